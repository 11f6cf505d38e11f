"""The PyTorch module's eager calls replayed as CUDA graphs on a real GPU
(conv2d.torch.graphs), acting, conv2d check on the GPU, the module under torch.compile and
torch.export on the GPU."""

import copy
import gc

import pytest

from conftest import HAVE_GPU, NO_GPU_REASON
from cuda_testing import NORMS, _module_pair

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)

if HAVE_GPU:
    pass


# The module's eager calls replayed as CUDA graphs (conv2d.torch.graphs) ------------------------
def _graphed_and_launched(torch, norm, dtype, channels=5, **kw):
    """(a module with cuda_graphs, its copy without, the torch dtype): channels in, and
    6 out for the default 5 (a small layer), else as many as in."""
    from conv2d.torch import Conv2dNormActivation

    # Earlier tests' garbage collected now, not in the middle of these steps (a collection
    # that frees device tensors moves the blocks the steps get), and the cached blocks
    # given back: the steps find the allocator as a training process does at its start.
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    graphed = Conv2dNormActivation(channels, 6 if channels == 5 else channels, 3, padding=1, norm=norm,
                                   activation="gelu", device="cuda", cuda_graphs=True, **kw).to(tdt)
    launched = copy.deepcopy(graphed)
    launched.cuda_graphs = False
    return graphed, launched, tdt


def _steady_input(torch, tdt):
    """(x, d_y) of a layer of 16 channels in and out, (8, 16, 72, 72): every activation-sized
    tensor of a step (x, y, the saved values, d_x) is of one size above 1 MB, which torch's
    allocator serves from its large pool, apart from the step's small tensors (gradients,
    statistics), which in a small layer split the same blocks."""
    x = torch.randn(8, 16, 72, 72, device="cuda").to(tdt, memory_format=torch.channels_last)
    return x, torch.randn_like(x)


def _training_steps(torch, model, x, d_y, steps, twice=False):
    """Eager SGD steps (the parameters change in place between them), a fresh input copy
    each step: what each step gave, copied to the host. Each step lets go of its device
    tensors before the next, as a loop that keeps only a scalar loss (the backward frees
    the saved values): so every step gets the blocks of the one before, and the calls'
    keys repeat. (A loop that still holds the last step's input and output when it makes
    the next rotates them through more blocks than two steps use, and on the H200 a
    single call's keys did not repeat within ten steps.)"""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        xr = x.clone().requires_grad_(True)
        y = model(model(xr)) if twice else model(xr)
        y.backward(d_y)
        out.append([t.detach().cpu() for t in (y, xr.grad, *(p.grad for p in model.parameters()),
                                                *model.buffers())])
        opt.step()
        opt.zero_grad()
        del xr, y
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("norm", NORMS)
def test_eager_steps_replayed_as_cuda_graphs_give_the_launched_steps_bits(norm, dtype):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    graphed, launched, tdt = _graphed_and_launched(torch, norm, dtype, channels=16)
    x, d_y = _steady_input(torch, tdt)
    # Ten steps: a key is captured at its second call and replayed from its third on.
    got = _training_steps(torch, graphed, x, d_y, 10)
    want = _training_steps(torch, launched, x, d_y, 10)
    for step, (a, b) in enumerate(zip(got, want)):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), f"step {step}"
    counts = graphed.graph_counts()
    assert counts["replayed"] > 0 and counts["failed"] == 0, counts
    assert launched.graph_counts()["replayed"] == 0


def test_a_module_called_twice_before_its_backward_replays_each_call_with_its_own_saved_values():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    graphed, launched, tdt = _graphed_and_launched(torch, "batch_norm", "float32", channels=16)
    x, d_y = _steady_input(torch, tdt)
    got = _training_steps(torch, graphed, x, d_y, 10, twice=True)
    want = _training_steps(torch, launched, x, d_y, 10, twice=True)
    for step, (a, b) in enumerate(zip(got, want)):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), f"step {step}"
    assert graphed.graph_counts()["replayed"] > 0, graphed.graph_counts()


