"""bfloat16 <-> float32 casts of the CPU backend, compiled (numba's CPU compiler): with
conv2d.cpu.kernels and conv2d.cpu.conv_kernels, the modules of conv2d/cpu that import
numba.

ml_dtypes' casts run ~10x slower than a copy (one element at a time through its ufunc
loop): a bfloat16 network's step spent a third of its time in them. These are the same
roundings on the bits: float32 -> bfloat16 rounds to nearest even and makes every NaN
the quiet NaN 0x7FC0 with its sign, as ml_dtypes does (all 2**32 float32 values
compared when this was written; tests/test_cpu_backend.py compares the edge cases);
bfloat16 -> float32 is exact. The tasks are chunks of CAST_CHUNK elements
(conv2d.cpu.kernels.run_tasks).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import njit

from conv2d.cpu.kernels import run_tasks

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_FLOAT32 = np.dtype(np.float32)
CAST_CHUNK = 1 << 16  # elements a task


@njit(inline="always", cache=True)
def _nearest(u):
    """The bfloat16 bits nearest the float32 bits `u`: to nearest, ties to even; a NaN
    the quiet NaN with its sign. Python-int constants: the arithmetic in int64 vectorises
    (numba's uint32 constants made the loops ten times slower)."""
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return ((u >> 16) & 0x8000) | 0x7FC0
    return (u + (0x7FFF + ((u >> 16) & 1))) >> 16


@njit(nogil=True, cache=True)
def _to_bfloat16(first, end, src, dst):
    lo, hi = first * CAST_CHUNK, min(src.size, end * CAST_CHUNK)
    s, d = src[lo:hi], dst[lo:hi]
    for i in range(s.size):  # _nearest written out: as a call this loop ran 1.5x slower
        u = s[i]
        if (u & 0x7FFFFFFF) > 0x7F800000:
            d[i] = ((u >> 16) & 0x8000) | 0x7FC0
        else:
            d[i] = (u + (0x7FFF + ((u >> 16) & 1))) >> 16


@njit(nogil=True, cache=True)
def _from_bfloat16(first, end, src, dst):
    lo, hi = first * CAST_CHUNK, min(src.size, end * CAST_CHUNK)
    s, d = src[lo:hi], dst[lo:hi]
    for i in range(s.size):
        d[i] = s[i] << 16


@njit(nogil=True, cache=True)
def _through_bfloat16(first, end, src, dst):
    lo, hi = first * CAST_CHUNK, min(src.size, end * CAST_CHUNK)
    s, d = src[lo:hi], dst[lo:hi]
    for i in range(s.size):
        d[i] = _nearest(s[i]) << 16


@njit(nogil=True, cache=True)
def _through_bfloat16_in_place(first, end, a):
    # One array, not _through_bfloat16 with src and dst the same: LLVM's runtime check
    # finds the two overlapping and runs its scalar loop, 11x slower (98,304 values:
    # 41 us against 3.7).
    lo, hi = first * CAST_CHUNK, min(a.size, end * CAST_CHUNK)
    s = a[lo:hi]
    for i in range(s.size):
        s[i] = _nearest(s[i]) << 16


def cast(a: np.ndarray, dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """`a.astype(dtype, copy=False)`, the same bits; bfloat16 <-> float32 of a C-contiguous
    array by the compiled loops. `out`: a C-contiguous array of a's shape and of `dtype`
    to write into (even where the dtypes are one), returned."""
    compiled = a.flags.c_contiguous and {a.dtype, dtype} == {BFLOAT16, _FLOAT32}
    if out is not None and not compiled:
        out[...] = a  # NumPy's cast (a copy where the dtypes are one)
        return out
    if a.dtype == dtype:
        return a
    if not compiled:
        return a.astype(dtype)
    if out is None:
        out = np.empty(a.shape, dtype)
    to = a.dtype == _FLOAT32
    src, dst = a.reshape(-1).view(np.uint32 if to else np.uint16), out.reshape(-1).view(np.uint16 if to else np.uint32)
    run_tasks(_to_bfloat16 if to else _from_bfloat16, -(-a.size // CAST_CHUNK), a.size, src, dst)
    return out


def through(a: np.ndarray, dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """`a.astype(dtype).astype(a.dtype)`: `a` rounded to `dtype`'s precision, kept in its
    own dtype (float32 through bfloat16 in one compiled pass). `out`: where to write it
    (a C-contiguous array like `a`, `a` itself included: each value is read before it is
    written), returned."""
    if a.dtype == dtype:
        return a
    if not a.flags.c_contiguous or a.dtype != _FLOAT32 or dtype != BFLOAT16:
        if out is None:
            return a.astype(dtype).astype(a.dtype)
        out[...] = a.astype(dtype)
        return out
    tasks = -(-a.size // CAST_CHUNK)
    if out is a:
        run_tasks(_through_bfloat16_in_place, tasks, a.size, a.reshape(-1).view(np.uint32))
        return a
    if out is None:
        out = np.empty_like(a)
    run_tasks(_through_bfloat16, tasks, a.size, a.reshape(-1).view(np.uint32), out.reshape(-1).view(np.uint32))
    return out

