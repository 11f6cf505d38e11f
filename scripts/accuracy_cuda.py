"""Where float32 loses accuracy, stage by stage, ours beside PyTorch's: each stage of a
layer's training step computed by this library and by PyTorch from the same float32
inputs, each against the same stage in float64, as max|got - exact| / max|exact|.

    python scripts/accuracy_cuda.py [--device cuda|cpu] [--shapes a,b] [--network] [--out DIR]

Stages, each isolated so that both sides start from the same inputs:
- conv forward, backward-data, backward-filter: a layer without norm, bias or activation
  (y = conv(x, w); d_x and d_w of a given d_y);
- the norm: a 1x1 convolution with identity weights (z = x exactly) before batch norm
  (statistics: the batch's mean and 1/std; normalise: y; its backward: d_z, gamma's and
  beta's gradients) and the bias gradient (the sum of d_z).
`--network`: the CIFAR conv-BN-ReLU network (8 layers, N=128) and the Nature-DQN (N=32) of
scripts/bench_networks.py, the module swapped in: the first backward's gradient of every
parameter, ours and PyTorch's in float32 and in bfloat16 against PyTorch's float64, plain
and with each side's own ReLU decisions ("decided": see network_study; the rounding
error without the flips of ReLUs whose input is within rounding of 0).

Ours is the CUDA backend on a GPU (TF32 off on both sides, PyTorch's cuDNN deterministic)
and the reference backend with `--device cpu`. Prints a table (ratio: ours / PyTorch's
error); `--out DIR` writes accuracy_cuda.md there with the provenance line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import numpy as np

from bench_shapes import SHAPES, bench_spec, write_table

import torch
import torch.nn.functional as F

from conv2d import Conv2d, LayerSpec
from conv2d.arrays import to_host
from conv2d.torch_layout import weights_from_torch, weights_to_torch


def error(got, exact, scale: float = 0.0) -> float:
    """max|got - exact| / max(max|exact|, scale): `scale` for sums that cancel (the
    magnitude of their terms)."""
    got, exact = np.asarray(got, np.float64), np.asarray(exact, np.float64)
    return float(np.abs(got - exact).max() / max(np.abs(exact).max(), scale, 1e-300))


def nchw(a: np.ndarray, device: str, dtype) -> torch.Tensor:
    """An (N, H, W, C) array as an NCHW view of a channels_last tensor."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype).permute(0, 3, 1, 2)


def nhwc(t: torch.Tensor) -> np.ndarray:
    return t.detach().permute(0, 2, 3, 1).double().cpu().numpy()


def ours(spec, device: str) -> Conv2d:
    return Conv2d(spec, "cuda" if device == "cuda" else "reference")


def conv_stages(name: str, device: str, rng) -> list[tuple[str, float, float]]:
    """(stage, ours' error, PyTorch's error) of the three convolutions of shape `name`."""
    spec = dataclasses.replace(bench_spec(name, False, "float32"), activation="identity", bias=False)
    x = rng.standard_normal(spec.input_shape).astype(np.float32)
    d_y = rng.standard_normal(spec.output_shape).astype(np.float32)
    layer = ours(spec, device)
    layer.init_weights(rng)
    w = layer.state_dict()["weights"]  # (OC, KH, KW, IC)
    y = to_host(layer.forward(x, training=True), np.float32)
    d_x = to_host(layer.backward_full(x, d_y), np.float32)
    d_w = layer.grad_dict()["weights"]
    results = {}
    for dtype in (torch.float64, torch.float32):
        xt = nchw(x, device, dtype).requires_grad_(True)
        wt = torch.from_numpy(weights_to_torch(w)).to(device=device, dtype=dtype).requires_grad_(True)
        yt = F.conv2d(xt, wt, None, spec.stride, spec.padding, spec.dilation, spec.groups)
        yt.backward(nchw(d_y, device, dtype))
        results[dtype] = (nhwc(yt), nhwc(xt.grad), weights_from_torch(wt.grad.double().cpu().numpy()))
    exact, theirs = results[torch.float64], results[torch.float32]
    return [(stage, error(o, e), error(t, e)) for stage, o, t, e in
            zip(("conv forward", "conv backward-data", "conv backward-filter"), (y, d_x, d_w), theirs, exact)]


