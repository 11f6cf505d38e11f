"""The padding modes' index rule, shared by every backend: which input position each
padded position of an axis copies. The reference pads and unpads with it
(reference/conv.py), the CUDA padding kernels read tables made from it
(cuda/kernels/padding.py), so no backend repeats the modes' rules."""

from __future__ import annotations

import numpy as np


def sources(size: int, before: int, after: int, mode: str) -> np.ndarray:
    """For each of the before + size + after padded positions of one axis, the input
    position it copies (-1: a zero)."""
    j = np.arange(-before, size + after)
    if mode == "zeros":
        return np.where((j >= 0) & (j < size), j, -1)
    if mode == "reflect":
        return np.where(j < 0, -j, np.where(j >= size, 2 * (size - 1) - j, j))
    if mode == "replicate":
        return np.clip(j, 0, size - 1)
    return j % size  # circular
