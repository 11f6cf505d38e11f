"""The CUDA backend's fused cuDNN forward for 16-bit ReLU layers without a norm
(`forward_pre_relu`: the pre-activations and their ReLU written by one graph): which
layers ask for it, that the layer's steps give with it what they give without it, and
that a graph that fails at its first execute leaves the unfused steps. The orchestration
runs in numba's simulator with the reference standing in for cuDNN (CI); the real graph
runs on the GPU."""

import dataclasses

import numpy as np
import pytest

from conftest import HAVE_GPU, NO_GPU_REASON, make_layer, random_inputs, spec_for

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")

from conv2d.arrays import to_host  # noqa: E402
from conv2d.cuda import cudnn, cudnn_execution  # noqa: E402
from conv2d.dtypes import storage_dtype  # noqa: E402
from host_convolutions import HostConvolutions  # noqa: E402

on_gpu = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)


class FusedHostConvolutions(HostConvolutions):
    """The stand-in with forward_pre_relu: z and ReLU(z) from one call, counted."""

    pre_relu = True
    calls = 0

    def forward_pre_relu(self, x, w, b, z, y):
        type(self).calls += 1
        self.forward(x, w, b, z)
        self.forward(x, w, b, y, relu=True)
        return True


class RefusingHostConvolutions(HostConvolutions):
    """A stand-in whose fused graph is not available (no engine, or it failed once)."""

    pre_relu = True

    def forward_pre_relu(self, x, w, b, z, y):
        return False


def _outputs(layer, x, dy):
    """y, the saved pre-activations, d_x, the gradients and evaluate's y, as host copies."""
    st = storage_dtype(layer.spec.dtype)
    y = to_host(layer.forward(x), st).copy()
    pre = np.array(layer.pre_activations)
    dx = to_host(layer.backward_full(x, dy), st).copy()
    return [y, pre, dx, *layer.grad_dict().values(), to_host(layer.evaluate(x), st).copy()]


@pytest.mark.parametrize("activation, norm, dtype, kernels, wanted", [
    ("relu", "none", "bfloat16", "fast", True),
    ("relu", "none", "float16", "fast", True),
    ("relu", "none", "float32", "fast", False),  # float32's engine fails at execute (docs/cudnn_fusions_cuda.md)
    ("relu", "batch_norm", "bfloat16", "fast", False),
    ("gelu", "none", "bfloat16", "fast", False),
    ("relu", "none", "bfloat16", "simple", False),  # the simple set: one kernel a reference step
])
def test_only_16_bit_relu_layers_without_a_norm_ask_for_the_fused_forward(activation, norm, dtype, kernels, wanted):
    layer = make_layer(spec_for(activation, norm, dtype), backend="cuda", convolutions=HostConvolutions,
                       kernels=kernels)
    assert layer.functions.pre_relu_fusion is wanted


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_fused_forward_gives_bitwise_what_the_unfused_steps_give(dtype):
    """With the same convolution standing in for both, the fused call's z and y feed the
    same backward and evaluate: every output bitwise the unfused layer's; the forward and
    evaluate both go through the fused call (so evaluate's y is the forward's)."""
    spec = spec_for("relu", "none", dtype)
    x, dy = random_inputs(spec, seed=3)
    FusedHostConvolutions.calls = 0
    fused = _outputs(make_layer(spec, seed=2, backend="cuda", convolutions=FusedHostConvolutions), x, dy)
    assert FusedHostConvolutions.calls == 2
    unfused = _outputs(make_layer(spec, seed=2, backend="cuda", convolutions=HostConvolutions), x, dy)
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), i


def test_a_fused_forward_that_is_not_available_leaves_the_unfused_steps():
    spec = spec_for("relu", "none", "bfloat16")
    x, dy = random_inputs(spec, seed=3)
    got = _outputs(make_layer(spec, seed=2, backend="cuda", convolutions=RefusingHostConvolutions), x, dy)
    want = _outputs(make_layer(spec, seed=2, backend="cuda", convolutions=HostConvolutions), x, dy)
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), i


