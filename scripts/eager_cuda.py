"""Eager wall time of a CUDA training step, for comparing two versions of conv2d on one
machine: forward(training) + backward_full on numba device arrays, 30 steps a block,
median of 7 blocks, ms per step; the same timing as bench_cuda.py's eager columns.

    PYTHONPATH=<a checkout's root> python scripts/eager_cuda.py TAG [--shapes a,b]

Put another commit's package first on PYTHONPATH (for example `git archive COMMIT conv2d
| tar -x -C /tmp/old`) to time that version; it uses only the public layer API, which
both sides of such a comparison share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import SHAPES, bench_spec, inputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tag", help="a name for the version timed, printed on each line")
    ap.add_argument("--shapes", default="tiny_latency,rl_small,rl_dqn_l1")
    args = ap.parse_args()

    from conv2d import Conv2d
    from conv2d.cuda.runtime import numba_cuda, to_device_bits

    cuda = numba_cuda()
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown {name!r}; known are {sorted(SHAPES)}")
        for bn in (False, True):
            for dtype in ("float32", "bfloat16"):
                spec = bench_spec(name, bn, dtype)
                layer = Conv2d(spec, "cuda")
                layer.init_weights(np.random.default_rng(0))
                x_host, dy_host = inputs(spec)
                x, dy = cuda.to_device(to_device_bits(x_host)), cuda.to_device(to_device_bits(dy_host))

                def step():
                    layer.forward(x, training=True)
                    layer.backward_full(x, dy)

                for _ in range(5):
                    step()
                cuda.synchronize()
                walls = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    for _ in range(30):
                        step()
                    cuda.synchronize()
                    walls.append((time.perf_counter() - t0) / 30 * 1e3)
                print(f"{args.tag} | {name} | {'bn' if bn else '-'} | {dtype} | {statistics.median(walls):.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
