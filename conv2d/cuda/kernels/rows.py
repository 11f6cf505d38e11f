"""The row engine under the fast set's per-value kernels: one skeleton of a kernel over
the (M, C) values of a layer's activations (M = N*OH*OW rows, C = OC channels, NHWC),
compiled once for each job it does (`row_kernels`):

- STATISTICS: batch norm's statistics, from sums shifted by each channel's first value
  (sum(z - s), sum((z - s)^2)); the mean, inv_std and running statistics in phase two.
- NORMALISE_AND_ACTIVATE: y = act(gamma * (z - mean) * inv_std + beta), or act(z).
- NORM_GRADIENTS: the per-channel sums of d_a and d_a * x_hat (d_a = d_y * act'(a)):
  d_beta and d_gamma, and the means a norm's backward with batch statistics needs.
- GRAD_PRE_ACTIVATIONS: d_z through the activation and the norm, written, and summed as
  stored: the bias gradient.

A thread keeps a lane group of `lanes` consecutive channels (8 bytes of them, read with
one load where the data is 8-byte aligned: `wide`); a block takes a fixed slice of rows.
The summing jobs add their values in float64, in a fixed order, into one partial per
(block, channel) (phase one), then the last block to finish (an atomic ticket) adds the
partials in a fixed order, in two levels of `phase_group` blocks (phase two), and
finishes the job's totals (`finish`). Within a block the threads' sums of a channel are
added in a fixed tree (`fold_rows`). So every sum has one order, fixed by the shape,
the storage format and the LaunchConfig: results are bitwise the same run to run. For
float32 storage each value's arithmetic (the normalise, its backward, the shifted
statistics) is float64 too, rounded once when written (`value_math`'s `widen`); the
16-bit formats compute it in float32.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from conv2d.activations import Activation
from conv2d.cuda.kernels.activation import ONE, ZERO, activation_functions
from conv2d.cuda.kernels.bits import load_u64, storage_io, store_u64
from conv2d.cuda.kernels.config import MAX_LANES, ROW_SHARED, ROW_THREADS, LaunchConfig, lanes_in_8_bytes
from conv2d.cuda.runtime import numba_cuda
from conv2d.spec import Normalization

cuda = numba_cuda()

# The summing jobs add in float64 (a thread's run of rows, the block's tree, phase two, the
# partials): in float32, sums over thousands of rows had 1.2-3.4x PyTorch's error in batch
# norm's stages, and over 1000x in a deep network's last block (docs/accuracy_cuda.md).
WIDE_ZERO = np.float64(0.0)

# The job of a row kernel (a compile-time constant of each compiled kernel).
STATISTICS, NORM_GRADIENTS, GRAD_PRE_ACTIVATIONS, NORMALISE_AND_ACTIVATE = 0, 1, 2, 3
JOBS = (STATISTICS, NORM_GRADIENTS, GRAD_PRE_ACTIVATIONS, NORMALISE_AND_ACTIVATE)
# What a summing job does with the totals it hands on (acc0, acc1): nothing, add them
# (+=: running statistics, accumulated gradients) or write them (fresh gradients, which
# then need no zeroing first: the same bits as adding to zero).
ACC_NONE, ACC_ADD, ACC_WRITE = 0, 1, 2
# The norm, as the kernels test it (a compile-time constant).
NORM_NONE, NORM_BATCH, NORM_LAYER = 0, 1, 2
NORM_MODE = {Normalization.NONE: NORM_NONE, Normalization.BATCH_NORM: NORM_BATCH,
             Normalization.LAYER_NORM: NORM_LAYER}


def lane_io(storage: str, lanes: int, wide: bool) -> SimpleNamespace:
    """How a row kernel moves a lane group's values: `fetch(a, i, buf, k)` loads the group
    at flat index i into slot k of a buffer of `buffer_type`, `value(buf, k, v)` gives lane
    v of slot k as float32, `put(out, i, w, packed, v)` stores lane v's value w (wide:
    into the packed 8 bytes; returns (packed, w as stored)), `flush(out, i, packed)`
    writes the packed group. With `wide` one 8-byte load and store a group, otherwise one
    a value: the same values, so the two give bitwise the same results."""
    io = storage_io(storage)
    load, stored, part, encode = io.load, io.stored, io.part, io.encode
    LANES = lanes
    if wide:
        if lanes != lanes_in_8_bytes(storage):
            raise ValueError(f"wide loads need 8 bytes of channels, got lanes={lanes} of {storage}")
        SHIFT = 64 // LANES

        @cuda.jit(device=True, inline=True)
        def fetch(a, i, buf, k):
            buf[k] = load_u64(a, i // LANES)

        @cuda.jit(device=True, inline=True)
        def value(buf, k, v):
            return part(buf[k], v)

        @cuda.jit(device=True, inline=True)
        def put(out, i, w, packed, v):
            bits, as_stored = encode(w)
            return packed | (bits << np.uint64(SHIFT * v)), as_stored

        @cuda.jit(device=True, inline=True)
        def flush(out, i, packed):
            # Outputs are whole allocations of the layer's (8-byte aligned by
            # construction) and i a lane group's first index.
            store_u64(out, i // LANES, packed)
        return SimpleNamespace(fetch=fetch, value=value, put=put, flush=flush, buffer_type=np.uint64)

    @cuda.jit(device=True, inline=True)
    def fetch(a, i, buf, k):
        for v in range(LANES):
            buf[k * LANES + v] = load(a, i + v)

    @cuda.jit(device=True, inline=True)
    def value(buf, k, v):
        return buf[k * LANES + v]

    @cuda.jit(device=True, inline=True)
    def put(out, i, w, packed, v):
        return packed, stored(out, i, w)

    @cuda.jit(device=True, inline=True)
    def flush(out, i, packed):
        pass
    return SimpleNamespace(fetch=fetch, value=value, put=put, flush=flush, buffer_type=np.float32)


@functools.lru_cache(maxsize=None)
def value_math(storage: str, activation: Activation, normalization: Normalization,
               parameter: float | None = None) -> SimpleNamespace:
    """The per-value arithmetic of the jobs (device functions, shared with the segment
    kernels of layer norm): the norm group of a value, the activation's input and the
    normalised value, a channel's parameters, and what each job makes of one value."""
    load = storage_io(storage).load
    act_f, act_d = activation_functions(activation, parameter)
    norm = NORM_MODE[normalization]
    # The per-value arithmetic's type: float64 for float32 storage (see activation_input);
    # the 16-bit formats keep float32, whose rounding is far below their storage's, and
    # float64 there slowed batch norm's training step up to 1.2x (resnet_56 bfloat16, H100).
    widen = np.float64 if storage == "float32" else np.float32

    @cuda.jit(device=True, inline=True)
    def norm_group(r, c, C, S):
        # The statistic the value of row r, channel c is normalised with.
        if norm == NORM_BATCH:
            return c
        if norm == NORM_LAYER:
            return (r * C) // S
        return 0

    @cuda.jit(device=True, inline=True)
    def activation_input(z, mean, inv_std, gamma, beta):
        # (a, x_hat): the activation's input (float32) and the normalised value of z
        # (`widen`), with the group's mean and inv_std and the channel's gamma and beta.
        # In float64 for float32 storage, so that a is rounded once: three float32
        # roundings gave batch norm's forward up to 1.3x PyTorch's error (issue 39).
        z_wide = widen(z)
        if norm == NORM_NONE:
            return z, z_wide
        x_hat = (z_wide - mean) * inv_std
        return np.float32(gamma * x_hat + beta), x_hat

    @cuda.jit(device=True, inline=True)
    def stored_activation_input(z, i, c, g, mean, inv_std, gamma, beta):
        # activation_input of the stored value z[i], channel c, norm group g.
        zi = load(z, i)
        if norm == NORM_NONE:
            return zi, zi
        return activation_input(zi, mean[g], inv_std[g], gamma[c], beta[c])

    @cuda.jit(device=True, inline=True)
    def channel_parameters(job, c, g, mean, inv_std, gamma, beta, sums, batch_stats, count):
        # What `value_terms` needs of channel c in norm group g: (mean, inv_std, gamma,
        # beta, mean of d_a, mean of d_a * x_hat), each read only where this job uses it
        # (zero otherwise).
        g_mean, g_inv_std, c_gamma, c_beta, mean_d_a, mean_d_a_x_hat = ZERO, ZERO, ZERO, ZERO, ZERO, ZERO
        if norm != NORM_NONE and job != STATISTICS:
            g_mean = mean[g]
            g_inv_std = inv_std[g]
            c_gamma = gamma[c]
            c_beta = beta[c]
            if job == GRAD_PRE_ACTIVATIONS and batch_stats:
                mean_d_a = sums[g] / count
                mean_d_a_x_hat = sums[mean.size + g] / count
        return g_mean, g_inv_std, c_gamma, c_beta, mean_d_a, mean_d_a_x_hat

    @cuda.jit(device=True, inline=True)
    def value_terms(job, z, d_y, g_mean, g_inv_std, c_gamma, c_beta, mean_d_a, mean_d_a_x_hat, shift,
                    batch_stats):
        # What a job makes of one value z (and its d_y), given its channel's parameters
        # (channel_parameters): the two values it sums and the value it writes (y or
        # d_z; the caller stores it, and sums d_z as stored: the bias gradient of the
        # stored d_z). Statistics are summed shifted by the channel's first value, which
        # keeps the variance from cancelling when the mean is large against the spread.
        # The arithmetic is `widen`'s (in float64 a product of two float32 values is
        # exact), the written value rounded once: without a norm the same bits either way.
        if job == STATISTICS:
            v = widen(z) - shift
            return v, v * v, ZERO
        a, x_hat = activation_input(z, g_mean, g_inv_std, c_gamma, c_beta)
        if job == NORMALISE_AND_ACTIVATE:
            return WIDE_ZERO, WIDE_ZERO, act_f(a)
        d_a = widen(d_y) * act_d(a)
        if job == NORM_GRADIENTS:
            return d_a, d_a * x_hat, ZERO
        if norm == NORM_NONE:
            d_z = d_a
        elif not batch_stats:
            d_z = d_a * c_gamma * g_inv_std
        elif norm == NORM_BATCH:
            d_z = c_gamma * g_inv_std * (d_a - mean_d_a - x_hat * mean_d_a_x_hat)
        else:
            d_z = g_inv_std * (d_a * c_gamma - mean_d_a - x_hat * mean_d_a_x_hat)
        return WIDE_ZERO, WIDE_ZERO, np.float32(d_z)

    return SimpleNamespace(norm_group=norm_group, activation_input=activation_input,
                           stored_activation_input=stored_activation_input,
                           channel_parameters=channel_parameters, value_terms=value_terms, act_d=act_d, act_f=act_f)


