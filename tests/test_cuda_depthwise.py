"""The numba depthwise convolutions (conv2d/cuda/depthwise.py): against the reference,
the fast kernels bitwise as the simple ones, and the default choice for depthwise layers;
in numba's CUDA simulator where there is no GPU (CI), on the GPU where there is."""

import math

import numpy as np
import pytest

from conftest import make_layer, random_inputs
from conv2d import LayerSpec

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")

from conv2d import Conv2d  # noqa: E402
from conv2d.cuda.runtime import numba_cuda  # noqa: E402
from conv2d.arrays import to_host  # noqa: E402
from conv2d.dtypes import storage_dtype  # noqa: E402
from host_convolutions import HostConvolutions  # noqa: E402

cuda = numba_cuda()


def cuda_layer(spec, seed=0, **options):
    return make_layer(spec, seed, backend="cuda", convolutions=HostConvolutions, **options)


DEPTHWISE_CASES = {"plain": dict(), "stride2_valid": dict(stride=2, padding=0),
                   "multiplier2_same_dilated": dict(out_channels=8, padding="same", dilation=2),
                   "reflect_asymmetric": dict(padding=((1, 2), (0, 1)), padding_mode="reflect", kernel=(3, 2)),
                   "layer_norm_no_bias": dict(bias=False, normalization="layer_norm", activation="silu"),
                   # The fast kernels' strips along the width at their edges: a stride and a dilation
                   # together (a strip's input column serves taps of several values), an odd width,
                   # and one column.
                   "stride2_dilated_odd_width": dict(stride=2, dilation=2, padding=2, in_width=9),
                   "one_column": dict(in_width=1, kernel=(3, 1), padding=(1, 0)),
                   # An odd channel count: the float32 forward's strips one channel a thread.
                   "three_channels": dict(in_channels=3, out_channels=3, groups=3),
                   # Strided input gradients: a row stride beside the width's, padding on the stride.
                   "stride2x3_padded": dict(stride=(2, 3), padding=1, in_height=9, in_width=11),
                   "stride2_padded_dilated_rows": dict(stride=2, padding=(3, 1), dilation=(2, 1), in_height=9)}
# 576 rows: 9 partial blocks of the weight gradient, whose fast phase two adds a group of 8, then 1.
FAST_DEPTHWISE_CASES = {**DEPTHWISE_CASES, "nine_partial_blocks": dict(batch_size=12, in_height=8, in_width=6)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(DEPTHWISE_CASES))
def test_the_numba_depthwise_convolutions_match_the_reference(case, dtype):
    """depthwise_kernel="numba": forward, evaluate, d_x and every gradient as the
    reference's within the dtype's tolerance (kernels/depthwise.py, no cuDNN)."""
    spec = LayerSpec(**{**dict(batch_size=3, in_height=7, in_width=6, in_channels=4, out_channels=4, kernel=3,
                               padding=1, groups=4, activation="relu", dtype=dtype), **DEPTHWISE_CASES[case]})
    ours = make_layer(spec, backend="cuda", depthwise_kernel="numba")
    ref = make_layer(spec, backend="reference")
    ref.load_state_dict(ours.state_dict())
    x, dy = random_inputs(spec)
    assert ours.functions.conv_plans == dict.fromkeys(("forward", "backward_data", "backward_filter"),
                                                      "numba depthwise")
    tol = 1e-5 if dtype == "float32" else 2e-2
    st = storage_dtype(spec.dtype)

    def close(got, want, what):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol,
                                   err_msg=what)
    close(to_host(ours.forward(x), st), ref.forward(x), "y")
    close(to_host(ours.backward_full(x, dy), st), ref.backward_full(x, dy), "d_x")
    for k, g in ref.grad_dict().items():
        close(ours.grad_dict()[k], g, k)
    close(to_host(ours.evaluate(x), st), ref.evaluate(x), "evaluate")


@pytest.mark.parametrize("case", list(FAST_DEPTHWISE_CASES))
def test_the_fast_depthwise_kernels_are_bitwise_the_simple_ones(case):
    """kernels/depthwise.py's fast kernels (the layer's sizes compile-time constants, the
    weights in shared memory; the weight gradient's first phase a thread a channel with
    the taps in registers) add the simple kernels' products in the simple kernels' order:
    y, d_x and d_w bitwise theirs."""
    assert_fast_depthwise_is_simple(FAST_DEPTHWISE_CASES[case])


@pytest.mark.parametrize("case", ["plain", "stride2_valid"])
def test_the_fast_depthwise_kernels_are_bitwise_the_simple_ones_in_bfloat16(case):
    """The same in bfloat16 (16-bit loads and stores, float32 sums)."""
    assert_fast_depthwise_is_simple(FAST_DEPTHWISE_CASES[case], "bfloat16")


def test_the_fast_depthwise_kernels_read_weights_too_many_for_shared_memory_from_w(monkeypatch):
    from conv2d.cuda.kernels import depthwise

    # A geometry of this test alone (the kernels are cached by geometry), whose kernels
    # are made while no weights fit in shared memory.
    clear = getattr(depthwise.fast_depthwise_kernels, "cache_clear", lambda: None)  # compile_kernels wraps it
    monkeypatch.setattr(depthwise, "SHARED_WEIGHTS", 0)
    clear()
    try:
        assert_fast_depthwise_is_simple(dict(out_channels=8, kernel=(2, 3), in_height=5))
    finally:
        clear()


