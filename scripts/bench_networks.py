"""Whole networks, not layers: each network of docs/bench_shapes.md ("Whole networks") in plain
PyTorch and with this library's module swapped in (`conv2d.torch.swap`: the same weights),
side by side in one process, timed in turns.

    python scripts/bench_networks.py [--device cuda|cpu] [--networks nature_dqn,impala_cnn,cifar_resnet]
        [--precisions default,strict,bfloat16] [--modes eager,graph,compile,reduce-overhead]
        [--rows train,act,loop] [--rounds 5] [--iters 10] [--threads 1,all] [--out DIR [--resume]] [--isolate]
        [--torch-deterministic] [--no-runs] [--rest]

Rows: the training step (forward, loss, backward, Adam step; the network's training batch)
and acting (eval, no_grad, batch 1, then a synchronisation). Precisions: "default"
(float32 with PyTorch's default settings on both sides: cuDNN convolutions in TF32 unless
`torch.backends.cudnn.allow_tf32` is off, which the module follows), "strict" (float32,
TF32 off on both sides), "bfloat16". Modes: eager; the whole step captured in
`torch.cuda.graph` ("graph"); `torch.compile` default ("compile") and
`mode="reduce-overhead"`. Each cell is the median over `--rounds` rounds, each round
timing PyTorch then ours for `--iters` calls after warm-up (so both see the machine at the
same moment); the ratio is ours / PyTorch (below 1: ours is faster). On CUDA a line
starting with "#" follows a row where our modules used call graphs: their counts round by
round (launched, captured, replayed, failed), since a replay needs the caller's tensor
addresses to repeat and a round that captures again is timed with its captures; `--out`
writes them under the table too. GPU rows
time with CUDA events (GPU ms) and the wall clock; CPU rows with the wall clock only (modes eager
and compile). On the CPU each row runs at each of `--threads` (torch.set_num_threads on
both sides; "all": the cores): the module runs the cpu backend, which follows that count
(conv2d.cpu.threads). Row "loop": the Breakout demo's DQN loop end to end in environment steps
per second (scripts/rl_loop.py: plain PyTorch eager, with the module, with PyTorch's
training step in torch.cuda.graph, and this library's demo path), its variants timed in
turns. `--torch-deterministic` (CUDA) times a third side in the same turns: PyTorch with
`torch.backends.cudnn.deterministic = True`, set around that side's calls alone, which
restricts its cuDNN plans to deterministic ones as this library's always are (PyTorch's
default lets backward-data and backward-filter take non-deterministic plans); its columns
are its time and ours / it. `--rest` (eager acting rows) times a side more: our network
with each swapped module's call replaced by its cached output, the parts both sides run in
PyTorch (heads, pooling, residual adds); its share of PyTorch's time is what no faster
layer can remove. `--out DIR` writes DIR/bench_networks_{cuda,cpu}.md with the
provenance line, after every row (marked unfinished until the run ends, so a run stopped by
a time limit leaves its rows); `--resume` with it keeps the rows that table already holds
from a run at the same commit on the same machine and runs the others, so that a table too
long for one time limit is made by several runs.

A CUDA error (an illegal memory access) leaves the process's CUDA context unusable, so
every row after it would fail too: after a row fails with one, each later row (and the
loop) runs in a process of its own (this script with `--one`), and `--isolate` does so
for every row from the start.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_cuda_runs import torch_graph  # PyTorch's capture recipe
from bench_shapes import provenance, provenance_key, write_table
import rl_loop

import torch
from torch import nn

# name -> (input (C, H, W), training batch, outputs)
NETWORKS = {"nature_dqn": ((4, 84, 84), 32, 6), "impala_cnn": ((3, 64, 64), 256, 15),
            "cifar_resnet": ((3, 32, 32), 128, 10), "digits_cnn": ((1, 8, 8), 32, 10),
            "mobilenet_v2": ((3, 64, 64), 128, 10)}
# The CPU's default networks and training batches (docs/bench_shapes.md, "Whole networks").
CPU_NETWORKS = ("digits_cnn", "nature_dqn", "impala_cnn", "mobilenet_v2")
CPU_TRAIN_BATCH = {"impala_cnn": 32, "mobilenet_v2": 32}
MODES = ("eager", "graph", "compile", "reduce-overhead")
PRECISIONS = ("default", "strict", "bfloat16")


class Residual(nn.Module):
    """x + block(x): IMPALA's residual block (ReLU, conv 3x3, ReLU, conv 3x3)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class InvertedResidual(nn.Module):
    """MobileNetV2's block (Sandler et al. 2018): expand 1x1 (x6) + BN + ReLU6, depthwise
    3x3 + BN + ReLU6, project 1x1 + BN, plus x where the shapes match (no expansion
    where `expand` is 1); laid out as torchvision's (`conv`: a Sequential of a Sequential
    a conv chain, then the project conv and BN), so that `swap` converts all three and
    calls them as one run."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int = 6) -> None:
        super().__init__()
        mid = cin * expand
        self.residual = stride == 1 and cin == cout
        layers = [] if expand == 1 else [nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid),
                                                       nn.ReLU6())]
        layers += [nn.Sequential(nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
                                 nn.ReLU6()),
                   nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return x + y if self.residual else y


def network(name: str) -> nn.Module:
    """The plain PyTorch network `name` (seeded weights)."""
    torch.manual_seed(0)
    (c, h, w), _, outputs = NETWORKS[name]
    if name == "nature_dqn":  # Mnih et al. 2015
        return nn.Sequential(nn.Conv2d(c, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                             nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(),
                             nn.Linear(512, outputs))
    if name == "impala_cnn":  # Espeholt et al. 2018
        layers: list[nn.Module] = []
        for out in (16, 32, 32):
            layers += [nn.Sequential(nn.Conv2d(c, out, 3, padding=1)), nn.MaxPool2d(3, 2, padding=1),
                       Residual(out), Residual(out)]
            c = out
        return nn.Sequential(*layers, nn.Flatten(), nn.ReLU(), nn.Linear(32 * 8 * 8, 256), nn.ReLU(),
                             nn.Linear(256, outputs))
    if name == "digits_cnn":  # the README's demo (conv2d/demos/digits.py), its output the last conv's
        return nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, outputs, 4),
                             nn.Flatten())
    if name == "mobilenet_v2":  # docs/bench_shapes.md: 16, 24/2, 24, 32/2, 32, 64/2
        layers = [nn.Sequential(nn.Conv2d(c, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6())]
        cin = 32
        for cout, stride, expand in ((16, 1, 1), (24, 2, 6), (24, 1, 6), (32, 2, 6), (32, 1, 6), (64, 2, 6)):
            layers.append(InvertedResidual(cin, cout, stride, expand))
            cin = cout
        layers.append(nn.Sequential(nn.Conv2d(cin, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU6()))
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, outputs))
    blocks, widths = [], [(c, 64, 1), (64, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1), (128, 128, 1),
                          (128, 256, 2), (256, 256, 1)]
    for cin, cout, stride in widths:
        blocks += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, outputs))


def models(name: str, device: str, dtype: torch.dtype, runs: bool = True) -> tuple[nn.Module, nn.Module]:
    """(PyTorch's network, the same network with the module swapped in), same weights;
    `runs`: swap's (consecutive layers of a Sequential called as one Conv2dRun)."""
    from conv2d.torch import swap

    theirs = network(name)
    ours = swap(copy.deepcopy(theirs), runs=runs)
    assert any(type(m).__name__ == "Conv2dNormActivation" for m in ours.modules()), name
    return tuple(m.to(device=device, dtype=dtype, memory_format=torch.channels_last) for m in (theirs, ours))


class Timer:
    """Times `iters` calls of a function: (GPU ms, wall ms) per call on CUDA, (wall, wall) on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, run, iters: int) -> tuple[float, float]:
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        if self.cuda:
            end.record()
        self.sync()
        wall = (time.perf_counter() - t0) * 1e3 / iters
        return (start.elapsed_time(end) / iters if self.cuda else wall), wall


def training_step(model: nn.Module, mode: str, x: torch.Tensor, target: torch.Tensor):
    """The step to time: zero the gradients, forward, MSE loss, backward, Adam."""
    model.train()
    capturable = mode == "graph"
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, capturable=capturable)
    run = model
    if mode in ("compile", "reduce-overhead"):
        run = torch.compile(model, mode=None if mode == "compile" else mode)

    def step():
        opt.zero_grad(set_to_none=not capturable)
        nn.functional.mse_loss(run(x).float(), target).backward()
        opt.step()
    return torch_graph(step).replay if mode == "graph" else step


def acting_step(model: nn.Module, mode: str, x: torch.Tensor, timer: Timer):
    """One action: eval, no_grad, batch 1, then synchronise."""
    model.eval()
    run = model
    if mode in ("compile", "reduce-overhead"):
        run = torch.compile(model, mode=None if mode == "compile" else mode)
    if mode == "graph":
        replay = torch_graph(lambda: model(x), no_grad=True).replay

        def act():
            replay()
            timer.sync()
        return act

    def act():
        with torch.no_grad():
            run(x)
        timer.sync()
    return act


class LayerOutput(nn.Module):
    """Stands in for one of our swapped modules: its first call's output, returned again
    (`--rest`: what a network costs besides our layers)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.out = module, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.out is None:
            self.out = self.module(x)
        return self.out


def without_layers(model: nn.Module) -> nn.Module:
    """`model` (ours) with each swapped module (a Conv2dNormActivation or Conv2dRun) a
    LayerOutput: the network's other parts alone."""
    for name, child in model.named_children():
        if type(child).__name__ in ("Conv2dNormActivation", "Conv2dRun"):
            setattr(model, name, LayerOutput(child))
        else:
            without_layers(child)
    return model


class SideFailed(Exception):
    """One side ("torch" or "ours") of a comparison raised (its cause), in its `phase`:
    "warm-up" (building, capturing or compiling, and the first calls) or "timed runs"
    (the rounds, where the sides take turns)."""

    def __init__(self, side: str, phase: str = "warm-up") -> None:
        super().__init__(side, phase)
        self.side, self.phase = side, phase


def failure(e: Exception) -> str:
    """A table cell for a comparison that raised: whose side, in which phase, and the error."""
    side = ""
    if isinstance(e, SideFailed):
        side, e = {"torch": "PyTorch's side", "ours": "our side", "torch_det": "deterministic PyTorch's side",
                   "rest": "our side without its layers"}[e.side] + f", {e.phase}: ", e.__cause__
    return f"failed ({side}{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"


def thread_count(given: str) -> int:
    """A `--threads` entry as a count: "all" is the cores."""
    import os

    return len(os.sched_getaffinity(0)) if given == "all" else int(given)


def row_inputs(name: str, row: str, precision: str, device: str, batch: int | None = None
               ) -> tuple[torch.dtype, torch.Tensor, torch.Tensor]:
    """(dtype, x, target) of `row` of network `name` at `precision` (x channels_last; a
    training batch of `batch`, else the network's; acting: batch 1), with PyTorch's
    cuDNN switches set for the precision on CUDA."""
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    if device == "cuda":
        torch.backends.cudnn.allow_tf32 = precision == "default"
        torch.backends.cudnn.benchmark = False
    (c, h, w), n, outputs = NETWORKS[name]
    n = batch or n
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n if row == "train" else 1, c, h, w, generator=g).to(device=device, dtype=dtype,
                                                                         memory_format=torch.channels_last)
    return dtype, x, torch.randn(n, outputs, generator=g).to(device)