@functools.lru_cache(maxsize=None)
def fold_rows_function() -> object:
    """fold_rows(s0, s1, t, n, C): s0[c] and s1[c] (c < C) become the sums of the n rows of
    C values there (row j at j * C), in a fixed tree: rows [h, n) added onto [0, n - h),
    h = ceil(n / 2), until one row is left (C = 1: one value, s0[0], the sum of s0[:n]):
    log2(n) dependent steps where a loop takes n. Every thread of the block calls it (it
    synchronises the block)."""
    @cuda.jit(device=True, inline=True)
    def fold_rows(s0, s1, t, n, C):
        while n > 1:
            h = (n + 1) // 2
            for i in range(t, (n - h) * C, ROW_THREADS):
                s0[i] += s0[i + h * C]
                s1[i] += s1[i + h * C]
            cuda.syncthreads()
            n = h
    return fold_rows


def _row_pass(storage: str, activation: Activation, normalization: Normalization, lanes: int, wide: bool,
              config: LaunchConfig, parameter: float | None) -> object:
    """row_pass: phase one of a row kernel for one thread (see its comment)."""
    ROW_UNROLL = config.row_unroll
    ROW_BUFFER = ROW_UNROLL * MAX_LANES
    LANES = lanes
    load = storage_io(storage).load
    io = lane_io(storage, lanes, wide)
    fetch, value, put, flush, BUFFER_TYPE = io.fetch, io.value, io.put, io.flush, io.buffer_type
    per_value = value_math(storage, activation, normalization, parameter)
    norm_group, channel_parameters, value_terms = (per_value.norm_group, per_value.channel_parameters,
                                                   per_value.value_terms)
    norm = NORM_MODE[normalization]

    @cuda.jit(device=True, inline=True)
    def row_pass(job, z, d_y, out, c0, r, end, step, C, S, mean, inv_std, gamma, beta, sums, batch_stats, count,
                 sum0, sum1, shift):
        # Rows r, r + step, ... < end of channels c0 .. c0 + LANES - 1, summed in that
        # order into sum0/sum1. Each turn loads ROW_UNROLL rows first, so that many loads
        # are in flight, then computes them in order (one copy of the per-value code
        # keeps numba's compile time short). Without layer norm a channel's parameters
        # are the same on every row: read once, kept in registers (per-value reads of
        # them were most of the kernels' L1 traffic).
        # Sized by module constants (numba needs them); a variant uses what it needs.
        z_buf = cuda.local.array(ROW_BUFFER, dtype=BUFFER_TYPE)
        d_y_buf = cuda.local.array(ROW_BUFFER, dtype=BUFFER_TYPE)
        lane_mean = cuda.local.array(MAX_LANES, dtype=np.float32)
        lane_inv_std = cuda.local.array(MAX_LANES, dtype=np.float32)
        lane_gamma = cuda.local.array(MAX_LANES, dtype=np.float32)
        lane_beta = cuda.local.array(MAX_LANES, dtype=np.float32)
        lane_mean_d_a = cuda.local.array(MAX_LANES, dtype=np.float32)
        lane_mean_d_a_x_hat = cuda.local.array(MAX_LANES, dtype=np.float32)
        for v in range(LANES):
            sum0[v] = ZERO
            sum1[v] = ZERO
            shift[v] = load(z, c0 + v) if job == STATISTICS else ZERO
            if norm != NORM_LAYER:
                (lane_mean[v], lane_inv_std[v], lane_gamma[v], lane_beta[v], lane_mean_d_a[v],
                 lane_mean_d_a_x_hat[v]) = channel_parameters(job, c0 + v, c0 + v, mean, inv_std, gamma, beta, sums,
                                                              batch_stats, count)
        while r < end:
            for k in range(ROW_UNROLL):
                rk = r + k * step
                if rk < end:
                    fetch(z, rk * C + c0, z_buf, k)
                    if job == NORM_GRADIENTS or job == GRAD_PRE_ACTIVATIONS:
                        fetch(d_y, rk * C + c0, d_y_buf, k)
            for k in range(ROW_UNROLL):
                rk = r + k * step
                if rk < end:
                    packed = np.uint64(0)
                    for v in range(LANES):
                        c = c0 + v
                        if norm == NORM_LAYER:
                            g_mean, g_inv_std, c_gamma, c_beta, mean_d_a, mean_d_a_x_hat = channel_parameters(
                                job, c, norm_group(rk, c, C, S), mean, inv_std, gamma, beta, sums, batch_stats, count)
                        else:
                            g_mean, g_inv_std, c_gamma, c_beta, mean_d_a, mean_d_a_x_hat = (
                                lane_mean[v], lane_inv_std[v], lane_gamma[v], lane_beta[v], lane_mean_d_a[v],
                                lane_mean_d_a_x_hat[v])
                        d_y_value = value(d_y_buf, k, v) if job == NORM_GRADIENTS or job == GRAD_PRE_ACTIVATIONS \
                            else ZERO
                        summand0, summand1, written = value_terms(job, value(z_buf, k, v), d_y_value, g_mean,
                                                                  g_inv_std, c_gamma, c_beta, mean_d_a,
                                                                  mean_d_a_x_hat, shift[v], batch_stats)
                        if job == NORMALISE_AND_ACTIVATE or job == GRAD_PRE_ACTIVATIONS:
                            packed, as_stored = put(out, rk * C + c, written, packed, v)
                            if job == GRAD_PRE_ACTIVATIONS:
                                summand0 = as_stored
                        sum0[v] += summand0
                        sum1[v] += summand1
                    if job == NORMALISE_AND_ACTIVATE or job == GRAD_PRE_ACTIVATIONS:
                        flush(out, rk * C + c0, packed)
            r += ROW_UNROLL * step
    return row_pass


