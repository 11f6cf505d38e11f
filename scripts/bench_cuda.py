"""The CUDA backend beside PyTorch on the GPU, in one process: a training step
(forward(training) + backward_full) on the shapes of shared/BENCH.md, eager and replayed
as a CUDA graph on both sides, plus a batch sweep of rl_small.

    python scripts/bench_cuda.py [--shapes a,b] [--dtypes float32,bfloat16] [--iters 20]
                                 [--sweep 1,2,4,...] [--no-steps] [--no-tuned] [--no-module] [--no-acting]
                                 [--no-tf32] [--no-optim] [--no-invariance]
                                 [--out DIR]

PyTorch runs nn.Conv2d (+ nn.BatchNorm2d) + nn.ReLU in channels_last with
cudnn.deterministic = True and TF32 off, as ours. Each side runs with cuDNN's heuristic
plan choice (ours by default, PyTorch's cudnn.benchmark = False: the first table, unless
--no-steps, as the next two), and once more, eager
and as CUDA graphs, with plans autotuned among the deterministic ones (ours
`autotune=True`, PyTorch's cudnn.benchmark = True): a second table (unless --no-tuned).
A third table steps each layer at a second batch size (a quarter of the planned one, 8
for batch 1) without a new layer: ours planned for the shape's batch, eager and captured
at the second, beside PyTorch at the second. A fourth (unless --no-module) runs our PyTorch
module in PyTorch's own step beside the Sequential it replaces, eager (also with autograd's
backward on the calling thread) and in torch.cuda.graph, both timed in turns
(module_vs_torch).
Then (unless --no-acting) acting: evaluate at N = 1 and a synchronisation, eager and
replayed, wall time a call, beside PyTorch's eval module under no_grad; and (unless
--no-tf32) ours with allow_tf32=True beside PyTorch's float32 default (TF32,
cudnn.benchmark = True), eager and as CUDA graphs; and (unless --no-optim) Adam: our
fused step beside torch.optim.Adam(fused=True), alone and inside a whole training step
captured as one CUDA graph on each side; and (unless --no-invariance) ours with
LayerSpec.batch_invariant beside ours without: the captured step and acting at N = 1.
GPU time: CUDA
events around `iters` steps on each side's stream; wall time: perf_counter around the
same steps and a final synchronize; each the median of 5 such blocks after a warm-up,
per step. The roofline time of a step is the larger of its FLOPs (three convolutions) at
the GPU's peak (790 TFLOP/s bf16/f16 measured on this H200; 67 TFLOP/s fp32, NVIDIA's
figure for non-tensor fp32) and its unavoidable bytes at 4.3 TB/s: x read twice and d_x
written, y and the pre-activations written, the pre-activations and d_y read (itemsize x
(3|x| + 4|y|)).
With --out, writes bench_cuda.md, bench_cuda.json and bench_cuda.png there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import provenance, SHAPES, bench_spec, cases, flops, inputs  # noqa: E402

PEAK_FLOPS = {"float32": 67e12, "float16": 790e12, "bfloat16": 790e12}
PEAK_BYTES = 4.3e12


def roofline_ms(spec) -> float:
    item = 4 if spec.dtype.value == "float32" else 2
    n_x = int(np.prod(spec.input_shape))
    n_y = int(np.prod(spec.output_shape))
    return 1e3 * max(flops(spec)["step"] / PEAK_FLOPS[spec.dtype.value], item * (3 * n_x + 4 * n_y) / PEAK_BYTES)


def timed(run, event, elapsed_ms, sync, iters: int, blocks: int = 5) -> tuple[float, float]:
    run()
    sync()
    gpu, wall = [], []
    for _ in range(blocks):
        start = event()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        end = event()
        sync()
        wall.append((time.perf_counter() - t0) * 1e3 / iters)
        gpu.append(elapsed_ms(start, end) / iters)
    return statistics.median(gpu), statistics.median(wall)


def second_batch(n: int) -> int:
    return 8 if n == 1 else max(1, n // 4)


def our_layer(spec, **options):
    """A CUDA layer of `spec` with PyTorch-style random weights, and a `timed` for it
    (CUDA events on the layer's stream)."""
    from conv2d import Conv2d

    layer = Conv2d(spec, "cuda", **options)
    layer.init_weights(np.random.default_rng(0))
    cuda, stream = layer.functions.cuda, layer.functions.stream

    def event():
        e = cuda.event()
        e.record(stream)
        return e
    return layer, lambda run, iters: timed(run, event, cuda.event_elapsed_time, stream.synchronize, iters)


def on_device(layer, *host):
    """Host arrays as device arrays on the layer's stream (bfloat16 as its bits)."""
    from conv2d.cuda.runtime import to_device_bits

    fn = layer.functions
    return [fn.cuda.to_device(to_device_bits(a), stream=fn.stream) for a in host]


def torch_timed(run, iters: int) -> tuple[float, float]:
    """`timed` with CUDA events on torch's current stream."""
    import torch

    def event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return timed(run, event, lambda a, b: a.elapsed_time(b), torch.cuda.synchronize, iters)


class Captured:
    """A CUDA graph with what its replays read and write kept alive: `step` (a closure
    over the model, its optimizer and inputs). A graph holds the addresses of the
    parameters, gradients and optimizer state its capture used, not the tensors; dropped,
    they go back to torch's allocator while replays still write into them (the blocks
    handed to whatever asks next)."""

    def __init__(self, graph, step) -> None:
        self.graph, self.step = graph, step

    def replay(self) -> None:
        self.graph.replay()


def torch_graph(step, warmup=None, no_grad: bool = False) -> Captured:
    """`step` captured in a CUDA graph after three `warmup` calls (default `step`) on a side
    stream, PyTorch's capture recipe; `no_grad` runs both under torch.no_grad. The
    result keeps `step` (and so what it closes over) alive with the graph."""
    import contextlib

    import torch

    grad = torch.no_grad if no_grad else contextlib.nullcontext
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), grad():
        for _ in range(3):
            (warmup or step)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), grad():
        step()
    return Captured(graph, (step, warmup))


