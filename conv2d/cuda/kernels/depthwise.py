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
- `fast_depthwise_kernels`: the forward and the input gradient, the same sums in the
  same order as the simple ones: bitwise theirs. Where x's and y's indices fit 31 bits
  (`small`), a thread computes a strip of STRIP values along the width, its index
  arithmetic in 32 bits, the weights and each input column loaded once a strip
  (`_strip_kernels`; the input gradient at strides that divide STRIP, else one thread a
  value). SASS for sm_90 of the MobileNetV2 shape (ptxas and nvdisasm over numba's PTX;
  instructions and global loads an output in the innermost loop): forward 187 and 9 one
  value a thread, 63 and 5.5 a strip (bfloat16 81 and 5.5); input gradient 178 and 9,
  48 and 4.5 a strip (bfloat16 58 and 4.5); at stride 2 (MobileNetV2's 112x112x96 layer)
  317 and 9 one value a thread, 63 and 2.3 a strip. On an H100 at 9e2e185
  (scripts/breakdown_cuda.py, N=128, 56x56x144), float32: forward 612 -> 243 us, input
  gradient 521 -> 241. A variant over 8 bytes of channels a thread (2 float32, 4
  bfloat16; fewer instructions and loads still: 67 and 3.3 for the float32 forward) was
  slower there (forward 298 us in float32, 229 against 207 in bfloat16; input gradient
  211 against 190 in bfloat16) and was removed.
- `weight_partials_by_channel`: the fast phase one of the weight gradient, one thread an
  output channel, its KH*KW sums kept in registers, d_z loaded once a row where the
  simple kernel (one thread a tap and channel) loads it KH*KW times, and x once a strip
  where one row a step loads it KH*KW times a row (where the indices fit 31 bits; else
  the simple kernel runs). It adds the same products in the same order (the strips of
  STRIP rows along the width p, p + P, ..., each strip's rows in order, for each tap),
  so its partials are bitwise the simple kernel's (SASS as above: 45 instructions and
  5.5 loads a row and channel against 134 and 10 one row a step; on the H100 as above
  561 -> 214 us).
tests/test_cuda_kernels.py checks both bitwise against the simple kernels.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

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
    def backward_filter_partials(x, d_z, partials, STRIPS, P, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW,
                                 M):
        """Phase one of d_w[oc, kh, kw] = sum over (n, oh, ow) of d_z * x: block p sums
        the strips p, p + P, p + 2P, ... (a strip: the rows (n, oh, ow0 .. ow0 + STRIP -
        1), ow0 a multiple of STRIP, those below OW), each strip's rows in order, into
        partials[p, j], j = tap * OC + oc (consecutive threads, consecutive channels)."""
        p = cuda.blockIdx.x
        OWS = (OW + STRIP - 1) // STRIP
        for j in range(cuda.threadIdx.x, OC * KH * KW, cuda.blockDim.x):
            oc = j % OC
            tap = j // OC
            kh = tap // KW
            kw = tap % KW
            c = oc // M
            acc = ZERO
            for strip in range(p, STRIPS, P):
                r = strip // OWS
                oh = r % OH
                n = r // OH
                for k in range(STRIP):
                    ow = strip % OWS * STRIP + k
                    ih = oh * SH - PH + kh * DH
                    iw = ow * SW - PW + kw * DW
                    if ow < OW and ih >= 0 and ih < H and iw >= 0 and iw < W:
                        acc += load(d_z, ((n * OH + oh) * OW + ow) * OC + oc) * load(x, ((n * H + ih) * W + iw) * C + c)
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


class FastDepthwise(NamedTuple):
    """`fast_depthwise_kernels`' kernels, and the outputs along W a thread of each of the
    first two computes (1: one thread a value; see `strip_items`)."""

    forward: Any
    backward_data: Any
    backward_filter_sum: Any
    forward_strip: int
    backward_strip: int


def strip_items(size: int, width: int, strip: int) -> int:
    """Threads of a kernel that computes `strip` consecutive values along the width
    `width` of an NHWC array of `size` values a thread: ceil(width / strip) a row."""
    return size // width * -(-width // strip)


@functools.lru_cache(maxsize=None)
def fast_depthwise_kernels(storage: str, geometry: tuple, small: bool = False) -> FastDepthwise:
    """The fast forward, backward_data and backward_filter_sum with `geometry`
    (geometry_key's tuple) compile-time constants; the simple kernels' arguments but the
    sizes. `small`: every index of x and y fits 31 bits, so that the index arithmetic
    runs in 32 bits (a 64-bit division by a constant is several instructions more), and
    the forward (and, at stride 1, the input gradient) computes a strip of STRIP values
    along the width a thread (`_strip_kernels`)."""
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

    if not small:
        return FastDepthwise(forward, backward_data, backward_filter_sum, 1, 1)
    strip_forward, strip_backward = _strip_kernels(storage, geometry, shared, block_weights)
    if strip_backward is None:
        return FastDepthwise(strip_forward, backward_data, backward_filter_sum, STRIP, 1)
    return FastDepthwise(strip_forward, strip_backward, backward_filter_sum, STRIP, STRIP)


def _strip_kernels(storage: str, geometry: tuple, shared: bool, block_weights: Any) -> tuple:
    """(forward, backward_data or None) computing STRIP consecutive values along the
    width a thread, for indices that fit 31 bits (int32 arithmetic). Each value adds
    the simple kernels' products in their order, so the same bits: the forward's value
    (n, oh, ow0 + r, oc) its taps in order (kh, kw), skipping those in the padding; a
    thread loads each input column of a window row once (j = r * SW + kw * DW: for one r,
    kw rises with j) and the weights once. The input gradient: `_strip_input_gradient`,
    where STRIP is a multiple of the width's stride (else None: the one-value kernel
    runs)."""
    io = storage_io(storage)
    load, store = io.load, io.store
    H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M = geometry
    TAPS = KH * KW
    R = STRIP
    SPAN = (R - 1) * SW + (KW - 1) * DW + 1  # input columns a strip's window rows cover
    # Index arithmetic in uint32: numba keeps uint32 with uint32 in 32 bits (int32 it
    # widens to 64). Positions that may lie in the padding are kept shifted by it (never
    # below zero: no wraparound, which numba's simulator would refuse).
    U = np.uint32
    H_, W_, C_, OH_, OW_, OC_, M_ = (U(v) for v in (H, W, C, OH, OW, OC, M))
    SH_, SW_, PH_, PW_, R_ = (U(v) for v in (SH, SW, PH, PW, R))
    OWS_ = U(-(-OW // R))  # strips a row of y

    if shared:
        @cuda.jit(device=True, inline=True)
        def tap_weight(w_t, oc, tap):
            return w_t[U(tap * OC) + oc]
    else:
        @cuda.jit(device=True, inline=True)
        def tap_weight(w_t, oc, tap):
            return load(w_t, oc * U(TAPS) + U(tap))

    @cuda.jit
    def forward(x, w, b, has_bias, relu, y):
        w_t = block_weights(w)
        acc = cuda.local.array(R, dtype=np.float32)
        wk = cuda.local.array(TAPS, dtype=np.float32)
        total = y.size // (OW * OC) * (-(-OW // R)) * OC
        for t in range(cuda.grid(1), total, cuda.gridsize(1)):
            # Work items (N, OH, strips, OC), channels fastest: a warp reads neighbouring ones.
            n, oh, strip, oc = nhwc_position(U(t), OH_, OWS_, OC_)
            ow0 = strip * R_
            ih0 = oh * SH_  # + PH: the window's first row, shifted by the padding
            iw0 = ow0 * SW_
            c = oc // M_
            for tap in range(TAPS):
                wk[tap] = tap_weight(w_t, oc, tap)
            for r in range(R):
                acc[r] = ZERO
            for kh in range(KH):
                ih = ih0 + U(kh * DH)
                if ih >= PH_ and ih < H_ + PH_:
                    row = (n * H_ + ih - PH_) * W_
                    for j in range(SPAN):
                        iw = iw0 + U(j)
                        if iw >= PW_ and iw < W_ + PW_:
                            v = load(x, (row + iw - PW_) * C_ + c)
                            for kw in range(KW):
                                rem = j - kw * DW
                                if rem >= 0 and rem % SW == 0 and rem // SW < R:
                                    if ow0 + U(rem // SW) < OW_:
                                        acc[rem // SW] += v * wk[kh * KW + kw]
            out = (n * OH_ + oh) * OW_ + ow0
            for r in range(R):
                if ow0 + U(r) < OW_:
                    v = acc[r]
                    if has_bias:
                        v += load(b, oc)
                    if relu and v < ZERO:
                        v = ZERO
                    store(y, (out + U(r)) * OC_ + oc, v)

    return forward, (_strip_input_gradient(storage, geometry, block_weights, tap_weight) if R % SW == 0 else None)


def _strip_input_gradient(storage: str, geometry: tuple, block_weights: Any, tap_weight: Any) -> Any:
    """`_strip_kernels`' input gradient (STRIP a multiple of SW): a thread's STRIP values
    of d_x along the width, each the simple kernel's gather in its order (m, kh, kw),
    over the taps whose window position is a multiple of the stride. It goes through d_z's
    columns q = r - kw * DW downwards, so that for one r kw rises. With iw0 a multiple of
    SW, whether a column q of the strip is on the stride is a constant of q; a row's is
    tested at run time (at stride 1 both fold away)."""
    io = storage_io(storage)
    load, store = io.load, io.store
    H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M = geometry
    TAPS = KH * KW
    R = STRIP
    U = np.uint32
    H_, W_, C_, OH_, OW_, OC_, M_ = (U(v) for v in (H, W, C, OH, OW, OC, M))
    SH_, SW_, R_ = U(SH), U(SW), U(R)
    WS_ = U(-(-W // R))
    LOW = -(KW - 1) * DW  # the lowest q = r - kw * DW
    ROWS_ABOVE_ = U((KH - 1) * DH)
    # A column's offset (PW + q) // SW from iw0 // SW, shifted to be never below zero.
    SHIFT = max(0, -((PW + LOW) // SW))
    SHIFT_ = U(SHIFT)

    @cuda.jit
    def backward_data(d_z, w, d_x):
        w_t = block_weights(w)
        acc = cuda.local.array(R, dtype=np.float32)
        wk = cuda.local.array(TAPS, dtype=np.float32)
        total = d_x.size // (W * C) * (-(-W // R)) * C
        for t in range(cuda.grid(1), total, cuda.gridsize(1)):
            n, ih, strip, c = nhwc_position(U(t), H_, WS_, C_)
            iw0 = strip * R_
            for r in range(R):
                acc[r] = ZERO
            for m in range(M):
                oc = c * M_ + U(m)
                for tap in range(TAPS):
                    wk[tap] = tap_weight(w_t, oc, tap)
                for kh in range(KH):
                    thp = ih + U(PH + (KH - 1) * DH - kh * DH)  # the row's numerator + ROWS_ABOVE
                    if thp >= ROWS_ABOVE_ and (thp - ROWS_ABOVE_) % SH_ == 0:
                        th = (thp - ROWS_ABOVE_) // SH_
                        if th < OH_:
                            row = (n * OH_ + th) * OW_
                            for k in range(R - LOW):
                                q = R - 1 - k  # from R - 1 down to LOW
                                if (PW + q) % SW == 0:  # on the stride (iw0 is a multiple of SW)
                                    col = iw0 // SW_ + U((PW + q) // SW + SHIFT)
                                    if col >= SHIFT_ and col < OW_ + SHIFT_:
                                        v = load(d_z, (row + col - SHIFT_) * OC_ + oc)
                                        for kw in range(KW):
                                            r = q + kw * DW
                                            if r >= 0 and r < R:
                                                if iw0 + U(r) < W_:
                                                    acc[r] += v * wk[kh * KW + kw]
            out = (n * H_ + ih) * W_ + iw0
            for r in range(R):
                if iw0 + U(r) < W_:
                    store(d_x, (out + U(r)) * C_ + c, acc[r])
    return backward_data


# Values along the width a thread of the fast forward and input gradient computes (where
# the indices fit 31 bits).
STRIP = 4
# The largest index (of x's or y's values) the 32-bit strip kernels take.
SMALL_INDEX = 2**31 - 1


# Partials the fast phase two loads before adding them (in order).
SUM_AHEAD = 8
# The most weights (OC * KH * KW float32 values, 16 KiB) the fast forward and input
# gradient copy into each block's shared memory; a layer with more reads them from w.
SHARED_WEIGHTS = 4096


@functools.lru_cache(maxsize=None)
def weight_partials_by_channel(storage: str, geometry: tuple) -> object:
    """The fast phase one of d_w (see the module docstring) with `geometry` (geometry_key's
    tuple) compile-time constants, for indices of x and d_z that fit 31 bits (uint32
    arithmetic, as `_strip_kernels`): block p, thread oc (every blockDim-th channel) sums
    the strips p, p + P, ... (the simple kernel's) into its KH*KW taps, written to
    partials[p, tap * OC + oc] as the simple kernel's. A strip's STRIP values of d_z are
    loaded first, then each input column of a window row once for every tap and row of
    the strip that reads it (j = r * SW + kw * DW: for one tap, the rows come in order),
    where one row a step loads x KH*KW times a row."""
    load = storage_io(storage).load
    H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, M = geometry
    TAPS = KH * KW
    R = STRIP
    SPAN = (R - 1) * SW + (KW - 1) * DW + 1
    U = np.uint32
    H_, W_, C_, OH_, OW_, OC_, M_ = (U(v) for v in (H, W, C, OH, OW, OC, M))
    SH_, SW_, PH_, PW_, R_ = (U(v) for v in (SH, SW, PH, PW, R))
    OWS_ = U(-(-OW // R))

    @cuda.jit
    def weight_partials(x, d_z, partials, STRIPS, P):
        p = cuda.blockIdx.x
        acc = cuda.local.array(TAPS, dtype=np.float32)
        g = cuda.local.array(R, dtype=np.float32)
        for oc in range(cuda.threadIdx.x, OC, cuda.blockDim.x):
            ocu = U(oc)
            c = ocu // M_
            for j in range(TAPS):
                acc[j] = ZERO
            for strip in range(p, STRIPS, P):
                u = U(strip)
                ow0 = u % OWS_ * R_
                s = u // OWS_
                oh = s % OH_
                n = s // OH_
                out = (n * OH_ + oh) * OW_ + ow0
                for k in range(R):
                    if ow0 + U(k) < OW_:
                        g[k] = load(d_z, (out + U(k)) * OC_ + ocu)
                ih0 = oh * SH_  # + PH: shifted by the padding, never below zero
                iw0 = ow0 * SW_  # + PW
                for kh in range(KH):
                    ih = ih0 + U(kh * DH)
                    if ih >= PH_ and ih < H_ + PH_:
                        row = (n * H_ + ih - PH_) * W_
                        for j in range(SPAN):
                            iw = iw0 + U(j)
                            if iw >= PW_ and iw < W_ + PW_:
                                v = load(x, (row + iw - PW_) * C_ + c)
                                for kw in range(KW):
                                    rem = j - kw * DW
                                    if rem >= 0 and rem % SW == 0 and rem // SW < R:
                                        if ow0 + U(rem // SW) < OW_:
                                            acc[kh * KW + kw] += g[rem // SW] * v
            for j in range(TAPS):
                partials[p * OC * TAPS + j * OC + oc] = acc[j]
    return weight_partials