def _partial_sums(config: LaunchConfig) -> SimpleNamespace:
    """Phase two's sums of the partials (device functions): `column_sums`, one thread's
    rows of a channel, and `channel_sums`, a channel's threads' sums added in order."""
    PHASE_TWO_UNROLL = config.phase_two_unroll

    @cuda.jit(device=True, inline=True)
    def column_sums(p0, p1, base, j, n, stride, C, c):
        # Sums of partials[p * C + c] over p = base + j, base + j + stride, ... < base + n
        # for both arrays, in that order; PHASE_TWO_UNROLL loads in flight (a warp reads
        # consecutive channels).
        b0 = cuda.local.array(PHASE_TWO_UNROLL, dtype=np.float64)
        b1 = cuda.local.array(PHASE_TWO_UNROLL, dtype=np.float64)
        a0, a1 = WIDE_ZERO, WIDE_ZERO
        p = base + j
        end = base + n
        while p < end:
            for k in range(PHASE_TWO_UNROLL):
                q = p + k * stride
                if q < end:
                    b0[k] = p0[q * C + c]
                    b1[k] = p1[q * C + c]
            for k in range(PHASE_TWO_UNROLL):
                if p + k * stride < end:
                    a0 += b0[k]
                    a1 += b1[k]
            p += PHASE_TWO_UNROLL * stride
        return a0, a1

    @cuda.jit(device=True, inline=True)
    def channel_sums(s0, s1, t, u0, u1, threads_per_channel, C):
        # With C < ROW_THREADS, thread t = j * C + c holds the j-th of channel c's sums
        # (u0, u1); for t < C, the channel's totals added in order of j. Every thread of
        # the block calls it together (it synchronises the block).
        s0[t] = u0
        s1[t] = u1
        cuda.syncthreads()
        t0, t1 = WIDE_ZERO, WIDE_ZERO
        if t < C:
            for j in range(threads_per_channel):
                t0 += s0[j * C + t]
                t1 += s1[j * C + t]
        return t0, t1
    return SimpleNamespace(column_sums=column_sums, channel_sums=channel_sums)


