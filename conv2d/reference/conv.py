"""Convolution forward, backward-data, backward-filter and the bias gradient, in NumPy.

All arrays NHWC and C-contiguous, in one float dtype (the caller's compute dtype):
`x` (N, H, W, C), weights `w` (OC, KH, KW, C), `d_z` (N, OH, OW, OC). Each convolution is a
strided window view of the padded input and one matrix product, so BLAS does the work.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided


def pad(x: np.ndarray, padding: tuple[int, int]) -> np.ndarray:
    """(N, H, W, C) -> (N, H + 2*PH, W + 2*PW, C), zeros around; `x` itself when no padding."""
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    return np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)))


def windows(xp: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int]) -> np.ndarray:
    """Read-only view (N, OH, OW, KH, KW, C) of the padded input `xp` (N, Hp, Wp, C)."""
    n, hp, wp, c = xp.shape
    kh, kw = kernel
    sh, sw = stride
    oh = (hp - kh) // sh + 1
    ow = (wp - kw) // sw + 1
    s_n, s_h, s_w, s_c = xp.strides
    return as_strided(xp, shape=(n, oh, ow, kh, kw, c),
                      strides=(s_n, sh * s_h, sw * s_w, s_h, s_w, s_c), writeable=False)


def conv_forward(x: np.ndarray, w: np.ndarray, stride: tuple[int, int],
                 padding: tuple[int, int]) -> np.ndarray:
    """y[n, oh, ow, oc] = sum_{kh, kw, c} xp[n, oh*SH + kh, ow*SW + kw, c] * w[oc, kh, kw, c]."""
    oc, kh, kw, c = w.shape
    cols = windows(pad(x, padding), (kh, kw), stride)
    n, oh, ow = cols.shape[:3]
    # The reshape copies the overlapping windows into one (N*OH*OW, KH*KW*C) matrix (im2col).
    y = cols.reshape(n * oh * ow, kh * kw * c) @ w.reshape(oc, kh * kw * c).T
    return y.reshape(n, oh, ow, oc)


def conv_backward_filter(x: np.ndarray, d_z: np.ndarray, kernel: tuple[int, int],
                         stride: tuple[int, int], padding: tuple[int, int]) -> np.ndarray:
    """d_w[oc, kh, kw, c] = sum_{n, oh, ow} d_z[n, oh, ow, oc] * xp[n, oh*SH + kh, ow*SW + kw, c]."""
    n, oh, ow, oc = d_z.shape
    kh, kw = kernel
    c = x.shape[3]
    cols = windows(pad(x, padding), kernel, stride).reshape(n * oh * ow, kh * kw * c)
    return (d_z.reshape(n * oh * ow, oc).T @ cols).reshape(oc, kh, kw, c)


def conv_backward_data(w: np.ndarray, d_z: np.ndarray, input_hw: tuple[int, int],
                       stride: tuple[int, int], padding: tuple[int, int]) -> np.ndarray:
    """d_x (N, H, W, C): the transpose of `conv_forward` applied to `d_z`.

    One matrix product gives every window's gradient, (N*OH*OW, KH*KW*C); each of the KH*KW
    kernel offsets then adds its slice into the padded gradient with one strided add.
    """
    n, oh, ow, oc = d_z.shape
    _, kh, kw, c = w.shape
    sh, sw = stride
    ph, pw = padding
    h, w_in = input_hw
    cols = (d_z.reshape(n * oh * ow, oc) @ w.reshape(oc, kh * kw * c)).reshape(n, oh, ow, kh, kw, c)
    d_xp = np.zeros((n, h + 2 * ph, w_in + 2 * pw, c), dtype=d_z.dtype)
    for i in range(kh):
        for j in range(kw):
            d_xp[:, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw, :] += cols[:, :, :, i, j, :]
    return np.ascontiguousarray(d_xp[:, ph:ph + h, pw:pw + w_in, :])


def bias_backward(d_z: np.ndarray) -> np.ndarray:
    """d_b[oc] = sum_{n, oh, ow} d_z[n, oh, ow, oc], (OC,)."""
    return d_z.reshape(-1, d_z.shape[-1]).sum(axis=0)
