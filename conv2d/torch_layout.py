"""Conversion between our state and PyTorch's `nn.Conv2d` / `nn.BatchNorm2d` parameter layout.

PyTorch keeps convolution weights as (OC, IC, KH, KW) (NCHW); ours are (OC, KH, KW, IC).
Names map as: weights -> {conv}.weight, bias -> {conv}.bias, gamma -> {norm}.weight,
beta -> {norm}.bias, running_mean -> {norm}.running_mean, running_var ->
{norm}.running_var, for module prefixes the caller names ("conv"/"norm" by default,
"0"/"1" for an `nn.Sequential`, "" for a module's own state_dict). A bias-free
convolution has no bias on either side. Values are NumPy arrays both ways (a torch
tensor is accepted on the way in and converted with `.detach().cpu().numpy()`); no
dtype is changed. PyTorch's BatchNorm2d updates running_var with the unbiased batch
variance: a layer continuing its training takes `bn_running_var="unbiased"`.
`dense_weight_to_conv` converts the one weight users got wrong: a dense layer after a
flatten (NCHW order in PyTorch, NHWC here).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

_NAMES = {
    "weights": "conv.weight",
    "bias": "conv.bias",
    "gamma": "norm.weight",
    "beta": "norm.bias",
    "running_mean": "norm.running_mean",
    "running_var": "norm.running_var",
}


def weights_to_torch(w: np.ndarray) -> np.ndarray:
    """(OC, KH, KW, IC) -> (OC, IC, KH, KW), C-contiguous copy."""
    if w.ndim != 4:
        raise ValueError(f"w: expected a 4-D (OC, KH, KW, IC) array, got shape {w.shape}")
    return np.ascontiguousarray(w.transpose(0, 3, 1, 2))


def weights_from_torch(w: Any) -> np.ndarray:
    """(OC, IC, KH, KW) -> (OC, KH, KW, IC), C-contiguous copy."""
    w = _numpy(w)
    if w.ndim != 4:
        raise ValueError(f"w: expected a 4-D (OC, IC, KH, KW) array, got shape {w.shape}")
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1))


def _numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor
        a = a.detach().cpu().numpy()
    if not isinstance(a, np.ndarray):
        raise TypeError(f"expected a numpy array or torch tensor, got {type(a).__name__}")
    return a


def _names(conv: str, norm: str) -> dict[str, str]:
    """Our state keys -> PyTorch keys under the module prefixes `conv` and `norm` ("" for a
    module's own state_dict, "0" and "1" for a Sequential's, "features.3" for a nested one)."""
    def key(prefix: str, name: str) -> str:
        return f"{prefix}.{name}" if prefix else name
    return {"weights": key(conv, "weight"), "bias": key(conv, "bias"), "gamma": key(norm, "weight"),
            "beta": key(norm, "bias"), "running_mean": key(norm, "running_mean"),
            "running_var": key(norm, "running_var"), "num_batches_tracked": key(norm, "num_batches_tracked")}


def _check_prefixes(conv: str, norm: str) -> None:
    for name, value in (("conv", conv), ("norm", norm)):
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a str prefix, got {type(value).__name__}")
    if conv == norm:
        raise ValueError(f"conv, norm: the two modules need different prefixes, got {conv!r} for both")


def state_to_torch(state: Mapping[str, np.ndarray], conv: str = "conv", norm: str = "norm") -> dict[str, np.ndarray]:
    """Our state dict -> PyTorch's names and layout: "{conv}.weight" (OC, IC, KH, KW),
    "{conv}.bias" (absent for a bias-free layer), "{norm}.weight", "{norm}.bias",
    "{norm}.running_mean", "{norm}.running_var" (and "{norm}.num_batches_tracked" of a
    `bn_momentum=None` layer's state). `conv="0", norm="1"` gives the keys of
    `nn.Sequential(conv, norm, act)` (and of `conv2d.torch.Conv2dNormActivation`)."""
    _check_prefixes(conv, norm)
    names = _names(conv, norm)
    unknown = sorted(set(state) - set(names))
    if unknown:
        raise KeyError(f"state: unknown keys {unknown}; known are {sorted(names)}")
    return {names[k]: (weights_to_torch(v) if k == "weights" else np.array(v, copy=True))
            for k, v in state.items()}


def state_from_torch(tensors: Mapping[str, Any], conv: str = "conv", norm: str = "norm",
                     strict: bool = True, num_batches_tracked: bool = False) -> dict[str, np.ndarray]:
    """The inverse of `state_to_torch`: our state from PyTorch's keys under the prefixes
    `conv` and `norm` (see `state_to_torch`; "" takes an `nn.Conv2d`'s own state_dict).
    BatchNorm2d's `num_batches_tracked` is taken with `num_batches_tracked=True` (the
    state of a `bn_momentum=None` layer, which counts its batches; an error if absent),
    and ignored otherwise. With `strict`, a key under neither prefix is an error; without,
    keys of other modules (a whole model's state_dict) are skipped."""
    _check_prefixes(conv, norm)
    back = {v: k for k, v in _names(conv, norm).items()}
    tracked = _names(conv, norm)["num_batches_tracked"]
    if num_batches_tracked and tracked not in tensors:
        raise KeyError(f"tensors: no {tracked!r} (num_batches_tracked=True) among {sorted(tensors)}")
    if not num_batches_tracked:
        del back[tracked]
    unknown = sorted(set(tensors) - set(back) - {tracked})
    if strict and unknown:
        raise KeyError(f"tensors: unknown keys {unknown}; known are {sorted(back)}")
    weight_key = _names(conv, norm)["weights"]
    if weight_key not in tensors:
        raise KeyError(f"tensors: no convolution weight {weight_key!r} among {sorted(tensors)}")
    return {back[k]: (weights_from_torch(v) if back[k] == "weights" else
                      np.array(_numpy(v), np.int64 if k == tracked else None, copy=True))
            for k, v in tensors.items() if k in back}


def state_from_modules(conv: Any, norm: Any = None) -> dict[str, np.ndarray]:
    """Our state from an `nn.Conv2d` and an optional `nn.BatchNorm2d` / `nn.GroupNorm`
    (the modules or their state_dicts); a BatchNorm2d module with `momentum=None` brings
    its `num_batches_tracked` (the state of a `bn_momentum=None` layer)."""
    def state(m: Any) -> Mapping[str, Any]:
        return m.state_dict() if hasattr(m, "state_dict") else m
    tensors = {f"conv.{k}": v for k, v in state(conv).items()}
    if norm is not None:
        tensors.update({f"norm.{k}": v for k, v in state(norm).items()})
    cumulative = (norm is not None and hasattr(norm, "momentum") and norm.momentum is None
                  and "norm.num_batches_tracked" in tensors)
    return state_from_torch(tensors, num_batches_tracked=cumulative)


def dense_weight_to_conv(w: Any, input_chw: tuple[int, int, int]) -> np.ndarray:
    """A PyTorch `nn.Linear` weight (OUT, C*H*W) that follows `nn.Flatten` of an NCHW
    tensor (C, H, W) -> the weights (OUT, H, W, C) of our convolution whose kernel covers
    the whole (H, W, C) input: the same dense layer on our NHWC layout. PyTorch flattens
    as c*H*W + h*W + w, NHWC as h*W*C + w*C + c; reshaping without this permutation
    silently gives another layer."""
    w = _numpy(w)
    c, h, width = input_chw
    if w.ndim != 2 or w.shape[1] != c * h * width:
        raise ValueError(f"w: expected a 2-D (OUT, {c}*{h}*{width}) = (OUT, {c * h * width}) array, got shape "
                         f"{w.shape}")
    return np.ascontiguousarray(w.reshape(w.shape[0], c, h, width).transpose(0, 2, 3, 1))


def conv_to_dense_weight(w: np.ndarray) -> np.ndarray:
    """The inverse of `dense_weight_to_conv`: our (OUT, H, W, C) -> PyTorch's (OUT, C*H*W)."""
    if w.ndim != 4:
        raise ValueError(f"w: expected a 4-D (OUT, H, W, C) array, got shape {w.shape}")
    return np.ascontiguousarray(w.transpose(0, 3, 1, 2).reshape(w.shape[0], -1))
