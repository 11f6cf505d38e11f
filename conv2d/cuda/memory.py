"""The CUDA functions' outputs: fresh arrays without a device allocation per call
(`OutputAllocator`), and what a caller gets back (`Outputs`: arrays in the input's
library, host copies for NumPy callers, a frozen layer's fixed buffers).

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
from typing import Any, Callable, Mapping

import numpy as np

from conv2d.arrays import CUPY, NUMPY, TORCH
from conv2d.cuda.launch import device_pointer
from conv2d.cuda.private import array_over
from conv2d.cuda.runtime import (device_dtype, device_view, from_device_bits, simulating, torch_dtype,
                                 torch_tensor_over)
from conv2d.dtypes import storage_dtype
from conv2d.spec import DType, LayerSpec
from conv2d.state import grad_layout


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


class Outputs:
    """A layer's output arrays: `output` (y, d_x), `gradients` (fresh gradient arrays),
    `result` and `host` (what a NumPy caller gets: host copies after the stream ends).
    Torch callers get tensors from torch's allocator; CuPy callers CuPy arrays; others
    numba arrays from `allocator`. `current()` is the stream of the call."""

    def __init__(self, spec: LayerSpec, cuda: Any, allocator: OutputAllocator, current: Callable[[], Any]) -> None:
        self.spec, self.cuda, self.allocator, self.current = spec, cuda, allocator, current
        self.device_dtype, self.storage = device_dtype(spec.dtype), storage_dtype(spec.dtype)
        self._grad_layout = grad_layout(spec)

    def output(self, plan: Any, name: str, shape: tuple[int, ...], lib: str, like: Any) -> tuple[Any, Any]:
        """(device array the kernels write, what the caller gets) for output `name`."""
        if plan.frozen is not None:
            arr = plan.frozen[name]
            if lib == TORCH:
                wrapped = plan.wrapped.get(name)
                if wrapped is None:
                    wrapped = plan.wrapped[name] = torch_tensor_over(arr, device_pointer(arr), shape,
                                                                     self.spec.dtype)
                return arr, wrapped
        elif lib == TORCH:
            import torch

            t = torch.empty(shape, dtype=torch_dtype(self.spec.dtype), device=like.device)
            return device_view(self.cuda, name, t, self.spec.dtype), t
        else:
            arr = self.allocator.array(shape, self.device_dtype)
        if lib == CUPY:
            import cupy

            return arr, cupy.asarray(arr)
        return arr, arr

    def gradients(self, names: list[str], lib: str, like: Any) -> tuple[dict, dict]:
        """(flat device gradient arrays the kernels write, what the caller gets). Fresh
        gradients are not zeroed: cuDNN's backward-filter writes the weights' whole and
        the row kernels write the others (ACC_WRITE), four memsets a step less."""
        views, out = {}, {}
        for k in names:
            shape, dt = self._grad_layout[k]
            stored = dt == self.storage
            if lib == TORCH:
                import torch

                t = torch.empty(shape, dtype=torch_dtype(self.spec.dtype) if stored else torch.float32,
                                device=like.device)
                views[k], out[k] = device_view(self.cuda, k, t, self.spec.dtype if stored else DType.FLOAT32,
                                               flat=True), t
            else:
                a = self.cuda.device_array(math.prod(shape), self.device_dtype if stored else dt,
                                           stream=self.current())
                views[k] = a
                out[k] = a.reshape(shape)
        return views, out

    def result(self, out: Any, lib: str, stream: Any) -> Any:
        """NumPy callers get a host copy (after the stream finishes); others `out`."""
        if lib != NUMPY:
            return out
        host = out.copy_to_host(stream=stream)
        stream.synchronize()
        return from_device_bits(host, self.storage)

    def host(self, arrays: Mapping[str, Any], layout: Mapping[str, tuple] | None = None) -> dict[str, np.ndarray]:
        """Host copies of device arrays, each of its layout's (default: the gradient
        layout's) shape and dtype, after the current stream finishes."""
        layout = layout or self._grad_layout
        current = self.current()
        out = {k: from_device_bits(a.copy_to_host(stream=current), layout[k][1]).reshape(layout[k][0])
               for k, a in arrays.items()}
        current.synchronize()
        return out
