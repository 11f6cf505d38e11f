"""The CUDA runtime pieces the backend needs: numba (importable under NumPy 2.5), the GPU
check, streams, and device arrays made from NumPy, `__cuda_array_interface__` objects or
torch tensors."""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable

import numpy as np

from conv2d.checks import c_contiguous_strides, check_numpy, describe
from conv2d.cuda.views import ForeignArray
from conv2d.dtypes import storage_dtype
from conv2d.spec import DType

INSTALL_HINT = ("install the GPU extra for your CUDA driver: pip install 'conv2d[cuda13]' "
                "(or 'conv2d[cuda12]'), on a machine with an NVIDIA GPU and driver")


class CudaUnavailableError(RuntimeError):
    """No usable GPU, driver or GPU library; the message says what to install."""


def simulating() -> bool:
    """Whether numba runs CUDA kernels in its CPU simulator (NUMBA_ENABLE_CUDASIM=1)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


@contextlib.contextmanager
def _numpy_row_stack_alias():
    # numba-cuda 0.30 registers an overload for np.row_stack when its CUDA target loads;
    # NumPy 2.5 removed that alias of np.vstack, so the import fails with AttributeError.
    # The alias exists only while that module loads, and only where NumPy lacks it.
    if hasattr(np, "row_stack"):
        yield
        return
    np.row_stack = np.vstack
    try:
        yield
    finally:
        del np.row_stack


def numba_cuda():
    """`numba.cuda`, with its array module loaded under the NumPy 2.5 workaround."""
    try:
        with _numpy_row_stack_alias():
            from numba import cuda
            if not simulating():
                import numba.cuda.np.arrayobj  # noqa: F401  (the module that reads np.row_stack)
    except ImportError as e:
        raise CudaUnavailableError(f"numba-cuda is not importable ({e}); {INSTALL_HINT}") from e
    return cuda


def require_gpu():
    """`numba.cuda` once a GPU is known to be usable, else CudaUnavailableError."""
    cuda = numba_cuda()
    if simulating():
        raise CudaUnavailableError("the CUDA backend needs a real GPU: NUMBA_ENABLE_CUDASIM=1 is set "
                                   "(the simulator runs only the numba kernels, not cuDNN)")
    try:
        available = cuda.is_available()
    except Exception as e:  # a broken driver install raises rather than answering
        raise CudaUnavailableError(f"the CUDA driver could not be initialised ({e}); {INSTALL_HINT}") from e
    if not available:
        raise CudaUnavailableError(f"no NVIDIA GPU is usable (numba.cuda.is_available() is False); {INSTALL_HINT}")
    return cuda


def stream_handle(stream: Any) -> int:
    """The CUstream of a numba stream as an int (0 for the default stream)."""
    h = stream.handle
    if hasattr(h, "value"):  # ctypes c_void_p (numba's ctypes binding)
        return int(h.value or 0)
    return int(h)  # cuda.bindings CUstream


def same_stream(a: Any, b: Any) -> bool:
    """Whether two numba streams are one CUDA stream: the same object, or the same CUstream
    (numba's simulator's streams have no handle: there only the same object)."""
    if a is b:
        return True
    return hasattr(a, "handle") and hasattr(b, "handle") and stream_handle(a) == stream_handle(b)


def as_stream(cuda, stream: Any):
    """A numba stream: a new one for None, else the caller's (numba stream, raw handle
    int, or any object with `cuda_stream` (torch) or `ptr` (cupy))."""
    if stream is None:
        return cuda.stream()
    if hasattr(stream, "synchronize") and (hasattr(stream, "handle") or simulating()):
        return stream  # a numba stream (the simulator's have no handle)
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return cuda.external_stream(int(getattr(stream, attr)))
    if isinstance(stream, int) and not isinstance(stream, bool):
        return cuda.external_stream(stream)
    raise TypeError(f"stream: expected a numba stream, a CUstream int, or an object with "
                    f"cuda_stream/ptr, got {describe(stream)}")


# How storage dtypes live on the device: numba has no bfloat16, so bfloat16 arrays are
# their uint16 bit patterns there (rounded to nearest even by the kernels).
_UINT16 = np.dtype(np.uint16)


def device_dtype(dtype: DType) -> np.dtype:
    return _UINT16 if dtype == DType.BFLOAT16 else storage_dtype(dtype)


def to_device_bits(a: np.ndarray) -> np.ndarray:
    """The host array as the device stores it (bfloat16 viewed as uint16)."""
    return a.view(np.uint16) if a.dtype == storage_dtype(DType.BFLOAT16) else a


def from_device_bits(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The inverse of `to_device_bits` for an array copied back to the host."""
    return a.view(dtype) if a.dtype != dtype else a


