"""What scripts/bench_cuda.py measures, one function a measurement: our layer and module
and PyTorch's, eager and as CUDA graphs (`ours`, `pytorch`, `module_vs_torch`), acting,
the optimizer step, batch invariance, and the roofline of a step. The timing rules are
the script's docstring's."""

from __future__ import annotations

import statistics
import time

import numpy as np

from bench_shapes import flops

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
