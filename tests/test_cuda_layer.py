"""The CUDA backend with cuDNN on a real GPU: golden files, agreement with the float64
reference, accumulation, determinism, threads, zero-copy inputs, bad inputs, freezing,
the demos."""

import dataclasses
import threading

import numpy as np
import pytest

from conftest import HAVE_GPU, NO_GPU_REASON, make_layer, random_inputs, spec_for
from cuda_testing import FILES, GPU_DTYPES, MODES, NORMS, step, torch_cuda
from conv2d import Activation, Conv2d
from conv2d.activations import JUMPING_DERIVATIVE

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)

if HAVE_GPU:
    from conv2d.arrays import to_host
    from conv2d.dtypes import storage_dtype
    from conv2d.testing import assert_close, cancellation_scales, reduction_lengths
    from conv2d.testing.golden import check_case, load_case, run_case


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in FILES])
def test_cuda_matches_golden(path, dtype, mode):
    case = load_case(path)
    check_case(case, run_case(case, dtype, mode, backend="cuda"), dtype, mode)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("act", list(Activation), ids=lambda a: a.value)
def test_cuda_matches_the_float64_reference_on_identical_inputs(act, norm, dtype, training):
    spec = spec_for(act.value, norm, dtype, stride=(2, 1), kernel=(3, 2))
    cuda_layer = make_layer(spec, seed=2, backend="cuda")
    x, dy = random_inputs(spec, seed=3)
    ref_spec = dataclasses.replace(spec, dtype="float64")
    ref = Conv2d(ref_spec)
    ref.load_state_dict({k: v.astype(np.float64) for k, v in cuda_layer.state_dict().items()})
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    y, dx, grads, state = step(cuda_layer, x, dy, training)
    want_y = ref.forward(x64, training=training)
    want_dx = ref.backward_full(x64, dy64)
    lengths = reduction_lengths(spec)
    jump = act in JUMPING_DERIVATIVE
    assert_close("y", y, want_y, dtype, lengths["y"])
    assert_close("d_x", dx, want_dx, dtype, lengths["d_x"], jump=jump)
    # the reference's own d_z is the exact d_z here (float64), for the cancellation scales
    d_pre = _reference_d_pre(ref_spec, ref, x64, dy64, training)
    scales = cancellation_scales(spec, training, x64, d_pre)
    for k, g in ref.grad_dict().items():
        assert_close(k, grads[k], g, dtype, lengths[k], scales.get(k, 0.0), jump=jump)
    for k in ("running_mean", "running_var"):
        if k in state:
            assert_close(k, state[k], ref.state_dict()[k], dtype, lengths[k])
    assert_close("evaluate", to_host(cuda_layer.evaluate(x), storage_dtype(spec.dtype)), ref.evaluate(x64),
                 dtype, lengths["y"])


def _reference_d_pre(spec, layer, x, dy, training):
    from conv2d.reference import functional as F
    from conv2d.state import RUNNING

    state = layer.state_dict()
    params = {k: v for k, v in state.items() if k not in RUNNING}
    running = {k: v for k, v in state.items() if k in RUNNING} or None
    _, saved = F.forward(spec, params, x, training, running)
    return F.grad_pre_activations(params, saved, dy)[0]


@pytest.mark.parametrize("norm", NORMS)
def test_backward_input_matches_backward_full_and_leaves_gradients(norm):
    spec = spec_for("gelu", norm)
    layer = make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    layer.forward(x)
    dx_only = to_host(layer.backward_input(dy)).copy()
    assert all((g == 0).all() for g in layer.grad_dict().values())
    np.testing.assert_array_equal(to_host(layer.backward_full(x, dy)), dx_only)


@pytest.mark.parametrize("norm", NORMS)
def test_gradients_accumulate_over_two_backward_calls(norm):
    spec = spec_for("tanh", norm)
    layer = make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    layer.forward(x)
    layer.backward(x, dy)
    once = layer.grad_dict()
    layer.backward(x, dy)
    for k, g in layer.grad_dict().items():
        np.testing.assert_array_equal(g, 2 * once[k], err_msg=k)  # g + g is exact in float32
    layer.zero_gradient()
    assert all((g == 0).all() for g in layer.grad_dict().values())


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_repeated_runs_are_bitwise_identical(norm, dtype):
    spec = spec_for("gelu_tanh", norm, dtype, batch_size=16, in_height=20, in_width=20, in_channels=8,
                    out_channels=16)
    x, dy = random_inputs(spec)
    a, b = make_layer(spec, backend="cuda"), make_layer(spec, backend="cuda")
    ra, rb = step(a, x, dy), step(b, x, dy)
    a.zero_gradient()
    a.load_state_dict(make_layer(spec, backend="reference").state_dict())
    ra2 = step(a, x, dy)
    for r in (rb, ra2):
        np.testing.assert_array_equal(r[0].view(np.uint8), ra[0].view(np.uint8))
        np.testing.assert_array_equal(r[1].view(np.uint8), ra[1].view(np.uint8))
        for k in ra[2]:
            np.testing.assert_array_equal(r[2][k].view(np.uint8), ra[2][k].view(np.uint8), err_msg=k)
        for k in ra[3]:
            np.testing.assert_array_equal(r[3][k].view(np.uint8), ra[3][k].view(np.uint8), err_msg=k)


