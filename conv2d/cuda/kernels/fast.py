"""The fast kernel set: the steps of simple.py fused where fusion pays. Norm statistics;
the norm applied with the activation (y); the activation and norm backward writing d_z
with the bias gradient; the norm-parameter gradients.

Every array is flat and C-ordered: activations are (M, C) with M = N*OH*OW rows and
C = OC channels (NHWC), a sample is S = OH*OW*OC consecutive values. Storage arrays are
float32, float16, or uint16 holding bfloat16 bits; all arithmetic is float32.

Reductions are two-phase with a fixed order, so results are bitwise identical run to
run: phase one gives each block a fixed slice of rows and sums it in a fixed order into
one partial per (block, group); phase two adds those partials in a fixed order (and, for
layer norm's per-sample sums, a fixed tree). The partition depends only on the shape,
the storage format and the launch settings (LaunchConfig).
The per-value passes are "row kernels" (`rows`): one skeleton that gives each thread a
fixed lane group of channels (`lanes_for`: 8 bytes of them, read with one load where the
data is 8-byte aligned) and either sums (statistics, the norm's gradient terms), writes
y, or writes d_z while summing it for the bias gradient; the channels' norm parameters
are read once where they do not change with the row (no norm, batch norm), and y and
d_z written with one 8-byte store a lane group. In a row kernel phase two runs in the
same launch, in two levels: the last block of each group of `phase_group` blocks (an
atomic ticket) adds the group's partials, the last group adds those, reading them
coalesced in its own channel layout; a launch of one block (a small layer) finishes its
own sums. Within a block, the threads' sums of a channel are added in a fixed tree
(`fold_rows`). Layer norm's per-sample sums keep a separate phase-two launch
(`partials_final`, `stats_final`).

`kernel_set(storage, activation, norm, lanes, wide, config)` compiles (once) the kernels
for one layer kind; the storage format, activation, norm, lane layout and launch
settings are compile-time constants of its closures.

Where the simple set has one kernel a step, this set has (reference function -> here):
statistics + inverse_std + update_running -> rows[SUM_STATS] (batch norm) or
segment_partials[SUM_STATS] + stats_final (layer norm), running_stats (batch norm, eval);
activation_input + activation_forward -> rows[WRITE_Y]; param_backward + gradient_means
-> rows[SUM_GRADS] (+ segment_partials[SUM_GRADS] + partials_final for layer norm);
activation_backward + backward_*_statistics + to_storage + bias_backward -> rows[WRITE_DZ].
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from conv2d.activations import Activation
from conv2d.cuda.kernels.activation import ONE, ZERO, activation_functions
from conv2d.cuda.kernels.bits import load_u64, storage_io, store_u64
from conv2d.cuda.runtime import numba_cuda, simulating
from conv2d.spec import Normalization

cuda = numba_cuda()
f32 = np.float32

# Launch shapes (the tuned ones are LaunchConfig's fields, below). Row kernels: blocks of
# ROW_THREADS threads, each block a fixed slice of rows; at most `row_max_blocks` blocks,
# at least ROW_MIN_VALUES values per thread: one
# wave of three blocks an SM of an H100/H200 (132 SMs). The lane-group row kernels take
# 60-80 registers (ptxas, sm_90), so three blocks of 256 fit an SM (four need <= 64) and
# a launch of four an SM ran its last blocks in a second wave. scripts/breakdown_cuda.py
# on the H200, graph step, bf16 batch norm (resnet_28 / resnet_56 / rl_small): 396
# blocks 431 / 375 / 95 us; 528 blocks 469 / 413 / 105, or 444 / 392 / 102 with launch
# bounds of four blocks (64 registers, with spills in the gradient kernels). Before the
# lane groups (one channel a thread, <= 64 registers) 528 blocks had won over 1056 and 264.
ELEMENTWISE_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 132 * 16
ROW_THREADS = 256
SMS = 132
ROW_MIN_VALUES = 16
MAX_LANES = 4  # channels a row-kernel thread keeps at most (8 bytes of 16-bit values)
# numba sizes local and shared arrays only by constants (module constants or the names
# kernel_set binds before it defines the kernels), not expressions.
ROW_SHARED = ROW_THREADS * MAX_LANES
SEG_THREADS = 256
SEG_MAX_PARTIALS = 64
WARP = 32


@dataclass(frozen=True)
class LaunchConfig:
    """The fast kernels' tuned launch settings: compile-time constants of the kernels and
    part of their cache key (`kernel_set`), chosen per layer (the backend option
    `launch_config`), never patched into this module. The defaults are the H200's
    (scripts/breakdown_cuda.py sweeps them)."""

    wide_rows: bool = True  # row kernels read lane groups with 8-byte loads (lanes_for)
    row_unroll: int = 4  # rows a row-kernel thread loads before it adds them
    phase_two_unroll: int = 4  # partials in flight per thread in phase two
    row_max_blocks: int = SMS * 3  # at most this many row-kernel blocks (one wave of three an SM)
    # Blocks whose partials one block adds in phase two's first level (phase_groups).
    phase_group: int = 16
    # Row kernels compiled with launch bounds of row_max_blocks // SMS resident blocks an
    # SM, so that a change that needs more registers spills (visible in ptxas -v) instead
    # of silently putting a launch in two waves.
    row_bounded: bool = True
    # Fixed block counts instead of the shape's partition (tests: several partials on a
    # small shape); None: row_partition and segment_partition decide.
    row_blocks: Optional[int] = None
    segment_blocks: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("row_unroll", "phase_two_unroll", "row_max_blocks", "phase_group", "row_blocks",
                     "segment_blocks"):
            v = getattr(self, name)
            if v is None and name in ("row_blocks", "segment_blocks"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"launch_config.{name}: expected an int >= 1, got {v!r}")
        for name in ("wide_rows", "row_bounded"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"launch_config.{name}: expected a bool, got {getattr(self, name)!r}")

    def row_partition(self, M: int, C: int) -> int:
        """Blocks of a row kernel over (M, C) values: enough to fill the GPU, each thread
        with at least ROW_MIN_VALUES values, no block without a row. Depends on the shape
        alone (and `row_blocks`, where given)."""
        if self.row_blocks is not None:
            return self.row_blocks
        return max(1, min(self.row_max_blocks, M, -(-M * C // (ROW_THREADS * ROW_MIN_VALUES))))

    def phase_groups(self, P: int) -> int:
        """Groups of `phase_group` blocks that a row kernel of P blocks adds up in phase
        two's first level: its partials need P + phase_groups(P) rows of C, its counter 1
        + phase_groups(P) zeros."""
        return -(-P // self.phase_group)

    def segment_partition(self, S: int) -> int:
        """Blocks along one sample of a segment reduction: ~16 values per thread, at most 64."""
        if self.segment_blocks is not None:
            return self.segment_blocks
        return max(1, min(SEG_MAX_PARTIALS, -(-S // (SEG_THREADS * 16))))


DEFAULT_CONFIG = LaunchConfig()

# Norm modes, and what a row kernel does per value (compile-time constants): sum the
# shifted statistics, sum the norm's gradient terms, write d_z and sum it (the bias
# gradient), or write y = act(norm(z)).
NORM_NONE, NORM_BATCH, NORM_LAYER = 0, 1, 2
SUM_STATS, SUM_GRADS, WRITE_DZ, WRITE_Y = 0, 1, 2, 3
# What a row kernel does with the totals it hands on (acc0, acc1): nothing, add them
# (+=: running statistics, accumulated gradients) or write them (fresh gradients, which
# then need no zeroing first: the same bits as adding to zero).
ACC_NONE, ACC_ADD, ACC_WRITE = 0, 1, 2
NORM_MODE = {Normalization.NONE: NORM_NONE, Normalization.BATCH_NORM: NORM_BATCH,
             Normalization.LAYER_NORM: NORM_LAYER}

def _lanes_in_8_bytes(storage: str) -> int:
    return 8 // np.dtype(np.float32 if storage == "float32" else np.uint16).itemsize


def lanes_for(storage: str, C: int) -> int:
    """Channels a row-kernel thread keeps: as many as fill 8 bytes of its storage format
    where C divides into them, else one. Depends on the shape and dtype alone."""
    lanes = _lanes_in_8_bytes(storage)
    return lanes if C % lanes == 0 else 1


@dataclass(frozen=True)
class KernelSet:
    """The compiled kernels of one (storage, activation, norm) layer kind."""

    rows: dict  # SUM_STATS, SUM_GRADS, WRITE_DZ, WRITE_Y -> row kernel (phase two included)
    segment_partials: dict  # SUM_STATS, SUM_GRADS -> kernel
    partials_final: object  # phase two of a segment reduction: the totals
    stats_final: object  # phase two of layer norm's segment statistics: mean, inv_std
    running_stats: object
    accumulate_stored: object  # grad += new, elementwise, both in the storage format
    direct_evaluate: object  # evaluate in one kernel (no norm, batch norm): conv, norm, activation


def row_jit_options(config: LaunchConfig) -> dict:
    """cuda.jit options of the row kernels: launch bounds (`row_bounded`), on a GPU only
    (the simulator takes none)."""
    if not config.row_bounded or simulating():
        return {}
    return {"launch_bounds": (ROW_THREADS, max(1, config.row_max_blocks // SMS))}


@functools.lru_cache(maxsize=None)
def kernel_set(storage: str, activation: Activation, normalization: Normalization, lanes: int = 1,
               wide: bool = False, config: LaunchConfig = DEFAULT_CONFIG) -> KernelSet:
    """The kernels of one layer kind. Row-kernel threads keep `lanes` consecutive channels
    (1, or `lanes_for`); with `wide` they read them with one 8-byte load (the arrays they
    read must then be 8-byte aligned), without it one load a value: the same sums in the
    same order, so the two give bitwise identical results. `config`'s settings are
    compile-time constants of the kernels (bound to these names before they are defined)."""
    ROW_UNROLL, PHASE_TWO_UNROLL, PHASE_GROUP = config.row_unroll, config.phase_two_unroll, config.phase_group
    ROW_BUFFER = ROW_UNROLL * MAX_LANES
    load, store, stored, part, encode = storage_io(storage)
    LANES = lanes
    if wide:
        if lanes != _lanes_in_8_bytes(storage):
            raise ValueError(f"wide loads need 8 bytes of channels, got lanes={lanes} of {storage}")
        BUF_T = np.uint64

        @cuda.jit(device=True, inline=True)
        def fetch(a, i, buf, k):
            buf[k] = load_u64(a, i // LANES)

        @cuda.jit(device=True, inline=True)
        def value(buf, k, v):
            return part(buf[k], v)

        SHIFT = 64 // LANES

        @cuda.jit(device=True, inline=True)
        def put(out, i, w, packed, v):
            # w into lane v of the lane group's 8 bytes; the value as stored.
            bits, as_stored = encode(w)
            return packed | (bits << np.uint64(SHIFT * v)), as_stored

        @cuda.jit(device=True, inline=True)
        def flush(out, i, packed):
            # Outputs are whole allocations of the layer's (8-byte aligned by
            # construction) and i a lane group's first index.
            store_u64(out, i // LANES, packed)
    else:
        BUF_T = np.float32

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
    act_f, act_d = activation_functions(activation)
    mode = NORM_MODE[normalization]

    @cuda.jit(device=True, inline=True)
    def row_group(r, c, C, S):
        # The statistic the values of row r, channel c are normalised with.
        if mode == NORM_BATCH:
            return c
        if mode == NORM_LAYER:
            return (r * C) // S
        return 0

    @cuda.jit(device=True, inline=True)
    def act_scalar(zi, m, isd, gm, bt):
        # (a, x_hat): the activation's input, and the normalised value, for z = zi with
        # mean m, inverse deviation isd, gamma gm and beta bt.
        if mode == NORM_NONE:
            return zi, zi
        x_hat = (zi - m) * isd
        return gm * x_hat + bt, x_hat

    @cuda.jit(device=True, inline=True)
    def act_value(zi, c, g, mean, inv_std, gamma, beta):
        # act_scalar with channel c's gamma/beta and group g's statistics.
        if mode == NORM_NONE:
            return zi, zi
        return act_scalar(zi, mean[g], inv_std[g], gamma[c], beta[c])

    @cuda.jit(device=True, inline=True)
    def act_input(z, i, c, g, mean, inv_std, gamma, beta):
        return act_value(load(z, i), c, g, mean, inv_std, gamma, beta)

    @cuda.jit(device=True, inline=True)
    def lane_params(kind, c, g, mean, inv_std, gamma, beta, sums, batch_stats, count):
        # What row_terms needs of channel c in group g: (mean, inverse deviation, gamma,
        # beta, sums[g] / count, sums[G + g] / count), each read only where it exists
        # for this kind (zero otherwise).
        m, isd, gm, bt, q0, q1 = ZERO, ZERO, ZERO, ZERO, ZERO, ZERO
        if mode != NORM_NONE and kind != SUM_STATS:
            m = mean[g]
            isd = inv_std[g]
            gm = gamma[c]
            bt = beta[c]
            if kind == WRITE_DZ and batch_stats:
                q0 = sums[g] / count
                q1 = sums[mean.size + g] / count
        return m, isd, gm, bt, q0, q1

    @cuda.jit(device=True, inline=True)
    def row_terms(kind, zi, gi, m, isd, gm, bt, q0, q1, shift, batch_stats):
        # What a row kernel does with one value, given z = zi, d_y = gi and its channel's
        # parameters (lane_params): returns the two values it sums and the value it
        # writes (y or d_z; the caller stores it and sums d_z as stored). Statistics
        # are summed shifted by the channel's first value, which keeps the variance from
        # cancelling when the mean is large against the spread. WRITE_DZ sums d_z as
        # stored (the bias gradient of the stored d_z).
        if kind == SUM_STATS:
            v = zi - shift
            return v, v * v, ZERO
        a, x_hat = act_scalar(zi, m, isd, gm, bt)
        if kind == WRITE_Y:
            return ZERO, ZERO, act_f(a)
        d_a = gi * act_d(a)
        if kind == SUM_GRADS:
            return d_a, d_a * x_hat, ZERO
        if mode == NORM_NONE:
            v = d_a
        elif not batch_stats:
            v = d_a * gm * isd
        elif mode == NORM_BATCH:
            v = gm * isd * (d_a - q0 - x_hat * q1)
        else:
            v = isd * (d_a * gm - q0 - x_hat * q1)
        return ZERO, ZERO, v

    @cuda.jit(device=True, inline=True)
    def row_run(kind, z, d_y, out, c0, r, end, step, C, S, mean, inv_std, gamma, beta, sums, batch_stats, count,
                acc0, acc1, shift):
        # Rows r, r + step, ... < end of channels c0 .. c0 + LANES - 1, summed in that
        # order into acc0/acc1. Each turn loads ROW_UNROLL rows first, so that many loads
        # are in flight, then computes them in order (one copy of the per-value code
        # keeps numba's compile time short). Without layer norm a channel's parameters
        # are the same on every row: read once, kept in registers (per-value reads of
        # them were most of the kernels' L1 traffic).
        # Sized by module constants (numba needs them); a variant uses what it needs.
        zs = cuda.local.array(ROW_BUFFER, dtype=BUF_T)
        gs = cuda.local.array(ROW_BUFFER, dtype=BUF_T)
        pm = cuda.local.array(MAX_LANES, dtype=np.float32)
        pi = cuda.local.array(MAX_LANES, dtype=np.float32)
        pg = cuda.local.array(MAX_LANES, dtype=np.float32)
        pb = cuda.local.array(MAX_LANES, dtype=np.float32)
        p0 = cuda.local.array(MAX_LANES, dtype=np.float32)
        p1 = cuda.local.array(MAX_LANES, dtype=np.float32)
        for v in range(LANES):
            acc0[v] = ZERO
            acc1[v] = ZERO
            shift[v] = load(z, c0 + v) if kind == SUM_STATS else ZERO
            if mode != NORM_LAYER:
                pm[v], pi[v], pg[v], pb[v], p0[v], p1[v] = lane_params(kind, c0 + v, c0 + v, mean, inv_std, gamma,
                                                                       beta, sums, batch_stats, count)
        while r < end:
            for k in range(ROW_UNROLL):
                rk = r + k * step
                if rk < end:
                    fetch(z, rk * C + c0, zs, k)
                    if kind == SUM_GRADS or kind == WRITE_DZ:
                        fetch(d_y, rk * C + c0, gs, k)
            for k in range(ROW_UNROLL):
                rk = r + k * step
                if rk < end:
                    packed = np.uint64(0)
                    for v in range(LANES):
                        c = c0 + v
                        if mode == NORM_LAYER:
                            m, isd, gm, bt, q0, q1 = lane_params(kind, c, row_group(rk, c, C, S), mean, inv_std,
                                                                 gamma, beta, sums, batch_stats, count)
                        else:
                            m, isd, gm, bt, q0, q1 = pm[v], pi[v], pg[v], pb[v], p0[v], p1[v]
                        gi = value(gs, k, v) if kind == SUM_GRADS or kind == WRITE_DZ else ZERO
                        u0, u1, w = row_terms(kind, value(zs, k, v), gi, m, isd, gm, bt, q0, q1, shift[v],
                                              batch_stats)
                        if kind == WRITE_Y or kind == WRITE_DZ:
                            packed, as_stored = put(out, rk * C + c, w, packed, v)
                            if kind == WRITE_DZ:
                                u0 = as_stored
                        acc0[v] += u0
                        acc1[v] += u1
                    if kind == WRITE_Y or kind == WRITE_DZ:
                        flush(out, rk * C + c0, packed)
            r += ROW_UNROLL * step

    @cuda.jit(device=True, inline=True)
    def column_sums(p0, p1, base, j, n, R, C, c):
        # Sums of partials[p * C + c] over p = base + j, base + j + R, ... < base + n for
        # both arrays, in that order; PHASE_TWO_UNROLL loads in flight (a warp reads
        # consecutive channels).
        b0 = cuda.local.array(PHASE_TWO_UNROLL, dtype=np.float32)
        b1 = cuda.local.array(PHASE_TWO_UNROLL, dtype=np.float32)
        a0, a1 = ZERO, ZERO
        p = base + j
        end = base + n
        while p < end:
            for k in range(PHASE_TWO_UNROLL):
                q = p + k * R
                if q < end:
                    b0[k] = p0[q * C + c]
                    b1[k] = p1[q * C + c]
            for k in range(PHASE_TWO_UNROLL):
                if p + k * R < end:
                    a0 += b0[k]
                    a1 += b1[k]
            p += PHASE_TWO_UNROLL * R
        return a0, a1

    @cuda.jit(device=True, inline=True)
    def channel_sums(s0, s1, t, u0, u1, R, C):
        # With C < ROW_THREADS, thread t = j * C + c holds the j-th of channel c's R sums
        # (u0, u1); for t < C, the channel's totals added in order of j. Every thread of
        # the block calls it together (it synchronises the block).
        s0[t] = u0
        s1[t] = u1
        cuda.syncthreads()
        t0, t1 = ZERO, ZERO
        if t < C:
            for j in range(R):
                t0 += s0[j * C + t]
                t1 += s1[j * C + t]
        return t0, t1

    @cuda.jit(device=True, inline=True)
    def finish(kind, g, t0, t1, z, mean, inv_std, sums, count, epsilon, momentum, var_scale, C, acc0, acc1,
               accumulate):
        # Phase two's result for channel g from its totals t0, t1. The running variance
        # takes the biased variance times var_scale (1, or count / (count - 1) for the
        # unbiased rule).
        if kind == SUM_STATS:
            # Shifted sums: t0 = sum(z - shift), t1 = sum((z - shift)^2), shift = z[0, g].
            m1 = t0 / count
            var = max(t1 / count - m1 * m1, ZERO)
            mu = load(z, g) + m1
            mean[g] = mu
            inv_std[g] = ONE / math.sqrt(var + epsilon)
            if accumulate == ACC_ADD:  # the running statistics
                acc0[g] = (ONE - momentum) * acc0[g] + momentum * mu
                acc1[g] = (ONE - momentum) * acc1[g] + momentum * (var * var_scale)
        elif kind == SUM_GRADS:
            sums[g] = t0
            sums[C + g] = t1
            if accumulate == ACC_ADD:  # d_beta, d_gamma
                acc0[g] += t0
                acc1[g] += t1
            elif accumulate == ACC_WRITE:
                acc0[g] = t0 + ZERO  # + 0: -0.0 becomes +0.0, as 0 + t0 would
                acc1[g] = t1 + ZERO
        elif accumulate == ACC_ADD:  # WRITE_DZ: d_b, in the storage format
            store(acc0, g, load(acc0, g) + t0)
        elif accumulate == ACC_WRITE:
            store(acc0, g, t0 + ZERO)

    @cuda.jit(device=True, inline=True)
    def fold_rows(s0, s1, t, n, C):
        # s0[c] and s1[c] (c < C) become the sums of the n rows of C values there (row j at
        # j * C), in a fixed tree: rows [h, n) added onto [0, n - h), h = ceil(n / 2), until
        # one row is left (C = 1: one value, s0[0], the sum of s0[:n]). Every thread of the
        # block calls it (it synchronises the block).
        while n > 1:
            h = (n + 1) // 2
            for i in range(t, (n - h) * C, ROW_THREADS):
                s0[i] += s0[i + h * C]
                s1[i] += s1[i + h * C]
            cuda.syncthreads()
            n = h

    def make_rows(kind):
        @cuda.jit(**row_jit_options(config))
        def rows(z, d_y, out, mean, inv_std, gamma, beta, sums, batch_stats, count, epsilon, momentum, var_scale,
                 M, C, S, out0, out1, counter, acc0, acc1, accumulate):
            """One pass over the (M, C) values: grid P blocks of ROW_THREADS, block p takes
            the rows [p*ceil(M/P), (p+1)*ceil(M/P)). A thread keeps a lane group of LANES
            consecutive channels; with CG = C / LANES groups < ROW_THREADS thread t keeps
            group t % CG and takes every R-th row (R = ROW_THREADS // CG), so a block reads
            consecutive values; otherwise a thread takes groups t, t+ROW_THREADS, ...
            Summing kinds write one partial per block and channel to out0/out1 (P, C); the
            last block to finish (counted in counter[0], which it resets) adds them up in
            a fixed order and finishes (`finish`): phase two without another launch. A
            grid of one block finishes its own partials."""
            s0 = cuda.shared.array(ROW_SHARED, dtype=np.float32)
            s1 = cuda.shared.array(ROW_SHARED, dtype=np.float32)
            run0 = cuda.local.array(MAX_LANES, dtype=np.float32)
            run1 = cuda.local.array(MAX_LANES, dtype=np.float32)
            shift = cuda.local.array(MAX_LANES, dtype=np.float32)
            t = cuda.threadIdx.x
            p = cuda.blockIdx.x
            per = -(-M // cuda.gridDim.x)
            start = p * per
            end = min(M, start + per)
            # A thread keeps LANES consecutive channels (a lane group); CG groups a row.
            # One call site of row_run for both layouts: each copy of the inlined
            # per-value code costs numba seconds of compile time.
            CG = C // LANES
            R = ROW_THREADS // CG if CG < ROW_THREADS else 1
            if CG < ROW_THREADS:
                g_first, r_first, step = t % CG, start + t // CG, R
                g_end = g_first + 1 if t < R * CG else g_first
            else:
                g_first, r_first, step, g_end = t, start, 1, CG
            for v in range(LANES):
                run0[v] = ZERO
                run1[v] = ZERO
            for g in range(g_first, g_end, ROW_THREADS):
                row_run(kind, z, d_y, out, g * LANES, r_first, end, step, C, S, mean, inv_std, gamma, beta, sums,
                        batch_stats, count, run0, run1, shift)
                if kind != WRITE_Y and CG >= ROW_THREADS:
                    for v in range(LANES):
                        out0[p * C + g * LANES + v] = run0[v]
                        out1[p * C + g * LANES + v] = run1[v]
            if kind != WRITE_Y and CG < ROW_THREADS:
                for v in range(LANES):
                    s0[t * LANES + v] = run0[v]
                    s1[t * LANES + v] = run1[v]
                cuda.syncthreads()
                # Thread j * CG + g kept group g of rows j, j + R, ...: s0 and s1 hold
                # (R, C) sums, row j channel c at j * C + c. Channel c's R sums are added
                # in a fixed tree (rows [h, n) onto [0, n - h), h = ceil(n / 2), until
                # one row is left): log2(R) steps where adding them in a loop of R
                # took R dependent steps (R = 128 for 8 bf16 channels: 2-3 us a launch).
                fold_rows(s0, s1, t, R, C)
                for c in range(t, C, ROW_THREADS):
                    out0[p * C + c] = s0[c]
                    out1[p * C + c] = s1[c]
            if kind != WRITE_Y and cuda.gridDim.x == 1:
                # One block: its partials are the totals, finished here without a ticket.
                # ZERO + x: the bits that phase two's sums (from ZERO) would give.
                cuda.syncthreads()  # the block's partials, written by its threads
                for c in range(t, C, ROW_THREADS):
                    finish(kind, c, ZERO + out0[c], ZERO + out1[c], z, mean, inv_std, sums, count, epsilon, momentum,
                           var_scale, C, acc0, acc1, accumulate)
            elif kind != WRITE_Y:
                # Phase two in two levels when there are several groups of PHASE_GROUP
                # blocks: the last block of a group to finish adds the group's partials
                # in block order into row P + group; the last group to finish adds those
                # in group order and finishes. One group: its last block adds the P
                # partials in block order. Tickets: counter[1 + group], then counter[0].
                flag = cuda.shared.array(1, dtype=np.int32)
                P = cuda.gridDim.x
                NG = (P + PHASE_GROUP - 1) // PHASE_GROUP
                grp = p // PHASE_GROUP
                first = grp * PHASE_GROUP
                n_in = min(PHASE_GROUP, P - first)
                cuda.threadfence()  # this block's partials before its ticket
                cuda.syncthreads()
                if t == 0:
                    flag[0] = 1 if cuda.atomic.add(counter, 1 + grp, 1) == n_in - 1 else 0
                cuda.syncthreads()
                # One loop over the levels, so that the summing code is inlined once
                # (a second copy took the kernels from 48 to 122 registers a thread).
                level = 0 if NG > 1 else 1
                while level < 2 and flag[0] == 1:
                    base, n = (first, n_in) if level == 0 else ((P, NG) if NG > 1 else (0, P))
                    # With C < ROW_THREADS thread t adds the partials of rows base + t // C,
                    # base + t // C + R, ... of channel t % C, then the R sums of a channel
                    # are added in order; otherwise thread t adds all rows of its channels.
                    if C < ROW_THREADS:
                        R2 = ROW_THREADS // C
                        u0, u1 = ZERO, ZERO
                        if t < R2 * C:
                            u0, u1 = column_sums(out0, out1, base, t // C, n, R2, C, t % C)
                        t0, t1 = channel_sums(s0, s1, t, u0, u1, R2, C)
                        c_first, c_end, c_step = t, (t + 1 if t < C else t), 1
                    else:
                        c_first, c_end, c_step = t, C, ROW_THREADS
                    for c in range(c_first, c_end, c_step):
                        if C >= ROW_THREADS:
                            t0, t1 = column_sums(out0, out1, base, 0, n, 1, C, c)
                        if level == 0:
                            out0[(P + grp) * C + c] = t0
                            out1[(P + grp) * C + c] = t1
                        else:
                            finish(kind, c, t0, t1, z, mean, inv_std, sums, count, epsilon, momentum, var_scale, C,
                                   acc0, acc1, accumulate)
                    if level == 0:
                        if t == 0:
                            counter[1 + grp] = 0
                        cuda.threadfence()  # the group's sums before its ticket
                        cuda.syncthreads()
                        if t == 0:
                            flag[0] = 1 if cuda.atomic.add(counter, 0, 1) == NG - 1 else 0
                        cuda.syncthreads()
                    elif t == 0:
                        counter[0] = 0
                        counter[1 + grp] = 0
                    level += 1
        return rows

    rows = {k: make_rows(k) for k in (SUM_STATS, SUM_GRADS, WRITE_DZ, WRITE_Y)}

    @cuda.jit(device=True, inline=True)
    def warp_sums(p0, p1, P, G, s0, s1):
        # The totals of both partial arrays for the block's group g (phase two of every
        # reduction), by one warp: a strided sum per lane, then the tree.
        g = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        a0, a1 = ZERO, ZERO
        for p in range(lane, P, WARP):
            a0 += p0[p * G + g]
            a1 += p1[p * G + g]
        s0[lane] = a0
        s1[lane] = a1
        cuda.syncthreads()
        fold_rows(s0, s1, lane, WARP, 1)
        return s0[0], s1[0]

    @cuda.jit
    def partials_final(p0, p1, P, G, sums):
        """Phase two of both reductions: grid G blocks of one warp; partials are (P, G);
        sums[g] and sums[G + g] receive the two totals of group g."""
        s0 = cuda.shared.array(WARP, dtype=np.float32)
        s1 = cuda.shared.array(WARP, dtype=np.float32)
        t0, t1 = warp_sums(p0, p1, P, G, s0, s1)
        if cuda.threadIdx.x == 0:
            g = cuda.blockIdx.x
            sums[g] = t0
            sums[G + g] = t1

    @cuda.jit(device=True, inline=True)
    def segment_terms(kind, z, d_y, i, c, g, S, mean, inv_std, gamma, beta):
        # Per sample: statistics shifted by the sample's first value; gradients are
        # g = d_a * gamma and g * x_hat.
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
            fold_rows(s0, s1, t, SEG_THREADS, 1)
            if t == 0:
                out0[q * cuda.gridDim.x + n] = s0[0]
                out1[q * cuda.gridDim.x + n] = s1[0]
        return segment_partials

    segment_partials = {k: make_segment_partials(k) for k in (SUM_STATS, SUM_GRADS)}

    @cuda.jit
    def stats_final(p0, p1, P, G, z, S, count, epsilon, mean, inv_std):
        """Phase two of layer norm's statistics (one warp per sample g): the shifted
        totals t0 = sum(z - shift), t1 = sum((z - shift)^2), shift = the sample's first
        value, give mean and inv_std."""
        s0 = cuda.shared.array(WARP, dtype=np.float32)
        s1 = cuda.shared.array(WARP, dtype=np.float32)
        t0, t1 = warp_sums(p0, p1, P, G, s0, s1)
        if cuda.threadIdx.x == 0:
            g = cuda.blockIdx.x
            shift = load(z, g * S)
            m1 = t0 / count
            var = max(t1 / count - m1 * m1, ZERO)
            mean[g] = shift + m1
            inv_std[g] = ONE / math.sqrt(var + epsilon)

    @cuda.jit
    def running_stats(running_mean, running_var, epsilon, mean, inv_std):
        """Batch norm outside training: mean = running_mean, inv_std = 1/sqrt(running_var + eps)."""
        c = cuda.grid(1)
        if c < mean.size:
            mean[c] = running_mean[c]
            inv_std[c] = ONE / math.sqrt(running_var[c] + epsilon)

    @cuda.jit
    def direct_evaluate(x, w, b, has_bias, running_mean, running_var, epsilon, gamma, beta, y, H, W, C, OH, OW,
                        OC, KH, KW, SH, SW, PH, PW):
        """evaluate (no norm, or batch norm with the running statistics) in one launch, for
        small inputs where cuDNN's execute and three launches cost more than the math:
        one thread an output value sums conv(x, w) directly (kh, kw, then channels, in
        order) and adds the bias, rounds the sum as the pre-activations are stored, then
        normalises and applies the activation as rows[WRITE_Y] does. x (N, H, W, C), w
        (OC, KH, KW, C), y (N, OH, OW, OC), flat."""
        for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
            oc = i % OC
            r = i // OC
            ow = r % OW
            r //= OW
            oh = r % OH
            n = r // OH
            acc = ZERO
            for kh in range(KH):
                ih = oh * SH - PH + kh
                if ih >= 0 and ih < H:
                    for kw in range(KW):
                        iw = ow * SW - PW + kw
                        if iw >= 0 and iw < W:
                            xb = ((n * H + ih) * W + iw) * C
                            wb = ((oc * KH + kh) * KW + kw) * C
                            for c in range(C):
                                acc += load(x, xb + c) * load(w, wb + c)
            if has_bias:
                acc += load(b, oc)
            _, z = encode(acc)
            if mode == NORM_BATCH:
                a, _ = act_scalar(z, running_mean[oc], ONE / math.sqrt(running_var[oc] + epsilon), gamma[oc],
                                  beta[oc])
            else:
                a = z
            store(y, i, act_f(a))

    @cuda.jit
    def accumulate_stored(grad, new, total):
        """grad += new, both in the storage format (the sum is rounded once, in float32)."""
        for i in range(cuda.grid(1), total, cuda.gridsize(1)):
            store(grad, i, load(grad, i) + load(new, i))

    return KernelSet(rows, segment_partials, partials_final, stats_final, running_stats, accumulate_stored,
                     direct_evaluate)


def small_grid(total: int) -> tuple[int, int]:
    """One thread per value for per-channel or per-sample work."""
    return (max(1, -(-total // WARP)), WARP)


def elementwise_grid(total: int) -> tuple[int, int]:
    return (max(1, min(ELEMENTWISE_MAX_BLOCKS, -(-total // ELEMENTWISE_THREADS))), ELEMENTWISE_THREADS)