def _finish(storage: str) -> Any:
    """Phase two's last step (a device function): `finish` turns a channel's totals into
    the job's results (statistics and running statistics, norm gradients, bias gradient)."""
    stored_io = storage_io(storage)
    load, store = stored_io.load, stored_io.store

    @cuda.jit(device=True, inline=True)
    def finish(job, g, t0, t1, z, mean, inv_std, sums, count, epsilon, momentum, batches, var_scale, C, acc0,
               acc1, accumulate):
        # Phase two's result for channel g from its totals t0, t1. The running variance
        # takes the biased variance times var_scale (1, or count / (count - 1) for the
        # unbiased rule). A momentum < 0 stands for the cumulative average: 1 / the
        # batches counted (batches[0], this one included: count_batch ran first).
        if job == STATISTICS:
            # Shifted sums: t0 = sum(z - shift), t1 = sum((z - shift)^2), shift = z[0, g].
            shifted_mean = t0 / count
            var = max(t1 / count - shifted_mean * shifted_mean, ZERO)
            mu = load(z, g) + shifted_mean
            mean[g] = mu
            inv_std[g] = ONE / math.sqrt(var + epsilon)
            if accumulate == ACC_ADD:  # the running statistics
                m = momentum if momentum >= ZERO else ONE / np.float32(batches[0])
                acc0[g] = (ONE - m) * acc0[g] + m * mu
                acc1[g] = (ONE - m) * acc1[g] + m * (var * var_scale)
        elif job == NORM_GRADIENTS:
            sums[g] = t0
            sums[C + g] = t1
            if accumulate == ACC_ADD:  # d_beta, d_gamma
                acc0[g] += t0
                acc1[g] += t1
            elif accumulate == ACC_WRITE:
                acc0[g] = t0 + ZERO  # + 0: -0.0 becomes +0.0, as 0 + t0 would
                acc1[g] = t1 + ZERO
        elif accumulate == ACC_ADD:  # GRAD_PRE_ACTIVATIONS: d_b, in the storage format
            store(acc0, g, np.float32(load(acc0, g) + t0))
        elif accumulate == ACC_WRITE:
            store(acc0, g, np.float32(t0 + WIDE_ZERO))
    return finish


