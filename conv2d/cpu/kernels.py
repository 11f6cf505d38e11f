"""The CPU backend's compiled loops (numba's CPU compiler, `@njit`): the one module of
conv2d/cpu that imports numba.

Every reduction is deterministic whatever the thread count: a sum runs over fixed chunks
of `CHUNK_ROWS` rows (fixed by the array's shape, never by the threads), each chunk's
partial sum in float64 in row order, one chunk a `prange` iteration, and the partials are
added in chunk order by one thread. Elementwise work runs in float64 and is stored in the
output's dtype.

Arrays: activations as (N, P, C) views of (N, OH, OW, OC) (P = OH*OW), C-contiguous.
`mode`: NO_NORM, BATCH_NORM (mean, inv_std per channel, (C,)) or LAYER_NORM (per sample,
(N,)); `code`: the activation's index in `ACTIVATION_CODES`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from conv2d.activations import (FAST_TANH_CLAMP, GELU_CUBIC, GELU_ORIGINAL_CUBIC, GELU_ORIGINAL_K, GELU_TANH_K,
                                HARDSWISH_SHIFT, INV_SQRT2, INV_SQRT_2PI, RELU6_CAP, Activation)

ACTIVATION_CODES = {a: i for i, a in enumerate(Activation)}
NO_NORM, BATCH_NORM, LAYER_NORM = 0, 1, 2
# Rows a chunk of a sum: small enough that a batch has chunks for every thread, large
# enough that the partials ((chunks, C) float64) stay a small fraction of the data.
CHUNK_ROWS = 256

(_IDENTITY, _RELU, _TANH, _SIGMOID, _FAST_TANH, _GELU_TANH, _GELU, _GELU_ORIGINAL, _SILU, _RELU6, _HARDSWISH,
 _LEAKY_RELU, _ELU) = (ACTIVATION_CODES[a] for a in Activation)


@njit(inline="always", cache=True)
def _sigmoid(x):
    if x >= 0.0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


@njit(inline="always", cache=True)
def _fast_tanh(x):
    c = x
    if c > FAST_TANH_CLAMP:
        c = FAST_TANH_CLAMP
    elif c < -FAST_TANH_CLAMP:
        c = -FAST_TANH_CLAMP
    c2 = c * c
    return c * (27.0 + c2) / (27.0 + 9.0 * c2)


@njit(inline="always", cache=True)
def activate(code, x, p):
    """f(x) of activation `code` (float64), `p` LeakyReLU's slope or ELU's alpha."""
    if code == _RELU:
        return 0.0 if x < 0.0 else x
    if code == _IDENTITY:
        return x
    if code == _RELU6:
        return 0.0 if x < 0.0 else (RELU6_CAP if x > RELU6_CAP else x)
    if code == _TANH:
        return math.tanh(x)
    if code == _SIGMOID:
        return _sigmoid(x)
    if code == _FAST_TANH:
        return _fast_tanh(x)
    if code == _GELU_TANH:
        return 0.5 * x * (1.0 + math.tanh(GELU_TANH_K * (x + GELU_CUBIC * x * x * x)))
    if code == _GELU_ORIGINAL:
        return 0.5 * x * (1.0 + math.tanh(GELU_ORIGINAL_K * (x + GELU_ORIGINAL_CUBIC * x * x * x)))
    if code == _GELU:
        return 0.5 * x * (1.0 + math.erf(x * INV_SQRT2))
    if code == _SILU:
        return x * _sigmoid(x)
    if code == _HARDSWISH:
        r = x + HARDSWISH_SHIFT
        r = 0.0 if r < 0.0 else (RELU6_CAP if r > RELU6_CAP else r)
        return x * r / RELU6_CAP
    if code == _LEAKY_RELU:
        return x if x > 0.0 else x * p
    # ELU
    return x if x > 0.0 else p * math.expm1(x)


@njit(inline="always", cache=True)
def _gelu_tanh_derivative(x, k, cubic):
    t = math.tanh(k * (x + cubic * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * cubic * x * x)


@njit(inline="always", cache=True)
def derivative(code, x, p):
    """f'(x) at the activation's input, as conv2d.activations.derivative."""
    if code == _RELU:
        return 1.0 if x > 0.0 else 0.0
    if code == _IDENTITY:
        return 1.0
    if code == _RELU6:
        return 1.0 if (x > 0.0 and x < RELU6_CAP) else 0.0
    if code == _TANH:
        t = math.tanh(x)
        return 1.0 - t * t
    if code == _SIGMOID:
        s = _sigmoid(x)
        return s * (1.0 - s)
    if code == _FAST_TANH:
        f = _fast_tanh(x)
        return 1.0 - f * f
    if code == _GELU_TANH:
        return _gelu_tanh_derivative(x, GELU_TANH_K, GELU_CUBIC)
    if code == _GELU_ORIGINAL:
        return _gelu_tanh_derivative(x, GELU_ORIGINAL_K, GELU_ORIGINAL_CUBIC)
    if code == _GELU:
        return 0.5 * (1.0 + math.erf(x * INV_SQRT2)) + x * math.exp(-0.5 * x * x) * INV_SQRT_2PI
    if code == _SILU:
        s = _sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    if code == _HARDSWISH:
        if x <= -HARDSWISH_SHIFT:
            return 0.0
        return x / HARDSWISH_SHIFT + 0.5 if x < HARDSWISH_SHIFT else 1.0
    if code == _LEAKY_RELU:
        return 1.0 if x > 0.0 else p
    return 1.0 if x > 0.0 else p * math.exp(x)  # ELU


@njit(inline="always", cache=True)
def _statistic_index(mode, n, c):
    return n if mode == LAYER_NORM else c


# Sums -------------------------------------------------------------------------------------
@njit(parallel=True, cache=True)
def column_sums(a, shift):
    """sum over rows of (a[r, c] - shift[c]) ** power, for power 1 and 2 at once: ((C,),
    (C,)) float64, of a 2-D (M, C) array, deterministically (fixed chunks, in order)."""
    m, c = a.shape
    chunks = (m + CHUNK_ROWS - 1) // CHUNK_ROWS
    part1 = np.zeros((chunks, c))
    part2 = np.zeros((chunks, c))
    for k in prange(chunks):
        for r in range(k * CHUNK_ROWS, min(m, (k + 1) * CHUNK_ROWS)):
            for j in range(c):
                v = np.float64(a[r, j]) - shift[j]
                part1[k, j] += v
                part2[k, j] += v * v
    s1 = np.zeros(c)
    s2 = np.zeros(c)
    for k in range(chunks):
        for j in range(c):
            s1[j] += part1[k, j]
            s2[j] += part2[k, j]
    return s1, s2


@njit(parallel=True, cache=True)
def row_sums(a, shift):
    """sum over each row of (a[n, s] - shift[n]) ** power, for power 1 and 2: ((N,), (N,))
    float64, of a 2-D (N, S) array; each row in fixed chunks of CHUNK_ROWS * 16 values."""
    n, s = a.shape
    width = CHUNK_ROWS * 16
    chunks = (s + width - 1) // width
    part1 = np.zeros((n, chunks))
    part2 = np.zeros((n, chunks))
    for t in prange(n * chunks):
        i, k = t // chunks, t % chunks
        for j in range(k * width, min(s, (k + 1) * width)):
            v = np.float64(a[i, j]) - shift[i]
            part1[i, k] += v
            part2[i, k] += v * v
    s1 = np.zeros(n)
    s2 = np.zeros(n)
    for i in range(n):
        for k in range(chunks):
            s1[i] += part1[i, k]
            s2[i] += part2[i, k]
    return s1, s2


# The norm and activation, fused ----------------------------------------------------------
@njit(parallel=True, cache=True)
def forward_epilogue(z, mode, mean, inv_std, gamma, beta, code, p, y):
    """y = f(gamma * (z - mean) * inv_std + beta) (f(z) with NO_NORM), z and y (N, P, C)."""
    n, pixels, c = z.shape
    for t in prange(n * pixels):
        i, q = t // pixels, t % pixels
        for j in range(c):
            a = np.float64(z[i, q, j])
            if mode != NO_NORM:
                s = _statistic_index(mode, i, j)
                a = (a - mean[s]) * inv_std[s] * gamma[j] + beta[j]
            y[i, q, j] = activate(code, a, p)


@njit(inline="always", cache=True)
def _grad_activation_input(z, d_y, mode, mean, inv_std, gamma, beta, code, p, i, q, j):
    """(d_a, x_hat) at one element: d_a = f'(a) * d_y, a the activation's input."""
    a = np.float64(z[i, q, j])
    x_hat = 0.0
    if mode != NO_NORM:
        s = _statistic_index(mode, i, j)
        x_hat = (a - mean[s]) * inv_std[s]
        a = x_hat * gamma[j] + beta[j]
    return derivative(code, a, p) * np.float64(d_y[i, q, j]), x_hat


@njit(parallel=True, cache=True)
def backward_sums(z, d_y, mode, mean, inv_std, gamma, beta, code, p):
    """The norm's backward sums: per channel (C,) sum(d_a) and sum(d_a * x_hat) (d_beta,
    d_gamma), and per sample (N,) sum(d_a * gamma) and sum(d_a * gamma * x_hat) (layer
    norm's means need them); fixed chunks of rows within each sample, added in order."""
    n, pixels, c = z.shape
    chunks = (pixels + CHUNK_ROWS - 1) // CHUNK_ROWS
    by_channel = np.zeros((n * chunks, 2, c))
    by_sample = np.zeros((n * chunks, 2))
    for t in prange(n * chunks):
        i, k = t // chunks, t % chunks
        for q in range(k * CHUNK_ROWS, min(pixels, (k + 1) * CHUNK_ROWS)):
            for j in range(c):
                d_a, x_hat = _grad_activation_input(z, d_y, mode, mean, inv_std, gamma, beta, code, p, i, q, j)
                by_channel[t, 0, j] += d_a
                by_channel[t, 1, j] += d_a * x_hat
                g = d_a * gamma[j]
                by_sample[t, 0] += g
                by_sample[t, 1] += g * x_hat
    channel = np.zeros((2, c))
    sample = np.zeros((2, n))
    for t in range(n * chunks):
        for j in range(c):
            channel[0, j] += by_channel[t, 0, j]
            channel[1, j] += by_channel[t, 1, j]
        sample[0, t // chunks] += by_sample[t, 0]
        sample[1, t // chunks] += by_sample[t, 1]
    return channel, sample


@njit(parallel=True, cache=True)
def backward_epilogue(z, d_y, mode, mean, inv_std, gamma, beta, code, p, batch_stats, mean_g, mean_gx, d_z):
    """d_z (N, P, C) of the activation and the norm: f'(a) * d_y without a norm;
    inv_std * (g - mean_g - x_hat * mean_gx) with g = d_a * gamma where the statistics came
    from the batch (mean_g, mean_gx indexed as the statistics: per channel or per sample);
    d_a * gamma * inv_std where they were fixed."""
    n, pixels, c = z.shape
    for t in prange(n * pixels):
        i, q = t // pixels, t % pixels
        for j in range(c):
            d_a, x_hat = _grad_activation_input(z, d_y, mode, mean, inv_std, gamma, beta, code, p, i, q, j)
            if mode == NO_NORM:
                d_z[i, q, j] = d_a
                continue
            s = _statistic_index(mode, i, j)
            g = d_a * gamma[j]
            if batch_stats:
                d_z[i, q, j] = inv_std[s] * (g - mean_g[s] - x_hat * mean_gx[s])
            else:
                d_z[i, q, j] = g * inv_std[s]


# Depthwise convolutions (groups = C, each input channel makes `mult` output channels) -----
# Output channel o = c * mult + j reads input channel c. Sums run in the arrays' dtype
# (the compute dtype: float32 lanes vectorise twice as wide), the filter gradient's
# partials in float64.
DEPTHWISE_CHUNK_ROWS = 8  # output rows (of one sample) a chunk of the filter gradient


@njit(parallel=True, cache=True)
def depthwise_forward(xp, w, stride, dilation, y):
    """y[n, oh, ow, o] = sum_{kh, kw} xp[n, oh*SH + kh*DH, ow*SW + kw*DW, o // mult] * w[kh, kw, o],
    xp (N, Hp, Wp, C) padded, w (KH, KW, OC), y (N, OH, OW, OC), one dtype."""
    n, oh, ow, oc = y.shape
    kh, kw = w.shape[0], w.shape[1]
    c = xp.shape[3]
    mult = oc // c
    sh, sw = stride
    dh, dw = dilation
    for t in prange(n * oh):
        i, r = t // oh, t % oh
        acc = np.empty(oc, y.dtype)
        for col in range(ow):
            acc[:] = 0
            for a in range(kh):
                for b in range(kw):
                    row = xp[i, r * sh + a * dh, col * sw + b * dw]
                    tap = w[a, b]
                    if mult == 1:
                        for o in range(oc):
                            acc[o] += row[o] * tap[o]
                    else:
                        for ch in range(c):
                            for j in range(mult):
                                acc[ch * mult + j] += row[ch] * tap[ch * mult + j]
            y[i, r, col] = acc


@njit(parallel=True, cache=True)
def depthwise_backward_data(d_z, w, stride, dilation, d_xp):
    """d_xp (N, Hp, Wp, C), zeroed, += each output position's taps: one sample a thread,
    its positions in order."""
    n, oh, ow, oc = d_z.shape
    kh, kw = w.shape[0], w.shape[1]
    c = d_xp.shape[3]
    mult = oc // c
    sh, sw = stride
    dh, dw = dilation
    for i in prange(n):
        for r in range(oh):
            for col in range(ow):
                g = d_z[i, r, col]
                for a in range(kh):
                    for b in range(kw):
                        out = d_xp[i, r * sh + a * dh, col * sw + b * dw]
                        tap = w[a, b]
                        if mult == 1:
                            for o in range(oc):
                                out[o] += g[o] * tap[o]
                        else:
                            for ch in range(c):
                                for j in range(mult):
                                    out[ch] += g[ch * mult + j] * tap[ch * mult + j]


@njit(parallel=True, cache=True)
def depthwise_backward_filter(xp, d_z, kernel, stride, dilation):
    """d_w (KH, KW, OC) float64: sum over n, oh, ow of d_z[n, oh, ow, o] * the tap's input,
    in fixed chunks of DEPTHWISE_CHUNK_ROWS output rows of one sample, added in order."""
    n, oh, ow, oc = d_z.shape
    kh, kw = kernel
    c = xp.shape[3]
    mult = oc // c
    sh, sw = stride
    dh, dw = dilation
    per_sample = (oh + DEPTHWISE_CHUNK_ROWS - 1) // DEPTHWISE_CHUNK_ROWS
    part = np.zeros((n * per_sample, kh, kw, oc))
    for t in prange(n * per_sample):
        i, k = t // per_sample, t % per_sample
        for r in range(k * DEPTHWISE_CHUNK_ROWS, min(oh, (k + 1) * DEPTHWISE_CHUNK_ROWS)):
            for col in range(ow):
                g = d_z[i, r, col]
                for a in range(kh):
                    for b in range(kw):
                        row = xp[i, r * sh + a * dh, col * sw + b * dw]
                        acc = part[t, a, b]
                        for o in range(oc):
                            acc[o] += np.float64(g[o]) * np.float64(row[o // mult])
    d_w = np.zeros((kh, kw, oc))
    for t in range(n * per_sample):
        d_w += part[t]
    return d_w
