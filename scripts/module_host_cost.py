"""Where the PyTorch module's host time goes, per call: the module (`Conv2dNormActivation`)
beside PyTorch's `Conv2d + BatchNorm2d + ReLU` modules on one benchmark layer
(docs/bench_shapes.md), acting (eval, no_grad) and training (forward and backward), then a
profile of ours by function (issue 38's "measure where the time goes per call").

    python scripts/module_host_cost.py [--device cuda|cpu] [--shape tiny_latency] [--bn]
        [--dtype float32] [--batch 1] [--calls 2000] [--top 15]

Host time per call: the wall time of `--calls` calls divided by their number, the GPU
synchronised once at the end, on a layer small enough that the host, not the GPU, sets
the pace (tiny_latency at batch 1 by default); on the CPU it is the whole call. Then
cProfile over ours: each function's own time (tottime) per call, in microseconds, the
largest first, named by file and function (the profiler's overhead inflates every row
alike; compare rows, not totals). Last, the module alone: its backend's calls replaced by
their recorded results, which leaves the module's own Python, autograd's and torch's
(PyTorch's row: its real layers), beside the floor of any Python autograd node: an empty
`torch.autograd.Function` called as the module's node is (the same tensors in, the same
saved, one new output; its backward returns new gradients of x and the parameters and
does nothing else; acting: the output alone, under no_grad).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from pathlib import Path

from bench_shapes import SHAPES, bench_spec, per_call_us, provenance

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layers(shape: str, bn: bool, dtype: torch.dtype, device: str) -> tuple[nn.Module, nn.Module]:
    """(PyTorch's Conv2d [+ BatchNorm2d] + ReLU, the module swapped in), same weights,
    channels_last."""
    from conv2d.torch import swap

    spec = bench_spec(shape, bn, "float32")
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Conv2d(spec.in_channels, spec.out_channels, spec.kernel, spec.stride, spec.padding,
                                     bias=not bn), *([nn.BatchNorm2d(spec.out_channels)] if bn else []), nn.ReLU())
    ours = swap(nn.Sequential(*[m for m in _copy(theirs)]))
    return tuple(m.to(device=device, dtype=dtype, memory_format=torch.channels_last) for m in (theirs, ours))


def _copy(m: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(m)


def calls(model: nn.Module, x: torch.Tensor, row: str):
    """One call of `row`: "act" (eval, no_grad) or "train" (forward, backward of the sum)."""
    if row == "act":
        model.eval()

        def act() -> None:
            with torch.no_grad():
                model(x)
        return act
    model.train()
    xg = x.detach().requires_grad_(True)

    def train() -> None:
        model(xg).sum().backward()
    return train


def swapped_layer(model: nn.Module) -> nn.Module:
    """The one `Conv2dNormActivation` in `model` (what `layers` swapped in)."""
    from conv2d.torch import Conv2dNormActivation

    (layer,) = [m for m in model.modules() if isinstance(m, Conv2dNormActivation)]
    return layer


def stub_backend(model: nn.Module, x: torch.Tensor) -> None:
    """Replace the backend functions of `model`'s module (after one real training call and
    one real acting call, eager) by functions that return those calls' results, so that
    a call costs the module's own Python, autograd's and torch's, not the backend's:
    forward, saved and backward (training; acting on the CPU) and evaluate (acting on
    CUDA: `eager.evaluate_call`)."""
    layer = swapped_layer(model)
    layer.cuda_graphs = False
    results: dict = {}
    for row in ("train", "act"):
        calls(model, x, row)()
        for fn, _ in layer._functions.values():
            if not hasattr(fn, "_stubbed"):
                fn._stubbed = True
                forward, saved, backward, evaluate = fn.forward, fn.saved, fn.backward, fn.evaluate

                def recorded(real, name):
                    def call(*a, **k):
                        if name not in results:
                            results[name] = real(*a, **k)
                        return results[name]
                    return call
                fn.forward, fn.saved, fn.backward, fn.evaluate = (
                    recorded(forward, "forward"), recorded(saved, "saved"), recorded(backward, "backward"),
                    recorded(evaluate, "evaluate"))
    for row in ("train", "act"):  # the recording calls
        calls(model, x, row)()


class EmptyNode(torch.autograd.Function):
    """The least a Python autograd node over the module's tensors costs: the module's
    inputs in, the same five saved, one new output; its backward only allocates the
    gradients (as any implementation must)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gamma, beta, running_mean, running_var, shape):
        ctx.save_for_backward(x, weight, gamma, beta, running_mean)
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, d_y):
        x, weight, gamma, beta, _ = ctx.saved_tensors
        new = [None if t is None else torch.empty_like(t) for t in (x, weight, gamma, beta)]
        return new[0], new[1], None, new[2], new[3], None, None, None


