"""How many threads the CPU backend's calls use, and which threads run them.

The rule: the backend's work is split into tasks fixed by the shapes (chunks of rows,
blocks of samples), shared by a team of threads in contiguous ranges
(conv2d.cpu.kernels.run_tasks); BLAS runs one thread inside each task (set once for the
process with threadpoolctl: BLAS's own pool spins between calls and took the cores from
ours). How many threads: `threads=None` (the default of `Conv2d(spec, "cpu")`): numba's
configured count (`NUMBA_NUM_THREADS`: the cores, unless set); an int: that many;
"torch" (what conv2d.torch's module passes): `torch.get_num_threads()` at each call, so
that a PyTorch caller's setting is ours too and never more. The results are the same bits
whatever the count: the tasks and the order their partial sums are added in do not
depend on it.

Which threads: with "torch", PyTorch's own OpenMP team, where PyTorch's OpenMP is GNU
libgomp (Linux wheels): the tasks run inside one `GOMP_parallel` region of the libgomp
that PyTorch loaded, on the threads PyTorch's ops run on. A pool of our own beside them
shared the cores with PyTorch's workers, which spin for a while after each of its ops:
on 2 cores a network's step at two threads ran slower than at one
(docs/bench_networks_cpu.md at commit 9c2a7b3). Otherwise, and for None or an int, a pool
of Python threads (`concurrent.futures`), the calling thread taking the first range.
`GOMP_parallel` is libgomp's ABI entry point for a parallel region (what GCC emits for
`#pragma omp parallel`), reached through ctypes: this module is the one place that does.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import os
from typing import Any, Callable

_BLAS_SET: list[int | None] = [None]  # the count this module last gave BLAS (threadpoolctl is slow to ask)
_COUNT: list[int | None] = [None]  # the compiled loops' count, for the call that runs now
_TORCH_TEAM: list[bool] = [False]  # whether the call that runs now runs on PyTorch's OpenMP team
_POOL: list = [None, 0]  # the ThreadPoolExecutor and its size
_OPENMP: list = []  # [the libgomp entry points] once looked for ([None] where there are none)
_JOBS: dict[int, tuple] = {}  # a parallel region's key -> (kernel, bounds, args, errors)
_KEYS = itertools.count()


def check(threads: Any) -> int | str | None:
    """`threads` after checking it: None, "torch", or an int >= 1."""
    if threads is None or threads == "torch":
        return threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected None, 'torch' or an int >= 1, got {threads!r}")
    return threads


def count() -> int:
    """The compiled loops' thread count now (`use`'s, else numba's configured count)."""
    if _COUNT[0] is None:
        import numba

        return numba.config.NUMBA_NUM_THREADS
    return _COUNT[0]


def use(threads: int | str | None) -> None:
    """Set the count the next calls' tasks run on (`check`'s values: None, numba's
    configured count; "torch", `torch.get_num_threads()` now, on PyTorch's team; an
    int), and BLAS to one thread (once: the process's setting, checked by threadpoolctl)."""
    _TORCH_TEAM[0] = threads == "torch"
    if threads == "torch":
        import torch

        threads = torch.get_num_threads()
    _COUNT[0] = threads
    if _BLAS_SET[0] != 1:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1, user_api="blas")
        _BLAS_SET[0] = 1


def run(kernel: Callable, tasks: int, count: int, args: tuple) -> None:
    """kernel(first, end, *args) over tasks [0, tasks) in `count` contiguous ranges at
    once: on PyTorch's OpenMP team where `use("torch")` asked for it and there is one,
    else on the pool."""
    bounds = [tasks * i // count for i in range(count + 1)]
    team = openmp() if _TORCH_TEAM[0] else None
    if team is None:
        _on_pool(kernel, bounds, args)
        return
    key = next(_KEYS)
    errors: list[BaseException] = []
    _JOBS[key] = (kernel, bounds, args, errors)
    try:
        team[0](team[3], key, count, 0)  # GOMP_parallel(fn, data, num_threads, flags)
    finally:
        del _JOBS[key]
    if errors:
        raise errors[0]


def _on_pool(kernel: Callable, bounds: list[int], args: tuple) -> None:
    count = len(bounds) - 1
    if _POOL[1] < count - 1:
        if _POOL[0] is not None:
            _POOL[0].shutdown(wait=True)
        _POOL[0], _POOL[1] = concurrent.futures.ThreadPoolExecutor(count - 1, "conv2d-cpu"), count - 1
    done = [_POOL[0].submit(kernel, bounds[i], bounds[i + 1], *args) for i in range(1, count)]
    kernel(bounds[0], bounds[1], *args)
    for d in done:
        d.result()


def _region(key: int) -> None:
    """The body each thread of the team runs: its ranges of the job (all of them where a
    nested region gave a team of one)."""
    gomp = _OPENMP[0]
    kernel, bounds, args, errors = _JOBS[key]
    size, me = gomp[2](), gomp[1]()
    try:
        for r in range(me, len(bounds) - 1, size):
            kernel(bounds[r], bounds[r + 1], *args)
    except BaseException as e:  # ctypes would print and drop it; `run` raises it
        errors.append(e)


def openmp() -> tuple | None:
    """(GOMP_parallel, omp_get_thread_num, omp_get_num_threads, the region's C callback)
    of the GNU libgomp that PyTorch loaded, or None (no PyTorch, another OpenMP runtime,
    or none), looked for once."""
    if not _OPENMP:
        _OPENMP.append(_find_libgomp())
    return _OPENMP[0]


def _find_libgomp() -> tuple | None:
    import torch
    from threadpoolctl import threadpool_info

    torch.get_num_threads()  # PyTorch's OpenMP runtime is loaded with it
    here = os.path.dirname(os.path.realpath(torch.__file__))
    found = [i["filepath"] for i in threadpool_info() if i.get("internal_api") == "openmp"
             and i.get("prefix") == "libgomp"]
    ours = [p for p in found if os.path.realpath(p).startswith(here)] or found
    if len(ours) != 1:  # none, or several runtimes with no way to say which is PyTorch's
        return None
    lib = ctypes.CDLL(ours[0])
    region_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    parallel = lib.GOMP_parallel
    parallel.argtypes = [region_type, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    thread_num, num_threads = lib.omp_get_thread_num, lib.omp_get_num_threads
    thread_num.restype = num_threads.restype = ctypes.c_int
    return parallel, thread_num, num_threads, region_type(lambda key: _region(key or 0))
