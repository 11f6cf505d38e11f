"""Convolution forward, backward-data, backward-filter and the bias gradient, in NumPy.

All arrays NHWC and C-contiguous, in one float dtype (the caller's compute dtype):
`x` (N, H, W, C), weights `w` (OC, KH, KW, C / groups), `d_z` (N, OH, OW, OC). `dilation`
spaces the kernel's taps; with `groups`, channel group g of x (C / groups channels) makes
output channels group g (OC / groups) with its own weights, one convolution a group. The forward and
backward-filter convolutions are a strided window view of the padded input and one
matrix product over the whole batch; backward-data is one product per kernel tap. The
plain formulas: the fast CPU backend's (conv2d/cpu/conv.py) are checked against these.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from conv2d.padding import sources


Pads = tuple[tuple[int, int], tuple[int, int]]
# PyTorch's padding modes as NumPy's np.pad names them.
NUMPY_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def pads_of(padding: tuple) -> Pads:
    """((top, bottom), (left, right)) from itself or from a symmetric (PH, PW)."""
    if isinstance(padding[0], tuple):
        return padding
    return ((padding[0], padding[0]), (padding[1], padding[1]))


def pad(x: np.ndarray, padding: tuple, mode: str = "zeros") -> np.ndarray:
    """(N, H, W, C) -> (N, top + H + bottom, left + W + right, C), padded as `mode` says
    (LayerSpec.padding_mode); `x` itself when there is no padding."""
    (top, bottom), (left, right) = pads_of(padding)
    return np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)), mode=NUMPY_MODES[mode])


def unpad(d_xp: np.ndarray, padding: tuple, mode: str, input_hw: tuple[int, int]) -> np.ndarray:
    """The adjoint of `pad`: the gradient (N, H, W, C) of x from that of the padded input,
    each padded position's gradient added to the input position it copies (in order of
    the padded positions: rows, then columns)."""
    (top, bottom), (left, right) = pads_of(padding)
    h, w = input_hw
    if mode == "zeros":
        return np.ascontiguousarray(d_xp[:, top:top + h, left:left + w, :])
    rows, cols = sources(h, top, bottom, mode), sources(w, left, right, mode)
    by_rows = np.zeros((d_xp.shape[0], h, d_xp.shape[2], d_xp.shape[3]), dtype=d_xp.dtype)
    np.add.at(by_rows, (slice(None), rows), d_xp)
    d_x = np.zeros((d_xp.shape[0], h, w, d_xp.shape[3]), dtype=d_xp.dtype)
    np.add.at(d_x, (slice(None), slice(None), cols), by_rows)
    return d_x


def windows(xp: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int],
            dilation: tuple[int, int] = (1, 1)) -> np.ndarray:
    """Read-only view (N, OH, OW, KH, KW, C) of the padded input `xp` (N, Hp, Wp, C)."""
    n, hp, wp, c = xp.shape
    kh, kw = kernel
    sh, sw = stride
    dh, dw = dilation
    oh = (hp - (kh - 1) * dh - 1) // sh + 1
    ow = (wp - (kw - 1) * dw - 1) // sw + 1
    s_n, s_h, s_w, s_c = xp.strides
    return as_strided(xp, shape=(n, oh, ow, kh, kw, c),
                      strides=(s_n, sh * s_h, sw * s_w, dh * s_h, dw * s_w, s_c), writeable=False)


def by_group(groups: int, run, a: np.ndarray, b: np.ndarray, a_axis: int, b_axis: int) -> np.ndarray:
    """run(a's channel group g, b's group g) for each of `groups` groups (a split along
    a_axis, b along b_axis, each part contiguous), joined along the last axis."""
    if groups == 1:
        return run(a, b)
    parts = zip(np.split(a, groups, axis=a_axis), np.split(b, groups, axis=b_axis))
    return np.concatenate([run(np.ascontiguousarray(p), np.ascontiguousarray(q)) for p, q in parts], axis=-1)


def conv_forward(x: np.ndarray, w: np.ndarray, stride: tuple[int, int],
                 padding: tuple, per_sample: bool = False, dilation: tuple[int, int] = (1, 1),
                 groups: int = 1, mode: str = "zeros") -> np.ndarray:
    """y[n, oh, ow, oc] = sum_{kh, kw, c} xp[n, oh*SH + kh, ow*SW + kw, c] * w[oc, kh, kw, c].

    `per_sample`: one matrix product a sample, of the same shape whatever N: BLAS picks its
    kernel (and so its summation order) by the product's shape, so a product over the
    batch gives a sample other bits at another batch size; one sample at a time gives it
    the same."""
    if groups > 1:
        return by_group(groups, lambda xg, wg: conv_forward(xg, wg, stride, padding, per_sample, dilation,
                                                             mode=mode), x, w, 3, 0)
    oc, kh, kw, c = w.shape
    cols = windows(pad(x, padding, mode), (kh, kw), stride, dilation)
    n, oh, ow = cols.shape[:3]
    w_t = w.reshape(oc, kh * kw * c).T
    y = np.empty((n, oh, ow, oc), dtype=np.result_type(x, w))
    step = 1 if per_sample else max(n, 1)
    for i in range(0, n, step):
        # The reshape copies the overlapping windows into one matrix (im2col).
        block = cols[i:i + step].reshape(-1, kh * kw * c)
        np.matmul(block, w_t, out=y[i:i + step].reshape(-1, oc))
    return y


def conv_backward_filter(x: np.ndarray, d_z: np.ndarray, kernel: tuple[int, int],
                         stride: tuple[int, int], padding: tuple, dilation: tuple[int, int] = (1, 1),
                         groups: int = 1, mode: str = "zeros") -> np.ndarray:
    """d_w[oc, kh, kw, c] = sum_{n, oh, ow} d_z[n, oh, ow, oc] * xp[n, oh*SH + kh, ow*SW + kw, c]
    (taps kh*DH, kw*DW with dilation; within each channel group)."""
    if groups > 1:
        # Each group's (OC / groups, KH, KW, C / groups) joined along OC: d_w's first axis.
        run = lambda xg, dg: np.moveaxis(conv_backward_filter(xg, dg, kernel, stride, padding, dilation,  # noqa: E731
                                                              mode=mode), 0, -1)
        return np.ascontiguousarray(np.moveaxis(by_group(groups, run, x, d_z, 3, 3), -1, 0))
    n, oh, ow, oc = d_z.shape
    kh, kw = kernel
    c = x.shape[3]
    cols = windows(pad(x, padding, mode), kernel, stride, dilation)
    d_w = d_z.reshape(-1, oc).T @ cols.reshape(-1, kh * kw * c)
    return d_w.reshape(oc, kh, kw, c)


def conv_backward_data(w: np.ndarray, d_z: np.ndarray, input_hw: tuple[int, int],
                       stride: tuple[int, int], padding: tuple, per_sample: bool = False,
                       dilation: tuple[int, int] = (1, 1), groups: int = 1, mode: str = "zeros") -> np.ndarray:
    """d_x (N, H, W, C): the transpose of `conv_forward` applied to `d_z`.

    For each of the KH*KW kernel taps, one matrix product d_z @ w[:, kh, kw, :] gives that
    tap's contribution, contiguous (N, OH, OW, C), added into the padded gradient with
    one strided add. `per_sample`: one sample at a time, as in `conv_forward`.
    """
    if groups > 1:
        return by_group(groups, lambda wg, dg: conv_backward_data(wg, dg, input_hw, stride, padding, per_sample,
                                                                   dilation, mode=mode), w, d_z, 0, 3)
    n, oh, ow, oc = d_z.shape
    _, kh, kw, c = w.shape
    sh, sw = stride
    (top_pad, bottom_pad), (left_pad, right_pad) = pads_of(padding)
    dh, dw = dilation
    h, w_in = input_hw
    hp, wp = h + top_pad + bottom_pad, w_in + left_pad + right_pad
    d_xp = np.zeros((n, hp, wp, c), dtype=np.result_type(w, d_z))
    step = 1 if per_sample else max(n, 1)
    for b in range(0, n, step):
        rows = d_z[b:b + step].reshape(-1, oc)
        out = d_xp[b:b + step]
        for i in range(kh):
            for j in range(kw):
                tap = (rows @ w[:, i, j, :]).reshape(-1, oh, ow, c)
                top, left = i * dh, j * dw
                out[:, top:top + sh * (oh - 1) + 1:sh, left:left + sw * (ow - 1) + 1:sw, :] += tap
    return unpad(d_xp, padding, mode, input_hw)


def bias_backward(d_z: np.ndarray) -> np.ndarray:
    """d_b[oc] = sum_{n, oh, ow} d_z[n, oh, ow, oc], (OC,), summed in float64, in d_z's dtype."""
    return d_z.sum(axis=(0, 1, 2), dtype=np.float64).astype(d_z.dtype)
