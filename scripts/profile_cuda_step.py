"""Where the host time of one eager CUDA training step goes: cProfile over repeated
forward(training) + backward_full on device arrays (with --module: the PyTorch module's
forward and backward on channels_last tensors), the top entries by own time.

    python scripts/profile_cuda_step.py [--shape tiny_latency] [--bn] [--dtype float32] [--steps 200] [--module]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import inputs, one_spec_arguments, spec_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    one_spec_arguments(ap)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--module", action="store_true", help="conv2d.torch.Conv2dNormActivation in a PyTorch step")
    ap.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumulative)")
    args = ap.parse_args()

    spec = spec_of(args)
    steps = module_steps(spec) if args.module else layer_steps(spec)
    steps(5)
    t0 = time.perf_counter()
    steps(args.steps)
    per_step = (time.perf_counter() - t0) / args.steps * 1e6
    what = "module" if args.module else "layer"
    print(f"{what} {args.shape} {'bn' if args.bn else '-'} {args.dtype}: {per_step:.0f} us wall per step")
    profile = cProfile.Profile()
    profile.enable()
    steps(args.steps)
    profile.disable()
    pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)


def layer_steps(spec):
    from conv2d import Conv2d
    from conv2d.cuda.runtime import to_device_bits

    layer = Conv2d(spec, "cuda")
    layer.init_weights(np.random.default_rng(0))
    cuda, stream = layer.functions.cuda, layer.functions.stream
    x_host, dy_host = inputs(spec)
    x, dy = cuda.to_device(to_device_bits(x_host)), cuda.to_device(to_device_bits(dy_host))

    def steps(n):
        for _ in range(n):
            layer.forward(x, training=True)
            layer.backward_full(x, dy)
        stream.synchronize()
    return steps


def module_steps(spec):
    import torch

    from bench_cuda import our_module, torch_nchw

    model = our_module(spec, cuda_graphs=False)  # the launches, the pieces a replay would hide
    x_host, dy_host = inputs(spec)
    x = torch_nchw(x_host, spec).requires_grad_(True)
    dy = torch_nchw(dy_host, spec)

    def steps(n):
        for _ in range(n):
            x.grad = None
            model(x).backward(dy)
        torch.cuda.synchronize()
    return steps


if __name__ == "__main__":
    main()
