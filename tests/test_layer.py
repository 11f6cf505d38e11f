"""Conv2d's semantics on the reference backend: caches, accumulation, state, init."""

import dataclasses
import math

import numpy as np
import pytest

from conftest import assert_same_gradients, make_layer, random_inputs, spec_for
from conv2d import Conv2d

NORMS = ["none", "batch_norm", "layer_norm"]
DTYPES = ["float64", "float32", "float16", "bfloat16"]


def layer_spec(normalization="batch_norm", dtype="float64", activation="tanh"):
    """This file's layer: N=3, 6x5, 2 -> 4 channels."""
    return spec_for(activation, normalization, dtype, batch_size=3, in_height=6, in_width=5, in_channels=2,
                    out_channels=4)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("norm", NORMS)
def test_parameter_gradients_accumulate_across_backward_calls(norm, dtype):
    spec = layer_spec(norm, dtype)
    layer = make_layer(spec)
    x, dy = random_inputs(spec)
    layer.forward(x)
    layer.backward(x, dy)
    once = layer.grad_dict()
    layer.backward(x, dy)
    for k, g in layer.grad_dict().items():
        np.testing.assert_allclose(g, 2 * once[k], rtol=1e-6, err_msg=k)


@pytest.mark.parametrize("norm", NORMS)
def test_input_gradient_is_returned_fresh_each_call(norm):
    spec = layer_spec(norm)
    layer = make_layer(spec)
    x, dy = random_inputs(spec)
    layer.forward(x)
    first = layer.backward_full(x, dy)
    np.testing.assert_array_equal(layer.backward_full(x, dy), first)
    np.testing.assert_array_equal(layer.backward_input(dy), first)


@pytest.mark.parametrize("norm", NORMS)
def test_backward_and_backward_full_give_the_same_parameter_gradients(norm):
    spec = layer_spec(norm)
    a, b = make_layer(spec), make_layer(spec)
    x, dy = random_inputs(spec)
    a.forward(x)
    b.forward(x)
    a.backward(x, dy)
    b.backward_full(x, dy)
    assert_same_gradients(a, b)


def test_backward_input_leaves_parameter_gradients_alone(small_spec):
    layer = make_layer(small_spec)
    x, dy = random_inputs(small_spec)
    layer.forward(x)
    layer.backward_input(dy)
    assert all((g == 0).all() for g in layer.grad_dict().values())


def test_zero_gradient_clears_every_gradient(small_spec):
    layer = make_layer(small_spec)
    x, dy = random_inputs(small_spec)
    layer.forward(x)
    layer.backward(x, dy)
    assert any((g != 0).any() for g in layer.grad_dict().values())
    layer.zero_gradient()
    assert all((g == 0).all() for g in layer.grad_dict().values())


def test_evaluate_keeps_nothing_and_uses_running_statistics(small_spec):
    layer = make_layer(small_spec)
    x, _ = random_inputs(small_spec)
    before = layer.state_dict()
    y = layer.evaluate(x)
    assert layer.pre_activations is None
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    np.testing.assert_array_equal(layer.forward(x, training=False), y)


def test_training_forward_updates_running_statistics_with_the_biased_variance(small_spec):
    layer = make_layer(small_spec)
    x, _ = random_inputs(small_spec)
    before = layer.state_dict()
    layer.forward(x, training=True)
    z = layer.pre_activations.reshape(-1, small_spec.out_channels)
    m = small_spec.bn_momentum
    after = layer.state_dict()
    np.testing.assert_allclose(after["running_mean"], (1 - m) * before["running_mean"] + m * z.mean(0), rtol=1e-12)
    np.testing.assert_allclose(after["running_var"], (1 - m) * before["running_var"] + m * z.var(0), rtol=1e-12)


