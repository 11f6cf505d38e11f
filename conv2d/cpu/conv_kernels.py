"""The CPU backend's compiled convolution loops (numba's CPU compiler, `@njit`): a small dense
convolution's im2col, the dense convolutions' input gradient (col2im) and the depthwise
convolutions, which are memory-bound loops, one product of a few taps an output, where a
matrix product a channel would cost more in Python than in arithmetic. Threads and
determinism as conv2d.cpu.kernels says: each kernel a loop over its tasks (`run_tasks`),
sums in a fixed order whatever the threads.

Arrays NHWC and C-contiguous in one float dtype (the compute dtype); depthwise taps
(KH, KW, OC); padded inputs `xp` (N, Hp, Wp, C).
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

from conv2d.cpu.kernels import in_order, run_tasks


# Dense convolutions' im2col ----------------------------------------------------------------
# Flat offsets into C-contiguous arrays as unsigned integers: numba checks a signed index
# for a negative value (counted from the end) on every access, which kept these copy and
# add loops scalar; an unsigned one it cannot be. The offsets are never negative here (a
# position outside x is tested before its offset is made). 1.1-1.5x faster than the loops
# over slices these replaced (im2col and add_windows on the IMPALA-CNN, Nature-DQN and
# MobileNetV2-like shapes, same bits).
@njit(inline="always", cache=True)
def _flat(i):
    return uint64(i)


@njit(nogil=True, cache=True)
def im2col(x, top, left, sh, sw, dh, dw, kh, kw, oh, ow, cols):
    """cols (N*OH*OW, KH*KW*C) = the (OH, OW) windows of x (N, H, W, C) zero-padded by `top`
    rows and `left` columns (and as many at the end as the windows reach), stride (sh, sw),
    dilation (dh, dw), row (n, oh, ow), column (kh, kw, c): conv2d.cpu.conv's padded
    windows reshaped, without the padded copy. x and cols C-contiguous, indexed flat
    with unsigned offsets (see _flat). A window row's kw taps, where they lie inside x,
    are one contiguous span copied as one. Scalars, not tuples: numba's dispatch of
    nested tuples costs ~0.3 us a call more."""
    n, h, w, c = x.shape
    span = kw * c
    width = kh * span
    xf, cf = x.reshape(-1), cols.reshape(-1)
    r = 0
    for i in range(n):
        for a in range(oh):
            for b in range(ow):
                x0 = b * sw - left
                whole = dw == 1 and x0 >= 0 and x0 + kw <= w  # the row's kw taps one contiguous span of x
                for p in range(kh):
                    yy = a * sh - top + p * dh
                    o = _flat(r * width + p * span)
                    if yy < 0 or yy >= h:
                        for k in range(_flat(span)):
                            cf[o + k] = 0
                    elif whole:
                        s0 = _flat(((i * h + yy) * w + x0) * c)
                        for k in range(_flat(span)):
                            cf[o + k] = xf[s0 + k]
                    else:
                        for q in range(kw):
                            xx = x0 + q * dw
                            oq = o + _flat(q * c)
                            if 0 <= xx < w:
                                sq = _flat(((i * h + yy) * w + xx) * c)
                                for ch in range(_flat(c)):
                                    cf[oq + ch] = xf[sq + ch]
                            else:
                                for ch in range(_flat(c)):
                                    cf[oq + ch] = 0
                r += 1


# Dense convolutions' input gradient --------------------------------------------------------
@njit(nogil=True, cache=True)
def add_windows(g, top, left, stride, dilation, d_x):
    """d_x (N, H, W, C) += each output position's taps g (N, OH, OW, KH, KW, C), the taps
    that land in x (padded by `top` rows and `left` columns, as im2col reads it): the
    adjoint of im2col (col2im); taps on the padding are dropped (zero padding's gradient),
    and with top = left = 0 and d_x the padded gradient none are. Each sample's positions
    in order, taps in (kh, kw) order, so an element's sum has one order whatever the
    blocks or threads. g and d_x C-contiguous, indexed flat (see _flat). Without dilation
    a window row's taps inside x are one contiguous span of d_x, added as one (1.5-1.9x
    faster on IMPALA's maps than a loop a tap)."""
    n, oh, ow, kh, kw, c = g.shape
    h, w = d_x.shape[1], d_x.shape[2]
    sh, sw = stride
    dh, dw = dilation
    gf, df = g.reshape(-1), d_x.reshape(-1)
    for i in range(n):
        for r in range(oh):
            for col in range(ow):
                x0 = col * sw - left
                first, end = max(0, -x0), min(kw, w - x0)  # the taps inside x, without dilation
                position = ((i * oh + r) * ow + col) * kh
                for a in range(kh):
                    yy = r * sh - top + a * dh
                    if yy < 0 or yy >= h:
                        continue
                    taps = _flat((position + a) * kw * c)
                    out_row = _flat((i * h + yy) * w * c)
                    if dw == 1:
                        if end > first:
                            o, t = out_row + _flat((x0 + first) * c), taps + _flat(first * c)
                            for k in range(_flat((end - first) * c)):
                                df[o + k] += gf[t + k]
                    else:
                        for b in range(kw):
                            xx = x0 + b * dw
                            if 0 <= xx < w:
                                o, t = out_row + _flat(xx * c), taps + _flat(b * c)
                                for ch in range(_flat(c)):
                                    df[o + ch] += gf[t + ch]


# Depthwise convolutions (groups = C, each input channel makes `mult` output channels) -----
# Output channel o = c * mult + j reads input channel c. Sums run in the arrays' dtype
# (the compute dtype), the filter gradient's chunk sums added in float64.
DEPTHWISE_CHUNK_ROWS = 8  # output rows (of one sample) a chunk of the filter gradient


# The loops below read the input x (N, H, W, C) as if padded by `top` rows and `left`
# columns of zeros (and as many at the end as the windows reach): a position outside x
# reads a row of zeros, so its products are 0 * w as on a padded copy (the same sums and
# the same NaN from an infinite weight), without making the padded copy (with zero
# padding the copy and its zeroing took about a tenth of MobileNetV2-like's training
# step). The other padding modes pass the padded input and top = left = 0.
@njit(nogil=True, cache=True)
def _depthwise_forward(first, end, x, w, top, left, stride, dilation, y):
    n, oh, ow, oc = y.shape
    kh, kw = w.shape[0], w.shape[1]
    h, wd, c = x.shape[1], x.shape[2], x.shape[3]
    mult = oc // c
    sh, sw = stride
    dh, dw = dilation
    acc = np.empty(oc, y.dtype)
    zeros = np.zeros(c, x.dtype)
    for t in range(first, end):
        i, r = t // oh, t % oh
        for col in range(ow):
            acc[:] = 0
            for a in range(kh):
                yy = r * sh - top + a * dh
                for b in range(kw):
                    xx = col * sw - left + b * dw
                    row = x[i, yy, xx] if 0 <= yy < h and 0 <= xx < wd else zeros
                    tap = w[a, b]
                    if mult == 1:
                        for o in range(oc):
                            acc[o] += row[o] * tap[o]
                    else:
                        for ch in range(c):
                            for j in range(mult):
                                acc[ch * mult + j] += row[ch] * tap[ch * mult + j]
            y[i, r, col] = acc


@njit(nogil=True, cache=True)
def _depthwise_forward_3x3(first, end, x, w, top, left, stride, dilation, y):
    # _depthwise_forward for a 3x3 kernel and one output channel an input channel: the
    # nine taps of a pixel's channel summed in registers in the same order (0 + tap (0,0)
    # + (0,1) + ... + (2,2), in y's dtype), so the same bits; the general loop keeps its
    # sums in an array and ran 2-3x slower on MobileNetV2's shapes.
    n, oh, ow, c = y.shape
    h, wd = x.shape[1], x.shape[2]
    sh, sw = stride
    dh, dw = dilation
    zero = np.zeros(1, y.dtype)[0]
    zeros = np.zeros(c, x.dtype)
    w00, w01, w02 = w[0, 0], w[0, 1], w[0, 2]
    w10, w11, w12 = w[1, 0], w[1, 1], w[1, 2]
    w20, w21, w22 = w[2, 0], w[2, 1], w[2, 2]
    for t in range(first, end):
        i, r = t // oh, t % oh
        y0 = r * sh - top
        y1, y2 = y0 + dh, y0 + 2 * dh
        in0, in1, in2 = 0 <= y0 < h, 0 <= y1 < h, 0 <= y2 < h
        x0, x1, x2 = x[i, y0 if in0 else 0], x[i, y1 if in1 else 0], x[i, y2 if in2 else 0]
        out_row = y[i, r]
        for col in range(ow):
            q0 = col * sw - left
            q1, q2 = q0 + dw, q0 + 2 * dw
            j0, j1, j2 = 0 <= q0 < wd, 0 <= q1 < wd, 0 <= q2 < wd
            a0 = x0[q0] if in0 and j0 else zeros
            a1 = x0[q1] if in0 and j1 else zeros
            a2 = x0[q2] if in0 and j2 else zeros
            b0 = x1[q0] if in1 and j0 else zeros
            b1 = x1[q1] if in1 and j1 else zeros
            b2 = x1[q2] if in1 and j2 else zeros
            c0 = x2[q0] if in2 and j0 else zeros
            c1 = x2[q1] if in2 and j1 else zeros
            c2 = x2[q2] if in2 and j2 else zeros
            out = out_row[col]
            for k in range(c):
                s = zero + a0[k] * w00[k]
                s += a1[k] * w01[k]
                s += a2[k] * w02[k]
                s += b0[k] * w10[k]
                s += b1[k] * w11[k]
                s += b2[k] * w12[k]
                s += c0[k] * w20[k]
                s += c1[k] * w21[k]
                s += c2[k] * w22[k]
                out[k] = s


def depthwise_forward(x, w, top, left, stride, dilation, y) -> None:
    """y[n, oh, ow, o] = sum_{kh, kw} xp[n, oh*SH + kh*DH, ow*SW + kw*DW, o // mult] * w[kh, kw, o],
    xp x (N, H, W, C) padded by `top` rows and `left` columns of zeros (see above), w (KH,
    KW, OC), y (N, OH, OW, OC), one dtype; one task an output row."""
    three = w.shape[0] == w.shape[1] == 3 and w.shape[2] == x.shape[3]
    run_tasks(_depthwise_forward_3x3 if three else _depthwise_forward, y.shape[0] * y.shape[1], x.size + y.size,
              x, w, top, left, stride, dilation, y)


@njit(nogil=True, cache=True)
def _depthwise_backward_data(first, end, d_z, w, top, left, stride, dilation, d_x):
    n, oh, ow, oc = d_z.shape
    kh, kw = w.shape[0], w.shape[1]
    h, wd, c = d_x.shape[1], d_x.shape[2], d_x.shape[3]
    mult = oc // c
    sh, sw = stride
    dh, dw = dilation
    for i in range(first, end):
        for r in range(oh):
            for col in range(ow):
                g = d_z[i, r, col]
                for a in range(kh):
                    yy = r * sh + a * dh - top
                    if yy < 0 or yy >= h:
                        continue
                    for b in range(kw):
                        xx = col * sw + b * dw - left
                        if xx < 0 or xx >= wd:
                            continue
                        out = d_x[i, yy, xx]
                        tap = w[a, b]
                        if mult == 1:
                            for o in range(oc):
                                out[o] += g[o] * tap[o]
                        else:
                            for ch in range(c):
                                for j in range(mult):
                                    out[ch] += g[ch * mult + j] * tap[ch * mult + j]


def depthwise_backward_data(d_z, w, top, left, stride, dilation, d_x) -> None:
    """d_x (N, H, W, C), zeroed, += each output position's taps that land in x (padded by
    `top` rows and `left` columns; taps on the padding dropped, zero padding's gradient;
    with top = left = 0 and the padded gradient, none are): one task a sample, its
    positions in order."""
    run_tasks(_depthwise_backward_data, d_z.shape[0], d_z.size + d_x.size, d_z, w, top, left, stride, dilation, d_x)


@njit(nogil=True, cache=True)
def _depthwise_backward_filter(first, end, x, d_z, top, left, stride, dilation, part):
    n, oh, ow, oc = d_z.shape
    kh, kw = part.shape[1], part.shape[2]
    h, wd, c = x.shape[1], x.shape[2], x.shape[3]
    mult = oc // c
    sh, sw = stride
    dh, dw = dilation
    per_sample = (oh + DEPTHWISE_CHUNK_ROWS - 1) // DEPTHWISE_CHUNK_ROWS
    acc = np.empty(oc, d_z.dtype)
    zeros = np.zeros(c, x.dtype)
    for t in range(first, end):
        i, k = t // per_sample, t % per_sample
        for a in range(kh):
            for b in range(kw):
                acc[:] = 0
                for r in range(k * DEPTHWISE_CHUNK_ROWS, min(oh, (k + 1) * DEPTHWISE_CHUNK_ROWS)):
                    yy = r * sh - top + a * dh
                    for col in range(ow):
                        g = d_z[i, r, col]
                        xx = col * sw - left + b * dw
                        row = x[i, yy, xx] if 0 <= yy < h and 0 <= xx < wd else zeros
                        if mult == 1:
                            for o in range(oc):
                                acc[o] += g[o] * row[o]
                        else:
                            for ch in range(c):
                                for j in range(mult):
                                    acc[ch * mult + j] += g[ch * mult + j] * row[ch]
                for o in range(oc):
                    part[t, a, b, o] = acc[o]


@njit(nogil=True, cache=True)
def _depthwise_backward_filter_rows(first, end, x, d_z, top, left, dilation, kh, kw, part):
    # _depthwise_backward_filter for stride 1 and one output channel an input channel: a
    # tap's products of an output row are one contiguous span of d_z's row and one of
    # the input row padded (copied into a row of zeros, in cache), multiplied and added
    # into a (OW*C) sum a tap in one loop over slices; the chunk's rows summed per column
    # first, then the columns in order. 1.1-1.5x faster on MobileNetV2-like's stride-1
    # maps than a loop a pixel.
    n, oh, ow, c = d_z.shape
    h, wd = x.shape[1], x.shape[2]
    dh, dw = dilation
    span = ow * c
    padded = (ow + (kw - 1) * dw) * c  # the padded row's values the windows read
    inside = max(0, min(wd, padded // c - left))  # x's columns that fall in them
    per_sample = (oh + DEPTHWISE_CHUNK_ROWS - 1) // DEPTHWISE_CHUNK_ROWS
    xr = x.reshape(n, h, wd * c)
    gr = d_z.reshape(n, oh, span)
    acc = np.empty((kh, kw, span), d_z.dtype)
    row_buffer = np.zeros(padded, x.dtype)  # x's row between zeros (written inside only)
    zero_row = np.zeros(padded, x.dtype)
    for t in range(first, end):
        i, k = t // per_sample, t % per_sample
        acc[:] = 0
        for r in range(k * DEPTHWISE_CHUNK_ROWS, min(oh, (k + 1) * DEPTHWISE_CHUNK_ROWS)):
            g = gr[i, r]
            for a in range(kh):
                yy = r - top + a * dh
                x_row = zero_row
                if 0 <= yy < h:
                    x_row = row_buffer
                    target = row_buffer[left * c:(left + inside) * c]
                    source = xr[i, yy, :inside * c]
                    for j in range(inside * c):
                        target[j] = source[j]
                for b in range(kw):
                    sums = acc[a, b]
                    shifted = x_row[b * dw * c:b * dw * c + span]
                    for j in range(span):
                        sums[j] += g[j] * shifted[j]
        for a in range(kh):
            for b in range(kw):
                sums = acc[a, b]
                out = part[t, a, b]
                for col in range(ow):
                    column = sums[col * c:(col + 1) * c]
                    for o in range(c):
                        out[o] += column[o]


def depthwise_backward_filter(x, d_z, kernel, top, left, stride, dilation) -> np.ndarray:
    """d_w (KH, KW, OC) float64: sum over n, oh, ow of d_z[n, oh, ow, o] * the tap's input
    (x read as padded by `top` rows and `left` columns of zeros, see the forward's loops);
    each chunk of DEPTHWISE_CHUNK_ROWS output rows of one sample summed a tap at a time in
    the arrays' dtype (the tap's sums stay in cache: 4x faster than all taps a pixel;
    with stride 1 and one output channel an input channel, each output column's sum over
    the chunk's rows first, then the columns'), the chunks' sums added in order in float64."""
    n, oh = d_z.shape[:2]
    tasks = n * ((oh + DEPTHWISE_CHUNK_ROWS - 1) // DEPTHWISE_CHUNK_ROWS)
    part = np.zeros((tasks, kernel[0], kernel[1], d_z.shape[3]))
    if tuple(stride) == (1, 1) and d_z.shape[3] == x.shape[3]:
        run_tasks(_depthwise_backward_filter_rows, tasks, x.size + d_z.size, x, d_z, top, left, dilation, kernel[0],
                  kernel[1], part)
    else:
        run_tasks(_depthwise_backward_filter, tasks, x.size + d_z.size, x, d_z, top, left, stride, dilation, part)
    return in_order(part)
