"""The CUDA backend's numba kernels and their orchestration, with the reference standing in
for cuDNN: in numba's CUDA simulator where there is no GPU (CI), on the GPU where there is."""


import numpy as np
import pytest

from conftest import GOLDEN_DIR, HAVE_GPU, make_layer, random_inputs, small_layer_spec
from conv2d import LayerSpec

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")

import ml_dtypes  # noqa: E402

from conv2d import Conv2d  # noqa: E402
from conv2d.cuda import kernels as K  # noqa: E402
from conv2d.cuda.runtime import numba_cuda  # noqa: E402
from conv2d.arrays import to_host  # noqa: E402
from conv2d.testing.golden import MODES, check_case, golden_files, load_case, run_case  # noqa: E402
from host_convolutions import HostConvolutions  # noqa: E402

cuda = numba_cuda()
FILES = {p.stem: p for p in golden_files(GOLDEN_DIR)}
# The simulator runs every GPU thread as a Python thread: every golden spec in float32,
# a spread of them (no norm, batch norm, layer norm; strides; ReLU) in 16 bits.
SIXTEEN_BIT_CASES = ["relu_bn_nonsquare", "gelu_original_ln", "tanh_stride4_pad2", "fast_tanh_bn_k5_c1"]
CASES = ([(name, "float32", mode) for name in FILES for mode in MODES]
         + [(name, dt, mode) for name in SIXTEEN_BIT_CASES for dt in ("float16", "bfloat16") for mode in MODES])


def cuda_layer(spec, seed=0, **options):
    return make_layer(spec, seed, backend="cuda", convolutions=HostConvolutions, **options)


def assert_step_matches(ours, ref, x, dy):
    """forward and backward_full of the CUDA layer agree with the reference's."""
    np.testing.assert_allclose(to_host(ours.forward(x)), ref.forward(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_host(ours.backward_full(x, dy)), ref.backward_full(x, dy), rtol=1e-4, atol=1e-5)


def assert_grads_and_state_match(ours, ref, bias_atol=1e-5):
    """The accumulated gradients and the state (running statistics) agree too."""
    for k, g in ref.grad_dict().items():
        atol = bias_atol if k == "bias" else 1e-5
        np.testing.assert_allclose(ours.grad_dict()[k], g, rtol=1e-4, atol=atol, err_msg=k)
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("name, dtype, mode", [pytest.param(*c, id="-".join(c))
                                              for c in CASES])
def test_cuda_kernels_match_the_golden_files(name, dtype, mode):
    case = load_case(FILES[name])
    got = run_case(case, dtype, mode, backend="cuda", convolutions=HostConvolutions)
    check_case(case, got, dtype, mode)


@cuda.jit
def _round_trip(values, bits, back):
    i = cuda.grid(1)
    if i < values.size:
        bits[i] = K.f32_to_bf16(values[i])
        back[i] = K.bf16_to_f32(bits[i])


def test_bfloat16_conversion_rounds_like_ml_dtypes():
    specials = [0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 1e-40, -3e-39, 3.3895314e38, 1.00390625, 1.01171875,
                1.0 + 2**-8, 1.0 + 3 * 2**-8]  # subnormals, overflow to inf, exact ties either way
    values = np.concatenate([np.array(specials, np.float32),
                             np.random.default_rng(0).standard_normal(64).astype(np.float32) * 100])
    bits = cuda.device_array(values.size, np.uint16)
    back = cuda.device_array(values.size, np.float32)
    _round_trip[1, 128](cuda.to_device(values), bits, back)
    want = values.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bits.copy_to_host(), want.view(np.uint16))
    np.testing.assert_array_equal(back.copy_to_host(), want.astype(np.float32))


@pytest.mark.parametrize("norm", ["batch_norm", "layer_norm"])
def test_reductions_over_several_partials_match_the_reference(norm):
    # Small shapes give one partial per group; force several to exercise phase two.
    spec = LayerSpec(batch_size=2, in_height=6, in_width=5, in_channels=2, out_channels=3, kernel=3, padding=1,
                     activation="tanh", normalization=norm, dtype="float32")
    config = K.LaunchConfig(row_blocks=3, segment_blocks=2)
    ours, ref = cuda_layer(spec, launch_config=config), make_layer(spec, backend="reference")
    x, dy = random_inputs(spec)
    assert_step_matches(ours, ref, x, dy)
    for k, g in ref.grad_dict().items():
        np.testing.assert_allclose(ours.grad_dict()[k], g, rtol=1e-4, atol=1e-5, err_msg=k)
    for k in ("running_mean", "running_var"):
        if k in ref.state_dict():
            np.testing.assert_allclose(ours.state_dict()[k], ref.state_dict()[k], rtol=1e-5, err_msg=k)


