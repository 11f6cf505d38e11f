"""Compile every numba kernel the simulator-run tests launch to PTX for a GPU's
architecture, on a machine without a GPU.

numba's CUDA simulator runs a kernel as Python, so a kernel that numba cannot type or
lower passes every simulated test and fails on its first launch on a GPU. This script
makes the check the simulator cannot, without a GPU or a driver, in two steps (two
processes, since the simulator is chosen when numba is imported):

1. record: the tests run in the simulator with a hook on its kernel launch that notes,
   for each kernel launched, the factory that made it (`kernel_set`, `simple_set`,
   `adam_kernel`, `sgd_kernel`, `padding_kernels`, `depthwise_kernels`, `weight_partials_by_channel`,
   `fast_depthwise_kernels`),
   that factory's arguments, where in what it returned the
   kernel sits, and the numba types of the launch's arguments;
2. compile: without the simulator, each noted kernel is made again by its factory and
   compiled for each noted signature by `numba.cuda.compile_ptx` for `--cc`, with the
   launch bounds and fastmath it was declared with.

Step 2 needs NVVM and NVRTC of the CUDA major of cuda-bindings (for CUDA 13, the pip
wheels nvidia-nvvm and nvidia-cuda-nvrtc; `--libs DIR` names a folder holding
libnvvm.so and libnvrtc.so when they are not installed in the environment).

Usage: python scripts/compile_kernels.py [--cc 9.0] [--libs DIR] [-- pytest arguments]
Prints one row per kernel (signatures compiled, seconds, the first error), and exits 1 when
a kernel fails to compile or when no kernel was recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ["tests/test_cuda_kernels.py", "tests/test_cuda_simple.py", "tests/test_optim.py",
                 "tests/test_sequential.py", "-k", "cuda"]

# (module, attribute) of each kernel factory; what the tests and the backend call.
FACTORIES = {
    "kernel_set": ("conv2d.cuda.kernels.fast", "kernel_set"),
    "simple_set": ("conv2d.cuda.kernels.simple", "simple_set"),
    "adam_kernel": ("conv2d.cuda.optim", "adam_kernel"),
    "sgd_kernel": ("conv2d.cuda.optim", "sgd_kernel"),
    "padding_kernels": ("conv2d.cuda.kernels.padding", "padding_kernels"),
    "depthwise_kernels": ("conv2d.cuda.kernels.depthwise", "depthwise_kernels"),
    "weight_partials_by_channel": ("conv2d.cuda.kernels.depthwise", "weight_partials_by_channel"),
    "fast_depthwise_kernels": ("conv2d.cuda.kernels.depthwise", "fast_depthwise_kernels"),
}
# Other modules that bind a factory under its own name at import (patched alike).
ALIASES = {"kernel_set": ["conv2d.cuda.kernels"], "padding_kernels": ["conv2d.cuda.functional"],
           "depthwise_kernels": ["conv2d.cuda.depthwise"], "weight_partials_by_channel": ["conv2d.cuda.depthwise"],
           "fast_depthwise_kernels": ["conv2d.cuda.depthwise"]}


def _kernels_in(made, path=()):
    """(path, kernel) for each launchable kernel in what a factory returned: the object
    itself, a dataclass's fields, a dict's values, recursively."""
    if hasattr(made, "py_func") and not getattr(made, "_device", False):
        yield path, made
    elif dataclasses.is_dataclass(made):
        for f in dataclasses.fields(made):
            yield from _kernels_in(getattr(made, f.name), path + (f.name,))
    elif isinstance(made, dict):
        for k, v in made.items():
            yield from _kernels_in(v, path + (k,))
    elif isinstance(made, tuple):
        for i, v in enumerate(made):
            yield from _kernels_in(v, path + (i,))


def _resolve(made, path):
    for step in path:
        made = made[step] if isinstance(made, (dict, tuple)) else getattr(made, step)
    return made


class Recorder:
    """pytest plugin for step 1 (in the simulator): wraps the factories and numba's
    simulated launch before the test modules are imported, writes the notes at the end."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.origin = {}  # id(kernel) -> (factory name, arguments, path); kernels kept alive below
        self.keep = []
        self.signatures = {}  # (factory name, pickled arguments, path) -> set of argument-type tuples

    def pytest_configure(self, config) -> None:
        import importlib

        import numba
        from numba.cuda.simulator import kernel as simulated
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        for name, (module, attr) in FACTORIES.items():
            mod = importlib.import_module(module)
            wrapped = self._wrap(name, getattr(mod, attr))
            setattr(mod, attr, wrapped)
            for alias in ALIASES.get(name, []):
                setattr(importlib.import_module(alias), attr, wrapped)

        def typeof(a):
            if isinstance(a, FakeCUDAArray):
                a = a._ary
            return numba.typeof(a)

        launch = simulated.FakeCUDAKernel.__call__
        recorder = self

        def recording_call(kernel, *args):
            if not kernel._device and not simulated._kernel_context:
                origin = recorder.origin.get(id(kernel))
                if origin is not None:
                    recorder.signatures.setdefault(origin, set()).add(tuple(typeof(a) for a in args))
            return launch(kernel, *args)
        simulated.FakeCUDAKernel.__call__ = recording_call

    def _wrap(self, name, factory):
        signature = inspect.signature(factory)

        @functools.wraps(factory)
        def wrapper(*args, **kwargs):
            made = factory(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = pickle.dumps(dict(bound.arguments))
            for path, kernel in _kernels_in(made):
                self.origin[id(kernel)] = (name, arguments, path)
                self.keep.append(kernel)
            return made
        return wrapper

    def pytest_unconfigure(self, config) -> None:
        with open(self.out, "wb") as f:
            pickle.dump(self.signatures, f)


def record(out: str, pytest_args: list[str]) -> int:
    import pytest

    return pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[Recorder(out)])


