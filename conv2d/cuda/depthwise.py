"""A depthwise layer's three convolutions through numba kernels (kernels/depthwise.py)
instead of cuDNN: the backend option `depthwise_kernel`, "numba" for layers with groups ==
in_channels ("auto", the default, takes it for them). Same methods as
`cudnn_execution.Convolutions` (the steps call either alike); the launches are prepared once per
input shape and run on the layer's current stream, so they are captured in CUDA graphs
like the other kernels.

cuDNN's depthwise graphs measured 1.4-2.6x PyTorch's training step on the MobileNetV2
shape (docs/bench_cuda.md). The fast kernels (the default) take the layer's sizes as
compile-time constants and the weights from shared memory; where the indices fit 31 bits
the forward and the input gradient compute a strip of values along the width a thread
with 32-bit index arithmetic, and the weight gradient's first phase (a thread a channel)
sums strips of rows. `kernels="simple"` runs the simple ones (one thread a value, the
sizes as arguments): the same sums. The captured step on an H100 at 9e2e185, against
PyTorch's: 0.94x in float32 and 0.95x in bfloat16 without a norm, 0.74x and 0.69x with
batch norm; cuDNN's graph 2.4-2.6x and 1.7x (docs/bench_cuda.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conv2d.cuda import kernels as K
from conv2d.cuda.kernels.depthwise import (SMALL_INDEX, STRIP, depthwise_kernels, fast_depthwise_kernels, geometry_key,
                                           strip_items, weight_partials_by_channel)
from conv2d.cuda.kernels.layout import window_geometry
from conv2d.cuda.launch import Launcher, LaunchKey
from conv2d.spec import LayerSpec

# Blocks of the weight gradient's first phase: each sums every P-th row (n, oh, ow). The
# fast kernel's block is a thread a channel, so its grid needs about this many blocks to
# fill a GPU (the MobileNetV2 shape: 144 channels, 401,408 rows).
MAX_PARTIAL_BLOCKS = 1024


def is_depthwise(spec: LayerSpec) -> bool:
    return spec.groups > 1 and spec.groups == spec.in_channels


class DepthwiseConvolutions:
    """The convolutions of one input shape (`spec`, zero padding: cuDNN's convolution
    spec; a depthwise one, which Functions checks), launched by `launch` (the layer's
    Launcher), by the fast kernels (the sizes compile-time constants, one compilation a
    geometry; the weight gradient's first phase a thread a channel), or with `simple` by
    the simple ones (the weight gradient's a thread a tap and channel): the same sums."""

    def __init__(self, cuda: Any, spec: LayerSpec, launch: Launcher, simple: bool = False) -> None:
        self.spec, self._launch = spec, launch
        n, h, w, c = spec.input_shape
        _, oh, ow, oc = spec.output_shape
        kh, kw = spec.kernel
        self._geometry = {**window_geometry(spec), "M": oc // c}
        simple_kernels = depthwise_kernels(spec.dtype.value)
        # The weight gradient's first phase: the simple kernel (a thread a tap and
        # channel, the sizes as arguments), or the fast one (a thread a channel, the
        # sizes its constants) where the indices fit 31 bits.
        self._weight_partials, self._partial_sizes = simple_kernels[2], self._geometry
        self._fast_partials = False
        strips = (1, 1)  # values along the width a thread of the forward, the input gradient
        if simple:
            self._kernels, self._weight_sum = simple_kernels[:2], simple_kernels[3]
            self._sizes_given = self._geometry  # the simple kernels take the sizes as arguments
            self._sum_sizes = {k: self._geometry[k] for k in ("OC", "KH", "KW")}
        else:  # the sizes are the fast kernels' constants
            key = geometry_key(self._geometry)
            small = max(n * h * w * c, n * oh * ow * oc) <= SMALL_INDEX
            fast = fast_depthwise_kernels(spec.dtype.value, key, small)
            self._kernels, self._weight_sum = (fast.forward, fast.backward_data), fast.backward_filter_sum
            strips = (fast.forward_strip, fast.backward_strip)
            if small:
                self._weight_partials = weight_partials_by_channel(spec.dtype.value, key)
                self._partial_sizes, self._fast_partials = {}, True
            self._sizes_given = self._sum_sizes = {}
        self._rows = n * oh * ow
        self._strips = strip_items(self._rows, ow, STRIP)  # the weight gradient's strips of rows
        self._P = max(1, min(MAX_PARTIAL_BLOCKS, self._rows // 64))
        self._taps = oc * kh * kw
        self._partials = cuda.device_array(self._P * self._taps, np.float32)
        self._dummy = cuda.device_array(1, np.float32)
        self._launches: dict = {}
        # Threads of the forward and of the input gradient: a value each, or a strip of
        # values along the width each (the fast kernels where the indices fit 31 bits).
        self._items = {"y": strip_items(n * oh * ow * oc, ow, strips[0]),
                       "x": strip_items(n * h * w * c, w, strips[1])}
        self.plans = {"forward": "numba depthwise", "backward_data": "numba depthwise",
                      "backward_filter": "numba depthwise"}

    def release(self) -> None:
        """Let the prepared launches go of the caller's arrays of their last call."""
        for launch in self._launches.values():
            launch.release()

    def forward(self, x: Any, w: Any, b: Any, y: Any, relu: bool = False) -> None:
        fixed = {**self._sizes_given, "has_bias": b is not None, "relu": relu}
        arrays = dict(x=x, w=w, b=self._dummy if b is None else b, y=y)
        self._launch(self._launches, LaunchKey("depthwise_forward", fixed=(("relu", relu),)), self._kernels[0],
                     *K.elementwise_grid(self._items["y"]), fixed, **arrays)

    def backward_data(self, d_z: Any, w: Any, d_x: Any) -> None:
        self._launch(self._launches, LaunchKey("depthwise_backward_data"), self._kernels[1],
                     *K.elementwise_grid(self._items["x"]), self._sizes_given, d_z=d_z, w=w, d_x=d_x)

    def backward_filter(self, x: Any, d_z: Any, d_w: Any) -> None:
        fixed = {**self._partial_sizes, "partials": self._partials, "STRIPS": self._strips, "P": self._P}
        # The fast kernel: a thread a channel, every channel in one pass of the block.
        block = (min(1024, -(-self.spec.out_channels // K.WARP) * K.WARP) if self._fast_partials
                 else K.WARP * 4)
        self._launch(self._launches, LaunchKey("depthwise_weight_partials"), self._weight_partials, self._P,
                     block, fixed, x=x, d_z=d_z)
        self._launch(self._launches, LaunchKey("depthwise_weight_sum"), self._weight_sum,
                     *K.elementwise_grid(self._taps), {"partials": self._partials, "P": self._P, **self._sum_sizes},
                     d_w=d_w)