def test_the_fast_depthwise_kernels_of_indices_beyond_31_bits_are_bitwise_the_simple_ones(monkeypatch):
    """Where x's or y's indices do not fit 31 bits, the fast forward and input gradient
    take one thread a value and 64-bit indices (no strips): forced here on a small layer."""
    from conv2d.cuda import depthwise

    monkeypatch.setattr(depthwise, "SMALL_INDEX", 0)  # every layer's indices "beyond 31 bits"
    assert_fast_depthwise_is_simple(dict(out_channels=8, padding="same", dilation=2))


@pytest.mark.parametrize("fields, strips", [(dict(), (4, 4)), (dict(stride=2, padding=0), (4, 4)),
                                            (dict(stride=(1, 3), padding=0), (4, 1))],
                         ids=["stride1", "stride2", "width_stride3"])
def test_the_fast_depthwise_kernels_compute_strips_along_the_width_where_indices_fit_31_bits(fields, strips):
    """The forward a strip of STRIP values a thread at any stride, the input gradient where
    STRIP is a multiple of the width's stride (else one thread a value)."""
    from conv2d.cuda.kernels.depthwise import STRIP, fast_depthwise_kernels, geometry_key
    from conv2d.cuda.kernels.layout import window_geometry
    from conv2d.cuda.plans import convolution_spec

    spec = convolution_spec(LayerSpec(**{**dict(batch_size=3, in_height=7, in_width=6, in_channels=4,
                                                out_channels=4, kernel=3, padding=1, groups=4), **fields}))
    key = geometry_key({**window_geometry(spec), "M": 1})
    fast = fast_depthwise_kernels("float32", key, True)
    assert (fast.forward_strip, fast.backward_strip) == tuple(STRIP if s == 4 else 1 for s in strips)
    assert (fast_depthwise_kernels("float32", key, False).forward_strip,
            fast_depthwise_kernels("float32", key, False).backward_strip) == (1, 1)


def assert_fast_depthwise_is_simple(fields: dict, dtype: str = "float32") -> None:
    from conv2d.cuda.depthwise import DepthwiseConvolutions
    from conv2d.cuda.launch import Launcher
    from conv2d.cuda.plans import convolution_spec
    from conv2d.cuda.runtime import to_device_bits
    from conv2d.dtypes import storage_dtype

    spec = convolution_spec(LayerSpec(**{**dict(batch_size=3, in_height=7, in_width=6, in_channels=4,
                                                out_channels=4, kernel=3, padding=1, groups=4, dtype=dtype),
                                         **fields}))
    st = storage_dtype(spec.dtype)
    x, d_z = (cuda.to_device(to_device_bits(a.reshape(-1))) for a in random_inputs(spec))
    rng = np.random.default_rng(1)
    w, b = (cuda.to_device(to_device_bits(rng.standard_normal(size).astype(st)))
            for size in (math.prod(spec.weight_shape), spec.out_channels))
    bits = to_device_bits(np.zeros(1, st)).dtype
    stream = cuda.stream()
    results = {}
    for simple in (True, False):
        conv = DepthwiseConvolutions(cuda, spec, Launcher(lambda: stream, False), simple)
        y, d_x, d_w = (cuda.device_array(math.prod(shape), bits)
                       for shape in (spec.output_shape, spec.input_shape, spec.weight_shape))
        conv.forward(x, w, b, y, relu=True)
        conv.backward_data(d_z, w, d_x)
        conv.backward_filter(x, d_z, d_w)
        results[simple] = [a.copy_to_host(stream=stream) for a in (y, d_x, d_w)]
    stream.synchronize()
    as_bits = np.uint32 if bits == np.float32 else bits
    for name, fast, simple in zip(("y", "d_x", "d_w"), results[False], results[True]):
        np.testing.assert_array_equal(fast.view(as_bits), simple.view(as_bits), err_msg=name)


def test_the_numba_depthwise_convolutions_refuse_a_layer_that_is_not_depthwise():
    spec = LayerSpec(batch_size=2, in_height=5, in_width=5, in_channels=4, out_channels=4, kernel=3, groups=2)
    with pytest.raises(ValueError, match=r"^depthwise_kernel: 'numba' takes depthwise layers \(groups == "
                                         r"in_channels\), got groups=2 with in_channels=4"):
        Conv2d(spec, "cuda", depthwise_kernel="numba")
    with pytest.raises(ValueError, match="^depthwise_kernel: expected 'auto', 'cudnn' or 'numba', got 'fast'"):
        Conv2d(spec, "cuda", depthwise_kernel="fast", convolutions=HostConvolutions)


@pytest.mark.parametrize("groups, chosen", [(4, "numba"), (2, "cudnn"), (1, "cudnn")])
def test_depthwise_layers_take_the_numba_kernels_by_default_and_others_cudnn(groups, chosen):
    """depthwise_kernel="auto" (the default): the numba kernels for groups == in_channels,
    cuDNN for any other layer; "cudnn" keeps a depthwise layer on cuDNN."""
    spec = LayerSpec(batch_size=2, in_height=5, in_width=5, in_channels=4, out_channels=8, kernel=3, padding=1,
                     groups=groups)
    layer = Conv2d(spec, "cuda", convolutions=HostConvolutions)
    assert layer.functions.depthwise_kernel == chosen
    if groups == 4:
        assert Conv2d(spec, "cuda", depthwise_kernel="cudnn",
                      convolutions=HostConvolutions).functions.depthwise_kernel == "cudnn"
        numba = Conv2d(spec, "cuda")  # no stand-in: the numba kernels themselves, in the simulator here
        numba.forward(random_inputs(spec)[0])
        assert numba.functions.conv_plans == dict.fromkeys(("forward", "backward_data", "backward_filter"),
                                                           "numba depthwise")
