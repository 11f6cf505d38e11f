"""fold_batch_norm: evaluation-mode batch norm folded into the convolution's weights and
bias gives the batch-norm layer's evaluate within the dtype's tolerance (not bitwise: it
rounds in other places), as a layer without a norm."""

import numpy as np
import pytest

from conftest import make_layer, random_inputs, small_layer_spec
from conv2d.dtypes import tolerance
from conv2d.spec import DType


def relative_error(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["identity", "gelu", "tanh"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_a_folded_layer_evaluates_as_the_batch_norm_layer_within_the_tolerance(dtype, activation, bias):
    exact = make_layer(small_layer_spec(activation=activation, bias=bias, dtype="float64", in_channels=5), seed=2)
    spec = small_layer_spec(activation=activation, bias=bias, dtype=dtype, in_channels=5)
    layer = make_layer(spec, seed=2)  # the same draws, rounded to the dtype
    x, _ = random_inputs(spec)
    want = exact.evaluate(np.asarray(x, np.float64))
    folded = layer.fold_batch_norm()
    assert folded.spec.normalization.value == "none" and folded.spec.bias
    assert relative_error(folded.evaluate(x), want) <= tolerance(DType(dtype), spec.fan_in)


@pytest.mark.parametrize("norm", ["none", "layer_norm"])
def test_only_batch_norm_folds(norm):
    with pytest.raises(ValueError, match="fold_batch_norm: the layer's normalization is"):
        make_layer(small_layer_spec(normalization=norm)).fold_batch_norm()


def test_batch_norm_without_running_statistics_does_not_fold():
    with pytest.raises(ValueError, match="keeps no running statistics"):
        make_layer(small_layer_spec(bn_track_running_stats=False)).fold_batch_norm()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_batch_norm_without_gamma_and_beta_folds_as_gamma_one_beta_zero(dtype):
    exact = make_layer(small_layer_spec(bn_affine=False, dtype="float64"), seed=2)
    layer = make_layer(small_layer_spec(bn_affine=False, dtype=dtype), seed=2)
    x, _ = random_inputs(layer.spec)
    want = exact.evaluate(np.asarray(x, np.float64))
    assert relative_error(layer.fold_batch_norm().evaluate(x), want) <= tolerance(DType(dtype), layer.spec.fan_in)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_a_folded_module_gives_the_modules_eval_output_within_the_tolerance(dtype):
    torch = pytest.importorskip("torch")
    from conv2d.torch import Conv2dNormActivation

    torch.manual_seed(0)
    m = Conv2dNormActivation(5, 6, 3, padding=1, norm="batch_norm", activation="gelu", dtype=torch.float64)
    with torch.no_grad():
        m.norm.running_mean.uniform_(-0.5, 0.5), m.norm.running_var.uniform_(0.5, 2.0)
        m.norm.weight.uniform_(0.5, 1.5), m.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 5, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    want = m.eval()(x).detach().numpy()
    low = Conv2dNormActivation(5, 6, 3, padding=1, norm="batch_norm", activation="gelu", dtype=getattr(torch, dtype))
    low.load_state_dict(m.state_dict())
    folded = low.fold_batch_norm()
    assert folded.norm is None and not folded.training
    got = folded(x.to(getattr(torch, dtype))).detach().to(torch.float64).numpy()
    assert relative_error(got, want) <= tolerance(DType(dtype), 5 * 9)
