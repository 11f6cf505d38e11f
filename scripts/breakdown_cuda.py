"""Where the GPU time of one CUDA training step goes: each cuDNN execute and each kernel
launch of forward(training) + backward_full timed with CUDA events on the layer's
stream, and the whole step replayed as a CUDA graph; optionally swept over the row
kernels' launch shape (blocks at most, rows loaded ahead, partials loaded ahead in phase
two, blocks a group in phase two's first level, lane groups read with 8-byte loads or
one channel a thread).

    python scripts/breakdown_cuda.py [--shapes resnet_28,rl_small] [--dtypes bfloat16] [--bn 1]
                                     [--max-blocks 1056,264] [--unroll 4,8] [--wide 1,0]
                                     [--phase-two-unroll 4,16] [--phase-group 16,32] [--steps 20]
                                     [--depthwise-kernel cudnn] [--depthwise-variants strip,value]

`--depthwise-kernel` is the backend option of that name ("auto", the default, runs a
depthwise shape's convolutions through the numba kernels; "cudnn" through cuDNN's
graphs); `--depthwise-variants` times the numba kernels as the backend picks them
("strip": a strip of values along the width a thread, where the indices fit 31 bits) and
forced to "value" (one value a thread with 64-bit indices and the simple weight
gradient, as for a layer whose indices pass 31 bits), to compare the kernels in one run.

Row kernels also print the bandwidth they reach: the bytes they must move (z read; d_y
read by the gradient passes; y or d_z written) over their time. Events between launches
add a little time to each piece; the graph column has none.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections import defaultdict

import numpy as np

from bench_shapes import bench_spec, inputs

# Values of (M, C) each row pass reads and writes: z, plus d_y, plus y or d_z.
ROW_TRAFFIC = {"batch_norm_statistics": 1, "normalise_and_activate": 2, "norm_gradients": 2, "grad_pre_activations": 3}


VARIANTS = ("strip", "value")


@contextlib.contextmanager
def depthwise_variant(variant: str):
    """The numba depthwise kernels as `variant` names them (see the module docstring),
    for the layers made inside: the factories' choices replaced for the while."""
    from conv2d.cuda import depthwise as layer
    from conv2d.cuda.kernels import depthwise as kernels

    saved = layer.SMALL_INDEX
    if variant == "value":
        layer.SMALL_INDEX = -1
    kernels.fast_depthwise_kernels.cache_clear()
    try:
        yield
    finally:
        layer.SMALL_INDEX = saved
        kernels.fast_depthwise_kernels.cache_clear()


def measure(spec, steps: int, config, depthwise_kernel: str = "auto") -> tuple[dict[str, float], float, int, str]:
    """(median ms of each labelled piece of an eager step, GPU ms of the step as a graph,
    the row kernels' block count, the convolutions' kernels the layer took: "numba" or
    "cudnn")."""
    from conv2d import Conv2d
    from conv2d.cuda import cudnn_execution
    from conv2d.cuda.launch import Launch
    from conv2d.cuda.runtime import to_device_bits

    layer = Conv2d(spec, "cuda", launch_config=config, depthwise_kernel=depthwise_kernel)
    layer.init_weights(np.random.default_rng(0))
    impl = layer.functions
    cuda, stream = impl.cuda, impl.stream
    x_host, dy_host = inputs(spec)
    x = cuda.to_device(to_device_bits(x_host), stream=stream)
    dy = cuda.to_device(to_device_bits(dy_host), stream=stream)

    def step():
        layer.forward(x, training=True)
        layer.backward_full(x, dy)

    for _ in range(3):
        step()
    stream.synchronize()

    pieces: list[tuple[str, object, object]] = []
    launch_call, execute_run = Launch.__call__, cudnn_execution.Execution.run

    def timed(label, run):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        run()
        end.record(stream)
        pieces.append((label, start, end))

    for (_, key), launch in impl.launches.items():
        launch.label = key.step
    for plan in impl._plans.values():  # the numba depthwise convolutions keep launches of their own
        for key, launch in getattr(plan.conv, "_launches", {}).items():
            launch.label = key.step

    Launch.__call__ = lambda self, **args: timed(getattr(self, "label", "kernel"), lambda: launch_call(self, **args))
    cudnn_execution.Execution.run = lambda self: timed(self.graph.op, lambda: execute_run(self))
    try:
        per = defaultdict(list)
        for _ in range(steps):
            pieces.clear()
            step()
            stream.synchronize()
            seen = defaultdict(float)
            for label, start, end in pieces:
                seen[label] += cuda.event_elapsed_time(start, end)
            for label, ms in seen.items():
                per[label].append(ms)
    finally:
        Launch.__call__, cudnn_execution.Execution.run = launch_call, execute_run

    graph = layer.capture(x, dy)
    medians = {k: statistics.median(v) for k, v in per.items()}
    return medians, gpu_ms(cuda, stream, graph.replay, steps), plan_blocks(impl), impl.depthwise_kernel