def compare(name: str, precision: str, mode: str, row: str, args, threads: str = "all") -> dict | None:
    """Both sides' median (GPU, wall) ms of `row` ("train" or "act"); None where the mode
    does not apply (graphs on the CPU). On the CPU both sides run `threads` threads."""
    device = args.device
    if device == "cpu" and mode in ("graph", "reduce-overhead"):
        return None
    if device == "cpu":
        torch.set_num_threads(thread_count(threads))
    torch._dynamo.reset()
    n = args.train_batch or (CPU_TRAIN_BATCH.get(name) if device == "cpu" else None)
    dtype, x, target = row_inputs(name, row, precision, device, n)
    timer = Timer(device)
    steps = {}
    sides = list(zip(("torch", "ours"), models(name, device, dtype, runs=not args.no_runs)))
    if args.torch_deterministic:  # CUDA only (main refuses it on the CPU)
        sides.append(("torch_det", network(name).to(device=device, dtype=dtype, memory_format=torch.channels_last)))
    if args.rest and row == "act" and mode == "eager":
        sides.append(("rest", without_layers(copy.deepcopy(sides[1][1]))))
    for side, model in sides:
        deterministic(side, device)
        try:
            steps[side] = (training_step(model, mode, x, target) if row == "train"
                           else acting_step(model, mode, x, timer))
            for _ in range(3):  # compile, capture, plan, warm caches
                steps[side]()
            timer.sync()  # a CUDA error of this side's work surfaces here, before the other side runs
        except Exception as e:
            raise SideFailed(side) from e
    times = {side: [] for side, _ in sides}
    ours = dict(sides)["ours"]
    counts = [graph_counts(ours)]
    for _ in range(args.rounds):
        for side in times:
            deterministic(side, device)
            try:
                # The timer synchronises after the side's runs, so a CUDA error of them
                # surfaces here (the other side's work was synchronised before).
                times[side].append(timer(steps[side], args.iters))
            except Exception as e:
                raise SideFailed(side, "timed runs") from e
        counts.append(graph_counts(ours))
    deterministic("torch", device)
    result: dict = {side: tuple(statistics.median(t[i] for t in ts) for i in (0, 1)) for side, ts in times.items()}
    if any(counts[-1].values()):
        result["graphs"] = [{k: b[k] - a[k] for k in b} for a, b in zip(counts, counts[1:])]
        print(f"# {name} {row} {precision} {mode}: our call graphs, round by round: {result['graphs']}", flush=True)
    return result


