"""Where the host time of the PyTorch module's eager step goes: each layer of the call,
timed alone (perf_counter over many calls, the GPU drained before and after), from
wrapping one tensor for numba up to the whole forward and backward.

    python scripts/probe_module.py [--shape tiny_latency] [--bn] [--dtype float32] [--n 300] [--profile]

Prints one line per piece: microseconds of host time per call; `--profile` then prints
cProfile's top functions of the module's step (with autograd's thread from Python 3.12
on), by own and by cumulative time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import inputs, one_spec_arguments, spec_of  # noqa: E402
from probe_cuda import host_us  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    one_spec_arguments(ap)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="cProfile the module's step on both threads")
    args = ap.parse_args()

    import torch

    from bench_cuda import our_module, torch_dtype, torch_nchw
    from conv2d.cuda.runtime import device_view

    spec = spec_of(args)
    model = our_module(spec, cuda_graphs=False)  # the launches, the pieces a replay would hide
    x_host, dy_host = inputs(spec)
    x = torch_nchw(x_host, spec).requires_grad_(True)
    dy = torch_nchw(dy_host, spec)
    model(x).backward(dy)
    fn, _ = next(iter(model._functions.values()))  # (the eager path's functions, their CallGraphs)
    op_key = model._op_key
    cuda = fn.cuda
    sync = torch.cuda.synchronize
    nhwc = x.detach().permute(0, 2, 3, 1)
    w = model.conv.weight.detach().permute(0, 2, 3, 1)
    params = {"weights": w}
    if model.conv.bias is not None:
        params["bias"] = model.conv.bias.detach()
    if model.norm is not None:
        params["gamma"], params["beta"] = model.norm.weight.detach(), model.norm.bias.detach()
    call = spec.at(*nhwc.shape[:3])
    groups = spec.out_channels
    saved_out = {"pre": torch.empty(call.output_shape, dtype=nhwc.dtype, device="cuda"),
                 "mean": torch.empty(groups, dtype=torch.float32, device="cuda"),
                 "inv_std": torch.empty(groups, dtype=torch.float32, device="cuda")}
    d_y = dy.permute(0, 2, 3, 1).contiguous()

    rows = []

    def row(name, f, n=args.n):
        try:
            us = host_us(f, sync, n)
        except Exception as e:  # a piece that fails is reported, the others still measured
            print(f"{name:58s} failed: {type(e).__name__}: {e}", flush=True)
            return
        rows.append((name, us))
        print(f"{name:58s} {us:9.1f} us", flush=True)

    row("torch.empty (one output)", lambda: torch.empty(call.output_shape, dtype=nhwc.dtype, device="cuda"))
    row("device_view of a torch tensor (x)", lambda: device_view(cuda, "x", nhwc, spec.dtype))
    iface = nhwc.__cuda_array_interface__
    row("numba from_cuda_array_interface (x)", lambda: cuda.from_cuda_array_interface(iface, owner=nhwc, sync=False))
    row("numba current_context()", cuda.current_context)
    row("Functions.forward (saved_out given)", lambda: fn.forward(params, nhwc, True, None, saved_out=saved_out))
    saved = fn.saved(nhwc, saved_out["pre"], saved_out["mean"], saved_out["inv_std"], True)
    row("Functions.saved", lambda: fn.saved(nhwc, saved_out["pre"], saved_out["mean"], saved_out["inv_std"], True))
    row("Functions.backward (params and input)", lambda: fn.backward(params, saved, d_y, True, True))
    with torch.no_grad():
        row("torch.ops.conv2d.forward, no_grad",
            lambda: torch.ops.conv2d.forward(nhwc, model.conv.weight.detach(), params.get("bias"),
                                             params.get("gamma"), params.get("beta"), None, None, True, False, op_key))
        row("module forward, no_grad", lambda: model(x))
    row("module forward, grad", lambda: model(x))

    def step():
        x.grad = None
        model(x).backward(dy)
    row("module forward + backward", step)
    with torch.autograd.set_multithreading_enabled(False):
        row("module forward + backward, autograd on the calling thread", step)
    inside = _TimedBackward()
    with inside:
        row("module forward + backward (EagerConv2d.backward timed)", step)
    print(f"{'  of which inside EagerConv2d.backward':58s} {inside.us_per_call():9.1f} us", flush=True)

    # autograd runs the backward of CUDA tensors on its own thread for the device: the
    # same work, timed there, against the main thread's rows above.
    on_engine = _EngineProbe(x)
    row("autograd backward, empty (engine's thread)", lambda: on_engine.run(lambda: None))
    row("Functions.saved + backward on the engine's thread",
        lambda: on_engine.run(lambda: fn.backward(params, fn.saved(nhwc, saved_out["pre"], saved_out["mean"],
                                                                     saved_out["inv_std"], True), d_y, True, True)))
    row("numba current_context() on the engine's thread", lambda: on_engine.run(cuda.current_context))
    seq = torch.nn.Sequential(torch.nn.Conv2d(spec.in_channels, spec.out_channels, spec.kernel, spec.stride,
                                              spec.padding), torch.nn.BatchNorm2d(spec.out_channels),
                              torch.nn.ReLU()).to("cuda", torch_dtype(spec)).to(memory_format=torch.channels_last)

    def torch_step():
        x.grad = None
        seq(x).backward(dy)
    row("PyTorch Sequential forward + backward", torch_step)
    if args.profile:
        _profile(step, args.n)


class _TimedBackward:
    """Within `with`: EagerConv2d.backward (the module's eager node) wrapped to time each
    call where it runs."""

    def __enter__(self):
        import time

        from conv2d.torch.eager import EagerConv2d

        self.total, self.calls, self.cls = 0.0, 0, EagerConv2d
        self.original = EagerConv2d.__dict__["backward"]
        inner = self.original.__func__

        def timed(ctx, d_y):
            t = time.perf_counter()
            out = inner(ctx, d_y)
            self.total += time.perf_counter() - t
            self.calls += 1
            return out
        EagerConv2d.backward = staticmethod(timed)
        return self

    def __exit__(self, *exc):
        self.cls.backward = self.original

    def us_per_call(self) -> float:
        return self.total / max(self.calls, 1) * 1e6


def _profile(step, n: int) -> None:
    """cProfile of n steps. From Python 3.12 the profiler rides on sys.monitoring, which
    is process-wide: autograd's thread, where the backward runs, shows in the same
    profile (the calling thread waits in C meanwhile). Before 3.12 only the calling
    thread shows."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    for order, count in (("tottime", 30), ("cumulative", 30)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(count)
        print(f"--- cProfile, {n} module steps, by {order} ---\n" + out.getvalue(), flush=True)


class _EngineProbe:
    """`run(work)`: one forward and backward of an identity autograd function on x whose
    backward calls `work()`, so `work` runs where autograd runs a CUDA backward."""

    def __init__(self, x) -> None:
        import torch

        probe = self

        class Identity(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.view_as(t)

            @staticmethod
            def backward(ctx, g):
                probe.work()
                return g

        self.apply, self.x = Identity.apply, x
        self.g = torch.ones_like(x)
        self.work = lambda: None

    def run(self, work) -> None:
        self.work = work
        self.x.grad = None
        self.apply(self.x).backward(self.g)


if __name__ == "__main__":
    main()
