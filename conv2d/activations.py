"""The activation table of the design, for both backends.

`Activation` names them; `CONSTANTS` holds the numbers the formulas use (the CUDA kernels
read the same ones); `forward(act, x)` and `derivative(act, x)` are the NumPy versions,
elementwise over an array of any shape in float32 or float64. The derivative is taken at
the activation's input `x`, never at its output.
"""

from __future__ import annotations

import math
from enum import Enum

import numpy as np
from scipy import special


class Activation(str, Enum):
    IDENTITY = "identity"
    RELU = "relu"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    FAST_TANH = "fast_tanh"
    GELU_TANH = "gelu_tanh"
    GELU = "gelu"
    GELU_ORIGINAL = "gelu_original"
    SILU = "silu"
    RELU6 = "relu6"
    HARDSWISH = "hardswish"
    LEAKY_RELU = "leaky_relu"
    ELU = "elu"


# Activations whose derivative jumps (ReLU's at 0): gradients through them get a wider
# tolerance in low precision (conv2d.dtypes.tolerance).
JUMPING_DERIVATIVE = frozenset({Activation.RELU, Activation.RELU6, Activation.HARDSWISH, Activation.LEAKY_RELU,
                                Activation.ELU})

# k of the tanh approximation of GELU: PyTorch's approximate="tanh" uses sqrt(2/pi); the
# original C++ library used half of it, kept so that its trained models load unchanged.
GELU_TANH_K = math.sqrt(2.0 / math.pi)
GELU_ORIGINAL_K = 0.5 * math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715
# rl_tools writes the cubic coefficient of its own GELU as the C++ float literal 0.044715f:
# gelu_original, rl_tools' activation, uses exactly that float32 value (in float64 too), so
# that its results match the compiled library's; gelu_tanh keeps PyTorch's double.
GELU_ORIGINAL_CUBIC = float(np.float32(GELU_CUBIC))
FAST_TANH_CLAMP = 3.0
RELU6_CAP = 6.0  # ReLU6: min(max(x, 0), 6); hardswish: x * relu6(x + 3) / 6
HARDSWISH_SHIFT = 3.0
# The parameters' defaults (PyTorch's): LeakyReLU's negative_slope, ELU's alpha.
DEFAULT_PARAMETER = {Activation.LEAKY_RELU: 0.01, Activation.ELU: 1.0}
INV_SQRT2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_tanh(x: np.ndarray, k: float, cubic: float) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(k * (x + cubic * x**3)))


