"""The CUDA backend's graphs and launches on a real GPU: the caller's stream, captured
steps (layers, stacks, Adam, depthwise, direct evaluate) replaying bitwise as eager ones,
the fast paths against the public ones, fresh outputs, autotuned and stored plans."""

import dataclasses

import numpy as np
import pytest

from conftest import HAVE_GPU, NO_GPU_REASON, make_layer, random_inputs, spec_for
from cuda_testing import GPU_DTYPES, NORMS, step
from conv2d import Conv2d, LayerSpec

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)

if HAVE_GPU:
    from conv2d.arrays import to_host
    from conv2d.dtypes import storage_dtype
    from conv2d.testing import assert_close, reduction_lengths


def test_the_callers_stream_carries_all_the_work():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from conv2d.cuda.runtime import stream_handle

    spec = spec_for("gelu", "batch_norm")
    theirs = torch.cuda.Stream()
    layer = make_layer(spec, backend="cuda", stream=theirs)
    assert stream_handle(layer.functions.stream) == theirs.cuda_stream
    x, dy = random_inputs(spec)
    with torch.cuda.stream(theirs):
        got = step(layer, x, dy)
    want = step(make_layer(spec, backend="cuda"), x, dy)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _device_pair(spec, x, dy):
    from numba import cuda

    from conv2d.cuda.runtime import to_device_bits
    return cuda.to_device(to_device_bits(x)), cuda.to_device(to_device_bits(dy))


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_a_captured_step_replays_bitwise_like_eager_steps(norm, dtype):
    spec = spec_for("relu", norm, dtype)
    x, dy = random_inputs(spec)
    eager, captured = make_layer(spec, backend="cuda"), make_layer(spec, backend="cuda")
    xe, dye = _device_pair(spec, x, dy)
    xc, dyc = _device_pair(spec, x, dy)
    graph = captured.capture(xc, dyc)
    # the capture itself changes nothing
    for k, v in make_layer(spec).state_dict().items():
        np.testing.assert_array_equal(captured.state_dict()[k], v, err_msg=k)
    st = storage_dtype(spec.dtype)
    for _ in range(2):
        y = to_host(eager.forward(xe, training=True), st)
        dx = to_host(eager.backward_full(xe, dye), st)
        graph.replay()
        np.testing.assert_array_equal(to_host(graph.outputs["y"], st).view(np.uint8), y.view(np.uint8))
        np.testing.assert_array_equal(to_host(graph.outputs["d_x"], st).view(np.uint8), dx.view(np.uint8))
    for a, b in ((eager.grad_dict(), captured.grad_dict()), (eager.state_dict(), captured.state_dict())):
        for k in a:
            np.testing.assert_array_equal(b[k].view(np.uint8), a[k].view(np.uint8), err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("norm", NORMS)
def test_the_numba_depthwise_kernels_on_the_gpu_agree_with_cudnn_and_replay_bitwise(norm, dtype):
    """depthwise_kernel="numba": the step within the tolerance of cuDNN's depthwise graph,
    and a captured step bitwise as the eager ones (a multiplier of 2, 'same', dilation)."""
    spec = LayerSpec(batch_size=4, in_height=12, in_width=10, in_channels=8, out_channels=16, kernel=3,
                     padding="same", dilation=2, groups=8, activation="relu", normalization=norm, dtype=dtype)
    x, dy = random_inputs(spec)
    st = storage_dtype(spec.dtype)
    numba_layer = make_layer(spec, backend="cuda", depthwise_kernel="numba")
    cudnn_layer = make_layer(spec, backend="cuda", depthwise_kernel="cudnn")
    captured = make_layer(spec, backend="cuda", depthwise_kernel="numba")
    tol = 1e-5 if dtype == "float32" else 2e-2
    got, want = step(numba_layer, x, dy), step(cudnn_layer, x, dy)
    for name, a, b in zip(("y", "d_x"), got[:2], want[:2]):
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol, err_msg=name)
    xc, dyc = _device_pair(spec, x, dy)
    graph = captured.capture(xc, dyc)
    graph.replay()
    np.testing.assert_array_equal(to_host(graph.outputs["y"], st).view(np.uint8), got[0].view(np.uint8))
    np.testing.assert_array_equal(to_host(graph.outputs["d_x"], st).view(np.uint8), got[1].view(np.uint8))
    for k, g in captured.grad_dict().items():
        np.testing.assert_array_equal(g.view(np.uint8), got[2][k].view(np.uint8), err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("norm", NORMS)
def test_a_captured_training_step_with_adam_replays_bitwise_like_eager_steps(norm, dtype):
    """zero_gradient, forward, backward_full and the optimizer's step in one graph: three
    replays leave weights, statistics, moments and step count bitwise as three eager steps
    (the bias corrections of steps 1, 2, 3 come from the count on the device)."""
    from conv2d.optim import Adam

    spec = spec_for("relu", norm, dtype)
    x, dy = random_inputs(spec)
    eager, captured = make_layer(spec, backend="cuda"), make_layer(spec, backend="cuda")
    eager_opt, captured_opt = Adam(eager, lr=1e-2, weight_decay=0.1), Adam(captured, lr=1e-2, weight_decay=0.1)
    xe, dye = _device_pair(spec, x, dy)
    xc, dyc = _device_pair(spec, x, dy)
    graph = captured.capture(xc, dyc, optimizer=captured_opt)
    assert captured_opt.t == 0  # the capture's warm-up step was undone
    for _ in range(3):
        eager.zero_gradient()
        eager.forward(xe, training=True)
        eager.backward_full(xe, dye)
        eager_opt.step()
        graph.replay()
    assert captured_opt.t == eager_opt.t == 3
    for a, b in ((eager.state_dict(), captured.state_dict()),
                 (eager_opt.state_dict()["arrays"], captured_opt.state_dict()["arrays"])):
        for k in a:
            np.testing.assert_array_equal(b[k].view(np.uint8), a[k].view(np.uint8), err_msg=k)


def test_a_captured_sequential_training_step_replays_bitwise_like_eager_steps():
    from conv2d import Sequential
    from conv2d.optim import SGD

    specs = [LayerSpec(batch_size=4, in_height=8, in_width=8, in_channels=3, out_channels=8, kernel=3, padding=1,
                       activation="relu", normalization="batch_norm", dtype="bfloat16"),
             LayerSpec(batch_size=4, in_height=8, in_width=8, in_channels=8, out_channels=5, kernel=8,
                       activation="identity", dtype="bfloat16")]  # a dense head
    models = [Sequential.from_specs(specs, "cuda") for _ in range(2)]
    for m in models:
        m.init_weights(np.random.default_rng(0))
    opts = [SGD(m, lr=0.05, momentum=0.9) for m in models]
    rng = np.random.default_rng(1)
    st = storage_dtype(specs[0].dtype)
    x = rng.standard_normal((4, 8, 8, 3)).astype(st)
    dy = rng.standard_normal((4, 1, 1, 5)).astype(st)
    xe, dye = _device_pair(specs[0], x, dy)
    xc, dyc = _device_pair(specs[0], x, dy)
    graph = models[1].capture(xc, dyc, optimizer=opts[1])
    for _ in range(3):
        models[0].zero_gradient()
        models[0].forward(xe)
        models[0].backward_full(xe, dye)
        opts[0].step()
        graph.replay()
    for k, v in models[0].state_dict().items():
        np.testing.assert_array_equal(models[1].state_dict()[k].view(np.uint8), v.view(np.uint8), err_msg=k)


@pytest.mark.parametrize("n", [1, 4])
def test_a_captured_sequential_evaluate_replays_new_inputs_bitwise_like_eager(n):
    """Sequential.capture_evaluate at batch n (an agent acting at 1, planned for 4): each
    replay of new values written into x (graph.write) gives the eager evaluate's bits
    (graph.read)."""
    from numba import cuda

    from conv2d import Sequential

    specs = [LayerSpec(batch_size=4, in_height=10, in_width=10, in_channels=4, out_channels=16, kernel=3,
                       activation="relu", normalization="batch_norm"),
             LayerSpec(batch_size=4, in_height=8, in_width=8, in_channels=16, out_channels=6, kernel=8,
                       activation="identity")]
    eager, captured = Sequential.from_specs(specs, "cuda"), Sequential.from_specs(specs, "cuda")
    eager.init_weights(np.random.default_rng(0))
    captured.load_state_dict(eager.state_dict())
    rng = np.random.default_rng(1)
    xc = cuda.to_device(np.zeros((n, 10, 10, 4), np.float32))
    graph = captured.capture_evaluate(xc)
    for _ in range(3):
        x = rng.standard_normal((n, 10, 10, 4)).astype(np.float32)
        graph.write("x", x)
        graph.replay()
        np.testing.assert_array_equal(graph.read("y"), eager.evaluate(x))


def test_a_graphs_write_and_read_refuse_what_does_not_fit_before_any_copy():
    from numba import cuda

    spec = spec_for("relu", "none", "bfloat16")
    x, _ = random_inputs(spec)
    xc = cuda.to_device(np.zeros(x.shape, np.uint16))
    graph = make_layer(spec, backend="cuda").capture_evaluate(xc)
    with pytest.raises(ValueError, match=r"^write\('x'\): expected shape"):
        graph.write("x", x[:2])
    with pytest.raises(TypeError, match=r"^write\('x'\): expected dtype bfloat16"):
        graph.write("x", x.astype(np.float32))
    with pytest.raises(ValueError, match=r"^read: expected one of \['y'\] .*, got 'd_x'"):
        graph.read("d_x")
    assert not to_host(xc).any()  # nothing was copied
    graph.write("x", x)
    graph.replay()
    np.testing.assert_array_equal(graph.read("y"), to_host(make_layer(spec, backend="cuda").evaluate(x)))


def test_a_replay_reads_new_values_written_into_the_captured_inputs():
    spec = spec_for("gelu", "layer_norm")
    x, dy = random_inputs(spec)
    layer = make_layer(spec, backend="cuda")
    xc, _ = _device_pair(spec, x, dy)
    graph = layer.capture_evaluate(xc)
    x2 = (x * 2 + 1).astype(x.dtype)
    xc.copy_to_device(x2)
    graph.replay()
    want = to_host(make_layer(spec, backend="cuda").evaluate(x2))
    np.testing.assert_array_equal(to_host(graph.outputs["y"]), want)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("norm", ["none", "batch_norm"])
def test_the_direct_evaluate_kernel_on_the_gpu_repeats_bitwise_captures_and_agrees_with_cudnn(norm, dtype):
    """evaluate_kernel="direct": at N = 1 and at the planned batch, two calls give the same
    bits, a captured evaluate replays them, and the result is the cuDNN path's within
    storage rounding."""
    spec = spec_for("gelu", norm, dtype)
    x, dy = random_inputs(spec)
    direct, default = make_layer(spec, backend="cuda", evaluate_kernel="direct"), make_layer(spec, backend="cuda")
    st = storage_dtype(spec.dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for batch in (x[:1], x):
        first = to_host(direct.evaluate(batch), st).copy()
        np.testing.assert_array_equal(to_host(direct.evaluate(batch), st).view(np.uint8), first.view(np.uint8))
        np.testing.assert_allclose(first.astype(np.float64), to_host(default.evaluate(batch), st).astype(np.float64),
                                   rtol=tol, atol=tol)
    xc, _ = _device_pair(spec, x, dy)
    graph = direct.capture_evaluate(xc)
    graph.replay()
    np.testing.assert_array_equal(to_host(graph.outputs["y"], st).view(np.uint8),
                                  to_host(make_layer(spec, backend="cuda", evaluate_kernel="direct").evaluate(x),
                                           st).view(np.uint8))


def test_capture_refuses_host_arrays_and_the_reference_backend():
    spec = spec_for("relu", "none")
    x, dy = random_inputs(spec)
    with pytest.raises(TypeError, match="x: a captured graph reads fixed device buffers"):
        make_layer(spec, backend="cuda").capture(x, dy)
    with pytest.raises(TypeError, match="capture: the 'reference' backend has no CUDA graphs"):
        make_layer(spec).capture(x, dy)


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_eager_launches_go_straight_to_the_driver(norm, dtype):
    """Every prepared launch of a step packs its arguments for cuLaunchKernel (a launch
    left on numba's dispatcher costs 25-50 us of host time more, in every dtype)."""
    spec = spec_for("gelu", norm, dtype)
    layer = make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    step(layer, x, dy)
    launches = layer.functions.launches
    assert launches and all(launch.prepared for launch in launches.values()), \
        [k for k, launch in launches.items() if not launch.prepared]


@pytest.mark.parametrize("act, norm, dtype", [("gelu", "batch_norm", "bfloat16"), ("tanh", "layer_norm", "float32"),
                                             ("relu", "none", "float32")])
def test_the_public_paths_give_the_bits_of_the_fast_paths(act, norm, dtype):
    """fast_paths=False launches through numba's dispatcher and executes cuDNN through the
    frontend's public execute: forward, backward, gradients, running statistics and an
    Adam step come out bitwise as with the private fast paths."""
    from conv2d.optim import Adam

    spec = spec_for(act, norm, dtype)
    x, dy = random_inputs(spec)
    results = {}
    for fast in (True, False):
        layer = make_layer(spec, backend="cuda", fast_paths=fast)
        y, dx, grads, state = step(layer, x, dy)
        Adam(layer, preset="torch").step()
        launches = layer.functions.launches.values()
        assert all(launch.prepared == fast for launch in launches), fast
        results[fast] = (y, dx, grads, state, layer.state_dict())
    (y, dx, grads, state, after), (y2, dx2, grads2, state2, after2) = results[True], results[False]
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(dx, dx2)
    for k in grads:
        np.testing.assert_array_equal(grads[k], grads2[k], err_msg=k)
    for k in state:
        np.testing.assert_array_equal(state[k], state2[k], err_msg=k)
        np.testing.assert_array_equal(after[k], after2[k], err_msg=f"{k} after Adam")


@pytest.mark.parametrize("norm", NORMS)
def test_eager_outputs_are_fresh_arrays_each_call(norm):
    from conv2d.cuda.launch import device_pointer

    spec = spec_for("relu", norm)
    layer = make_layer(spec, backend="cuda")
    x, dy = _device_pair(spec, *random_inputs(spec))
    y1 = layer.forward(x)
    first = to_host(y1).copy()
    dx1 = layer.backward_full(x, dy)
    first_dx = to_host(dx1).copy()
    x2, dy2 = _device_pair(spec, (2 * to_host(x)).astype(first.dtype), (3 * to_host(dy)).astype(first.dtype))
    y2 = layer.forward(x2)
    dx2 = layer.backward_full(x2, dy2)
    assert device_pointer(y1) != device_pointer(y2) and device_pointer(dx1) != device_pointer(dx2)
    np.testing.assert_array_equal(to_host(y1), first)
    np.testing.assert_array_equal(to_host(dx1), first_dx)


_STORED_PLANS = """
import json, sys
from conv2d import Conv2d, LayerSpec
from conv2d.cuda import plan_store
spec = LayerSpec(batch_size=16, in_height=20, in_width=20, in_channels=8, out_channels=16, kernel=3, padding=1,
                 normalization="batch_norm", dtype=sys.argv[1])
layer = Conv2d(spec, "cuda", autotune=True)
print(json.dumps({"plans": layer.functions.conv_plans, "counts": plan_store.current().counts}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_second_process_builds_the_autotuned_plans_a_first_one_stored_without_timing(tmp_path, dtype):
    """CONV2D_PLAN_STORE (conv2d.cuda.plan_store): the first process times each graph's
    plans and stores its choices; a fresh one finds every graph stored and builds the same
    plans (each process its own, as cuDNN's graphs are cached per process)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, CONV2D_PLAN_STORE=str(tmp_path / "plans.json"))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _STORED_PLANS, dtype], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    graphs = len(first["plans"])
    assert graphs >= 3 and first["counts"] == {"hits": 0, "misses": graphs}, first
    assert second["counts"] == {"hits": graphs, "misses": 0} and second["plans"] == first["plans"], (first, second)
    assert len(json.loads((tmp_path / "plans.json").read_text())["plans"]) == graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_autotuned_plans_match_the_reference_and_repeat_bitwise(dtype):
    spec = spec_for("relu", "batch_norm", dtype, batch_size=16, in_height=20, in_width=20, in_channels=8,
                    out_channels=16)
    x, dy = random_inputs(spec)
    a, b = make_layer(spec, backend="cuda", autotune=True), make_layer(spec, backend="cuda", autotune=True)
    plans = a.functions.conv_plans
    assert {"forward", "backward_data", "backward_filter"} <= set(plans) and "?" not in plans.values(), plans
    ra, rb = step(a, x, dy), step(b, x, dy)
    np.testing.assert_array_equal(rb[0].view(np.uint8), ra[0].view(np.uint8))
    np.testing.assert_array_equal(rb[1].view(np.uint8), ra[1].view(np.uint8))
    ref = Conv2d(dataclasses.replace(spec, dtype="float64"))
    ref.load_state_dict({k: v.astype(np.float64) for k, v in make_layer(spec).state_dict().items()})
    lengths = reduction_lengths(spec)
    assert_close("y", ra[0], ref.forward(x.astype(np.float64)), dtype, lengths["y"])
    assert_close("d_x", ra[1], ref.backward_full(x.astype(np.float64), dy.astype(np.float64)), dtype,
                 lengths["d_x"], jump=True)