def norm_stages(name: str, device: str, rng) -> list[tuple[str, float, float]]:
    """(stage, ours' error, PyTorch's error) of batch norm on the pre-activations of
    shape `name`: z itself through a 1x1 convolution with identity weights."""
    n, _, _, _, oc, _, _, _ = SHAPES[name]
    _, oh, ow, _ = bench_spec(name, True, "float32").output_shape
    spec = LayerSpec(batch_size=n, in_height=oh, in_width=ow, in_channels=oc, out_channels=oc, kernel=1,
                     activation="identity", normalization="batch_norm", dtype="float32")
    z = (rng.standard_normal(spec.input_shape) * rng.uniform(0.5, 2.0, oc) + rng.uniform(-1, 1, oc)).astype(np.float32)
    d_y = rng.standard_normal(spec.output_shape).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, oc).astype(np.float32)
    beta = rng.uniform(-0.5, 0.5, oc).astype(np.float32)
    layer = ours(spec, device)
    state = layer.state_dict()
    state.update(weights=np.eye(oc, dtype=np.float32).reshape(oc, 1, 1, oc), bias=np.zeros(oc, np.float32),
                 gamma=gamma, beta=beta)
    layer.load_state_dict(state)
    y = to_host(layer.forward(z, training=True), np.float32)
    d_z = to_host(layer.backward_full(z, d_y), np.float32)
    g = layer.grad_dict()
    results = {}
    for dtype in (torch.float64, torch.float32):
        zt = nchw(z, device, dtype).requires_grad_(True)
        gt = torch.from_numpy(gamma).to(device=device, dtype=dtype).requires_grad_(True)
        bt = torch.from_numpy(beta).to(device=device, dtype=dtype).requires_grad_(True)
        yt = F.batch_norm(zt, None, None, gt, bt, training=True, eps=spec.bn_epsilon)
        yt.backward(nchw(d_y, device, dtype))
        # the convolution's bias gradient: the per-channel sum of d_z, in the side's dtype
        results[dtype] = (nhwc(yt), nhwc(zt.grad), gt.grad.double().cpu().numpy(), bt.grad.double().cpu().numpy(),
                          zt.grad.sum(dim=(0, 2, 3)).double().cpu().numpy())
    exact, theirs = results[torch.float64], results[torch.float32]
    stages = ("batch norm forward (y)", "batch norm backward (d_z)", "gamma gradient", "beta gradient",
              "bias gradient (sum of d_z)")
    # Under batch norm the bias gradient cancels to zero: relative to the sum of |d_z|.
    scales = (0.0,) * 4 + (float(np.abs(exact[1]).reshape(-1, oc).sum(axis=0).max()),)
    return [(stage, error(o, e, sc), error(t, e, sc)) for stage, o, t, e, sc in
            zip(stages, (y, d_z, g["gamma"], g["beta"], g["bias"]), theirs, exact, scales)]