def test_two_threads_on_the_same_spec_agree_with_one():
    spec = spec_for("relu", "batch_norm", out_channels=9)  # a spec no other test builds
    x, dy = random_inputs(spec)
    results, errors = {}, []

    def work(i):
        try:
            results[i] = step(make_layer(spec, backend="cuda"), x, dy)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    alone = step(make_layer(spec, backend="cuda"), x, dy)
    for r in results.values():
        np.testing.assert_array_equal(r[0], alone[0])
        np.testing.assert_array_equal(r[1], alone[1])
        for k in alone[2]:
            np.testing.assert_array_equal(r[2][k], alone[2][k], err_msg=k)


def _no_copy(shape, dtype):
    pytest.fail(f"device_input allocated a block {shape} {dtype} for a device array")


@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_torch_tensors_are_used_without_a_copy(dtype):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from conv2d.cuda.runtime import device_input

    spec = spec_for("relu", "none", dtype)
    layer = make_layer(spec, backend="cuda")
    x, _ = random_inputs(spec)
    xt = torch_cuda(torch, x, dtype)
    view = device_input(layer.functions.cuda, "x", xt, spec.input_shape, spec.dtype, layer.functions.stream,
                        _no_copy)
    assert view.__cuda_array_interface__["data"][0] == xt.data_ptr()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(to_host(layer.forward(xt), storage_dtype(spec.dtype)),
                                  to_host(layer.forward(x), storage_dtype(spec.dtype)))


