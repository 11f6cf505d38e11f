"""conv2d.Sequential: a stack of layers, its gradients against PyTorch autograd in float64,
and saving and loading the whole stack in one file."""

import numpy as np
import pytest

import conv2d
from conftest import assert_same_gradients
from conv2d import Conv2d, LayerSpec, Sequential


def specs(dtype="float64"):
    common = dict(batch_size=3, dtype=dtype)
    return [LayerSpec(in_height=8, in_width=7, in_channels=2, out_channels=4, kernel=3, padding=1,
                      activation="relu", normalization="batch_norm", **common),
            LayerSpec(in_height=8, in_width=7, in_channels=4, out_channels=5, kernel=3, stride=2, padding=1,
                      activation="tanh", normalization="layer_norm", **common),
            LayerSpec(in_height=4, in_width=4, in_channels=5, out_channels=3, kernel=4, activation="identity",
                      **common)]  # the whole 4x4 input: a dense layer


def stack(seed=0, dtype="float64"):
    model = Sequential.from_specs(specs(dtype))
    model.init_weights(np.random.default_rng(seed))
    return model


def test_gradients_of_a_three_layer_stack_match_pytorch_autograd():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    model = stack()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8, 7, 2))
    dy = rng.standard_normal((3, 1, 1, 3))
    y = model.forward(x)
    d_x = model.backward_full(x, dy)
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).requires_grad_(True)
    params = []
    h = xt
    for layer in model:
        s, st = layer.spec, layer.state_dict()
        w = torch.from_numpy(st["weights"].transpose(0, 3, 1, 2)).requires_grad_(True)
        b = torch.from_numpy(st["bias"]).requires_grad_(True)
        params.append((w, b))
        h = torch.nn.functional.conv2d(h, w, b, s.stride, s.padding)
        if s.normalization.value == "batch_norm":
            h = torch.nn.functional.batch_norm(h, None, None, torch.from_numpy(st["gamma"]),
                                               torch.from_numpy(st["beta"]), training=True, eps=s.bn_epsilon)
        elif s.normalization.value == "layer_norm":
            h = torch.nn.functional.group_norm(h, 1, torch.from_numpy(st["gamma"]), torch.from_numpy(st["beta"]),
                                               eps=s.bn_epsilon)
        h = {"relu": torch.relu, "tanh": torch.tanh, "identity": lambda t: t}[s.activation.value](h)
    h.backward(torch.from_numpy(dy).permute(0, 3, 1, 2))
    np.testing.assert_allclose(y, h.detach().permute(0, 2, 3, 1).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(d_x, xt.grad.permute(0, 2, 3, 1).numpy(), rtol=1e-10, atol=1e-12)
    for layer, (w, b) in zip(model, params):
        g = layer.grad_dict()
        np.testing.assert_allclose(g["weights"], w.grad.permute(0, 2, 3, 1).numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(g["bias"], b.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_backward_gives_the_same_parameter_gradients_as_backward_full():
    a, b = stack(), stack()
    x = np.random.default_rng(2).standard_normal((3, 8, 7, 2))
    dy = np.ones((3, 1, 1, 3))
    a.forward(x)
    b.forward(x)
    a.backward(x, dy)
    b.backward_full(x, dy)
    assert_same_gradients(a, b)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_stack_saves_and_loads_in_one_file_bitwise(tmp_path, dtype):
    model = stack(dtype=dtype)
    conv2d.save(model, tmp_path / "m.npz")
    loaded = conv2d.load(tmp_path / "m.npz")
    assert isinstance(loaded, Sequential) and [layer.spec for layer in loaded] == specs(dtype)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k].view(np.uint8), v.view(np.uint8), err_msg=k)
    into = Sequential.from_specs(specs(dtype))
    assert conv2d.load(tmp_path / "m.npz", into=into) is into
    with pytest.raises(TypeError, match="a Sequential of 3 layers"):
        conv2d.load(tmp_path / "m.npz", into=Conv2d(specs(dtype)[0]))


def test_layers_whose_channels_do_not_chain_are_refused():
    a, b = specs()[0], specs()[2]
    with pytest.raises(ValueError, match=r"layers\[1\]: in_channels 5 differs from layers\[0\]'s out_channels 4"):
        Sequential([Conv2d(a), Conv2d(b)])


def test_backward_before_forward_raises():
    with pytest.raises(RuntimeError, match="no forward pass"):
        stack().backward(np.zeros((3, 8, 7, 2)), np.zeros((3, 1, 1, 3)))


def test_a_state_dict_key_without_a_layer_index_is_refused_before_any_change():
    model = stack()
    before = model.state_dict()
    state = dict(before)
    state["weights"] = state.pop("0.weights")
    with pytest.raises(KeyError, match="'weights' is not '<layer index>.<name>'"):
        model.load_state_dict(state)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def _cuda_options():
    from conftest import HAVE_GPU

    return {} if HAVE_GPU else {"convolutions": __import__("host_convolutions").HostConvolutions}


def test_cuda_layers_made_by_from_specs_run_on_one_stream():
    model = Sequential.from_specs(specs("float32"), "cuda", **_cuda_options())
    streams = {id(layer.functions.stream) for layer in model}
    assert len(streams) == 1


def test_cuda_layers_on_different_streams_are_refused():
    layers = [Conv2d(spec, "cuda", **_cuda_options()) for spec in specs("float32")]
    with pytest.raises(ValueError, match=r"^layers\[1\]: runs on another CUDA stream than layers\[0\]"):
        Sequential(layers)


def test_a_cuda_stack_matches_the_reference_stack():
    reference = stack(dtype="float32")
    model = reference.to("cuda", **_cuda_options())
    x = np.random.default_rng(3).standard_normal((3, 8, 7, 2)).astype(np.float32)
    d_y = np.random.default_rng(4).standard_normal((3, 1, 1, 3)).astype(np.float32)
    want_y, got_y = reference.forward(x), model.forward(x)
    want_dx, got_dx = reference.backward_full(x, d_y), model.backward_full(x, d_y)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_dx, want_dx, rtol=1e-4, atol=1e-4)
    for k, v in reference.grad_dict().items():
        np.testing.assert_allclose(model.grad_dict()[k], v, rtol=1e-4, atol=1e-4, err_msg=k)


def test_capture_is_refused_on_the_reference_backend():
    x = np.zeros((3, 8, 7, 2))
    with pytest.raises(TypeError, match="^capture: the 'reference' backend has no CUDA graphs"):
        stack().capture(x, np.zeros((3, 1, 1, 3)))
    with pytest.raises(TypeError, match="^capture_evaluate: the 'reference' backend has no CUDA graphs"):
        stack().capture_evaluate(x)


def test_a_stack_capture_refuses_an_optimizer_over_other_layers_before_any_change():
    from conv2d.optim import Adam

    model = Sequential.from_specs(specs("float32"), "cuda", **_cuda_options())
    other = Sequential.from_specs(specs("float32"), "cuda", **_cuda_options())
    before = model.state_dict()
    x, d_y = np.zeros((3, 8, 7, 2), np.float32), np.zeros((3, 1, 1, 3), np.float32)
    with pytest.raises(ValueError, match="^optimizer: expected a conv2d.optim optimizer over this Sequential's "
                                         "layers, got Adam over 3 layers"):
        model.capture(x, d_y, optimizer=Adam(other))
    for k, v in before.items():
        np.testing.assert_array_equal(model.state_dict()[k], v, err_msg=k)
