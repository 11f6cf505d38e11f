"""Conversion between our state and PyTorch's `nn.Conv2d` / `nn.BatchNorm2d` parameter layout.

PyTorch keeps convolution weights as (OC, IC, KH, KW) (NCHW); ours are (OC, KH, KW, IC).
Names map as: weights -> conv.weight, bias -> conv.bias, gamma -> norm.weight,
beta -> norm.bias, running_mean -> norm.running_mean, running_var -> norm.running_var.
Values are NumPy arrays both ways (a torch tensor is accepted on the way in and converted
with `.detach().cpu().numpy()`); no dtype is changed. Note PyTorch's BatchNorm2d updates
running_var with the unbiased batch variance, our layer with the biased one.
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


def state_to_torch(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our state dict -> {"conv.weight": (OC, IC, KH, KW), "conv.bias", "norm.*"}."""
    unknown = sorted(set(state) - set(_NAMES))
    if unknown:
        raise KeyError(f"state: unknown keys {unknown}; known are {sorted(_NAMES)}")
    return {_NAMES[k]: (weights_to_torch(v) if k == "weights" else np.array(v, copy=True))
            for k, v in state.items()}


def state_from_torch(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The inverse of `state_to_torch`; PyTorch's `norm.num_batches_tracked` is ignored."""
    back = {v: k for k, v in _NAMES.items()}
    unknown = sorted(set(tensors) - set(back) - {"norm.num_batches_tracked"})
    if unknown:
        raise KeyError(f"tensors: unknown keys {unknown}; known are {sorted(back)}")
    return {back[k]: (weights_from_torch(v) if k == "conv.weight" else np.array(_numpy(v), copy=True))
            for k, v in tensors.items() if k in back}
