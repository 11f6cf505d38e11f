"""Where a whole network's eager training step spends its GPU time: the networks of
scripts/bench_networks.py, plain PyTorch and with the module swapped in, each step timed
(CUDA events, the median of --rounds rounds of --steps steps), then torch.profiler over
--steps more steps of each side: every kernel's duration, summed by kind per step.

    python scripts/network_kernel_profile.py [--networks nature_dqn,impala_cnn]
        [--precisions default,bfloat16] [--steps 20] [--rounds 3] [--top 6] [--launch] [--out DIR]

"busy" is the kernels' summed time, "step" the step's GPU time by events: where busy is
well below step, the GPU waits on the host (docs/network_host_profile_cuda.txt says on
what); where it is close, the kinds' rows are what the step costs. Kinds, by kernel
name: "convolution" (cuDNN's, PyTorch's and ours alike), "ours (numba)" (this
library's numba kernels: norm, bias gradient, activations, depthwise), "batch norm"
(PyTorch's), "matmul" (the Linear layers, and any kernel of cuDNN's named for a
matrix product without fprop/dgrad/wgrad in its name), "optimizer" (Adam's foreach kernels),
"memcpy/memset", and "other" (PyTorch's elementwise, pooling, reductions, the loss).
The module's call graphs (conv2d.torch.graphs) replay in the timed steps as in a
training loop; `--launch` turns them off (every call launches), for a profiler that does
not see the kernels of replayed graphs. `--out DIR` writes the tables into DIR, with the
provenance line.
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

import bench_networks as bn
from bench_shapes import write_table

import torch

KINDS = ("convolution", "ours (numba)", "batch norm", "matmul", "optimizer", "memcpy/memset", "other")
# numba's kernel names carry the module path: conv2d::cuda::kernels::... as the profiler
# demangles them (_ZN6conv2d4cuda... where it does not).
_OURS = re.compile(r"conv2d(::|\d)")


def kind(name: str) -> str:
    """The kind of a kernel, by its name (see the module docstring)."""
    n = name.lower()
    if _OURS.search(name):
        return "ours (numba)"
    if "batch_norm" in n or "batchnorm" in n or "bn_fw" in n or "bn_bw" in n:  # cudnn::bn_fw_tr_... too
        return "batch norm"
    if any(k in n for k in ("fprop", "dgrad", "wgrad", "conv", "implicit", "winograd", "cudnn", "depthwise")):
        return "convolution"
    if "gemm" in n or "gemv" in n or "cublas" in n or "cutlass" in n:
        return "matmul"
    if "multi_tensor" in n or "foreach" in n:
        return "optimizer"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    return "other"


def kernels_per_step(step, steps: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (us per step, launches per step)} over `steps` profiled steps."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()  # a kernel's (or copy's) own span on the GPU
        entry = out.setdefault(e.name, [0.0, 0.0])
        entry[0] += us / steps
        entry[1] += 1 / steps
    return {k: (v[0], v[1]) for k, v in out.items()}


def step_ms(step, steps: int, rounds: int) -> float:
    """The step's GPU time by CUDA events, the median of `rounds` rounds of `steps` steps."""
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def prepared(name: str, precision: str, launch: bool) -> dict:
    """{"torch": step, "ours": step}: the network's eager training step, warmed up."""
    dtype, x, target = bn.row_inputs(name, "train", precision, "cuda")
    steps = {}
    for side, model in zip(("torch", "ours"), bn.models(name, "cuda", dtype)):
        if launch:
            for m in model.modules():
                if hasattr(m, "cuda_graphs"):
                    m.cuda_graphs = False
        steps[side] = bn.training_step(model, "eager", x, target)
        for _ in range(10):
            steps[side]()
    torch.cuda.synchronize()
    return steps


def network_rows(name: str, precision: str, args) -> tuple[list[list[str]], list[list[str]]]:
    """(the kinds' rows, the largest kernels' rows) of one network at one precision."""
    steps = prepared(name, precision, args.launch)
    timed = {side: step_ms(steps[side], args.steps, args.rounds) for side in ("torch", "ours")}
    kernels = {side: kernels_per_step(steps[side], args.steps) for side in ("torch", "ours")}
    by_kind = {side: {k: [0.0, 0.0] for k in KINDS} for side in kernels}
    for side, found in kernels.items():
        for kname, (us, calls) in found.items():
            by_kind[side][kind(kname)][0] += us
            by_kind[side][kind(kname)][1] += calls
    busy = {side: sum(v[0] for v in by_kind[side].values()) for side in kernels}
    rows = [[name, precision, "step (GPU, events)", f"{timed['torch'] * 1e3:.0f}", "",
             f"{timed['ours'] * 1e3:.0f}", "", f"{timed['ours'] / timed['torch']:.2f}"],
            [name, precision, "busy (kernels' sum)", f"{busy['torch']:.0f}", "", f"{busy['ours']:.0f}", "",
             f"{busy['ours'] / busy['torch']:.2f}" if busy["torch"] else "-"]]
    for k in KINDS:
        t, o = by_kind["torch"][k], by_kind["ours"][k]
        if t[0] == 0 and o[0] == 0:
            continue
        rows.append([name, precision, k, f"{t[0]:.0f}", f"{t[1]:.0f}", f"{o[0]:.0f}", f"{o[1]:.0f}",
                     f"{o[0] / t[0]:.2f}" if t[0] else "-"])
    top = []
    for side in ("torch", "ours"):
        for kname, (us, calls) in sorted(kernels[side].items(), key=lambda kv: -kv[1][0])[:args.top]:
            short = kname if len(kname) <= 90 else kname[:87] + "..."
            top.append([name, precision, side, kind(kname), short.replace("|", "\\|"), f"{us:.0f}", f"{calls:.0f}"])
    return rows, top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--networks", default="nature_dqn,impala_cnn,mobilenet_v2,cifar_resnet")
    ap.add_argument("--precisions", default="default,bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=6, help="the largest kernels listed a side")
    ap.add_argument("--launch", action="store_true", help="our modules' call graphs off: every call launches")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("network_kernel_profile: needs a CUDA GPU (torch.cuda.is_available() is False)")
    rows, top = [], []
    for name in args.networks.split(","):
        for precision in args.precisions.split(","):
            r, t = network_rows(name, precision, args)
            rows += r
            top += t
            for line in r:
                print(" | ".join(line), flush=True)
    lines = []
    for title, head, body in (
            ("Eager training step: GPU time per step by kind of kernel (us), and launches per step",
             ["network", "precision", "kind", "torch us", "torch launches", "ours us", "ours launches",
              "ours / torch"], rows),
            (f"The {args.top} largest kernels of each side (us per step)",
             ["network", "precision", "side", "kind", "kernel", "us", "launches"], top)):
        lines += [f"## {title}", "", "| " + " | ".join(head) + " |",
                  "| " + " | ".join("---" if i < 3 else "---:" for i in range(len(head))) + " |"]
        lines += ["| " + " | ".join(r) + " |" for r in body] + [""]
    if args.out:
        write_table(args.out, "network_kernels_cuda.md", "conv2d: where the networks' training steps spend GPU "
                    "time, ours vs PyTorch", lines, True, "Per step, averaged over the profiled steps; "
                    "scripts/network_kernel_profile.py's docstring says how.")


if __name__ == "__main__":
    main()
