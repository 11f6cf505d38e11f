"""The reference backend beside PyTorch on the CPU: forward(training) and a training step
(forward + backward_full) on the shapes of docs/bench_shapes.md, same threads, same dtype.

    python scripts/bench_reference.py [--shapes a,b] [--dtypes float32,bfloat16] [--repeats 5]

Prints a Markdown table of median wall times (ms) and the ratio ours / PyTorch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from bench_shapes import provenance, SHAPES, cases

from conv2d import Conv2d


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def ours(spec, x, dy, repeats):
    layer = Conv2d(spec, "reference")
    layer.init_weights(np.random.default_rng(0))
    fwd = median_ms(lambda: layer.forward(x, training=True), repeats)

    def step():
        layer.forward(x, training=True)
        layer.backward_full(x, dy)
    return fwd, median_ms(step, repeats)


def pytorch(spec, x, dy, repeats):
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.dtype.value]
    layers = [torch.nn.Conv2d(spec.in_channels, spec.out_channels, spec.kernel, spec.stride, spec.padding)]
    if spec.normalization.value == "batch_norm":
        layers.append(torch.nn.BatchNorm2d(spec.out_channels, eps=spec.bn_epsilon, momentum=spec.bn_momentum))
    layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(dtype=dt, memory_format=torch.channels_last).train()
    # NHWC memory viewed as NCHW channels_last: no copy.
    xt = torch.from_numpy(x.astype(np.float32)).to(dt).permute(0, 3, 1, 2).requires_grad_(True)
    dyt = torch.from_numpy(dy.astype(np.float32)).to(dt).permute(0, 3, 1, 2)

    def forward():
        # With autograd on, as ours keeps what backward needs.
        model(xt)

    def step():
        model.zero_grad(set_to_none=False)
        xt.grad = None
        model(xt).backward(dyt)
    return median_ms(forward, repeats), median_ms(step, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import torch
    from threadpoolctl import threadpool_info, threadpool_limits

    torch.set_num_threads(args.threads)
    with threadpool_limits(limits=args.threads):
        blas = ", ".join(f"{i['internal_api']} {i.get('architecture', '')} x{i['num_threads']}" for i in threadpool_info())
        print(f"# reference vs PyTorch {torch.__version__} on the CPU, {args.threads} threads; NumPy "
              f"{np.__version__} BLAS: {blas}; median of {args.repeats} after 2 warm-ups, wall ms\n")
        print(provenance(gpu=False) + "\n")
        print("| shape | norm | dtype | ours fwd | torch fwd | ratio | ours step | torch step | ratio |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, bn, spec, x, dy in cases(args.shapes, args.dtypes):
            of, os_ = ours(spec, x, dy, args.repeats)
            tf, ts = pytorch(spec, x, dy, args.repeats)
            print(f"| {name} | {'bn' if bn else '-'} | {spec.dtype.value} | {of:.2f} | {tf:.2f} | {of / tf:.2f} "
                  f"| {os_:.2f} | {ts:.2f} | {os_ / ts:.2f} |", flush=True)


if __name__ == "__main__":
    main()
