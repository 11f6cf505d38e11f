"""Argument checks shared by the layer and both backends; each raises before anything changes."""

from __future__ import annotations

import warnings

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from conv2d.spec import LayerSpec


def c_contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def describe(a: Any) -> str:
    shape = getattr(a, "shape", None)
    dtype = getattr(a, "dtype", None)
    if shape is None:
        return f"a {type(a).__name__}"
    return f"a {type(a).__name__} of shape {tuple(shape)} and dtype {dtype}"


def check_shape_dtype(name: str, a: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """`a` must have exactly `shape` and `dtype`: nothing is cast or reshaped for the caller."""
    got_shape = tuple(getattr(a, "shape", ()))
    if got_shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {describe(a)}")
    if np.dtype(a.dtype) != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {describe(a)} (cast it first; "
                        f"nothing is cast silently)")


def check_plain_array(name: str, a: Any, expected: str = "a numpy.ndarray") -> None:
    """`a` must be a NumPy array and not a masked one (whose mask every computation here
    would ignore)."""
    if isinstance(a, np.ma.MaskedArray):
        raise TypeError(f"{name}: expected {expected}, got {describe(a)} (a masked array: its mask would be ignored)")
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected {expected}, got {describe(a)}")


def check_numpy(name: str, a: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A C-contiguous NumPy array of `shape` and `dtype`, or a clear error."""
    check_plain_array(name, a)
    check_shape_dtype(name, a, shape, dtype)
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got one with strides {a.strides} "
                         f"(use numpy.ascontiguousarray)")
    return a


def warn_non_finite(name: str, a: np.ndarray) -> None:
    """A RuntimeWarning where `a` holds NaN or infinite values: state a diverged run left
    (one NaN batch makes the running statistics NaN) is saved and loaded as it is, so
    that it can be inspected, with a word that it is there."""
    finite = np.isfinite(a.astype(np.float64, copy=False))
    if not finite.all():
        warnings.warn(f"{name}: {int(finite.size - finite.sum())} NaN or infinite entries (a diverged run?), kept "
                      f"as they are", RuntimeWarning, stacklevel=3)


def check_finite(name: str, a: np.ndarray) -> None:
    # Comparing in float64 handles ml_dtypes' 16-bit types, which np.isfinite may not know.
    finite = np.isfinite(a.astype(np.float64, copy=False))
    if not finite.all():
        bad = int(finite.size - finite.sum())
        raise ValueError(f"{name}: expected finite values, got {bad} NaN or infinite entries")


def input_spec(name: str, a: Any, spec: "LayerSpec") -> "LayerSpec":
    """The spec of a call on input `a` (N, H, W, C): any N >= 1 and any H, W the kernel
    fits, with C the spec's in_channels (shape only; dtype and layout are checked apart)."""
    shape = tuple(getattr(a, "shape", ()))
    c = spec.in_channels
    if len(shape) != 4 or shape[3] != c or min(shape) < 1:
        raise ValueError(f"{name}: expected shape (N, H, W, {c}) with N, H, W >= 1, got {describe(a)}")
    try:
        return spec.at(int(shape[0]), int(shape[1]), int(shape[2]))
    except ValueError as e:
        spread = f" and dilation {spec.dilation}" if spec.dilation != (1, 1) else ""
        raise ValueError(f"{name}: the kernel {spec.kernel} with padding {spec.padding}{spread} does not fit an "
                         f"input of height {shape[1]} and width {shape[2]}, got {describe(a)}") from e
