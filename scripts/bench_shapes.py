"""The benchmark layers of docs/bench_shapes.md, shared by the benchmark scripts."""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Iterator

import numpy as np

from conv2d.dtypes import storage_dtype
from conv2d.spec import LayerSpec

# name -> (N, H, W, C, OC, K, S, P)
SHAPES = {
    "tiny_latency": (1, 16, 16, 3, 8, 3, 1, 1),
    "rl_dqn_l1": (256, 84, 84, 4, 32, 8, 4, 0),
    "rl_small": (64, 32, 32, 16, 32, 3, 1, 1),
    "resnet_56": (128, 56, 56, 64, 64, 3, 1, 1),
    "resnet_28": (256, 28, 28, 128, 128, 3, 1, 1),
    # PyTorch's options (BENCH.md's "More layer shapes"): MobileNetV2's depthwise and
    # pointwise layers, a dilated one.
    "mbv2_depthwise": (128, 56, 56, 144, 144, 3, 1, 1),
    "mbv2_pointwise": (128, 56, 56, 144, 24, 1, 1, 0),
    "dilated": (16, 64, 64, 256, 256, 3, 1, 2),
}
# name -> LayerSpec options beyond SHAPES' columns
OPTIONS = {"mbv2_depthwise": {"groups": 144}, "dilated": {"dilation": 2}}


def bench_spec(name: str, batch_norm: bool, dtype: str, batch_size: int | None = None) -> LayerSpec:
    n, h, w, c, oc, k, s, p = SHAPES[name]
    return LayerSpec(batch_size=batch_size or n, in_height=h, in_width=w, in_channels=c, out_channels=oc,
                     kernel=k, stride=s, padding=p, activation="relu",
                     normalization="batch_norm" if batch_norm else "none", dtype=dtype, **OPTIONS.get(name, {}))


def flops(spec: LayerSpec) -> dict[str, float]:
    """Multiply-adds x 2 of the three convolutions of a step."""
    kh, kw = spec.kernel
    conv = (2.0 * spec.batch_size * spec.out_height * spec.out_width * spec.out_channels * kh * kw
            * (spec.in_channels // spec.groups))
    return {"forward": conv, "step": 3 * conv}


def cases(shapes: str, dtypes: str) -> Iterator[tuple[str, bool, LayerSpec, np.ndarray, np.ndarray]]:
    """(name, batch_norm, spec, x, d_y) for every shape, norm setting and dtype asked for,
    with the same seeded Gaussian x and d_y for both sides of a comparison."""
    for name in shapes.split(","):
        for bn in (False, True):
            for dtype in dtypes.split(","):
                spec = bench_spec(name, bn, dtype)
                yield (name, bn, spec, *inputs(spec))


def inputs(spec: LayerSpec) -> tuple[np.ndarray, np.ndarray]:
    """Seeded Gaussian x (N, H, W, C) and d_y (N, OH, OW, OC) in the spec's storage dtype."""
    rng = np.random.default_rng(1)
    st = storage_dtype(spec.dtype)
    x = rng.standard_normal(spec.input_shape, dtype=np.float32).astype(st)
    dy = rng.standard_normal(spec.output_shape, dtype=np.float32).astype(st)
    return x, dy


def per_call_us(run, n: int, sync) -> float:
    """Microseconds a call of `run()` over `n` calls, `sync()` (the GPU's, or nothing)
    before and after: a host-bound call shows its host time."""
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    sync()
    return (time.perf_counter() - t0) * 1e6 / n


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def provenance(gpu: bool) -> str:
    """Where a table comes from, as one Markdown paragraph: the command, the commit
    ($CONV2D_COMMIT where set, else git's), the date, the machine and the library versions.
    The device tool's copy of a working tree keeps an older .git (its git named a commit
    hours old "with uncommitted changes"): a command run there passes the commit it was
    sent from in $CONV2D_COMMIT."""
    root = Path(__file__).resolve().parent.parent
    commit = os.environ.get("CONV2D_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                    text=True, check=True).stdout.strip()
            if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                              capture_output=True, text=True).stdout.strip():
                commit += " with uncommitted changes"
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    import numpy
    import torch

    command = " ".join(["python3", f"scripts/{Path(sys.argv[0]).name}", *map(shlex.quote, sys.argv[1:])])
    parts = [f"Made by `{command}`",
             f"commit {commit}", datetime.date.today().isoformat()]
    if gpu:
        import numba

        free, total = torch.cuda.mem_get_info()
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip() or "-"
        parts += [f"{torch.cuda.get_device_name()} ({total / 2**30:.0f} GiB), driver {driver}",
                  f"PyTorch {torch.__version__} (cuDNN {torch.backends.cudnn.version()})",
                  f"numba {numba.__version__}, numba-cuda {_version('numba-cuda')}",
                  f"nvidia-cudnn-frontend {_version('nvidia-cudnn-frontend')}", f"NumPy {numpy.__version__}"]
    else:
        parts += [f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                  f"PyTorch {torch.__version__}", f"NumPy {numpy.__version__}", _blas()]
    return "; ".join(parts) + "."


def provenance_key(line: str) -> str:
    """A provenance line without its command and date: the commit, the machine and the
    versions, which the runs of one table resumed across processes must share."""
    return re.sub(r"; \d{4}-\d\d-\d\d;", ";", re.sub(r"^Made by `[^`]*`; ", "", line))


def _blas() -> str:
    """NumPy's BLAS and the kernel set it runs (they set the cpu backend's products), with
    OPENBLAS_CORETYPE where the environment forces one (some machines force an older set,
    which slows the products)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "NumPy's BLAS unknown"
    found = [i for i in threadpool_info() if i.get("user_api") == "blas" and "numpy" in (i.get("filepath") or "")]
    if not found:
        return "NumPy's BLAS unknown"
    chosen = os.environ.get("OPENBLAS_CORETYPE")
    return (f"NumPy's BLAS {found[0].get('internal_api')} {found[0].get('version')} "
            f"({found[0].get('architecture')} kernels" + (f", OPENBLAS_CORETYPE={chosen}" if chosen else "") + ")")


def write_table(out: str | os.PathLike, name: str, title: str, lines: list[str], gpu: bool,
                intro: str | None = None, say: bool = True, made: str | None = None) -> Path:
    """Write a table file `out`/`name`: "# title", `intro` (a paragraph saying how to read
    it) if any, the `provenance` line (`made`, where the caller has it already) and the
    table's `lines`; says where (if `say`), returns the path."""
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)  # a folder of its own, as on the GPU machine's $OUT
    head = [f"# {title}", ""] + ([intro, ""] if intro else [])
    path.write_text("\n".join([*head, made or provenance(gpu), "", *lines, ""]))
    if say:
        print(f"wrote {path}")
    return path
