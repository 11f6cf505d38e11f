"""The cpu backend's first-call latency: numba compiles its kernels on first use and caches
them on disk (`cache=True`). Each row is a new process timing `import conv2d`, then the
first training step (forward + backward_full) and the second of one layer, with an empty
kernel cache ("cold": NUMBA_CACHE_DIR a new folder) and then with the cache the cold run
left ("warm"). PyTorch's first step of the same layer, in its own new process, is the
comparison.

    python scripts/cpu_first_call.py [--dtypes float32,float64] [--out DIR]

Prints a Markdown table; `--out DIR` writes it, with the provenance line, into that folder
(docs/cpu_first_call.md is `--out docs`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench_shapes import write_table

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
side, dtype = sys.argv[1], sys.argv[2]
if side == "ours":
    import numpy as np
    from conv2d import Conv2d, LayerSpec
    spec = LayerSpec(batch_size=32, in_height=16, in_width=16, in_channels=8, out_channels=16, kernel=3, padding=1,
                     activation="relu", normalization="batch_norm", dtype=dtype)
    layer = Conv2d(spec, "cpu", threads=1)
    layer.init_weights(np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((32, 16, 16, 8)).astype(dtype)
    def step():
        y = layer.forward(x, training=True)
        layer.backward_full(x, np.ones_like(y))
else:
    import torch
    torch.set_num_threads(1)
    tdt = getattr(torch, dtype)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU()).to(
        tdt, memory_format=torch.channels_last)
    x = torch.randn(32, 8, 16, 16, dtype=tdt).contiguous(memory_format=torch.channels_last).requires_grad_()
    def step():
        model(x).sum().backward()
t1 = time.perf_counter()
step()
t2 = time.perf_counter()
step()
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "first": t2 - t1, "second": t3 - t2}))
"""


def run(side: str, dtype: str, cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    done = subprocess.run([sys.executable, "-c", CHILD, side, dtype], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = ["| dtype | side | import s | first step s | second step ms |", "| --- | --- | ---: | ---: | ---: |"]
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory() as cache:
            rows = [("ours, cold cache", run("ours", dtype, cache)), ("ours, warm cache", run("ours", dtype, cache)),
                    ("PyTorch", run("torch", dtype, cache))]
        for side, t in rows:
            lines.append(f"| {dtype} | {side} | {t['import']:.2f} | {t['first']:.2f} | {1e3 * t['second']:.2f} |")
            print(lines[-1], flush=True)
    if args.out:
        write_table(args.out, "cpu_first_call.md", "The cpu backend's first call: compiling, and the on-disk cache",
                    lines, gpu=False)


if __name__ == "__main__":
    main()
