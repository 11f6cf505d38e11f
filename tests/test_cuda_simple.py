"""The simple kernel set (conv2d/cuda/kernels/simple.py), each kernel against the reference function
it is named after, computed in float64: in numba's CUDA simulator where there is no GPU
(CI), on the GPU where there is."""

import numpy as np
import pytest

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")

import ml_dtypes  # noqa: E402

from conv2d import activations  # noqa: E402
from conv2d.activations import Activation  # noqa: E402
from conv2d.cuda.runtime import numba_cuda  # noqa: E402
from conv2d.cuda.kernels.simple import grid, simple_set  # noqa: E402
from conv2d.reference import conv, norm  # noqa: E402

cuda = numba_cuda()
SHAPE = (2, 3, 4, 5)  # (N, OH, OW, OC): M = 24 rows, S = 60 values a sample
N, C, S = SHAPE[0], SHAPE[3], SHAPE[1] * SHAPE[2] * SHAPE[3]
NORMS = {"batch_norm": (norm.BATCH_AXES, C, False), "layer_norm": (norm.LAYER_AXES, N, True)}
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# float32 sums of at most 60 terms against float64: a few float32 roundings a term.
CLOSE = dict(rtol=2e-5, atol=2e-6)


def values(seed, shape=SHAPE):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def launch(kernel, n, *args):
    """Runs `kernel` over n items; arrays go to the device and come back flat."""
    dev = [cuda.to_device(np.ascontiguousarray(a).reshape(-1)) if isinstance(a, np.ndarray) else a for a in args]
    kernel[grid(n)](*dev)
    return [d.copy_to_host() if hasattr(d, "copy_to_host") else d for d in dev]


def kernels(activation=Activation.RELU, storage="float32"):
    return simple_set(storage, activation)


@pytest.mark.parametrize("which", NORMS)
def test_statistics_are_the_references_two_pass_mean_and_biased_variance(which):
    axes, groups, layer = NORMS[which]
    z = values(0) + 3.0  # an offset: a one-pass sum of squares would lose digits here
    _, _, _, _, mean, var = launch(kernels().statistics, groups, z, C, S, layer, np.zeros(groups, np.float32),
                                   np.zeros(groups, np.float32))
    want_mean, want_var = norm.statistics(z.astype(np.float64), axes)
    np.testing.assert_allclose(mean, want_mean, **CLOSE)
    np.testing.assert_allclose(var, want_var, **CLOSE)


def test_inverse_std_is_one_over_the_root_of_var_plus_epsilon():
    var = np.abs(values(1, (C,)))
    _, _, out = launch(kernels().inverse_std, C, var, np.float32(1e-5), np.zeros(C, np.float32))
    np.testing.assert_allclose(out, norm.inverse_std(var.astype(np.float64), 1e-5), **CLOSE)


@pytest.mark.parametrize("momentum, batches, weight", [(0.1, 7, 0.1), (-1.0, 4, 0.25)],
                         ids=["momentum", "cumulative"])
def test_update_running_averages_with_momentum_and_the_variance_scale(momentum, batches, weight):
    """A momentum of -1 stands for the cumulative average: 1 / the batches counted."""
    running, stat = values(2, (C,)), values(3, (C,))
    out, *_ = launch(kernels().update_running, C, running.copy(), stat, np.float32(momentum),
                     np.array([batches], np.int64), np.float32(1.25))
    np.testing.assert_allclose(out, norm.update_running(running.astype(np.float64), stat * 1.25, weight), **CLOSE)


def test_count_batch_counts_one_batch():
    from conv2d.cuda.kernels.simple import count_batch

    batches, = launch(count_batch, 1, np.array([6], np.int64))
    assert batches.tolist() == [7]


@pytest.mark.parametrize("which", NORMS)
def test_activation_input_normalises_then_scales_and_shifts_per_channel(which):
    axes, groups, layer = NORMS[which]
    z, gamma, beta = values(4), values(5, (C,)), values(6, (C,))
    mean, inv_std = values(7, (groups,)), np.abs(values(8, (groups,))) + 0.5
    *_, a, x_hat = launch(kernels().activation_input, z.size, z, mean, inv_std, gamma, beta, C, S, layer,
                          np.zeros(z.size, np.float32), np.zeros(z.size, np.float32))
    want_x_hat = norm.normalize(z.astype(np.float64), mean.astype(np.float64), inv_std.astype(np.float64), axes)
    np.testing.assert_allclose(x_hat, want_x_hat.reshape(-1), **CLOSE)
    np.testing.assert_allclose(a, norm.affine(want_x_hat, gamma, beta).reshape(-1), **CLOSE)


