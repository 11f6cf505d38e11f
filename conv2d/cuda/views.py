"""Device arrays over memory another library owns (torch CUDA tensors), as the backend's
launches read them: an address, a shape and a dtype, the owner kept alive.

A prepared launch (`launch.Launch`) and a cuDNN execution (`cudnn_execution.Execution`) need only
the address. Viewing a torch tensor as numba's own DeviceNDArray computes its extents
in Python, several times this view's host time (a one-off probe, since removed: git
before commit 233f8cb), and the PyTorch module's step views some 25 tensors a step: `ForeignArray` is built instead, and numba's array only where numba
itself is handed the array (a launch being prepared, or going through numba's
dispatcher: `as_numba`), or when an attribute only numba's array has is asked for
(`copy_to_host`, `__cuda_array_interface__`, ...), which is then looked up on it.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np


class ForeignArray:
    """A C-contiguous device array of `shape` and `dtype` (the device's: bfloat16 as
    uint16) at address `ptr`, whose memory `owner` (a torch tensor) holds."""

    __slots__ = ("ptr", "shape", "dtype", "size", "owner", "device_ctypes_pointer", "_numba")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: Any) -> None:
        self.ptr, self.shape, self.dtype, self.owner = ptr, shape, dtype, owner
        self.size = math.prod(shape)
        self.device_ctypes_pointer = ctypes.c_void_p(ptr)  # what numba's arrays offer
        self._numba = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_c_contiguous(self) -> bool:
        return True

    def reshape(self, *shape: Any) -> "ForeignArray":
        """The same memory as another C-contiguous shape of the same size."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else tuple(shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape a device array of size {self.size} into shape {shape}")
        return ForeignArray(self.ptr, shape, self.dtype, self.owner)

    def numba(self) -> Any:
        """numba's device array over the same memory (made once)."""
        if self._numba is None:
            from conv2d.cuda.private import tensor_view
            from conv2d.cuda.runtime import numba_cuda

            self._numba = tensor_view(numba_cuda(), self.owner, self.shape, self.dtype)  # owner.data_ptr() is ptr
        return self._numba

    def __getattr__(self, name: str) -> Any:
        # Only attributes ForeignArray lacks get here: numba's array answers them.
        return getattr(self.numba(), name)

    def __repr__(self) -> str:
        return f"ForeignArray(0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype})"


def as_numba(a: Any) -> Any:
    """`a` as numba's dispatcher takes it: numba's array for a ForeignArray, else `a`."""
    return a.numba() if type(a) is ForeignArray else a
