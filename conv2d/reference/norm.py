"""Batch norm and layer norm, in NumPy, over (N, OH, OW, OC) arrays in the compute dtype.

Both normalise `z` over some axes and scale and shift per channel:
batch norm over `BATCH_AXES` (N, OH, OW), one statistic per channel, shape (OC,);
layer norm over `LAYER_AXES` (OH, OW, OC), one statistic per sample, shape (N,).
`expand` turns a statistic back into a shape that broadcasts against `z`.
"""

from __future__ import annotations

import numpy as np

BATCH_AXES = (0, 1, 2)
LAYER_AXES = (1, 2, 3)


def wide_mean(a: np.ndarray, axes: tuple[int, ...], keepdims: bool = False) -> np.ndarray:
    """a's mean over `axes` (BATCH_AXES or LAYER_AXES of an (N, OH, OW, OC) array),
    summed in float64 (at least) and returned in a's dtype. A float32 sum over N·OH·OW
    rows gathers an error that grows with the count (batch norm in float32 measured
    2.4-2.9x PyTorch's error, scripts/accuracy_cuda.py); float64 sums keep it at one
    float32 rounding."""
    sums = a.sum(axis=axes, dtype=np.promote_types(a.dtype, np.float64))
    mean = (sums / (a.size // sums.size)).astype(a.dtype, copy=False)
    return expand(mean, axes) if keepdims else mean


def wide_sum(a: np.ndarray) -> np.ndarray:
    """The sums of an (M, C) array's rows, added in float64 (at least), in a's dtype."""
    return a.sum(axis=0, dtype=np.promote_types(a.dtype, np.float64)).astype(a.dtype, copy=False)


def expand(stat: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """(OC,) -> (1, 1, 1, OC) for batch norm; (N,) -> (N, 1, 1, 1) for layer norm."""
    return stat.reshape((1, 1, 1, -1) if axes == BATCH_AXES else (-1, 1, 1, 1))


def statistics(z: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Mean and biased variance over `axes`, two passes (mean, then mean squared deviation).
    The CUDA backend's simple kernels do the same; its fast kernels sum z - shift and
    (z - shift)^2 in one pass, shift = the group's first value (mean = shift + mean of
    the shifted values, var = their mean square minus its square), within the tolerance."""
    mean = wide_mean(z, axes)
    dev = z - expand(mean, axes)
    dev *= dev
    return mean, wide_mean(dev, axes)


def inverse_std(var: np.ndarray, epsilon: float) -> np.ndarray:
    return (1.0 / np.sqrt(var + var.dtype.type(epsilon))).astype(var.dtype, copy=False)


def normalize(z: np.ndarray, mean: np.ndarray, inv_std: np.ndarray,
              axes: tuple[int, ...]) -> np.ndarray:
    """x_hat = (z - mean) * inv_std, same shape as `z`."""
    # In place on one new array: these run over the whole activation tensor, where each
    # temporary costs a pass and fresh pages.
    x_hat = z - expand(mean, axes)
    x_hat *= expand(inv_std, axes)
    return x_hat


def affine(x_hat: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """gamma * x_hat + beta, per channel (the last axis)."""
    a = x_hat * gamma
    a += beta
    return a


def update_running(running: np.ndarray, batch_stat: np.ndarray, momentum: float) -> np.ndarray:
    """(1 - momentum) * running + momentum * batch_stat, in `running`'s dtype."""
    m = running.dtype.type(momentum)
    return ((1 - m) * running + m * batch_stat.astype(running.dtype)).astype(running.dtype, copy=False)


def param_backward(d_out: np.ndarray, x_hat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """d_gamma = sum(d_out * x_hat), d_beta = sum(d_out), over N, OH, OW: (OC,) each."""
    c = d_out.shape[-1]
    return wide_sum((d_out * x_hat).reshape(-1, c)), wide_sum(d_out.reshape(-1, c))


def backward_batch_statistics(d_out: np.ndarray, x_hat: np.ndarray, inv_std: np.ndarray,
                              gamma: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """d_z when mean and inv_std were computed from `z` itself over `axes`.

    With g = d_out * gamma: d_z = inv_std * (g - mean(g) - x_hat * mean(g * x_hat)).
    """
    g = d_out * gamma
    mean_g = wide_mean(g, axes, keepdims=True)
    mean_gx = wide_mean(g * x_hat, axes, keepdims=True)
    g -= mean_g
    g -= x_hat * mean_gx
    g *= expand(inv_std, axes)
    return g


def backward_fixed_statistics(d_out: np.ndarray, inv_std: np.ndarray, gamma: np.ndarray,
                              axes: tuple[int, ...]) -> np.ndarray:
    """d_z when mean and inv_std were constants (batch norm in eval): d_out * gamma * inv_std."""
    return d_out * gamma * expand(inv_std, axes)
