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
parameter, ours and PyTorch's in float32 and in bfloat16 against PyTorch's float64.

Ours is the CUDA backend on a GPU (TF32 off on both sides, PyTorch's cuDNN deterministic)
and the reference backend with `--device cpu`. Prints a table (ratio: ours / PyTorch's
error); `--out DIR` writes DIR/accuracy_cuda.md with the provenance line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import SHAPES, bench_spec, provenance  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from conv2d import Conv2d, LayerSpec  # noqa: E402
from conv2d.arrays import to_host  # noqa: E402
from conv2d.torch_layout import weights_from_torch, weights_to_torch  # noqa: E402


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


def network_errors(name: str, dtype: str, device: str) -> dict[str, tuple[float, float]]:
    """parameter -> (ours, PyTorch's) error of its gradient in the first backward of the
    network `name` of scripts/bench_networks.py (its training batch, MSE loss against a
    random target), at `dtype` on both sides, against the same network in float64."""
    from bench_networks import NETWORKS, network

    from conv2d.torch import swap

    (c, h, w), batch, outputs = NETWORKS[name]
    exact_net = network(name).double().to(device)
    theirs = copy.deepcopy(exact_net).to(NETWORK_DTYPES[dtype])
    mine = swap(copy.deepcopy(exact_net)).to(NETWORK_DTYPES[dtype])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, c, h, w, generator=g, dtype=torch.float64).to(device)
    target = torch.randn(batch, outputs, generator=g, dtype=torch.float64).to(device)
    grads = []
    for model, dt in ((exact_net, torch.float64), (theirs, NETWORK_DTYPES[dtype]), (mine, NETWORK_DTYPES[dtype])):
        model.train()
        xm = x.to(dt).contiguous(memory_format=torch.channels_last)
        F.mse_loss(model(xm).double(), target).backward()
        grads.append({k: v.grad.double().cpu().numpy() for k, v in model.state_dict(keep_vars=True).items()
                      if isinstance(v, torch.nn.Parameter)})
    exact, torch_grads, our_grads = grads
    return {k: (error(our_grads[k], e), error(torch_grads[k], e)) for k, e in exact.items()}


def network_rows(device: str, networks: str) -> list[tuple[str, float, float]]:
    """Each network's first backward, float32 and bfloat16: each parameter's gradient error."""
    rows = []
    for name in networks.split(","):
        for dtype in NETWORK_DTYPES:
            if dtype == "bfloat16" and device == "cpu":
                continue  # the reference's bfloat16 is not what users run on the CPU; slow too
            rows += [(f"{name} {dtype} {k}", o, t) for k, (o, t) in network_errors(name, dtype, device).items()]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--shapes", default="rl_dqn_l1,rl_small,resnet_56,resnet_28")
    ap.add_argument("--network", action="store_true", help="also the deep networks' parameter gradients")
    ap.add_argument("--networks", default="cifar_resnet,nature_dqn", help="the networks of --network")
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
    if args.out:
        path = Path(args.out) / "accuracy_cuda.md"
        path.write_text("\n".join(["# conv2d: float32 accuracy by stage, ours beside PyTorch's", "",
                                   "Errors are max|float32 - float64| / max|float64| of each stage from the same "
                                   "inputs (scripts/accuracy_cuda.py's docstring).", "",
                                   provenance(args.device == "cuda"), "", *lines, ""]))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
