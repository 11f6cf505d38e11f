"""The CUDA backend with the caller's arrays on a real GPU: torch, CuPy, numba and NumPy
in give the same library out, on the caller's stream; caller-owned parameters; any batch
size after a capture."""

import dataclasses
import gc

import numpy as np
import pytest

from conftest import HAVE_GPU, NO_GPU_REASON, make_layer, random_inputs, spec_for
from cuda_testing import GPU_DTYPES, step, torch_cuda

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)

if HAVE_GPU:
    from conv2d.arrays import to_host
    from conv2d.dtypes import storage_dtype


# Arrays of the caller's library, any batch size, caller-owned parameters -------------------
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_torch_cuda_tensors_give_torch_tensors_from_torchs_allocator(dtype):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    spec = spec_for("gelu", "batch_norm", dtype)
    layer = make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    xt, dyt = torch_cuda(torch, x, dtype), torch_cuda(torch, dy, dtype)
    tdt = xt.dtype
    gc.collect()  # no tensor of an earlier test is freed during the forward
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    y = layer.forward(xt)
    assert isinstance(y, torch.Tensor) and y.is_cuda and y.dtype == tdt and tuple(y.shape) == spec.output_shape
    # y came from torch's caching allocator, which counts it
    assert torch.cuda.memory_allocated() >= allocated + y.numel() * y.element_size()
    assert layer._saved.x.__cuda_array_interface__["data"][0] == xt.data_ptr()  # no copy of the input
    d_x = layer.backward_full(xt, dyt)
    assert isinstance(d_x, torch.Tensor) and d_x.dtype == tdt and tuple(d_x.shape) == spec.input_shape
    want = step(make_layer(spec, backend="cuda"), to_host(xt), to_host(dyt))
    st = storage_dtype(spec.dtype)
    np.testing.assert_array_equal(to_host(y, st).view(np.uint8), want[0].view(np.uint8))
    np.testing.assert_array_equal(to_host(d_x, st).view(np.uint8), want[1].view(np.uint8))


def test_torch_tensors_run_on_torchs_current_stream():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from conv2d.cuda.runtime import stream_handle

    spec = spec_for("relu", "layer_norm")
    layer = make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    xt, dyt = torch.from_numpy(x).cuda(), torch.from_numpy(dy).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = layer.forward(xt)
        assert stream_handle(layer.functions.current_stream) == side.cuda_stream
        d_x = layer.backward_full(xt, dyt)
    side.synchronize()
    want = step(make_layer(spec, backend="cuda"), x, dy)
    np.testing.assert_array_equal(to_host(y), want[0])
    np.testing.assert_array_equal(to_host(d_x), want[1])
    layer.forward(x)  # a NumPy input goes back to the layer's own stream
    assert layer.functions.current_stream is layer.functions.stream


def test_cupy_arrays_give_cupy_arrays_and_numba_arrays_numba_arrays():
    cp = pytest.importorskip("cupy", reason="cupy is not installed")
    from numba import cuda

    spec = spec_for("tanh", "batch_norm", "bfloat16")
    layer = make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    xc, dyc = cp.asarray(x.view(np.uint16)), cp.asarray(dy.view(np.uint16))
    y = layer.forward(xc)
    assert isinstance(y, cp.ndarray) and y.dtype == np.uint16 and y.shape == spec.output_shape
    assert isinstance(layer.backward_full(xc, dyc), cp.ndarray)
    xn = cuda.to_device(x.view(np.uint16))
    yn = layer.forward(xn)
    assert cuda.is_cuda_array(yn) and type(yn).__module__.startswith("numba") and yn.dtype == np.uint16
    np.testing.assert_array_equal(yn.copy_to_host(), y.get())


