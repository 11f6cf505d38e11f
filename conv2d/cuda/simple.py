"""The simple kernel set: one plain numba kernel per step of the reference
(`conv2d/reference/functional.py` and `norm.py`), named after the reference's function,
one thread per value or per reduced group, no tricks.

This is the set a reader learns the CUDA backend from and the one a new kernel is first
written as; the fast set (`kernels.py`) fuses these steps and is tested against it.
Every array is flat and C-ordered, in float32 (the compute dtype) except where a kernel
converts to or from the storage format. Activations are (M, C) values with M = N*OH*OW
rows and C = OC channels (NHWC). A norm group is a channel for batch norm (G = C groups,
value i in group i % C, M values each) and a sample for layer norm (G = N groups, value i
in group i // S with S = OH*OW*OC values each).

Sums run in a fixed order (a thread adds its group's values first to last), so results
are bitwise reproducible; the variance is the reference's two passes (the mean, then the
mean squared deviation), where the fast set takes one shifted pass.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from conv2d.activations import Activation
from conv2d.cuda.kernels import activation_functions, storage_io
from conv2d.cuda.runtime import numba_cuda

cuda = numba_cuda()
f32 = np.float32
ZERO, ONE = f32(0), f32(1)
THREADS = 128


def grid(n: int) -> tuple[int, int]:
    """(blocks, threads) for one thread per item of n."""
    return max(1, (n + THREADS - 1) // THREADS), THREADS


@dataclass(frozen=True)
class SimpleSet:
    """The simple kernels of one (storage, activation) layer kind; launch each over
    `grid(n)` for its n items (values, groups or channels, as its docstring says)."""

    to_compute: object
    to_storage: object
    statistics: object
    inverse_std: object
    update_running: object
    activation_input: object
    activation_forward: object
    activation_backward: object
    param_backward: object
    gradient_means: object
    backward_batch_statistics: object
    backward_fixed_statistics: object
    bias_backward: object


@cuda.jit(device=True, inline=True)
def _group(i, C, S, layer):
    """The norm group of value i: its sample (layer norm) or its channel (batch norm)."""
    return i // S if layer else i % C


@functools.lru_cache(maxsize=None)
def simple_set(storage: str, activation: Activation) -> SimpleSet:
    """The simple kernels for values stored as `storage` ("float32", "float16", "bfloat16")
    and `activation`."""
    load, store, _, _, _ = storage_io(storage)
    f, d = activation_functions(Activation(activation))

    @cuda.jit
    def to_compute(src, out):
        """out[i] = src[i] as float32 (one thread a value)."""
        i = cuda.grid(1)
        if i < out.size:
            out[i] = load(src, i)

    @cuda.jit
    def to_storage(src, out):
        """out[i] = src[i] rounded to the storage format (one thread a value)."""
        i = cuda.grid(1)
        if i < src.size:
            store(out, i, src[i])

    @cuda.jit
    def statistics(z, C, S, layer, mean, var):
        """norm.statistics: the mean and biased variance of each group, two passes (one
        thread a group)."""
        g = cuda.grid(1)
        if g >= mean.size:
            return
        if layer:
            first, count, step = g * S, S, 1
        else:
            first, count, step = g, z.size // C, C
        total = ZERO
        for k in range(count):
            total += z[first + k * step]
        m = total / f32(count)
        squares = ZERO
        for k in range(count):
            dev = z[first + k * step] - m
            squares += dev * dev
        mean[g] = m
        var[g] = squares / f32(count)

    @cuda.jit
    def inverse_std(var, epsilon, out):
        """norm.inverse_std: out = 1 / sqrt(var + epsilon) (one thread a group)."""
        g = cuda.grid(1)
        if g < var.size:
            out[g] = ONE / math.sqrt(var[g] + epsilon)

    @cuda.jit
    def update_running(running, stat, momentum, scale):
        """norm.update_running: running = (1 - momentum) * running + momentum * stat *
        scale (scale: the unbiased-variance factor, or 1) (one thread a channel)."""
        c = cuda.grid(1)
        if c < running.size:
            running[c] = (ONE - momentum) * running[c] + momentum * (stat[c] * scale)

    @cuda.jit
    def activation_input(z, mean, inv_std, gamma, beta, C, S, layer, a, x_hat):
        """_activation_input with a norm: x_hat = (z - mean) * inv_std and a = gamma *
        x_hat + beta (one thread a value)."""
        i = cuda.grid(1)
        if i < z.size:
            g, c = _group(i, C, S, layer), i % C
            xh = (z[i] - mean[g]) * inv_std[g]
            x_hat[i] = xh
            a[i] = xh * gamma[c] + beta[c]

    @cuda.jit
    def activation_forward(a, y):
        """activations.forward: y = f(a), stored (one thread a value)."""
        i = cuda.grid(1)
        if i < a.size:
            store(y, i, f(a[i]))

    @cuda.jit
    def activation_backward(a, d_y, d_a):
        """grad_pre_activations' first step: d_a = f'(a) * d_y (d_y stored) (one thread a
        value)."""
        i = cuda.grid(1)
        if i < a.size:
            d_a[i] = d(a[i]) * load(d_y, i)

    @cuda.jit
    def param_backward(d_a, x_hat, C, d_gamma, d_beta):
        """norm.param_backward: d_gamma = sum(d_a * x_hat), d_beta = sum(d_a) over the rows
        (one thread a channel)."""
        c = cuda.grid(1)
        if c >= C:
            return
        sg = ZERO
        sb = ZERO
        for r in range(d_a.size // C):
            sg += d_a[r * C + c] * x_hat[r * C + c]
            sb += d_a[r * C + c]
        d_gamma[c] = sg
        d_beta[c] = sb

    @cuda.jit
    def gradient_means(d_a, x_hat, gamma, C, S, layer, mean_g, mean_gx):
        """backward_batch_statistics' group means: with g = d_a * gamma, mean(g) and
        mean(g * x_hat) over each group (one thread a group)."""
        grp = cuda.grid(1)
        if grp >= mean_g.size:
            return
        if layer:
            first, count, step = grp * S, S, 1
        else:
            first, count, step = grp, d_a.size // C, C
        s = ZERO
        sx = ZERO
        for k in range(count):
            j = first + k * step
            g = d_a[j] * gamma[j % C]
            s += g
            sx += g * x_hat[j]
        mean_g[grp] = s / f32(count)
        mean_gx[grp] = sx / f32(count)

    @cuda.jit
    def backward_batch_statistics(d_a, x_hat, inv_std, gamma, mean_g, mean_gx, C, S, layer, d_z):
        """norm.backward_batch_statistics: d_z = inv_std * (g - mean(g) - x_hat *
        mean(g * x_hat)), g = d_a * gamma, the means from `gradient_means` (one thread a
        value)."""
        i = cuda.grid(1)
        if i < d_z.size:
            grp, c = _group(i, C, S, layer), i % C
            g = d_a[i] * gamma[c]
            d_z[i] = inv_std[grp] * (g - mean_g[grp] - x_hat[i] * mean_gx[grp])

    @cuda.jit
    def backward_fixed_statistics(d_a, inv_std, gamma, C, d_z):
        """norm.backward_fixed_statistics: d_z = d_a * gamma * inv_std, batch norm with
        the running statistics (one thread a value)."""
        i = cuda.grid(1)
        if i < d_a.size:
            c = i % C
            d_z[i] = d_a[i] * gamma[c] * inv_std[c]

    @cuda.jit
    def bias_backward(d_z, C, d_bias):
        """conv.bias_backward: d_bias = sum of d_z over the rows (one thread a channel)."""
        c = cuda.grid(1)
        if c < C:
            s = ZERO
            for r in range(d_z.size // C):
                s += d_z[r * C + c]
            d_bias[c] = s

    return SimpleSet(to_compute, to_storage, statistics, inverse_std, update_running, activation_input,
                     activation_forward, activation_backward, param_backward, gradient_means, backward_batch_statistics,
                     backward_fixed_statistics, bias_backward)
