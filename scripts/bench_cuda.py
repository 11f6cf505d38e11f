"""The CUDA backend beside PyTorch on the GPU: a training step (forward(training) +
backward_full) on the shapes of shared/BENCH.md, eager, in one process.

    python scripts/bench_cuda.py [--shapes a,b] [--dtypes float32,bfloat16] [--iters 20] [--out table.md]

PyTorch runs nn.Conv2d (+ nn.BatchNorm2d) + nn.ReLU in channels_last with
cudnn.deterministic = True and TF32 off, as ours. GPU time: CUDA events around `iters`
steps on each side's stream; wall time: perf_counter around the same steps plus a final
synchronize; each the median of 5 such blocks after a warm-up, per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import SHAPES, cases  # noqa: E402


def timed(run, record_start, record_end, elapsed_ms, sync, iters: int, blocks: int = 5):
    run()
    sync()
    gpu, wall = [], []
    for _ in range(blocks):
        start, end = record_start(), None
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        end = record_end()
        sync()
        wall.append((time.perf_counter() - t0) * 1e3 / iters)
        gpu.append(elapsed_ms(start, end) / iters)
    return statistics.median(gpu), statistics.median(wall)


def ours(spec, x_host, dy_host, iters):
    from conv2d import Conv2d
    from conv2d.cuda.runtime import to_device_bits

    layer = Conv2d(spec, "cuda")
    layer.init_weights(np.random.default_rng(0))
    impl = layer._impl
    cuda, stream = impl.cuda, impl.stream
    x = cuda.to_device(to_device_bits(x_host), stream=stream)
    dy = cuda.to_device(to_device_bits(dy_host), stream=stream)

    def run():
        layer.forward(x, training=True)
        layer.backward_full(x, dy)

    def record():
        e = cuda.event()
        e.record(stream)
        return e
    return timed(run, record, record, lambda a, b: cuda.event_elapsed_time(a, b), stream.synchronize, iters)


def pytorch(spec, x_host, dy_host, iters):
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.dtype.value]
    layers = [torch.nn.Conv2d(spec.in_channels, spec.out_channels, spec.kernel, spec.stride, spec.padding)]
    if spec.normalization.value == "batch_norm":
        layers.append(torch.nn.BatchNorm2d(spec.out_channels, eps=spec.bn_epsilon, momentum=spec.bn_momentum))
    layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).cuda().to(dtype=dt, memory_format=torch.channels_last).train()
    x = torch.from_numpy(x_host.astype(np.float32)).cuda().to(dt).permute(0, 3, 1, 2).requires_grad_(True)
    dy = torch.from_numpy(dy_host.astype(np.float32)).cuda().to(dt).permute(0, 3, 1, 2)

    def run():
        x.grad = None
        model(x).backward(dy)  # parameter grads accumulate, as ours

    def record():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return timed(run, record, record, lambda a, b: a.elapsed_time(b), torch.cuda.synchronize, iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch


    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    lines = [f"# conv2d CUDA backend vs PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: "
             f"training step, eager, median ms per step",
             "",
             "| shape | norm | dtype | ours GPU | torch GPU | ratio | ours wall | torch wall | ratio |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    print("\n".join(lines), flush=True)
    for name, bn, spec, x, dy in cases(args.shapes, args.dtypes):
        og, ow = ours(spec, x, dy, args.iters)
        tg, tw = pytorch(spec, x, dy, args.iters)
        line = (f"| {name} | {'bn' if bn else '-'} | {spec.dtype.value} | {og:.3f} | {tg:.3f} | {og / tg:.2f} "
                f"| {ow:.3f} | {tw:.3f} | {ow / tw:.2f} |")
        lines.append(line)
        print(line, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