def graph_counts(model: nn.Module) -> dict[str, int]:
    """How the eager CUDA calls of `model`'s modules went so far (their `graph_counts`,
    summed: launched, captured, replayed, failed): a replay needs every address of a
    call to repeat, so a round of steps that captures or launches again instead of
    replaying says that they did not."""
    total: dict[str, int] = {}
    for m in model.modules():
        counted = getattr(m, "graph_counts", None)
        for k, v in (counted() if callable(counted) else {}).items():
            total[k] = total.get(k, 0) + v
    return total


def deterministic(side: str, device: str) -> None:
    """PyTorch's cuDNN determinism for `side`'s calls: on for "torch_det" alone."""
    if device == "cuda":
        torch.backends.cudnn.deterministic = side == "torch_det"


def loop_table(args) -> list[str]:
    """The DQN loop's table (scripts/rl_loop.py), printed as it comes."""
    variants = [v for v in rl_loop.VARIANTS if args.device == "cuda" or v != "torch graph"]
    rates = rl_loop.steps_per_second(args.device, variants, args.loop_warmup, args.loop_steps, args.rounds)
    lines = [f"The Breakout demo's DQN loop (scripts/rl_loop.py), {args.loop_steps} training steps a round after "
             f"{args.loop_warmup} random ones, median of {args.rounds} rounds in turns:", "",
             "| variant | steps/s | ms/step | steps/s vs plain PyTorch |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {v} | {r:.0f} | {1e3 / r:.3f} | {r / rates['torch']:.2f} |" for v, r in rates.items()]
    print("\n".join(lines), flush=True)
    return lines


