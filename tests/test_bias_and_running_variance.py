"""Layers without a bias (bias=False) and the running variance's rule (biased, as the
original library; unbiased, as PyTorch), on both backends."""

import dataclasses

import numpy as np
import pytest

import conv2d
from conftest import make_layer
from conv2d import Conv2d
from conv2d.dtypes import storage_dtype
from conv2d.arrays import to_host

from functional_testing import BACKENDS, NORMS, functional_spec, inputs_at, layer_on, train_step


# bias=False ---------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
def test_a_layer_without_bias_matches_pytorch_conv2d_without_bias(norm):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    spec = functional_spec(norm, activation="gelu", bias=False)
    layer = make_layer(spec)
    state = layer.state_dict()
    assert "bias" not in state and "bias" not in layer.grad_dict()
    x, dy = inputs_at(spec, 3)
    conv = torch.nn.Conv2d(2, 3, 3, padding=1, bias=False).double()
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(state["weights"].transpose(0, 3, 1, 2)))
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).requires_grad_(True)
    z = conv(xt)
    if norm == "batch_norm":
        z = torch.nn.functional.batch_norm(z, None, None, torch.from_numpy(state["gamma"]),
                                           torch.from_numpy(state["beta"]), training=True, eps=spec.bn_epsilon)
    elif norm == "layer_norm":
        zn = (z - z.mean(dim=(1, 2, 3), keepdim=True)) / torch.sqrt(
            z.var(dim=(1, 2, 3), unbiased=False, keepdim=True) + spec.bn_epsilon)
        z = zn * torch.from_numpy(state["gamma"]).view(1, -1, 1, 1) + torch.from_numpy(state["beta"]).view(1, -1, 1, 1)
    want = torch.nn.functional.gelu(z)
    want.backward(torch.from_numpy(dy).permute(0, 3, 1, 2))
    y = layer.forward(x)
    d_x = layer.backward_full(x, dy)
    np.testing.assert_allclose(y, want.detach().permute(0, 2, 3, 1).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(d_x, xt.grad.permute(0, 2, 3, 1).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layer.grad_dict()["weights"], conv.weight.grad.permute(0, 2, 3, 1).numpy(),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_without_bias_equals_one_with_a_zero_bias(backend):
    spec = functional_spec("none", backend, activation="relu")
    with_bias, without = layer_on(backend, spec), layer_on(backend, dataclasses.replace(spec, bias=False))
    state = with_bias.state_dict()
    state["bias"][...] = 0
    with_bias.load_state_dict(state)
    without.load_state_dict({k: v for k, v in state.items() if k != "bias"})
    x, dy = inputs_at(spec, 2)
    a, b = train_step(with_bias, x, dy), train_step(without, x, dy)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2]["weights"], b[2]["weights"])
    st = storage_dtype(spec.dtype)
    np.testing.assert_array_equal(to_host(with_bias.evaluate(x), st), to_host(without.evaluate(x), st))


def test_a_layer_without_bias_saves_and_loads(tmp_path):
    spec = functional_spec("batch_norm", bias=False)
    layer = make_layer(spec)
    conv2d.save(layer, tmp_path / "l.npz")
    loaded = conv2d.load(tmp_path / "l.npz")
    assert loaded.spec == spec and set(loaded.state_dict()) == set(layer.state_dict())
    with pytest.raises(ValueError, match="bias: file False, layer True"):
        conv2d.load(tmp_path / "l.npz", into=make_layer(dataclasses.replace(spec, bias=True)))


def test_layer_from_another_backend_moves_without_its_forward():
    spec = functional_spec("none")
    layer = make_layer(spec)
    x, _ = inputs_at(spec, 2)
    layer.forward(x)
    assert Conv2d(spec).pre_activations is None
    assert layer.to("reference").pre_activations is None


# The running variance's rule ----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_unbiased_running_variance_rule_averages_the_unbiased_batch_variance(backend):
    spec = functional_spec("batch_norm", backend, bn_running_var="unbiased", bn_momentum=0.5)
    layer = layer_on(backend, spec)
    x, _ = inputs_at(spec, 3)
    before = layer.state_dict()["running_var"].astype(np.float64)
    pre = None
    layer.forward(x, training=True)
    pre = layer.pre_activations.astype(np.float64)
    var = pre.reshape(-1, spec.out_channels).var(axis=0, ddof=1)
    want = 0.5 * before + 0.5 * var
    np.testing.assert_allclose(layer.state_dict()["running_var"], want, rtol=1e-5 if backend == "cuda" else 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_unbiased_rule_refuses_one_value_per_channel_as_pytorch_does(backend):
    spec = functional_spec("batch_norm", backend, bn_running_var="unbiased", kernel=1, padding=0, in_height=1,
                    in_width=1)
    layer = layer_on(backend, spec)
    x, _ = inputs_at(spec, 1)
    before = layer.state_dict()
    with pytest.raises(ValueError, match="unbiased running variance needs more than one value per channel"):
        layer.forward(x, training=True)
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    layer.forward(x, training=False)  # eval does not touch the running statistics
