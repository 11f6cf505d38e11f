"""The reference against PyTorch directly on random specs, and against finite differences."""

import numpy as np
import pytest

from conftest import make_layer, random_inputs
from conv2d import Activation, LayerSpec
from conv2d.testing import assert_close, cancellation_scales, reduction_lengths


def random_specs(count: int, seed: int) -> list[LayerSpec]:
    rng = np.random.default_rng(seed)
    specs = []
    acts, norms = list(Activation), ["none", "batch_norm", "layer_norm"]
    while len(specs) < count:
        k = (int(rng.integers(1, 6)), int(rng.integers(1, 6)))
        p = (int(rng.integers(0, 3)), int(rng.integers(0, 3)))
        h, w = int(rng.integers(max(1, k[0] - 2 * p[0]), 12)), int(rng.integers(max(1, k[1] - 2 * p[1]), 12))
        spec = LayerSpec(batch_size=int(rng.integers(1, 5)), in_height=h, in_width=w,
                         in_channels=int(rng.integers(1, 6)), out_channels=int(rng.integers(1, 6)), kernel=k,
                         stride=(int(rng.integers(1, 4)), int(rng.integers(1, 4))), padding=p,
                         activation=acts[len(specs) % len(acts)], normalization=norms[len(specs) % 3],
                         bn_momentum=float(rng.uniform(0, 1)), dtype="float64")
        pixels = spec.batch_size * spec.out_height * spec.out_width
        group = {"batch_norm": pixels, "layer_norm": spec.out_height * spec.out_width * spec.out_channels}
        if group.get(spec.normalization.value, 8) < 8:
            # Statistics of a handful of values are ill-conditioned: their gradients are
            # differences of nearly equal terms, beyond what a rounding bound describes.
            continue
        if p[0] >= k[0] or p[1] >= k[1]:
            # Windows wholly in the padding give many equal pre-activations, and a few
            # samples of nearly equal values make the norm's statistics ill-conditioned;
            # golden/sigmoid_ln_padding_windows covers such windows at a sound size.
            continue
        specs.append(spec)
    return specs


SPECS = random_specs(24, seed=2026)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("spec", SPECS, ids=[f"s{i}" for i in range(len(SPECS))])
def test_reference_matches_pytorch_autograd(spec, training):
    torch_oracle = pytest.importorskip("conv2d.testing.torch_oracle", reason="PyTorch (the oracle) is not installed")
    layer = make_layer(spec, seed=3)
    x, dy = random_inputs(spec, seed=4)
    want = torch_oracle.run(spec, layer.state_dict(), x, dy, training)
    lengths = reduction_lengths(spec)
    y = layer.forward(x, training=training)
    d_x = layer.backward_full(x, dy)
    assert_close("y", y, want["y"], "float64", lengths["y"])
    assert_close("pre_activations", layer.pre_activations, want["pre_activations"], "float64", lengths["pre_activations"])
    assert_close("d_x", d_x, want["d_x"], "float64", lengths["d_x"])
    scales = cancellation_scales(spec, training, x, want["d_pre_activations"])
    for k, g in layer.grad_dict().items():
        assert_close(k, g, want[f"grad.{k}"], "float64", lengths[k], scales.get(k, 0.0))
    for k in ("running_mean", "running_var"):
        if k in want:
            assert_close(k, layer.state_dict()[k], want[k], "float64", lengths[k])


FD_SPECS = [
    LayerSpec(batch_size=2, in_height=5, in_width=4, in_channels=2, out_channels=3, kernel=3, stride=(1, 2),
              padding=1, activation=act, normalization=norm, dtype="float64")
    for act, norm in [("gelu", "batch_norm"), ("tanh", "layer_norm"), ("sigmoid", "none"),
                      ("gelu_tanh", "batch_norm"), ("gelu_original", "none"), ("identity", "batch_norm")]
]


def _loss(layer, x, dy, training):
    return float((layer.forward(x, training=training) * dy).sum())


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("spec", FD_SPECS, ids=lambda s: f"{s.activation.value}-{s.normalization.value}")
def test_every_gradient_matches_central_differences(spec, training):
    """d/dθ of L = sum(y * d_y) by central differences (h = 1e-6), every entry."""
    layer = make_layer(spec, seed=5)
    x, dy = random_inputs(spec, seed=6)
    layer.forward(x, training=training)
    d_x = layer.backward_full(x, dy)
    grads = layer.grad_dict()
    h = 1e-6
    base = layer.state_dict()

    def numeric_param(name):
        out = np.zeros_like(base[name])
        for i in np.ndindex(out.shape):
            values = []
            for sign in (1, -1):
                s = {k: v.copy() for k, v in base.items()}
                s[name][i] += sign * h
                layer.load_state_dict(s)
                values.append(_loss(layer, x, dy, training))
            out[i] = (values[0] - values[1]) / (2 * h)
        layer.load_state_dict(base)
        return out

    for name, g in grads.items():
        np.testing.assert_allclose(g, numeric_param(name), rtol=1e-5, atol=1e-7, err_msg=name)
    numeric_x = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        numeric_x[i] = (_loss(layer, xp, dy, training) - _loss(layer, xm, dy, training)) / (2 * h)
    np.testing.assert_allclose(d_x, numeric_x, rtol=1e-5, atol=1e-7, err_msg="d_x")
