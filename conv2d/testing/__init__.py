"""Helpers for checking a layer's numbers: comparison within the type policy's tolerance."""

from __future__ import annotations

import numpy as np

from conv2d.dtypes import tolerance
from conv2d.spec import DType, LayerSpec, Normalization


def reduction_lengths(spec: LayerSpec) -> dict[str, int]:
    """The longest sum behind each result of the layer (what `tolerance` scales with)."""
    kh, kw = spec.kernel
    pixels = spec.batch_size * spec.out_height * spec.out_width
    norm = pixels if spec.normalization is Normalization.BATCH_NORM else spec.out_height * spec.out_width * spec.out_channels
    forward = spec.fan_in  # kh * kw * in_channels / groups
    if spec.normalization.value != "none":
        forward = max(forward, norm)
    data = max(forward, kh * kw * spec.out_channels // spec.groups)
    filt = max(forward, pixels)
    return {"y": forward, "pre_activations": spec.fan_in, "d_x": data,
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

    if not spec.batch_statistics(training):
        return {}
    d_abs = np.abs(np.asarray(d_pre, dtype=np.float64))
    x_abs = np.abs(np.asarray(x).astype(np.float64))
    return {"bias": float(d_abs.sum(axis=(0, 1, 2)).max()),
            "weights": float(conv_backward_filter(x_abs, d_abs, spec.kernel, spec.stride, spec.pads, spec.dilation,
                                                  spec.groups, spec.padding_mode).max())}


def conditioning_scales(spec: LayerSpec, state: dict[str, np.ndarray], x: np.ndarray, d_y: np.ndarray,
                        training: bool) -> dict[str, float]:
    """Denominators for the results of a norm over few or nearly equal values, else nothing.

    A norm centres z on its mean and scales by inv_std: rounding z - mean errs by about
    u * |z|, which the scaling multiplies by inv_std. Where the values are many and spread,
    inv_std * |z| is a few and this is within max|y|; where they are few or nearly equal
    (a constant channel: inv_std = 1/sqrt(eps)), it is not, however exact the arithmetic:
    so y is measured against max over groups of |gamma| * inv_std * max|z|. With batch
    statistics, d_z = inv_std * (g - mean(g) - x_hat * mean(g * x_hat)) (g = d_a * gamma)
    cancels by construction (with two values a group, x_hat = +-1 and d_z is eps-small):
    its error scales with its terms, S = inv_std * (|g| + mean|g| + |x_hat| * mean|g *
    x_hat|), and d_x is measured against backward_data(|W|, S). Computed in float64 from
    the spec, the float64 `state`, `x` and `d_y` (the oracle's own inputs)."""
    from dataclasses import replace

    from conv2d import activations
    from conv2d.reference import functional as F
    from conv2d.reference.conv import conv_backward_data
    from conv2d.state import RUNNING

    if spec.normalization is Normalization.NONE:
        return {}
    spec64 = replace(spec, dtype="float64")
    params = {k: np.asarray(v, np.float64) for k, v in state.items() if k not in RUNNING}
    running = {k: np.array(state[k], np.int64 if k == "num_batches_tracked" else np.float64)
               for k in RUNNING if k in state} or None
    x64, dy64 = np.asarray(x, np.float64), np.asarray(d_y, np.float64)
    _, saved = F.forward(spec64.at(x64.shape[0], x64.shape[1], x64.shape[2]), params, x64, training, running)
    axes = F._axes(spec64)
    from conv2d.reference import norm

    z = saved.pre
    gamma, inv_std = params.get("gamma", np.ones(spec.out_channels)), saved.inv_std
    scale_z = np.abs(z).max(axis=axes)  # per group, as inv_std
    if spec.normalization is Normalization.BATCH_NORM:
        y_scale = float((np.abs(gamma) * inv_std * scale_z).max())
    else:
        y_scale = float((np.abs(gamma).max() * inv_std * scale_z).max())
    out = {"y": y_scale}
    if saved.batch_stats:
        x_hat = norm.normalize(z, saved.mean, inv_std, axes)
        a = norm.affine(x_hat, gamma, params.get("beta", np.zeros(spec.out_channels)))
        g = np.abs(activations.derivative(spec.activation, a, spec.activation_parameter) * dy64 * gamma)
        terms = g + g.mean(axis=axes, keepdims=True) + np.abs(x_hat) * (g * np.abs(x_hat)).mean(axis=axes,
                                                                                               keepdims=True)
        terms *= norm.expand(inv_std, axes)
        w = np.abs(params["weights"])
        c = saved.spec
        out["d_x"] = float(conv_backward_data(w, terms, (c.in_height, c.in_width), c.stride, c.pads,
                                              dilation=c.dilation, groups=c.groups, mode=c.padding_mode).max())
    return out


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
