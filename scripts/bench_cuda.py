"""The CUDA backend beside PyTorch on the GPU, in one process: a training step
(forward(training) + backward_full) on the shapes of docs/bench_shapes.md, eager and replayed
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
from pathlib import Path

from bench_cuda_runs import (MODULE_RUNS, acting_ours, acting_pytorch, invariance_ours,
                             invariance_pytorch, module_vs_torch, optim_ours, optim_pytorch, ours, pytorch,
                             roofline_ms, second_batch)
from bench_shapes import SHAPES, bench_spec, cases, inputs, provenance

def arguments() -> argparse.Namespace:
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
    return ap.parse_args()


def main() -> None:
    args = arguments()
    import torch

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict] = []
    lines = [f"# conv2d CUDA backend vs PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: "
             f"training step (forward + backward_full), median ms per step", "", provenance(gpu=True)]
    print("\n".join(lines), flush=True)
    lines += step_tables(args, rows)
    if not args.no_acting:
        lines += acting_table(args)
    if not args.no_tf32 and "float32" in args.dtypes.split(","):
        lines += tf32_table(args)
    if not args.no_optim:
        lines += optim_table(args)
    if not args.no_invariance:
        lines += invariance_table(args)
    sweep_lines, sweep = sweep_table(args)
    lines += sweep_lines
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_cuda.md").write_text("\n".join(lines) + "\n")
        (args.out / "bench_cuda.json").write_text(json.dumps({"steps": rows, "sweep": sweep}, indent=1))
        if sweep:
            _plot(sweep, args.out / "bench_cuda.png")


def step_tables(args: argparse.Namespace, rows: list[dict]) -> list[str]:
    """The training-step tables (heuristic plans, autotuned, a second batch size, depthwise) and
    the module's table, row by row as they are measured; `rows` receives the JSON rows."""
    lines: list[str] = []
    tuned_lines: list[str] = []
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
    return lines


def acting_table(args: argparse.Namespace) -> list[str]:
    """Acting: evaluate at N = 1 and a synchronisation, beside PyTorch's eval module."""
    head = ["", "## Acting: evaluate at N = 1 and a synchronisation, wall ms per call (PyTorch: eval, no_grad)",
            "(ours direct: evaluate_kernel=\"direct\", one kernel for the convolution, norm and activation; "
            "not for layer norm)", "",
            "| shape | norm | dtype | ours eager | torch eager | ratio | ours graph | torch graph | ratio "
            "| ours direct eager | ratio | ours direct graph | ratio |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines = list(head)
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
    return lines


def tf32_table(args: argparse.Namespace) -> list[str]:
    """Ours with allow_tf32=True beside PyTorch's float32 default (TF32, cudnn.benchmark)."""
    import torch

    head = ["", "## TF32: ours allow_tf32=True beside PyTorch's float32 default (TF32, cudnn.benchmark = True), "
            "training step (ours tuned: also autotune=True, plans timed among TF32's)", "",
            "| shape | norm | ours eager wall | torch eager wall | ratio | ours graph GPU "
            "| torch graph GPU | ratio | ours tuned graph GPU | ratio |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines = list(head)
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
    return lines


def optim_table(args: argparse.Namespace) -> list[str]:
    """Adam: the step alone and the whole training step as one CUDA graph, each side."""
    head = ["", "## Adam: the optimizer step alone (eager) and the whole training step (zero grad, forward, "
            "backward, step) as one CUDA graph; ours conv2d.optim.Adam(preset='torch') (16-bit layers keep "
            "float32 masters), PyTorch torch.optim.Adam(fused=True, capturable=True)", "",
            "| shape | norm | dtype | ours step wall | torch step wall | ratio | ours step GPU | torch step GPU "
            "| ratio | ours whole-step graph GPU | torch whole-step graph GPU | ratio |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines = list(head)
    print("\n".join(head), flush=True)
    for name, bn, spec, x, dy in cases(args.shapes, args.dtypes):
        o, t = optim_ours(spec, x, dy, args.iters), optim_pytorch(spec, x, dy, args.iters)
        line = (f"| {name} | {'bn' if bn else '-'} | {spec.dtype.value} | {o['step'][1]:.4f} "
                f"| {t['step'][1]:.4f} | {o['step'][1] / t['step'][1]:.2f} | {o['step'][0]:.4f} "
                f"| {t['step'][0]:.4f} | {o['step'][0] / t['step'][0]:.2f} | {o['graph'][0]:.3f} "
                f"| {t['graph'][0]:.3f} | {o['graph'][0] / t['graph'][0]:.2f} |")
        lines.append(line)
        print(line, flush=True)
    return lines


def invariance_table(args: argparse.Namespace) -> list[str]:
    """batch_invariant=True beside the default: kept bits, captured step, acting."""
    head = ["", "## Batch invariance: ours with batch_invariant=True (one cuDNN plan at every batch size) beside "
            "the default (cuDNN's heuristic plan per batch size); whether evaluate at the planned batch gives "
            "rows 0, N/2 and N - 1 bitwise as each sample alone (PyTorch: its eval Sequential); captured training "
            "step at the planned batch, GPU ms; acting at N = 1 (evaluate and a synchronisation), wall ms", "",
            "| shape | norm | dtype | invariant: PyTorch | ours default | ours batch_invariant "
            "| default graph GPU | invariant graph GPU | ratio | default acting eager "
            "| invariant acting eager | ratio | default acting graph | invariant acting graph | ratio |",
            "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines = list(head)
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
    return lines


def sweep_table(args: argparse.Namespace) -> tuple[list[str], list[dict]]:
    """The rl_small batch sweep (bfloat16, batch norm): captured step GPU ms, each side."""
    sweep = []
    lines: list[str] = []
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
    return lines, sweep


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