def empty_node(model: nn.Module, x: torch.Tensor, row: str):
    """One call of `row` (as `calls`) through `EmptyNode` over the module's tensors."""
    layer = swapped_layer(model)
    norm = layer.norm
    tensors = (layer.conv.weight, layer.conv.bias, *((norm.weight, norm.bias, norm.running_mean, norm.running_var)
                                                     if norm is not None else (None,) * 4))
    with torch.no_grad():
        shape = model(x).shape
    if row == "act":
        def act() -> None:
            with torch.no_grad():
                torch.empty(shape, dtype=x.dtype, device=x.device)
        return act
    xg = x.detach().requires_grad_(True)

    def train() -> None:
        EmptyNode.apply(xg, *tensors, shape).sum().backward()
    return train


def warm_up(run, n: int) -> None:
    """Calls before the `n` measured ones: plans, CUDA graphs of the module's calls, and
    the first calls of a mode, which check and view the parameters."""
    for _ in range(max(10, n // 10)):
        run()


def host_us(run, n: int, sync) -> float:
    warm_up(run, n)
    return per_call_us(run, n, sync)


def profile_rows(run, n: int, top: int) -> list[tuple[str, float, int]]:
    """(file:function, own us per call, calls per call) of the `top` functions by own time."""
    warm_up(run, n)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        run()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    rows = []
    for (file, _, name), (_, calls_, tottime, _, _) in stats.items():
        short = "/".join(Path(file).parts[-2:]) if file != "~" else "builtin"
        rows.append((f"{short}:{name}", tottime * 1e6 / n, calls_ / n))
    return sorted(rows, key=lambda r: -r[1])[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="tiny_latency", choices=sorted(SHAPES))
    ap.add_argument("--bn", action="store_true", help="with batch norm")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    if args.calls < 1 or args.batch < 1:
        ap.error(f"--calls and --batch: expected positive ints, got {args.calls} and {args.batch}")
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    theirs, ours = layers(args.shape, args.bn, DTYPES[args.dtype], args.device)
    _, h, w, c = bench_spec(args.shape, args.bn, "float32").input_shape
    x = torch.randn(args.batch, c, h, w).to(device=args.device, dtype=DTYPES[args.dtype],
                                              memory_format=torch.channels_last)
    print(provenance(cuda), "\n")
    print(f"Host time per call, {args.shape}{' bn' if args.bn else ''} {args.dtype}, batch {args.batch}, "
          f"{args.device}, {args.calls} calls:\n")
    print("| row | ours us | PyTorch us | ours - PyTorch |\n| --- | ---: | ---: | ---: |")
    for row in ("act", "train"):
        t_ours = host_us(calls(ours, x, row), args.calls, sync)
        t_theirs = host_us(calls(theirs, x, row), args.calls, sync)
        print(f"| {row} | {t_ours:.1f} | {t_theirs:.1f} | {t_ours - t_theirs:+.1f} |", flush=True)
    for row in ("act", "train"):
        print(f"\nOurs, {row}: own time per call by function (cProfile), the {args.top} largest:\n")
        print("| function | us per call | calls per call |\n| --- | ---: | ---: |")
        # calls() sets the model's mode (eval for acting): made again here, after the other row's.
        for name, us, per in profile_rows(calls(ours, x, row), max(1, args.calls // 4), args.top):
            print(f"| {name} | {us:.2f} | {per:.1f} |")

    stub_backend(ours, x)
    print("\nThe module's own host time: its backend's forward, saved, backward and evaluate replaced by "
          "their results (eager launches, no CUDA graphs), beside an empty autograd node over the same tensors "
          "(EmptyNode: the floor of any Python node) and PyTorch's real layers:\n")
    print("| row | module alone us | empty node us | PyTorch us |\n| --- | ---: | ---: | ---: |")
    for row in ("act", "train"):
        t_ours = host_us(calls(ours, x, row), args.calls, sync)
        t_empty = host_us(empty_node(ours, x, row), args.calls, sync)
        t_theirs = host_us(calls(theirs, x, row), args.calls, sync)
        print(f"| {row} | {t_ours:.1f} | {t_empty:.1f} | {t_theirs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