def test_evaluate_keeps_the_forward_cache(monkeypatch):
    spec = LayerSpec(batch_size=2, in_height=4, in_width=4, in_channels=2, out_channels=3, kernel=3, padding=1,
                     activation="relu", normalization="batch_norm", dtype="float32")
    layer = cuda_layer(spec)
    x, dy = random_inputs(spec)
    layer.forward(x, training=True)
    pre = to_host(layer.pre_activations).copy()
    before = layer.state_dict()
    layer.evaluate(x * 3)
    np.testing.assert_array_equal(to_host(layer.pre_activations), pre)
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


@pytest.mark.skipif(HAVE_GPU, reason="checks the simulator's own error path; on a GPU the cuDNN backend runs")
def test_cuda_backend_without_a_gpu_says_what_is_missing():
    from conv2d.cuda.runtime import CudaUnavailableError

    spec = LayerSpec(batch_size=1, in_height=4, in_width=4, in_channels=1, out_channels=1, kernel=3)
    with pytest.raises(CudaUnavailableError, match="needs a real GPU"):
        Conv2d(spec, backend="cuda")


def test_autotune_must_be_a_bool():
    spec = LayerSpec(batch_size=1, in_height=4, in_width=4, in_channels=1, out_channels=1, kernel=3)
    with pytest.raises(TypeError, match="autotune: expected a bool, got 'yes'"):
        Conv2d(spec, backend="cuda", autotune="yes")


@pytest.mark.parametrize("norm", ["none", "batch_norm"])
def test_phase_two_in_the_last_block_runs_again_on_the_next_launch(norm):
    # Several blocks per row kernel: each launch's last block must finish and reset its
    # counter, so a second step on new data matches the reference as the first did.
    spec = LayerSpec(batch_size=3, in_height=5, in_width=4, in_channels=2, out_channels=3, kernel=3, padding=1,
                     activation="relu", normalization=norm, dtype="float32")
    ours = cuda_layer(spec, launch_config=K.LaunchConfig(row_blocks=4))
    ref = make_layer(spec, backend="reference")
    for seed in (1, 2):
        assert_step_matches(ours, ref, *random_inputs(spec, seed=seed))
    assert_grads_and_state_match(ours, ref)


@pytest.mark.parametrize("channels, blocks, group", [(100, 11, 16), (260, 3, 16), (100, 11, 4), (260, 3, 2)],
                         ids=["two-threads-a-channel", "wider-than-a-block", "groups-ragged", "groups-wide"])
