"""LayerSpec(batch_invariant=True): a sample's results are bitwise the same whatever batch
it is computed in (its size, its other samples, its position), for every output that is
a function of the sample alone: evaluate (any norm), the training forward without batch
norm or with layer norm, and the input gradient of those. Both backends: the reference
(CI), the CUDA backend on a GPU (cuDNN's plans), and the CUDA backend's own kernels in
numba's simulator with the host stand-in for cuDNN (CI)."""

import dataclasses

import numpy as np
import pytest

import conv2d
from conftest import HAVE_GPU, NO_GPU_REASON, make_layer, random_inputs, small_layer_spec
from conv2d import LayerSpec
from conv2d.arrays import to_host

DTYPES = ["float64", "float32", "bfloat16", "float16"]
# 1x1, 3x3 and 5x5 kernels, strides 1 to 3, 1 to 64 channels.
SHAPES = {
    "1x1": dict(in_height=5, in_width=4, in_channels=1, out_channels=3, kernel=1, stride=1, padding=0),
    "3x3": dict(in_height=7, in_width=6, in_channels=4, out_channels=8, kernel=3, stride=1, padding=1),
    "5x5s2": dict(in_height=9, in_width=8, in_channels=16, out_channels=5, kernel=5, stride=2, padding=2),
    "3x3s3": dict(in_height=9, in_width=9, in_channels=64, out_channels=64, kernel=3, stride=3, padding=0),
}
BATCHES = [1, 2, 3, 7, 31, 32, 33, 255, 256]
GPU = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)


def backends_and_dtypes():
    """(backend, dtype) pairs: the host backends (reference, cpu) in every dtype, the CUDA
    backend (GPU) in those it has (no float64)."""
    return [pytest.param(b, d, id=f"{b}-{d}") for b in ("reference", "cpu") for d in DTYPES] + \
        [pytest.param("cuda", d, id=f"cuda-{d}", marks=GPU) for d in DTYPES if d != "float64"]


def invariant_layer(shape, norm, dtype, backend="reference", **options):
    """A layer of shape `shape` (norm parameters and running statistics away from their
    defaults) and a pool of max(BATCHES) distinct samples and output gradients."""
    spec = LayerSpec(batch_size=None, **SHAPES[shape], activation="gelu", normalization=norm, dtype=dtype,
                     batch_invariant=True)
    return (make_layer(spec, seed=5, backend=backend, **options), *random_inputs(spec.at(max(BATCHES)), seed=3))


def rows(a) -> np.ndarray:
    return to_host(a)


