"""conv2d.torch_layout: our state <-> PyTorch's module keys and layouts, without hand-made
key mappings: Sequential and nested prefixes, plain modules, bias-free convolutions, and
the dense weight after a flatten."""

import dataclasses

import numpy as np
import pytest

from conftest import make_layer, random_inputs, small_layer_spec
from conv2d import Conv2d, LayerSpec
from conv2d.torch_layout import (conv_to_dense_weight, dense_weight_to_conv, state_from_modules, state_from_torch,
                                 state_to_torch)

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra brings it)")

SPEC = small_layer_spec(dtype="float64", bn_running_var="unbiased")


def sequential(spec):
    layers = [torch.nn.Conv2d(spec.in_channels, spec.out_channels, spec.kernel, spec.stride, spec.padding,
                              bias=spec.bias).double()]
    if spec.normalization.value == "batch_norm":
        layers.append(torch.nn.BatchNorm2d(spec.out_channels, eps=spec.bn_epsilon).double())
    layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def eval_output(model, x):
    with torch.no_grad():
        return model.eval()(torch.from_numpy(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("bias", [True, False])
def test_our_layer_to_a_sequential_and_back_is_bitwise(bias):
    spec = dataclasses.replace(SPEC, bias=bias)
    layer = make_layer(spec)
    seq = sequential(spec)
    seq.load_state_dict({k: torch.from_numpy(v) for k, v in state_to_torch(layer.state_dict(), "0", "1").items()},
                        strict=False)
    x, _ = random_inputs(spec)
    np.testing.assert_allclose(eval_output(seq, x), layer.evaluate(x), rtol=1e-12, atol=1e-14)
    back = Conv2d(spec)
    back.load_state_dict(state_from_torch(seq.state_dict(), conv="0", norm="1"))
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[k], v, err_msg=k)


def test_a_nested_prefix_reads_one_layer_out_of_a_whole_model():
    spec = SPEC
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1).double(), sequential(spec), torch.nn.Flatten())
    state = state_from_torch(model.state_dict(), conv="1.0", norm="1.1", strict=False)
    layer = Conv2d(spec)
    layer.load_state_dict(state)
    x, _ = random_inputs(spec)
    np.testing.assert_allclose(layer.evaluate(x), eval_output(model[1], x), rtol=1e-12, atol=1e-14)
    with pytest.raises(KeyError, match="unknown keys"):
        state_from_torch(model.state_dict(), conv="1.0", norm="1.1")


def test_plain_modules_give_our_state():
    seq = sequential(SPEC)
    state = state_from_modules(seq[0], seq[1])
    assert sorted(state) == sorted(Conv2d(SPEC).state_dict())
    np.testing.assert_array_equal(state["weights"], seq[0].weight.detach().numpy().transpose(0, 2, 3, 1))


def test_a_cumulative_batch_norm_brings_its_batch_count_both_ways():
    spec = dataclasses.replace(SPEC, bn_momentum=None)
    conv = torch.nn.Conv2d(spec.in_channels, spec.out_channels, spec.kernel, spec.stride, spec.padding).double()
    bn = torch.nn.BatchNorm2d(spec.out_channels, eps=spec.bn_epsilon, momentum=None).double()
    x, _ = random_inputs(spec)
    for _ in range(3):
        bn(conv(torch.from_numpy(x).permute(0, 3, 1, 2)))
    state = state_from_modules(conv, bn)
    assert state["num_batches_tracked"].dtype == np.int64 and state["num_batches_tracked"] == 3
    layer = Conv2d(spec)
    layer.load_state_dict(state)
    t = state_to_torch(layer.state_dict())
    assert t["norm.num_batches_tracked"] == 3
    with pytest.raises(KeyError, match="num_batches_tracked"):
        state_from_torch({k: v for k, v in t.items() if k != "norm.num_batches_tracked"}, num_batches_tracked=True)


def test_a_missing_weight_and_equal_prefixes_are_refused():
    with pytest.raises(KeyError, match="no convolution weight '0.weight'"):
        state_from_torch({"1.weight": np.ones(4)}, conv="0", norm="1", strict=False)
    with pytest.raises(ValueError, match="different prefixes"):
        state_from_torch({}, conv="", norm="")


def test_the_dense_weight_after_a_flatten_becomes_a_whole_input_convolution():
    c, h, w, out = 3, 4, 5, 6
    linear = torch.nn.Linear(c * h * w, out).double()
    spec = LayerSpec(batch_size=2, in_height=h, in_width=w, in_channels=c, out_channels=out, kernel=(h, w),
                     dtype="float64")
    layer = Conv2d(spec)
    layer.load_state_dict({"weights": dense_weight_to_conv(linear.weight, (c, h, w)),
                           "bias": linear.bias.detach().numpy().copy()})
    x, _ = random_inputs(spec)
    with torch.no_grad():
        want = linear(torch.nn.Flatten()(torch.from_numpy(x).permute(0, 3, 1, 2))).numpy()
    np.testing.assert_allclose(layer.evaluate(x).reshape(2, out), want, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(conv_to_dense_weight(layer.state_dict()["weights"]),
                                  linear.weight.detach().numpy())
    with pytest.raises(ValueError, match=r"expected a 2-D \(OUT, 3\*4\*6\)"):
        dense_weight_to_conv(linear.weight, (c, h, w + 1))
