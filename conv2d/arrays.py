"""The caller's array library: which library an array comes from, NumPy views of host
arrays, and host results handed back in the caller's library.

NumPy in gives NumPy out; a torch CPU tensor in gives torch CPU tensors out, through
zero-copy views both ways (`Tensor.numpy()` and `torch.from_numpy`). NumPy has no
bfloat16 of its own: bfloat16 host arrays are `ml_dtypes.bfloat16`, and a torch bfloat16
tensor is viewed through its 16-bit integer bits. torch is imported only when the caller
brought a tensor. The CUDA backend's device arrays are handled in `conv2d.cuda.runtime`.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import zlib

import numpy as np

from conv2d.checks import check_plain_array, describe

NUMPY, TORCH, CUPY, NUMBA, CUDA_ARRAY = "numpy", "torch", "cupy", "numba", "cuda_array_interface"
# torch's device type of host memory (a torch device, not the backend of that name).
HOST_DEVICE = "cpu"
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def library(a: Any) -> str | None:
    """Which array library `a` belongs to: "numpy", "torch", "cupy", "numba", or
    "cuda_array_interface" for any other device array; None for anything else."""
    if isinstance(a, np.ndarray):
        return NUMPY
    root = type(a).__module__.partition(".")[0]
    if root in (TORCH, CUPY, NUMBA):
        return root
    if hasattr(a, "__cuda_array_interface__"):
        return CUDA_ARRAY
    return None


def host_view(name: str, a: Any) -> tuple[np.ndarray, str]:
    """(a NumPy view of `a`, its library) for a NumPy array or a torch CPU tensor; no copy."""
    lib = library(a)
    if lib == NUMPY:
        check_plain_array(name, a, "a numpy.ndarray or a torch CPU tensor")
        return a, lib
    if lib == TORCH and hasattr(a, "device"):
        if a.device.type != HOST_DEVICE:
            raise TypeError(f"{name}: expected a NumPy array or a torch CPU tensor (this backend runs on the CPU), "
                            f"got a tensor on {a.device}")
        import torch

        t = a.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BFLOAT16), lib
        return t.numpy(), lib
    raise TypeError(f"{name}: expected a numpy.ndarray or a torch CPU tensor, got {describe(a)}")


def to_library(a: np.ndarray, lib: str) -> Any:
    """The host result `a` in library `lib` ("numpy" or "torch"), without a copy."""
    if lib != TORCH:
        return a
    import torch

    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def same_memory(a: Any, b: Any) -> bool:
    """Whether two arrays of any library are the same object or view the same memory
    with the same shape and dtype."""
    if a is b:
        return True
    if library(a) != library(b) or tuple(getattr(a, "shape", ())) != tuple(getattr(b, "shape", ())):
        return False
    return _address(a) == _address(b) and str(a.dtype) == str(b.dtype)


def _address(a: Any) -> int | None:
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    if hasattr(a, "data_ptr"):
        return a.data_ptr()
    iface = getattr(a, "__cuda_array_interface__", None)
    return None if iface is None else iface["data"][0]


def content_mark(a: Any) -> tuple:
    """Something that changes when `a`'s values are changed in place, read in O(size):
    a torch tensor's version counter (advanced by every in-place torch operation) and,
    for host memory (NumPy, torch CPU), a CRC-32 of the bytes (writes through a NumPy
    view bypass torch's counter). Device arrays of other libraries have neither: ()."""
    mark: tuple = ()
    if library(a) == TORCH:
        mark += (a._version,)
    try:
        host, _ = host_view("a", a)
    except TypeError:
        return mark
    return mark + (zlib.crc32(np.ascontiguousarray(host).view(np.uint8).reshape(-1)),)


def equal_host_arrays(a: Any, b: Any) -> bool:
    """Whether two host arrays (NumPy or torch CPU) hold the same values, bit for bit."""
    try:
        x, _ = host_view("a", a)
        y, _ = host_view("b", b)
    except TypeError:
        return False
    return (x.shape == y.shape and x.dtype == y.dtype
            and np.array_equal(np.ascontiguousarray(x).view(np.uint8), np.ascontiguousarray(y).view(np.uint8)))


def to_host(a: Any, dtype: np.dtype | None = None) -> np.ndarray:
    """`a`'s values as a NumPy array: `a` itself for a NumPy array, a host copy of a
    numba, CuPy or torch array; with `dtype` bfloat16, arrays of uint16 bits (the CUDA
    backend's bfloat16) are viewed as bfloat16."""
    if isinstance(a, np.ndarray):
        out = a
    elif hasattr(a, "copy_to_host"):
        out = a.copy_to_host()
    elif hasattr(a, "get"):
        out = a.get()
    elif hasattr(a, "detach"):
        out = host_view("a", a.detach().cpu())[0].copy()
    else:
        raise TypeError(f"to_host: cannot copy a {type(a).__name__} to the host")
    if dtype is not None and out.dtype == np.uint16 and np.dtype(dtype) == BFLOAT16:
        out = out.view(dtype)
    return out
