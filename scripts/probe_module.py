"""Where the host time of the PyTorch module's eager step goes: each layer of the call,
timed alone (perf_counter over many calls, the GPU drained before and after), from
wrapping one tensor for numba up to the whole forward and backward.

    python scripts/probe_module.py [--shape tiny_latency] [--bn] [--dtype float32] [--n 300]

Prints one line per piece: microseconds of host time per call.
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
    args = ap.parse_args()

    import torch

    from bench_cuda import our_module, torch_dtype, torch_nchw
    from conv2d.cuda.runtime import device_view

    spec = spec_of(args)
    model = our_module(spec)
    x_host, dy_host = inputs(spec)
    x = torch_nchw(x_host, spec).requires_grad_(True)
    dy = torch_nchw(dy_host, spec)
    model(x).backward(dy)
    fn = next(iter(model._functions.values()))
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
    key = next(iter(model._functions))
    op_key = model._op_key(key)
    with torch.no_grad():
        row("torch.ops.conv2d.forward, no_grad",
            lambda: torch.ops.conv2d.forward(nhwc, w, params.get("bias"), params.get("gamma"), params.get("beta"),
                                             None, None, True, op_key))
        row("module forward, no_grad", lambda: model(x))
    row("module forward, grad", lambda: model(x))

    def step():
        x.grad = None
        model(x).backward(dy)
    row("module forward + backward", step)

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
