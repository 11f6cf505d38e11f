"""The cpu backend's evaluate: bitwise its forward's y (training=False) on every kind of
layer, whether fused into one pass after the convolution or not; the prepared evaluate
(conv2d.backend.Preparing) bitwise evaluate's, reading the parameters' values at each
call; the compiled im2col against NumPy's padded windows."""

import numpy as np
import pytest

pytest.importorskip("numba", reason="numba is not installed (the test extra brings it)")

from conftest import make_layer, random_inputs  # noqa: E402
from conv2d import LayerSpec  # noqa: E402
from conv2d.backend import make_functions  # noqa: E402
from conv2d.cpu import conv as cpu_conv, conv_kernels  # noqa: E402
from conv2d.cpu.functional import _fused_evaluate  # noqa: E402
from conv2d.state import split_state  # noqa: E402

LAYERS = {
    "batch_norm_relu": dict(in_channels=5, out_channels=8, kernel=3, padding=1, normalization="batch_norm",
                            activation="relu"),
    "strided_batch_norm_no_bias_relu6": dict(in_channels=4, out_channels=6, kernel=3, stride=2, padding=1,
                                             bias=False, normalization="batch_norm", activation="relu6"),
    "batch_norm_without_affine_silu": dict(in_channels=3, out_channels=4, kernel=2, normalization="batch_norm",
                                           bn_affine=False, activation="silu"),
    "batch_norm_of_batch_statistics": dict(in_channels=3, out_channels=4, kernel=3, normalization="batch_norm",
                                           bn_track_running_stats=False, activation="relu"),
    "layer_norm_gelu": dict(in_channels=4, out_channels=6, kernel=3, stride=2, padding=1,
                            normalization="layer_norm", activation="gelu"),
    "no_norm_dilated_tanh": dict(in_channels=4, out_channels=5, kernel=3, dilation=2, padding=(2, 1),
                                 activation="tanh"),
    "asymmetric_padding_identity": dict(in_channels=2, out_channels=3, kernel=(3, 2), padding=(0, 1),
                                        padding_end=(2, 0)),
    "reflect_padding_leaky_relu": dict(in_channels=3, out_channels=4, kernel=3, padding=1, padding_mode="reflect",
                                       activation="leaky_relu"),
    "depthwise_batch_norm": dict(in_channels=6, out_channels=12, kernel=3, padding=1, groups=6,
                                 normalization="batch_norm", activation="relu6"),
    "depthwise_strided_no_bias": dict(in_channels=6, out_channels=6, kernel=3, stride=2, padding=1, groups=6,
                                      bias=False, normalization="batch_norm", activation="relu6"),
    "grouped": dict(in_channels=6, out_channels=4, kernel=3, padding=1, groups=2, activation="elu"),
    "batch_invariant": dict(in_channels=4, out_channels=5, kernel=3, padding=1, normalization="batch_norm",
                            batch_invariant=True, activation="relu"),
}
# One sample of 9x7, one of 33x31 (one block) and 16 samples of 33x31 (blocks); the
# padding modes other than zeros go through NumPy's windows.
SIZES = {"acting": (1, 9, 7), "acting_large": (1, 33, 31), "batch": (16, 33, 31)}


def _arrays(spec: LayerSpec) -> tuple[dict, dict, np.ndarray]:
    layer = make_layer(spec, seed=5, backend="cpu", threads=1)
    params, running = split_state(layer.state_dict())
    x, _ = random_inputs(spec, seed=6)
    return params, running, x


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("layer", LAYERS)
def test_evaluate_gives_the_bits_of_forward_in_eval(layer, size, dtype):
    n, h, w = SIZES[size]
    spec = LayerSpec(batch_size=n, in_height=h, in_width=w, dtype=dtype, **LAYERS[layer])
    params, running, x = _arrays(spec)
    fn = make_functions("cpu", spec, threads=1)
    want, _ = fn.forward(params, x, False, running)
    _same_bits(fn.evaluate(params, x, running), want)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_the_fused_evaluate_covers_layers_without_a_norm_or_with_running_statistics(dtype):
    """Which layers the test above checks in one pass after the convolution (the others
    run the forward's passes): a change here would leave the fused pass untested."""
    fused = {name for name, options in LAYERS.items()
             if _fused_evaluate(LayerSpec(batch_size=1, in_height=9, in_width=7, dtype=dtype, **options))}
    assert fused == set(LAYERS) - {"batch_norm_of_batch_statistics", "layer_norm_gelu"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("layer", ["batch_norm_relu", "no_norm_dilated_tanh", "depthwise_batch_norm",
                                   "depthwise_strided_no_bias", "grouped", "layer_norm_gelu"])
def test_a_prepared_evaluate_gives_evaluates_bits_and_reads_the_values_at_each_call(layer, size, dtype):
    n, h, w = SIZES[size]
    spec = LayerSpec(batch_size=n, in_height=h, in_width=w, dtype=dtype, **LAYERS[layer])
    params, running, x = _arrays(spec)
    fn = make_functions("cpu", spec, threads=1)
    run = fn.prepare_evaluate(params, running, x.shape)
    _same_bits(run(x), fn.evaluate(params, x, running))
    # An optimizer's step and a batch's statistics change the values in place, not the memory.
    params["weights"][...] = (params["weights"].astype(np.float32) * -0.5).astype(params["weights"].dtype)
    if "bias" in params:
        params["bias"][...] = 0.25
    if running:
        running["running_mean"][...] += 0.125
        running["running_var"][...] *= 2.0
    _same_bits(run(x), fn.evaluate(params, x, running))


def test_a_prepared_evaluate_checks_its_arrays_once_when_made():
    spec = LayerSpec(batch_size=1, in_height=9, in_width=7, **LAYERS["batch_norm_relu"])
    params, running, x = _arrays(spec)
    fn = make_functions("cpu", spec, threads=1)
    with pytest.raises(ValueError, match="running"):
        fn.prepare_evaluate(params, None, x.shape)
    with pytest.raises(ValueError, match="x"):
        fn.prepare_evaluate(params, running, (1, 9, 7, 4))  # 4 channels, the spec's 5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kernel, stride, padding, dilation", [
    ((3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1)), ((3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1)),
    ((4, 4), (1, 1), ((0, 0), (0, 0)), (1, 1)), ((3, 2), (2, 1), ((2, 0), (0, 3)), (1, 2)),
    ((8, 8), (4, 4), ((0, 0), (0, 0)), (1, 1)), ((2, 3), (1, 3), ((1, 2), (2, 1)), (3, 1))])
@pytest.mark.parametrize("channels", [1, 3, 16])
def test_the_compiled_im2col_equals_numpys_padded_windows(kernel, stride, padding, dilation, dtype, channels):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 12, 11, channels)).astype(dtype)
    windows = cpu_conv._windows(cpu_conv.pad(x, padding), kernel, stride, dilation)
    want = windows.reshape(-1, kernel[0] * kernel[1] * channels)
    cols = np.full(want.shape, np.nan, dtype)
    conv_kernels.im2col(x, padding[0][0], padding[1][0], *stride, *dilation, *kernel, *windows.shape[1:3], cols)
    _same_bits(cols, want)