def torch_dtype(spec):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.dtype.value]


def torch_sequential(spec):
    """PyTorch's Conv2d (+ BatchNorm2d) + ReLU for `spec`, channels_last, in the spec's dtype."""
    import torch

    layers = [torch.nn.Conv2d(spec.in_channels, spec.out_channels, spec.kernel, spec.stride, spec.padding,
                              dilation=spec.dilation, groups=spec.groups)]
    if spec.normalization.value == "batch_norm":
        layers.append(torch.nn.BatchNorm2d(spec.out_channels, eps=spec.bn_epsilon, momentum=spec.bn_momentum))
    layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).cuda().to(dtype=torch_dtype(spec), memory_format=torch.channels_last)


def torch_nchw(a: np.ndarray, spec):
    """An (N, H, W, C) host array as an NCHW view of a channels_last CUDA tensor."""
    import torch

    return torch.from_numpy(a.astype(np.float32)).cuda().to(torch_dtype(spec)).permute(0, 3, 1, 2)


def ours(spec, x_host, dy_host, iters: int, eager: bool = True, autotune: bool = False, planned=None,
         allow_tf32: bool = False, **options) -> dict:
    """Our step on x_host, dy_host; the layer is planned for `planned` (a spec; default
    `spec`); `options`: more of the backend's."""
    layer, ours_timed = our_layer(planned or spec, autotune=autotune, allow_tf32=allow_tf32, **options)
    x, dy = on_device(layer, x_host, dy_host)
    out = {}
    if eager:
        def step():
            layer.forward(x, training=True)
            layer.backward_full(x, dy)
        out["eager"] = ours_timed(step, iters)
    out["graph"] = ours_timed(layer.capture(x, dy).replay, iters)
    return out


def our_module(spec, cuda_graphs: bool = True):
    """conv2d.torch.Conv2dNormActivation of `spec` (ReLU) on the GPU in the spec's dtype, training."""
    from conv2d.torch import Conv2dNormActivation

    return Conv2dNormActivation(spec.in_channels, spec.out_channels, spec.kernel, spec.stride, spec.padding,
                                dilation=spec.dilation, groups=spec.groups, norm=spec.normalization.value, activation="relu", eps=spec.bn_epsilon,
                                momentum=spec.bn_momentum, device="cuda",
                                cuda_graphs=cuda_graphs).to(torch_dtype(spec)).train()


