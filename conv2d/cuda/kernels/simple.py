"""The simple kernel set: one plain numba kernel per step of the reference
(`conv2d/reference/functional.py` and `norm.py`), named after the reference's function,
one thread per value or per reduced group, no tricks.

This is the set a reader learns the CUDA backend from and the one a new kernel is first
written as; the fast set (`fast.py`) fuses these steps and is tested against it.
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
from conv2d.cuda.kernels.activation import activation_functions
from conv2d.cuda.kernels.bits import storage_io
from conv2d.cuda.runtime import numba_cuda
from conv2d.cuda.views import as_numba
from conv2d.state import MAX_BATCHES

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
    accumulate: object


@cuda.jit(device=True, inline=True)
def _group(i, C, S, layer):
    """The norm group of value i: its sample (layer norm) or its channel (batch norm)."""
    return i // S if layer else i % C


@cuda.jit(device=True, inline=True)
def _members(g, C, S, layer, total):
    """(first, count, step): group g's values are first + k * step for k < count, over
    `total` values: a sample's S consecutive values, or a channel's every C-th."""
    if layer:
        return g * S, S, 1
    return g, total // C, C


@cuda.jit
def count_batch(batches):
    """batches[0] += 1: a training batch counted for the cumulative average
    (bn_momentum=None; PyTorch's num_batches_tracked), before the running statistics move
    1/batches[0] of the way; at the int64 maximum it stays there (saturates: a wrap would
    make the count negative, as the reference's `_statistics` does not). One thread."""
    if cuda.grid(1) == 0 and batches[0] < MAX_BATCHES:
        batches[0] += 1


def momentum_argument(spec) -> np.float32:
    """The momentum as the running-statistics kernels (this set's update_running, the row
    engine's finish) take it: the spec's, or -1 for the cumulative average
    (bn_momentum=None), which they read from the batch count instead."""
    return np.float32(-1.0 if spec.bn_momentum is None else spec.bn_momentum)


# The kernels that read and write float32 alone and apply no activation: one for every
# storage format and activation (a set below names them beside its own).
@cuda.jit
def statistics(z, C, S, layer, mean, var):
    """norm.statistics: the mean and biased variance of each group, two passes (one
    thread a group)."""
    g = cuda.grid(1)
    if g >= mean.size:
        return
    first, count, step = _members(g, C, S, layer, z.size)
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
def update_running(running, stat, momentum, batches, scale):
    """norm.update_running: running = (1 - momentum) * running + momentum * stat *
    scale (scale: the unbiased-variance factor, or 1) (one thread a channel); a
    momentum < 0 stands for the cumulative average, 1 / batches[0] (the batches
    counted by count_batch, this one included)."""
    c = cuda.grid(1)
    if c < running.size:
        m = momentum if momentum >= ZERO else ONE / np.float32(batches[0])
        running[c] = (ONE - m) * running[c] + m * (stat[c] * scale)


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
    first, count, step = _members(grp, C, S, layer, d_a.size)
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


@functools.lru_cache(maxsize=None)
def simple_set(storage: str, activation: Activation, parameter: float | None = None) -> SimpleSet:
    """The simple kernels for values stored as `storage` ("float32", "float16", "bfloat16")
    and `activation` (with its `parameter`, LayerSpec.activation_parameter)."""
    io = storage_io(storage)
    load, store = io.load, io.store
    f, d = activation_functions(Activation(activation), parameter)

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
    def accumulate(total, new):
        """total += new, total stored, new float32: a gradient added into the caller's
        (one thread a value)."""
        i = cuda.grid(1)
        if i < new.size:
            store(total, i, load(total, i) + new[i])

    return SimpleSet(to_compute, to_storage, statistics, inverse_std, update_running, activation_input,
                     activation_forward, activation_backward, param_backward, gradient_means, backward_batch_statistics,
                     backward_fixed_statistics, bias_backward, accumulate)


# The layer's steps over the simple kernels: what `Functions` runs between the
# convolutions with kernels="simple", in the reference's order (reference/functional.py:
# forward's _statistics and _activation_input, grad_pre_activations, bias_backward).
class Scratch:
    """float32 arrays of one input shape for the simple steps: values (M*C), per group
    and per channel."""

    def __init__(self, cuda, total: int, groups: int, channels: int) -> None:
        def alloc(n):
            return cuda.device_array(max(n, 1), np.float32)
        self.z, self.a, self.x_hat, self.d_a, self.d_z = (alloc(total) for _ in range(5))
        self.var, self.mean_g, self.mean_gx = (alloc(groups) for _ in range(3))
        self.d_gamma, self.d_beta, self.d_bias = (alloc(channels) for _ in range(3))


def _run(kernel, n: int, stream, *args) -> None:
    """`kernel` over n items on `stream`; the kernels index arrays flat."""
    blocks, threads = grid(n)
    flat = [as_numba(a.reshape(a.size) if getattr(a, "ndim", 1) > 1 else a) for a in args]
    kernel[blocks, threads, stream](*flat)


def forward_steps(k: SimpleSet, spec, shape: tuple, scratch: Scratch, params: dict, running: dict | None,
                  z, y, mean, inv_std, training: bool, stream, count_dummy) -> bool:
    """y = act(norm(z)) from the stored pre-activations z (flat (M*C) values), filling mean
    and inv_std of the norm and, for a training batch norm, updating `running` in place;
    returns whether the statistics came from the batch. `shape`: (M, C, S, groups);
    `count_dummy`: a one-element int64 array standing for num_batches_tracked where the
    spec has none."""
    from conv2d.spec import Normalization

    M, C, S, groups = shape
    total, norm, s = M * C, spec.normalization, scratch
    _run(k.to_compute, total, stream, z, s.z)
    if norm is Normalization.NONE:
        _run(k.activation_forward, total, stream, s.z, y)
        return False
    layer = norm is Normalization.LAYER_NORM
    eps = np.float32(spec.bn_epsilon)
    if layer or training:
        _run(k.statistics, groups, stream, s.z, C, S, layer, mean, s.var)
        _run(k.inverse_std, groups, stream, s.var, eps, inv_std)
        if not layer and running is not None:
            mom, batches = momentum_argument(spec), count_dummy
            if spec.bn_momentum is None:
                batches = running["num_batches_tracked"]
                _run(count_batch, 1, stream, batches)
            _run(k.update_running, C, stream, running["running_mean"], mean, mom, batches, np.float32(1.0))
            _run(k.update_running, C, stream, running["running_var"], s.var, mom, batches,
                 np.float32(spec.running_var_scale(M)))
        from_batch = True
    else:
        mean.copy_to_device(running["running_mean"], stream=stream)
        _run(k.inverse_std, groups, stream, running["running_var"], eps, inv_std)
        from_batch = False
    _run(k.activation_input, total, stream, s.z, mean, inv_std, params["gamma"], params["beta"], C, S, layer,
         s.a, s.x_hat)
    _run(k.activation_forward, total, stream, s.a, y)
    return from_batch


def backward_steps(k: SimpleSet, k32: SimpleSet, spec, shape: tuple, scratch: Scratch, params: dict, pre,
                   mean, inv_std, batch_stats: bool, d_y, d_z, grads: dict, fresh: bool, stream) -> None:
    """d_z (stored, flat) from d_y through the activation and the norm, and the bias,
    gamma and beta gradients written into `grads` (`fresh`: their memory is not zeroed)
    or added into them (those of its keys the spec has). `k32`: the float32 set (gamma
    and beta gradients are float32)."""
    from conv2d.spec import Normalization

    M, C, S, groups = shape
    total, norm, s = M * C, spec.normalization, scratch
    _run(k.to_compute, total, stream, pre, s.z)
    if norm is Normalization.NONE:
        _run(k.activation_backward, total, stream, s.z, d_y, s.d_z)
    else:
        layer = norm is Normalization.LAYER_NORM
        gamma = params["gamma"]
        _run(k.activation_input, total, stream, s.z, mean, inv_std, gamma, params["beta"], C, S, layer, s.a,
             s.x_hat)
        _run(k.activation_backward, total, stream, s.a, d_y, s.d_a)
        if "gamma" in grads and fresh:
            _run(k.param_backward, C, stream, s.d_a, s.x_hat, C, grads["gamma"], grads["beta"])
        elif "gamma" in grads:
            _run(k.param_backward, C, stream, s.d_a, s.x_hat, C, s.d_gamma, s.d_beta)
            _run(k32.accumulate, C, stream, grads["gamma"], s.d_gamma)
            _run(k32.accumulate, C, stream, grads["beta"], s.d_beta)
        if batch_stats:
            _run(k.gradient_means, groups, stream, s.d_a, s.x_hat, gamma, C, S, layer, s.mean_g, s.mean_gx)
            _run(k.backward_batch_statistics, total, stream, s.d_a, s.x_hat, inv_std, gamma, s.mean_g, s.mean_gx,
                 C, S, layer, s.d_z)
        else:
            _run(k.backward_fixed_statistics, total, stream, s.d_a, inv_std, gamma, C, s.d_z)
    _run(k.to_storage, total, stream, s.d_z, d_z)
    if "bias" in grads:
        # The bias gradient sums d_z as stored, as the convolution gradients read it.
        _run(k.to_compute, total, stream, d_z, s.d_a)
        _run(k.bias_backward, C, stream, s.d_a, C, s.d_bias)
        if fresh:
            _run(k.to_storage, C, stream, s.d_bias, grads["bias"])
        else:
            _run(k.accumulate, C, stream, grads["bias"], s.d_bias)
