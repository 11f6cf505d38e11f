"""The independent oracle: the layer written with PyTorch ops, differentiated by autograd.

Used to make the golden files and by the oracle tests; never by the backends. Everything
runs in float64 on the CPU. Arrays in and out are NumPy, NHWC, in our layouts.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from conv2d.spec import LayerSpec

_FAST_TANH_CLAMP = 3.0


class _FastTanh(torch.autograd.Function):
    # The original library's rational tanh; its backward is 1 - f(x)^2 by definition.
    @staticmethod
    def forward(ctx, x):
        c = x.clamp(-_FAST_TANH_CLAMP, _FAST_TANH_CLAMP)
        f = c * (27 + c * c) / (27 + 9 * c * c)
        ctx.save_for_backward(f)
        return f

    @staticmethod
    def backward(ctx, grad):
        (f,) = ctx.saved_tensors
        return grad * (1 - f * f)


def _activation(name: str, a: torch.Tensor, parameter: float | None = None) -> torch.Tensor:
    if name == "identity":
        return a
    if name == "relu":
        return F.relu(a)
    if name == "tanh":
        return torch.tanh(a)
    if name == "sigmoid":
        return torch.sigmoid(a)
    if name == "fast_tanh":
        return _FastTanh.apply(a)
    if name == "gelu_tanh":
        return F.gelu(a, approximate="tanh")
    if name == "gelu":
        return F.gelu(a)
    if name == "gelu_original":
        # rl_tools' constants: k half of PyTorch's, the cubic coefficient the float32 0.044715f
        k = 0.5 * math.sqrt(2 / math.pi)
        cubic = float(np.float32(0.044715))
        return 0.5 * a * (1 + torch.tanh(k * (a + cubic * a**3)))
    if name == "silu":
        return F.silu(a)
    if name == "relu6":
        return F.relu6(a)
    if name == "hardswish":
        return F.hardswish(a)
    if name == "leaky_relu":
        return F.leaky_relu(a, parameter)
    if name == "elu":
        return F.elu(a, parameter)
    raise ValueError(f"oracle: unknown activation {name!r}")


def run(spec: LayerSpec, state: dict[str, np.ndarray], x: np.ndarray, d_y: np.ndarray,
        training: bool) -> dict[str, np.ndarray]:
    """One forward (training or not) then backward with `d_y`, on float64 copies.

    Returns y, pre_activations, d_x, the gradients (weights, bias, gamma, beta where the
    spec has them) and running_mean/running_var after the forward.
    """
    t = lambda a: torch.tensor(np.asarray(a, dtype=np.float64))  # noqa: E731
    xt = t(x).permute(0, 3, 1, 2).requires_grad_(True)
    w = t(state["weights"]).permute(0, 3, 1, 2).contiguous().requires_grad_(True)
    b = t(state["bias"]).requires_grad_(True)
    (top, bottom), (left, right) = spec.pads
    mode = {"zeros": "constant"}.get(spec.padding_mode, spec.padding_mode)  # F.pad's names
    xp = F.pad(xt, (left, right, top, bottom), mode=mode)
    z = F.conv2d(xp, w, b, stride=spec.stride, dilation=spec.dilation, groups=spec.groups)  # NCHW
    z.retain_grad()
    norm = spec.normalization.value
    params = {"weights": w, "bias": b}
    out: dict[str, np.ndarray] = {}
    if norm == "none":
        a = z
    else:
        gamma = beta = None
        if spec.bn_affine:
            gamma = t(state["gamma"]).requires_grad_(True)
            beta = t(state["beta"]).requires_grad_(True)
            params.update(gamma=gamma, beta=beta)
        if norm == "batch_norm" and not spec.bn_track_running_stats:
            a = F.batch_norm(z, None, None, gamma, beta, training=True, eps=spec.bn_epsilon)
        elif norm == "batch_norm":
            rm, rv = t(state["running_mean"]), t(state["running_var"])
            a = F.batch_norm(z, rm.clone(), rv.clone(), gamma, beta, training=training,
                             momentum=0.0, eps=spec.bn_epsilon)  # (clones: the update is written out below)
            tracked = state.get("num_batches_tracked")
            if training:
                # The running variance takes the biased variance (the design's rule) or the
                # unbiased one (PyTorch's, bn_running_var="unbiased"): written out here.
                zd = z.detach()
                mean = zd.mean(dim=(0, 2, 3))
                var = zd.var(dim=(0, 2, 3), unbiased=False) * spec.running_var_scale(zd.numel() // zd.shape[1])
                m = spec.bn_momentum
                if m is None:  # BatchNorm2d(momentum=None): 1 / the batches counted with this one
                    tracked = np.array(int(tracked) + 1, np.int64)
                    m = 1.0 / float(tracked)
                rm, rv = (1 - m) * rm + m * mean, (1 - m) * rv + m * var
            out["running_mean"], out["running_var"] = rm.numpy(), rv.numpy()
            if tracked is not None:
                out["num_batches_tracked"] = np.array(tracked, np.int64)
        else:  # layer norm: per sample over (OH, OW, OC), gamma/beta per channel
            zn = z.permute(0, 2, 3, 1)
            a = F.layer_norm(zn, zn.shape[1:], eps=spec.bn_epsilon)
            if gamma is not None:
                a = a * gamma + beta
            a = a.permute(0, 3, 1, 2)
    y = _activation(spec.activation.value, a, spec.activation_parameter)
    y.backward(t(d_y).permute(0, 3, 1, 2))
    nhwc = lambda v: v.detach().permute(0, 2, 3, 1).contiguous().numpy()  # noqa: E731
    out["y"] = nhwc(y)
    out["pre_activations"] = nhwc(z)
    out["d_x"] = nhwc(xt.grad)
    out["d_pre_activations"] = nhwc(z.grad)
    for k, p in params.items():
        g = p.grad.detach()
        out[f"grad.{k}"] = (g.permute(0, 2, 3, 1).contiguous() if k == "weights" else g).numpy()
    return out
