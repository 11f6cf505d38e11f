"""cuDNN's engine heuristics side by side: for every shape and dtype of shared/BENCH.md
(batch norm on; the convolutions do not depend on it), the plans each heuristic mode
picks for forward, backward-data and backward-filter, the time to build them, and the
GPU time of the captured training step with them.

    python scripts/heuristics_cuda.py [--modes A,B] [--shapes a,b] [--dtypes float32,bfloat16] [--iters 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cuda import ours  # noqa: E402
from bench_shapes import SHAPES, bench_spec, inputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="A,B", help="comma list of cudnn.heur_mode names, each then FALLBACK")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()

    from conv2d import Conv2d
    from conv2d.cuda import cudnn

    chosen = dict(cudnn.HEUR_MODES)

    print("| shape | dtype | mode | graph GPU ms | build s | forward | backward_data | backward_filter |")
    print("| --- | --- | --- | ---: | ---: | --- | --- | --- |")
    for name in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            spec = bench_spec(name, True, dtype)
            x, dy = inputs(spec)
            for mode in args.modes.split(","):
                cudnn.HEUR_MODES = {**cudnn.HEUR_MODES, spec.dtype: (mode, "FALLBACK")}
                cudnn._CACHE.clear()  # built again under this mode
                t = time.perf_counter()
                plans = Conv2d(spec, "cuda").functions.conv_plans
                build = time.perf_counter() - t
                ms = ours(spec, x, dy, args.iters, eager=False)["graph"][0]
                print(f"| {name} | {dtype} | {mode} | {ms:.3f} | {build:.2f} | {plans['forward']} "
                      f"| {plans['backward_data']} | {plans['backward_filter']} |", flush=True)
            cudnn.HEUR_MODES = chosen
            cudnn._CACHE.clear()


if __name__ == "__main__":
    main()
