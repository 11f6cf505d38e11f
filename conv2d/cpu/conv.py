"""Convolution forward, backward-data, backward-filter and the bias gradient of the CPU
backend: BLAS matrix products (im2col) for dense and grouped convolutions, numba loops
(conv2d.cpu.conv_kernels) for depthwise ones and the bias gradient. The functions and their
names are the reference's (conv2d/reference/conv.py), which they are tested against.

All arrays NHWC and C-contiguous, in one float dtype (the caller's compute dtype):
`x` (N, H, W, C), weights `w` (OC, KH, KW, C / groups), `d_z` (N, OH, OW, OC). `dilation`
spaces the kernel's taps; with `groups`, channel group g of x (C / groups channels) makes
output channels group g (OC / groups) with its own weights, one convolution a group. The forward and
backward-filter convolutions copy a block of samples' windows into one matrix (im2col: a
compiled loop for zero padding, NumPy's copy of the padded window view for the other
modes) and make one matrix product a block; backward-data is one product per block and a
compiled loop that adds its taps back. BLAS does the work. Depthwise convolutions (C / groups = 1) are memory-bound
loops, one product of a few taps an output, where a matrix product a channel would
cost more in Python than in arithmetic.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from conv2d.cpu import conv_kernels, kernels
# The reference's helpers where nothing is faster than its plain form: the padded input's
# windows, the adjoint of padding, the split by channel groups.
from conv2d.reference.conv import NUMPY_MODES, by_group, pads_of, unpad, windows


def pad(x: np.ndarray, padding: tuple, mode: str = "zeros") -> np.ndarray:
    """(N, H, W, C) -> (N, top + H + bottom, left + W + right, C), padded as `mode` says
    (LayerSpec.padding_mode); `x` itself when there is no padding."""
    (top, bottom), (left, right) = pads_of(padding)
    if top == bottom == left == right == 0:
        return x
    if mode == "zeros":  # np.pad's generality costs ~25 us a call, the layer's own time on small inputs
        n, h, w, c = x.shape
        xp = np.zeros((n, top + h + bottom, left + w + right, c), x.dtype)
        xp[:, top:top + h, left:left + w] = x
        return xp
    return np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)), mode=NUMPY_MODES[mode])


def _windows(xp: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int],
             dilation: tuple[int, int]) -> np.ndarray:
    """conv2d.reference.conv.windows' view (N, OH, OW, KH, KW, C) of the padded input,
    made by the ndarray constructor where xp is C-contiguous (NumPy's as_strided costs
    ~2 us a call of its own, a tenth of an acting layer's)."""
    if not xp.flags.c_contiguous:
        return windows(xp, kernel, stride, dilation)
    shape, strides = _window_layout(xp.shape, kernel, stride, dilation, xp.itemsize)
    view = np.ndarray(shape, xp.dtype, xp, 0, strides)
    view.flags.writeable = False
    return view


def _window_layout(padded_shape: tuple, kernel: tuple[int, int], stride: tuple[int, int],
                   dilation: tuple[int, int], itemsize: int) -> tuple[tuple, tuple]:
    """(shape, strides) of the windows view (N, OH, OW, KH, KW, C) of a C-contiguous padded
    input of shape `padded_shape` (N, HP, WP, C)."""
    n, hp, wp, c = padded_shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    oh, ow = _output_size((hp, wp), kernel, stride, dilation)
    s_w, s_h = c * itemsize, wp * c * itemsize
    return (n, oh, ow, kh, kw, c), (hp * s_h, sh * s_h, sw * s_w, dh * s_h, dw * s_w, itemsize)


def _compiled_columns(x: np.ndarray, mode: str) -> bool:
    """Whether x's windows are copied by conv_kernels.im2col (zero padding, C-contiguous x:
    faster than NumPy's copy of the padded window view, without the padded copy) or by
    NumPy (the other padding modes)."""
    return mode == "zeros" and x.flags.c_contiguous


def _columns(x: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple,
             dilation: tuple[int, int], mode: str) -> np.ndarray:
    """The windows of x (N, H, W, C) padded as `mode` says, as one matrix (N*OH*OW, KH*KW*C)
    (im2col), a copy."""
    return _block_columns(x, kernel, stride, padding, dilation, mode)(0, x.shape[0], None)


def _block_columns(x: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple,
                   dilation: tuple[int, int], mode: str) -> Callable:
    """columns(i, m, out): the windows of samples i..i+m of x (N, H, W, C) padded as `mode`
    says, as one matrix (m*OH*OW, KH*KW*C), written into the first rows of `out` where it
    is given (a buffer of a block's rows, reused block after block), else new."""
    (kh, kw), c = kernel, x.shape[3]
    oh, ow = _output_size(_padded_hw(x.shape, padding), kernel, stride, dilation)
    width = kh * kw * c
    if _pointwise((kh, kw), stride, padding):
        # A 1x1 convolution's windows are x's rows: a view where x is C-contiguous, no copy.
        return lambda i, m, out: x[i:i + m].reshape(-1, c)
    if _compiled_columns(x, mode):
        (top, _), (left, _) = pads_of(padding)
        (sh, sw), (dh, dw) = stride, dilation

        def compiled(i: int, m: int, out: np.ndarray | None) -> np.ndarray:
            cols = np.empty((m * oh * ow, width), x.dtype) if out is None else out[:m * oh * ow]
            conv_kernels.im2col(x[i:i + m], top, left, sh, sw, dh, dw, kh, kw, oh, ow, cols)
            return cols
        return compiled
    view = _windows(pad(x, padding, mode), kernel, stride, dilation)
    # The reshape copies the overlapping windows into one matrix (im2col).
    return lambda i, m, out: view[i:i + m].reshape(-1, width)


def _pointwise(kernel: tuple[int, int], stride: tuple[int, int], padding: tuple) -> bool:
    """Whether a convolution is 1x1, stride 1, without padding: each output position's
    window is x's pixel there, so x's rows (N*H*W, C) are the windows, no copy."""
    (top, bottom), (left, right) = pads_of(padding)
    return tuple(kernel) == (1, 1) and tuple(stride) == (1, 1) and top == bottom == left == right == 0


def _padded_input(x: np.ndarray, padding: tuple, mode: str) -> tuple[np.ndarray, int, int]:
    """(x, top, left) for the depthwise loops, which read zeros outside x themselves
    (conv2d.cpu.conv_kernels): x itself with zero padding, else the padded copy, 0, 0."""
    if mode == "zeros":
        (top, _), (left, _) = pads_of(padding)
        return x, top, left
    return pad(x, padding, mode), 0, 0


def _padded_hw(shape: tuple, padding: tuple) -> tuple[int, int]:
    (top, bottom), (left, right) = pads_of(padding)
    return shape[1] + top + bottom, shape[2] + left + right


def _depthwise(groups: int, channels: int) -> bool:
    """Whether a convolution of `channels` input channels in `groups` groups is depthwise
    (each group one input channel)."""
    return groups > 1 and groups == channels


def _taps(w: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Depthwise weights (OC, KH, KW, 1) as (KH, KW, OC) in `dtype`, contiguous."""
    return np.ascontiguousarray(w[..., 0].transpose(1, 2, 0), dtype=dtype)  # not moveaxis: 2 us more a call


def _output_size(padded_hw: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int],
                 dilation: tuple[int, int]) -> tuple[int, int]:
    return tuple((p - (k - 1) * d - 1) // s + 1 for p, k, s, d in zip(padded_hw, kernel, stride, dilation))


# Samples per im2col block: the copied windows of one block stay near this many bytes, so
# they are written and read back from cache, not memory (measured ~2x faster on the
# ResNet shapes than one whole-batch copy), and peak memory stays bounded. The blocks are
# the tasks the call's threads share (conv2d.cpu.kernels.run_tasks; BLAS itself runs one
# thread): fixed by the shapes, never by the thread count, so each product has the same
# shape, and so the same bits, whatever the count.
BLOCK_BYTES = 1 << 20


def _block_samples(bytes_per_sample: int) -> int:
    """How many samples make one block of about BLOCK_BYTES (at least one)."""
    return max(1, BLOCK_BYTES // max(1, bytes_per_sample))


def conv_forward(x: np.ndarray, w: np.ndarray, stride: tuple[int, int],
                 padding: tuple, per_sample: bool = False, dilation: tuple[int, int] = (1, 1),
                 groups: int = 1, mode: str = "zeros") -> np.ndarray:
    """y[n, oh, ow, oc] = sum_{kh, kw, c} xp[n, oh*SH + kh, ow*SW + kw, c] * w[oc, kh, kw, c].

    `per_sample`: one matrix product a sample, of the same shape whatever N: BLAS picks its
    kernel (and so its summation order) by the product's shape, so blocks of samples give
    a sample other bits at another batch size; one sample at a time gives it the same."""
    if _depthwise(groups, x.shape[3]):
        oh, ow = _output_size(_padded_hw(x.shape, padding), w.shape[1:3], stride, dilation)
        y = np.empty((x.shape[0], oh, ow, w.shape[0]), dtype=np.result_type(x, w))
        source, top, left = _padded_input(x, padding, mode)
        conv_kernels.depthwise_forward(source, _taps(w, y.dtype), top, left, stride, dilation, y)
        return y
    if groups > 1:
        return by_group(groups, lambda xg, wg: conv_forward(xg, wg, stride, padding, per_sample, dilation,
                                                             mode=mode), x, w, 3, 0)
    oc, kh, kw, c = w.shape
    n = x.shape[0]
    oh, ow = _output_size(_padded_hw(x.shape, padding), (kh, kw), stride, dilation)
    w_t = w.reshape(oc, kh * kw * c).T
    y = np.empty((n, oh, ow, oc), dtype=np.result_type(x, w))
    step = 1 if per_sample else _block_samples(oh * ow * kh * kw * c * x.itemsize)
    if step >= n:  # one block (an acting call): the product alone, no tasks
        np.matmul(_columns(x, (kh, kw), stride, padding, dilation, mode), w_t, out=y.reshape(-1, oc))
        return y
    columns = _block_columns(x, (kh, kw), stride, padding, dilation, mode)

    def blocks(first: int, end: int) -> None:
        buffer = np.empty((step * oh * ow, kh * kw * c), x.dtype)
        for i in range(first * step, min(n, end * step), step):
            np.matmul(columns(i, min(step, n - i), buffer), w_t, out=y[i:i + step].reshape(-1, oc))
    kernels.run_tasks(blocks, -(-n // step), y.size * kh * kw * c)
    return y


def forward_function(x_shape: tuple[int, int, int, int], w: np.ndarray, stride: tuple[int, int], padding: tuple,
                     per_sample: bool = False, dilation: tuple[int, int] = (1, 1), groups: int = 1,
                     mode: str = "zeros") -> Callable[[np.ndarray], np.ndarray]:
    """conv_forward(x, w, ...) of C-contiguous x of shape `x_shape` (N, H, W, C) and of
    dtype w's, as a function of x alone, bitwise conv_forward's: what depends on the
    shapes alone is worked out here, once (for the calls that prepare an evaluate, where
    it is a third of a small layer's time). `w` is read at each call."""
    oc, kh, kw, c = w.shape
    n = x_shape[0]
    padded = _padded_hw(x_shape, padding)
    oh, ow = _output_size(padded, (kh, kw), stride, dilation)
    rows, width = n * oh * ow, kh * kw * c
    step = 1 if per_sample else _block_samples(oh * ow * width * w.itemsize)
    (top, _), (left, _) = pads_of(padding)
    if _depthwise(groups, x_shape[3]) and mode == "zeros":
        # conv_forward's depthwise case with its shape work done here (a third of
        # MobileNetV2-like's acting call on a 16x16 map).
        y_shape = (n, oh, ow, oc)

        def forward_depthwise(x: np.ndarray) -> np.ndarray:
            y = np.empty(y_shape, w.dtype)
            conv_kernels.depthwise_forward(x, _taps(w, w.dtype), top, left, stride, dilation, y)
            return y
        return forward_depthwise
    if _depthwise(groups, x_shape[3]) or groups > 1 or step < n:
        return lambda x: conv_forward(x, w, stride, padding, per_sample, dilation, groups, mode)
    w_t = w.reshape(oc, width).T
    (sh, sw), (dh, dw) = stride, dilation
    if _pointwise((kh, kw), stride, padding):
        def forward_rows(x: np.ndarray) -> np.ndarray:  # a 1x1 convolution: the product of x's rows
            y = np.empty((rows, oc), w.dtype)
            np.matmul(x.reshape(rows, c), w_t, out=y)
            return y.reshape(n, oh, ow, oc)
        return forward_rows
    if mode != "zeros":  # x is C-contiguous: zero padding's windows are conv_kernels.im2col's
        # One block, NumPy's copy of the windows (conv_forward's), the window view's
        # strides worked out here: on IMPALA's acting calls the per-call shape work was
        # about a tenth of a layer's time.
        shape, strides = _window_layout((n, *padded, c), (kh, kw), stride, dilation, w.itemsize)

        def forward_windows(x: np.ndarray) -> np.ndarray:
            cols = np.ndarray(shape, w.dtype, pad(x, padding, mode), 0, strides).reshape(rows, width)
            y = np.empty((rows, oc), w.dtype)
            np.matmul(cols, w_t, out=y)
            return y.reshape(n, oh, ow, oc)
        return forward_windows

    def forward(x: np.ndarray) -> np.ndarray:
        cols = np.empty((rows, width), w.dtype)
        conv_kernels.im2col(x, top, left, sh, sw, dh, dw, kh, kw, oh, ow, cols)
        y = np.empty((rows, oc), w.dtype)
        np.matmul(cols, w_t, out=y)
        return y.reshape(n, oh, ow, oc)
    return forward


def conv_backward_filter(x: np.ndarray, d_z: np.ndarray, kernel: tuple[int, int],
                         stride: tuple[int, int], padding: tuple, dilation: tuple[int, int] = (1, 1),
                         groups: int = 1, mode: str = "zeros") -> np.ndarray:
    """d_w[oc, kh, kw, c] = sum_{n, oh, ow} d_z[n, oh, ow, oc] * xp[n, oh*SH + kh, ow*SW + kw, c]
    (taps kh*DH, kw*DW with dilation; within each channel group)."""
    if _depthwise(groups, x.shape[3]):
        source, top, left = _padded_input(x, padding, mode)
        d_w = conv_kernels.depthwise_backward_filter(source, d_z, tuple(kernel), top, left, stride, dilation)
        return np.ascontiguousarray(np.moveaxis(d_w, -1, 0))[..., None].astype(np.result_type(x, d_z), copy=False)
    if groups > 1:
        # Each group's (OC / groups, KH, KW, C / groups) joined along OC: d_w's first axis.
        run = lambda xg, dg: np.moveaxis(conv_backward_filter(xg, dg, kernel, stride, padding, dilation,  # noqa: E731
                                                              mode=mode), 0, -1)
        return np.ascontiguousarray(np.moveaxis(by_group(groups, run, x, d_z, 3, 3), -1, 0))
    n, oh, ow, oc = d_z.shape
    kh, kw = kernel
    c = x.shape[3]
    columns = _block_columns(x, kernel, stride, padding, dilation, mode)
    step = _block_samples(oh * ow * kh * kw * c * x.itemsize)
    # A block's sums as columns.T @ d_z, (KH*KW*C, OC), where the block has at least as
    # many rows as columns: OpenBLAS's other orientation, d_z.T @ columns, ran 1.1-1.4x
    # longer there (the IMPALA-CNN, MobileNetV2-like and CIFAR shapes, the transpose of
    # the sum included); with fewer rows it was as fast or faster (Nature-DQN's 4x4 and
    # 3x3 layers; the digits CNN's last, 0.8x), and the transpose is saved.
    width = kh * kw * c
    tall = min(step, n) * oh * ow >= width
    part = np.empty((-(-n // step), *((width, oc) if tall else (oc, width))), dtype=np.result_type(x, d_z))

    def blocks(first: int, end: int) -> None:
        buffer = np.empty((step * oh * ow, width), x.dtype)
        for b in range(first, end):
            i = b * step
            cols, g = columns(i, min(step, n - i), buffer), d_z[i:i + step].reshape(-1, oc)
            np.matmul(cols.T, g, out=part[b]) if tall else np.matmul(g.T, cols, out=part[b])
    kernels.run_tasks(blocks, part.shape[0], d_z.size * width)
    d_w = part[0].copy()
    for b in range(1, part.shape[0]):  # the blocks' sums added in order
        d_w += part[b]
    return (np.ascontiguousarray(d_w.T) if tall else d_w).reshape(oc, kh, kw, c)


def conv_backward_data(w: np.ndarray, d_z: np.ndarray, input_hw: tuple[int, int],
                       stride: tuple[int, int], padding: tuple, per_sample: bool = False,
                       dilation: tuple[int, int] = (1, 1), groups: int = 1, mode: str = "zeros") -> np.ndarray:
    """d_x (N, H, W, C): the transpose of `conv_forward` applied to `d_z`.

    One matrix product a block of samples, d_z (rows, OC) @ w (OC, KH*KW*C), gives every
    output position's taps, which a compiled loop adds into d_x (conv2d.cpu.conv_kernels.
    add_windows, the adjoint of im2col; with a padding mode other than zeros into the
    padded gradient, whose border is then folded back). A product a
    tap (K = OC) with NumPy's strided adds was measured 1.3-1.5x slower on the IMPALA and
    Nature-DQN shapes. A 1x1 stride-1 convolution without padding is the product alone.
    Blocks of samples keep the taps in cache; `per_sample`: blocks of one sample, as in
    `conv_forward`.
    """
    if _depthwise(groups, groups * w.shape[3]):
        (top, bottom), (left, right) = pads_of(padding)
        n = d_z.shape[0]
        dtype = np.result_type(w, d_z)
        shape = (n, input_hw[0] + top + bottom, input_hw[1] + left + right, groups)  # the padded input's
        if tuple(stride) == (1, 1) and w.shape[1:3] == (3, 3) and w.shape[0] == groups:
            # Stride 1, 3x3: the forward's 3x3 loop over d_z padded by the dilated kernel,
            # taps flipped; each input position gathers its nine products in registers.
            # On MobileNetV2's maps faster than adding every output's taps back (the loop
            # below): 1.2-1.7x on 32x32 and 16x16; on 8x8 too since zero padding's case
            # computes d_x's positions alone.
            dh, dw = dilation
            taps = np.ascontiguousarray(_taps(w, dtype)[::-1, ::-1])
            if mode == "zeros":
                # Zero padding's gradient is the padded gradient's interior: d_z read as
                # padded by 2 * dilation - pad a side (a negative offset where the padding
                # is wider than the kernel reaches) gives just that, the same sums.
                d_x = np.empty((n, *input_hw, groups), dtype)
                conv_kernels.depthwise_forward(d_z, taps, 2 * dh - top, 2 * dw - left, (1, 1), dilation, d_x)
                return d_x
            d_xp = np.empty(shape, dtype)
            conv_kernels.depthwise_forward(d_z, taps, 2 * dh, 2 * dw, (1, 1), dilation, d_xp)
            return unpad(d_xp, padding, mode, input_hw)
        if mode == "zeros":  # the taps inside x, added into d_x itself
            d_x = np.zeros((n, *input_hw, groups), dtype)
            conv_kernels.depthwise_backward_data(d_z, _taps(w, dtype), top, left, stride, dilation, d_x)
            return d_x
        d_xp = np.zeros(shape, dtype)
        conv_kernels.depthwise_backward_data(d_z, _taps(w, dtype), 0, 0, stride, dilation, d_xp)
        return unpad(d_xp, padding, mode, input_hw)
    if groups > 1:
        return by_group(groups, lambda wg, dg: conv_backward_data(wg, dg, input_hw, stride, padding, per_sample,
                                                                   dilation, mode=mode), w, d_z, 0, 3)
    n, oh, ow, oc = d_z.shape
    _, kh, kw, c = w.shape
    (top, bottom), (left, right) = pads_of(padding)
    dtype = np.result_type(w, d_z)
    w_all = w.reshape(oc, kh * kw * c)
    if _pointwise((kh, kw), stride, padding):
        d_x = np.empty((n, oh, ow, c), dtype)
        step = 1 if per_sample else _block_samples(oh * ow * (oc + c) * d_x.itemsize)

        def products(first: int, end: int) -> None:
            for b in range(first * step, min(n, end * step), step):
                np.matmul(d_z[b:b + step].reshape(-1, oc), w_all, out=d_x[b:b + step].reshape(-1, c))
        kernels.run_tasks(products, -(-n // step), d_z.size * c)
        return d_x
    # Zero padding's gradient is the taps that land inside x, added into d_x itself; the
    # other modes add them all into the padded gradient and fold its border back (unpad).
    inside = mode == "zeros"
    d_xp = np.zeros((n, *input_hw, c) if inside else (n, input_hw[0] + top + bottom, input_hw[1] + left + right, c),
                    dtype)
    offsets = (top, left) if inside else (0, 0)
    step = 1 if per_sample else _block_samples(oh * ow * kh * kw * c * d_xp.itemsize)

    def blocks(first: int, end: int) -> None:
        buffer = np.empty((step * oh * ow, kh * kw * c), dtype)
        for b in range(first * step, min(n, end * step), step):
            m = min(step, n - b)
            taps = np.matmul(d_z[b:b + m].reshape(-1, oc), w_all, out=buffer[:m * oh * ow])
            conv_kernels.add_windows(taps.reshape(m, oh, ow, kh, kw, c), *offsets, stride, dilation, d_xp[b:b + m])
    kernels.run_tasks(blocks, -(-n // step), d_z.size * kh * kw * c)
    return d_xp if inside else unpad(d_xp, padding, mode, input_hw)


def bias_backward(d_z: np.ndarray) -> np.ndarray:
    """d_b[oc] = sum_{n, oh, ow} d_z[n, oh, ow, oc], (OC,), summed in float64 in fixed
    chunks (conv2d.cpu.kernels.column_sums), in d_z's dtype."""
    c = d_z.shape[-1]
    return kernels.column_sums(d_z.reshape(-1, c), np.zeros(c), 1).astype(d_z.dtype)