def test_numpy_in_gives_numpy_out_on_the_gpu():
    spec = spec_for("sigmoid", "batch_norm", "bfloat16")
    layer = make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    y = layer.forward(x)
    d_x = layer.backward_full(x, dy)
    assert isinstance(y, np.ndarray) and y.dtype == storage_dtype(spec.dtype) and y.shape == spec.output_shape
    assert isinstance(d_x, np.ndarray) and d_x.dtype == storage_dtype(spec.dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_numpy_input_may_change_as_soon_as_the_call_returns(dtype):
    """NumPy inputs are copied into the layer's own blocks (cuMemcpyHtoDAsync from
    pageable memory): overwriting x and d_y right after each call, while the kernels may
    still run, changes nothing, and a second layer fed the untouched arrays agrees bitwise."""
    spec = spec_for("gelu", "batch_norm", dtype, batch_size=3)
    ours, other = make_layer(spec, backend="cuda"), make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    x_scratch, dy_scratch = x.copy(), dy.copy()
    y = ours.forward(x_scratch)
    x_scratch[...] = 7
    d_x = ours.backward_full(x_scratch, dy_scratch)  # the same array object as the forward's
    dy_scratch[...] = -3
    np.testing.assert_array_equal(y, other.forward(x))
    np.testing.assert_array_equal(d_x, other.backward_full(x, dy))
    for k, g in other.grad_dict().items():
        np.testing.assert_array_equal(ours.grad_dict()[k], g, err_msg=k)


def test_caller_owned_torch_parameters_are_read_in_place_and_gradients_come_back_fresh():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from conv2d.state import RUNNING

    spec = spec_for("gelu", "batch_norm", batch_size=2)
    layer = make_layer(spec, backend="cuda")
    state = layer.state_dict()
    params = {k: torch.from_numpy(v).cuda() for k, v in state.items() if k not in RUNNING}
    running = {k: torch.from_numpy(v).cuda() for k, v in state.items() if k in RUNNING}
    x, dy = random_inputs(dataclasses.replace(spec, batch_size=5))
    xt, dyt = torch.from_numpy(x).cuda(), torch.from_numpy(dy).cuda()
    fn = layer.functions
    y, saved = fn.forward(params, xt, True, running)
    grads, d_x = fn.backward(params, saved, dyt)
    assert all(isinstance(g, torch.Tensor) and tuple(g.shape) == tuple(params[k].shape) for k, g in grads.items())
    np.testing.assert_array_equal(to_host(y), to_host(layer.forward(x)))
    np.testing.assert_array_equal(to_host(d_x), to_host(layer.backward_full(x, dy)))
    for k, g in layer.grad_dict().items():
        np.testing.assert_array_equal(to_host(grads[k]), g, err_msg=k)
    for k in running:
        np.testing.assert_array_equal(to_host(running[k]), layer.state_dict()[k], err_msg=k)


def test_a_torch_parameter_whose_memory_is_replaced_in_place_is_read_at_its_new_address():
    """The CUDA backend views the caller's dicts once per set of arrays; `t.data = other`
    keeps the tensor object but moves its memory, and the next call must read (and
    write) the new memory, not the freed one."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from conv2d.state import RUNNING

    spec = spec_for("relu", "batch_norm", batch_size=2)
    layer = make_layer(spec, backend="cuda")
    state = layer.state_dict()
    params = {k: torch.from_numpy(v).cuda() for k, v in state.items() if k not in RUNNING}
    x, _ = random_inputs(spec)
    xt = torch.from_numpy(x).cuda()
    fn = layer.functions
    before = to_host(fn.evaluate(params, xt, {k: torch.from_numpy(v).cuda() for k, v in state.items()
                                              if k in RUNNING}))
    running = {k: torch.from_numpy(v).cuda() for k, v in state.items() if k in RUNNING}
    fn.evaluate(params, xt, running)
    params["weights"].data = -params["weights"].clone()  # the same object, other memory
    after = to_host(fn.evaluate(params, xt, running))
    layer.load_state_dict({**state, "weights": -state["weights"]})
    np.testing.assert_array_equal(after, to_host(layer.evaluate(x)))
    assert not np.array_equal(after, before)


def test_a_frozen_layer_refuses_a_backward_of_an_overwritten_forward():
    from numba import cuda

    spec = spec_for("relu", "batch_norm")
    layer = make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    xd, dyd = cuda.to_device(x), cuda.to_device(dy)
    layer.freeze()
    fn = layer.functions
    params = layer.parameters()
    _, first = fn.forward(params, xd, True)
    fn.forward(params, xd, True)
    with pytest.raises(RuntimeError, match="overwrote this forward's saved values"):
        fn.backward(params, first, dyd)
    with pytest.raises(RuntimeError, match="frozen and has no plan for input shape"):
        layer.forward(cuda.to_device(x[:1]))


def test_a_capture_after_other_batch_sizes_replays_at_the_planned_one():
    from numba import cuda

    spec = spec_for("relu", "batch_norm")
    layer, eager = make_layer(spec, backend="cuda"), make_layer(spec, backend="cuda")
    x, dy = random_inputs(spec)
    for layer_ in (layer, eager):
        layer_.evaluate(x[:1])  # acting at batch 1 plans a second shape
    xc, dyc = cuda.to_device(x), cuda.to_device(dy)
    graph = layer.capture(xc, dyc)
    graph.replay()
    want = step(eager, x, dy)
    np.testing.assert_array_equal(to_host(graph.outputs["y"]), want[0])
    np.testing.assert_array_equal(to_host(graph.outputs["d_x"]), want[1])
