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
from conv2d.cpu import casts, conv_kernels, kernels  # noqa: E402
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


@pytest.fixture
def torch_team(monkeypatch):
    """PyTorch at 3 threads with its OpenMP team found (a skip naming what is missing
    otherwise), `use("torch")` set for the test; PyTorch's count restored after."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (the test extra brings it)")
    from conv2d.cpu import threads as pool

    if pool.openmp() is None:
        pytest.skip("PyTorch's OpenMP runtime here is not GNU libgomp: the cpu backend uses its own pool")
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    pool.use("torch")
    yield pool
    pool.use(None)
    torch.set_num_threads(before)


def test_with_threads_torch_the_tasks_run_on_pytorchs_openmp_team_not_a_pool_beside_it(torch_team):
    seen = {}
    barrier = threading.Barrier(3, timeout=10)

    def kernel(first, end):  # each range waits for the others: they run at once, or this times out
        seen[threading.get_ident()] = (threading.current_thread().name, torch_team.openmp()[1]())
        barrier.wait()
    kernels.run_tasks(kernel, 7, kernels.PARALLEL_VALUES)
    assert sorted(n for _, n in seen.values()) == [0, 1, 2]  # omp_get_thread_num: one team of three
    assert threading.get_ident() in seen  # the caller is the team's first thread
    assert not any(name.startswith("conv2d-cpu") for name, _ in seen.values())


def test_a_task_that_raises_on_pytorchs_team_raises_from_the_call(torch_team):
    def kernel(first, end):
        if first > 0:
            raise ArithmeticError(f"range {first}:{end}")
    with pytest.raises(ArithmeticError, match="range"):
        kernels.run_tasks(kernel, 6, kernels.PARALLEL_VALUES)


def test_a_call_inside_a_team_task_still_runs_every_range(torch_team):
    """A nested region gets a team of one thread (OpenMP's default): that thread runs
    all the ranges."""
    done = []
    lock = threading.Lock()

    def inner(first, end):
        with lock:
            done.extend(range(first, end))

    def outer(first, end):
        kernels.run_tasks(inner, 5, kernels.PARALLEL_VALUES)
    kernels.run_tasks(outer, 3, kernels.PARALLEL_VALUES)
    assert sorted(done) == sorted(list(range(5)) * 3)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", SPECS)
def test_results_on_pytorchs_team_are_bitwise_those_of_one_thread(shape, dtype, torch_team, monkeypatch):
    monkeypatch.setattr(kernels, "PARALLEL_VALUES", 1)
    spec = LayerSpec(batch_size=5, in_height=23, in_width=19, dtype=dtype, **SPECS[shape])
    one = _step(spec, 1)
    for got, want in zip(_step(spec, "torch"), one):
        np.testing.assert_array_equal(got, want)


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


@pytest.mark.parametrize("stride, dilation, mult", [((1, 1), (1, 1), 1), ((1, 1), (2, 1), 1), ((2, 1), (1, 2), 1),
                                                    ((2, 2), (2, 1), 3)])
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
    sums, squares = (kernels.row_sums(a, np.zeros(3), power) for power in (1, 2))
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


def _float32_edge_bits() -> np.ndarray:
    """float32 bit patterns where a cast to bfloat16 can go wrong: zeros, infinities,
    NaNs (quiet, signalling, payloads, both signs), subnormals, the largest finite values,
    ties between two bfloat16 values (even and odd below), one bit either side of a tie,
    and random ones."""
    edges = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,
             0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA50000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00008000,
             0x00018000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,
             0xBF808000, 0xBF818000, 0x4B7FFFFF]
    rng = np.random.default_rng(0)
    return np.concatenate([np.array(edges, np.uint32), rng.integers(0, 2**32, 100_000, dtype=np.uint64)
                           .astype(np.uint32)])


def test_the_bfloat16_casts_give_numpys_bits_for_every_edge_case():
    bits = _float32_edge_bits()
    x = bits.view(np.float32)
    with np.errstate(invalid="ignore"):
        want = x.astype(casts.BFLOAT16)
    np.testing.assert_array_equal(casts.cast(x, casts.BFLOAT16).view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(casts.through(x, casts.BFLOAT16).view(np.uint32),
                                  want.astype(np.float32).view(np.uint32))
    in_place = x.copy()  # its own loop (one array): the same bits
    casts.through(in_place, casts.BFLOAT16, out=in_place)
    np.testing.assert_array_equal(in_place.view(np.uint32), want.astype(np.float32).view(np.uint32))
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(casts.BFLOAT16)  # exact: all 65,536
    np.testing.assert_array_equal(casts.cast(every, np.dtype(np.float32)).view(np.uint32),
                                  every.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("threads", [1, 3])
def test_the_bfloat16_casts_keep_the_shape_and_split_into_tasks_alike(threads):
    from conv2d.cpu import threads as pool

    x = np.random.default_rng(1).standard_normal((4, 100, 100, 7)).astype(np.float32)
    assert x.size > 4 * casts.CAST_CHUNK  # several tasks
    pool.use(threads)
    try:
        got = casts.cast(x, casts.BFLOAT16)
    finally:
        pool.use(None)
    assert got.shape == x.shape and got.dtype == casts.BFLOAT16
    np.testing.assert_array_equal(got.view(np.uint16), x.astype(casts.BFLOAT16).view(np.uint16))


def test_a_cast_to_the_same_dtype_is_the_array_itself_and_other_pairs_are_numpys():
    x = np.ones((2, 3), np.float32)
    assert casts.cast(x, np.dtype(np.float32)) is x
    np.testing.assert_array_equal(casts.cast(x, np.dtype(np.float16)), x.astype(np.float16))
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]  # not contiguous: NumPy's cast
    np.testing.assert_array_equal(casts.cast(strided, casts.BFLOAT16).astype(np.float32), strided)


@pytest.mark.parametrize(("source", "target"), [(np.float32, "bfloat16"), ("bfloat16", np.float32),
                                                 (np.float32, np.float16), (np.float32, np.float32)])
def test_a_cast_into_out_writes_numpys_bits_there(source, target):
    source = casts.BFLOAT16 if source == "bfloat16" else np.dtype(source)
    target = casts.BFLOAT16 if target == "bfloat16" else np.dtype(target)
    x = (np.random.default_rng(0).standard_normal((3, 70000)) * 1e3).astype(source)
    out = np.empty(x.shape, target)
    assert casts.cast(x, target, out=out) is out
    np.testing.assert_array_equal(out.astype(np.float64), x.astype(target).astype(np.float64))


@pytest.mark.parametrize("storage", ["bfloat16", np.float16])
def test_rounding_through_a_storage_dtype_in_place_gives_numpys_bits(storage):
    storage = casts.BFLOAT16 if storage == "bfloat16" else np.dtype(storage)
    x = (np.random.default_rng(1).standard_normal((3, 70000)) * 1e3).astype(np.float32)
    want = x.astype(storage).astype(np.float32)
    assert casts.through(x, storage, out=x) is x
    np.testing.assert_array_equal(x.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stride, dilation", [((1, 1), (1, 1)), ((2, 2), (1, 1)), ((2, 1), (1, 2)), ((1, 3), (2, 1))])
def test_the_3x3_depthwise_forward_gives_the_general_loops_bits(stride, dilation, dtype):
    rng = np.random.default_rng(2)
    xp = rng.standard_normal((3, 13, 12, 37)).astype(dtype)
    xp[0, :3] = -0.0  # zero products: the sums start from +0 in both
    w = rng.standard_normal((3, 3, 37)).astype(dtype)
    oh = (13 - 2 * dilation[0] - 1) // stride[0] + 1
    ow = (12 - 2 * dilation[1] - 1) // stride[1] + 1
    general, three = np.empty((3, oh, ow, 37), dtype), np.empty((3, oh, ow, 37), dtype)
    conv_kernels._depthwise_forward(0, 3 * oh, xp, w, 0, 0, stride, dilation, general)
    conv_kernels._depthwise_forward_3x3(0, 3 * oh, xp, w, 0, 0, stride, dilation, three)
    np.testing.assert_array_equal(three.view(np.uint8), general.view(np.uint8))  # the signs of zeros too


@pytest.mark.parametrize("kernel, mult", [(3, 1), (3, 2), (5, 1)])
@pytest.mark.parametrize("stride, dilation", [((1, 1), (1, 1)), ((2, 2), (1, 1)), ((2, 1), (1, 2))])
def test_the_depthwise_loops_read_zero_padding_as_a_padded_copy_would(kernel, mult, stride, dilation):
    """The depthwise forward and filter-gradient loops read positions outside x as zeros
    (no padded copy): the bits of the same loops over the padded copy, the products with
    an infinite weight or gradient (NaN) and the signs of zeros included."""
    rng = np.random.default_rng(4)
    c, (top, bottom), (left, right) = 3, (2, 1), (1, 2)
    x = rng.standard_normal((2, 9, 8, c))
    x[0, :2] = -0.0
    xp = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    w = rng.standard_normal((kernel, kernel, c * mult))
    w[0, 0, 0] = np.inf
    oh = (9 + top + bottom - (kernel - 1) * dilation[0] - 1) // stride[0] + 1
    ow = (8 + left + right - (kernel - 1) * dilation[1] - 1) // stride[1] + 1
    loop = conv_kernels._depthwise_forward_3x3 if kernel == 3 and mult == 1 else conv_kernels._depthwise_forward
    read, copied = np.empty((2, oh, ow, c * mult)), np.empty((2, oh, ow, c * mult))
    loop(0, 2 * oh, x, w, top, left, stride, dilation, read)
    loop(0, 2 * oh, xp, w, 0, 0, stride, dilation, copied)
    np.testing.assert_array_equal(read.view(np.uint8), copied.view(np.uint8))
    d_z = rng.standard_normal((2, oh, ow, c * mult))
    d_z[1, 0, 0, 0] = np.inf
    np.testing.assert_array_equal(
        conv_kernels.depthwise_backward_filter(x, d_z, (kernel, kernel), top, left, stride, dilation).view(np.uint8),
        conv_kernels.depthwise_backward_filter(xp, d_z, (kernel, kernel), 0, 0, stride, dilation).view(np.uint8))


@pytest.mark.parametrize("dilation, padding, mode", [
    ((1, 1), ((1, 1), (1, 1)), "zeros"), ((2, 1), ((2, 2), (2, 2)), "zeros"),
    ((1, 1), ((2, 0), (1, 2)), "zeros"),  # uneven: d_z padded by 0 to 2 a side
    ((1, 1), ((3, 1), (1, 1)), "zeros"),  # wider than the kernel reaches: d_z read at a negative offset
    ((1, 1), ((1, 1), (1, 1)), "reflect"), ((1, 2), ((2, 2), (2, 2)), "circular")])
@pytest.mark.parametrize("input_hw", [(19, 17), (6, 7)])
def test_the_3x3_depthwise_input_gradient_gathered_equals_the_reference(dilation, padding, mode, input_hw):
    """Stride 1: the forward's 3x3 loop over the padded d_z with the taps flipped, against
    the reference's float64 adjoint, on MobileNetV2-sized and small maps; with zero
    padding, d_x's positions alone."""
    rng = np.random.default_rng(3)
    c = 6
    x = rng.standard_normal((2, *input_hw, c))
    w = rng.standard_normal((c, 3, 3, 1))
    y = reference_conv.conv_forward(x, w, (1, 1), padding, dilation=dilation, groups=c, mode=mode)
    d_z = rng.standard_normal(y.shape)
    np.testing.assert_allclose(
        cpu_conv.conv_backward_data(w, d_z, input_hw, (1, 1), padding, dilation=dilation, groups=c, mode=mode),
        reference_conv.conv_backward_data(w, d_z, input_hw, (1, 1), padding, dilation=dilation, groups=c, mode=mode),
        rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("n, hw, c, kernel", [
    (3, 20, 4, 3),  # blocks with more rows than columns: columns.T @ d_z, then the transpose
    (70, 8, 32, 3),  # the same, over several blocks whose sums are added in order
    (3, 4, 32, 4),  # fewer rows than columns: d_z.T @ columns
    (40, 4, 256, 3),  # the same, over several blocks
])
def test_the_dense_filter_gradient_equals_the_reference_in_either_product_orientation(n, hw, c, kernel):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, hw, hw, c))
    w = rng.standard_normal((6, kernel, kernel, c))
    padding = ((1, 0), (0, 1))
    d_z = rng.standard_normal(reference_conv.conv_forward(x, w, (1, 1), padding).shape)
    np.testing.assert_allclose(cpu_conv.conv_backward_filter(x, d_z, (kernel, kernel), (1, 1), padding),
                               reference_conv.conv_backward_filter(x, d_z, (kernel, kernel), (1, 1), padding),
                               rtol=1e-12, atol=1e-11)