@pytest.mark.parametrize("running_var", ["biased", "unbiased"])
def test_momentum_none_is_pytorchs_cumulative_average_of_the_batches(running_var):
    """bn_momentum=None: after k training batches the running statistics are the mean of
    the k batches' (PyTorch's BatchNorm2d(momentum=None), which counts them in
    num_batches_tracked); an eval forward counts nothing."""
    spec = dataclasses.replace(layer_spec("batch_norm"), dtype="float64", bn_momentum=None,
                               bn_running_var=running_var)
    layer = make_layer(spec)
    stats = []
    for seed in range(3):
        x, _ = random_inputs(spec, seed=seed)
        layer.forward(x, training=True)
        z = layer.pre_activations.reshape(-1, spec.out_channels)
        stats.append((z.mean(0), z.var(0) * spec.running_var_scale(z.shape[0])))
        layer.forward(x, training=False)
    state = layer.state_dict()
    assert state["num_batches_tracked"].dtype == np.int64 and state["num_batches_tracked"] == 3
    # running = 0 then 1 then 1 (momentum 1, 1/2, 1/3): the plain mean of the three batches
    np.testing.assert_allclose(state["running_mean"], np.mean([m for m, _ in stats], 0), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(state["running_var"], np.mean([v for _, v in stats], 0), rtol=1e-12)


def test_reset_running_stats_zeroes_the_batch_count():
    spec = dataclasses.replace(layer_spec("batch_norm"), bn_momentum=None)
    layer = make_layer(spec)
    layer.forward(random_inputs(spec)[0], training=True)
    layer.reset_running_stats()
    assert layer.state_dict()["num_batches_tracked"] == 0


def test_eval_forward_leaves_running_statistics_unchanged(small_spec):
    layer = make_layer(small_spec)
    x, _ = random_inputs(small_spec)
    before = layer.state_dict()
    layer.forward(x, training=False)
    np.testing.assert_array_equal(layer.state_dict()["running_mean"], before["running_mean"])
    np.testing.assert_array_equal(layer.state_dict()["running_var"], before["running_var"])


def test_layer_norm_is_the_same_in_training_and_eval():
    spec = layer_spec("layer_norm")
    layer = make_layer(spec)
    x, _ = random_inputs(spec)
    np.testing.assert_array_equal(layer.forward(x, training=True), layer.evaluate(x))


def test_pre_activations_are_conv_plus_bias(small_spec):
    spec = dataclasses.replace(small_spec, normalization="none", activation="identity")
    layer = make_layer(spec)
    x, _ = random_inputs(spec)
    y = layer.forward(x)
    np.testing.assert_array_equal(layer.pre_activations, y)


def test_backward_before_any_forward_raises(small_spec):
    layer = make_layer(small_spec)
    x, dy = random_inputs(small_spec)
    with pytest.raises(RuntimeError, match="call forward"):
        layer.backward(x, dy)
    with pytest.raises(RuntimeError, match="call forward"):
        layer.backward_input(dy)


def test_state_and_grad_dicts_are_copies(small_spec):
    layer = make_layer(small_spec)
    state, grads = layer.state_dict(), layer.grad_dict()
    state["weights"][...] = 7
    grads["weights"][...] = 7
    assert (layer.state_dict()["weights"] != 7).all()
    assert (layer.grad_dict()["weights"] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_state_keys_shapes_and_dtypes_follow_the_type_policy(norm, dtype):
    spec = layer_spec(norm, dtype)
    state = Conv2d(spec).state_dict()
    keys = {"none": {"weights", "bias"}, "layer_norm": {"weights", "bias", "gamma", "beta"},
            "batch_norm": {"weights", "bias", "gamma", "beta", "running_mean", "running_var"}}[norm]
    assert set(state) == keys
    assert state["weights"].shape == (4, 3, 3, 2)
    assert state["weights"].dtype.name == dtype and state["bias"].dtype.name == dtype
    for k in keys - {"weights", "bias"}:
        assert state[k].dtype == (np.float64 if dtype == "float64" else np.float32)
    assert set(Conv2d(spec).grad_dict()) == keys - {"running_mean", "running_var"}


def test_init_weights_follows_pytorch_bounds_and_is_reproducible(small_spec):
    a, b = Conv2d(small_spec), Conv2d(small_spec)
    a.init_weights(np.random.default_rng(5))
    b.init_weights(np.random.default_rng(5))
    sa = a.state_dict()
    fan_in = small_spec.fan_in
    assert np.abs(sa["weights"]).max() <= math.sqrt(6 / (6 * fan_in))
    assert np.abs(sa["bias"]).max() <= 1 / math.sqrt(fan_in)
    assert sa["weights"].std() > 0.4 / math.sqrt(fan_in)  # uniform over the bound: std = bound/sqrt(3)
    np.testing.assert_array_equal(sa["gamma"], 1)
    np.testing.assert_array_equal(sa["beta"], 0)
    np.testing.assert_array_equal(sa["running_mean"], 0)
    np.testing.assert_array_equal(sa["running_var"], 1)
    for k, v in b.state_dict().items():
        np.testing.assert_array_equal(v, sa[k])


def test_reset_running_stats_restores_zero_and_one(small_spec):
    layer = make_layer(small_spec)
    x, _ = random_inputs(small_spec)
    layer.forward(x)
    layer.reset_running_stats()
    np.testing.assert_array_equal(layer.state_dict()["running_mean"], 0)
    np.testing.assert_array_equal(layer.state_dict()["running_var"], 1)


def test_to_copies_state_and_gradients(small_spec):
    layer = make_layer(small_spec)
    x, dy = random_inputs(small_spec)
    layer.forward(x)
    layer.backward(x, dy)
    other = layer.to("reference")
    for d_self, d_other in ((layer.state_dict(), other.state_dict()), (layer.grad_dict(), other.grad_dict())):
        for k in d_self:
            np.testing.assert_array_equal(d_other[k], d_self[k])
    np.testing.assert_array_equal(other.evaluate(x), layer.evaluate(x))


@pytest.mark.parametrize("norm", NORMS)
def test_nan_in_the_input_propagates_without_raising(norm):
    spec = layer_spec(norm, activation="identity")
    layer = make_layer(spec)
    x, dy = random_inputs(spec)
    x[0, 0, 0, 0] = np.nan
    with np.errstate(invalid="ignore"):
        y = layer.forward(x)
        dx = layer.backward_full(x, dy)
    assert np.isnan(y[0, 0, 0]).all()
    if norm == "none":
        assert not np.isnan(y[1:]).any()  # other samples are untouched
    assert np.isnan(dx).any() or norm == "none"
    assert np.isnan(layer.grad_dict()["weights"]).any()


def test_infinite_gradient_output_gives_infinite_or_nan_gradients(small_spec):
    layer = make_layer(small_spec)
    x, dy = random_inputs(small_spec)
    dy[0, 0, 0, 0] = np.inf
    layer.forward(x)
    with np.errstate(invalid="ignore"):
        layer.backward(x, dy)
    assert not np.isfinite(layer.grad_dict()["weights"]).all()