def is_cuda_error(e: Exception) -> bool:
    """Whether `e` (or what it was raised from) is a CUDA error, after which the process's
    CUDA context is unusable."""
    while e is not None:
        if type(e).__name__ == "AcceleratorError" or "CUDA error" in str(e):
            return True
        e = e.__cause__
    return False


def run_alone(args, name: str, precision: str, mode: str, row: str, threads: str = "all") -> dict:
    """One comparison (or, row "loop", the loop's table) in a process of its own: what
    `--one` prints, {"times": compare's result or None} or {"failed": the cell} or
    {"lines": the loop's}; a process that dies without saying is a failed cell."""
    command = [sys.executable, str(Path(__file__).resolve()), "--one", "--device", args.device, "--networks", name,
               "--precisions", precision, "--modes", mode, "--rows", row, "--rounds", str(args.rounds),
               "--iters", str(args.iters), "--loop-warmup", str(args.loop_warmup),
               "--loop-steps", str(args.loop_steps), "--threads", threads] + \
        (["--torch-deterministic"] if args.torch_deterministic else []) + (["--no-runs"] if args.no_runs else []) + \
        (["--rest"] if args.rest else [])
    if args.train_batch:
        command += ["--train-batch", str(args.train_batch)]
    done = subprocess.run(command, capture_output=True, text=True)
    said = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and said:
        return json.loads(said[-1])
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"failed": f"failed (its own process ended, exit {done.returncode}: {last[:120]})"}


