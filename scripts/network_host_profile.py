"""Where a whole network's eager step spends its host time: the networks of
scripts/bench_networks.py, plain PyTorch and with the module swapped in, each step timed
(wall and CUDA events), then cProfile over ours and over PyTorch's, each function's own
time (tottime) per step in microseconds, the largest first.

    python scripts/network_host_profile.py [--networks nature_dqn,impala_cnn] [--rows train,act]
        [--precision default|strict|bfloat16] [--steps 200] [--top 25] [--no-runs]

A step whose wall time is well above its GPU time is host-bound: there, the profile's rows
are what to cut (the profiler's overhead inflates every row alike: compare rows, not
totals). Rows and precisions are bench_networks' (its `training_step`, `acting_step`).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import bench_networks as bn

import torch


def prepared(name: str, row: str, precision: str, runs: bool) -> dict:
    """{"torch": step, "ours": step} for `row` of network `name`, warmed up."""
    dtype, x, target = bn.row_inputs(name, row, precision, "cuda")
    timer = bn.Timer("cuda")
    steps = {}
    for side, model in zip(("torch", "ours"), bn.models(name, "cuda", dtype, runs=runs)):
        steps[side] = (bn.training_step(model, "eager", x, target) if row == "train"
                       else bn.acting_step(model, "eager", x, timer))
        for _ in range(10):
            steps[side]()
    torch.cuda.synchronize()
    return steps


def profile_rows(step, steps: int, top: int) -> list[str]:
    """The `top` functions by own time per step of `steps` calls of `step`."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():
        rows.append((tottime, calls, cumtime, f"{Path(path).parent.name}/{Path(path).name}:{line}:{func}"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    out = [f"  profiled: {total * 1e6 / steps:.1f} us/step in all"]
    for tottime, calls, cumtime, where in rows[:top]:
        out.append(f"  {tottime * 1e6 / steps:8.1f} us own {cumtime * 1e6 / steps:8.1f} us cum "
                   f"{calls / steps:6.1f} calls  {where}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--networks", default="nature_dqn,impala_cnn,mobilenet_v2,cifar_resnet")
    ap.add_argument("--rows", default="train,act")
    ap.add_argument("--precision", default="default", choices=bn.PRECISIONS)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-runs", action="store_true", help="swap with runs=False")
    args = ap.parse_args()
    timer = bn.Timer("cuda")
    for name in args.networks.split(","):
        for row in args.rows.split(","):
            steps = prepared(name, row, args.precision, not args.no_runs)
            times = {side: sorted(timer(step, args.steps // 4) for _ in range(3))[1] for side, step in steps.items()}
            print(f"== {name} {row} {args.precision}: " + ", ".join(
                f"{side} {gpu:.3f} GPU ms {wall:.3f} wall ms" for side, (gpu, wall) in times.items()), flush=True)
            for side in ("ours", "torch"):
                t0 = time.perf_counter()
                lines = profile_rows(steps[side], args.steps, args.top)
                print(f" {side} (profiled wall {(time.perf_counter() - t0) * 1e3 / args.steps:.3f} ms/step)")
                print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