def _phase_two(storage: str, config: LaunchConfig) -> SimpleNamespace:
    """The summing jobs' phase two (device functions): `finish` a channel's totals, and
    `phase_two`, the last blocks adding the partials (`_partial_sums`)."""
    PHASE_GROUP = config.phase_group
    sums_of = _partial_sums(config)
    column_sums, channel_sums = sums_of.column_sums, sums_of.channel_sums
    finish = _finish(storage)

    @cuda.jit(device=True, inline=True)
    def phase_two(job, p, t, out0, out1, s0, s1, ticket, counter, C, z, mean, inv_std, sums, count, epsilon,
                  momentum, batches, var_scale, acc0, acc1, accumulate):
        # Phase two in two levels when there are several groups of PHASE_GROUP blocks:
        # the last block of a group to finish adds the group's partials in block order
        # into row P + group; the last group to finish adds those in group order and
        # finishes. One group: its last block adds the P partials in block order.
        # Tickets: counter[1 + group], then counter[0]; `ticket` (shared) tells the
        # block whether it drew the last one.
        P = cuda.gridDim.x
        n_groups = (P + PHASE_GROUP - 1) // PHASE_GROUP
        group = p // PHASE_GROUP
        first = group * PHASE_GROUP
        blocks_in_group = min(PHASE_GROUP, P - first)
        cuda.threadfence()  # this block's partials before its ticket
        cuda.syncthreads()
        if t == 0:
            ticket[0] = 1 if cuda.atomic.add(counter, 1 + group, 1) == blocks_in_group - 1 else 0
        cuda.syncthreads()
        # One loop over the levels, so that the summing code is inlined once (a second
        # copy took the kernels from 48 to 122 registers a thread).
        level = 0 if n_groups > 1 else 1
        while level < 2 and ticket[0] == 1:
            base, n = (first, blocks_in_group) if level == 0 else ((P, n_groups) if n_groups > 1 else (0, P))
            # With C < ROW_THREADS thread t adds the partials of rows base + t // C,
            # base + t // C + threads_per_channel, ... of channel t % C, then a
            # channel's sums are added in order; otherwise thread t adds all rows of
            # its channels.
            if C < ROW_THREADS:
                threads_per_channel = ROW_THREADS // C
                u0, u1 = WIDE_ZERO, WIDE_ZERO
                if t < threads_per_channel * C:
                    u0, u1 = column_sums(out0, out1, base, t // C, n, threads_per_channel, C, t % C)
                t0, t1 = channel_sums(s0, s1, t, u0, u1, threads_per_channel, C)
                c_first, c_end, c_step = t, (t + 1 if t < C else t), 1
            else:
                c_first, c_end, c_step = t, C, ROW_THREADS
            for c in range(c_first, c_end, c_step):
                if C >= ROW_THREADS:
                    t0, t1 = column_sums(out0, out1, base, 0, n, 1, C, c)
                if level == 0:
                    out0[(P + group) * C + c] = t0
                    out1[(P + group) * C + c] = t1
                else:
                    finish(job, c, t0, t1, z, mean, inv_std, sums, count, epsilon, momentum, batches, var_scale, C,
                           acc0, acc1, accumulate)
            if level == 0:
                if t == 0:
                    counter[1 + group] = 0
                cuda.threadfence()  # the group's sums before its ticket
                cuda.syncthreads()
                if t == 0:
                    ticket[0] = 1 if cuda.atomic.add(counter, 0, 1) == n_groups - 1 else 0
                cuda.syncthreads()
            elif t == 0:
                counter[0] = 0
                counter[1 + group] = 0
            level += 1
    return SimpleNamespace(finish=finish, phase_two=phase_two)


@functools.lru_cache(maxsize=None)
def row_kernels(storage: str, activation: Activation, normalization: Normalization, lanes: int, wide: bool,
                config: LaunchConfig, parameter: float | None = None) -> dict[int, object]:
    """job -> the row kernel of one layer kind; see the module docstring. `config`'s
    settings are compile-time constants of the kernels (bound to these names before the
    kernels are defined)."""
    LANES = lanes
    row_pass = _row_pass(storage, activation, normalization, lanes, wide, config, parameter)
    ends = _phase_two(storage, config)
    finish, phase_two = ends.finish, ends.phase_two
    fold_rows = fold_rows_function()

    def make(job):
        @cuda.jit(**config.jit_options())
        def rows(z, d_y, out, mean, inv_std, gamma, beta, sums, batch_stats, count, epsilon, momentum, batches,
                 var_scale, M, C, S, out0, out1, counter, acc0, acc1, accumulate):
            """One pass over the (M, C) values: grid P blocks of ROW_THREADS, block p takes
            the rows [p*ceil(M/P), (p+1)*ceil(M/P)). A thread keeps a lane group of LANES
            consecutive channels; with fewer lane groups than ROW_THREADS, thread t keeps
            group t % lane_groups and takes every rows_at_once-th row, so a block reads
            consecutive values; otherwise a thread takes groups t, t+ROW_THREADS, ...
            Summing jobs write one partial per block and channel to out0/out1 (P, C); the
            last block to finish (counted in counter[0], which it resets) adds them up in
            a fixed order and finishes (`phase_two`): no second launch. A grid of one
            block finishes its own partials."""
            s0 = cuda.shared.array(ROW_SHARED, dtype=np.float64)
            s1 = cuda.shared.array(ROW_SHARED, dtype=np.float64)
            sum0 = cuda.local.array(MAX_LANES, dtype=np.float64)
            sum1 = cuda.local.array(MAX_LANES, dtype=np.float64)
            shift = cuda.local.array(MAX_LANES, dtype=np.float32)
            t = cuda.threadIdx.x
            p = cuda.blockIdx.x
            per = -(-M // cuda.gridDim.x)
            start = p * per
            end = min(M, start + per)
            # One call site of row_pass for both layouts: each copy of the inlined
            # per-value code costs numba seconds of compile time.
            lane_groups = C // LANES
            rows_at_once = ROW_THREADS // lane_groups if lane_groups < ROW_THREADS else 1
            if lane_groups < ROW_THREADS:
                g_first, r_first, step = t % lane_groups, start + t // lane_groups, rows_at_once
                g_end = g_first + 1 if t < rows_at_once * lane_groups else g_first
            else:
                g_first, r_first, step, g_end = t, start, 1, lane_groups
            for v in range(LANES):
                sum0[v] = ZERO
                sum1[v] = ZERO
            for g in range(g_first, g_end, ROW_THREADS):
                row_pass(job, z, d_y, out, g * LANES, r_first, end, step, C, S, mean, inv_std, gamma, beta, sums,
                         batch_stats, count, sum0, sum1, shift)
                if job != NORMALISE_AND_ACTIVATE and lane_groups >= ROW_THREADS:
                    for v in range(LANES):
                        out0[p * C + g * LANES + v] = sum0[v]
                        out1[p * C + g * LANES + v] = sum1[v]
            if job != NORMALISE_AND_ACTIVATE and lane_groups < ROW_THREADS:
                for v in range(LANES):
                    s0[t * LANES + v] = sum0[v]
                    s1[t * LANES + v] = sum1[v]
                cuda.syncthreads()
                # Thread j * lane_groups + g kept group g of rows j, j + rows_at_once, ...:
                # s0 and s1 hold (rows_at_once, C) sums, row j channel c at j * C + c,
                # added in fold_rows' fixed tree (log2 steps where a loop took
                # rows_at_once = 128 dependent steps for 8 bf16 channels: 2-3 us a launch).
                fold_rows(s0, s1, t, rows_at_once, C)
                for c in range(t, C, ROW_THREADS):
                    out0[p * C + c] = s0[c]
                    out1[p * C + c] = s1[c]
            if job != NORMALISE_AND_ACTIVATE and cuda.gridDim.x == 1:
                # One block: its partials are the totals, finished here without a ticket.
                # ZERO + x: the bits that phase two's sums (from ZERO) would give.
                cuda.syncthreads()  # the block's partials, written by its threads
                for c in range(t, C, ROW_THREADS):
                    finish(job, c, WIDE_ZERO + out0[c], WIDE_ZERO + out1[c], z, mean, inv_std, sums, count, epsilon, momentum,
                           batches, var_scale, C, acc0, acc1, accumulate)
            elif job != NORMALISE_AND_ACTIVATE:
                ticket = cuda.shared.array(1, dtype=np.int32)
                phase_two(job, p, t, out0, out1, s0, s1, ticket, counter, C, z, mean, inv_std, sums, count, epsilon,
                          momentum, batches, var_scale, acc0, acc1, accumulate)
        return rows

    return {job: make(job) for job in JOBS}
