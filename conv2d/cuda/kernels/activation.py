"""The activation table (conv2d/activations.py) as numba device functions, one float32
scalar at a time, and the float32 constants the kernels share."""

from __future__ import annotations

import math

import numpy as np

from conv2d import activations as act_table
from conv2d.activations import Activation
from conv2d.cuda.runtime import numba_cuda

cuda = numba_cuda()
f32 = np.float32

# float32 constants: a bare Python float would promote the arithmetic to float64.
ZERO, ONE, HALF, TWO = f32(0), f32(1), f32(0.5), f32(2)
K_TANH = f32(act_table.GELU_TANH_K)
K_ORIGINAL = f32(act_table.GELU_ORIGINAL_K)
CUBIC = f32(act_table.GELU_CUBIC)
CUBIC3 = f32(3 * act_table.GELU_CUBIC)
CLAMP = f32(act_table.FAST_TANH_CLAMP)
INV_SQRT2 = f32(act_table.INV_SQRT2)
INV_SQRT_2PI = f32(act_table.INV_SQRT_2PI)
F27, F9 = f32(27), f32(9)
CAP6 = f32(act_table.RELU6_CAP)
SHIFT3 = f32(act_table.HARDSWISH_SHIFT)


# The activation table (conv2d/activations.py), one scalar at a time in float32.
@cuda.jit(device=True, inline=True)
def _fast_tanh(x):
    c = min(max(x, -CLAMP), CLAMP)
    c2 = c * c
    return c * (F27 + c2) / (F27 + F9 * c2)


@cuda.jit(device=True, inline=True)
def _sigmoid(x):
    return ONE / (ONE + math.exp(-x))


def activation_functions(act: Activation, parameter: float | None = None):
    """(f, f') device functions; f' is taken at the activation's input. `parameter`:
    LeakyReLU's negative_slope or ELU's alpha (PyTorch's default when None), a float32
    constant of the functions."""
    P = f32(act_table.DEFAULT_PARAMETER.get(act, 0.0) if parameter is None else parameter)
    if act is Activation.IDENTITY:
        def f(x): return x
        def d(x): return ONE
    elif act is Activation.RELU:
        def f(x): return x if (x > ZERO or x != x) else ZERO  # NaN stays NaN, as np.maximum
        def d(x): return ONE if x > ZERO else ZERO
    elif act is Activation.TANH:
        def f(x): return math.tanh(x)
        def d(x):
            t = math.tanh(x)
            return ONE - t * t
    elif act is Activation.SIGMOID:
        def f(x): return _sigmoid(x)
        def d(x):
            s = _sigmoid(x)
            return s * (ONE - s)
    elif act is Activation.FAST_TANH:
        def f(x): return _fast_tanh(x)
        def d(x):
            t = _fast_tanh(x)
            return ONE - t * t
    elif act in (Activation.GELU_TANH, Activation.GELU_ORIGINAL):
        k = K_TANH if act is Activation.GELU_TANH else K_ORIGINAL

        def f(x): return HALF * x * (ONE + math.tanh(k * (x + CUBIC * x * x * x)))
        def d(x):
            t = math.tanh(k * (x + CUBIC * x * x * x))
            return HALF * (ONE + t) + HALF * x * (ONE - t * t) * k * (ONE + CUBIC3 * x * x)
    elif act is Activation.GELU:
        def f(x): return HALF * x * (ONE + math.erf(x * INV_SQRT2))
        def d(x): return HALF * (ONE + math.erf(x * INV_SQRT2)) + x * math.exp(-HALF * x * x) * INV_SQRT_2PI
    elif act is Activation.SILU:
        def f(x): return x * _sigmoid(x)
        def d(x):
            s = _sigmoid(x)
            return s * (ONE + x * (ONE - s))
    elif act is Activation.RELU6:
        def f(x): return x if x != x else min(max(x, ZERO), CAP6)  # NaN stays NaN, as np.clip
        def d(x): return ONE if (x > ZERO and x < CAP6) else ZERO
    elif act is Activation.HARDSWISH:
        def f(x): return x if x != x else x * min(max(x + SHIFT3, ZERO), CAP6) / CAP6
        def d(x):
            if x <= -SHIFT3:
                return ZERO
            if x < SHIFT3:
                return x / SHIFT3 + HALF
            return ONE
    elif act is Activation.LEAKY_RELU:
        def f(x): return x if x > ZERO else x * P  # NaN: NaN * P, NaN as in NumPy
        def d(x): return ONE if x > ZERO else P
    elif act is Activation.ELU:
        def f(x): return x if x > ZERO else P * math.expm1(x)
        def d(x): return ONE if x > ZERO else P * math.exp(x)
    else:
        raise ValueError(f"activation: unknown {act!r}")
    return cuda.jit(device=True, inline=True)(f), cuda.jit(device=True, inline=True)(d)