def test_acting_without_gradients_replays_the_evaluation_graph():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    graphed, launched, tdt = _graphed_and_launched(torch, "batch_norm", "bfloat16")
    x = torch.randn(1, 5, 12, 10, device="cuda").to(tdt, memory_format=torch.channels_last)

    def act(model):
        # One model acting, as an actor does: a new observation each step, the action
        # values taken to the host, nothing else on the device in between. (Two models
        # interleaved in one loop share the allocator's blocks of this size and cycle
        # through more address sets than 10 steps repeat.)
        model.eval()
        got = []
        with torch.no_grad():
            for step in range(10):
                obs = x + step
                got.append(model(obs).cpu())
                del obs
        return got
    for step, (a, b) in enumerate(zip(act(graphed), act(launched))):
        assert torch.equal(a, b), step
    assert graphed.graph_counts()["replayed"] >= 2, graphed.graph_counts()


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("norm", NORMS)
def test_acting_without_gradients_evaluates_into_one_new_tensor_as_the_eval_forward_does(norm, activation):
    """Under no_grad in eval the module runs the backend's evaluate: y is the one tensor a
    call allocates (the pre-activations and statistics stay in the plan's scratch), and
    it is the grad-enabled eval call's y within the tolerance (ReLU without a norm runs
    cuDNN's fused graph, another plan; otherwise the same kernels, bitwise)."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from conv2d.torch import Conv2dNormActivation

    torch.manual_seed(0)
    ours = Conv2dNormActivation(5, 6, 3, padding=1, norm=norm, activation=activation, device="cuda",
                                cuda_graphs=False).eval()
    x = torch.randn(2, 5, 12, 10, device="cuda").contiguous(memory_format=torch.channels_last)
    want = ours(x.requires_grad_(True)).detach()
    x = x.detach()
    with torch.no_grad():
        ours(x)  # plans the shape's evaluate
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        got = ours(x)
        after = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert after - before == 1
    if norm == "none" and activation == "relu":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)


def test_graphs_hold_the_plans_they_were_captured_with_when_the_backend_drops_them():
    """max_shapes=1: every call of the other input size drops the plan a graph was captured
    on; the graph keeps that plan's scratch and workspace, and every step keeps the bits."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    graphed, launched, tdt = _graphed_and_launched(torch, "batch_norm", "float32",
                                                   backend_options={"max_shapes": 1})
    for size in (12, 8, 12, 8, 12, 8):
        x = torch.randn(2, 5, size, size, device="cuda").to(memory_format=torch.channels_last)
        d_y = torch.randn(2, 6, size, size, device="cuda").to(memory_format=torch.channels_last)
        got = _training_steps(torch, graphed, x, d_y, 8)
        want = _training_steps(torch, launched, x, d_y, 8)
        for a, b in zip(got, want):
            assert all(torch.equal(u, v) for u, v in zip(a, b)), size
    assert graphed.graph_counts()["replayed"] > 0


def test_a_capture_of_the_callers_step_records_launches_not_the_modules_graphs():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    graphed, _, _ = _graphed_and_launched(torch, "batch_norm", "float32")
    x = torch.randn(4, 5, 12, 10, device="cuda").to(memory_format=torch.channels_last)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(8):  # warm-up: captures and replays the module's own graphs
            graphed(x).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    before = graphed.graph_counts()
    assert before["replayed"] > 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed(x).sum().backward()
    assert graphed.graph_counts() == before


def test_a_dropped_module_gives_its_backend_back_without_the_garbage_collector():
    """No reference cycle holds the backend: its device memory goes back when the module
    does, not at a later collection (which may fall inside a caller's graph capture, where
    a free invalidates it)."""
    import weakref

    torch = pytest.importorskip("torch", reason="torch is not installed")
    ours, _, _ = _module_pair(torch, "batch_norm", "float32")
    ours.cuda_graphs = True
    x = torch.randn(4, 5, 12, 10, device="cuda").to(memory_format=torch.channels_last)
    for _ in range(8):  # launches, captures, replays
        ours(x).sum().backward()
    assert ours.graph_counts()["captured"] > 0
    refs = [weakref.ref(entry[0]) for entry in ours._functions.values()]
    gc.collect()
    gc.disable()
    try:
        del ours
        assert refs and all(r() is None for r in refs)
    finally:
        gc.enable()


def test_torch_compile_of_the_module_on_the_gpu_matches_eager():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    ours, _, _ = _module_pair(torch, "layer_norm", "float32")
    x = torch.randn(2, 5, 8, 8, device="cuda").to(memory_format=torch.channels_last)
    torch.testing.assert_close(torch.compile(ours)(x), ours(x), rtol=0, atol=0)


