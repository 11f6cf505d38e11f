"""Fresh output arrays from a stream-ordered memory pool.

numba's `device_array` calls cuMemAlloc, and frees through cuMemFree, which synchronises
the device: with two outputs a step (y, d_x), an eager training loop stalled on every
few steps (about 130 us a call measured on the H200). Outputs come instead from one
driver memory pool per device (cuMemAllocFromPoolAsync on the layer's stream; freed
with cuMemFreeAsync on that stream when the array is garbage-collected), which keeps
what it has reserved and costs a few microseconds, like PyTorch's caching allocator.
An output array belongs to the layer's stream: use it there, or synchronise first.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

from conv2d.checks import c_contiguous_strides
from conv2d.cuda.runtime import simulating, stream_handle

_POOLS: dict[int, Any] = {}
_LOCK = threading.Lock()


def _check(what: str, result: Any) -> Any:
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise MemoryError(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else (rest or None)


def _pool(device: int) -> Any:
    from cuda.bindings import driver

    with _LOCK:
        pool = _POOLS.get(device)
        if pool is None:
            props = driver.CUmemPoolProps()
            props.allocType = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            props.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            props.location.id = device
            pool = _check("cuMemPoolCreate", driver.cuMemPoolCreate(props))
            # Keep freed blocks for reuse instead of returning them at each synchronisation.
            _check("cuMemPoolSetAttribute", driver.cuMemPoolSetAttribute(
                pool, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, driver.cuuint64_t(2**64 - 1)))
            _POOLS[device] = pool
        return pool


def _free(driver, ptr: int, cu_stream: Any, stream: Any) -> None:
    # `stream` is held only to keep the layer's stream alive until its last output is freed.
    try:
        driver.cuMemFreeAsync(driver.CUdeviceptr(ptr), cu_stream)
    except Exception:  # interpreter shutdown: the context may be gone
        pass


class OutputAllocator:
    """Allocates a layer's output arrays (numba device arrays) on its stream."""

    def __init__(self, cuda: Any, stream: Any) -> None:
        self.cuda = cuda
        self.stream = stream
        self._pooled = not simulating()
        if self._pooled:
            from cuda.bindings import driver
            from numba.cuda.cudadrv import devicearray
            from numba.cuda.cudadrv import driver as numba_driver

            self._driver = driver
            self._devicearray = devicearray
            self._memory_pointer = numba_driver.MemoryPointer
            self._context = cuda.current_context()
            self._pool = _pool(self._context.device.id)
            self._cu_stream = driver.CUstream(stream_handle(stream))

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A new C-contiguous device array of `shape` and `dtype` (contents undefined)."""
        if not self._pooled:
            return self.cuda.device_array(shape, dtype, stream=self.stream)
        driver = self._driver
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        ptr = int(_check("cuMemAllocFromPoolAsync",
                         driver.cuMemAllocFromPoolAsync(max(nbytes, 1), self._pool, self._cu_stream)))
        memory = self._memory_pointer(self._context, driver.CUdeviceptr(ptr), nbytes,
                                      finalizer=functools.partial(_free, driver, ptr, self._cu_stream, self.stream))
        return self._devicearray.DeviceNDArray(shape, c_contiguous_strides(shape, dtype.itemsize), dtype,
                                               stream=self.stream, gpu_data=memory)