_TYPESTR = {"torch.float32": "<f4", "torch.float16": "<f2", "torch.bfloat16": "<u2", "torch.int64": "<i8"}
_TORCH_DTYPES: dict = {}  # an array's dtype object -> (is torch's, device dtype or None), seen once


def _torch_dtype(a: Any) -> tuple[bool, np.dtype | None]:
    """(whether `a`'s dtype is a torch dtype, the device dtype of its storage: float32,
    float16, or uint16 for bfloat16; None for other torch dtypes), cached per dtype
    (str() of a torch dtype costs a microsecond, and this runs for every tensor a step)."""
    dt = getattr(a, "dtype", None)
    found = _TORCH_DTYPES.get(dt)
    if found is None:
        name = str(dt) if dt is not None else ""
        typestr = _TYPESTR.get(name)
        found = (name.startswith("torch."), None if typestr is None else np.dtype(typestr))
        if dt is not None:
            _TORCH_DTYPES[dt] = found
    return found


def _dtypes(dtype: DType | np.dtype) -> tuple[np.dtype, np.dtype]:
    """(host dtype, device dtype) of a layer dtype, or of a NumPy dtype stored as itself
    (num_batches_tracked's int64)."""
    if isinstance(dtype, np.dtype):
        return dtype, dtype
    return storage_dtype(dtype), device_dtype(dtype)


def _want(dtype: DType | np.dtype) -> str:
    st, dev_dt = _dtypes(dtype)
    return f"{st}" + (" (or uint16 bfloat16 bits)" if dev_dt != st else "")


def device_view(cuda, name: str, a: Any, dtype: DType | np.dtype, shape: tuple[int, ...] | None = None,
                flat: bool = False) -> Any:
    """A device array over the device array `a` (numba, torch CUDA, or any
    `__cuda_array_interface__` object such as CuPy's), no copy, after checking its dtype
    (the storage dtype, or uint16 bits for bfloat16), C-contiguity and, if given, `shape`
    (with `flat`, its size alone); `flat` gives a 1-D view. Raises before any work.
    A torch tensor gives a `views.ForeignArray` (its address; numba's array only when
    numba is handed it), anything else a numba array. `dtype`: a layer dtype, or a NumPy
    dtype the device stores as is (int64)."""
    st, dev_dt = _dtypes(dtype)
    got_shape = tuple(a.shape)
    size = math.prod(got_shape)  # math.prod: np.prod costs microseconds, and this runs on every call
    if shape is not None and got_shape != tuple(shape) and not (flat and size == math.prod(shape)):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {describe(a)}")
    is_torch, torch_dev_dt = _torch_dtype(a)
    if is_torch:
        if not a.is_cuda:
            raise TypeError(f"{name}: expected a CUDA tensor, a device array or a NumPy array, got a CPU tensor")
        if torch_dev_dt != dev_dt:
            raise TypeError(f"{name}: expected dtype {st}, got {describe(a)} (nothing is cast silently)")
        if not a.is_contiguous():
            raise ValueError(f"{name}: expected a C-contiguous array, got strides {tuple(a.stride())} (elements)")
        return ForeignArray(a.data_ptr(), (size,) if flat else got_shape, dev_dt, a)
    if type(a) is ForeignArray or (hasattr(a, "copy_to_host") and hasattr(a, "is_c_contiguous")):
        # numba's own device arrays: checked from their attributes and used as they are.
        if np.dtype(a.dtype) != dev_dt:
            raise TypeError(f"{name}: expected dtype {_want(dtype)}, got {describe(a)} (nothing is cast silently)")
        if not a.is_c_contiguous():
            raise ValueError(f"{name}: expected a C-contiguous array, got strides {tuple(a.strides)} (bytes)")
        return a.reshape(size) if flat and a.ndim != 1 else a
    if hasattr(a, "__cuda_array_interface__"):
        iface = a.__cuda_array_interface__
        got_dt = np.dtype(iface["typestr"])
        if got_dt != dev_dt and got_dt != st:
            raise TypeError(f"{name}: expected dtype {_want(dtype)}, got {describe(a)} (nothing is cast silently)")
        strides = iface.get("strides")
        if strides is not None and tuple(strides) != c_contiguous_strides(got_shape, got_dt.itemsize):
            raise ValueError(f"{name}: expected a C-contiguous array, got strides {tuple(strides)} (bytes)")
        view = cuda.as_cuda_array(a, sync=False)
        return view.reshape(size) if flat and view.ndim != 1 else view
    raise TypeError(f"{name}: expected a numpy.ndarray or a device array with __cuda_array_interface__, "
                    f"got {describe(a)}")