def pytorch(spec, x_host, dy_host, iters: int, eager: bool = True, benchmark: bool = False,
            tf32: bool = False) -> dict:
    """PyTorch's Sequential step; with `tf32`, PyTorch's float32 default (TF32
    convolutions, nondeterministic algorithms allowed)."""
    import torch

    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.deterministic = not tf32
    step = torch_step(torch_sequential(spec).train(), x_host, dy_host, spec)
    out = {}
    if eager:
        out["eager"] = torch_timed(step, iters)
    out["graph"] = torch_timed(torch_graph(step).replay, iters)
    return out


def torch_step(model, x_host, dy_host, spec):
    """PyTorch's training step of `model` on x (requiring grad) and d_y: forward and
    backward, the parameters' gradients accumulating, as ours."""
    x = torch_nchw(x_host, spec).requires_grad_(True)
    dy = torch_nchw(dy_host, spec)

    def step():
        x.grad = None
        model(x).backward(dy)
    return step


MODULE_RUNS = ("torch", "module", "launched", "torch, calling thread", "module, calling thread")


def module_vs_torch(spec, x_host, dy_host, iters: int, rounds: int = 3) -> dict:
    """Our Conv2dNormActivation in PyTorch's step beside PyTorch's Sequential, timed in
    turns so that each ratio compares the host at the same moment: `rounds` rounds, each
    timing (`torch_timed`) every one of MODULE_RUNS once: PyTorch; the module (its
    default, calls replayed as CUDA graphs where the addresses repeat); "launched"
    (cuda_graphs=False, every call launches); and PyTorch and the module with autograd's
    backward on the calling thread (torch.autograd.set_multithreading_enabled(False); by
    default a CUDA backward runs on autograd's device thread). Each run's (GPU, wall) is
    the median over its rounds; then both models' steps in torch.cuda.graph ("torch
    graph", "module graph"), and the module's `graph_counts()` ("counts")."""
    import torch

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    steps = {"torch": torch_step(torch_sequential(spec).train(), x_host, dy_host, spec)}
    module = our_module(spec)
    steps["module"] = torch_step(module, x_host, dy_host, spec)
    steps["launched"] = torch_step(our_module(spec, cuda_graphs=False), x_host, dy_host, spec)
    timings = {run: [] for run in MODULE_RUNS}
    for _ in range(rounds):
        for run in MODULE_RUNS:
            model, _, thread = run.partition(", ")
            torch.autograd.set_multithreading_enabled(not thread)
            try:
                timings[run].append(torch_timed(steps[model], iters))
            finally:
                torch.autograd.set_multithreading_enabled(True)
    out = {run: tuple(statistics.median(t[i] for t in ts) for i in (0, 1)) for run, ts in timings.items()}
    out["counts"] = module.graph_counts()  # how its eager calls went: replays, captures, launches
    out["torch graph"] = torch_timed(torch_graph(steps["torch"]).replay, iters)
    out["module graph"] = torch_timed(torch_graph(steps["module"]).replay, iters)
    return out


def optim_ours(spec, x_host, dy_host, iters: int) -> dict:
    """Our Adam (preset "torch") on one layer: the optimizer step alone, eager (one fused
    launch), and the whole training step (zero_gradient, forward, backward_full, step)
    captured as one CUDA graph."""
    from conv2d.optim import Adam

    layer, ours_timed = our_layer(spec)
    opt = Adam(layer, preset="torch")
    x, dy = on_device(layer, x_host, dy_host)
    out = {"step": ours_timed(opt.step, iters)}
    out["graph"] = ours_timed(layer.capture(x, dy, optimizer=opt).replay, iters)
    return out


