"""The CPU backend's compiled norm and activation passes (numba's CPU compiler, `@njit`), and
`run_tasks`, which every compiled loop runs through: with conv2d.cpu.conv_kernels (the
convolution loops) and conv2d.cpu.casts, the modules of conv2d/cpu that import numba.

Every reduction is deterministic whatever the thread count: a sum runs over fixed chunks
of `CHUNK_ROWS` rows (fixed by the array's shape, never by the threads), each chunk's
partial sum in float64 in row order, one chunk a task, and the partials are added in
chunk order by one thread. Elementwise work runs in the compute dtype (float32 lanes
vectorise twice as wide), transcendental activations in float64.

Threads: each kernel is a loop over its tasks (chunks of rows, samples, output rows),
compiled once with the GIL released (`nogil`); `run_tasks` splits the tasks into as many
contiguous ranges as the call's thread count and runs them at once (conv2d.cpu.threads
says on which threads). Partial sums land in one slot a task, added in task order
afterwards, so the bits do not depend on the split. Not numba's
threading layers: in a process with PyTorch, numba's "omp" layer binds to PyTorch's
OpenMP runtime for some calls and its own for others (it reset torch.get_num_threads()
from 1 to 2, and the module's acting call on Nature-DQN took 25 ms instead of 0.6 ms),
and its "workqueue" layer takes ~90 us to start a loop.

Arrays: activations as (N, P, C) views of (N, OH, OW, OC) (P = OH*OW), C-contiguous.
`mode`: NO_NORM, BATCH_NORM (mean, inv_std per channel, (C,)) or LAYER_NORM (per sample,
(N,)); `code`: the activation's index in `ACTIVATION_CODES`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from conv2d.activations import (FAST_TANH_CLAMP, GELU_CUBIC, GELU_ORIGINAL_CUBIC, GELU_ORIGINAL_K, GELU_TANH_K,
                                HARDSWISH_SHIFT, INV_SQRT2, INV_SQRT_2PI, RELU6_CAP, Activation)
from conv2d.cpu import threads

# Less work than this many values a call runs on the calling thread alone: a task
# handed to another thread costs ~20 us, an acting call's whole layer a few. At 1 << 16
# the acting calls' passes over a batch of one (MobileNetV2-like's 32x32x96 maps) went to
# two threads and took longer than on one (the network's acting at two threads 0.94 ms,
# at one 0.72); at 1 << 18 as fast as at one, and the training steps at two threads the same.
PARALLEL_VALUES = 1 << 18


def run_tasks(kernel, tasks: int, values: int, *args) -> None:
    """kernel(first, end, *args) over tasks [0, tasks): in contiguous ranges on as many
    threads as `threads.count()` allows (conv2d.cpu.threads.run says which threads; one,
    the caller's, where `values`, the data the call touches, is below PARALLEL_VALUES)."""
    count = min(threads.count(), tasks) if values >= PARALLEL_VALUES else 1
    if count <= 1:
        kernel(0, tasks, *args)
        return
    threads.run(kernel, tasks, count, args)


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


# Sums -------------------------------------------------------------------------------------
# One power a pass: the statistics' first pass needs the sums alone, the second the squares
# alone (both in one pass cost a third more a pass).
@njit(nogil=True, cache=True)
def _column_sums(first, end, a, shift, power, part):
    m, c = a.shape
    for k in range(first, end):
        total = part[k]
        rows = range(k * CHUNK_ROWS, min(m, (k + 1) * CHUNK_ROWS))
        if power == 1:
            for r in rows:
                row = a[r]
                for j in range(c):
                    total[j] += np.float64(row[j]) - shift[j]
        else:
            for r in rows:
                row = a[r]
                for j in range(c):
                    v = np.float64(row[j]) - shift[j]
                    total[j] += v * v


@njit(cache=True)
def in_order(part):
    """Partial sums (tasks, ...) added in task order: part[0] + part[1] + ..."""
    total = np.zeros(part.shape[1:])
    for k in range(part.shape[0]):
        total += part[k]
    return total


def column_sums(a: np.ndarray, shift: np.ndarray, power: int) -> np.ndarray:
    """sum over rows of (a[r, c] - shift[c]) ** power (1 or 2): (C,) float64, of a 2-D
    (M, C) array, in fixed chunks of rows added in order."""
    m, c = a.shape
    chunks = (m + CHUNK_ROWS - 1) // CHUNK_ROWS
    part = np.zeros((chunks, c))
    run_tasks(_column_sums, chunks, a.size, a, shift, power, part)
    return in_order(part)


# Values a chunk of one sample's sum (layer norm's statistics).
ROW_CHUNK = CHUNK_ROWS * 16


@njit(nogil=True, cache=True)
def _row_sums(first, end, a, shift, power, part):
    n, s = a.shape
    chunks = part.shape[1]
    for t in range(first, end):
        i, k = t // chunks, t % chunks
        total = 0.0
        for j in range(k * ROW_CHUNK, min(s, (k + 1) * ROW_CHUNK)):
            v = np.float64(a[i, j]) - shift[i]
            total += v if power == 1 else v * v
        part[i, k] = total


def row_sums(a: np.ndarray, shift: np.ndarray, power: int) -> np.ndarray:
    """sum over each row of (a[n, s] - shift[n]) ** power (1 or 2): (N,) float64, of a 2-D
    (N, S) array; each row in fixed chunks of ROW_CHUNK values."""
    n, s = a.shape
    chunks = (s + ROW_CHUNK - 1) // ROW_CHUNK
    part = np.zeros((n, chunks))
    run_tasks(_row_sums, n * chunks, a.size, a, shift, power, part)
    return in_order(part.T.copy())  # (chunks, N): each sample's chunks in order


# The norm and activation, fused, a row (a pixel's C channels) at a time ----------------
# Arrays here are 2-D (rows, C) views of (N, OH, OW, OC), indexed [row, channel]. LLVM
# vectorises a loop over a row's channels only where no choice is left inside it that it
# cannot take out: the helpers below are scalar and inlined; whether the activation is a
# common one (ReLU, ReLU6, identity) is decided outside the loops, the norm's mode inside
# them (one mode a call, which LLVM takes out), and each further case has a loop of its
# own (_norm_gradients, _norm_sums). A helper holding a choice between loops, or the
# other activations' code inside the common loop, kept the loops scalar, several times
# slower. Values round to the compute dtype where they are stored, as the reference's
# arrays do, so the results are bitwise those of the separate passes over 32-row buffers
# that these replaced (which took up to twice as long; the commit has the measurement).
SPAN = 128  # rows a task of the elementwise passes


@njit(inline="always", cache=True)
def _common(code):
    """Whether activation `code` is ReLU, ReLU6 or the identity."""
    return code == _RELU or code == _RELU6 or code == _IDENTITY


@njit(inline="always", cache=True)
def _common_activated(code, v):
    """f(v) for a `_common` activation."""
    if code == _RELU:
        return 0.0 if v < 0.0 else v
    if code == _RELU6:
        return 0.0 if v < 0.0 else (RELU6_CAP if v > RELU6_CAP else v)
    return v


@njit(inline="always", cache=True)
def _common_gradient(code, v, g):
    """f'(v) * g for a `_common` activation."""
    if code == _RELU:
        return g if v > 0.0 else 0.0
    if code == _RELU6:
        return g if (v > 0.0 and v < RELU6_CAP) else 0.0
    return g


@njit(inline="always", cache=True)
def _x_hat(mode, zv, j, m, s, mean, inv_std):
    """zv (channel j's) normalised: by the channel's statistics (BATCH_NORM) or by its
    sample's m and s (LAYER_NORM)."""
    if mode == BATCH_NORM:
        return (zv - mean[j]) * inv_std[j]
    return (zv - m) * s


@njit(inline="always", cache=True)
def _activation_input(mode, zv, j, m, s, mean, inv_std, gamma, beta):
    """a = gamma * x_hat + beta (zv itself with NO_NORM), in zv's dtype."""
    if mode == NO_NORM:
        return zv
    return _x_hat(mode, zv, j, m, s, mean, inv_std) * gamma[j] + beta[j]


@njit(inline="always", cache=True)
def _row_statistics(mode, mean, inv_std, i):
    """(m, s): sample i's mean and inv_std for LAYER_NORM, placeholders otherwise."""
    if mode == LAYER_NORM:
        return mean[i], inv_std[i]
    return mean[0], inv_std[0]


@njit(nogil=True, cache=True)
def _forward_epilogue(first, end, z, pixels, mode, mean, inv_std, gamma, beta, code, p, y):
    c = z.shape[1]
    rows = range(first * SPAN, min(z.shape[0], end * SPAN))
    if _common(code):
        for t in rows:
            m, s = _row_statistics(mode, mean, inv_std, t // pixels)
            zr, yr = z[t], y[t]
            for j in range(c):
                yr[j] = _common_activated(code, _activation_input(mode, zr[j], j, m, s, mean, inv_std, gamma, beta))
    else:
        for t in rows:
            m, s = _row_statistics(mode, mean, inv_std, t // pixels)
            zr, yr = z[t], y[t]
            for j in range(c):
                a = _activation_input(mode, zr[j], j, m, s, mean, inv_std, gamma, beta)
                yr[j] = activate(code, np.float64(a), p)


def _rows(a: np.ndarray) -> np.ndarray:
    """(N, P, C) -> (N*P, C), a view."""
    return a.reshape(-1, a.shape[-1])


def forward_epilogue(z, mode, mean, inv_std, gamma, beta, code, p, y) -> None:
    """y = f(gamma * (z - mean) * inv_std + beta) (f(z) with NO_NORM), z and y (N, P, C);
    mean and inv_std (C,) or (N,) by `mode`, (1,) or more with NO_NORM."""
    rows = z.shape[0] * z.shape[1]
    run_tasks(_forward_epilogue, (rows + SPAN - 1) // SPAN, z.size, _rows(z), z.shape[1], mode, mean,
              inv_std, gamma, beta, code, p, _rows(y))


@njit(nogil=True, cache=True)
def _evaluate_epilogue(first, end, z, bias, mode, running_mean, running_var, eps, gamma, beta, code, p, y):
    rows, c = z.shape
    mean = np.zeros(max(c, 1), z.dtype)
    inv_std = np.ones(max(c, 1), z.dtype)
    if mode == BATCH_NORM:  # the running statistics as _statistics gives them: inv_std in float64, then rounded
        for j in range(c):
            mean[j] = running_mean[j]
            inv_std[j] = 1.0 / math.sqrt(np.float64(running_var[j]) + eps)
    for task in range(first, end):  # a task's rows get their bias, then go through the forward's pass
        if bias.shape[0]:
            for t in range(task * SPAN, min(rows, (task + 1) * SPAN)):
                zr = z[t]
                for j in range(c):
                    zr[j] += bias[j]
        _forward_epilogue(task, task + 1, z, 1, mode, mean, inv_std, gamma, beta, code, p, y)


def evaluate_epilogue(z, bias, mode, running_mean, running_var, eps, gamma, beta, code, p, y) -> None:
    """y = f(gamma * (z + bias - mean) * inv_std + beta), mean and inv_std =
    1 / sqrt(running_var + eps) the running statistics' (BATCH_NORM), or f(z + bias)
    (NO_NORM): forward_epilogue's values for an evaluate, with the bias and the statistics
    in the same pass (adding the bias into z, which is the caller's scratch). z, y (N, P,
    C) in the compute dtype; bias (C,) or (0,)."""
    rows = z.shape[0] * z.shape[1]
    run_tasks(_evaluate_epilogue, (rows + SPAN - 1) // SPAN, z.size, _rows(z), bias, mode, running_mean,
              running_var, eps, gamma, beta, code, p, _rows(y))


@njit(nogil=True, cache=True)
def _gradients(t0, t1, z, d_y, pixels, mode, mean, inv_std, gamma, beta, code, p, d_a):
    """d_a[t - t0] = f'(a) * d_y[t] for rows t0..t1, a as _activation_input gives it,
    rounded to d_a's dtype as the reference rounds it."""
    c = z.shape[1]
    rows = range(t0, t1)
    if _common(code):
        for t in rows:
            m, s = _row_statistics(mode, mean, inv_std, t // pixels)
            zr, gr, out = z[t], d_y[t], d_a[t - t0]
            for j in range(c):
                out[j] = _common_gradient(code, _activation_input(mode, zr[j], j, m, s, mean, inv_std, gamma, beta),
                                          gr[j])
    else:
        for t in rows:
            m, s = _row_statistics(mode, mean, inv_std, t // pixels)
            zr, gr, out = z[t], d_y[t], d_a[t - t0]
            for j in range(c):
                a = _activation_input(mode, zr[j], j, m, s, mean, inv_std, gamma, beta)
                out[j] = derivative(code, np.float64(a), p) * gr[j]


@njit(nogil=True, cache=True)
def _norm_sums(t0, t1, z, d_a, m, s, mode, mean, inv_std, gamma, s_a, s_ax, by_sample):
    """Adds rows t0..t1's d_a (d_a[t - t0]) and d_a * x_hat into s_a, s_ax (C,), and for
    a layer norm, of the rows' sample (m, s), sum(d_a * gamma) and sum(d_a * gamma * x_hat)
    into by_sample (2,). A loop a case (see _norm_gradients)."""
    c = z.shape[1]
    if mode == BATCH_NORM:
        for t in range(t0, t1):
            zr, g_row = z[t], d_a[t - t0]
            for j in range(c):
                s_a[j] += g_row[j]
                s_ax[j] += np.float64(g_row[j]) * ((zr[j] - mean[j]) * inv_std[j])
    else:
        for t in range(t0, t1):
            zr, g_row = z[t], d_a[t - t0]
            for j in range(c):
                s_a[j] += g_row[j]
                s_ax[j] += np.float64(g_row[j]) * ((zr[j] - m) * s)
            for j in range(c):  # one sum a sample, in element order
                g = np.float64(g_row[j]) * gamma[j]
                by_sample[0] += g
                by_sample[1] += g * ((zr[j] - m) * s)


@njit(nogil=True, cache=True)
def _backward_sums(first, end, z, d_y, pixels, mode, mean, inv_std, gamma, beta, code, p, by_channel, by_sample):
    c = z.shape[1]
    chunks = (pixels + CHUNK_ROWS - 1) // CHUNK_ROWS
    d_a = np.empty((SPAN, c), z.dtype)
    for task in range(first, end):
        i, k = task // chunks, task % chunks
        m, s = _row_statistics(mode, mean, inv_std, i)
        end_row = i * pixels + min(pixels, (k + 1) * CHUNK_ROWS)
        for t0 in range(i * pixels + k * CHUNK_ROWS, end_row, SPAN):
            t1 = min(end_row, t0 + SPAN)
            _gradients(t0, t1, z, d_y, pixels, mode, mean, inv_std, gamma, beta, code, p, d_a)
            _norm_sums(t0, t1, z, d_a, m, s, mode, mean, inv_std, gamma, by_channel[task, 0], by_channel[task, 1],
                       by_sample[task])


def backward_sums(z, d_y, mode, mean, inv_std, gamma, beta, code, p) -> tuple[np.ndarray, np.ndarray]:
    """The norm's backward sums, float64: per channel (2, C) sum(d_a) and sum(d_a * x_hat)
    (d_beta, d_gamma), and, for layer norm, per sample (2, N) sum(d_a * gamma) and
    sum(d_a * gamma * x_hat) (its means need them); fixed chunks of rows within each
    sample, added in order. d_a = f'(a) * d_y, a the activation's input; z, d_y (N, P, C);
    a norm's `mode` (BATCH_NORM or LAYER_NORM)."""
    n, pixels, c = z.shape
    chunks = (pixels + CHUNK_ROWS - 1) // CHUNK_ROWS
    by_channel = np.zeros((n * chunks, 2, c))
    by_sample = np.zeros((n * chunks, 2))
    run_tasks(_backward_sums, n * chunks, 2 * z.size, _rows(z), _rows(d_y), pixels, mode, mean, inv_std, gamma, beta,
              code, p, by_channel, by_sample)
    sample = in_order(by_sample.reshape(n, chunks, 2).transpose(1, 0, 2).copy())  # (N, 2)
    return in_order(by_channel), sample.T.copy()


@njit(nogil=True, cache=True)
def _norm_gradients(t0, t1, z, d_a, pixels, mode, mean, inv_std, gamma, batch_stats, mean_g, mean_gx, d_z):
    """d_z[t] of rows t0..t1 from d_a[t - t0] = f'(a) * d_y[t], through the norm. Each case
    its own loop, with no choice inside (a choice in the loop kept it scalar: 4x slower
    where C is 16)."""
    c = z.shape[1]
    if not batch_stats:  # a batch norm's running statistics (a layer norm's are always the batch's)
        for t in range(t0, t1):
            g_row, out = d_a[t - t0], d_z[t]
            for j in range(c):
                out[j] = g_row[j] * gamma[j] * inv_std[j]
    elif mode == BATCH_NORM:
        for t in range(t0, t1):
            zr, g_row, out = z[t], d_a[t - t0], d_z[t]
            for j in range(c):
                x_hat = (zr[j] - mean[j]) * inv_std[j]
                out[j] = inv_std[j] * (g_row[j] * gamma[j] - mean_g[j] - x_hat * mean_gx[j])
    else:
        for t in range(t0, t1):
            i = t // pixels
            m, s, m_g, m_gx = mean[i], inv_std[i], mean_g[i], mean_gx[i]
            zr, g_row, out = z[t], d_a[t - t0], d_z[t]
            for j in range(c):
                out[j] = s * (g_row[j] * gamma[j] - m_g - (zr[j] - m) * s * m_gx)


@njit(nogil=True, cache=True)
def _backward_epilogue(first, end, z, d_y, pixels, mode, mean, inv_std, gamma, beta, code, p, batch_stats, mean_g,
                       mean_gx, d_z):
    rows, c = z.shape
    d_a = np.empty((SPAN, c), z.dtype)
    for task in range(first, end):
        t0, t1 = task * SPAN, min(rows, (task + 1) * SPAN)
        if mode == NO_NORM:
            _gradients(t0, t1, z, d_y, pixels, mode, mean, inv_std, gamma, beta, code, p, d_z[t0:t1])
        else:
            _gradients(t0, t1, z, d_y, pixels, mode, mean, inv_std, gamma, beta, code, p, d_a)
            _norm_gradients(t0, t1, z, d_a, pixels, mode, mean, inv_std, gamma, batch_stats, mean_g, mean_gx, d_z)


def backward_epilogue(z, d_y, mode, mean, inv_std, gamma, beta, code, p, batch_stats, mean_g, mean_gx, d_z) -> None:
    """d_z (N, P, C) of the activation and the norm: f'(a) * d_y without a norm;
    inv_std * (g - mean_g - x_hat * mean_gx) with g = d_a * gamma where the statistics came
    from the batch (mean_g, mean_gx indexed as the statistics: per channel or per sample);
    d_a * gamma * inv_std where they were fixed."""
    rows = z.shape[0] * z.shape[1]
    run_tasks(_backward_epilogue, (rows + SPAN - 1) // SPAN, 2 * z.size, _rows(z), _rows(d_y),
              z.shape[1], mode, mean, inv_std, gamma, beta, code, p, batch_stats, mean_g, mean_gx, _rows(d_z))