def test_phase_two_adds_the_partials_of_every_block(channels, blocks, group):
    # 100 channels: two threads of the last block share a channel, each adding several
    # turns of partials with a ragged last turn; 260 channels: more channels than threads.
    # With groups of fewer blocks than the kernel has, in two levels: 11 blocks in groups
    # of 4, 4, 3; 3 blocks in groups of 2, 1.
    spec = LayerSpec(batch_size=3, in_height=2, in_width=2, in_channels=2, out_channels=channels, kernel=1,
                     activation="relu", normalization="batch_norm", dtype="float32")
    ours = cuda_layer(spec, launch_config=K.LaunchConfig(row_blocks=blocks, phase_group=group))
    ref = make_layer(spec, backend="reference")
    assert_step_matches(ours, ref, *random_inputs(spec))
    # Under batch norm the bias gradient sums d_z to about zero: float32 leaves ~1e-5 of
    # noise, while a partial left out or added twice would leave ~1.
    assert_grads_and_state_match(ours, ref, bias_atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_d_y_off_eight_byte_alignment_gives_the_same_bits(dtype):
    # Row kernels read and write lane groups with 8-byte loads and stores; a d_y one
    # value off that alignment is read one value at a time (and d_z written one value at
    # a time), by the same sums in the same order.
    from conv2d.cuda.runtime import to_device_bits

    spec = LayerSpec(batch_size=2, in_height=4, in_width=3, in_channels=2, out_channels=8, kernel=3, padding=1,
                     activation="tanh", normalization="batch_norm", dtype=dtype)
    x, dy = random_inputs(spec)
    bits = to_device_bits(dy).reshape(-1)
    padded = cuda.to_device(np.concatenate([bits[:1], bits]))
    offset = padded[1:].reshape(spec.output_shape)
    aligned = cuda.to_device(bits).reshape(spec.output_shape)
    results = []
    for d_y in (aligned, offset):
        layer = cuda_layer(spec)
        assert layer.functions.lanes > 1
        layer.forward(x)
        results.append((to_host(layer.backward_full(x, d_y)), layer.grad_dict()))
        narrow = [key.narrow for _, key in layer.functions.launches
                  if key.step in ("norm_gradients", "grad_pre_activations")]
        assert narrow and all(narrow) == (d_y is offset)
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for k, g in results[0][1].items():
        np.testing.assert_array_equal(results[1][1][k], g, err_msg=k)


@pytest.mark.parametrize("norm", ["none", "batch_norm", "layer_norm"])
def test_fresh_gradients_are_written_whole_not_added_to_unzeroed_memory(monkeypatch, norm):
    """Fresh gradients come from memory that is not zeroed first (the row kernels write the
    bias, gamma and beta gradients, cuDNN the weights'): with every new device array
    filled with NaN, they still equal the reference's."""
    spec = LayerSpec(batch_size=2, in_height=5, in_width=4, in_channels=2, out_channels=3, kernel=3, padding=1,
                     activation="tanh", normalization=norm, dtype="float32")
    ours, ref = cuda_layer(spec), make_layer(spec, backend="reference")
    real = cuda.device_array

    def nan_filled(shape, dtype=np.float32, *args, **kwargs):
        a = real(shape, dtype, *args, **kwargs)
        if np.dtype(dtype).kind == "f":
            a.copy_to_device(np.full(a.shape, np.nan, dtype))
        return a
    monkeypatch.setattr(cuda, "device_array", nan_filled)
    x, dy = random_inputs(spec)
    params = ours.parameters()
    _, saved = ours.functions.forward(params, x, True)
    grads, _ = ours.functions.backward(params, saved, dy)
    ref_params = {k: v for k, v in ref.state_dict().items() if not k.startswith("running_")}
    _, ref_saved = ref.functions.forward(ref_params, x, True)
    want, _ = ref.functions.backward(ref_params, ref_saved, dy)
    for k, g in want.items():
        np.testing.assert_allclose(to_host(grads[k]), g, rtol=1e-4, atol=1e-4, err_msg=k)


def test_fast_paths_must_be_a_bool():
    spec = LayerSpec(batch_size=2, in_height=4, in_width=4, in_channels=2, out_channels=3, kernel=3)
    with pytest.raises(TypeError, match="^fast_paths: expected a bool, got 'no'"):
        Conv2d(spec, "cuda", fast_paths="no", convolutions=HostConvolutions)


def test_the_public_launch_path_runs_the_layer_in_the_simulator():
    """fast_paths=False takes numba's dispatcher for every launch (in the simulator every
    launch does): the step still matches the reference."""
    spec = LayerSpec(batch_size=2, in_height=5, in_width=4, in_channels=2, out_channels=4, kernel=3, padding=1,
                     activation="gelu", normalization="batch_norm")
    ours = make_layer(spec, backend="cuda", convolutions=HostConvolutions, fast_paths=False)
    ref = make_layer(spec)
    x, dy = random_inputs(spec)
    assert_step_matches(ours, ref, x, dy)
    assert_grads_and_state_match(ours, ref, bias_atol=1e-4)  # batch norm: the bias gradient sums to ~0


SIMPLE_CASES = [("relu", "none", "float32"), ("gelu", "batch_norm", "float32"), ("tanh", "layer_norm", "float32"),
                ("fast_tanh", "batch_norm", "bfloat16"), ("sigmoid", "layer_norm", "float16")]


@pytest.mark.parametrize("act, norm, dtype", SIMPLE_CASES, ids=["-".join(c) for c in SIMPLE_CASES])
def test_the_simple_kernels_run_the_layer_as_the_reference_and_the_fast_kernels(act, norm, dtype):
    """kernels="simple" (one plain kernel per reference step): a training step and an
    evaluate agree with the reference, and with the fast kernels, within the tolerance."""
    spec = LayerSpec(batch_size=3, in_height=6, in_width=5, in_channels=3, out_channels=4, kernel=3, padding=1,
                     activation=act, normalization=norm, dtype=dtype)
    simple_layer = make_layer(spec, backend="cuda", convolutions=HostConvolutions, kernels="simple")
    fast_layer = cuda_layer(spec)
    ref = make_layer(spec, backend="reference")
    x, dy = random_inputs(spec)
    got = {}
    for name, layer in (("simple", simple_layer), ("fast", fast_layer), ("reference", ref)):
        y = to_host(layer.forward(x))
        dx = to_host(layer.backward_full(x, dy))
        got[name] = {"y": y, "d_x": dx, **{f"d_{k}": v for k, v in layer.grad_dict().items()},
                     **layer.state_dict(), "evaluate": to_host(layer.evaluate(x))}
    # Against the largest value of each result, at least 1: a bias gradient under batch
    # norm sums 90 terms of O(1) to about zero, and two summation orders of those differ by
    # about 90 float32 roundings of O(1) (1.4e-5 seen on the H200, gelu-batch_norm), which
    # is no evidence about the kernels; a wrong term costs O(1). 16-bit: storage roundings.
    tol = 1e-4 if dtype == "float32" else 3e-2
    for other in ("reference", "fast"):
        for k, want in got[other].items():
            want = np.asarray(want, np.float64)
            err = np.max(np.abs(np.asarray(got["simple"][k], np.float64) - want)) / max(np.max(np.abs(want)), 1.0)
            assert err <= tol, f"{k} against {other}: relative error {err:.2e} > {tol:.0e}"


def test_a_launch_config_is_part_of_the_kernel_cache_key():
    from conv2d.activations import Activation
    from conv2d.spec import Normalization

    kind = ("float32", Activation.RELU, Normalization.BATCH_NORM, 1, False)
    assert K.kernel_set(*kind, K.DEFAULT_CONFIG) is K.kernel_set(*kind, K.LaunchConfig())  # equal settings
    assert K.kernel_set(*kind, K.LaunchConfig(row_unroll=2)) is not K.kernel_set(*kind, K.DEFAULT_CONFIG)


def test_a_launch_config_names_a_bad_field():
    with pytest.raises(ValueError, match=r"^launch_config.row_unroll: expected an int >= 1, got 0"):
        K.LaunchConfig(row_unroll=0)
    with pytest.raises(TypeError, match=r"^launch_config.wide_rows: expected a bool"):
        K.LaunchConfig(wide_rows=1)
    spec = LayerSpec(batch_size=2, in_height=4, in_width=4, in_channels=2, out_channels=3, kernel=3)
    with pytest.raises(TypeError, match=r"^launch_config: expected a conv2d.cuda.kernels.LaunchConfig"):
        Conv2d(spec, "cuda", launch_config={"row_unroll": 2}, convolutions=HostConvolutions)


def test_a_layer_with_other_launch_settings_matches_the_reference():
    """Settings of the kind scripts/breakdown_cuda.py sweeps, given per layer: narrow loads,
    two rows in flight, small phase-two groups, without launch bounds."""
    spec = LayerSpec(batch_size=3, in_height=6, in_width=5, in_channels=2, out_channels=8, kernel=3, padding=1,
                     activation="gelu", normalization="batch_norm", dtype="bfloat16")
    config = K.LaunchConfig(wide_rows=False, row_unroll=2, phase_two_unroll=2, phase_group=2, row_bounded=False,
                            row_blocks=5)
    ours, ref = cuda_layer(spec, launch_config=config), make_layer(spec, backend="reference")
    x, dy = random_inputs(spec)
    y, want = to_host(ours.forward(x)).astype(np.float32), ref.forward(x).astype(np.float32)
    np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2)
    dx, want_dx = to_host(ours.backward_full(x, dy)).astype(np.float32), ref.backward_full(x, dy).astype(np.float32)
    np.testing.assert_allclose(dx, want_dx, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("norm", ["batch_norm", "layer_norm"])
def test_the_fast_statistics_are_the_simple_ones(norm):
    """The statistics step alone: the fast kernels' one shifted pass and the simple
    kernels' two passes give the same mean and inv_std within float32 rounding, on values
    with a large offset (where an unshifted one-pass variance would cancel)."""
    spec = LayerSpec(batch_size=3, in_height=6, in_width=5, in_channels=3, out_channels=4, kernel=3, padding=1,
                     activation="relu", normalization=norm, dtype="float32")
    x, _ = random_inputs(spec)
    x = (x + 50.0).astype(np.float32)
    saved = {}
    for kernels in ("simple", "fast"):
        layer = make_layer(spec, backend="cuda", convolutions=HostConvolutions, kernels=kernels)
        _, s = layer.functions.forward(layer.parameters(), x, True)
        saved[kernels] = (s.mean.copy_to_host(), s.inv_std.copy_to_host())
    for got, want, name in zip(saved["fast"], saved["simple"], ("mean", "inv_std")):
        np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("kernels", ["fast", "simple"])
def test_the_cumulative_average_counts_the_batches_like_the_reference(kernels):
    """bn_momentum=None: each training forward counts num_batches_tracked up on the
    device, then moves the running statistics 1/count of the way; an eval forward counts
    nothing. Three batches agree with the reference's state."""
    spec = LayerSpec(batch_size=3, in_height=6, in_width=5, in_channels=3, out_channels=4, kernel=3, padding=1,
                     activation="relu", normalization="batch_norm", dtype="float32", bn_momentum=None,
                     bn_running_var="unbiased")
    ours = make_layer(spec, backend="cuda", convolutions=HostConvolutions, kernels=kernels)
    ref = make_layer(spec)
    ours.load_state_dict(ref.state_dict())
    for seed in range(3):
        x, _ = random_inputs(spec, seed=seed)
        for layer in (ours, ref):
            layer.forward(x, training=True)
            layer.forward(x, training=False)
    got, want = ours.state_dict(), ref.state_dict()
    assert got["num_batches_tracked"] == want["num_batches_tracked"] == 3
    for k in ("running_mean", "running_var"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_the_cuda_bias_gradient_sums_d_z_as_stored_like_the_reference():
    """Both backends sum d_z rounded to bfloat16 for the bias gradient. Against the
    reference's sum, the CUDA backend's differs only by its summation order (a float32
    rounding, so at most a channel or two one bfloat16 step apart); against a sum of the
    unrounded d_z it differs in many channels, so the test tells the two rules apart."""
    from conv2d.reference.functional import grad_pre_activations

    spec = LayerSpec(batch_size=2, in_height=16, in_width=16, in_channels=2, out_channels=64, kernel=1,
                     activation="tanh", normalization="none", dtype="bfloat16")
    x, dy = random_inputs(spec)
    ref = make_layer(spec)
    params = {k: v for k, v in ref.state_dict().items()}
    _, saved = ref.functions.forward(params, x, True)
    grads, _ = ref.functions.backward(params, saved, dy)
    d_z, _ = grad_pre_activations(params, saved, dy)
    unrounded = d_z.reshape(-1, spec.out_channels).sum(axis=0).astype(ml_dtypes.bfloat16)
    ours = cuda_layer(spec)
    ours.load_state_dict(ref.state_dict())
    ours.forward(x)
    ours.backward_full(x, dy)
    got = ours.grad_dict()["bias"]
    assert np.count_nonzero(got != grads["bias"]) <= 2
    assert np.count_nonzero(got != unrounded) >= 8


DIRECT_CASES = [("relu", "none", "float32", dict(stride=1, padding=1)),
                ("gelu", "batch_norm", "float32", dict(stride=2, padding=0)),
                ("tanh", "batch_norm", "bfloat16", dict(stride=1, padding=1)),
                ("sigmoid", "none", "float16", dict(stride=2, padding=2)),
                ("relu", "none", "float32", dict(padding="same", dilation=2, groups=3, out_channels=6)),
                ("silu", "batch_norm", "float32", dict(padding=((0, 2), (1, 0)), dilation=(1, 2))),
                ("relu6", "none", "bfloat16", dict(padding=2, padding_mode="reflect", groups=3, out_channels=3)),
                ("identity", "batch_norm", "float32", dict(padding=(1, 2), padding_mode="circular", stride=2))]


@pytest.mark.parametrize("act, norm, dtype, geometry", DIRECT_CASES,
                         ids=["-".join([*c[:3], *(f"{k}{v}".replace(" ", "") for k, v in c[3].items())])
                              for c in DIRECT_CASES])
def test_the_direct_evaluate_kernel_agrees_with_the_reference_and_the_cudnn_path(act, norm, dtype, geometry):
    """evaluate_kernel="direct" (convolution, norm and activation in one kernel) gives the
    reference's evaluate, and the default path's, within storage rounding; at N = 1 and
    at the planned batch; strides, paddings, padding modes, dilation and groups."""
    spec = LayerSpec(**{**dict(batch_size=3, in_height=7, in_width=6, in_channels=3, out_channels=4, kernel=3,
                               activation=act, normalization=norm, dtype=dtype), **geometry})
    direct = cuda_layer(spec, evaluate_kernel="direct")
    default, ref = cuda_layer(spec), make_layer(spec, backend="reference")
    x, _ = random_inputs(spec)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for batch in (x[:1], x):
        got = to_host(direct.evaluate(batch)).astype(np.float64)
        for other in (ref.evaluate(batch), to_host(default.evaluate(batch))):
            np.testing.assert_allclose(got, np.asarray(other, np.float64), rtol=tol, atol=tol)


def test_the_direct_evaluate_kernel_refuses_layer_norm():
    spec = LayerSpec(batch_size=2, in_height=4, in_width=4, in_channels=2, out_channels=3, kernel=3,
                     normalization="layer_norm")
    with pytest.raises(ValueError, match="^evaluate_kernel: 'direct' takes no norm or batch norm"):
        Conv2d(spec, "cuda", evaluate_kernel="direct", convolutions=HostConvolutions)
    with pytest.raises(ValueError, match="^evaluate_kernel: expected 'cudnn' or 'direct', got 'fused'"):
        Conv2d(spec, "cuda", evaluate_kernel="fused", convolutions=HostConvolutions)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "zeros"])
