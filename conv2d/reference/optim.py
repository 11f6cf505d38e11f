"""The optimizers' updates in NumPy, in place, in the compute dtype (float64 for float64
arrays, float32 otherwise); `conv2d.optim` holds their state, and `conv2d/cuda/optim.py`
has the same updates as kernels (one launch a layer).

`adam` and `sgd` update `value` from `grad` and the optimizer's arrays for one parameter:
`master` is the float32 copy of a 16-bit parameter (None otherwise), updated and then
rounded into `value`. `h` holds the step's hyper-parameters (see `conv2d.optim`).
`adam_step` and `sgd_step` update every parameter of a layer for the step after the count
in `step` (a one-element int64 array), then store the new count there, as the kernels do.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np


def _compute(value: np.ndarray) -> np.dtype:
    return np.dtype(np.float64) if value.dtype == np.float64 else np.dtype(np.float32)


def _finish(value: np.ndarray, p: np.ndarray, master: np.ndarray | None) -> None:
    if master is not None:
        master[...] = p
    value[...] = p.astype(value.dtype)


def adam(value: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, master: np.ndarray | None,
         h: dict[str, Any]) -> None:
    """One Adam step. h["rule"] "rl_tools": m, v as usual, value -= alpha * c1 * m /
    (sqrt(max(v * c2, eps_sqrt)) + eps) + (value * weight_decay / 2 where h["decay"]);
    "torch": torch.optim.Adam (L2 weight decay added to the gradient, m by lerp);
    "torch_w": torch.optim.AdamW (decoupled: value *= 1 - lr * weight_decay first)."""
    ct = _compute(value)
    t = ct.type
    p = (master if master is not None else value).astype(ct)
    g = grad.astype(ct)
    b1, b2, lr, eps, wd = t(h["beta1"]), t(h["beta2"]), t(h["lr"]), t(h["eps"]), t(h["weight_decay"])
    rule = h["rule"]
    if rule == "rl_tools":
        m[...] = b1 * m + (t(1) - b1) * g
        v[...] = b2 * v + (t(1) - b2) * g * g
        update = lr * t(h["c1"]) * m / (np.sqrt(np.maximum(v * t(h["c2"]), t(h["eps_sqrt"]))) + eps)
        if h["decay"]:
            update += p * wd / t(2)
        p = p - update
    else:
        if rule == "torch" and wd:
            g = g + wd * p
        elif rule == "torch_w" and wd:
            p = p * (t(1) - lr * wd)
        m += (g - m) * (t(1) - b1)  # torch's lerp
        v[...] = v * b2 + g * g * (t(1) - b2)
        denom = np.sqrt(v) / t(h["bc2_sqrt"]) + eps
        p = p - t(h["step_size"]) * m / denom
    _finish(value, p, master)


def sgd(value: np.ndarray, grad: np.ndarray, buf: np.ndarray | None, master: np.ndarray | None,
        h: dict[str, Any]) -> None:
    """One step of torch.optim.SGD's rule: g += weight_decay * value; with momentum,
    buf = momentum * buf + (1 - dampening) * g (buf = g on the first step, h["first"]),
    g = g + momentum * buf (nesterov) or buf; value -= lr * g."""
    ct = _compute(value)
    t = ct.type
    p = (master if master is not None else value).astype(ct)
    g = grad.astype(ct)
    if h["weight_decay"]:
        g = g + t(h["weight_decay"]) * p
    if buf is not None:
        mom = t(h["momentum"])
        if h["first"]:
            buf[...] = g
        else:
            buf[...] = buf * mom + g * (t(1) - t(h["dampening"]))
        g = g + mom * buf if h["nesterov"] else buf.astype(ct)
    _finish(value, p - t(h["lr"]) * g, master)


def bias_corrections(h: Mapping[str, Any], t: int) -> dict[str, float]:
    """Adam's step-t factors, in float64: c1 = 1 / (1 - beta1^t), c2 = 1 / (1 - beta2^t)
    (rl_tools), step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t) (torch)."""
    b1t, b2t = math.pow(h["beta1"], t), math.pow(h["beta2"], t)
    return {"c1": 1.0 / (1.0 - b1t), "c2": 1.0 / (1.0 - b2t), "step_size": h["lr"] / (1.0 - b1t),
            "bc2_sqrt": math.sqrt(1.0 - b2t)}


def adam_step(params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray], buffers: Mapping[str, dict],
              step: np.ndarray, h: Mapping[str, Any]) -> None:
    """One Adam step of every parameter of a layer; h["decayed"] names those that take
    rl_tools' weight decay."""
    t = int(step[0]) + 1
    corrections = bias_corrections(h, t)
    for name, value in params.items():
        b = buffers[name]
        decay = name in h["decayed"] and h["weight_decay"] > 0
        adam(value, grads[name], b["m"], b["v"], b.get("master"), dict(h, decay=decay, **corrections))
    step[0] = t


def sgd_step(params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray], buffers: Mapping[str, dict],
             step: np.ndarray, h: Mapping[str, Any]) -> None:
    """One SGD step of every parameter of a layer (the momentum buffers start on step 1)."""
    t = int(step[0]) + 1
    for name, value in params.items():
        b = buffers[name]
        sgd(value, grads[name], b.get("buf"), b.get("master"), dict(h, first=t == 1))
    step[0] = t
