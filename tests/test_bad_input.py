"""Bad arguments at every public call raise a clear error before anything changes."""

import numpy as np
import pytest

from conftest import make_layer, random_inputs, small_layer_spec
from conv2d import Conv2d

SPEC = small_layer_spec(in_height=5, in_width=5)


def snapshot(layer):
    return {**{f"s.{k}": v for k, v in layer.state_dict().items()},
            **{f"g.{k}": v for k, v in layer.grad_dict().items()}}


def assert_unchanged(layer, before):
    after = snapshot(layer)
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


@pytest.fixture
def trained():
    """A layer after forward + backward, so caches and gradients are non-trivial."""
    layer = make_layer(SPEC)
    x, dy = random_inputs(SPEC)
    layer.forward(x)
    layer.backward(x, dy)
    return layer, x, dy


def test_constructor_rejects_a_non_spec():
    with pytest.raises(TypeError, match="spec: expected a LayerSpec, got dict"):
        Conv2d({"batch_size": 1})


def test_constructor_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match=r"backend: expected one of \['reference', 'cpu', 'cuda'\], got 'tpu'"):
        Conv2d(SPEC, backend="tpu")


def _bad_arrays(shape, dtype):
    good = np.zeros(shape, dtype)
    wide = np.zeros(shape[:-1] + (shape[-1] * 2,), dtype)
    return [
        ("wrong shape", np.zeros(shape[:-1] + (shape[-1] + 1,), dtype), ValueError, "expected shape"),
        ("wrong rank", good.reshape(shape[0], -1), ValueError, "expected shape"),
        ("wrong dtype", good.astype(np.float64), TypeError, "expected dtype float32"),
        ("non-contiguous", wide[..., ::2], ValueError, "expected a C-contiguous array"),
        ("not an array", good.tolist(), TypeError, "expected a numpy.ndarray"),
    ]


@pytest.mark.parametrize("case", _bad_arrays(SPEC.input_shape, np.float32), ids=lambda c: c[0])
@pytest.mark.parametrize("call", ["evaluate", "forward", "backward", "backward_full"])
def test_bad_x_is_rejected_before_any_change(trained, call, case):
    layer, x, dy = trained
    _, bad, error, message = case
    before, pre = snapshot(layer), layer.pre_activations.copy()
    args = (bad,) if call in ("evaluate", "forward") else (bad, dy)
    with pytest.raises(error, match=f"^x: {message}"):
        getattr(layer, call)(*args)
    assert_unchanged(layer, before)
    np.testing.assert_array_equal(layer.pre_activations, pre)


@pytest.mark.parametrize("case", _bad_arrays(SPEC.output_shape, np.float32), ids=lambda c: c[0])
@pytest.mark.parametrize("call", ["backward", "backward_full", "backward_input"])
def test_bad_d_y_is_rejected_before_any_change(trained, call, case):
    layer, x, dy = trained
    _, bad, error, message = case
    before = snapshot(layer)
    args = (bad,) if call == "backward_input" else (x, bad)
    with pytest.raises(error, match=f"^d_y: {message}"):
        getattr(layer, call)(*args)
    assert_unchanged(layer, before)


def test_forward_rejects_a_non_bool_training_flag(trained):
    layer, x, _ = trained
    before = snapshot(layer)
    with pytest.raises(TypeError, match="training: expected a bool, got 'yes'"):
        layer.forward(x, training="yes")
    assert_unchanged(layer, before)


def test_init_weights_rejects_a_seed_in_place_of_a_generator(trained):
    layer, _, _ = trained
    before = snapshot(layer)
    with pytest.raises(TypeError, match="rng: expected a numpy.random.Generator, got int"):
        layer.init_weights(42)
    assert_unchanged(layer, before)


def _state_edits():
    def drop(s): s.pop("gamma")
    def extra(s): s["dilation"] = np.ones(1)
    def shape(s): s["bias"] = np.zeros(5, np.float32)
    def dtype(s): s["weights"] = s["weights"].astype(np.float64)
    def negative_var(s): s["running_var"][2] = -1.0
    def non_array(s): s["beta"] = s["beta"].tolist()
    return [(drop, KeyError, "missing \\['gamma'\\]"), (extra, KeyError, "unexpected \\['dilation'\\]"),
            (shape, ValueError, r"state\['bias'\]: expected shape \(4,\)"),
            (dtype, TypeError, r"state\['weights'\]: expected dtype float32"),
            (negative_var, ValueError, r"state\['running_var'\]: expected values >= 0"),
            (non_array, TypeError, r"state\['beta'\]: expected a numpy.ndarray")]


@pytest.mark.parametrize("edit, error, message", _state_edits(), ids=lambda v: getattr(v, "__name__", ""))
def test_load_state_dict_rejects_bad_state_before_any_change(trained, edit, error, message):
    layer, _, _ = trained
    before = snapshot(layer)
    state = layer.state_dict()
    edit(state)
    with pytest.raises(error, match=message):
        layer.load_state_dict(state)
    assert_unchanged(layer, before)


def test_load_state_dict_rejects_a_non_dict(trained):
    layer, _, _ = trained
    with pytest.raises(TypeError, match="state: expected a dict of arrays"):
        layer.load_state_dict([1, 2])


def test_load_grad_dict_rejects_a_wrong_shape_before_any_change(trained):
    layer, _, _ = trained
    before = snapshot(layer)
    grads = layer.grad_dict()
    grads["gamma"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"grads\['gamma'\]: expected shape \(4,\)"):
        layer.load_grad_dict(grads)
    assert_unchanged(layer, before)
