"""Where a flat index of an NHWC array points, and the convolution sum over one output
value's window: for the kernels that take one value a thread."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numpy import float64

from conv2d.cuda.kernels.activation import ZERO
from conv2d.cuda.kernels.bits import storage_io
from conv2d.cuda.runtime import numba_cuda

cuda = numba_cuda()


@cuda.jit(device=True, inline=True)
def nhwc_position(i, H, W, C):
    """(n, h, w, c) of flat index i of an (N, H, W, C) C-ordered array."""
    c = i % C
    r = i // C
    w = r % W
    r //= W
    return r // H, r % H, w, c


def window_geometry(spec: Any) -> dict[str, int]:
    """The sizes `window_sum` and the kernels over it take, of a LayerSpec at one input
    shape: H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW (top/left padding), DH, DW."""
    _, h, w, c = spec.input_shape
    _, oh, ow, oc = spec.output_shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = spec.kernel, spec.stride, spec.padding, spec.dilation
    return {"H": h, "W": w, "C": c, "OH": oh, "OW": ow, "OC": oc, "KH": kh, "KW": kw, "SH": sh, "SW": sw, "PH": ph,
            "PW": pw, "DH": dh, "DW": dw}


@cuda.jit(device=True, inline=True)
def _as_is(v):
    return v


@cuda.jit(device=True, inline=True)
def _widened(v):
    return float64(v)


@functools.lru_cache(maxsize=None)
def window_sum_function(storage: str, wide: bool = False):
    """A device function window_sum(x, w, n, oh, ow, oc, H, W, C, KH, KW, SH, SW, PH, PW,
    DH, DW, CG, OCG): output value (n, oh, ow, oc)'s convolution sum over its window, taps
    in order (kh, kw, then the CG channels of its group oc // OCG), in float32 (float64
    with `wide`); x (N, H, W, C), w (OC, KH, KW, CG), flat, in the storage format
    `storage`. The direct evaluate kernel and the float64 oracle (kernels/oracle.py,
    `wide`) share it."""
    load = storage_io(storage).load
    widen = _widened if wide else _as_is
    zero = float64(0) if wide else ZERO

    @cuda.jit(device=True, inline=True)
    def window_sum(x, w, n, oh, ow, oc, H, W, C, KH, KW, SH, SW, PH, PW, DH, DW, CG, OCG):
        c0 = (oc // OCG) * CG
        acc = zero
        for kh in range(KH):
            ih = oh * SH - PH + kh * DH
            if ih >= 0 and ih < H:
                for kw in range(KW):
                    iw = ow * SW - PW + kw * DW
                    if iw >= 0 and iw < W:
                        xb = ((n * H + ih) * W + iw) * C + c0
                        wb = ((oc * KH + kh) * KW + kw) * CG
                        for c in range(CG):
                            # uint64: no negative-index wraparound at each load (see
                            # kernels/depthwise._value_functions); these are never negative.
                            acc += widen(load(x, np.uint64(xb + c))) * widen(load(w, np.uint64(wb + c)))
        return acc
    return window_sum