def compile_all(notes: dict, cc: tuple[int, int]) -> int:
    import importlib

    from conv2d.cuda.runtime import numba_cuda

    cuda = numba_cuda()
    failed = 0
    print(f"{'factory':<12} {'arguments':<58} {'kernel':<28} {'sigs':>4} {'s':>6}  result")
    for (name, arguments, path), sigs in sorted(notes.items(), key=lambda kv: (kv[0][0], str(kv[0][2]),
                                                                                 kv[0][1])):
        module, attr = FACTORIES[name]
        args = pickle.loads(arguments)
        kernel = _resolve(getattr(importlib.import_module(module), attr)(**args), path)
        options = getattr(kernel, "targetoptions", {})
        t0, error = time.perf_counter(), ""
        for sig in sorted(sigs, key=str):
            try:
                cuda.compile_ptx(kernel.py_func, sig, cc=cc, fastmath=options.get("fastmath", False),
                                 launch_bounds=options.get("launch_bounds"))
            except Exception as e:  # noqa: BLE001 (every failure is reported, then counted)
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip().strip(":")]
                error = f"{type(e).__name__}: {' / '.join(lines[:3])[:240]}"
                break
        failed += bool(error)
        shown = ", ".join(f"{k}={getattr(v, 'name', v)}" for k, v in args.items() if k != "config")
        print(f"{name:<12} {shown[:58]:<58} {'.'.join(map(str, path)) or '-':<28} {len(sigs):>4} "
              f"{time.perf_counter() - t0:6.1f}  {error or 'ok'}", flush=True)
    print(f"compile_kernels: {len(notes)} kernels, {sum(map(len, notes.values()))} signatures, {failed} failed, "
          f"for sm_{cc[0]}{cc[1]}")
    return 1 if failed or not notes else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cc", default="9.0", help="compute capability to compile for (default 9.0, the H200)")
    parser.add_argument("--libs", help="a folder with libnvvm.so and libnvrtc.so (else: the environment's)")
    parser.add_argument("--record", help=argparse.SUPPRESS)  # step 1, in the child process
    parser.add_argument("--notes", help=argparse.SUPPRESS)  # step 2, in the child process
    parser.add_argument("pytest_args", nargs="*", help="the tests to record (default: the kernel, optimizer and "
                        "stack tests on the CUDA backend)")
    a = parser.parse_args()
    if a.record:
        return record(a.record, a.pytest_args or DEFAULT_TESTS)
    if a.notes:
        with open(a.notes, "rb") as f:
            notes = pickle.load(f)
        major, minor = (int(v) for v in a.cc.split("."))
        return compile_all(notes, (major, minor))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        notes = os.path.join(tmp, "notes.pickle")
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, __file__, "--record", notes, "--", *(a.pytest_args or DEFAULT_TESTS)],
                             cwd=ROOT, env={**env, "NUMBA_ENABLE_CUDASIM": "1"})
        print(f"compile_kernels: recorded in {time.perf_counter() - t0:.0f} s (pytest exit {rc})", flush=True)
        if rc not in (0, 5) or not os.path.exists(notes):
            print("compile_kernels: the recording run failed; nothing compiled", file=sys.stderr)
            return 1
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        if a.libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [a.libs, env.get("LD_LIBRARY_PATH")]))
        return subprocess.call([sys.executable, __file__, "--notes", notes, "--cc", a.cc], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
