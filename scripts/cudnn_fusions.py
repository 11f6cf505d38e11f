"""Which of cuDNN's runtime fusions the layer could use, measured on this GPU: for layer
shapes of the benchmark networks (their training batches) and each dtype, every fused
graph below is built through the frontend as conv2d.cuda.cudnn builds the layer's own
(deterministic engines only: NONDETERMINISTIC deselected; float32 without TF32's
TENSOR_CORE / DOWN_CONVERT_INPUTS engines; 16-bit types without REDUCED_PRECISION_REDUCTION),
executed, checked against PyTorch in float64, executed again (bitwise the same?), and
timed against the unfused work it would replace: the lone convolution graph plus
PyTorch's ops for the rest.

    python scripts/cudnn_fusions.py [--dtypes float32,bfloat16,float16] [--iters 50] [--out DIR]

Fusions (the patterns of the cuDNN frontend's samples and NVIDIA's fused ResNet blocks):
  conv_bias_relu      fprop + bias + ReLU, y only (the layer's evaluate without a norm)
  conv_genstats       fprop, and batch norm's per-channel sum and sum of squares (genstats)
  sbr_conv_genstats   scale + bias + ReLU of the input (the previous layer's norm applied
                      in the prologue), fprop, genstats
  dgrad_drelu         dgrad, times the ReLU derivative of the previous layer's output
  conv_bias_pre_relu  fprop + bias kept (the pre-activations a backward needs) and its ReLU

Each fusion is measured in a process of its own (`--here`: in this one), so that an
engine that breaks the CUDA context loses only its own fusion's later rows. A row's
status says where a fusion stopped: "no plan" (no deterministic engine passed
check_support or build), "execute failed", "process died", or "ok"; "error" is the largest absolute
difference from float64 over the largest absolute reference value; "fused / unfused" the
ratio of GPU times by CUDA events (each the median of 3 rounds of --iters executions).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from bench_shapes import write_table

# (name, N, C, H, OC, kernel, stride, padding): layers of scripts/bench_networks.py's
# networks at their GPU training batches (docs/bench_shapes.md).
SHAPES = [("impala 32->32 3x3", 256, 32, 16, 32, 3, 1, 1),
          ("mobilenet 16->96 1x1", 128, 16, 32, 96, 1, 1, 0),
          ("cifar 64->64 3x3", 128, 64, 32, 64, 3, 1, 1)]
# conv_bias_pre_relu last: its engine failed at execute before (conv2d/cuda/cudnn.py), and
# a failure that left the context broken would stop only the rows after it.
FUSIONS = ("conv_bias_relu", "conv_genstats", "sbr_conv_genstats", "dgrad_drelu", "conv_bias_pre_relu")
_LONE: dict = {}  # (dgrad?, shape, dtype) -> the lone convolution's (execute, output, inputs)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Case:
    """One fusion at one shape: the graph's tensors by role, the torch tensors bound to
    them, the outputs' roles, and the float64 reference of each output."""

    graph: Any
    tensors: dict
    bound: dict
    outputs: list
    reference: dict


def _cudnn_type(cudnn: Any, dtype: torch.dtype) -> Any:
    return {torch.float32: cudnn.data_type.FLOAT, torch.bfloat16: cudnn.data_type.BFLOAT16,
            torch.float16: cudnn.data_type.HALF}[dtype]


