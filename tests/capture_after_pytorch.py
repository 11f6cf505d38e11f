"""A scenario for tests/test_torch_module_cuda.py, run in a process of its own (a CUDA error such as an
illegal memory access poisons the process's context): scripts/bench_networks.py's "graph"
mode on a CIFAR-style conv-BN-ReLU network. The plain PyTorch network's training step is
captured in torch.cuda.graph and replayed first, then the same network with the module
swapped in; then the two graphs are replayed in turns, as the benchmark times them (at
9e2e185 the benchmark's turns ended in an illegal memory access on the H100 where a
capture and replays of ours alone did not). The module's captured steps must give the
parameters and running statistics of the same steps run eagerly.

    PYTHONPATH=scripts python tests/capture_after_pytorch.py PRECISION BATCH [ORDER]
        PRECISION: strict or tf32; ORDER: "pytorch-then-ours" (default), "ours" (ours alone) or
        "pytorch" (PyTorch's alone, replayed as often as in "pytorch-then-ours": whether its
        own captured network runs)

Prints "OK", or "DIFFER" and the first parameter that differs (exit 1); "PYTORCH FAILED"
and the error where PyTorch's own captured network fails before ours runs (exit 3);
"REPLAY FAILED", whose replay (synchronised after each) and the error, where a replay
fails once ours was captured (exit 4); another non-zero exit on another CUDA error.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from conv2d.torch import swap

# scripts/bench_networks.py's capture: PyTorch's recipe (three warm-up steps on a side stream).
from bench_cuda_runs import torch_graph

WIDTHS = [(3, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1)]  # (in, out, stride)
REPLAYS = 5


def network() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for cin, cout, stride in WIDTHS:
        layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(WIDTHS[-1][1], 10))


def training_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor):
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, capturable=True)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        nn.functional.mse_loss(model(x).float(), target).backward()
        opt.step()
    return step


def first_line(e: Exception) -> str:
    return (str(e).splitlines() or [""])[0]


def replay_in_turns(turns: list) -> str | None:
    """Each graph of `turns` ((whose, graph) pairs) replayed REPLAYS times, in turns, each
    replay synchronised (an error surfaces at the replay that caused it): None, or which
    replay failed and with what."""
    for i in range(REPLAYS):
        for whose, graph in turns:
            try:
                graph.replay()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported, and the process ends
                return f"{whose} replay {i + 1} of {REPLAYS}: {type(e).__name__}: {first_line(e)}"
    return None


def main() -> int:
    precision, batch = sys.argv[1], int(sys.argv[2])
    order = sys.argv[3] if len(sys.argv) > 3 else "pytorch-then-ours"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.benchmark = False

    def on_gpu(m: nn.Module) -> nn.Module:
        return m.to(device="cuda", memory_format=torch.channels_last)
    theirs = on_gpu(network())
    ours = on_gpu(swap(network()))
    eager = copy.deepcopy(ours)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(device="cuda", memory_format=torch.channels_last)
    target = torch.randn(batch, 10, generator=g).to("cuda")

    if order not in ("pytorch-then-ours", "ours", "pytorch"):
        print(f"ORDER: expected pytorch-then-ours, ours or pytorch, got {order!r}")
        return 2
    if order != "ours":
        try:
            pytorch_graph = torch_graph(training_step(theirs, x, target))
            for _ in range(3):
                pytorch_graph.replay()
            torch.cuda.synchronize()  # an error of PyTorch's own work surfaces here, before ours runs
        except Exception as e:  # noqa: BLE001 - reported, and the process ends
            print(f"PYTORCH FAILED {type(e).__name__}: {first_line(e)}")
            return 3
        if order == "pytorch":
            # As many replays as PyTorch's graph gets in "pytorch-then-ours": a failure
            # there that PyTorch's graph alone also has is not ours.
            failed = replay_in_turns([("PyTorch's", pytorch_graph)])
            if failed is not None:
                print(f"PYTORCH FAILED alone, after its first 3 replays: {failed}")
                return 3
            print("OK")
            return 0
    our_graph = torch_graph(training_step(ours, x, target))
    # The benchmark's turns: PyTorch's graph, then ours (ours alone: ours only).
    turns = ([("PyTorch's", pytorch_graph)] if order == "pytorch-then-ours" else []) + [("ours", our_graph)]
    failed = replay_in_turns(turns)
    if failed is not None:
        print(f"REPLAY FAILED: {failed} (our graph captured after PyTorch's: {order != 'ours'})")
        return 4
    step = training_step(eager, x, target)
    for _ in range(3 + REPLAYS):  # the warm-up steps and the replays
        step()
    torch.cuda.synchronize()
    for (name, a), b in zip(ours.state_dict().items(), eager.state_dict().values()):
        if not torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-6):
            print(f"DIFFER {name}: largest difference {(a.double() - b.double()).abs().max().item():.3g}")
            return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