@pytest.mark.parametrize("pads", [((1, 1), (1, 1)), ((2, 0), (1, 3)), ((0, 3), (4, 0))], ids=str)
def test_the_padding_kernels_are_the_references_pad_and_its_adjoint(mode, pads):
    """pad_input copies what conv.pad does, bitwise; unpad_gradient sums what conv.unpad
    does (another order of the same float32 additions)."""
    from conv2d.cuda.kernels.padding import padding_kernels, source_tables
    from conv2d.reference import conv

    (top, bottom), (left, right) = pads
    n, h, w, c = 2, 5, 6, 3
    hp, wp = h + top + bottom, w + left + right
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    d_xp = rng.standard_normal((n, hp, wp, c)).astype(np.float32)
    rows, row_copies = source_tables(h, top, bottom, mode)
    cols, col_copies = source_tables(w, left, right, mode)
    pad_input, unpad_gradient = padding_kernels("float32")
    xp = cuda.device_array(n * hp * wp * c, np.float32)
    pad_input[8, 32](cuda.to_device(x.ravel()), xp, cuda.to_device(rows), cuda.to_device(cols), h, w, c, hp, wp)
    np.testing.assert_array_equal(xp.copy_to_host().reshape(n, hp, wp, c), conv.pad(x, pads, mode))
    d_x = cuda.device_array(x.size, np.float32)
    unpad_gradient[8, 32](cuda.to_device(d_xp.ravel()), d_x, cuda.to_device(row_copies.ravel()),
                          cuda.to_device(col_copies.ravel()), row_copies.shape[1], col_copies.shape[1], h, w, c, hp,
                          wp)
    np.testing.assert_allclose(d_x.copy_to_host().reshape(x.shape), conv.unpad(d_xp, pads, mode, (h, w)),
                               rtol=1e-6, atol=1e-6)


