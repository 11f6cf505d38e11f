"""How fast the cpu backend's convolutions can be: every convolution of the CPU networks of
scripts/bench_networks.py at its training batch, PyTorch's (oneDNN, channels_last)
beside ours (conv2d.cpu.conv) and beside the BLAS matrix product alone that ours is
built on, the floor of an im2col convolution.

    python scripts/bench_cpu_convolutions.py [--networks digits_cnn,nature_dqn,impala_cnn,mobilenet_v2]
        [--threads 1] [--batch N] [--rounds 5] [--iters 5] [--out DIR]

Per convolution, milliseconds a call (wall clock, the median of `--rounds` rounds, each
timing PyTorch, ours and the product in turn for `--iters` calls): the forward, and the
backward (the input gradient where the network needs one, and the weight gradient).
"product" is the forward's matrix product alone on windows copied before the clock
starts (rows N*OH*OW, K = KH*KW*C, OC columns: numpy.matmul, one thread a task as the
backend runs it); depthwise convolutions have none (a compiled loop, not a product). Both
sides run `--threads` threads, ours on PyTorch's OpenMP team as the module's calls do
(conv2d.cpu.threads). GFLOP/s counts 2 x multiply-adds. A network's line sums its
convolutions. Where "product" alone is slower than PyTorch's whole forward, no im2col
convolution on this BLAS can match PyTorch's there, whatever the overhead around it.
`--batch N`: every network at batch N instead (`--batch 1`: the acting calls' shapes;
the table is then bench_cpu_convolutions_batch1.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_networks import CPU_NETWORKS, CPU_TRAIN_BATCH, NETWORKS, network
from bench_shapes import write_table

import torch
from torch import nn


def convolutions(name: str, batch: int) -> list[tuple[nn.Conv2d, tuple[int, ...], bool]]:
    """(each nn.Conv2d of network `name`, its input's shape (N, C, H, W) at `batch`, whether
    the network needs its input gradient), in call order."""
    model = network(name)
    (c, h, w), _, _ = NETWORKS[name]
    seen: list = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((m, tuple(args[0].shape))))
             for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(torch.zeros(batch, c, h, w))
    for hook in hooks:
        hook.remove()
    return [(m, shape, i > 0) for i, (m, shape) in enumerate(seen)]


def timed(run, iters: int) -> float:
    run()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    return (time.perf_counter() - t0) * 1e3 / iters


def sides(conv: nn.Conv2d, shape: tuple[int, ...], input_grad: bool) -> dict[str, dict]:
    """{"forward"|"backward": {side: a call}} for one convolution: PyTorch's, ours, and
    the forward's product alone (None for depthwise)."""
    from conv2d.cpu import conv as ours
    from conv2d.reference.conv import windows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(memory_format=torch.channels_last)
    w = conv.weight.detach().to(memory_format=torch.channels_last)
    stride, padding, dilation, groups = conv.stride, conv.padding, conv.dilation, conv.groups
    y = nn.functional.conv2d(x, w, None, stride, padding, dilation, groups)
    d_y = torch.randn(y.shape, generator=g).to(memory_format=torch.channels_last)
    x_np = np.ascontiguousarray(x.permute(0, 2, 3, 1).numpy())
    w_np = np.ascontiguousarray(w.permute(0, 2, 3, 1).numpy())
    d_np = np.ascontiguousarray(d_y.permute(0, 2, 3, 1).numpy())
    pads = ((padding[0], padding[0]), (padding[1], padding[1]))
    mask = [input_grad, True, False]
    calls = {"forward": {"torch": lambda: nn.functional.conv2d(x, w, None, stride, padding, dilation, groups),
                         "ours": lambda: ours.conv_forward(x_np, w_np, stride, pads, dilation=dilation, groups=groups)},
             "backward": {"torch": lambda: torch.ops.aten.convolution_backward(d_y, x, w, None, stride, padding,
                                                                               dilation, False, [0, 0], groups, mask)}}

    def our_backward():
        if input_grad:
            ours.conv_backward_data(w_np, d_np, x_np.shape[1:3], stride, pads, dilation=dilation, groups=groups)
        ours.conv_backward_filter(x_np, d_np, w_np.shape[1:3], stride, pads, dilation, groups)
    calls["backward"]["ours"] = our_backward
    calls["forward"]["product"] = None
    if groups == 1:
        oc, kh, kw, c = w_np.shape
        cols = np.ascontiguousarray(windows(ours.pad(x_np, pads), (kh, kw), stride, dilation)).reshape(-1, kh * kw * c)
        w_t = w_np.reshape(oc, -1).T
        out = np.empty((cols.shape[0], oc), np.float32)
        step = ours._block_samples(cols.shape[0] // shape[0] * kh * kw * c * 4) * (cols.shape[0] // shape[0])

        def product():
            def blocks(first: int, end: int) -> None:
                for i in range(first * step, min(cols.shape[0], end * step), step):
                    np.matmul(cols[i:i + step], w_t, out=out[i:i + step])
            ours.kernels.run_tasks(blocks, -(-cols.shape[0] // step), out.size * cols.shape[1])
        calls["forward"]["product"] = product
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--networks", default=",".join(CPU_NETWORKS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=None, help="instead of each network's training batch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None, help="a folder to write bench_cpu_convolutions.md in")
    args = p.parse_args()
    from conv2d.cpu import threads

    torch.set_num_threads(args.threads)
    # As the module runs it: PyTorch's count, on PyTorch's own OpenMP team (a pool of our
    # own beside it competes with its spinning workers: no faster at 2 threads than at 1).
    threads.use("torch")
    lines = ["| network | convolution | input (N, C, H, W) | GFLOP | torch fwd ms | ours fwd ms | product ms | "
             "torch fwd GFLOP/s | product GFLOP/s | torch bwd ms | ours bwd ms | fwd ours / torch | "
             "product / torch fwd | bwd ours / torch |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in args.networks.split(","):
        total = {"torch f": 0.0, "ours f": 0.0, "product": 0.0, "torch b": 0.0, "ours b": 0.0, "flop": 0.0}
        for conv, shape, input_grad in convolutions(name, args.batch or CPU_TRAIN_BATCH.get(name, NETWORKS[name][1])):
            calls = sides(conv, shape, input_grad)
            found = {(part, side): [] for part, c in calls.items() for side, f in c.items() if f is not None}
            for _ in range(args.rounds):
                for part, side in found:
                    found[part, side].append(timed(calls[part][side], args.iters))
            ms = {k: statistics.median(v) for k, v in found.items()}
            n, c, h, w = shape
            kh, kw = conv.kernel_size
            oh = (h + 2 * conv.padding[0] - conv.dilation[0] * (kh - 1) - 1) // conv.stride[0] + 1
            ow = (w + 2 * conv.padding[1] - conv.dilation[1] * (kw - 1) - 1) // conv.stride[1] + 1
            flop = 2.0 * n * oh * ow * conv.out_channels * kh * kw * c // conv.groups / 1e9
            prod = ms.get(("forward", "product"))
            what = f"{c}->{conv.out_channels} {kh}x{kw}/{conv.stride[0]}" + (
                f" groups {conv.groups}" if conv.groups > 1 else "")
            tf, of, tb, ob = ms["forward", "torch"], ms["forward", "ours"], ms["backward", "torch"], ms["backward", "ours"]
            lines.append(f"| {name} | {what} | {shape} | {flop:.3f} | {tf:.3f} | {of:.3f} | "
                         f"{'-' if prod is None else f'{prod:.3f}'} | {flop / tf * 1e3:.0f} | "
                         f"{'-' if prod is None else f'{flop / prod * 1e3:.0f}'} | {tb:.3f} | {ob:.3f} | "
                         f"{of / tf:.2f} | {'-' if prod is None else f'{prod / tf:.2f}'} | {ob / tb:.2f} |")
            print(lines[-1], flush=True)
            for k, v in (("torch f", tf), ("ours f", of), ("product", prod or 0.0), ("torch b", tb), ("ours b", ob),
                         ("flop", flop)):
                total[k] += v
        lines.append(f"| **{name}** | all | | {total['flop']:.3f} | {total['torch f']:.3f} | {total['ours f']:.3f} | "
                     f"{total['product']:.3f} | | | {total['torch b']:.3f} | {total['ours b']:.3f} | "
                     f"{total['ours f'] / total['torch f']:.2f} | | {total['ours b'] / total['torch b']:.2f} |")
        print(lines[-1], flush=True)
    if args.out:
        at = "" if args.batch is None else f"_batch{args.batch}"
        write_table(args.out, f"bench_cpu_convolutions{at}.md", "conv2d: the CPU networks' convolutions, PyTorch's "
                    "(oneDNN) vs the cpu backend's and its BLAS product alone"
                    + ("" if args.batch is None else f", at batch {args.batch}"), lines, gpu=False,
                    intro=f"Milliseconds a call at {args.threads} thread(s); scripts/bench_cpu_convolutions.py's "
                          "docstring says how. \"product\": the forward's matrix product alone, the floor of an "
                          "im2col convolution on NumPy's BLAS.")


if __name__ == "__main__":
    main()