def one(args, precisions: list[str], modes: list[str], rows: list[str]) -> None:
    """`--one`: the single comparison the arguments name, as one JSON line."""
    name, precision, mode, row = args.networks, precisions[0], modes[0], rows[0]
    if row == "loop":
        print(json.dumps({"lines": loop_table(args)}))
        return
    try:
        got = compare(name, precision, mode, row, args, args.threads)
    except Exception as e:  # the cell says so, as in the parent's own rows
        print(json.dumps({"failed": failure(e)}))
        return
    print(json.dumps({"times": got}))


GRAPHS_HEADING = ("Our modules' call graphs, round by round (launched eagerly, captured, replayed, failed), in the "
                  "rows where they used any:")


def earlier_rows(path: Path, head: str, cuda: bool, made: str) -> tuple[dict[tuple, str], dict[tuple, str], list[str]]:
    """`--resume`: the rows of the table an earlier run wrote to `path` and their call-graph
    lines, by (network, row, precision, mode[, threads]), and its DQN loop's lines; nothing
    where there is no table. `made`: this run's provenance line.
    Refuses (SystemExit, saying what differs) a table made at another commit, on another
    machine or with other library versions, or with other columns."""
    if not path.exists():
        return {}, {}, []
    text = path.read_text().splitlines()
    earlier = provenance_key(next((line for line in text if line.startswith("Made by `")), ""))
    here = provenance_key(made)
    if earlier != here:
        raise SystemExit(f"--resume: {path} was made by another run ({earlier or 'no provenance line'});"
                         f" expected one of this one: {here}")
    if head.splitlines()[0] not in text:
        raise SystemExit(f"--resume: {path}'s table has other columns; expected {head.splitlines()[0]}")
    rows, graphs, loop = {}, {}, []
    for i, line in enumerate(text):
        if line.startswith("- `"):
            graphs[tuple(line[3:line.index("`", 3)].split())] = line
            continue
        if line.startswith("The Breakout demo's DQN loop"):
            loop = text[i:]
            while loop and not loop[-1]:
                loop.pop()
            break
        if line.startswith("| ") and not line.startswith(("| network |", "| --- |")):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[tuple(cells[:4 if cuda else 5])] = line
    return rows, graphs, loop