NETWORK_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class DecidedReLU(torch.nn.Module):
    """ReLU with its decisions given: x * mask, so that the gradient passes where `mask`
    (another network's x > 0) says, whatever this network's own x."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask


def _network_problem(name: str, device: str) -> tuple:
    """(the network `name` of scripts/bench_networks.py in float64, the names of its
    ReLUs, its training batch x, a random target), seeded."""
    from bench_networks import NETWORKS, network

    (c, h, w), batch, outputs = NETWORKS[name]
    exact_net = network(name).double().to(device)
    relus = [n for n, m in exact_net.named_modules() if isinstance(m, torch.nn.ReLU)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, c, h, w, generator=g, dtype=torch.float64).to(device)
    target = torch.randn(batch, outputs, generator=g, dtype=torch.float64).to(device)
    return exact_net, relus, x, target


def _first_backward(model, x, target, dt, relus=()) -> tuple[dict, dict]:
    """(gradient of each parameter, float64 on the host; x > 0 after each ReLU named in
    `relus`) of one forward and backward of `model` at dtype `dt`, MSE loss."""
    model.train()
    masks, hooks = {}, []
    modules = dict(model.named_modules())
    for name in relus:
        hooks.append(modules[name].register_forward_hook(
            lambda mod, inp, out, name=name: masks.__setitem__(name, (out.detach() > 0).to(torch.float64))))
    try:
        F.mse_loss(model(x.to(dt).contiguous(memory_format=torch.channels_last)).double(), target).backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {k: v.grad.double().cpu().numpy() for k, v in model.state_dict(keep_vars=True).items()
             if isinstance(v, torch.nn.Parameter)}
    return grads, masks


def network_study(name: str, dtype: str, device: str) -> tuple[dict, dict, dict]:
    """The first backward of the network `name` of scripts/bench_networks.py (its
    training batch, MSE loss against a random target) at `dtype` on both sides, ours and
    PyTorch's, against the same network in float64: (parameter -> (ours, PyTorch's)
    gradient error against plain float64; the same against float64 taking that side's own
    ReLU decisions; ReLU -> (ours, PyTorch's) count of decisions unlike float64's).

    A ReLU whose input is within rounding of 0 decides differently in float32 and in
    float64, and each such flip moves a gradient by one whole term: in a deep network the
    max-norm error against plain float64 is then a count of flips (a matter of luck,
    measured: 0 to 11 flips per block of the CIFAR network, on either side) more than of
    rounding. Against float64 with the side's own decisions (`DecidedReLU`) it is the
    error of the arithmetic alone."""
    from conv2d.torch import swap

    exact_net, relus, x, target = _network_problem(name, device)
    exact, exact_masks = _first_backward(copy.deepcopy(exact_net), x, target, torch.float64, relus)
    plain, decided, flips = [], [], []
    # runs=False: each ReLU decision read from its own placeholder's output (a run gives the run's last).
    for model in (swap(copy.deepcopy(exact_net), runs=False), copy.deepcopy(exact_net)):  # ours, PyTorch's
        got, masks = _first_backward(model.to(NETWORK_DTYPES[dtype]), x, target, NETWORK_DTYPES[dtype], relus)
        same = copy.deepcopy(exact_net)
        for relu in relus:
            parent, _, child = relu.rpartition(".")
            setattr(same.get_submodule(parent) if parent else same, child, DecidedReLU(masks[relu]))
        want, _ = _first_backward(same, x, target, torch.float64)
        plain.append({k: error(got[k], e) for k, e in exact.items()})
        decided.append({k: error(got[k], e) for k, e in want.items()})
        flips.append({r: int((masks[r] != exact_masks[r]).sum()) for r in relus})
    return tuple({k: (ours[k], theirs[k]) for k in ours} for ours, theirs in (plain, decided, flips))


def network_errors(name: str, dtype: str, device: str, same_decisions: bool = False) -> dict[str, tuple[float, float]]:
    """parameter -> (ours, PyTorch's) error of its gradient (`network_study`), against
    plain float64 or, with `same_decisions`, against float64 taking each side's own ReLU
    decisions."""
    plain, decided, _ = network_study(name, dtype, device)
    return decided if same_decisions else plain


def network_rows(device: str, networks: str) -> list[tuple[str, float, float]]:
    """Each network's first backward, float32 and bfloat16: each parameter's gradient
    error against float64 with each side's own ReLU decisions ("decided"), and against
    plain float64 ("plain"); each ReLU's flips printed."""
    rows = []
    for name in networks.split(","):
        for dtype in NETWORK_DTYPES:
            if dtype == "bfloat16" and device == "cpu":
                continue  # the reference's bfloat16 is not what users run on the CPU; slow too
            plain, decided, flips = network_study(name, dtype, device)
            for label, errors in (("decided", decided), ("plain", plain)):
                rows += [(f"{name} {dtype} {label} {k}", o, t) for k, (o, t) in errors.items()]
            print(f"{name} {dtype}: ReLU decisions unlike float64's, ours / PyTorch's: "
                  + ", ".join(f"{r}: {o}/{t}" for r, (o, t) in flips.items()), flush=True)
    return rows


def network_convolutions(name: str) -> list[tuple[str, LayerSpec]]:
    """(the parameter name of its weight, its spec in float32, no bias) of each
    convolution of the network `name` of scripts/bench_networks.py at its training batch;
    "bench": the bench shapes (docs/bench_shapes.md) at their batch, one convolution each."""
    from bench_networks import NETWORKS, network

    if name == "bench":
        return [(shape, dataclasses.replace(bench_spec(shape, False, "float32"), bias=False, activation="identity"))
                for shape in SHAPES]

    (c, h, w), batch, _ = NETWORKS[name]
    net, shapes = network(name), {}
    hooks = [m.register_forward_hook(lambda m, inp, out, k=k: shapes.__setitem__(k, tuple(inp[0].shape)))
             for k, m in net.named_modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        net(torch.zeros(batch, c, h, w))
    for hk in hooks:
        hk.remove()
    convs = []
    for k, (n, ci, hi, wi) in shapes.items():
        m = net.get_submodule(k)
        convs.append((f"{k}.weight", LayerSpec(batch_size=n, in_height=hi, in_width=wi, in_channels=ci,
                                               out_channels=m.out_channels, kernel=m.kernel_size, stride=m.stride,
                                               padding=m.padding, bias=False, activation="identity", dtype="float32")))
    return convs


def engine_rows(networks: str) -> list[str]:
    """For each convolution of the networks and each of its three operations, in float32
    without TF32: the error (against float64) and GPU time of the cuDNN plan our heuristic
    (mode B) chooses, of mode A's first plan (PyTorch's choice: its error is PyTorch's), and
    of the most accurate deterministic plan of either list, beside PyTorch's own error."""
    from conv2d.cuda import cudnn as C, plan_heuristic
    from conv2d.cuda.runtime import numba_cuda
    from conv2d.spec import DType

    cud = C.import_cudnn()
    handle = cud.create_handle()
    stream = torch.cuda.current_stream().cuda_stream
    cud.set_stream(handle, stream)
    rows = []
    for net in networks.split(","):
        for label, spec in network_convolutions(net):
            n, h, w, c = spec.input_shape
            _, oh, ow, oc = spec.output_shape
            kh, kw = spec.kernel
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(n, h, w, c, device="cuda", generator=g)
            cg = c // spec.groups
            wt = torch.randn(oc, kh, kw, cg, device="cuda", generator=g) / (kh * kw * cg) ** 0.5
            dy = torch.randn(n, oh, ow, oc, device="cuda", generator=g)
            results = {}
            for dt in (torch.float64, torch.float32):
                xs, ws = (t.to(dt).permute(0, 3, 1, 2).requires_grad_(True) for t in (x, wt))
                y = F.conv2d(xs, ws, None, spec.stride, spec.padding, spec.dilation, spec.groups)
                y.backward(dy.to(dt).permute(0, 3, 1, 2))
                results[dt] = {"forward": y.detach().permute(0, 2, 3, 1), "backward_data": xs.grad.permute(0, 2, 3, 1),
                               "backward_filter": ws.grad.permute(0, 2, 3, 1)}
            for op in ("forward", "backward_data", "backward_filter"):
                exact = results[torch.float64][op]
                theirs = error(results[torch.float32][op].cpu(), exact.cpu())
                out = torch.empty(exact.shape, dtype=torch.float32, device="cuda")
                bufs = {"x": x, "w": wt, "dy": dy, "y": out, "dx": out, "dw": out}
                plans = {}  # name -> (error, ms)
                chosen = {}
                for mode in (("B", "FALLBACK"), ("A", "FALLBACK")):
                    saved = C.HEUR_MODES[DType.FLOAT32]
                    C.HEUR_MODES[DType.FLOAT32] = mode
                    try:
                        built = C.build(op, spec, handle, False)
                    finally:
                        C.HEUR_MODES[DType.FLOAT32] = saved
                    chosen[mode[0]] = built.plan
                    gr = built.graph
                    gr.build_plans(cud.build_plan_policy.ALL)
                    pack = {t: bufs[r].data_ptr() for r, t in built.tensors.items()}
                    for i in range(gr.get_execution_plan_count()):
                        try:
                            name = str(gr.get_plan_name_at_index(i))
                            if name in plans:
                                continue
                            ws = torch.empty(max(int(gr.get_workspace_size_plan_at_index(i)), 1), dtype=torch.uint8,
                                             device="cuda")
                            run = lambda: gr.execute_plan_at_index(pack, ws.data_ptr(), i, handle=handle)  # noqa: E731
                            run()
                            torch.cuda.synchronize()
                            err = error(out.cpu(), exact.cpu())
                            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            start.record()
                            for _ in range(10):
                                run()
                            end.record()
                            end.synchronize()
                            plans[name] = (err, start.elapsed_time(end) / 10)
                        except Exception:  # a plan that does not build or run
                            continue
                best = min(plans, key=lambda k: (plans[k][0], plans[k][1]))
                picked = plan_heuristic.build_accurate(op, spec, handle, plan_heuristic.AccuracyProbe(numba_cuda(), stream)).plan

                def cell(name):
                    e, ms = plans.get(name, (float("nan"), float("nan")))
                    return f"{name} | {e:.2e} | {ms:.3f}"
                rows.append(f"| {net} {label} | {op} | {cell(chosen['B'])} | {cell(chosen['A'])} | {cell(best)} "
                            f"| {picked} | {theirs:.2e} | {plans.get(picked, (float('nan'),))[0] / theirs:.2f} |")
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--shapes", default="rl_dqn_l1,rl_small,resnet_56,resnet_28")
    ap.add_argument("--network", action="store_true", help="also the deep networks' parameter gradients")
    ap.add_argument("--networks", default="cifar_resnet,nature_dqn", help="the networks of --network and --engines")
    ap.add_argument("--engines", action="store_true",
                    help="also each network convolution's cuDNN plans: ours, PyTorch's, the most accurate (GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
    lines = ["| shape | stage | ours error | PyTorch error | ours / PyTorch |", "| --- | --- | ---: | ---: | ---: |"]
    print("\n".join(lines), flush=True)

    def emit(shape: str, rows) -> None:
        for stage, o, t in rows:
            line = f"| {shape} | {stage} | {o:.2e} | {t:.2e} | {o / t if t else float('inf'):.2f} |"
            lines.append(line)
            print(line, flush=True)
    for name in args.shapes.split(","):
        rng = np.random.default_rng(0)
        emit(name, conv_stages(name, args.device, rng))
        emit(name, norm_stages(name, args.device, rng))
    if args.network:
        emit("network", network_rows(args.device, args.networks))
    if args.engines and args.device == "cuda":
        head = ["", "| convolution | operation | ours (mode B) | error | GPU ms | mode A (PyTorch's) | error | GPU ms "
                "| most accurate | error | GPU ms | the backend's choice | PyTorch's error | choice / PyTorch |",
                "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |"]
        print("\n".join(head), flush=True)
        lines += head + engine_rows(args.networks)
    if args.out:
        write_table(args.out, "accuracy_cuda.md", "conv2d: float32 accuracy by stage, ours beside PyTorch's", lines,
                    args.device == "cuda", "Errors are max|float32 - float64| / max|float64| of each stage from the "
                    "same inputs (scripts/accuracy_cuda.py's docstring).")


if __name__ == "__main__":
    main()
