"""The cpu backend's own promises: the same bits for any thread count, its tasks really
shared among threads, its thread option checked, its kernels against the reference's
formulas on the shapes the layer tests do not reach (depthwise with a channel multiplier,
strides and dilation; layer norm over several chunks). Its results against the reference
and PyTorch: the contract, golden, functional, batch-invariance and Hypothesis tests, run
over both host backends."""

import threading

import numpy as np
import pytest

pytest.importorskip("numba", reason="numba is not installed (the test extra brings it)")

from conftest import make_layer, random_inputs  # noqa: E402
from conv2d import Conv2d, LayerSpec  # noqa: E402
from conv2d.cpu import kernels  # noqa: E402
from conv2d.reference import conv as reference_conv  # noqa: E402
from conv2d.cpu import conv as cpu_conv  # noqa: E402

SPECS = {
    "batch_norm": dict(in_channels=6, out_channels=8, kernel=3, padding=1, normalization="batch_norm",
                       activation="relu6"),
    "layer_norm": dict(in_channels=6, out_channels=8, kernel=3, stride=2, padding=1, normalization="layer_norm",
                       activation="gelu"),
    "depthwise": dict(in_channels=6, out_channels=12, kernel=5, padding=2, groups=6, normalization="batch_norm",
                      activation="silu"),
    "no_norm": dict(in_channels=6, out_channels=8, kernel=3, dilation=2, padding=2, normalization="none",
                    activation="tanh"),
}


def _step(spec, threads):
    """y, d_x, every gradient and the running statistics of one training step and one
    evaluate on the cpu backend with `threads`."""
    layer = make_layer(spec, seed=3, backend="cpu", threads=threads)
    x, d_y = random_inputs(spec, seed=4)
    y = layer.forward(x, training=True)
    d_x = layer.backward_full(x, d_y)
    return [y, d_x, layer.evaluate(x), *layer.grad_dict().values(), *layer.state_dict().values()]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", SPECS)
def test_results_are_bitwise_the_same_for_one_two_and_all_threads(shape, dtype, monkeypatch):
    """Every call splits into tasks (PARALLEL_VALUES lowered so that these small layers do
    too), and 1, 2 and numba's configured count of threads give the same bits."""
    monkeypatch.setattr(kernels, "PARALLEL_VALUES", 1)
    spec = LayerSpec(batch_size=5, in_height=23, in_width=19, dtype=dtype, **SPECS[shape])
    one = _step(spec, 1)
    for threads in (2, None):
        for got, want in zip(_step(spec, threads), one):
            np.testing.assert_array_equal(got, want)


def test_the_tasks_of_a_call_run_on_as_many_threads_as_asked(monkeypatch):
    from conv2d.cpu import threads as pool

    seen = set()
    barrier = threading.Barrier(3, timeout=10)

    def kernel(first, end):  # each range waits for the others: they run at once, or this times out
        seen.add(threading.get_ident())
        barrier.wait()
    pool.use(3)
    try:
        kernels.run_tasks(kernel, 7, kernels.PARALLEL_VALUES)
    finally:
        pool.use(None)
    assert len(seen) == 3


def test_a_small_call_runs_on_the_calling_thread():
    from conv2d.cpu import threads as pool

    seen = set()
    pool.use(2)
    try:
        kernels.run_tasks(lambda first, end: seen.add(threading.get_ident()), 4, kernels.PARALLEL_VALUES - 1)
    finally:
        pool.use(None)
    assert seen == {threading.get_ident()}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "all"])
def test_a_thread_count_other_than_none_torch_or_a_positive_int_is_refused(bad):
    spec = LayerSpec(batch_size=1, in_height=4, in_width=4, in_channels=1, out_channels=1, kernel=3)
    with pytest.raises(ValueError, match=r"threads: expected None, 'torch' or an int >= 1, got"):
        Conv2d(spec, "cpu", threads=bad)


@pytest.mark.parametrize("stride, dilation, mult", [((1, 1), (1, 1), 1), ((2, 1), (1, 2), 1), ((2, 2), (2, 1), 3)])
def test_depthwise_loops_equal_the_reference_convolutions_in_float64(stride, dilation, mult):
    rng = np.random.default_rng(0)
    c = 5
    x = rng.standard_normal((3, 11, 9, c))
    w = rng.standard_normal((c * mult, 3, 3, 1))
    padding = ((1, 2), (2, 1))
    y = reference_conv.conv_forward(x, w, stride, padding, dilation=dilation, groups=c)
    np.testing.assert_allclose(cpu_conv.conv_forward(x, w, stride, padding, dilation=dilation, groups=c), y,
                               rtol=1e-13, atol=1e-13)
    d_z = rng.standard_normal(y.shape)
    np.testing.assert_allclose(
        cpu_conv.conv_backward_data(w, d_z, (11, 9), stride, padding, dilation=dilation, groups=c),
        reference_conv.conv_backward_data(w, d_z, (11, 9), stride, padding, dilation=dilation, groups=c),
        rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(
        cpu_conv.conv_backward_filter(x, d_z, (3, 3), stride, padding, dilation, groups=c),
        reference_conv.conv_backward_filter(x, d_z, (3, 3), stride, padding, dilation, groups=c),
        rtol=1e-12, atol=1e-12)


def test_layer_norm_sums_over_several_chunks_equal_exact_sums():
    """kernels.row_sums: each sample's values in fixed chunks (ROW_CHUNK) added in order."""
    import math

    a = np.random.default_rng(1).standard_normal((3, 2 * kernels.ROW_CHUNK + 17)).astype(np.float32) + 100
    sums, squares = kernels.row_sums(a, np.zeros(3))
    np.testing.assert_allclose(sums, [math.fsum(r) for r in a.astype(np.float64)], rtol=1e-13)
    np.testing.assert_allclose(squares, [math.fsum(r * r) for r in a.astype(np.float64)], rtol=1e-13)


def test_a_stack_on_the_cpu_backend_trains_as_on_the_reference():
    """Sequential.from_specs(..., backend="cpu"): outputs, d_x and every layer's gradient
    agree with the reference's stack in float64."""
    from conv2d import Sequential
    from test_sequential import specs

    rng = np.random.default_rng(2)
    stacks = [Sequential.from_specs(specs("float64"), backend=b) for b in ("reference", "cpu")]
    stacks[0].init_weights(rng)
    stacks[1].load_state_dict(stacks[0].state_dict())
    x = rng.standard_normal((3, *specs("float64")[0].input_shape[1:]))
    ys = [s.forward(x, training=True) for s in stacks]
    np.testing.assert_allclose(ys[1], ys[0], rtol=1e-12, atol=1e-12)
    d_y = rng.standard_normal(ys[0].shape)
    d_xs = [s.backward_full(x, d_y) for s in stacks]
    np.testing.assert_allclose(d_xs[1], d_xs[0], rtol=1e-11, atol=1e-12)
    for a, b in zip(*stacks):
        for k, g in a.grad_dict().items():
            np.testing.assert_allclose(b.grad_dict()[k], g, rtol=1e-10, atol=1e-12, err_msg=k)