def _inputs(shape: tuple, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random inputs, channels_last (cuDNN sees NCHW dims with NHWC strides)."""
    _, n, c, h, oc, k, stride, pad = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    oh = (h + 2 * pad - k) // stride + 1

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(size, generator=g, device="cuda") * scale
        return t.to(dtype).contiguous(memory_format=torch.channels_last)
    return {"x": rand(n, c, h, h), "w": rand(oc, c, k, k, scale=(c * k * k) ** -0.5), "b": rand(1, oc, 1, 1),
            "scale": rand(1, c, 1, 1), "shift": rand(1, c, 1, 1), "dy": rand(n, oc, oh, oh)}


def _conv64(x: torch.Tensor, w: torch.Tensor, stride: int, pad: int) -> torch.Tensor:
    return torch.nn.functional.conv2d(x.double(), w.double(), stride=stride, padding=pad)


def _graph(cudnn: Any, handle: Any, shape: tuple, dtype: torch.dtype) -> tuple:
    """(a new frontend graph, its inputs, a function that declares input `role` in it, the
    convolution's geometry, the io and float32 data types)."""
    _, n, c, h, oc, k, stride, pad = shape
    t = _inputs(shape, dtype)
    io, f32 = _cudnn_type(cudnn, dtype), cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def tensor(role: str) -> Any:
        return g.tensor(name=role, dim=list(t[role].size()), stride=list(t[role].stride()), data_type=io)
    return g, t, tensor, dict(padding=[pad, pad], stride=[stride, stride], dilation=[1, 1]), io, f32


def build_case(cudnn: Any, handle: Any, fusion: str, shape: tuple, dtype: torch.dtype) -> Case:
    """The frontend graph of `fusion` at `shape`, validated and its operation graph built
    (plans not yet made), with its inputs, outputs and float64 reference."""
    _, n, c, h, oc, k, stride, pad = shape
    g, t, tensor, geometry, io, f32 = _graph(cudnn, handle, shape, dtype)
    roles = {}
    ref: dict[str, torch.Tensor] = {}
    if fusion == "dgrad_drelu":
        roles = {"dy": tensor("dy"), "w": tensor("w"), "x": tensor("x")}
        dx = g.conv_dgrad(loss=roles["dy"], filter=roles["w"], **geometry)
        dx.set_dim(list(t["x"].size())).set_stride(list(t["x"].stride())).set_data_type(f32)
        out = g.relu_backward(loss=dx, input=roles["x"])
        out.set_output(True).set_data_type(io)
        roles["dx"] = out
        full = torch.nn.grad.conv2d_input(t["x"].shape, t["w"].double(), t["dy"].double(), stride=stride,
                                          padding=pad)
        ref["dx"] = full * (t["x"].double() > 0)
        bound_out = {"dx": torch.empty_like(t["x"])}
    else:
        roles = {"x": tensor("x"), "w": tensor("w")}
        image, x64 = roles["x"], t["x"].double()
        if fusion == "sbr_conv_genstats":
            roles["scale"], roles["shift"] = tensor("scale"), tensor("shift")
            image = g.relu(input=g.bias(input=g.scale(input=image, scale=roles["scale"]), bias=roles["shift"]))
            x64 = torch.relu(x64 * t["scale"].double() + t["shift"].double())
        z = g.conv_fprop(image=image, weight=roles["w"], **geometry)
        z64 = _conv64(x64, t["w"], stride, pad)
        if fusion.startswith("conv_bias"):
            roles["b"] = tensor("b")
            z = g.bias(input=z, bias=roles["b"])
            z64 = z64 + t["b"].double()
        if fusion in ("conv_bias_relu", "conv_bias_pre_relu"):
            if fusion == "conv_bias_pre_relu":
                z.set_output(True).set_data_type(io)
                roles["pre"], ref["pre"] = z, z64
            y = g.relu(input=z)
            y.set_output(True).set_data_type(io)
            roles["y"], ref["y"] = y, torch.relu(z64)
        else:
            z.set_output(True).set_data_type(io)
            roles["y"], ref["y"] = z, z64
            s, sq = g.genstats(input=z)
            s.set_output(True).set_data_type(f32)
            sq.set_output(True).set_data_type(f32)
            roles["sum"], roles["sq_sum"] = s, sq
            ref["sum"], ref["sq_sum"] = z64.sum((0, 2, 3), keepdim=True), (z64 * z64).sum((0, 2, 3), keepdim=True)
        bound_out = {r: torch.empty_like(t["dy"]) for r in ("y", "pre") if r in roles}  # dy: y's shape and layout
        bound_out.update({r: torch.zeros((1, oc, 1, 1), dtype=torch.float32, device="cuda")
                          for r in ("sum", "sq_sum") if r in roles})
    g.validate()
    g.build_operation_graph()
    bound = {r: t[r] for r in roles if r in t}
    bound.update(bound_out)
    return Case(g, roles, bound, [r for r in bound_out], ref)


def make_plans(cudnn: Any, case: Case, dtype: torch.dtype) -> tuple[int, str]:
    """Plans of the layer's kind (deterministic; no TF32 for float32), built: (how many
    passed check_support, the first's name)."""
    g = case.graph
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    notes = [cudnn.numerical_note.NONDETERMINISTIC]
    notes += ([cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS] if dtype == torch.float32
              else [cudnn.numerical_note.REDUCED_PRECISION_REDUCTION])
    g.deselect_numeric_notes(notes)
    g.check_support()
    g.build_plans()
    count = int(g.get_execution_plan_count())
    try:
        name = str(g.get_plan_name_at_index(0))
    except Exception:
        name = "?"
    return count, name


def executor(case: Case, handle: Any) -> Callable[[], None]:
    workspace = torch.empty(max(1, int(case.graph.get_workspace_size())), dtype=torch.uint8, device="cuda")
    pack = {case.tensors[r]: case.bound[r].data_ptr() for r in case.tensors}
    return lambda: case.graph.execute(pack, workspace.data_ptr(), handle=handle)


def gpu_ms(fn: Callable[[], None], iters: int) -> float:
    """The median over 3 rounds of `iters` calls' GPU time by CUDA events, ms a call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def unfused(cudnn: Any, handle: Any, fusion: str, shape: tuple, dtype: torch.dtype) -> Callable[[], None]:
    """The work the fusion replaces: the lone convolution graph (fprop, or dgrad) and
    PyTorch's ops for the rest."""
    key = (fusion == "dgrad_drelu", shape, dtype)
    if key not in _LONE:
        _LONE[key] = _lone_convolution(cudnn, handle, fusion, shape, dtype)
    run_conv, out, t = _LONE[key]

    def rest() -> None:
        if fusion == "dgrad_drelu":
            torch.mul(out, t["x"] > 0)
        elif fusion in ("conv_bias_relu", "conv_bias_pre_relu"):
            torch.relu(out + t["b"])
        else:
            if fusion == "sbr_conv_genstats":
                torch.relu(t["x"] * t["scale"] + t["shift"])
            torch.sum(out, (0, 2, 3), dtype=torch.float32)
            torch.sum(out.float().square(), (0, 2, 3))

    def run() -> None:
        run_conv()
        rest()
    return run


def _lone_convolution(cudnn: Any, handle: Any, fusion: str, shape: tuple, dtype: torch.dtype) -> tuple:
    """(execute, its output, its inputs) of the lone convolution a fusion is timed against."""
    g, t, tensor, geometry, io, _ = _graph(cudnn, handle, shape, dtype)
    if fusion == "dgrad_drelu":
        roles = {"dy": tensor("dy"), "w": tensor("w")}
        out = g.conv_dgrad(loss=roles["dy"], filter=roles["w"], **geometry)
        out.set_output(True).set_dim(list(t["x"].size())).set_stride(list(t["x"].stride())).set_data_type(io)
        result = torch.empty_like(t["x"])
    else:
        roles = {"x": tensor("x"), "w": tensor("w")}
        out = g.conv_fprop(image=roles["x"], weight=roles["w"], **geometry)
        out.set_output(True).set_data_type(io)
        result = torch.empty_like(t["dy"])  # y's shape and layout
    g.validate()
    g.build_operation_graph()
    case = Case(g, {**roles, "out": out}, {**{r: t[r] for r in roles}, "out": result}, ["out"], {})
    make_plans(cudnn, case, dtype)
    return executor(case, handle), result, t


def measure(cudnn: Any, handle: Any, fusion: str, shape: tuple, dtype: torch.dtype, iters: int) -> list[str]:
    """One table row's cells after the shape's and dtype's: status, plans, the first
    plan's name, error, bitwise repeat, fused ms, unfused ms, fused / unfused."""
    try:
        case = build_case(cudnn, handle, fusion, shape, dtype)
        count, name = make_plans(cudnn, case, dtype)
    except Exception as e:
        return ["no plan", "0", _short(e), "-", "-", "-", "-", "-"]
    try:
        run = executor(case, handle)
        run()
        torch.cuda.synchronize()
    except Exception as e:
        return ["execute failed", str(count), f"{name}: {_short(e)}", "-", "-", "-", "-", "-"]
    first = {r: case.bound[r].clone() for r in case.outputs}
    error = max(float((case.bound[r].double() - case.reference[r]).abs().max() / case.reference[r].abs().max())
                for r in case.outputs)
    run()
    torch.cuda.synchronize()
    same = all(torch.equal(first[r], case.bound[r]) for r in case.outputs)
    fused = gpu_ms(run, iters)
    try:
        apart = gpu_ms(unfused(cudnn, handle, fusion, shape, dtype), iters)
    except Exception as e:
        return ["ok", str(count), name, f"{error:.1e}", "yes" if same else "no", f"{fused:.3f}",
                f"failed: {_short(e)}", "-"]
    return ["ok", str(count), name, f"{error:.1e}", "yes" if same else "no", f"{fused:.3f}", f"{apart:.3f}",
            f"{fused / apart:.2f}"]


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''}".replace("|", "/")


def rows_of(fusion: str, dtypes: list[str], iters: int) -> list[str]:
    """The table rows of one fusion, measured in this process."""
    from conv2d.cuda.cudnn import import_cudnn

    cudnn = import_cudnn()
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    rows = []
    for shape in SHAPES:
        for name in dtypes:
            cells = measure(cudnn, handle, fusion, shape, DTYPES[name], iters)
            rows.append(f"| {fusion} | {shape[0]} | {name} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    return rows


def isolated_rows(fusion: str, dtypes: list[str], iters: int) -> list[str]:
    """rows_of(fusion) in a process of its own: an engine that breaks the CUDA context
    (a failed execute can) takes only its own fusion's later rows with it, which are
    then reported as lost with the process's exit status."""
    done = subprocess.run([sys.executable, __file__, "--fusions", fusion, "--dtypes", ",".join(dtypes),
                           "--iters", str(iters), "--here"], capture_output=True, text=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith(f"| {fusion} |")]
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        measured = {tuple(c.strip() for c in row.split("|")[2:4]) for row in rows}
        lost = [f"| {fusion} | {shape[0]} | {name} | process died (exit {done.returncode}) | - | - | - | - | - | - "
                f"| - |" for shape in SHAPES for name in dtypes if (shape[0], name) not in measured]
        print("\n".join(lost), flush=True)
        rows += lost
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--fusions", default=",".join(FUSIONS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--here", action="store_true", help="measure in this process (default: a process a fusion)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    lines = ["| fusion | layer | dtype | status | plans | plan (or why not) | error | bitwise repeat | fused ms "
             "| unfused ms | fused / unfused |", "| --- | --- | --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for fusion in args.fusions.split(","):
        lines += (rows_of if args.here else isolated_rows)(fusion, dtypes, args.iters)
    if args.here:
        return
    from conv2d.cuda.cudnn import import_cudnn

    try:
        print(f"cuDNN {import_cudnn().backend_version_string()}")
    except Exception as e:  # no GPU here: every row says its process died
        print(f"cuDNN unavailable ({type(e).__name__})")
    if args.out:
        parts = __doc__.strip().split("\n\n")  # what it measures, usage, the fusions, how to read a row
        intro = "\n\n".join([parts[0].replace("\n", " "), "```\n" + parts[2] + "\n```", parts[3].replace("\n", " ")])
        write_table(args.out, "cudnn_fusions_cuda.md", "conv2d: cuDNN's runtime fusions on this GPU, deterministic "
                    "engines only", lines, gpu=True, intro=intro)


if __name__ == "__main__":
    main()
