"""The type policy: what each `DType` stores, computes in, and how far it may be from float64.

| policy   | activations, gradients, weights | accumulation, norm statistics and parameters |
| -------- | ------------------------------- | -------------------------------------------- |
| float64  | float64 (reference only)        | float64                                      |
| float32  | float32                         | float32                                      |
| float16  | float16                         | float32                                      |
| bfloat16 | bfloat16 (ml_dtypes)            | float32                                      |
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from conv2d.spec import DType

_STORAGE = {
    DType.FLOAT64: np.dtype(np.float64),
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
}

# Unit roundoff u = 2^-p for p significand bits (counting the implicit one): the largest
# relative error of one rounding to nearest.
UNIT_ROUNDOFF = {
    DType.FLOAT64: 2.0**-53,
    DType.FLOAT32: 2.0**-24,
    DType.FLOAT16: 2.0**-11,
    DType.BFLOAT16: 2.0**-8,
}

# Roundings to the storage type on the longest path from the float64 inputs to a result:
# x and W when cast in, the stored pre-activations, d_y when cast in, d_z before it feeds
# the two convolution gradients, and the result itself.
STORAGE_ROUNDINGS = 6

# Elementwise operations, each one rounding in the compute type, on the longest chain
# outside the sums: bias add, the norm's centring, scaling and affine, an activation and
# its derivative (a tanh or erf and about ten products), the norm's backward (six more).
ELEMENTWISE_ROUNDINGS = 32

# Confidence factor of the probabilistic bound (Higham & Mary, SIAM J. Sci. Comput. 2019):
# a length-n sum in precision u errs by at most lam*sqrt(n)*u relative to the sum of
# magnitudes with probability >= 1 - 2*exp(-lam^2 / 2); lam = 6 leaves ~3e-8 per element.
CONFIDENCE = 6.0


# A derivative with a jump (ReLU's at 0) turns a rounding of its input across the jump into
# an O(1) error of that term. A fraction ~u_s of the terms lie within one rounding of the
# jump, so a sum of n terms gains about sqrt(n * u_s) such errors against a sum of size
# ~sqrt(n): a relative error ~sqrt(u_s), whatever n. The factor 2 covers the spread of
# |z| / std(z) that widens that band.
JUMP_FACTOR = 2.0


def storage_dtype(dtype: DType) -> np.dtype:
    """The NumPy dtype of activations, gradients, weights and bias."""
    found = _STORAGE.get(dtype)  # DType members and their names hit directly (a str enum): no enum call
    return found if found is not None else _STORAGE[DType(dtype)]


def compute_dtype(dtype: DType) -> np.dtype:
    """The dtype of accumulation, norm statistics and norm parameters."""
    return np.dtype(np.float64) if DType(dtype) is DType.FLOAT64 else np.dtype(np.float32)


def tolerance(dtype: DType, reduction_length: int, jump: bool = False) -> float:
    """Largest allowed `max|got - want| / max|want|` of a result against the float64 oracle.

    `reduction_length` is the longest sum behind the result: KH*KW*IC for the forward
    convolution, KH*KW*OC for backward-data, N*OH*OW for backward-filter, the bias
    gradient and batch-norm statistics. The bound is CONFIDENCE * (STORAGE_ROUNDINGS * u_s
    + (ELEMENTWISE_ROUNDINGS + sqrt(n)) * u_c) with u_s, u_c the unit roundoffs of the
    storage and compute types,
    plus JUMP_FACTOR * sqrt(u_s) for gradients through a derivative with a jump (`jump`).
    """
    dtype = DType(dtype)
    if reduction_length < 1:
        raise ValueError(f"reduction_length: expected an int >= 1, got {reduction_length!r}")
    u_s = UNIT_ROUNDOFF[dtype]
    u_c = UNIT_ROUNDOFF[DType.FLOAT64] if dtype is DType.FLOAT64 else UNIT_ROUNDOFF[DType.FLOAT32]
    tol = CONFIDENCE * (STORAGE_ROUNDINGS * u_s + (ELEMENTWISE_ROUNDINGS + math.sqrt(reduction_length)) * u_c)
    if jump:
        tol += JUMP_FACTOR * math.sqrt(u_s)
    return tol
