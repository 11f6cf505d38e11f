"""Batch norm and layer norm, in NumPy, over (N, OH, OW, OC) arrays in the compute dtype.

Both normalise `z` over some axes and scale and shift per channel:
batch norm over `BATCH_AXES` (N, OH, OW), one statistic per channel, shape (OC,);
layer norm over `LAYER_AXES` (OH, OW, OC), one statistic per sample, shape (N,).
`expand` turns a statistic back into a shape that broadcasts against `z`.
"""

from __future__ import annotations

import functools

import numpy as np

BATCH_AXES = (0, 1, 2)
LAYER_AXES = (1, 2, 3)


# Values a block of a wide sum: converted to float64 a block at a time, each block's sums
# one BLAS matrix-vector product. NumPy's own float64 reduction over the rows of an (M, C)
# float32 array adds one row of C values at a time, and was 1.3-3x slower on the layers of
# the README's digits CNN and the bench shapes (2 cores, a one-off timing).
WIDE_BLOCK = 1 << 15


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    # Read-only and shared: a layer sums arrays of the same few lengths every step.
    ones = np.ones(n, dtype)
    ones.flags.writeable = False
    return ones


def wide_row_sums(a: np.ndarray) -> np.ndarray:
    """The sums of an (M, C) array's rows, (C,), in float64 (at least): blocks of rows in
    order, each block's sum a product with a vector of ones (BLAS takes a transposed view
    as it is)."""
    m, c = a.shape
    dt = np.promote_types(a.dtype, np.float64)
    rows = max(1, WIDE_BLOCK // max(c, 1))
    ones = _ones(min(rows, m), dt)
    if m <= rows:  # one block (a small layer's every sum)
        return ones @ a.astype(dt, copy=False)
    total = np.zeros(c, dt)
    for i in range(0, m, rows):
        part = a[i:i + rows]
        total += ones[:part.shape[0]] @ part.astype(dt, copy=False)
    return total


def wide_mean(a: np.ndarray, axes: tuple[int, ...], keepdims: bool = False) -> np.ndarray:
    """a's mean over `axes` (BATCH_AXES or LAYER_AXES of an (N, OH, OW, OC) array),
    summed in float64 (at least) and returned in a's dtype. A float32 sum over N·OH·OW
    rows gathers an error that grows with the count (batch norm in float32 measured
    2.4-2.9x PyTorch's error, scripts/accuracy_cuda.py); float64 sums keep it at one
    float32 rounding."""
    if axes == BATCH_AXES:
        sums, count = wide_row_sums(a.reshape(-1, a.shape[-1])), a.size // a.shape[-1]
    else:
        sums, count = wide_row_sums(a.reshape(a.shape[0], -1).T), a.size // a.shape[0]  # one sum a sample
    mean = (sums / count).astype(a.dtype, copy=False)
    return expand(mean, axes) if keepdims else mean


def wide_sum(a: np.ndarray) -> np.ndarray:
    """The sums of an (M, C) array's rows in float64 (`wide_row_sums`), in a's dtype."""
    return wide_row_sums(a).astype(a.dtype, copy=False)


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
                              gamma: np.ndarray, axes: tuple[int, ...],
                              sums: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """d_z when mean and inv_std were computed from `z` itself over `axes`.

    With g = d_out * gamma: d_z = inv_std * (g - mean(g) - x_hat * mean(g * x_hat)).
    `sums`: batch norm's (sum(d_out), sum(d_out * x_hat)) over N, OH, OW, (OC,) each
    (`param_backward`'s d_beta and d_gamma): gamma is one value a channel there, so
    mean(g) = gamma * sum(d_out) / count and mean(g * x_hat) = gamma * sum(d_out * x_hat)
    / count, without two more passes over the batch (PyTorch's batch-norm backward reuses
    its two sums the same way). Layer norm's gamma varies within a sample's sums: its
    means always take the two passes.
    """
    g = d_out * gamma
    if sums is not None and axes == BATCH_AXES:
        count = d_out.size // d_out.shape[-1]
        mean_g, mean_gx = (gamma * (s / s.dtype.type(count)) for s in sums)
    else:
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
