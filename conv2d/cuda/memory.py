"""Fresh output arrays without a device allocation per call.

numba's `device_array` calls cuMemAlloc, and frees through cuMemFree, which synchronises
the device: with two outputs a step (y, d_x), an eager training loop stalled every few
steps (about 130 us a call measured on the H200). A layer's outputs come instead from
blocks it keeps: an output is a new numba array over a block; when the array is
garbage-collected its block goes back to the layer's free list (a list append in the
finaliser, no driver call), and the next output of that size reuses it. As with
PyTorch's caching allocator, reuse is ordered by the layer's stream: an output belongs
to that stream; work on it elsewhere must be synchronised with that stream before the
array is dropped.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from conv2d.cuda.private import array_over
from conv2d.cuda.runtime import simulating


class OutputAllocator:
    """Allocates a layer's output arrays (numba device arrays) for use on its stream."""

    def __init__(self, cuda: Any, stream: Any) -> None:
        self.cuda = cuda
        self.stream = stream
        self._free: dict[int, list] = {}  # bytes -> blocks (uint8 device arrays) not in use
        self._cached = not simulating()
        if self._cached:
            self._context = cuda.current_context()

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A new C-contiguous device array of `shape` and `dtype` (contents undefined)."""
        if not self._cached:
            return self.cuda.device_array(shape, dtype, stream=self.stream)
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize  # math.prod: np.prod costs microseconds a call
        free = self._free.setdefault(nbytes, [])
        block = free.pop() if free else self.cuda.device_array(max(nbytes, 1), np.uint8, stream=self.stream)
        return array_over(self._context, int(block.gpu_data.device_pointer), shape, dtype, stream=self.stream,
                          finalizer=_Return(free, block))


class _Return:
    """The finaliser of an output's memory: its block goes back to the free list."""

    __slots__ = ("free", "block")

    def __init__(self, free: list, block: Any) -> None:
        self.free, self.block = free, block

    def __call__(self) -> None:
        self.free.append(self.block)
