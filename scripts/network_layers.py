"""Where a network's step goes, layer by layer: each layer that the module replaced in a
network of scripts/bench_networks.py (`conv2d.torch.swap`), beside the PyTorch layers it
stands for (`conv2d.torch.reference_sequential`: Conv2d [+ BatchNorm2d] + activation,
the same weights), each alone on the input it sees in the network.

    python scripts/network_layers.py [--device cuda|cpu] [--network digits_cnn]
        [--precision strict|default|bfloat16] [--rounds 5] [--iters 50]

Columns, microseconds a call (wall clock; on CUDA the GPU is synchronised once after
`--iters` calls, so a host-bound call shows its host time): the training forward (train
mode, gradients wanted, the network's training batch), its backward (forward and
backward, less the forward), and acting (eval, no_grad, batch 1). Medians over
`--rounds` rounds, each timing PyTorch's layers then ours. The sum over layers is
beside the whole network's step in scripts/bench_networks.py, which adds the loss, the
optimizer and the layers the module did not replace.
"""

from __future__ import annotations

import argparse
import statistics

from bench_networks import NETWORKS, models
from bench_shapes import per_call_us, provenance

import torch

PRECISIONS = {"strict": torch.float32, "default": torch.float32, "bfloat16": torch.bfloat16}
COLUMNS = ("train forward", "train backward", "act")


def layer_inputs(model: torch.nn.Module, x: torch.Tensor) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(each module of `model` that conv2d swapped in, the input it gets from x), in call order."""
    from conv2d.torch import Conv2dNormActivation

    seen: list = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((m, args[0].detach())))
             for m in model.modules() if isinstance(m, Conv2dNormActivation)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def calls(layer: torch.nn.Module, x: torch.Tensor, first: bool) -> dict:
    """The three timed calls of `layer` on x (N, C, H, W): train forward, train forward and
    backward, act (x's first sample). A first layer's x wants no gradient, as in the
    network."""
    xg = x.detach().requires_grad_(not first)
    layer.train()
    d_y = torch.randn_like(layer(xg))
    one = x[:1].contiguous(memory_format=torch.channels_last)

    def forward() -> None:
        layer.train()
        layer(xg)

    def step() -> None:
        layer.train()
        layer(xg).backward(d_y)

    def act() -> None:
        layer.eval()
        with torch.no_grad():
            layer(one)
    return {"forward": forward, "step": step, "act": act}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--network", default="digits_cnn", choices=sorted(NETWORKS))
    ap.add_argument("--precision", default="strict", choices=sorted(PRECISIONS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if args.rounds < 1 or args.iters < 1:
        ap.error(f"--rounds and --iters: expected positive ints, got {args.rounds} and {args.iters}")
    cuda = args.device == "cuda"
    if cuda:
        torch.backends.cudnn.allow_tf32 = args.precision == "default"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    from conv2d.torch import reference_sequential

    dtype = PRECISIONS[args.precision]
    _, ours = models(args.network, args.device, dtype)
    (c, h, w), batch, _ = NETWORKS[args.network]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, c, h, w, generator=g).to(device=args.device, dtype=dtype, memory_format=torch.channels_last)
    rows = []
    for i, (layer, x_i) in enumerate(layer_inputs(ours, x)):
        theirs = reference_sequential(layer).to(memory_format=torch.channels_last)
        sides = {"ours": calls(layer, x_i, i == 0), "PyTorch": calls(theirs, x_i, i == 0)}
        for side in sides.values():  # warm-up: plans, CUDA graphs, caches
            for run in side.values():
                for _ in range(5):
                    run()
        times: dict = {(s, k): [] for s in sides for k in ("forward", "step", "act")}
        for _ in range(args.rounds):
            for s in ("PyTorch", "ours"):
                for k, run in sides[s].items():
                    times[s, k].append(per_call_us(run, args.iters, sync))
        med = {key: statistics.median(v) for key, v in times.items()}
        rows.append((f"{i}: {tuple(x_i.shape[1:])} -> {layer.spec.out_channels}", {
            s: (med[s, "forward"], med[s, "step"] - med[s, "forward"], med[s, "act"]) for s in sides}))
    print(provenance(cuda), "\n")
    print(f"{args.network}, {args.precision}, {args.device}: microseconds a call of each swapped layer "
          f"(training batch {batch}; acting batch 1), ours / PyTorch's layers, medians of {args.rounds} rounds of "
          f"{args.iters} calls:\n")
    head = " | ".join(f"{col} ours | {col} PyTorch" for col in COLUMNS)
    print(f"| layer (C, H, W) -> OC | {head} |\n| --- |" + " ---: |" * (2 * len(COLUMNS)))
    total = {s: [0.0] * len(COLUMNS) for s in ("ours", "PyTorch")}
    for name, by_side in rows:
        cells = []
        for k in range(len(COLUMNS)):
            cells += [f"{by_side['ours'][k]:.0f}", f"{by_side['PyTorch'][k]:.0f}"]
            for s in total:
                total[s][k] += by_side[s][k]
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{total[s][k]:.0f}" for k in range(len(COLUMNS)) for s in ("ours", "PyTorch")]
    print("| all layers | " + " | ".join(cells) + " |")
    ratios = [f"{total['ours'][k] / total['PyTorch'][k]:.2f}x" for k in range(len(COLUMNS))]
    print("| ours / PyTorch | " + " | ".join(cell for r in ratios for cell in (r, "")) + " |")


if __name__ == "__main__":
    main()