def device_input(cuda, name: str, a: Any, shape: tuple[int, ...], dtype: DType, stream,
                 allocate: Callable[[tuple[int, ...], np.dtype], Any]) -> Any:
    """A numba device array for argument `a` of exactly `shape`, checked before any copy
    or launch: NumPy arrays are copied (`copy_into`, on `stream`) into a new block from
    `allocate(shape, dtype)` (a layer's output blocks); device arrays (numba, torch CUDA
    tensors, `__cuda_array_interface__` objects) are used in place."""
    if isinstance(a, np.ndarray):
        check_numpy(name, a, shape, storage_dtype(dtype))
        bits = to_device_bits(a)
        d = allocate(bits.shape, bits.dtype)
        copy_into(d, bits, stream)
        return d
    if not hasattr(a, "shape"):
        raise TypeError(f"{name}: expected a numpy.ndarray or a device array with __cuda_array_interface__, "
                        f"got {describe(a)}")
    return device_view(cuda, name, a, dtype, shape)


def copy_into(dst: Any, src: np.ndarray, stream) -> None:
    """dst[...] = src: the C-contiguous host array `src` into the numba device array `dst`
    of the same byte size, queued on `stream` (one cuMemcpyHtoDAsync; from pageable memory
    it returns once `src` has been read, so `src` may change after). numba's
    `copy_to_device` walks the device array's extents in Python first, O(size): 0.6 ms a
    call under cProfile on the H200 for a (32, 10, 10, 4) batch, half of the breakout
    demo's time. In the simulator: numba's."""
    if src.nbytes != dst.size * dst.dtype.itemsize:
        raise ValueError(f"copy: {src.nbytes} bytes into a device array of {dst.size * dst.dtype.itemsize}")
    if simulating():
        dst.copy_to_device(src.reshape(dst.shape).view(dst.dtype), stream=stream)
        return
    from cuda.bindings import driver

    from conv2d.cuda.launch import device_pointer

    if src.nbytes:
        err, = driver.cuMemcpyHtoDAsync(device_pointer(dst), src.ctypes.data, src.nbytes,
                                        driver.CUstream(stream_handle(stream)))
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyHtoDAsync: {err}")


class _Interface:
    """A `__cuda_array_interface__` over memory another object owns (kept alive here)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: Any) -> None:
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "version": 2, "strides": None, "stream": None}
        self.owner = owner


def torch_tensor_over(a: Any, ptr: int, shape: tuple[int, ...], dtype: DType) -> Any:
    """A torch CUDA tensor over the device memory of numba array `a` (at `ptr`), no copy;
    bfloat16 as torch.bfloat16 (viewed from its 16-bit integer bits)."""
    import torch

    bf16 = DType(dtype) is DType.BFLOAT16
    typestr = "<i2" if bf16 else storage_dtype(dtype).str
    t = torch.as_tensor(_Interface(ptr, shape, typestr, a), device="cuda")
    return t.view(torch.bfloat16) if bf16 else t


_TORCH_OF: dict = {}


def torch_dtype(dtype: DType) -> Any:
    found = _TORCH_OF.get(dtype)
    if found is None:
        import torch

        found = _TORCH_OF[dtype] = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16,
                                    DType.BFLOAT16: torch.bfloat16}[DType(dtype)]
    return found


def torch_current_stream(t: Any) -> int:
    """The CUstream of torch's current stream on tensor t's device, as an int."""
    from conv2d.cuda.private import torch_raw_stream

    return torch_raw_stream(t.get_device())


def zero_fill(cuda, a: Any, stream) -> None:
    """a[...] = 0 on `stream` (a memset; in numba's simulator, a host write)."""
    if simulating():
        a.copy_to_device(np.zeros(a.shape, a.dtype))
        return
    from cuda.bindings import driver

    from conv2d.cuda.launch import device_pointer

    nbytes = int(a.size) * a.dtype.itemsize
    if nbytes:
        err, = driver.cuMemsetD8Async(device_pointer(a), 0, nbytes, driver.CUstream(stream_handle(stream)))
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemsetD8Async: {err}")