def _gelu_tanh_derivative(x: np.ndarray, k: float, cubic: float) -> np.ndarray:
    t = np.tanh(k * (x + cubic * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * cubic * x * x)


def _fast_tanh(x: np.ndarray) -> np.ndarray:
    c = np.clip(x, -FAST_TANH_CLAMP, FAST_TANH_CLAMP)
    c2 = c * c
    return c * (27.0 + c2) / (27.0 + 9.0 * c2)


def forward(act: Activation, x: np.ndarray, parameter: float | None = None) -> np.ndarray:
    """f(x), same shape and dtype as `x`; `parameter`: LeakyReLU's negative_slope or ELU's
    alpha (LayerSpec.activation_parameter; PyTorch's default when None)."""
    dt = x.dtype.type
    p = dt(DEFAULT_PARAMETER.get(act, 0.0) if parameter is None else parameter)
    if act is Activation.IDENTITY:
        return x.copy()
    if act is Activation.RELU:
        return np.maximum(x, dt(0))
    if act is Activation.TANH:
        return np.tanh(x)
    if act is Activation.SIGMOID:
        return special.expit(x)
    if act is Activation.FAST_TANH:
        return _fast_tanh(x).astype(x.dtype, copy=False)
    if act is Activation.GELU_TANH:
        return _gelu_tanh(x, dt(GELU_TANH_K), GELU_CUBIC).astype(x.dtype, copy=False)
    if act is Activation.GELU_ORIGINAL:
        return _gelu_tanh(x, dt(GELU_ORIGINAL_K), GELU_ORIGINAL_CUBIC).astype(x.dtype, copy=False)
    if act is Activation.GELU:
        return (dt(0.5) * x * (dt(1) + special.erf(x * dt(INV_SQRT2)))).astype(x.dtype, copy=False)
    if act is Activation.SILU:
        return x * special.expit(x)
    if act is Activation.RELU6:
        return np.clip(x, dt(0), dt(RELU6_CAP))  # NaN stays NaN
    if act is Activation.HARDSWISH:
        return x * np.clip(x + dt(HARDSWISH_SHIFT), dt(0), dt(RELU6_CAP)) / dt(RELU6_CAP)
    if act is Activation.LEAKY_RELU:
        return np.where(x > 0, x, x * p)
    if act is Activation.ELU:
        return np.where(x > 0, x, p * np.expm1(np.minimum(x, dt(0))))
    raise ValueError(f"activation: unknown {act!r}")


def derivative(act: Activation, x: np.ndarray, parameter: float | None = None) -> np.ndarray:
    """f'(x) at the activation's input `x`, same shape and dtype as `x` (`parameter` as
    `forward`'s)."""
    dt = x.dtype.type
    p = dt(DEFAULT_PARAMETER.get(act, 0.0) if parameter is None else parameter)
    if act is Activation.IDENTITY:
        return np.ones_like(x)
    if act is Activation.RELU:
        return (x > 0).astype(x.dtype)
    if act is Activation.TANH:
        t = np.tanh(x)
        return dt(1) - t * t
    if act is Activation.SIGMOID:
        s = special.expit(x)
        return s * (dt(1) - s)
    if act is Activation.FAST_TANH:
        # As the original library: 1 - f(x)^2, which is not f's exact derivative.
        f = _fast_tanh(x)
        return (1.0 - f * f).astype(x.dtype, copy=False)
    if act is Activation.GELU_TANH:
        return _gelu_tanh_derivative(x, dt(GELU_TANH_K), GELU_CUBIC).astype(x.dtype, copy=False)
    if act is Activation.GELU_ORIGINAL:
        return _gelu_tanh_derivative(x, dt(GELU_ORIGINAL_K), GELU_ORIGINAL_CUBIC).astype(x.dtype, copy=False)
    if act is Activation.GELU:
        cdf = dt(0.5) * (dt(1) + special.erf(x * dt(INV_SQRT2)))
        pdf = np.exp(dt(-0.5) * x * x) * dt(INV_SQRT_2PI)
        return (cdf + x * pdf).astype(x.dtype, copy=False)
    if act is Activation.SILU:
        s = special.expit(x)
        return s * (dt(1) + x * (dt(1) - s))
    if act is Activation.RELU6:
        # As PyTorch: 1 strictly inside (0, 6), 0 at and beyond the ends.
        return ((x > 0) & (x < dt(RELU6_CAP))).astype(x.dtype)
    if act is Activation.HARDSWISH:
        # As PyTorch (2.13): 0 up to -3, x / 3 + 1/2 strictly between -3 and 3, 1 from 3 on.
        middle = x / dt(HARDSWISH_SHIFT) + dt(0.5)
        return np.where(x <= -dt(HARDSWISH_SHIFT), dt(0), np.where(x < dt(HARDSWISH_SHIFT), middle, dt(1))
                        ).astype(x.dtype, copy=False)
    if act is Activation.LEAKY_RELU:
        # As PyTorch: the slope at and below 0.
        return np.where(x > 0, dt(1), p).astype(x.dtype, copy=False)
    if act is Activation.ELU:
        # As PyTorch: alpha * exp(x) at and below 0.
        return np.where(x > 0, dt(1), p * np.exp(np.minimum(x, dt(0)))).astype(x.dtype, copy=False)
    raise ValueError(f"activation: unknown {act!r}")
