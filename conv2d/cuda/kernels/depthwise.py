"""Depthwise convolutions (groups == in_channels) as numba kernels, beside cuDNN's: the
three convolutions of a depthwise layer (reference: conv.conv_forward, conv_backward_data,
conv_backward_filter with groups = C), for `depthwise_kernel="numba"`
(conv2d/cuda/depthwise.py). These are the simple kernels, one thread a value, every sum
in a fixed order (no atomics): bitwise deterministic, whatever the batch.

x (N, H, W, C), w (OC, KH, KW, 1) with OC = C * M (the channel multiplier M: output
channel oc reads input channel oc // M), y and d_z (N, OH, OW, OC); flat, NHWC, in the
storage format; sums in float32.

The fast kernels take a layer's geometry (`window_geometry`'s sizes and M, without N) as
compile-time constants, one compilation a geometry: the simple kernels divide 64-bit
indices by runtime sizes (four divisions a value to place it, and four a tap in the
input gradient's gather), and a 64-bit division by a runtime value is a long
instruction sequence on the GPU where one by a constant is a multiply and shifts.
- `fast_depthwise_kernels`: the forward and the input gradient, one thread a value as
  the simple ones, the same sums in the same order: bitwise theirs.
- `weight_partials_by_channel`: the fast phase one of the weight gradient, one thread an
  output channel, its KH*KW sums kept in registers, d_z loaded once a row where the
  simple kernel (one thread a tap and channel) loads it KH*KW times. It adds the same
  products in the same order (rows p, p + P, ... for each tap), so its partials are
  bitwise the simple kernel's.
tests/test_cuda_kernels.py checks both bitwise against the simple kernels.
"""

from __future__ import annotations

import functools

import numpy as np

from conv2d.cuda.kernels.activation import ZERO
from conv2d.cuda.kernels.bits import storage_io
from conv2d.cuda.kernels.layout import nhwc_position
from conv2d.cuda.runtime import numba_cuda

cuda = numba_cuda()


