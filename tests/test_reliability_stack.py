"""A stack of layers refuses before it changes anything (reliability III): a forward that a
later layer cannot take, a backward of a changed input, one layer object in two places;
its state and gradient dicts are read whole while another thread steps the optimizer; a
batch counter that cannot wrap."""

import threading

import numpy as np
import pytest

from conftest import make_layer, random_inputs, small_layer_spec
from conv2d import Conv2d, LayerSpec, Sequential
from conv2d.optim import SGD


def bn_layer(in_channels, out_channels, **fields):
    spec = LayerSpec(batch_size=1, in_height=3, in_width=3, in_channels=in_channels, out_channels=out_channels,
                     kernel=3, padding=fields.pop("padding", 1), normalization="batch_norm", activation="relu",
                     dtype="float64", **fields)
    layer = Conv2d(spec)
    layer.init_weights(np.random.default_rng(in_channels))
    return layer


def test_a_training_forward_a_later_layer_refuses_changes_no_layer():
    # Layer 1's kernel leaves one value per channel at N = 1, which the unbiased running
    # variance cannot take: refused before layer 0's running statistics move.
    model = Sequential([bn_layer(2, 3), bn_layer(3, 4, padding=0, bn_running_var="unbiased")])
    before = model.state_dict()
    x = np.random.default_rng(0).standard_normal((1, 3, 3, 2))
    with pytest.raises(ValueError, match=r"layers\[1\].*more than one value per channel"):
        model.forward(x, training=True)
    after = model.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    model.forward(x, training=False)  # evaluation updates nothing: taken


def test_a_backward_of_an_input_changed_in_place_accumulates_nothing():
    model = Sequential([bn_layer(2, 3), bn_layer(3, 4)])
    x = np.random.default_rng(0).standard_normal((2, 3, 3, 2))
    y = model.forward(x)
    x[0, 0, 0, 0] += 1
    with pytest.raises(ValueError, match="changed in place"):
        model.backward(x, np.ones_like(y))
    for layer in model:
        assert all(not g.any() for g in layer.grad_dict().values())


def test_a_backward_after_a_layers_parameters_changed_accumulates_nothing():
    model = Sequential([bn_layer(2, 3), bn_layer(3, 4)])
    x = np.random.default_rng(0).standard_normal((2, 3, 3, 2))
    y = model.forward(x)
    model[0].parameters_changed()
    with pytest.raises(RuntimeError, match="parameters changed"):
        model.backward(x, np.ones_like(y))
    assert all(not g.any() for layer in model for g in layer.grad_dict().values())


def test_one_layer_object_in_two_places_is_refused_at_construction():
    layer = bn_layer(3, 3)
    with pytest.raises(ValueError, match=r"layers\[1\]: the same Conv2d object as layers\[0\]"):
        Sequential([layer, layer])


def test_state_and_gradient_dicts_are_read_whole_while_another_thread_steps():
    spec = small_layer_spec(dtype="float64", normalization="none", in_channels=4)
    model = Sequential([make_layer(spec, seed=1), make_layer(spec, seed=2)])
    x, dy = random_inputs(spec)
    model.forward(x)
    model.backward(x, dy)
    for layer in model:  # every gradient 1: each step moves every parameter by the same -0.5
        layer.load_grad_dict({k: np.ones_like(v) for k, v in layer.grad_dict().items()})
    start = {k: v.copy() for k, v in model.state_dict().items()}
    opt = SGD(model, lr=0.5)
    stop = threading.Event()

    def steps():
        while not stop.is_set():
            opt.step()
    worker = threading.Thread(target=steps)
    worker.start()
    try:
        for _ in range(300):
            state = model.state_dict()
            moved = {round(float((start[k] - v).flat[0]) / 0.5) for k, v in state.items()}
            assert len(moved) == 1, f"layers read at different steps: {sorted(moved)}"
    finally:
        stop.set()
        worker.join()


def test_the_batch_counter_saturates_instead_of_wrapping():
    spec = small_layer_spec(dtype="float64", bn_momentum=None)
    layer = make_layer(spec)
    state = layer.state_dict()
    state["num_batches_tracked"] = np.array(2 ** 63 - 1, np.int64)
    layer.load_state_dict(state)
    x, _ = random_inputs(spec)
    layer.forward(x, training=True)
    after = layer.state_dict()
    assert after["num_batches_tracked"] == 2 ** 63 - 1
    # The statistics moved by 1/(2**63 - 1) of the way, not by -1/2**63.
    assert np.all(np.abs(after["running_mean"] - state["running_mean"]) < 1e-15)
    assert np.all(after["running_var"] >= 0)
