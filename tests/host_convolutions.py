"""A stand-in for cuDNN in tests: the three convolutions of `conv2d.cuda.cudnn_execution.Convolutions`
done by the reference on host copies, rounded as cuDNN stores them. With it the CUDA
backend's kernels and orchestration run in numba's simulator, where cuDNN cannot."""

import numpy as np

from conv2d.cuda.runtime import from_device_bits, to_device_bits
from conv2d.dtypes import storage_dtype
from conv2d.reference import conv


class HostConvolutions:
    """Made for one input shape, as cudnn_execution.Convolutions: `spec` is the spec at that shape."""

    def __init__(self, spec):
        self.spec = spec
        self.st = storage_dtype(spec.dtype)

    def _get(self, a, shape):
        return from_device_bits(a.copy_to_host(), self.st).reshape(shape).astype(np.float32)

    def _put(self, value, a, dtype):
        a.copy_to_device(np.ascontiguousarray(to_device_bits(value.astype(dtype))).reshape(a.shape))

    def forward(self, x, w, b, y, relu=False):
        s = self.spec
        z = conv.conv_forward(self._get(x, s.input_shape), self._get(w, s.weight_shape), s.stride, s.pads,
                              dilation=s.dilation, groups=s.groups, mode=s.padding_mode, per_sample=s.batch_invariant)
        if b is not None:
            z += self._get(b, (s.out_channels,))
        self._put(np.maximum(z, 0) if relu else z, y, self.st)

    def backward_data(self, d_z, w, d_x):
        s = self.spec
        dx = conv.conv_backward_data(self._get(w, s.weight_shape), self._get(d_z, s.output_shape),
                                     (s.in_height, s.in_width), s.stride, s.pads, dilation=s.dilation,
                                     groups=s.groups, mode=s.padding_mode, per_sample=s.batch_invariant)
        self._put(dx, d_x, self.st)

    def backward_filter(self, x, d_z, d_w):
        s = self.spec
        dw = conv.conv_backward_filter(self._get(x, s.input_shape), self._get(d_z, s.output_shape),
                                       s.kernel, s.stride, s.pads, dilation=s.dilation, groups=s.groups,
                                       mode=s.padding_mode)
        self._put(dw, d_w, self.st)