@functools.lru_cache(maxsize=None)
def _value_functions(storage: str, shared_weights: bool = False) -> tuple:
    """(output_value, input_gradient_value): the one-thread-a-value sums that the simple
    kernels run with the sizes as arguments and the fast ones with them as constants (the
    same code, inlined, so the same sums). The weights are w (OC, KH, KW, 1) in the
    storage format, or with `shared_weights` the fast kernels' float32 copy in shared
    memory, tap-major (w_t[tap * OC + oc]): a warp's consecutive channels then read
    consecutive words, where in w they are KH*KW values apart (a memory transaction a
    few channels). The same values either way: loading converts to float32 exactly."""
    load = storage_io(storage).load

    # Indices go to the loads as uint64: a signed index costs a negative-index wraparound
    # at every load (three 64-bit instructions), and these are never negative.
    if shared_weights:
        @cuda.jit(device=True, inline=True)
        def weight(w, oc, tap, OC, TAPS):
            return w[np.uint64(tap * OC + oc)]
    else:
        @cuda.jit(device=True, inline=True)
        def weight(w, oc, tap, OC, TAPS):
            return load(w, np.uint64(oc * TAPS + tap))

    @cuda.jit(device=True, inline=True)
    def output_value(x, w, b, has_bias, relu, i, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M):
        # y[i] = conv(x, w) (+ b) (then ReLU with `relu`), taps in order (kh, then kw).
        # A tap's x index is the window corner's plus a constant of the tap (the corner
        # itself may lie in the padding).
        n, oh, ow, oc = nhwc_position(i, OH, OW, OC)
        ih0 = oh * SH - PH
        iw0 = ow * SW - PW
        corner = ((n * H + ih0) * W + iw0) * C + oc // M
        acc = ZERO
        for kh in range(KH):
            ih = ih0 + kh * DH
            if ih >= 0 and ih < H:
                for kw in range(KW):
                    iw = iw0 + kw * DW
                    if iw >= 0 and iw < W:
                        acc += (load(x, np.uint64(corner + (kh * DH * W + kw * DW) * C))
                                * weight(w, oc, kh * KW + kw, OC, KH * KW))
        if has_bias:
            acc += load(b, oc)
        if relu and acc < ZERO:
            acc = ZERO
        return acc

    @cuda.jit(device=True, inline=True)
    def input_gradient_value(d_z, w, i, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M):
        # d_x[i] = the sum over the M output channels of its channel and the taps whose
        # window covers it of d_z * w: a gather (no atomics), in order (m, kh, kw).
        n, ih, iw, c = nhwc_position(i, H, W, C)
        acc = ZERO
        for m in range(M):
            oc = c * M + m
            for kh in range(KH):
                th = ih + PH - kh * DH
                if th >= 0 and th % SH == 0 and th // SH < OH:
                    row = (n * OH + th // SH) * OW
                    for kw in range(KW):
                        tw = iw + PW - kw * DW
                        if tw >= 0 and tw % SW == 0 and tw // SW < OW:
                            acc += (load(d_z, np.uint64((row + tw // SW) * OC + oc))
                                    * weight(w, oc, kh * KW + kw, OC, KH * KW))
        return acc

    return output_value, input_gradient_value


@functools.lru_cache(maxsize=None)
def depthwise_kernels(storage: str) -> tuple:
    """(forward, backward_data, backward_filter_partials, backward_filter_sum) for
    storage format `storage`: the simple kernels, the sizes as arguments."""
    io = storage_io(storage)
    load, store = io.load, io.store
    output_value, input_gradient_value = _value_functions(storage)

    @cuda.jit
    def forward(x, w, b, has_bias, relu, y, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M):
        """y = conv(x, w) (+ b) (then ReLU with `relu`): one thread an output value."""
        for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
            store(y, i, output_value(x, w, b, has_bias, relu, i, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH,
                                     DW, M))

    @cuda.jit
    def backward_data(d_z, w, d_x, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M):
        """d_x = the transpose of the forward applied to d_z: one thread an input value."""
        for i in range(cuda.grid(1), d_x.size, cuda.gridsize(1)):
            store(d_x, i, input_gradient_value(d_z, w, i, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M))

    @cuda.jit
    def backward_filter_partials(x, d_z, partials, ROWS, P, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW,
                                 M):
        """Phase one of d_w[oc, kh, kw] = sum over (n, oh, ow) of d_z * x: block p sums
        the rows (n, oh, ow) p, p + P, p + 2P, ... in order into partials[p, j], j = tap *
        OC + oc (consecutive threads, consecutive channels)."""
        p = cuda.blockIdx.x
        for j in range(cuda.threadIdx.x, OC * KH * KW, cuda.blockDim.x):
            oc = j % OC
            tap = j // OC
            kh = tap // KW
            kw = tap % KW
            c = oc // M
            acc = ZERO
            for row in range(p, ROWS, P):
                ow = row % OW
                r = row // OW
                oh = r % OH
                n = r // OH
                ih = oh * SH - PH + kh * DH
                iw = ow * SW - PW + kw * DW
                if ih >= 0 and ih < H and iw >= 0 and iw < W:
                    acc += load(d_z, row * OC + oc) * load(x, ((n * H + ih) * W + iw) * C + c)
            partials[p * OC * KH * KW + j] = acc

    @cuda.jit
    def backward_filter_sum(partials, P, d_w, OC, KH, KW):
        """Phase two: d_w[oc, kh, kw] = the partials of its j summed over p in order,
        stored once."""
        for j in range(cuda.grid(1), OC * KH * KW, cuda.gridsize(1)):
            acc = ZERO
            for p in range(P):
                acc += partials[p * OC * KH * KW + j]
            oc = j % OC
            tap = j // OC
            store(d_w, oc * KH * KW + tap, acc)

    return forward, backward_data, backward_filter_partials, backward_filter_sum


GEOMETRY = ("H", "W", "C", "OH", "OW", "OC", "KH", "KW", "SH", "SW", "PH", "PW", "DH", "DW", "M")


def geometry_key(geometry: dict) -> tuple:
    """The fast kernels' cache key of a layer's sizes (window_geometry's and M)."""
    return tuple(int(geometry[k]) for k in GEOMETRY)


@functools.lru_cache(maxsize=None)
def fast_depthwise_kernels(storage: str, geometry: tuple) -> tuple:
    """(forward, backward_data, backward_filter_sum) with `geometry` (geometry_key's
    tuple) compile-time constants; the simple kernels' arguments but the sizes."""
    io = storage_io(storage)
    load, store = io.load, io.store
    H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M = geometry
    TAPS = KH * KW
    WEIGHTS = OC * TAPS
    shared = WEIGHTS <= SHARED_WEIGHTS
    output_value, input_gradient_value = _value_functions(storage, shared)

    # Each block's float32 copy of w, tap-major (see _value_functions), or w itself where
    # it does not fit.
    if shared:
        @cuda.jit(device=True, inline=True)
        def block_weights(w):
            w_t = cuda.shared.array(WEIGHTS, dtype=np.float32)
            for j in range(cuda.threadIdx.x, WEIGHTS, cuda.blockDim.x):
                w_t[j] = load(w, (j % OC) * TAPS + j // OC)
            cuda.syncthreads()
            return w_t
    else:
        @cuda.jit(device=True, inline=True)
        def block_weights(w):
            return w

    @cuda.jit
    def forward(x, w, b, has_bias, relu, y):
        w_t = block_weights(w)
        for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
            store(y, i, output_value(x, w_t, b, has_bias, relu, i, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH,
                                     DW, M))

    @cuda.jit
    def backward_data(d_z, w, d_x):
        w_t = block_weights(w)
        for i in range(cuda.grid(1), d_x.size, cuda.gridsize(1)):
            store(d_x, i, input_gradient_value(d_z, w_t, i, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M))

    @cuda.jit
    def backward_filter_sum(partials, P, d_w):
        """The simple phase two (d_w[oc, kh, kw] = its partials summed over p in order),
        the partials loaded SUM_AHEAD at a time before they are added in order: a
        thread's loads wait on each other's latency once a group, not once a partial."""
        TAPS = OC * KH * KW
        ahead = cuda.local.array(SUM_AHEAD, dtype=np.float32)
        for j in range(cuda.grid(1), TAPS, cuda.gridsize(1)):
            acc = ZERO
            p = 0
            while p + SUM_AHEAD <= P:
                for q in range(SUM_AHEAD):
                    ahead[q] = partials[(p + q) * TAPS + j]
                for q in range(SUM_AHEAD):
                    acc += ahead[q]
                p += SUM_AHEAD
            while p < P:
                acc += partials[p * TAPS + j]
                p += 1
            oc = j % OC
            tap = j // OC
            store(d_w, oc * KH * KW + tap, acc)

    return forward, backward_data, backward_filter_sum


# Partials the fast phase two loads before adding them (in order).
SUM_AHEAD = 8
# The most weights (OC * KH * KW float32 values, 16 KiB) the fast forward and input
# gradient copy into each block's shared memory; a layer with more reads them from w.
SHARED_WEIGHTS = 4096


@functools.lru_cache(maxsize=None)
def weight_partials_by_channel(storage: str, geometry: tuple) -> object:
    """The fast phase one of d_w (see the module docstring) with `geometry` (geometry_key's
    tuple) compile-time constants: block p, thread oc (every blockDim-th channel) sums the
    rows (n, oh, ow) p, p + P, ... in order into its KH*KW taps, written to partials[p,
    tap * OC + oc] as the simple kernel's."""
    load = storage_io(storage).load
    H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M = geometry
    TAPS = KH * KW

    @cuda.jit
    def weight_partials(x, d_z, partials, ROWS, P):
        p = cuda.blockIdx.x
        acc = cuda.local.array(TAPS, dtype=np.float32)
        for oc in range(cuda.threadIdx.x, OC, cuda.blockDim.x):
            c = oc // M
            for j in range(TAPS):
                acc[j] = ZERO
            for row in range(p, ROWS, P):
                ow = row % OW
                r = row // OW
                oh = r % OH
                n = r // OH
                g = load(d_z, np.uint64(row * OC + oc))
                ih0 = oh * SH - PH
                iw0 = ow * SW - PW
                corner = ((n * H + ih0) * W + iw0) * C + c  # as in output_value
                for kh in range(KH):
                    ih = ih0 + kh * DH
                    for kw in range(KW):
                        iw = iw0 + kw * DW
                        if ih >= 0 and ih < H and iw >= 0 and iw < W:
                            acc[kh * KW + kw] += g * load(x, np.uint64(corner + (kh * DH * W + kw * DW) * C))
            for j in range(TAPS):
                partials[p * OC * TAPS + j * OC + oc] = acc[j]
    return weight_partials