@pytest.mark.parametrize("shape", [(4, 12, 10, 5), (7,)], ids=["4d", "1d"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fast_view_of_a_torch_tensor_is_numbas_public_view(dtype, shape):
    """private.tensor_view builds numba's array directly (private classes); it must be what
    numba's public from_cuda_array_interface gives, field for field and in the bits read."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from conv2d.cuda.private import interface_view, tensor_view
    from conv2d.cuda.runtime import numba_cuda

    cuda = numba_cuda()
    t = torch_cuda(torch, np.random.default_rng(0).standard_normal(shape), dtype)
    dt = np.dtype(np.uint16 if dtype == "bfloat16" else np.float32)
    fast, public = tensor_view(cuda, t, shape, dt), interface_view(cuda, t, shape, dt)
    torch.cuda.synchronize()
    for field in ("shape", "strides", "dtype", "size", "alloc_size"):
        assert getattr(fast, field) == getattr(public, field), field
    assert fast.__cuda_array_interface__ == public.__cuda_array_interface__
    assert fast.gpu_data.owner is t
    assert int(fast.gpu_data.context.handle) == int(public.gpu_data.context.handle)
    np.testing.assert_array_equal(fast.copy_to_host(), public.copy_to_host())


def test_a_torch_tensor_is_viewed_by_address_and_numbas_array_over_it_is_the_fast_view():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from conv2d.cuda.private import tensor_view
    from conv2d.cuda.runtime import device_view, numba_cuda
    from conv2d.cuda.views import ForeignArray
    from conv2d.spec import DType

    cuda = numba_cuda()
    t = torch.arange(24, dtype=torch.float32, device="cuda").reshape(2, 3, 4)
    view = device_view(cuda, "t", t, DType.FLOAT32, flat=True)
    assert type(view) is ForeignArray and view.ptr == t.data_ptr() and view.shape == (24,)
    expected = tensor_view(cuda, t, (24,), np.dtype(np.float32))
    assert view.numba().__cuda_array_interface__ == expected.__cuda_array_interface__
    np.testing.assert_array_equal(view.copy_to_host(), np.arange(24, dtype=np.float32))


def test_torchs_current_stream_read_through_its_c_binding_is_the_public_one():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from conv2d.cuda.private import torch_raw_stream

    side = torch.cuda.Stream()
    for stream in (torch.cuda.default_stream(), side):
        with torch.cuda.stream(stream):
            assert torch_raw_stream(torch.cuda.current_device()) == torch.cuda.current_stream().cuda_stream


def test_cupy_arrays_are_used_without_a_copy():
    cp = pytest.importorskip("cupy", reason="cupy is not installed")
    from conv2d.cuda.runtime import device_input

    spec = spec_for("tanh", "layer_norm")
    layer = make_layer(spec, backend="cuda")
    x, _ = random_inputs(spec)
    xc = cp.asarray(x)
    view = device_input(layer.functions.cuda, "x", xc, spec.input_shape, spec.dtype, layer.functions.stream,
                        _no_copy)
    assert view.__cuda_array_interface__["data"][0] == xc.data.ptr
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(to_host(layer.forward(xc)), to_host(layer.forward(x)))


def test_bad_device_inputs_are_rejected_before_any_launch():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    spec = spec_for("relu", "batch_norm")
    layer = make_layer(spec, backend="cuda")
    before = layer.state_dict()
    good = torch.zeros(spec.input_shape, device="cuda")
    cases = [
        (torch.zeros((4, 12, 10, 6), device="cuda"), ValueError, "x: expected shape"),
        (good.double(), TypeError, "x: expected dtype float32"),
        (torch.zeros((4, 12, 10, 10), device="cuda")[..., ::2], ValueError, "x: expected a C-contiguous array"),
        (good.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1), ValueError, "x: expected a C-contiguous"),
        ("not an array", TypeError, "x: expected a numpy.ndarray or a device array"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            layer.forward(bad)
    with pytest.raises(RuntimeError, match="call forward"):
        layer.backward_input(torch.zeros(spec.output_shape, device="cuda"))
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_float64_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="float64 is the reference backend's oracle type"):
        Conv2d(spec_for(dtype="float64"), backend="cuda")


def test_float32_is_exact_fp32_unless_tf32_is_allowed():
    # A long reduction (KH*KW*IC = 1152): TF32's 10-bit mantissa errs by ~1e-3 here.
    spec = spec_for("identity", "none", in_channels=128, out_channels=64, batch_size=8)
    x, _ = random_inputs(spec)
    layer = make_layer(spec, backend="cuda")
    ref = Conv2d(dataclasses.replace(spec, dtype="float64"))
    ref.load_state_dict({k: v.astype(np.float64) for k, v in layer.state_dict().items()})
    want = ref.forward(x.astype(np.float64))
    assert_close("fp32", to_host(layer.forward(x)), want, "float32", spec.fan_in)
    tf32 = make_layer(spec, backend="cuda", allow_tf32=True)
    err = np.abs(to_host(tf32.forward(x)) - want).max() / np.abs(want).max()
    assert err < 1e-2  # TF32 is allowed to be coarser, not wrong


def test_freeze_reuses_output_buffers_and_refuses_host_arrays():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    spec = spec_for("relu", "batch_norm")
    layer = make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    layer.forward(x)
    layer.freeze()
    xt, dyt = torch.from_numpy(x).cuda(), torch.from_numpy(dy).cuda()
    y1, y2 = layer.forward(xt), layer.forward(xt)
    assert y1.__cuda_array_interface__["data"][0] == y2.__cuda_array_interface__["data"][0]
    d1, d2 = layer.backward_full(xt, dyt), layer.backward_full(xt, dyt)
    assert d1.__cuda_array_interface__["data"][0] == d2.__cuda_array_interface__["data"][0]
    with pytest.raises(RuntimeError, match="frozen"):
        layer.forward(x)
    layer.freeze()  # again: a no-op that keeps the buffers
    assert layer.forward(xt).__cuda_array_interface__["data"][0] == y1.__cuda_array_interface__["data"][0]


def test_to_moves_state_and_gradients_both_ways():
    spec = spec_for("sigmoid", "batch_norm")
    ref = make_layer(spec)
    x, dy = random_inputs(spec)
    ref.forward(x)
    ref.backward(x, dy)
    gpu = ref.to("cuda")
    back = gpu.to("reference")
    for d_a, d_b in ((ref.state_dict(), back.state_dict()), (ref.grad_dict(), back.grad_dict())):
        for k in d_a:
            np.testing.assert_array_equal(d_b[k], d_a[k], err_msg=k)


def test_the_digits_demo_reaches_its_accuracy_on_the_gpu(capsys):
    pytest.importorskip("sklearn", reason="scikit-learn (the demo extra) is not installed")
    from conv2d.cli import main

    assert main(["demo", "--quiet", "--backend", "cuda"]) == 0
    assert ">= target 0.98" in capsys.readouterr().out


def test_demo_runs_on_the_gpu(capsys):
    from conv2d.cli import main

    assert main(["demo", "--task", "fit", "--quiet", "--backend", "cuda"]) == 0
    assert "the student matches the teacher" in capsys.readouterr().out


def test_the_breakout_demos_graphs_act_and_learn_bitwise_as_its_eager_calls(capsys, monkeypatch):
    """The demo's CUDA graphs (acting, the batch's values, the whole Adam step) against
    one eager call per layer on the same GPU: the same episodes and returns, to the last
    digit, over 1500 steps (1350 updates)."""
    pytest.importorskip("minatar", reason="MinAtar (the demo extra) is not installed")
    from conv2d.cli import main
    from conv2d.demos import breakout

    argv = ["demo", "--task", "breakout", "--backend", "cuda", "--quiet", "--steps", "1500", "--target", "0"]
    runs = []
    for agent in (breakout._Graphs, breakout._CallByCall):
        monkeypatch.setattr(breakout, "_Graphs", agent)
        assert main(argv) == 0
        runs.append([line.rsplit(" in ", 1)[0] for line in capsys.readouterr().out.splitlines()])
    assert runs[0] == runs[1] and "1500 steps" in runs[0][-1]