def test_conv2d_check_passes_on_both_backends_with_bitwise_repeats_on_the_gpu(capsys):
    from conv2d.cli import main

    # Two specs (batch norm, layer norm): the whole set compiles every kernel variant again,
    # minutes, and test_cuda_kernels runs each golden file on the GPU already.
    assert main(["check", "--specs", "relu_bn_nonsquare,gelu_original_ln"]) == 0
    out = capsys.readouterr().out
    assert "| cuda |" in out and "| NO |" not in out and "bitwise repeats on cuda" in out.splitlines()[-1]


# The PyTorch module under torch.compile on the GPU (the PyTorch-integration issue) -------------
@pytest.mark.parametrize("mode, dynamic", [
    ("default", None), ("default", True), ("default", False), ("reduce-overhead", None)])
def test_the_compiled_module_on_the_gpu_takes_changing_batch_sizes_bitwise_as_eager(mode, dynamic):
    torch = pytest.importorskip("torch")
    from conv2d.torch import Conv2dNormActivation

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Conv2dNormActivation(5, 6, 3, padding=1, norm="batch_norm", activation="relu", device="cuda",
                                 cuda_graphs=False)
    compiled = copy.deepcopy(eager)
    run = torch.compile(compiled, mode=mode, dynamic=dynamic)
    for n in (32, 30, 1, 64, 32, 30):
        x = torch.randn(n, 5, 12, 12, device="cuda").contiguous(memory_format=torch.channels_last)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.compiler.cudagraph_mark_step_begin()  # a training step begins (PyTorch's advice for reduce-overhead)
        ye, yc = eager(xe), run(xc)
        assert torch.equal(yc, ye), n  # before the next replay may reuse yc's memory (reduce-overhead)
        ye.square().sum().backward()
        yc.square().sum().backward()
        assert torch.equal(xc.grad, xe.grad), n
        # Compared and dropped each step, as a training step does (zero_grad): under
        # reduce-overhead the gradients are CUDA graph outputs that the next replay
        # overwrites, so accumulating them across steps is refused (as for nn.Conv2d).
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
            assert torch.equal(b.grad, a.grad), (n, name)
        eager.zero_grad(), compiled.zero_grad()
    assert torch.equal(compiled.norm.running_var, eager.norm.running_var)


def test_the_ops_on_the_gpu_keep_no_tensor_of_their_calls():
    # CUDA graph trees (reduce-overhead) refuse a recording after which a tensor of their
    # pool lives on untracked: the ops' functions may keep none of a call's tensors.
    torch = pytest.importorskip("torch")
    import weakref

    from conv2d.torch import Conv2dNormActivation, ops

    m = Conv2dNormActivation(5, 6, 3, padding=1, norm="batch_norm", activation="relu", device="cuda")
    x = torch.randn(4, 5, 8, 8, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()
    running = [m.norm.running_mean.clone(), m.norm.running_var.clone()]  # as functionalisation passes them
    y = ops.Conv2dFunction.apply(
        x, m.conv.weight, m.conv.bias, m.norm.weight, m.norm.bias, *running, True, True, True,
        m._op_keys[(False, False)])
    y.sum().backward()
    made = [weakref.ref(t) for t in (x, y, x.grad, *running)]
    del x, y, running
    gc.collect()
    assert [r() is None for r in made] == [True] * len(made)


def test_a_double_backward_on_the_gpu_raises():
    torch = pytest.importorskip("torch")
    from conv2d.torch import Conv2dNormActivation

    m = Conv2dNormActivation(5, 6, 3, padding=1, norm="batch_norm", activation="tanh", device="cuda")
    x = torch.randn(4, 5, 8, 8, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()
    g, = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def test_an_exported_module_on_the_gpu_runs_after_the_module_is_gone():
    torch = pytest.importorskip("torch")
    from conv2d.torch import Conv2dNormActivation

    m = Conv2dNormActivation(5, 6, 3, padding=1, norm="batch_norm", activation="relu", device="cuda").eval()
    x = torch.randn(4, 5, 8, 8, device="cuda").contiguous(memory_format=torch.channels_last)
    want = m(x)
    ep = torch.export.export(m, (x,))
    del m
    gc.collect()
    assert torch.equal(ep.module()(x), want)