@pytest.mark.parametrize("activation", list(Activation), ids=[a.value for a in Activation])
def test_activation_forward_and_backward_are_the_activation_table(activation):
    a, d_y = values(9) * 2, values(10)
    k = kernels(activation)
    _, y = launch(k.activation_forward, a.size, a, np.zeros(a.size, np.float32))
    _, _, d_a = launch(k.activation_backward, a.size, a, d_y, np.zeros(a.size, np.float32))
    a64 = a.astype(np.float64).reshape(-1)
    np.testing.assert_allclose(y, activations.forward(activation, a64), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(d_a, activations.derivative(activation, a64) * d_y.reshape(-1), rtol=2e-5,
                               atol=2e-6)


@pytest.mark.parametrize("storage", list(STORAGE))
def test_storage_conversions_round_as_numpy_casts(storage):
    k = kernels(storage=storage)
    x = values(11) * 100
    stored = x.astype(STORAGE[storage])
    bits = stored.view(np.uint16) if storage == "bfloat16" else stored
    _, back = launch(k.to_compute, x.size, bits, np.zeros(x.size, np.float32))
    _, out = launch(k.to_storage, x.size, x, np.zeros(x.size, bits.dtype))
    np.testing.assert_array_equal(back, stored.astype(np.float32).reshape(-1))
    np.testing.assert_array_equal(out, bits.reshape(-1))


def test_param_backward_sums_d_a_times_x_hat_and_d_a_over_the_rows():
    d_a, x_hat = values(12), values(13)
    *_, d_gamma, d_beta = launch(kernels().param_backward, C, d_a, x_hat, C, np.zeros(C, np.float32),
                                 np.zeros(C, np.float32))
    want_gamma, want_beta = norm.param_backward(d_a.astype(np.float64), x_hat.astype(np.float64))
    np.testing.assert_allclose(d_gamma, want_gamma, **CLOSE)
    np.testing.assert_allclose(d_beta, want_beta, **CLOSE)


def test_bias_backward_sums_d_z_over_the_rows():
    d_z = values(14)
    *_, d_bias = launch(kernels().bias_backward, C, d_z, C, np.zeros(C, np.float32))
    np.testing.assert_allclose(d_bias, conv.bias_backward(d_z.astype(np.float64)), **CLOSE)


@pytest.mark.parametrize("which", NORMS)
def test_backward_batch_statistics_is_the_references(which):
    axes, groups, layer = NORMS[which]
    d_a, gamma = values(15), values(16, (C,))
    z = values(17)
    mean, var = norm.statistics(z.astype(np.float64), axes)
    inv_std = norm.inverse_std(var, 1e-5)
    x_hat = norm.normalize(z.astype(np.float64), mean, inv_std, axes).astype(np.float32)
    inv_std32 = inv_std.astype(np.float32)
    k = kernels()
    *_, mean_g, mean_gx = launch(k.gradient_means, groups, d_a, x_hat, gamma, C, S, layer,
                                 np.zeros(groups, np.float32), np.zeros(groups, np.float32))
    *_, d_z = launch(k.backward_batch_statistics, d_a.size, d_a, x_hat, inv_std32, gamma, mean_g, mean_gx, C, S,
                     layer, np.zeros(d_a.size, np.float32))
    want = norm.backward_batch_statistics(d_a.astype(np.float64), x_hat.astype(np.float64),
                                          inv_std32.astype(np.float64), gamma.astype(np.float64), axes)
    np.testing.assert_allclose(d_z, want.reshape(-1), rtol=1e-4, atol=1e-5)


def test_backward_fixed_statistics_scales_by_gamma_and_inv_std():
    d_a, gamma, inv_std = values(18), values(19, (C,)), np.abs(values(20, (C,))) + 0.5
    *_, d_z = launch(kernels().backward_fixed_statistics, d_a.size, d_a, inv_std, gamma, C,
                     np.zeros(d_a.size, np.float32))
    want = norm.backward_fixed_statistics(d_a.astype(np.float64), inv_std.astype(np.float64),
                                          gamma.astype(np.float64), norm.BATCH_AXES)
    np.testing.assert_allclose(d_z, want.reshape(-1), **CLOSE)
