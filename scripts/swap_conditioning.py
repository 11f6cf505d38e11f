"""Is a float32 difference between a swapped model and PyTorch conditioning or a defect?
For each model of tests/swap_models.py in training mode: the output and the input
gradient of PyTorch in float32, and of the swapped model (the cpu backend) in float32,
each against PyTorch in float64 on the same inputs and weights (max |error| / max |value|).
Where ours and PyTorch's float32 errors are of one size, the difference between the two
is the problem's conditioning, not a defect.

    python scripts/swap_conditioning.py [--models resnet_basic,mobilenet_v2] [--batch 8] [--out DIR]

Prints a Markdown table; `--out DIR` writes it, with the provenance line, into that folder
(docs/swap_conditioning.md is `--out docs`).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from swap_models import MODELS  # noqa: E402

from bench_shapes import write_table  # noqa: E402
from conv2d.torch import swap  # noqa: E402


def results(model: torch.nn.Module, x: torch.Tensor, d_y_seed: int = 2) -> dict[str, torch.Tensor]:
    model.train()
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    d_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(d_y_seed), dtype=torch.float64).to(y.dtype)
    y.backward(d_y)
    return {"y": y.detach().double(), "d_x": x.grad.double()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = ["| model | value | PyTorch float32 vs float64 | ours float32 vs float64 | ours vs PyTorch, float32 |",
             "| --- | --- | ---: | ---: | ---: |"]
    for name in args.models.split(","):
        torch.manual_seed(0)
        base = MODELS[name]()
        x = torch.randn(args.batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        truth = results(copy.deepcopy(base).double(), x.double())
        theirs = results(copy.deepcopy(base).float(), x.float())
        ours = results(swap(copy.deepcopy(base).float()), x.float())
        for k in truth:
            lines.append(f"| {name} | {k} | {relative(theirs[k], truth[k]):.1e} | {relative(ours[k], truth[k]):.1e} | "
                         f"{relative(ours[k], theirs[k]):.1e} |")
            print(lines[-1], flush=True)
    if args.out:
        write_table(args.out, "swap_conditioning.md", "swap: float32 errors, ours and PyTorch's, against float64",
                    lines, gpu=False)


if __name__ == "__main__":
    main()