def assert_rows_as_alone(batched, alone_of, n, label):
    """Rows 0, n // 2 and n - 1 of `batched` (computed on a batch of n) are, byte for
    byte, what `alone_of(i)` gives for sample i computed in a batch of one."""
    batched = rows(batched)
    for i in sorted({0, n // 2, n - 1}):
        alone = rows(alone_of(i))[0]
        assert batched[i].tobytes() == alone.tobytes(), f"{label}: row {i} of a batch of {n}"


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("norm", ["none", "batch_norm", "layer_norm"])
@pytest.mark.parametrize("backend, dtype", backends_and_dtypes())
def test_evaluate_gives_each_sample_the_bits_it_gets_alone(backend, dtype, norm, shape):
    layer, x, _ = invariant_layer(shape, norm, dtype, backend)
    for n in BATCHES:
        batch = np.ascontiguousarray(x[:n])
        assert_rows_as_alone(layer.evaluate(batch), lambda i: layer.evaluate(x[i:i + 1]), n, f"evaluate, {dtype}")
        # the same samples in the opposite order: a sample's bits do not depend on its position
        reversed_rows = rows(layer.evaluate(np.ascontiguousarray(batch[::-1])))[::-1]
        assert reversed_rows.tobytes() == rows(layer.evaluate(batch)).tobytes(), f"reversed batch of {n}"


@pytest.mark.parametrize("shape", ["1x1", "3x3", "5x5s2"])
@pytest.mark.parametrize("norm", ["none", "layer_norm"])
@pytest.mark.parametrize("backend, dtype", backends_and_dtypes())
def test_the_training_forward_without_batch_norm_gives_each_sample_the_bits_it_gets_alone(backend, dtype, norm,
                                                                                           shape):
    layer, x, _ = invariant_layer(shape, norm, dtype, backend)
    for n in BATCHES:
        assert_rows_as_alone(layer.forward(np.ascontiguousarray(x[:n])), lambda i: layer.forward(x[i:i + 1]), n,
                             f"training forward, {dtype}")


def input_gradients(layer, x, d_y, training):
    """d_x(lo, hi): the input gradient of samples lo..hi computed as one batch."""
    def d_x(lo, hi):
        layer.forward(np.ascontiguousarray(x[lo:hi]), training=training)
        return layer.backward_input(np.ascontiguousarray(d_y[lo:hi]))
    return d_x


@pytest.mark.parametrize("shape", ["1x1", "3x3", "5x5s2"])
@pytest.mark.parametrize("norm, training", [("none", True), ("layer_norm", True), ("batch_norm", False)])
@pytest.mark.parametrize("backend, dtype", backends_and_dtypes())
def test_the_input_gradient_gives_each_sample_the_bits_it_gets_alone(backend, dtype, norm, training, shape):
    layer, x, d_y = invariant_layer(shape, norm, dtype, backend)
    d_x = input_gradients(layer, x, d_y, training)
    for n in BATCHES:
        assert_rows_as_alone(d_x(0, n), lambda i: d_x(i, i + 1), n, f"d_x, {dtype}")


@pytest.mark.parametrize("norm, training", [("none", True), ("layer_norm", True), ("batch_norm", False)])
def test_the_cuda_kernels_keep_each_samples_bits_in_the_simulator(norm, training):
    """The CUDA backend's own kernels (activations, norms, their backward) with the host
    stand-in for cuDNN; runs in numba's simulator where there is no GPU."""
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")
    from host_convolutions import HostConvolutions

    layer, x, d_y = invariant_layer("3x3", norm, "float32", "cuda", convolutions=HostConvolutions)
    d_x = input_gradients(layer, x, d_y, training)
    for n in (1, 5):
        out = layer.forward(np.ascontiguousarray(x[:n]), training=training)
        assert_rows_as_alone(out, lambda i: layer.forward(x[i:i + 1], training=training), n, "forward")
        assert_rows_as_alone(d_x(0, n), lambda i: d_x(i, i + 1), n, "d_x")


@GPU
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["tiny_latency", "rl_dqn_l1", "rl_small", "resnet_28", "resnet_56"])
def test_the_bench_shapes_give_each_sample_the_bits_it_gets_alone_on_the_gpu(shape, dtype):
    """scripts/bench_shapes.py's layers at their planned batch (tiny_latency's 1: at 33):
    evaluate with batch norm, and the training forward and d_x without a norm."""
    from bench_shapes import bench_spec

    for bn in (True, False):
        spec = bench_spec(shape, bn, dtype)
        spec = dataclasses.replace(spec, batch_size=max(spec.batch_size, 33), batch_invariant=True)
        layer = make_layer(spec, seed=5, backend="cuda")
        x, d_y = random_inputs(spec, seed=3)
        n = spec.batch_size
        if bn:
            assert_rows_as_alone(layer.evaluate(x), lambda i: layer.evaluate(x[i:i + 1]), n, f"{shape} evaluate")
            continue
        assert_rows_as_alone(layer.forward(x), lambda i: layer.forward(x[i:i + 1]), n, f"{shape} forward")
        d_x = input_gradients(layer, x, d_y, True)
        assert_rows_as_alone(d_x(0, n), lambda i: d_x(i, i + 1), n, f"{shape} d_x")


@GPU
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_invariant_layer_runs_one_cudnn_plan_at_every_batch_size(dtype):
    layer, x, d_y = invariant_layer("3x3s3", "none", dtype, "cuda")
    seen = []
    for n in (1, 7, 256):
        layer.forward(np.ascontiguousarray(x[:n]))
        layer.backward_input(np.ascontiguousarray(d_y[:n]))
        plans = layer.functions.conv_plans
        seen.append((plans["forward"], plans["backward_data"]))
    assert seen[0] == seen[1] == seen[2], seen


def test_batch_invariance_is_a_bool():
    with pytest.raises(ValueError, match="batch_invariant: expected a bool"):
        small_layer_spec(batch_invariant=1)


def test_batch_invariance_is_saved_and_loaded(tmp_path):
    spec = small_layer_spec(batch_invariant=True)
    conv2d.save(make_layer(spec), tmp_path / "layer.npz")
    assert conv2d.load(tmp_path / "layer.npz").spec.batch_invariant is True
    # a file written before the field existed loads as batch_invariant=False
    assert LayerSpec.from_dict({k: v for k, v in small_layer_spec().to_dict().items()
                                if k != "batch_invariant"}).batch_invariant is False


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_the_module_takes_batch_invariant(device):
    torch = pytest.importorskip("torch")
    from conv2d.torch import Conv2dNormActivation

    torch.manual_seed(0)
    m = Conv2dNormActivation(4, 8, 3, padding=1, norm="layer_norm", activation="gelu", dtype=torch.float32,
                             batch_invariant=True).eval().to(device)
    x = torch.randn(33, 4, 7, 6).contiguous(memory_format=torch.channels_last).to(device)
    with torch.no_grad():
        batched = m(x)
        for i in (0, 16, 32):
            alone = m(x[i:i + 1].contiguous(memory_format=torch.channels_last))
            assert torch.equal(batched[i], alone[0]), i


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["reference", pytest.param("cuda", marks=GPU)])
def test_the_breakout_actor_at_batch_one_gets_the_learners_q_values_bitwise(backend, dtype):
    from conv2d.demos import breakout
    from conv2d.dtypes import storage_dtype
    from conv2d.optim import Adam

    st = storage_dtype(dtype)
    q = breakout.q_network(3, 32, dtype, backend, batch_invariant=True)
    q.init_weights(np.random.default_rng(0))
    net = breakout._CallByCall(q, q, Adam(q), 32, 3, st)  # the demo's actor and learner: one network
    states = (np.random.default_rng(1).random((32, 10, 10, 4)) < 0.1).astype(st)  # MinAtar's 0/1 planes
    learner, _ = net.values(states, states)
    for i in range(32):
        assert net.act(states[i]).tobytes() == learner[i:i + 1].tobytes(), i
