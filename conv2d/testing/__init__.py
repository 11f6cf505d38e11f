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


def cancellation_scales(spec: LayerSpec, training: bool, x: np.ndarray,
                        d_pre: np.ndarray) -> dict[str, float]:
    """Denominators for results that cancel by construction, else nothing.

    When the norm's statistics come from the batch itself (batch norm in training, layer
    norm always), d_z sums to zero over what was normalised, so the bias gradient
    sum(d_z) and the weight gradient sum(d_z * x) are small differences of large terms.
    Their rounding error scales with the sum of the terms' magnitudes (Higham's bound), so
    that is what they are measured against: max over channels of sum |d_z|, and the
    largest entry of backward_filter(|x|, |d_z|). `d_pre` is the oracle's d_z.
    """
    from conv2d.reference.conv import conv_backward_filter

    batch_stats = spec.normalization.value == "layer_norm" or (
        spec.normalization.value == "batch_norm" and training)
    if not batch_stats:
        return {}
    d_abs = np.abs(np.asarray(d_pre, dtype=np.float64))
    x_abs = np.abs(np.asarray(x).astype(np.float64))
    return {"bias": float(d_abs.sum(axis=(0, 1, 2)).max()),
            "weights": float(conv_backward_filter(x_abs, d_abs, spec.kernel, spec.stride, spec.padding).max())}


def relative_error(got: np.ndarray, want: np.ndarray, scale: float = 0.0) -> float:
    """max|got - want| / max(max|want|, scale), in float64.

    `scale` is for results that cancel by construction (see `cancellation_scales`). When the
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