class _FailingExecution:
    """An Execution whose run fails as cuDNN's execute did for float32's fused engine."""

    runs = 0

    def set(self, role, ptr):
        pass

    def run(self):
        self.runs += 1
        raise cudnn.CudnnError("cuDNN forward_pre_relu: execute failed (CUDNN_STATUS_INTERNAL_ERROR)")


def test_a_fused_graph_that_fails_at_its_first_execute_is_not_run_again():
    """Convolutions.forward_pre_relu says False (the caller runs the unfused pair) and
    keeps cuDNN's message, and does not try the graph again."""
    convolutions = object.__new__(cudnn_execution.Convolutions)
    failing = _FailingExecution()
    convolutions._executions = {"forward_pre_relu": failing}
    convolutions.pre_relu, convolutions._pre_relu_ran, convolutions.pre_relu_failure = True, False, None
    arrays = [np.zeros(1, np.uint16) for _ in range(5)]
    assert convolutions.forward_pre_relu(*arrays) is False
    assert convolutions.pre_relu is False and "CUDNN_STATUS_INTERNAL_ERROR" in convolutions.pre_relu_failure
    assert convolutions.forward_pre_relu(*arrays) is False and failing.runs == 1


@on_gpu
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_fused_cudnn_forward_runs_repeats_bitwise_and_agrees_with_the_unfused_layer(dtype, bias):
    """On cuDNN: the layer's plans include forward_pre_relu, y is bitwise ReLU(z) and
    evaluate's y, a second step repeats every output bitwise, and every output is within
    the dtype's tolerance of the unfused layer's (kernels="simple": the plain forward
    graph, then the activation kernel)."""
    from conv2d.testing import assert_close, reduction_lengths

    spec = spec_for("relu", "none", dtype, bias=bias, batch_size=16, in_channels=16, out_channels=32)
    x, dy = random_inputs(spec, seed=3)
    layer = make_layer(spec, seed=2, backend="cuda")
    first = _outputs(layer, x, dy)
    assert "forward_pre_relu" in layer.functions.conv_plans
    y, pre = first[0], first[1]
    st = storage_dtype(spec.dtype)
    relu = np.maximum(pre.astype(np.float32), 0).astype(st)
    assert np.array_equal(y.view(np.uint16), relu.view(np.uint16))
    assert np.array_equal(first[-1].view(np.uint16), y.view(np.uint16))  # evaluate
    layer.zero_gradient()
    again = _outputs(layer, x, dy)
    for i, (a, b) in enumerate(zip(first, again)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), i
    unfused = _outputs(make_layer(spec, seed=2, backend="cuda", kernels="simple"), x, dy)
    lengths = reduction_lengths(spec)
    names = ["y", "pre", "d_x", *make_layer(spec, backend="reference").grad_dict(), "evaluate"]
    for name, a, b in zip(names, again, unfused):
        length = lengths.get(name, lengths["y"])
        assert_close(name, a.astype(np.float64), b.astype(np.float64), dtype, 2 * length)


@on_gpu
def test_a_batch_invariant_16_bit_relu_layer_keeps_its_bits_at_every_batch_size_with_the_fused_forward():
    spec = spec_for("relu", "none", "bfloat16", batch_invariant=True, batch_size=None)
    layer = make_layer(spec, seed=2, backend="cuda")
    x, _ = random_inputs(dataclasses.replace(spec, batch_size=8), seed=3)
    st = storage_dtype(spec.dtype)
    whole = to_host(layer.forward(x), st).copy()
    assert "forward_pre_relu" in layer.functions.conv_plans
    for first, n in ((0, 1), (3, 5)):
        part = to_host(layer.forward(np.ascontiguousarray(x[first:first + n])), st)
        assert np.array_equal(part.view(np.uint16), whole[first:first + n].view(np.uint16))