def optim_pytorch(spec, x_host, dy_host, iters: int) -> dict:
    """torch.optim.Adam(fused=True, capturable=True) on PyTorch's Sequential: the whole
    training step (zero_grad, forward, backward, step) in a CUDA graph, as PyTorch's
    whole-network capture recipe does it, and the step alone, eager."""
    import torch

    # The strict comparison's settings, whatever ran before (the TF32 table turns
    # cudnn.benchmark on; autotuned plans against our heuristic ones would not compare).
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = False, False
    torch.backends.cudnn.deterministic = True
    model = torch_sequential(spec).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True, capturable=True)
    # x requires grad: ours computes d_x in its whole step (backward_full), so PyTorch's
    # step runs the backward-data convolution too.
    x, dy = torch_nchw(x_host, spec).requires_grad_(True), torch_nchw(dy_host, spec)

    def train():
        x.grad = None
        model(x).backward(dy)
        opt.step()

    def warmup():
        opt.zero_grad(set_to_none=True)
        train()
        opt.zero_grad(set_to_none=True)  # the capture's backward allocates the gradients in its pool
    graph = torch_graph(train, warmup)
    out = {"graph": torch_timed(graph.replay, iters)}  # first: the replays fill the gradients the step reads
    out["step"] = torch_timed(opt.step, iters)
    return out


def acting_ours(spec, x_host, iters: int, evaluate_kernel: str = "cudnn") -> dict:
    """evaluate at N = 1 and a synchronisation, wall ms per call: eager and captured."""
    layer, ours_timed = our_layer(spec, evaluate_kernel=evaluate_kernel)
    x, = on_device(layer, x_host[:1])
    stream = layer.functions.stream

    def act():
        layer.evaluate(x)
        stream.synchronize()
    out = {"eager": ours_timed(act, iters)}
    graph = layer.capture_evaluate(x)

    def replay():
        graph.replay()
        stream.synchronize()
    out["graph"] = ours_timed(replay, iters)
    return out


def acting_pytorch(spec, x_host, iters: int) -> dict:
    """PyTorch's Sequential in eval under no_grad at N = 1, then torch.cuda.synchronize:
    eager and replayed as a CUDA graph."""
    import torch

    model = torch_sequential(spec).eval()
    x = torch_nchw(x_host[:1], spec)

    def act():
        with torch.no_grad():
            model(x)
        torch.cuda.synchronize()
    out = {"eager": torch_timed(act, iters)}
    graph = torch_graph(lambda: model(x), no_grad=True)

    def replay():
        graph.replay()
        torch.cuda.synchronize()
    out["graph"] = torch_timed(replay, iters)
    return out


