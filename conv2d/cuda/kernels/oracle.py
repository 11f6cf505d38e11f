"""The three convolutions in float64 on the device, one thread a value, from float32
inputs: the oracle against which `cudnn.AccuracyProbe` measures cuDNN's float32 plans.
The sums of the reference's conv.conv_forward, conv_backward_data and
conv_backward_filter (zero padding, stride, dilation, groups), each in a fixed order.

x (N, H, W, C), w (OC, KH, KW, CG) with CG = C / groups channels a group and OCG = OC /
groups output channels a group, d_y (N, OH, OW, OC); flat, NHWC, float32; outputs flat
float64. Geometry as kernels/layout.window_geometry gives it.
"""

from __future__ import annotations

import numpy as np

from conv2d.cuda.kernels.layout import nhwc_position, window_sum_function
from conv2d.cuda.runtime import numba_cuda

cuda = numba_cuda()
ZERO = np.float64(0)


_window_sum = window_sum_function("float32", wide=True)


@cuda.jit
def forward(x, w, y, N, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, CG, OCG):
    """y = conv(x, w) for the first y.size // (OH*OW*OC) samples: one thread an output
    value, taps in order (kh, kw, then the group's channels: layout.window_sum_function)."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        n, oh, ow, oc = nhwc_position(i, OH, OW, OC)
        y[i] = _window_sum(x, w, n, oh, ow, oc, H, W, C, KH, KW, SH, SW, PH, PW, DH, DW, CG, OCG)


@cuda.jit
def backward_data(d_y, w, d_x, N, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, CG, OCG):
    """d_x = the transpose of `forward` applied to d_y, for the first d_x.size //
    (H*W*C) samples: one thread an input value (a gather), in order (kh, kw, then the
    group's output channels)."""
    for i in range(cuda.grid(1), d_x.size, cuda.gridsize(1)):
        n, ih, iw, c = nhwc_position(i, H, W, C)
        g = c // CG
        cg = c - g * CG
        acc = ZERO
        for kh in range(KH):
            th = ih + PH - kh * DH
            if th >= 0 and th % SH == 0 and th // SH < OH:
                oh = th // SH
                for kw in range(KW):
                    tw = iw + PW - kw * DW
                    if tw >= 0 and tw % SW == 0 and tw // SW < OW:
                        ow = tw // SW
                        yb = ((n * OH + oh) * OW + ow) * OC
                        for oc in range(g * OCG, (g + 1) * OCG):
                            acc += np.float64(d_y[yb + oc]) * np.float64(w[((oc * KH + kh) * KW + kw) * CG + cg])
        d_x[i] = acc


@cuda.jit
def backward_filter(x, d_y, d_w, N, H, W, C, OH, OW, OC, KH, KW, SH, SW, PH, PW, DH, DW, CG, OCG):
    """d_w[oc, kh, kw, cg] = sum over (n, oh, ow) of x at the tap times d_y: one thread
    a weight value, in order (n, oh, ow)."""
    for i in range(cuda.grid(1), d_w.size, cuda.gridsize(1)):
        cg = i % CG
        r = i // CG
        kw = r % KW
        r //= KW
        kh = r % KH
        oc = r // KH
        c = (oc // OCG) * CG + cg
        acc = ZERO
        for n in range(N):
            for oh in range(OH):
                ih = oh * SH - PH + kh * DH
                if ih >= 0 and ih < H:
                    for ow in range(OW):
                        iw = ow * SW - PW + kw * DW
                        if iw >= 0 and iw < W:
                            acc += (np.float64(x[((n * H + ih) * W + iw) * C + c])
                                    * np.float64(d_y[((n * OH + oh) * OW + ow) * OC + oc]))
        d_w[i] = acc