def row_line(args, name: str, row: str, precision: str, mode: str, threads: str, cuda: bool, det: bool,
             columns: int, alone: bool) -> tuple[str, bool, list | None] | None:
    """(the table line of one comparison, whether later rows run alone, our call graphs'
    counts round by round where it used any), or None where the mode does not apply."""
    failed = got = None
    if alone:
        said = run_alone(args, name, precision, mode, row, threads)
        failed, got = said.get("failed"), said.get("times")
    else:
        try:
            got = compare(name, precision, mode, row, args, threads)
        except Exception as e:  # a mode that fails is a finding: its row says so
            failed = failure(e)
            alone = alone or is_cuda_error(e)
    first = f"| {name} | {row} | {precision} | {mode} | " + ("" if cuda else f"{thread_count(threads)} | ")
    if failed is not None:
        return f"{first}{failed} |{' |' * (columns - 1)}", alone, None
    if got is None:
        return None
    (og, ow), (tg, tw) = got["ours"], got["torch"]
    gpu = f"{og:.3f} | {tg:.3f} | {og / tg:.2f} | " if cuda else ""
    line = f"{first}{gpu}{ow:.3f} | {tw:.3f} | {ow / tw:.2f} |"
    if args.rest:
        line += f" {got['rest'][1]:.3f} | {got['rest'][1] / tw:.2f} |" if "rest" in got else " - | - |"
    if det:
        dg = got["torch_det"][0]
        line += f" {dg:.3f} | {og / dg:.2f} |"
    return line, alone, got.get("graphs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--networks", default=None, help="default: all on CUDA; " + ",".join(CPU_NETWORKS) + " on the CPU")
    ap.add_argument("--threads", default="1,all", help="CPU: the thread counts to run each row at (\"all\": the cores)")
    ap.add_argument("--precisions", default=None, help="default: all three on CUDA; strict,bfloat16 on the CPU")
    ap.add_argument("--modes", default=None, help="default: all four on CUDA; eager,compile on the CPU")
    ap.add_argument("--rows", default="train,act,loop", help="train, act (tables by network) and loop (the DQN "
                    "loop in steps/s: scripts/rl_loop.py)")
    ap.add_argument("--loop-warmup", type=int, default=1000, help="loop: random steps filling the replay first")
    ap.add_argument("--loop-steps", type=int, default=500, help="loop: training steps a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--train-batch", type=int, default=None, help="instead of each network's training batch")
    ap.add_argument("--out", default=None, help="a folder to write bench_networks_{device}.md into")
    ap.add_argument("--isolate", action="store_true", help="every row in a process of its own (see the docstring)")
    ap.add_argument("--torch-deterministic", action="store_true", help="also PyTorch with cudnn.deterministic "
                    "(CUDA; see the docstring)")
    ap.add_argument("--no-runs", action="store_true", help="swap with runs=False: one module a conv chain, "
                    "not one Conv2dRun a run of them (to see what runs change)")
    ap.add_argument("--rest", action="store_true", help="eager acting rows: also time our network with each "
                    "swapped module's call replaced by its cached output (what the network costs besides our "
                    "layers, which both sides run in PyTorch) and its share of PyTorch's time")
    ap.add_argument("--resume", action="store_true", help="with --out: keep the rows (and the loop) that the table "
                    "already in DIR holds from a run at this commit on this machine, and run only the others (a run "
                    "stopped by a time limit goes on where it stopped)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child of run_alone
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.networks = args.networks or ",".join(NETWORKS if cuda else CPU_NETWORKS)
    thread_counts = ["all"] if cuda else args.threads.split(",")
    bad = [t for t in thread_counts if t != "all" and not t.isdigit()]
    if bad or not thread_counts:
        ap.error(f"--threads: expected counts or 'all', got {args.threads!r}")
    precisions = (args.precisions or ("default,strict,bfloat16" if cuda else "strict,bfloat16")).split(",")
    modes = (args.modes or (",".join(MODES) if cuda else "eager,compile")).split(",")
    for what, given, known in (("precision", precisions, PRECISIONS), ("mode", modes, MODES),
                               ("network", args.networks.split(","), NETWORKS)):
        bad = [v for v in given if v not in known]
        if bad:
            ap.error(f"unknown {what} {bad}; expected from {list(known)}")
    if args.torch_deterministic and not cuda:
        ap.error("--torch-deterministic: PyTorch's cuDNN determinism is a CUDA setting; expected --device cuda, "
                 f"got --device {args.device}")
    rows = args.rows.split(",")
    bad = [r for r in rows if r not in ("train", "act", "loop")]
    if bad:
        ap.error(f"unknown row {bad}; expected from ['train', 'act', 'loop']")
    if args.one:
        if len(precisions) != 1 or len(modes) != 1 or len(rows) != 1 or "," in args.networks or \
                len(thread_counts) != 1:
            ap.error("--one: expected one network, precision, mode, row and thread count")
        one(args, precisions, modes, rows)
        return
    if args.resume and not args.out:
        ap.error("--resume: expected --out DIR (the folder of the table to go on with)")
    det = args.torch_deterministic
    gpu_columns = "ours GPU ms | torch GPU ms | ratio | " if cuda else ""
    extra_columns = (" ours without its layers wall ms | / torch wall |" if args.rest else "") + \
        (" torch deterministic GPU ms | ratio |" if det else "")
    columns = (6 if cuda else 3) + (2 if det else 0) + (2 if args.rest else 0)
    thread_column = "" if cuda else "threads | "
    head = (f"| network | row | precision | mode | {thread_column}{gpu_columns}ours wall ms | torch wall ms | ratio |"
            f"{extra_columns}\n| --- | --- | --- | --- | {'' if cuda else '---: | '}{'---: | ' * columns}".rstrip())
    lines = [head]
    print(head, flush=True)
    title = "conv2d: whole networks, the module swapped in vs plain PyTorch"
    intro = ("Ratios are ours / PyTorch (below 1: ours is faster); medians over rounds timed in turns "
             "(scripts/bench_networks.py's docstring says how).")

    graph_lines: list[str] = []
    loop_lines: list[str] = []
    made = provenance(cuda) if args.out else ""  # once: on a GPU it asks nvidia-smi

    def write(done: bool) -> None:
        # After every row too, so a run stopped by a time limit leaves the rows it made,
        # marked as an unfinished run's.
        if args.out:
            body = lines + (["", GRAPHS_HEADING, "", *graph_lines] if graph_lines else []) + \
                (["", *loop_lines] if loop_lines else [])
            write_table(args.out, f"bench_networks_{args.device}.md", title, body, cuda,
                        intro if done else intro + " Unfinished: the run was stopped after the rows below.", say=done,
                        made=made)

    table = Path(args.out or ".") / f"bench_networks_{args.device}.md"
    done, graphs_done, loop_done = earlier_rows(table, head, cuda, made) if args.resume else ({}, {}, [])
    alone = args.isolate  # each row in a process of its own: asked for, or since a CUDA error
    for name in args.networks.split(",") if set(rows) - {"loop"} else []:
        for row in (r for r in rows if r != "loop"):
            for precision in precisions:
                for mode in modes:
                    for threads in thread_counts:
                        key = (name, row, precision, mode) + (() if cuda else (str(thread_count(threads)),))
                        if key in done:
                            line, graph_line = done[key], graphs_done.get(key)
                        else:
                            made_row = row_line(args, name, row, precision, mode, threads, cuda, det, columns, alone)
                            if made_row is None:
                                continue
                            line, alone, graphs = made_row
                            graph_line = graphs and f"- `{' '.join(key)}`: {graphs}"
                        lines.append(line)
                        if graph_line:
                            graph_lines.append(graph_line)
                        print(line, flush=True)
                        write(False)
    if "loop" in rows:
        if loop_done:
            loop_lines = loop_done
            print("\n".join(loop_lines), flush=True)
        elif alone:
            said = run_alone(args, "nature_dqn", precisions[0], modes[0], "loop")
            loop_lines = said.get("lines") or [f"The DQN loop: {said.get('failed')}"]
            print("\n".join(loop_lines), flush=True)
        else:
            loop_lines = loop_table(args)
    write(True)


if __name__ == "__main__":
    main()