def keeps_rows(run, x_host) -> bool:
    """Whether `run(x)` (an (N, ...) host array in, host rows out) gives rows 0, N // 2
    and N - 1 of x_host, byte for byte, as it gives each sample computed alone."""
    n = x_host.shape[0]
    batched = run(x_host)
    return all(batched[i].tobytes() == run(x_host[i:i + 1])[0].tobytes() for i in sorted({0, n // 2, n - 1}))


def invariance_ours(spec, x_host) -> bool:
    """keeps_rows for our layer's evaluate (weights as acting_ours's)."""
    from conv2d.arrays import to_host

    layer, _ = our_layer(spec)
    return keeps_rows(lambda a: to_host(layer.evaluate(np.ascontiguousarray(a))), x_host)


def invariance_pytorch(spec, x_host) -> bool:
    """keeps_rows for PyTorch's Sequential in eval under no_grad."""
    import torch

    model = torch_sequential(spec).eval()

    def run(a):
        with torch.no_grad():
            return model(torch_nchw(np.ascontiguousarray(a), spec)).permute(0, 2, 3, 1).float().cpu().numpy()
    return keeps_rows(run, x_host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", default="1,2,4,8,16,32,64,128,256,512,1024",
                    help="batch sizes of the rl_small sweep (bfloat16, batch norm); empty for none")
    ap.add_argument("--no-tuned", action="store_true", help="skip the autotuned table")
    ap.add_argument("--no-steps", action="store_true",
                    help="skip the training-step tables (heuristic, autotuned, second batch size)")
    ap.add_argument("--no-module", action="store_true", help="skip the PyTorch-module table")
    ap.add_argument("--no-acting", action="store_true", help="skip the acting table (evaluate at N = 1)")
    ap.add_argument("--no-tf32", action="store_true", help="skip the TF32 table")
    ap.add_argument("--no-optim", action="store_true", help="skip the optimizer table (Adam step, whole step graph)")
    ap.add_argument("--no-invariance", action="store_true",
                    help="skip the batch-invariance table (batch_invariant=True beside the default)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rows, tuned_lines = [], []
    lines = [f"# conv2d CUDA backend vs PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: "
             f"training step (forward + backward_full), median ms per step", "", provenance(gpu=True)]
    if not args.no_steps:
        lines += ["", "## cuDNN's heuristic plans (ours by default; PyTorch cudnn.benchmark = False)", "",
                  "| shape | norm | dtype | ours eager wall | torch eager wall | ratio | ours eager GPU "
                  "| torch eager GPU | ratio | ours graph GPU | torch graph GPU | ratio | roofline "
                  "| ours best graph % of roofline |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    tuned_head = ["", "## Plans autotuned among the deterministic ones (ours autotune=True; PyTorch "
                  "cudnn.benchmark = True)", "",
                  "| shape | norm | dtype | ours eager wall | torch eager wall | ratio | ours graph GPU "
                  "| torch graph GPU | ratio |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    second_head = ["", "## A second batch size, same layer (ours planned for the shape's batch; heuristic plans)", "",
                   "| shape | norm | dtype | N | ours eager wall | torch eager wall | ratio | ours graph GPU "
                   "| torch graph GPU | ratio |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    second_lines = []
    depthwise_head = ["", "## Depthwise layers: ours by default (the numba kernels, depthwise_kernel=\"auto\") beside "
                      "ours through cuDNN's graph (depthwise_kernel=\"cudnn\") and PyTorch", "",
                      "| shape | norm | dtype | numba eager wall | cuDNN eager wall | torch eager wall | numba / torch "
                      "| numba graph GPU | cuDNN graph GPU | torch graph GPU | numba / torch |",
                      "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    depthwise_lines = []
    module_head = ["", "## The PyTorch module (conv2d.torch.Conv2dNormActivation) in a PyTorch step, beside "
                   "PyTorch's Sequential (channels_last; heuristic plans; timed in turns, median of 3 rounds)", "",
                   "(module: the default, eager calls replayed as CUDA graphs where the addresses repeat; "
                   "launched: cuda_graphs=False, every call launches; calling thread: "
                   "torch.autograd.set_multithreading_enabled(False) on both sides; graph: the whole step in "
                   "torch.cuda.graph)", "",
                   "| shape | norm | dtype | module eager wall | torch eager wall | ratio | module eager GPU "
                   "| torch eager GPU | launched wall | ratio | module wall, calling thread | torch wall, calling "
                   "thread | ratio | module graph GPU | torch graph GPU | ratio |",
                   "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                   "| ---: | ---: |"]
    module_lines = []
    print("\n".join(lines), flush=True)
    nan = (float("nan"), float("nan"))
    for name, bn, spec, x, dy in cases(args.shapes, args.dtypes):
        if not args.no_module:
            m = module_vs_torch(spec, x, dy, args.iters)
            wall = {run: m[run][1] for run in MODULE_RUNS}
            module_line = (f"| {name} | {'bn' if bn else '-'} | {spec.dtype.value} | {wall['module']:.3f} "
                           f"| {wall['torch']:.3f} | {wall['module'] / wall['torch']:.2f} | {m['module'][0]:.3f} "
                           f"| {m['torch'][0]:.3f} | {wall['launched']:.3f} | {wall['launched'] / wall['torch']:.2f} "
                           f"| {wall['module, calling thread']:.3f} | {wall['torch, calling thread']:.3f} "
                           f"| {wall['module, calling thread'] / wall['torch, calling thread']:.2f} "
                           f"| {m['module graph'][0]:.3f} | {m['torch graph'][0]:.3f} "
                           f"| {m['module graph'][0] / m['torch graph'][0]:.2f} |")
            module_lines.append(module_line)
            print(module_line, f"(module calls: {m['counts']})", flush=True)
        if args.no_steps:
            continue
        o, t = ours(spec, x, dy, args.iters), pytorch(spec, x, dy, args.iters)
        if args.no_tuned:
            o_tuned = t_tuned = {"eager": nan, "graph": nan}
        else:
            o_tuned = ours(spec, x, dy, args.iters, autotune=True)
            t_tuned = pytorch(spec, x, dy, args.iters, benchmark=True)
        n2 = second_batch(spec.batch_size)
        spec2 = bench_spec(name, bn, spec.dtype.value, batch_size=n2)
        x2, dy2 = inputs(spec2)
        o2, t2 = ours(spec2, x2, dy2, args.iters, planned=spec), pytorch(spec2, x2, dy2, args.iters)
        second = (f"| {name} | {'bn' if bn else '-'} | {spec.dtype.value} | {n2} | {o2['eager'][1]:.3f} "
                  f"| {t2['eager'][1]:.3f} | {o2['eager'][1] / t2['eager'][1]:.2f} | {o2['graph'][0]:.3f} "
                  f"| {t2['graph'][0]:.3f} | {o2['graph'][0] / t2['graph'][0]:.2f} |")
        second_lines.append(second)
        o["tuned_eager"], o["tuned_graph"] = o_tuned["eager"], o_tuned["graph"]
        t["tuned_eager"], t["tuned_graph"] = t_tuned["eager"], t_tuned["graph"]
        roof = roofline_ms(spec)
        best = min(o["graph"][0], o["tuned_graph"][0])
        row = {"shape": name, "batch_norm": bn, "dtype": spec.dtype.value, "roofline_ms": roof,
               **{f"ours_{k}_{w}_ms": v[i] for k, v in o.items() for i, w in enumerate(("gpu", "wall"))},
               **{f"torch_{k}_{w}_ms": v[i] for k, v in t.items() for i, w in enumerate(("gpu", "wall"))}}
        rows.append(row)
        case = f"| {name} | {'bn' if bn else '-'} | {spec.dtype.value} "
        line = (case + f"| {o['eager'][1]:.3f} | {t['eager'][1]:.3f} | {o['eager'][1] / t['eager'][1]:.2f} "
                f"| {o['eager'][0]:.3f} | {t['eager'][0]:.3f} | {o['eager'][0] / t['eager'][0]:.2f} "
                f"| {o['graph'][0]:.3f} | {t['graph'][0]:.3f} | {o['graph'][0] / t['graph'][0]:.2f} "
                f"| {roof:.4f} | {100 * roof / best:.1f} |")
        tuned = (case + f"| {o['tuned_eager'][1]:.3f} | {t['tuned_eager'][1]:.3f} "
                 f"| {o['tuned_eager'][1] / t['tuned_eager'][1]:.2f} | {o['tuned_graph'][0]:.3f} "
                 f"| {t['tuned_graph'][0]:.3f} | {o['tuned_graph'][0] / t['tuned_graph'][0]:.2f} |")
        lines.append(line)
        tuned_lines.append(tuned)
        print(line, "\n" + tuned, "\n" + second, flush=True)
        if spec.groups > 1 and spec.groups == spec.in_channels:
            o_dnn = ours(spec, x, dy, args.iters, depthwise_kernel="cudnn")
            depthwise = (case + f"| {o['eager'][1]:.3f} | {o_dnn['eager'][1]:.3f} | {t['eager'][1]:.3f} "
                         f"| {o['eager'][1] / t['eager'][1]:.2f} | {o['graph'][0]:.3f} | {o_dnn['graph'][0]:.3f} "
                         f"| {t['graph'][0]:.3f} | {o['graph'][0] / t['graph'][0]:.2f} |")
            depthwise_lines.append(depthwise)
            print(depthwise, flush=True)
    if not args.no_steps:
        if not args.no_tuned:
            lines += tuned_head + tuned_lines
        lines += second_head + second_lines
        if depthwise_lines:
            lines += depthwise_head + depthwise_lines
    if not args.no_module:
        lines += module_head + module_lines
    if not args.no_acting:
        head = ["", "## Acting: evaluate at N = 1 and a synchronisation, wall ms per call (PyTorch: eval, no_grad)",
                "(ours direct: evaluate_kernel=\"direct\", one kernel for the convolution, norm and activation; "
                "not for layer norm)", "",
                "| shape | norm | dtype | ours eager | torch eager | ratio | ours graph | torch graph | ratio "
                "| ours direct eager | ratio | ours direct graph | ratio |",
                "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += head
        print("\n".join(head), flush=True)
        for name, bn, spec, x, _ in cases(args.shapes, args.dtypes):
            one = bench_spec(name, bn, spec.dtype.value, batch_size=1)
            o, t = acting_ours(one, x, args.iters), acting_pytorch(one, x, args.iters)
            dr = acting_ours(one, x, args.iters, evaluate_kernel="direct")
            line = (f"| {name} | {'bn' if bn else '-'} | {spec.dtype.value} | {o['eager'][1]:.4f} "
                    f"| {t['eager'][1]:.4f} | {o['eager'][1] / t['eager'][1]:.2f} | {o['graph'][1]:.4f} "
                    f"| {t['graph'][1]:.4f} | {o['graph'][1] / t['graph'][1]:.2f} | {dr['eager'][1]:.4f} "
                    f"| {dr['eager'][1] / t['eager'][1]:.2f} | {dr['graph'][1]:.4f} "
                    f"| {dr['graph'][1] / t['graph'][1]:.2f} |")
            lines.append(line)
            print(line, flush=True)
    if not args.no_tf32 and "float32" in args.dtypes.split(","):
        head = ["", "## TF32: ours allow_tf32=True beside PyTorch's float32 default (TF32, cudnn.benchmark = True), "
                "training step (ours tuned: also autotune=True, plans timed among TF32's)", "",
                "| shape | norm | ours eager wall | torch eager wall | ratio | ours graph GPU "
                "| torch graph GPU | ratio | ours tuned graph GPU | ratio |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += head
        print("\n".join(head), flush=True)
        for name, bn, spec, x, dy in cases(args.shapes, "float32"):
            o = ours(spec, x, dy, args.iters, allow_tf32=True)
            tuned = ours(spec, x, dy, args.iters, eager=False, autotune=True, allow_tf32=True)
            t = pytorch(spec, x, dy, args.iters, benchmark=True, tf32=True)
            line = (f"| {name} | {'bn' if bn else '-'} | {o['eager'][1]:.3f} | {t['eager'][1]:.3f} "
                    f"| {o['eager'][1] / t['eager'][1]:.2f} | {o['graph'][0]:.3f} | {t['graph'][0]:.3f} "
                    f"| {o['graph'][0] / t['graph'][0]:.2f} | {tuned['graph'][0]:.3f} "
                    f"| {tuned['graph'][0] / t['graph'][0]:.2f} |")
            lines.append(line)
            print(line, flush=True)
        # the strict comparison's settings again for what follows
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = False, True
        torch.backends.cudnn.benchmark = False
    if not args.no_optim:
        head = ["", "## Adam: the optimizer step alone (eager) and the whole training step (zero grad, forward, "
                "backward, step) as one CUDA graph; ours conv2d.optim.Adam(preset='torch') (16-bit layers keep "
                "float32 masters), PyTorch torch.optim.Adam(fused=True, capturable=True)", "",
                "| shape | norm | dtype | ours step wall | torch step wall | ratio | ours step GPU | torch step GPU "
                "| ratio | ours whole-step graph GPU | torch whole-step graph GPU | ratio |",
                "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += head
        print("\n".join(head), flush=True)
        for name, bn, spec, x, dy in cases(args.shapes, args.dtypes):
            o, t = optim_ours(spec, x, dy, args.iters), optim_pytorch(spec, x, dy, args.iters)
            line = (f"| {name} | {'bn' if bn else '-'} | {spec.dtype.value} | {o['step'][1]:.4f} "
                    f"| {t['step'][1]:.4f} | {o['step'][1] / t['step'][1]:.2f} | {o['step'][0]:.4f} "
                    f"| {t['step'][0]:.4f} | {o['step'][0] / t['step'][0]:.2f} | {o['graph'][0]:.3f} "
                    f"| {t['graph'][0]:.3f} | {o['graph'][0] / t['graph'][0]:.2f} |")
            lines.append(line)
            print(line, flush=True)
    if not args.no_invariance:
        head = ["", "## Batch invariance: ours with batch_invariant=True (one cuDNN plan at every batch size) beside "
                "the default (cuDNN's heuristic plan per batch size); whether evaluate at the planned batch gives "
                "rows 0, N/2 and N - 1 bitwise as each sample alone (PyTorch: its eval Sequential); captured training "
                "step at the planned batch, GPU ms; acting at N = 1 (evaluate and a synchronisation), wall ms", "",
                "| shape | norm | dtype | invariant: PyTorch | ours default | ours batch_invariant "
                "| default graph GPU | invariant graph GPU | ratio | default acting eager "
                "| invariant acting eager | ratio | default acting graph | invariant acting graph | ratio |",
                "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += head
        print("\n".join(head), flush=True)
        for name, bn, spec, x, dy in cases(args.shapes, args.dtypes):
            inv = dataclasses.replace(spec, batch_invariant=True)
            one = bench_spec(name, bn, spec.dtype.value, batch_size=1)
            d_step, i_step = (ours(s, x, dy, args.iters, eager=False) for s in (spec, inv))
            one_inv = dataclasses.replace(one, batch_invariant=True)
            d_act, i_act = (acting_ours(s, x, args.iters) for s in (one, one_inv))
            yes = {True: "yes", False: "no"}
            kept = (yes[invariance_pytorch(spec, x)], yes[invariance_ours(spec, x)], yes[invariance_ours(inv, x)])
            line = (f"| {name} | {'bn' if bn else '-'} | {spec.dtype.value} | {' | '.join(kept)} "
                    f"| {d_step['graph'][0]:.3f} "
                    f"| {i_step['graph'][0]:.3f} | {i_step['graph'][0] / d_step['graph'][0]:.2f} "
                    f"| {d_act['eager'][1]:.4f} | {i_act['eager'][1]:.4f} "
                    f"| {i_act['eager'][1] / d_act['eager'][1]:.2f} | {d_act['graph'][1]:.4f} "
                    f"| {i_act['graph'][1]:.4f} | {i_act['graph'][1] / d_act['graph'][1]:.2f} |")
            lines.append(line)
            print(line, flush=True)
    sweep = []
    if args.sweep:
        head = ["", "## Batch sweep: rl_small, bfloat16, batch norm, CUDA-graph GPU ms per step", "",
                "| N | ours graph GPU | torch graph GPU | ratio | roofline |", "| ---: | ---: | ---: | ---: | ---: |"]
        lines += head
        print("\n".join(head), flush=True)
        for n in (int(v) for v in args.sweep.split(",")):
            spec = bench_spec("rl_small", True, "bfloat16", batch_size=n)
            x, dy = inputs(spec)
            o, t = ours(spec, x, dy, args.iters, eager=False), pytorch(spec, x, dy, args.iters, eager=False)
            sweep.append({"batch_size": n, "ours_graph_gpu_ms": o["graph"][0], "torch_graph_gpu_ms": t["graph"][0],
                          "roofline_ms": roofline_ms(spec)})
            line = (f"| {n} | {o['graph'][0]:.3f} | {t['graph'][0]:.3f} | {o['graph'][0] / t['graph'][0]:.2f} "
                    f"| {roofline_ms(spec):.4f} |")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_cuda.md").write_text("\n".join(lines) + "\n")
        (args.out / "bench_cuda.json").write_text(json.dumps({"steps": rows, "sweep": sweep}, indent=1))
        if sweep:
            _plot(sweep, args.out / "bench_cuda.png")


def _plot(sweep: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["batch_size"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(n, [r["ours_graph_gpu_ms"] for r in sweep], "o-", label="conv2d (CUDA graph)")
    ax.loglog(n, [r["torch_graph_gpu_ms"] for r in sweep], "s-", label="PyTorch (CUDA graph)")
    ax.loglog(n, [r["roofline_ms"] for r in sweep], "--", label="roofline")
    ax.set_xlabel("batch size N")
    ax.set_ylabel("GPU ms per training step")
    ax.set_title("rl_small, bfloat16, batch norm")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
