"""numba `@cuda.jit` kernels: norm statistics, norm apply with the activation, the
activation and norm backward, and the bias and norm-parameter gradients.

Every array is flat and C-ordered: activations are (M, C) with M = N*OH*OW rows and
C = OC channels (NHWC), a sample is S = OH*OW*OC consecutive values. Storage arrays are
float32, float16, or uint16 holding bfloat16 bits; all arithmetic is float32.

Reductions are two-phase with a fixed order, so results are bitwise identical run to
run: phase one gives each block a fixed slice of rows and sums it in a fixed order into
one partial per (block, group); phase two has one warp per group add those partials in
a fixed order and a fixed tree. The partition depends only on the shape.

`kernel_set(storage, activation, norm)` compiles (once) the kernels for one layer kind;
the storage format, activation and norm are compile-time constants of its closures.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from conv2d import activations as act_table
from conv2d.activations import Activation
from conv2d.cuda.runtime import numba_cuda, simulating
from conv2d.spec import Normalization

cuda = numba_cuda()
f32 = np.float32

# Launch shapes. Column reductions: blocks of COL_X channels x COL_Y row lanes.
ELEMENTWISE_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 132 * 16  # 16 blocks of 256 per SM of an H200 keep it full
COL_X, COL_Y = 32, 8
COL_MAX_PARTIALS = 128
SEG_THREADS = 256
SEG_MAX_PARTIALS = 64
WARP = 32

# Norm modes and what a column reduction sums (compile-time constants).
NORM_NONE, NORM_BATCH, NORM_LAYER = 0, 1, 2
SUM_STATS, SUM_GRADS, SUM_PLAIN = 0, 1, 2
NORM_MODE = {Normalization.NONE: NORM_NONE, Normalization.BATCH_NORM: NORM_BATCH,
             Normalization.LAYER_NORM: NORM_LAYER}

# float32 constants: a bare Python float would promote the arithmetic to float64.
ZERO, ONE, HALF, TWO, THREE = f32(0), f32(1), f32(0.5), f32(2), f32(3)
K_TANH = f32(act_table.GELU_TANH_K)
K_ORIGINAL = f32(act_table.GELU_ORIGINAL_K)
CUBIC = f32(act_table.GELU_CUBIC)
CUBIC3 = f32(3 * act_table.GELU_CUBIC)
CLAMP = f32(act_table.FAST_TANH_CLAMP)
INV_SQRT2 = f32(act_table.INV_SQRT2)
INV_SQRT_2PI = f32(act_table.INV_SQRT_2PI)
F27, F9 = f32(27), f32(9)


# bfloat16 <-> float32 bit conversions. On a GPU through libdevice's bit casts; numba's
# simulator has no libdevice, so there the same conversion goes through NumPy views.
if simulating():
    @cuda.jit(device=True)
    def bf16_to_f32(bits):
        return np.array([np.uint32(bits) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def f32_to_bf16(v):
        if v != v:
            return np.uint16(0x7FC0)
        u = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
        return np.uint16(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def bf16_to_f32(bits):
        return libdevice.int_as_float(np.int32(bits) << np.int32(16))

    @cuda.jit(device=True, inline=True)
    def f32_to_bf16(v):
        if v != v:
            return np.uint16(0x7FC0)
        u = np.int64(libdevice.float_as_int(v)) & np.int64(0xFFFFFFFF)
        # Round to nearest, ties to even, as NumPy's and ml_dtypes' casts do.
        return np.uint16(((u + np.int64(0x7FFF) + ((u >> np.int64(16)) & np.int64(1))) >> np.int64(16)) & np.int64(0xFFFF))


def _io(storage: str):
    """(load, store) device functions for a storage format: float32 values in and out."""
    if storage == "bfloat16":
        @cuda.jit(device=True, inline=True)
        def load(a, i):
            return bf16_to_f32(a[i])

        @cuda.jit(device=True, inline=True)
        def store(a, i, v):
            a[i] = f32_to_bf16(v)
    elif storage == "float16":
        @cuda.jit(device=True, inline=True)
        def load(a, i):
            return f32(a[i])

        @cuda.jit(device=True, inline=True)
        def store(a, i, v):
            a[i] = np.float16(v)
    else:
        @cuda.jit(device=True, inline=True)
        def load(a, i):
            return f32(a[i])

        @cuda.jit(device=True, inline=True)
        def store(a, i, v):
            a[i] = f32(v)
    return load, store


# The activation table (conv2d/activations.py), one scalar at a time in float32.
@cuda.jit(device=True, inline=True)
def _fast_tanh(x):
    c = min(max(x, -CLAMP), CLAMP)
    c2 = c * c
    return c * (F27 + c2) / (F27 + F9 * c2)


@cuda.jit(device=True, inline=True)
def _sigmoid(x):
    return ONE / (ONE + math.exp(-x))


def _activation(act: Activation):
    """(f, f') device functions; f' is taken at the activation's input."""
    if act is Activation.IDENTITY:
        def f(x): return x
        def d(x): return ONE
    elif act is Activation.RELU:
        def f(x): return x if (x > ZERO or x != x) else ZERO  # NaN stays NaN, as np.maximum
        def d(x): return ONE if x > ZERO else ZERO
    elif act is Activation.TANH:
        def f(x): return math.tanh(x)
        def d(x):
            t = math.tanh(x)
            return ONE - t * t
    elif act is Activation.SIGMOID:
        def f(x): return _sigmoid(x)
        def d(x):
            s = _sigmoid(x)
            return s * (ONE - s)
    elif act is Activation.FAST_TANH:
        def f(x): return _fast_tanh(x)
        def d(x):
            t = _fast_tanh(x)
            return ONE - t * t
    elif act in (Activation.GELU_TANH, Activation.GELU_ORIGINAL):
        k = K_TANH if act is Activation.GELU_TANH else K_ORIGINAL

        def f(x): return HALF * x * (ONE + math.tanh(k * (x + CUBIC * x * x * x)))
        def d(x):
            t = math.tanh(k * (x + CUBIC * x * x * x))
            return HALF * (ONE + t) + HALF * x * (ONE - t * t) * k * (ONE + CUBIC3 * x * x)
    elif act is Activation.GELU:
        def f(x): return HALF * x * (ONE + math.erf(x * INV_SQRT2))
        def d(x): return HALF * (ONE + math.erf(x * INV_SQRT2)) + x * math.exp(-HALF * x * x) * INV_SQRT_2PI
    else:
        raise ValueError(f"activation: unknown {act!r}")
    return cuda.jit(device=True, inline=True)(f), cuda.jit(device=True, inline=True)(d)


@dataclass(frozen=True)
class KernelSet:
    """The compiled kernels of one (storage, activation, norm) layer kind."""

    forward_apply: object
    column_partials: dict  # SUM_* -> kernel
    segment_partials: dict  # SUM_STATS, SUM_GRADS -> kernel
    partials_final: object  # phase two: the totals
    stats_final: object  # phase two of the statistics: mean, inv_std, running update
    final_accumulate_f32: object  # phase two, totals added into two float32 gradients
    final_accumulate_stored: object  # phase two, the total added into a storage-format gradient
    running_stats: object
    backward_dz: object
    accumulate_stored: object  # grad += new, elementwise, both in the storage format


@functools.lru_cache(maxsize=None)
def kernel_set(storage: str, activation: Activation, normalization: Normalization) -> KernelSet:
    load, store = _io(storage)
    act_f, act_d = _activation(activation)
    mode = NORM_MODE[normalization]

    @cuda.jit(device=True, inline=True)
    def group(i, C, S):
        # The statistic an element (flat index i) is normalised with.
        return i % C if mode == NORM_BATCH else i // S

    @cuda.jit(device=True, inline=True)
    def act_input(z, i, c, g, mean, inv_std, gamma, beta):
        # (a, x_hat): the activation's input, and the normalised value.
        zi = load(z, i)
        if mode == NORM_NONE:
            return zi, zi
        x_hat = (zi - mean[g]) * inv_std[g]
        return gamma[c] * x_hat + beta[c], x_hat

    @cuda.jit
    def forward_apply(z, y, mean, inv_std, gamma, beta, total, C, S):
        """y = act(norm(z)), elementwise over total = M*C values."""
        start = cuda.grid(1)
        step = cuda.gridsize(1)
        for i in range(start, total, step):
            c = i % C
            a, _ = act_input(z, i, c, group(i, C, S), mean, inv_std, gamma, beta)
            store(y, i, act_f(a))

    @cuda.jit(device=True, inline=True)
    def column_terms(kind, z, d_y, i, c, g, mean, inv_std, gamma, beta):
        # The two values per element a column reduction sums. Statistics are summed
        # shifted by the channel's first value, which keeps the variance from cancelling
        # when the mean is large against the spread.
        if kind == SUM_STATS:
            v = load(z, i) - load(z, c)
            return v, v * v
        if kind == SUM_GRADS:
            a, x_hat = act_input(z, i, c, g, mean, inv_std, gamma, beta)
            d_a = load(d_y, i) * act_d(a)
            return d_a, d_a * x_hat
        return load(z, i), ZERO

    def make_column_partials(kind):
        @cuda.jit
        def column_partials(z, d_y, mean, inv_std, gamma, beta, M, C, S, out0, out1):
            """Per-channel partial sums over a fixed set of rows: grid (ceil(C/COL_X), P),
            block (COL_X, COL_Y); out0/out1 are (P, C)."""
            s0 = cuda.shared.array((COL_Y, COL_X), dtype=np.float32)
            s1 = cuda.shared.array((COL_Y, COL_X), dtype=np.float32)
            tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
            c = cuda.blockIdx.x * COL_X + tx
            p = cuda.blockIdx.y
            lanes = cuda.gridDim.y * COL_Y
            a0, a1 = ZERO, ZERO
            if c < C:
                for r in range(p * COL_Y + ty, M, lanes):
                    i = r * C + c
                    v0, v1 = column_terms(kind, z, d_y, i, c, group(i, C, S), mean, inv_std, gamma, beta)
                    a0 += v0
                    a1 += v1
            s0[ty, tx] = a0
            s1[ty, tx] = a1
            cuda.syncthreads()
            if ty == 0 and c < C:
                t0, t1 = ZERO, ZERO
                for k in range(COL_Y):
                    t0 += s0[k, tx]
                    t1 += s1[k, tx]
                out0[p * C + c] = t0
                out1[p * C + c] = t1
        return column_partials

    column_partials = {k: make_column_partials(k) for k in (SUM_STATS, SUM_GRADS, SUM_PLAIN)}

    @cuda.jit(device=True, inline=True)
    def warp_sum(partials, P, G, g, sh, lane):
        # Sum of partials[p * G + g] over p, by one warp in a fixed order and tree.
        acc = ZERO
        for p in range(lane, P, WARP):
            acc += partials[p * G + g]
        sh[lane] = acc
        cuda.syncthreads()
        width = WARP // 2
        while width > 0:
            if lane < width:
                sh[lane] += sh[lane + width]
            cuda.syncthreads()
            width //= 2
        return sh[0]

    @cuda.jit
    def partials_final(p0, p1, P, G, sums):
        """Phase two of both reductions: grid G blocks of one warp; partials are (P, G);
        sums[g] and sums[G + g] receive the two totals of group g."""
        sh = cuda.shared.array(WARP, dtype=np.float32)
        g = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        t0 = warp_sum(p0, P, G, g, sh, lane)
        cuda.syncthreads()
        t1 = warp_sum(p1, P, G, g, sh, lane)
        if lane == 0:
            sums[g] = t0
            sums[G + g] = t1

    @cuda.jit(device=True, inline=True)
    def segment_terms(kind, z, d_y, i, c, g, S, mean, inv_std, gamma, beta):
        # As column_terms, per sample: statistics shifted by the sample's first value;
        # gradients are g = d_a * gamma and g * x_hat.
        if kind == SUM_STATS:
            v = load(z, i) - load(z, g * S)
            return v, v * v
        a, x_hat = act_input(z, i, c, g, mean, inv_std, gamma, beta)
        gi = load(d_y, i) * act_d(a) * gamma[c]
        return gi, gi * x_hat

    def make_segment_partials(kind):
        @cuda.jit
        def segment_partials(z, d_y, mean, inv_std, gamma, beta, C, S, out0, out1):
            """Per-sample partial sums over a fixed slice of its S values: grid (N, Q),
            block SEG_THREADS; out0/out1 are (Q, N)."""
            s0 = cuda.shared.array(SEG_THREADS, dtype=np.float32)
            s1 = cuda.shared.array(SEG_THREADS, dtype=np.float32)
            n = cuda.blockIdx.x
            q = cuda.blockIdx.y
            t = cuda.threadIdx.x
            a0, a1 = ZERO, ZERO
            for j in range(q * SEG_THREADS + t, S, cuda.gridDim.y * SEG_THREADS):
                i = n * S + j
                v0, v1 = segment_terms(kind, z, d_y, i, j % C, n, S, mean, inv_std, gamma, beta)
                a0 += v0
                a1 += v1
            s0[t] = a0
            s1[t] = a1
            cuda.syncthreads()
            width = SEG_THREADS // 2
            while width > 0:
                if t < width:
                    s0[t] += s0[t + width]
                    s1[t] += s1[t + width]
                cuda.syncthreads()
                width //= 2
            if t == 0:
                out0[q * cuda.gridDim.x + n] = s0[0]
                out1[q * cuda.gridDim.x + n] = s1[0]
        return segment_partials

    segment_partials = {k: make_segment_partials(k) for k in (SUM_STATS, SUM_GRADS)}

    @cuda.jit
    def stats_final(p0, p1, P, G, z, S, count, epsilon, momentum, mean, inv_std, running_mean, running_var,
                    update):
        """Phase two of the statistics (one warp per group g): the shifted totals
        t0 = sum(z - shift), t1 = sum((z - shift)^2), shift = the group's first value, give
        mean and inv_std; with `update`, running = (1 - momentum) * running + momentum *
        batch statistic."""
        sh = cuda.shared.array(WARP, dtype=np.float32)
        g = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        t0 = warp_sum(p0, P, G, g, sh, lane)
        cuda.syncthreads()
        t1 = warp_sum(p1, P, G, g, sh, lane)
        if lane == 0:
            shift = load(z, g) if mode == NORM_BATCH else load(z, g * S)
            m1 = t0 / count
            var = max(t1 / count - m1 * m1, ZERO)
            mu = shift + m1
            mean[g] = mu
            inv_std[g] = ONE / math.sqrt(var + epsilon)
            if update:
                running_mean[g] = (ONE - momentum) * running_mean[g] + momentum * mu
                running_var[g] = (ONE - momentum) * running_var[g] + momentum * var

    @cuda.jit
    def final_accumulate_f32(p0, p1, P, G, sums, grad0, grad1):
        """partials_final, and grad0[g] += total0, grad1[g] += total1 (float32 gradients)."""
        sh = cuda.shared.array(WARP, dtype=np.float32)
        g = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        t0 = warp_sum(p0, P, G, g, sh, lane)
        cuda.syncthreads()
        t1 = warp_sum(p1, P, G, g, sh, lane)
        if lane == 0:
            sums[g] = t0
            sums[G + g] = t1
            grad0[g] += t0
            grad1[g] += t1

    @cuda.jit
    def final_accumulate_stored(p0, P, G, grad):
        """grad[g] += the total of p0 over its P partials (a storage-format gradient)."""
        sh = cuda.shared.array(WARP, dtype=np.float32)
        g = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        t0 = warp_sum(p0, P, G, g, sh, lane)
        if lane == 0:
            store(grad, g, load(grad, g) + t0)

    @cuda.jit
    def backward_dz(z, d_y, d_z, mean, inv_std, gamma, beta, sums, batch_stats, total, C, S, count):
        """d_z from d_y through the activation and the norm, elementwise; `sums` holds the
        per-group totals of the norm's backward (batch norm: sum d_a, sum d_a*x_hat per
        channel; layer norm: sum g, sum g*x_hat per sample with g = d_a * gamma)."""
        start = cuda.grid(1)
        step = cuda.gridsize(1)
        G = mean.size
        for i in range(start, total, step):
            c = i % C
            g = group(i, C, S)
            a, x_hat = act_input(z, i, c, g, mean, inv_std, gamma, beta)
            d_a = load(d_y, i) * act_d(a)
            if mode == NORM_NONE:
                v = d_a
            elif not batch_stats:
                v = d_a * gamma[c] * inv_std[g]
            elif mode == NORM_BATCH:
                v = gamma[c] * inv_std[g] * (d_a - sums[g] / count - x_hat * (sums[G + g] / count))
            else:
                v = inv_std[g] * (d_a * gamma[c] - sums[g] / count - x_hat * (sums[G + g] / count))
            store(d_z, i, v)

    @cuda.jit
    def running_stats(running_mean, running_var, epsilon, mean, inv_std):
        """Batch norm outside training: mean = running_mean, inv_std = 1/sqrt(running_var + eps)."""
        c = cuda.grid(1)
        if c < mean.size:
            mean[c] = running_mean[c]
            inv_std[c] = ONE / math.sqrt(running_var[c] + epsilon)

    @cuda.jit
    def accumulate_stored(grad, new, total):
        """grad += new, both in the storage format (the sum is rounded once, in float32)."""
        for i in range(cuda.grid(1), total, cuda.gridsize(1)):
            store(grad, i, load(grad, i) + load(new, i))

    return KernelSet(forward_apply, column_partials, segment_partials, partials_final, stats_final,
                     final_accumulate_f32, final_accumulate_stored, running_stats, backward_dz,
                     accumulate_stored)


def small_grid(total: int) -> tuple[int, int]:
    """One thread per value for per-channel or per-sample work."""
    return (max(1, -(-total // WARP)), WARP)


def elementwise_grid(total: int) -> tuple[int, int]:
    return (max(1, min(ELEMENTWISE_MAX_BLOCKS, -(-total // ELEMENTWISE_THREADS))), ELEMENTWISE_THREADS)


def column_partition(M: int) -> int:
    """Blocks along the rows of a column reduction: ~64 rows per lane, at most 128."""
    return max(1, min(COL_MAX_PARTIALS, -(-M // (COL_Y * 64))))


def segment_partition(S: int) -> int:
    """Blocks along one sample of a segment reduction: ~16 values per thread, at most 64."""
    return max(1, min(SEG_MAX_PARTIALS, -(-S // (SEG_THREADS * 16))))
