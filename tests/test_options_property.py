"""PyTorch's convolution options in random combinations (Hypothesis): each host backend (the
reference and cpu) in float64 against PyTorch's autograd in float64 (conv2d.testing.torch_oracle), forward
in training and eval, d_x, every parameter gradient and the running statistics."""

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (the test extra brings it)")
pytest.importorskip("torch", reason="torch (the oracle) is not installed")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import make_layer, random_inputs  # noqa: E402
from conv2d import LayerSpec  # noqa: E402
from conv2d.testing import torch_oracle  # noqa: E402

ACTIVATIONS = ["identity", "relu", "tanh", "gelu", "silu", "relu6", "hardswish", "leaky_relu", "elu"]


@st.composite
def specs(draw):
    groups = draw(st.sampled_from([1, 2, 3]))
    fields = dict(batch_size=draw(st.integers(1, 3)), in_height=draw(st.integers(3, 9)),
                  in_width=draw(st.integers(3, 9)), in_channels=groups * draw(st.integers(1, 2)),
                  out_channels=groups * draw(st.integers(1, 3)), groups=groups,
                  kernel=(draw(st.integers(1, 4)), draw(st.integers(1, 4))),
                  stride=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
                  dilation=(draw(st.integers(1, 2)), draw(st.integers(1, 2))),
                  padding_mode=draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"])),
                  activation=draw(st.sampled_from(ACTIVATIONS)),
                  normalization=draw(st.sampled_from(["none", "batch_norm", "layer_norm"])), dtype="float64")
    padding = draw(st.sampled_from(["int", "pair", "same", "valid", "asymmetric"]))
    if padding == "same":
        fields.update(padding="same", stride=1)
    elif padding == "valid":
        fields["padding"] = "valid"
    elif padding == "asymmetric":
        fields["padding"] = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(2))
    else:
        fields["padding"] = draw(st.integers(0, 2)) if padding == "int" else (draw(st.integers(0, 2)),
                                                                                  draw(st.integers(0, 2)))
    if fields["normalization"] != "none":
        fields["bn_affine"] = draw(st.booleans())
    if fields["normalization"] == "batch_norm":
        fields["bn_track_running_stats"] = draw(st.booleans())
        fields["bn_momentum"] = draw(st.sampled_from([0.1, 0.7, None]))  # None: the cumulative average
    if fields["activation"] == "leaky_relu":
        fields["negative_slope"] = draw(st.floats(-0.5, 0.5))
    if fields["activation"] == "elu":
        fields["elu_alpha"] = draw(st.floats(0.1, 2.0))
    try:
        return LayerSpec(**fields)
    except ValueError:  # a combination that cannot exist (a kernel larger than the input, ...)
        assume(False)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.filter_too_much])
@given(spec=specs(), training=st.booleans())
def test_random_option_combinations_match_pytorch_in_float64(backend, spec, training):
    if spec.batch_statistics(training) and spec.normalization.value == "batch_norm":
        assume(spec.batch_size * spec.out_height * spec.out_width > 1)  # a variance needs two values
    layer = make_layer(spec, seed=1, backend=backend)
    x, d_y = random_inputs(spec, seed=2)
    want = torch_oracle.run(spec, layer.state_dict(), x, d_y, training)
    np.testing.assert_allclose(layer.forward(x, training=training), want["y"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layer.backward_full(x, d_y), want["d_x"], rtol=1e-9, atol=1e-11)
    for name, grad in layer.grad_dict().items():
        np.testing.assert_allclose(grad, want[f"grad.{name}"], rtol=1e-9, atol=1e-11, err_msg=name)
    state = layer.state_dict()
    for name in ("running_mean", "running_var", "num_batches_tracked"):  # those the layer keeps
        if name in state:
            np.testing.assert_allclose(state[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("fields", [
    dict(in_height=4, in_width=4, kernel=4, padding=0),  # the digits CNN's last layer: a 1x1 map
    dict(in_height=5, in_width=5, kernel=3, dilation=2, padding=0, stride=2),
    dict(in_height=3, in_width=3, kernel=3, dilation=2, padding=1, padding_mode="reflect"),
    dict(in_height=3, in_width=2, kernel=(3, 2), stride=3, padding=((0, 1), (0, 0)), padding_mode="circular",
         groups=2, in_channels=4, out_channels=6),
])
def test_a_layer_with_a_one_by_one_output_map_matches_pytorch_in_float64(fields):
    """conv_backward_data's one-window path (one product for every tap)."""
    spec = LayerSpec(**{**dict(batch_size=3, in_channels=2, out_channels=3, activation="tanh", dtype="float64"),
                        **fields})
    assert (spec.out_height, spec.out_width) == (1, 1)
    layer = make_layer(spec, seed=1)
    x, d_y = random_inputs(spec, seed=2)
    want = torch_oracle.run(spec, layer.state_dict(), x, d_y, True)
    layer.forward(x, training=True)
    np.testing.assert_allclose(layer.backward_full(x, d_y), want["d_x"], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(layer.grad_dict()["weights"], want["grad.weights"], rtol=1e-9, atol=1e-11)
