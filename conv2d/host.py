"""Copying a backend's output arrays to the host, whatever library holds them."""

from __future__ import annotations

from typing import Any

import numpy as np

from conv2d.dtypes import storage_dtype
from conv2d.spec import DType


def as_numpy(a: Any, dtype: np.dtype | None = None) -> np.ndarray:
    """A host copy of a NumPy, numba, CuPy or torch array; with `dtype` bfloat16, device
    arrays of uint16 bits (the CUDA backend's bfloat16) are viewed as bfloat16."""
    if isinstance(a, np.ndarray):
        out = a
    elif hasattr(a, "copy_to_host"):
        out = a.copy_to_host()
    elif hasattr(a, "get"):
        out = a.get()
    elif hasattr(a, "detach"):
        from conv2d.arrays import host_array

        out = host_array("a", a.detach().cpu())[0].copy()
    else:
        raise TypeError(f"as_numpy: cannot copy a {type(a).__name__} to the host")
    if dtype is not None and out.dtype == np.uint16 and np.dtype(dtype) == storage_dtype(DType.BFLOAT16):
        out = out.view(dtype)
    return out