def gpu_ms(cuda, stream, fn, n: int = 10) -> float:
    """GPU ms of one call of `fn` on `stream`: CUDA events around n calls, median of 3."""
    fn()
    rounds = []
    for _ in range(3):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        for _ in range(n):
            fn()
        end.record(stream)
        end.synchronize()
        rounds.append(cuda.event_elapsed_time(start, end) / n)
    return statistics.median(rounds)


def plan_blocks(impl) -> int:
    """The row kernels' block count of the layer's planned shape."""
    return next(iter(impl._plans.values())).P


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="resnet_28,resnet_56,rl_small")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--bn", default="1", help="comma list of 0/1")
    ap.add_argument("--max-blocks", default="", help="comma list of LaunchConfig.row_max_blocks values")
    ap.add_argument("--unroll", default="", help="comma list of LaunchConfig.row_unroll values")
    ap.add_argument("--wide", default="", help="comma list of LaunchConfig.wide_rows values (1/0)")
    ap.add_argument("--phase-two-unroll", default="", help="comma list of LaunchConfig.phase_two_unroll values")
    ap.add_argument("--phase-group", default="", help="comma list of LaunchConfig.phase_group values")
    ap.add_argument("--bounded", default="", help="comma list of LaunchConfig.row_bounded values (1/0)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--depthwise-kernel", default="auto", choices=("auto", "cudnn", "numba"))
    ap.add_argument("--depthwise-variants", default="strip", help="comma list of strip, value")
    args = ap.parse_args()
    variants = args.depthwise_variants.split(",")
    if not set(variants) <= set(VARIANTS):
        ap.error(f"--depthwise-variants: expected a comma list of {', '.join(VARIANTS)}, got {args.depthwise_variants!r}")

    from conv2d.cuda import kernels as K

    d = K.DEFAULT_CONFIG
    blocks = [int(v) for v in args.max_blocks.split(",") if v] or [d.row_max_blocks]
    unrolls = [int(v) for v in args.unroll.split(",") if v] or [d.row_unroll]
    wides = [v == "1" for v in args.wide.split(",") if v] or [d.wide_rows]
    twos = [int(v) for v in args.phase_two_unroll.split(",") if v] or [d.phase_two_unroll]
    groups = [int(v) for v in args.phase_group.split(",") if v] or [d.phase_group]
    bounds = [v == "1" for v in args.bounded.split(",") if v] or [d.row_bounded]
    sweep = [(w, u, t, g, b, lb) for w in wides for u in unrolls for t in twos for g in groups for b in blocks
             for lb in bounds]
    for wide, unroll, two, group, max_blocks, bounded in sweep:
        config = K.LaunchConfig(wide_rows=wide, row_unroll=unroll, phase_two_unroll=two, row_max_blocks=max_blocks,
                                phase_group=group, row_bounded=bounded)
        for shape in args.shapes.split(","):
            for dtype in args.dtypes.split(","):
                for bn, variant in ((b, v) for b in args.bn.split(",") for v in variants):
                    spec = bench_spec(shape, bn == "1", dtype)
                    with depthwise_variant(variant):
                        pieces, graph_ms, P, convolutions = measure(spec, args.steps, config,
                                                                    args.depthwise_kernel)
                    item = 4 if dtype == "float32" else 2
                    values = int(np.prod(spec.output_shape))
                    parts = []
                    for label, ms in pieces.items():
                        text = f"{label} {1e3 * ms:.1f}"
                        if label in ROW_TRAFFIC:
                            text += f" ({ROW_TRAFFIC[label] * values * item / (ms * 1e-3) / 1e12:.2f} TB/s)"
                        parts.append(text)
                    shown = f" depthwise={variant}" if convolutions == "numba" else ""
                    print(f"{shape} {dtype} bn={bn}{shown} wide={int(wide)} unroll={unroll} "
                          f"phase_two_unroll={two} phase_group={group} bounded={int(bounded)} blocks={P}: graph {1e3 * graph_ms:.1f} us, "
                          f"eager pieces {1e3 * sum(pieces.values()):.1f} us = " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    main()
