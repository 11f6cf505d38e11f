"""Helpers for checking a layer's numbers: comparison within the type policy's tolerance."""

from __future__ import annotations

import numpy as np

from conv2d.dtypes import tolerance
from conv2d.spec import DType, LayerSpec


def reduction_lengths(spec: LayerSpec) -> dict[str, int]:
    """The longest sum behind each result of the layer (what `tolerance` scales with)."""
    kh, kw = spec.kernel
    pixels = spec.batch_size * spec.out_height * spec.out_width
    norm = pixels if spec.normalization.value == "batch_norm" else spec.out_height * spec.out_width * spec.out_channels
    forward = kh * kw * spec.in_channels
    if spec.normalization.value != "none":
        forward = max(forward, norm)
    data = max(forward, kh * kw * spec.out_channels)
    filt = max(forward, pixels)
    return {"y": forward, "pre_activations": kh * kw * spec.in_channels, "d_x": data,
            "weights": filt, "bias": filt, "gamma": filt, "beta": filt,
            "running_mean": norm, "running_var": norm}


def relative_error(got: np.ndarray, want: np.ndarray, scale: float = 0.0) -> float:
    """max|got - want| / max(max|want|, scale), in float64.

    `scale` is for results that cancel to about zero (the bias gradient under training batch
    norm): pass the size of the terms summed, e.g. max over channels of sum |d_z|. When the
    denominator is zero the answer is 0 for an exact match and 1 otherwise.
    """
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: got {got.shape}, want {want.shape}")
    diff = np.abs(got - want)
    if np.isnan(diff).any():
        return float("inf")
    scale = max(float(np.abs(want).max(initial=0.0)), float(scale))
    worst = diff.max(initial=0.0)
    if scale == 0.0:
        return 0.0 if worst == 0.0 else 1.0
    return float(worst / scale)


def assert_close(name: str, got: np.ndarray, want: np.ndarray, dtype: DType | str,
                 reduction_length: int, scale: float = 0.0, jump: bool = False) -> None:
    """Fail unless `got` is within `tolerance(dtype, reduction_length)` of `want`
    (relative to `max(max|want|, scale)`, see `relative_error`); `jump` for gradients
    through an activation whose derivative jumps."""
    err = relative_error(got, want, scale)
    tol = tolerance(DType(dtype), reduction_length, jump)
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.3e} > tolerance {tol:.3e} "
                             f"({DType(dtype).value}, reduction length {reduction_length})")