ORACLE_CASES = {"plain": dict(), "stride2_dilated": dict(stride=2, dilation=2, padding=2),
                "groups2_asymmetric": dict(in_channels=4, out_channels=6, groups=2, padding=((1, 0), (2, 1))),
                "depthwise_k2x3": dict(out_channels=8, groups=4, kernel=(2, 3), padding=0)}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_the_float64_oracle_computes_the_references_three_convolutions(case):
    """kernels/oracle.py (what plan_heuristic.AccuracyProbe measures cuDNN's float32 plans
    against): forward and backward-data on the first samples, backward-filter over all,
    as the reference's float64 convolutions."""
    from conv2d.cuda.kernels import oracle
    from conv2d.cuda.kernels.layout import window_geometry
    from conv2d.reference import conv

    spec = LayerSpec(**{**dict(batch_size=3, in_height=7, in_width=6, in_channels=4, out_channels=5, kernel=3,
                               padding=1), **ORACLE_CASES[case]})
    rng = np.random.default_rng(0)
    x = rng.standard_normal(spec.input_shape).astype(np.float32)
    w = rng.standard_normal(spec.weight_shape).astype(np.float32)
    dy = rng.standard_normal(spec.output_shape).astype(np.float32)
    args = dict(stride=spec.stride, padding=spec.pads, dilation=spec.dilation, groups=spec.groups)
    want = {"forward": conv.conv_forward(x.astype(np.float64), w.astype(np.float64), **args)[:2],
            "backward_data": conv.conv_backward_data(w.astype(np.float64), dy.astype(np.float64),
                                                     (spec.in_height, spec.in_width), **args)[:2],
            "backward_filter": conv.conv_backward_filter(x.astype(np.float64), dy.astype(np.float64), spec.kernel,
                                                         **args)}
    inputs = {"forward": (x, w), "backward_data": (dy, w), "backward_filter": (x, dy)}
    g = window_geometry(spec)
    sizes = (g["H"], g["W"], g["C"], g["OH"], g["OW"], g["OC"], g["KH"], g["KW"], g["SH"], g["SW"], g["PH"], g["PW"],
             g["DH"], g["DW"], spec.in_channels // spec.groups, spec.out_channels // spec.groups)
    for op, exact in want.items():
        out = cuda.device_array(exact.size, np.float64)
        getattr(oracle, op)[4, 64](*(cuda.to_device(a.ravel()) for a in inputs[op]), out, spec.batch_size, *sizes)
        np.testing.assert_allclose(out.copy_to_host().reshape(exact.shape), exact, rtol=1e-12, atol=1e-12,
                                   err_msg=op)


@pytest.mark.parametrize("errors, kept", [((2e-7, 1e-6), "mode B's"), ((1e-6, 2e-7), "mode A's"),
                                          ((3e-7, 3e-7), "mode B's"), ((3.9e-7, 2e-7), "mode B's"),
                                          ((4.1e-7, 2e-7), "mode A's"), ((None, 2e-7), "mode B's")])
def test_strict_float32_keeps_mode_a_plan_only_where_mode_b_is_clearly_less_accurate(monkeypatch, errors, kept):
    """plan_heuristic.build_accurate: mode B's first plan (the faster heuristic) unless its
    measured error is more than ACCURACY_MARGIN (2) times that of mode A's first
    (PyTorch's choice); B within the margin, or where the oracle would cost too much (None)."""
    from conv2d.cuda import cudnn, plan_heuristic

    def build(op, spec, handle, allow_tf32, config=None, modes=None, select=None):
        return cudnn.Graph(op, spec, None, {}, 0, None,
                           "mode A's" if modes == plan_heuristic.ACCURACY_MODES else "mode B's")

    class Probe:
        def error(self, op, g, handle):
            return errors[0] if g.plan == "mode B's" else errors[1]

    monkeypatch.setattr(cudnn, "build", build)
    assert plan_heuristic.build_accurate("forward", small_layer_spec(), None, Probe()).plan == kept


@pytest.mark.skipif(HAVE_GPU, reason="the simulator's own behaviour: runs where the kernels are simulated")
def test_the_yielding_simulator_is_patched_once_and_keeps_a_block_barrier_right():
    """conftest applies private.yielding_simulator; again changes nothing, and a block
    that sums through shared memory between barriers still gets every thread's value."""
    from numba.cuda.simulator import kernel as simulated

    from conv2d.cuda.private import yielding_simulator

    patched = simulated.BlockThread.is_alive
    yielding_simulator()
    assert simulated.BlockThread.is_alive is patched and patched.yields

    @cuda.jit
    def block_sum(out):
        shared = cuda.shared.array(32, np.float32)
        t = cuda.threadIdx.x
        shared[t] = t + 1
        cuda.syncthreads()
        if t == 0:
            total = np.float32(0)
            for i in range(32):
                total += shared[i]
            out[0] = total
        cuda.syncthreads()

    out = cuda.device_array(1, np.float32)
    block_sum[1, 32](out)
    assert out.copy_to_host()[0] == 32 * 33 / 2
