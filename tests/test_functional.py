"""The functional core and the layer over it, on both backends: any batch size (and input
size) at every call, explicit per-call state, caller-owned parameters, the checks that
keep a backward honest, outputs in the caller's library, and bias-free layers.

"cuda" runs the CUDA backend: with cuDNN on a GPU, else its kernels in numba's simulator
with the reference standing in for cuDNN (tests/host_convolutions.py)."""

import dataclasses

import numpy as np
import pytest

from conftest import assert_same_gradients, make_layer, random_inputs
from conv2d import LayerSpec
from conv2d.dtypes import storage_dtype
from conv2d.arrays import to_host
from conv2d.state import RUNNING, split_state

from functional_testing import BACKENDS, NORMS, assert_same, functional_spec, inputs_at, layer_on, train_step



# Any batch size -----------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_any_batch_size_equals_a_layer_planned_for_it(backend, n, norm):
    spec = functional_spec(norm, backend, batch_size=4)
    x, dy = inputs_at(spec, n)
    ours = layer_on(backend, spec)
    planned = layer_on(backend, dataclasses.replace(spec, batch_size=n))
    st = storage_dtype(spec.dtype)
    np.testing.assert_array_equal(to_host(ours.evaluate(x), st), to_host(planned.evaluate(x), st))
    assert_same(train_step(ours, x, dy), train_step(planned, x, dy), exact=backend == "cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_sizes_alternate_through_the_same_weights(backend):
    # RL: act with batch 1, train with batch 4, act again, all on one layer.
    spec = functional_spec("batch_norm", backend, batch_size=4)
    layer, alone = layer_on(backend, spec), layer_on(backend, spec)
    obs, _ = inputs_at(spec, 1, seed=5)
    x, dy = inputs_at(spec, 4)
    st = storage_dtype(spec.dtype)
    layer.evaluate(obs)
    got = train_step(layer, x, dy)
    assert_same(got, train_step(alone, x, dy), exact=True)  # acting changed nothing
    np.testing.assert_array_equal(to_host(layer.evaluate(obs), st), to_host(alone.evaluate(obs), st))


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_input_heights_and_widths_are_accepted(backend):
    spec = functional_spec("layer_norm", backend)
    other = dataclasses.replace(spec, in_height=7, in_width=3)
    x, dy = random_inputs(other)
    layer, planned = layer_on(backend, spec), layer_on(backend, other)
    assert_same(train_step(layer, x, dy), train_step(planned, x, dy), exact=backend == "cuda")
    assert layer.pre_activations.shape == other.output_shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_input_the_kernel_does_not_fit_is_refused_naming_x(backend):
    layer = layer_on(backend, functional_spec("none", backend, kernel=3, padding=0))
    x = np.zeros((2, 2, 4, 2), storage_dtype(layer.spec.dtype))
    with pytest.raises(ValueError, match=r"^x: the kernel \(3, 3\) with padding \(0, 0\) does not fit an input of "
                                         r"height 2 and width 4"):
        layer.forward(x)


@pytest.mark.parametrize("bad", ["not an array", [[1.0]], None], ids=["str", "list", "None"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_input_that_is_no_array_is_refused_naming_x(backend, bad):
    layer = layer_on(backend, functional_spec("none", backend))
    with pytest.raises(TypeError, match="^x: expected a numpy.ndarray"):
        layer.forward(bad)
    with pytest.raises(TypeError, match="^x: expected a numpy.ndarray"):
        layer.evaluate(bad)


def test_a_spec_may_plan_no_batch():
    spec = functional_spec("batch_norm", batch_size=None)
    layer = make_layer(spec)
    x, dy = inputs_at(spec, 3)
    layer.forward(x)
    assert layer.backward_full(x, dy).shape == x.shape
    with pytest.raises(ValueError, match="batch_size is None"):
        spec.input_shape


def test_spec_fields_are_keyword_only():
    with pytest.raises(TypeError):
        LayerSpec(2, 5, 4, 2, 3)


# Saved values belong to one forward ---------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_with_an_input_other_than_the_last_forwards_raises(backend):
    spec = functional_spec("batch_norm", backend)
    layer = layer_on(backend, spec)
    s, dy = inputs_at(spec, 4, seed=1)
    s_next, _ = inputs_at(spec, 4, seed=2)
    layer.forward(s)
    layer.forward(s_next)  # Q(s) then Q(s') before one backward, as in DQN
    before = layer.grad_dict()
    with pytest.raises(ValueError, match="^x: not the input of the last forward"):
        layer.backward(s, dy)
    for k, g in layer.grad_dict().items():
        np.testing.assert_array_equal(g, before[k], err_msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_accepts_an_equal_copy_of_a_host_input(backend):
    spec = functional_spec("none", backend)
    a, b = layer_on(backend, spec), layer_on(backend, spec)
    x, dy = inputs_at(spec, 2)
    a.forward(x)
    b.forward(x)
    a.backward(x.copy(), dy)
    b.backward(x, dy)
    assert_same_gradients(a, b)


@pytest.mark.parametrize("change", ["load_state_dict", "init_weights", "parameters_changed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_after_the_parameters_changed_raises(backend, change):
    spec = functional_spec("batch_norm", backend)
    layer = layer_on(backend, spec)
    x, dy = inputs_at(spec, 4)
    layer.forward(x)
    if change == "load_state_dict":
        layer.load_state_dict(layer_on(backend, spec, seed=7).state_dict())
    elif change == "init_weights":
        layer.init_weights(np.random.default_rng(3))
    else:
        layer.parameters_changed()
    for call in (lambda: layer.backward(x, dy), lambda: layer.backward_input(dy)):
        with pytest.raises(RuntimeError, match="the parameters changed"):
            call()
    layer.forward(x)
    layer.backward(x, dy)  # a new forward is fine


@pytest.mark.parametrize("backend", BACKENDS)
def test_resetting_running_statistics_keeps_the_forward_usable(backend):
    spec = functional_spec("batch_norm", backend)
    layer = layer_on(backend, spec)
    x, dy = inputs_at(spec, 4)
    layer.forward(x)
    layer.reset_running_stats()
    layer.backward(x, dy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pre_activations_are_read_only_and_cannot_change_the_next_backward(backend):
    spec = functional_spec("batch_norm", backend)
    layer, twin = layer_on(backend, spec), layer_on(backend, spec)
    x, dy = inputs_at(spec, 4)
    layer.forward(x)
    twin.forward(x)
    pre = layer.pre_activations
    with pytest.raises(ValueError, match="read-only"):
        pre[...] = 0
    layer.backward(x, dy)
    twin.backward(x, dy)
    assert_same_gradients(layer, twin)


# The functions themselves -------------------------------------------------------------------
def test_functions_read_caller_owned_parameters_and_update_running_statistics_in_place():
    spec = functional_spec("batch_norm")
    layer = make_layer(spec)
    state = layer.state_dict()
    params, running = split_state(state)
    running_before = {k: v.copy() for k, v in running.items()}
    x, dy = inputs_at(spec, 3)
    fn = layer.functions
    y, saved = fn.forward(params, x, True, running)
    grads, d_x = fn.backward(params, saved, dy)
    np.testing.assert_array_equal(y, layer.forward(x))
    np.testing.assert_array_equal(d_x, layer.backward_full(x, dy))
    for k, g in layer.grad_dict().items():
        np.testing.assert_array_equal(grads[k], g, err_msg=k)
    for k, v in layer.state_dict().items():
        if k in RUNNING:
            np.testing.assert_array_equal(running[k], v, err_msg=k)  # updated in place, like the layer's
            assert not np.array_equal(running[k], running_before[k])


def test_backward_gives_fresh_gradients_each_call_and_accumulates_only_when_asked():
    spec = functional_spec("layer_norm")
    layer = make_layer(spec)
    state = layer.state_dict()
    x, dy = inputs_at(spec, 2)
    fn = layer.functions
    _, saved = fn.forward(state, x, True)
    first, _ = fn.backward(state, saved, dy, want_input=False)
    again, _ = fn.backward(state, saved, dy, want_input=False)
    acc = {k: np.zeros_like(v) for k, v in first.items()}
    fn.backward(state, saved, dy, want_input=False, accumulate=acc)
    fn.backward(state, saved, dy, want_input=False, accumulate=acc)
    for k in first:
        np.testing.assert_array_equal(again[k], first[k], err_msg=k)
        np.testing.assert_allclose(acc[k], 2 * first[k], rtol=1e-15, err_msg=k)


def test_functions_refuse_parameters_of_the_wrong_shape_naming_them():
    spec = functional_spec("none")
    layer = make_layer(spec)
    params = layer.state_dict()
    params["weights"] = params["weights"][:, :, :, :1]
    x, _ = inputs_at(spec, 2)
    with pytest.raises(ValueError, match=r"params\['weights'\]: expected shape \(3, 3, 3, 2\)"):
        layer.functions.forward(params, x, True)


def _swap_weights(params, replacement, how):
    """Give `params` other weights: a new array in the same dict, or (torch) new data
    under the same tensor object."""
    if how == "new array in the dict":
        params["weights"] = replacement
    else:
        params["weights"].data = replacement


@pytest.mark.parametrize("how", ["new array in the dict", "tensor.data replaced"])
def test_the_cpu_functions_read_weights_replaced_between_calls(how):
    """The cpu Functions check and view the same dicts of the same arrays once; an
    array replaced in the dict, or a tensor given other memory, is read anew."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    spec = functional_spec("none")
    layer = make_layer(spec, backend="cpu")
    params = {k: torch.from_numpy(v.copy()) for k, v in layer.state_dict().items()}
    x, _ = inputs_at(spec, 2)
    fn = layer.functions
    first = fn.evaluate(params, x).copy()
    other = np.random.default_rng(5).standard_normal(spec.weight_shape)
    _swap_weights(params, torch.from_numpy(other), how)
    layer.load_state_dict({**layer.state_dict(), "weights": other})
    np.testing.assert_array_equal(fn.evaluate(params, x), layer.evaluate(x))
    assert not np.array_equal(first, layer.evaluate(x))


def _count_checks(monkeypatch):
    from conv2d.reference import functional as ref

    calls = []
    real = ref.check_params
    monkeypatch.setattr(ref, "check_params", lambda *a: calls.append(1) or real(*a))
    return calls


def test_the_reference_checks_the_parameters_at_every_call(monkeypatch):
    """The oracle keeps no cache: the same dicts of the same arrays are checked each call."""
    spec = functional_spec("none")
    layer = make_layer(spec)
    params = layer.state_dict()
    x, _ = inputs_at(spec, 2)
    calls = _count_checks(monkeypatch)
    for _ in range(3):
        layer.functions.evaluate(params, x)
    assert len(calls) == 3


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_the_cpu_functions_check_new_dicts_of_views_over_the_same_memory_once(lib, monkeypatch):
    """New dicts of new array objects over the memory of an earlier call's (what the
    registered torch ops hand over under torch.compile) are checked once, not every call."""
    spec = functional_spec("batch_norm")
    layer = make_layer(spec, backend="cpu")
    params, running = split_state(layer.state_dict())
    if lib == "torch":
        torch = pytest.importorskip("torch", reason="torch is not installed")
        params = {k: torch.from_numpy(v) for k, v in params.items()}
        running = {k: torch.from_numpy(v) for k, v in running.items()}
    fresh = (lambda d: {k: v.view(v.shape) for k, v in d.items()}) if lib == "torch" else \
        (lambda d: {k: v.view() for k, v in d.items()})
    x, _ = inputs_at(spec, 2)
    calls = _count_checks(monkeypatch)
    first = layer.functions.evaluate(fresh(params), x, fresh(running))
    for _ in range(3):
        np.testing.assert_array_equal(layer.functions.evaluate(fresh(params), x, fresh(running)), first)
    assert len(calls) == 1


def test_the_cpu_functions_check_a_new_dict_over_other_memory_anew(monkeypatch):
    spec = functional_spec("none")
    layer = make_layer(spec, backend="cpu")
    params = layer.state_dict()
    x, _ = inputs_at(spec, 2)
    calls = _count_checks(monkeypatch)
    first = layer.functions.evaluate(dict(params), x)
    other = {k: v * 2 for k, v in params.items()}
    assert not np.array_equal(layer.functions.evaluate(other, x), first)
    assert len(calls) == 2


def test_the_cpu_functions_refuse_an_array_reshaped_in_place_after_a_call_by_memory():
    """A view kept by the address cache is not the caller's object: reshaping the caller's
    array in place is seen, and a new array of the old shape at that address still works."""
    spec = functional_spec("none")
    layer = make_layer(spec, backend="cpu")
    params = layer.state_dict()
    x, _ = inputs_at(spec, 2)
    first = layer.functions.evaluate(dict(params), x)
    w = params["weights"]
    w.shape = (w.size,)
    with pytest.raises(ValueError, match=r"params\['weights'\]: expected shape \(3, 3, 3, 2\)"):
        layer.functions.evaluate(dict(params), x)
    np.testing.assert_array_equal(layer.functions.evaluate({**params, "weights": w.reshape(spec.weight_shape)}, x),
                                  first)


def test_the_cpu_functions_refuse_an_array_reshaped_in_place_after_a_good_call():
    spec = functional_spec("none")
    layer = make_layer(spec, backend="cpu")
    params = layer.state_dict()
    x, _ = inputs_at(spec, 2)
    layer.functions.evaluate(params, x)
    params["weights"].shape = (params["weights"].size,)
    with pytest.raises(ValueError, match=r"params\['weights'\]: expected shape \(3, 3, 3, 2\)"):
        layer.functions.evaluate(params, x)


def test_the_cpu_functions_still_want_running_statistics_where_a_cached_call_did_not():
    spec = functional_spec("batch_norm")
    layer = make_layer(spec, backend="cpu")
    params, _ = split_state(layer.state_dict())
    x, _ = inputs_at(spec, 2)
    layer.functions.forward(params, x, True)  # training: batch statistics, running optional
    with pytest.raises(ValueError, match="running: expected arrays"):
        layer.functions.forward(params, x, False)


# Outputs in the caller's library ------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_torch_cpu_tensors_through_the_reference_give_torch_tensors_without_copies(dtype):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    spec = functional_spec("batch_norm", dtype=dtype)
    layer = make_layer(spec)
    x, dy = inputs_at(spec, 3)
    tdt = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    xt = torch.from_numpy(x.astype(np.float32)).to(tdt)
    dyt = torch.from_numpy(dy.astype(np.float32)).to(tdt)
    y = layer.forward(xt)
    assert isinstance(y, torch.Tensor) and y.dtype == tdt and tuple(y.shape) == spec.at(3).output_shape
    params, running = split_state(layer.state_dict())
    _, saved = layer.functions.forward(params, xt, False, running)
    assert saved.x.__array_interface__["data"][0] == xt.data_ptr()  # the input was viewed, not copied
    d_x = layer.backward_full(xt, dyt)
    assert isinstance(d_x, torch.Tensor) and d_x.dtype == tdt and tuple(d_x.shape) == tuple(xt.shape)
    ref = make_layer(spec)
    x, dy = to_host(xt), to_host(dyt)
    np.testing.assert_array_equal(to_host(y), ref.forward(x))
    np.testing.assert_array_equal(to_host(d_x), ref.backward_full(x, dy))
    assert isinstance(layer.evaluate(xt), torch.Tensor)


def test_the_reference_refuses_a_cuda_tensor_saying_it_runs_on_the_cpu():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    layer = make_layer(functional_spec("none"))
    meta = torch.empty((2, 5, 4, 2), dtype=torch.float64, device="meta")
    with pytest.raises(TypeError, match="^x: expected a NumPy array or a torch CPU tensor.*meta"):
        layer.forward(meta)


# Saved values the caller keeps (what a torch custom op returns) ------------------------------
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backward_from_saved_values_the_caller_kept_equals_the_usual_one(backend, norm):
    spec = functional_spec(norm, backend)
    layer = layer_on(backend, spec)
    fn = layer.functions
    params = layer.parameters()
    x, dy = inputs_at(spec, 3)
    st = storage_dtype(spec.dtype)
    if backend == "cuda":
        from conv2d.cuda.runtime import numba_cuda

        cuda = numba_cuda()
        x, dy = cuda.to_device(x), cuda.to_device(dy)
        groups = {"batch_norm": spec.out_channels, "layer_norm": 3}.get(norm, 1)
        kept = {"pre": cuda.device_array(spec.at(3).output_shape, st),
                "mean": cuda.device_array(groups, np.float32), "inv_std": cuda.device_array(groups, np.float32)}
        y, _ = fn.forward(params, x, True, saved_out=kept)
    else:
        y, saved = fn.forward(params, x, True)
        kept = {"pre": saved.pre, "mean": saved.mean, "inv_std": saved.inv_std}
    rebuilt = fn.saved(x, kept["pre"], kept["mean"], kept["inv_std"], batch_stats=norm != "none")
    grads, d_x = fn.backward(params, rebuilt, dy)
    y2, usual = fn.forward(params, x, True)
    grads2, d_x2 = fn.backward(params, usual, dy)
    np.testing.assert_array_equal(to_host(y, st), to_host(y2, st))
    np.testing.assert_array_equal(to_host(d_x, st), to_host(d_x2, st))
    for k in grads2:
        np.testing.assert_array_equal(to_host(grads[k]), to_host(grads2[k]), err_msg=k)


def _cuda_call(norm):
    """(functions, params, running, x, d_y, numba) of the CUDA backend (cuDNN on a GPU, else
    numba's simulator), inputs on the device, batch 3."""
    spec = functional_spec(norm, "cuda")
    layer = layer_on("cuda", spec)
    from conv2d.cuda.runtime import numba_cuda

    cuda = numba_cuda()
    x, dy = inputs_at(spec, 3)
    fn = layer.functions
    running = None if norm != "batch_norm" else fn.from_host(
        {"running_mean": np.zeros(spec.out_channels, np.float32), "running_var": np.ones(spec.out_channels, np.float32)})
    return fn, layer.parameters(), running, cuda.to_device(x), cuda.to_device(dy), cuda


@pytest.mark.parametrize("norm", NORMS)
def test_outputs_written_into_the_callers_arrays_equal_new_ones_bitwise(norm):
    """y_out, grads_out and d_x_out: a call that allocates nothing (what conv2d.torch.graphs
    captures) gives the bits of the usual call, in the given arrays."""
    fn, params, running, x, dy, cuda = _cuda_call(norm)
    st = storage_dtype(fn.spec.dtype)
    call = fn.spec.at(3)
    want_y, saved = fn.forward(params, x, True, running)
    want_grads, want_dx = fn.backward(params, saved, dy)
    from conv2d.cuda.runtime import device_dtype

    dev = device_dtype(fn.spec.dtype)
    y_out = cuda.device_array(call.output_shape, dev)
    d_x_out = cuda.device_array(call.input_shape, dev)
    grads_out = {k: cuda.device_array(g.shape, g.dtype) for k, g in want_grads.items()}
    y, saved = fn.forward(params, x, True, running, y_out=y_out)
    grads, d_x = fn.backward(params, saved, dy, grads_out=grads_out, d_x_out=d_x_out)
    assert y is y_out and d_x is d_x_out and grads is grads_out
    np.testing.assert_array_equal(to_host(y, st), to_host(want_y, st))
    np.testing.assert_array_equal(to_host(d_x, st), to_host(want_dx, st))
    for k in want_grads:
        np.testing.assert_array_equal(to_host(grads[k]), to_host(want_grads[k]), err_msg=k)


@pytest.mark.parametrize("case, error, match", [
    ("y_out of another shape", ValueError, r"^y_out: expected shape \(3, 5, 4, 3\)"),
    ("y_out on the host", TypeError, "^y_out: expected a device array"),
    ("evaluate's y_out of another shape", ValueError, r"^y_out: expected shape \(3, 5, 4, 3\)"),
    ("evaluate's y_out on the host", TypeError, "^y_out: expected a device array"),
    ("grads_out with accumulate", ValueError, "^grads_out: given with accumulate"),
    ("grads_out without want_params", ValueError, "^grads_out: given with accumulate or without want_params"),
    ("grads_out missing a key", ValueError, r"^grads_out: expected keys \['weights', 'bias', 'gamma', 'beta'\]"),
    ("d_x_out without want_input", ValueError, "^d_x_out: given with want_input=False"),
])
def test_output_arrays_that_do_not_fit_are_refused_before_any_work(case, error, match):
    fn, params, running, x, dy, cuda = _cuda_call("batch_norm")
    before = {k: v.copy_to_host() for k, v in running.items()}
    _, saved = fn.forward(params, x, True)
    from conv2d.cuda.runtime import device_dtype

    dev = device_dtype(fn.spec.dtype)
    grads = {k: cuda.device_array(a.shape, a.dtype) for k, a in params.items()}
    with pytest.raises(error, match=match):
        if case == "y_out of another shape":
            fn.forward(params, x, True, running, y_out=cuda.device_array((3, 5, 4, 2), dev))
        elif case == "y_out on the host":
            fn.forward(params, x, True, running, y_out=np.zeros((3, 5, 4, 3), dev))
        elif case == "evaluate's y_out of another shape":
            fn.evaluate(params, x, running, y_out=cuda.device_array((3, 5, 4, 2), dev))
        elif case == "evaluate's y_out on the host":
            fn.evaluate(params, x, running, y_out=np.zeros((3, 5, 4, 3), dev))
        elif case == "grads_out with accumulate":
            fn.backward(params, saved, dy, grads_out=grads, accumulate=grads)
        elif case == "grads_out without want_params":
            fn.backward(params, saved, dy, want_params=False, grads_out=grads)
        elif case == "grads_out missing a key":
            fn.backward(params, saved, dy, grads_out={"weights": grads["weights"]})
        else:
            fn.backward(params, saved, dy, want_input=False, d_x_out=cuda.device_array((3, 5, 4, 2), dev))
    for k, v in running.items():  # a refused forward did not update the running statistics
        np.testing.assert_array_equal(v.copy_to_host(), before[k], err_msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dropped_layer_gives_its_functions_back_without_the_garbage_collector(backend):
    import gc
    import weakref

    spec = functional_spec("batch_norm", backend)
    layer = layer_on(backend, spec)
    x, dy = inputs_at(spec, 3)
    layer.forward(x)
    layer.backward_full(x, dy)
    ref = weakref.ref(layer.functions)
    gc.collect()
    gc.disable()
    try:
        del layer
        assert ref() is None
    finally:
        gc.enable()


def test_the_bias_gradient_sums_d_z_as_stored_in_the_storage_dtype():
    """The reference sums d_z rounded to the storage dtype for the bias gradient, as the GPU
    sums the d_z it stores for cuDNN; the sum of the unrounded d_z differs in some
    channels here, so the test tells the two apart."""
    from conv2d.reference.functional import grad_pre_activations

    spec = LayerSpec(batch_size=16, in_height=12, in_width=12, in_channels=3, out_channels=16, kernel=3, padding=1,
                     activation="tanh", normalization="batch_norm", dtype="bfloat16")
    layer = make_layer(spec)
    x, dy = random_inputs(spec)
    params, _ = split_state(layer.state_dict())
    _, saved = layer.functions.forward(params, x, True)
    grads, _ = layer.functions.backward(params, saved, dy)
    d_z, _ = grad_pre_activations(params, saved, dy)
    st = storage_dtype(spec.dtype)

    def bias_of(d):
        return d.reshape(-1, spec.out_channels).sum(axis=0).astype(st)
    rounded, unrounded = bias_of(d_z.astype(st).astype(np.float32)), bias_of(d_z)
    assert (rounded != unrounded).any()
    np.testing.assert_array_equal(grads["bias"], rounded)


@pytest.mark.parametrize("chunks", [0.01, 1, 1.5, 3])
def test_the_cpu_column_sums_add_in_float64_in_one_chunk_or_several(chunks):
    """conv2d.cpu.kernels.column_sums, under every statistic and parameter gradient of the
    cpu backend: float64 sums of float32 rows (float32 sums of these rows are off by about
    1e-7 of the column sums), over one fixed chunk of rows or several."""
    import math

    pytest.importorskip("numba", reason="numba is not installed (the test extra brings it)")
    from conv2d.cpu import kernels

    rows = max(1, int(chunks * kernels.CHUNK_ROWS))
    a = (np.random.default_rng(rows).standard_normal((rows, 16)) * 1e3 + 1e4).astype(np.float32)
    sums, squares = (kernels.column_sums(a, np.zeros(16), power) for power in (1, 2))
    exact = np.array([math.fsum(column) for column in a.astype(np.float64).T])
    assert sums.dtype == np.float64
    np.testing.assert_allclose(sums, exact, rtol=1e-13)
    np.testing.assert_allclose(squares, [math.fsum(column ** 2) for column in a.astype(np.float64).T], rtol=1e-13)
