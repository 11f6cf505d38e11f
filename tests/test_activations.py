"""The activation table: each f(x) and f'(x) against the design's formulas."""

import math
import warnings

import numpy as np
import pytest

from conv2d.activations import Activation, derivative, forward

K_TANH = math.sqrt(2 / math.pi)
K_ORIGINAL = 0.5 * math.sqrt(2 / math.pi)
CUBIC_F32 = float(np.float32(0.044715))


def _fast_tanh(x):
    c = min(max(x, -3.0), 3.0)
    return c * (27 + c * c) / (27 + 9 * c * c)


# The table of DESIGN.md, one scalar at a time with Python's math module.
FORMULAS = {
    Activation.IDENTITY: lambda x: x,
    Activation.RELU: lambda x: max(x, 0.0),
    Activation.TANH: math.tanh,
    Activation.SIGMOID: lambda x: 1 / (1 + math.exp(-x)),
    Activation.FAST_TANH: _fast_tanh,
    Activation.GELU_TANH: lambda x: 0.5 * x * (1 + math.tanh(K_TANH * (x + 0.044715 * x**3))),
    Activation.GELU: lambda x: 0.5 * x * (1 + math.erf(x / math.sqrt(2))),
    # rl_tools' cubic coefficient is the C++ float literal 0.044715f: that float32 value.
    Activation.GELU_ORIGINAL: lambda x: 0.5 * x * (1 + math.tanh(K_ORIGINAL * (x + CUBIC_F32 * x**3))),
    Activation.SILU: lambda x: x / (1 + math.exp(-x)),
    Activation.RELU6: lambda x: min(max(x, 0.0), 6.0),
    Activation.HARDSWISH: lambda x: x * min(max(x + 3.0, 0.0), 6.0) / 6.0,
    Activation.LEAKY_RELU: lambda x: x if x > 0 else 0.01 * x,  # PyTorch's default negative_slope
    Activation.ELU: lambda x: x if x > 0 else math.expm1(x),  # PyTorch's default alpha, 1
}
# Points away from the kinks: ReLU's and ReLU6's at 0 (and 6), fast_tanh's clamp and
# hardswish's ends at +-3.
GRID = np.array([-7.3, -3.4, -2.9, -1.1, -0.37, -0.01, 0.02, 0.45, 1.3, 2.8, 3.3, 6.1])


@pytest.mark.parametrize("act", list(Activation))
def test_forward_matches_the_formula(act):
    want = np.array([FORMULAS[act](float(v)) for v in GRID])
    np.testing.assert_allclose(forward(act, GRID), want, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("act", [a for a in Activation if a is not Activation.FAST_TANH])
def test_derivative_is_the_exact_derivative(act):
    h = 1e-6
    numeric = np.array([(FORMULAS[act](v + h) - FORMULAS[act](v - h)) / (2 * h) for v in GRID])
    np.testing.assert_allclose(derivative(act, GRID), numeric, rtol=1e-7, atol=1e-8)


def test_fast_tanh_derivative_is_one_minus_its_square_as_the_original():
    f = forward(Activation.FAST_TANH, GRID)
    np.testing.assert_array_equal(derivative(Activation.FAST_TANH, GRID), 1 - f * f)


def test_relu_derivative_at_zero_is_zero():
    assert derivative(Activation.RELU, np.zeros(1))[0] == 0.0


@pytest.mark.parametrize("act, parameter, formula", [
    (Activation.LEAKY_RELU, 0.2, lambda x: x if x > 0 else 0.2 * x),
    (Activation.ELU, 0.7, lambda x: x if x > 0 else 0.7 * math.expm1(x))])
def test_the_parameter_of_leaky_relu_and_elu_is_used(act, parameter, formula):
    np.testing.assert_allclose(forward(act, GRID, parameter), [formula(float(v)) for v in GRID], rtol=1e-14)
    h = 1e-6
    numeric = [(formula(v + h) - formula(v - h)) / (2 * h) for v in GRID]
    np.testing.assert_allclose(derivative(act, GRID, parameter), numeric, rtol=1e-7, atol=1e-8)


def test_leaky_relu_and_elu_derivatives_at_zero_are_pytorchs():
    assert derivative(Activation.LEAKY_RELU, np.zeros(1), 0.2)[0] == 0.2
    assert derivative(Activation.ELU, np.zeros(1), 0.7)[0] == 0.7


def test_relu6_and_hardswish_derivatives_at_their_kinks_are_pytorchs():
    # PyTorch 2.13: ReLU6 (hardtanh) passes the gradient strictly inside (0, 6);
    # hardswish's is 0 at -3 and 1 at 3 (x / 3 + 1/2 strictly between).
    np.testing.assert_array_equal(derivative(Activation.RELU6, np.array([0.0, 6.0])), [0.0, 0.0])
    np.testing.assert_array_equal(derivative(Activation.HARDSWISH, np.array([-3.0, 3.0])), [0.0, 1.0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("act", list(Activation))
def test_dtype_is_preserved(act, dtype):
    x = GRID.astype(dtype)
    assert forward(act, x).dtype == dtype
    assert derivative(act, x).dtype == dtype


@pytest.mark.parametrize("act", list(Activation))
def test_large_inputs_give_finite_values_without_warnings(act):
    x = np.array([-1e4, -800.0, 800.0, 1e4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f, d = forward(act, x), derivative(act, x)
    assert np.isfinite(f).all() and np.isfinite(d).all()


@pytest.mark.parametrize("act", list(Activation))
def test_nan_propagates_through_forward(act):
    assert np.isnan(forward(act, np.array([np.nan]))[0])


def test_gelu_original_uses_rl_tools_float32_cubic_coefficient_exactly_in_float64():
    """rl_tools writes 0.044715f: its float32 value, not the double 0.044715 (a 1e-9
    relative difference in float64 against the compiled library otherwise)."""
    cubic = CUBIC_F32
    x = np.linspace(-4, 4, 101)
    t = np.tanh(K_ORIGINAL * (x + cubic * x**3))
    np.testing.assert_array_equal(forward(Activation.GELU_ORIGINAL, x), 0.5 * x * (1.0 + t))
    want_d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K_ORIGINAL * (1.0 + 3.0 * cubic * x * x)
    np.testing.assert_array_equal(derivative(Activation.GELU_ORIGINAL, x), want_d)
    assert not np.array_equal(forward(Activation.GELU_ORIGINAL, x),
                              0.5 * x * (1.0 + np.tanh(K_ORIGINAL * (x + 0.044715 * x**3))))
