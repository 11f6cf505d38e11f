"""conv2d.torch.Conv2dNormActivation on the CPU (the reference backend) against the PyTorch
Sequential it replaces, in float64: outputs, gradients, running statistics, state_dict,
gradcheck, dtypes and layouts, torch.compile, DistributedDataParallel over gloo."""

import gc
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra brings it)")

from conv2d.torch import Conv2dNormActivation, reference_sequential  # noqa: E402

NORMS = ["none", "batch_norm", "layer_norm"]
TORCH_ACTIVATIONS = ["identity", "relu", "tanh", "sigmoid", "gelu", "gelu_tanh", "silu", "relu6", "hardswish",
                     "leaky_relu", "elu"]


def module_and_sequential(norm="batch_norm", activation="relu", seed=0, **kw):
    torch.manual_seed(seed)
    options = dict(kernel_size=3, padding=1, stride=1, norm=norm, activation=activation, dtype=torch.float64)
    options.update(kw)
    module = perturbed(Conv2dNormActivation(3, 5, **options))
    return module, reference_sequential(module)


def perturbed(module):
    """`module` with every parameter moved (norm parameters away from their initial 1 and 0)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


def channels_last(shape, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype).to(memory_format=torch.channels_last)


def run(model, x, d_y):
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.backward(d_y)
    return y.detach(), x.grad, {k: p.grad for k, p in model.named_parameters()}


def assert_same_step(ours, theirs, x, d_y):
    """One forward and backward of each: y, d_x and every parameter gradient agree (float64)."""
    got, want = run(ours, x, d_y), run(theirs, x, d_y)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], rtol=1e-10, atol=1e-12, msg=k)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("activation", TORCH_ACTIVATIONS)
def test_the_module_matches_the_sequential_it_replaces(activation, norm, training):
    ours, theirs = module_and_sequential(norm, activation)
    ours.train(training)
    theirs.train(training)
    assert_same_step(ours, theirs, channels_last((4, 3, 7, 6)), channels_last((4, 5, 7, 6), seed=2))
    for k, v in theirs.state_dict().items():  # running statistics, PyTorch's unbiased rule
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=1e-12, atol=1e-14, msg=k)


@pytest.mark.parametrize("norm", NORMS)
def test_gradcheck_of_input_and_parameters(norm):
    module, _ = module_and_sequential(norm, "gelu", stride=2)
    x = channels_last((2, 3, 6, 5)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: module(x), (x,))
    # The parameters' gradients, through a functional call of the same module.
    from torch.func import functional_call

    names = [k for k, _ in module.named_parameters()]
    values = tuple(p.detach().clone().requires_grad_(True) for p in module.parameters())
    assert torch.autograd.gradcheck(lambda *v: functional_call(module, dict(zip(names, v)), (x.detach(),)), values)


def test_the_sequentials_state_dict_loads_as_it_is():
    ours, _ = module_and_sequential("batch_norm", "relu")
    _, theirs = module_and_sequential("batch_norm", "relu", seed=5)
    theirs.train()
    theirs(channels_last((3, 3, 5, 5)))  # running statistics and num_batches_tracked move
    ours.load_state_dict(theirs.state_dict())
    ours.eval()
    theirs.eval()
    x = channels_last((2, 3, 5, 5))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-14)
    assert int(ours.state_dict()["1.num_batches_tracked"]) == 1


def test_a_bias_free_module_matches_conv2d_without_bias():
    ours, theirs = module_and_sequential("batch_norm", "tanh", bias=False)
    assert "0.bias" not in ours.state_dict() and theirs[0].bias is None
    x, d_y = channels_last((2, 3, 5, 4)), channels_last((2, 5, 5, 4), seed=3)
    got, want = run(ours, x, d_y), run(theirs, x, d_y)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)


def test_an_input_in_another_memory_format_gives_the_same_result():
    module, _ = module_and_sequential("layer_norm", "relu")
    x = channels_last((2, 3, 6, 6))
    torch.testing.assert_close(module(x.contiguous()), module(x), rtol=0, atol=0)


@pytest.mark.parametrize("norm", NORMS)
def test_an_nhwc_module_gives_the_nchw_modules_results_bitwise_in_nhwc(norm):
    nchw, _ = module_and_sequential(norm, "gelu")
    nhwc = Conv2dNormActivation(3, 5, kernel_size=3, padding=1, norm=norm, activation="gelu", dtype=torch.float64,
                                layout="NHWC")
    nhwc.load_state_dict(nchw.state_dict())
    x, d_y = channels_last((2, 3, 6, 5)), channels_last((2, 5, 6, 5), seed=3)
    want = run(nchw, x, d_y)
    got = run(nhwc, x.permute(0, 2, 3, 1).contiguous(), d_y.permute(0, 2, 3, 1).contiguous())
    assert got[0].shape == (2, 6, 5, 5) and got[0].is_contiguous()
    torch.testing.assert_close(got[0], want[0].permute(0, 2, 3, 1), rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1].permute(0, 2, 3, 1), rtol=0, atol=0)
    for k, g in want[2].items():
        torch.testing.assert_close(got[2][k], g, rtol=0, atol=0, msg=k)
    torch.testing.assert_close(nhwc.state_dict(), nchw.state_dict(), rtol=0, atol=0)


def test_a_reference_cpu_call_leaves_numpys_blas_at_one_thread_beside_torchs():
    """Two thread pools on the same cores slow each other (conv2d.torch.calls.one_blas_thread):
    the module's first CPU call on the reference sets NumPy's BLAS to one thread for the process."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from conv2d.torch import calls

    calls.one_blas_thread.cache_clear()
    with threadpool_limits(limits=2, user_api="blas"):
        module = Conv2dNormActivation(3, 4, 3, padding=1, norm="batch_norm", cpu_backend="reference")
        module(torch.randn(2, 3, 5, 5))
        assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {1}


@pytest.mark.parametrize("threads", [1, 2])
def test_a_cpu_backend_call_runs_as_many_threads_as_torch(threads):
    """The cpu backend's tasks run on torch.get_num_threads() threads, read at each call,
    with BLAS at one thread inside each (conv2d.cpu.threads)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with threadpool_limits(limits=3, user_api="blas"):
            from conv2d.cpu import threads as pool

            pool._BLAS_SET[0] = None  # threadpool_limits changed BLAS behind its back
            module = Conv2dNormActivation(3, 4, 3, padding=1, norm="batch_norm")
            module(torch.randn(2, 3, 5, 5))
            assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {1}
            assert pool.count() == threads
    finally:
        torch.set_num_threads(before)


def test_a_cpu_backend_that_runs_no_cpu_tensors_is_refused():
    with pytest.raises(ValueError, match=r"cpu_backend: expected one of \['reference', 'cpu'\].*got 'cuda'"):
        Conv2dNormActivation(3, 4, 3, cpu_backend="cuda")


@pytest.mark.parametrize("norm", ["none", "batch_norm", "layer_norm"])
def test_the_cpu_and_reference_backends_give_the_same_module_results(norm):
    """cpu_backend="reference" runs the oracle under the same module: the two agree in
    float64 to rounding (outputs, every gradient, the running statistics)."""
    results = []
    for name in ("cpu", "reference"):
        torch.manual_seed(0)
        module = Conv2dNormActivation(3, 4, 3, padding=1, norm=norm, activation="silu", dtype=torch.float64,
                                      cpu_backend=name)
        x = torch.randn(2, 3, 6, 5, dtype=torch.float64, requires_grad=True)
        y = module(x)
        y.backward(torch.randn_like(y, generator=torch.Generator().manual_seed(1)))
        results.append([y, x.grad, *(p.grad for p in module.parameters()), *module.buffers()])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_cuda_graphs_other_than_a_bool_is_refused():
    with pytest.raises(TypeError, match="cuda_graphs: expected a bool, got 'yes'"):
        Conv2dNormActivation(3, 5, cuda_graphs="yes")


def test_cuda_graphs_are_on_by_default_and_change_nothing_on_the_cpu():
    launched, _ = module_and_sequential("batch_norm", "relu", cuda_graphs=False)
    graphed, _ = module_and_sequential("batch_norm", "relu")
    assert graphed.cuda_graphs is True
    x, d_y = channels_last((4, 3, 7, 6)), channels_last((4, 5, 7, 6), seed=2)
    for _ in range(3):
        got, want = run(graphed, x, d_y), run(launched, x, d_y)
        assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))
    assert graphed.graph_counts() == {"eager": 0, "captured": 0, "replayed": 0, "failed": 0}


def test_a_layout_other_than_nchw_or_nhwc_is_refused():
    with pytest.raises(ValueError, match="^layout: expected 'NCHW' or 'NHWC', got 'CHWN'"):
        Conv2dNormActivation(3, 5, layout="CHWN")
    module = Conv2dNormActivation(3, 5, layout="NHWC", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^x: expected a 4-D \(N, H, W, C\) tensor"):
        module(torch.zeros(4, 4, 3, dtype=torch.float64))


def test_the_biased_rule_keeps_the_original_librarys_running_variance():
    biased, _ = module_and_sequential("batch_norm", "relu", running_var="biased", momentum=1.0)
    x = channels_last((3, 3, 4, 4))
    biased.train()
    with torch.no_grad():
        z = torch.nn.functional.conv2d(x, biased.conv.weight, biased.conv.bias, padding=1)
        biased(x)
    torch.testing.assert_close(biased.norm.running_var, z.var(dim=(0, 2, 3), unbiased=False), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_a_lower_precision_keeps_norm_parameters_in_float32_and_stays_close(dtype):
    module, _ = module_and_sequential("batch_norm", "gelu")
    x = channels_last((2, 3, 6, 6))
    want = module.eval()(x)
    low = module.to(dtype)
    assert low.conv.weight.dtype == dtype and low.norm.weight.dtype == torch.float32
    assert low.norm.running_var.dtype == torch.float32
    got = low(x.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=0.05 if dtype == torch.bfloat16 else 1e-5,
                               atol=0.05 if dtype == torch.bfloat16 else 1e-5)


def test_a_parameter_changed_in_place_before_backward_raises():
    module, _ = module_and_sequential("none", "tanh")
    x = channels_last((2, 3, 4, 4)).requires_grad_(True)
    y = module(x)
    with torch.no_grad():
        module.conv.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("norm", NORMS)
def test_an_eager_step_is_one_autograd_node(norm):
    module, _ = module_and_sequential(norm, "gelu")
    y = module(channels_last((2, 3, 5, 4)).requires_grad_(True))
    node = y.grad_fn.next_functions[0][0]  # y is the node's NHWC output, permuted to NCHW
    assert type(node).__name__ == "EagerConv2dBackward"
    assert all(type(f).__name__ in ("AccumulateGrad", "NoneType") for f, _ in node.next_functions)


@pytest.mark.parametrize("norm", NORMS)
def test_a_weight_in_another_memory_format_gives_the_same_values_and_gradients_bitwise(norm):
    # Its channels_last copy is what the node reads; the gradient comes back to the
    # parameter through that copy, in the parameter's own memory format.
    module, _ = module_and_sequential(norm, "gelu")
    other, _ = module_and_sequential(norm, "gelu")
    with torch.no_grad():
        other.conv.weight.data = other.conv.weight.contiguous()  # NCHW memory
    x, d_y = channels_last((2, 3, 5, 4)), channels_last((2, 5, 5, 4), seed=2)
    got, want = run(other, x, d_y), run(module, x, d_y)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for k in want[2]:
        assert torch.equal(got[2][k], want[2][k]), k
    assert other.conv.weight.grad.is_contiguous()
    assert other.conv.weight.is_contiguous()  # the parameter is read, never rewritten in place


def test_a_parameter_given_new_memory_is_read_from_there_on_the_next_call():
    module, theirs = module_and_sequential("batch_norm", "relu")
    x = channels_last((2, 3, 4, 4))
    module(x)
    theirs(x)
    new = torch.randn_like(module.conv.weight).contiguous(memory_format=torch.channels_last)
    module.conv.weight.data = new  # the same Parameter over new memory
    theirs[0].weight.data = new.clone()
    module.norm.running_mean = torch.full_like(module.norm.running_mean, 0.5)  # a new buffer object
    theirs[1].running_mean = torch.full_like(theirs[1].running_mean, 0.5)
    torch.testing.assert_close(module(x), theirs(x), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(module.norm.running_mean, theirs[1].running_mean, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("where", ["conv weight", "norm weight"])
def test_a_parametrized_parameter_is_read_through_its_parametrization_and_trains_as_in_pytorch(where):
    """torch.nn.utils.parametrize moves the parameter out of the module's own dict (weight
    norm: "parametrizations.weight.original0/1"): the module reads the computed weight."""
    from torch.nn.utils.parametrizations import weight_norm

    module, theirs = module_and_sequential("batch_norm", "relu")
    owner, their_owner = (module.conv, theirs[0]) if where == "conv weight" else (module.norm, theirs[1])
    for m in (owner, their_owner):
        weight_norm(m, "weight", dim=0)
        with torch.no_grad():
            m.parametrizations.weight.original0.mul_(1.5)  # a weight that differs from the one the module had
    assert_same_step(module, theirs, channels_last((2, 3, 4, 4)), channels_last((2, 5, 4, 4), seed=2))


def test_backward_twice_through_a_retained_graph_gives_twice_the_gradients():
    module, _ = module_and_sequential("batch_norm", "tanh")
    x = channels_last((2, 3, 4, 4)).requires_grad_(True)
    y = module(x)
    y.sum().backward(retain_graph=True)
    once = x.grad.clone(), module.conv.weight.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * once[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(module.conv.weight.grad, 2 * once[1], rtol=1e-12, atol=0)


def _saved_by(module, x):
    """(y, weak references to what the module's node saved for its backward)."""
    import weakref

    refs = []

    def pack(t):
        refs.append(weakref.ref(t))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    return y, refs


@pytest.mark.parametrize("norm", NORMS)
def test_backward_frees_the_saved_activations_while_the_output_lives_as_pytorchs_layers_do(norm):
    module, _ = module_and_sequential(norm, "gelu")
    x = channels_last((2, 3, 4, 4)).requires_grad_(True)
    y, refs = _saved_by(module, x)
    inputs = {id(t) for t in (x, *module.parameters())}
    activations = [r for r in refs if r() is not None and id(r()) not in inputs]
    assert activations, "the node saved none of its forward's values"
    y.backward(torch.ones_like(y))
    gc.collect()
    assert [r() for r in activations if r() is not None] == []


def test_saved_tensor_hooks_replace_every_saved_value_and_the_gradients_stay_the_same():
    module, _ = module_and_sequential("batch_norm", "gelu")
    x, d_y = channels_last((2, 3, 4, 4)), channels_last((2, 5, 4, 4), seed=2)
    want = run(module, x, d_y)
    module.zero_grad()
    packed = []

    def pack(t):  # what an offloading hook does: another tensor, elsewhere in memory
        packed.append(t.shape)
        return t.clone()
    xr = x.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(xr)
    y.backward(d_y)
    assert len(packed) >= 5  # x, the weight, gamma, beta, and the forward's own values
    assert torch.equal(xr.grad, want[1])
    for k, p in module.named_parameters():
        assert torch.equal(p.grad, want[2][k]), k


def test_a_second_derivative_is_refused_not_returned_as_zero():
    module, _ = module_and_sequential("none", "tanh")
    x = channels_last((2, 3, 4, 4)).requires_grad_(True)
    y = module(x)
    v = torch.ones_like(y).requires_grad_(True)  # a d_y with a graph of its own: d_x would depend on it
    (d_x,) = torch.autograd.grad(y, x, v, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        d_x.sum().backward()


@pytest.mark.parametrize("norm", NORMS)
def test_a_step_keeps_no_part_of_its_autograd_graph_alive(norm):
    from conftest import autograd_history_kept

    module, _ = module_and_sequential(norm, "relu")
    assert autograd_history_kept(module, channels_last((2, 3, 4, 4)).requires_grad_(True)) == []


def test_bad_inputs_name_x():
    module, _ = module_and_sequential("none", "relu")
    with pytest.raises(ValueError, match="^x: expected a 4-D"):
        module(torch.zeros(3, 3, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="^x: expected a torch.float64 tensor"):
        module(torch.zeros(1, 3, 4, 4, dtype=torch.float32))


@pytest.mark.parametrize("norm", NORMS)
def test_torch_compile_sees_one_opaque_op_and_matches_eager_with_gradients(norm):
    compiled_module, _ = module_and_sequential(norm, "relu")
    eager_module, _ = module_and_sequential(norm, "relu")
    x = channels_last((2, 3, 5, 5))
    assert torch._dynamo.explain(compiled_module.eval())(x).graph_break_count == 0  # eval: the stats stay
    compiled_module.train()
    compiled = torch.compile(compiled_module, backend="aot_eager")  # no C++ toolchain needed on CI
    d_y = channels_last((2, 5, 5, 5), seed=4)
    got, want = run(compiled, x, d_y), run(eager_module, x, d_y)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for k, p in compiled_module.named_parameters():
        torch.testing.assert_close(p.grad, want[2][k], rtol=0, atol=0, msg=k)
    for k, v in eager_module.state_dict().items():
        torch.testing.assert_close(compiled_module.state_dict()[k], v, rtol=0, atol=0, msg=k)


def _ddp_worker(rank, world, path, port):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        module, _ = module_and_sequential("none", "gelu")
        ddp = torch.nn.parallel.DistributedDataParallel(module)
        x = channels_last((4, 3, 5, 5))
        d_y = channels_last((4, 5, 5, 5), seed=2)
        part = slice(2 * rank, 2 * rank + 2)
        # d_y scaled by the world size: DDP averages the ranks' gradients
        ddp(x[part].contiguous(memory_format=torch.channels_last)).backward(d_y[part] * world)
        if rank == 0:
            torch.save({k: p.grad for k, p in module.named_parameters()}, path)
        del ddp  # its reducer holds the group: let go of it while both ranks are alive
        gc.collect()
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()
    # The work is done and written. Interpreter finalization, which destroys what torch's C++
    # side still holds while its threads may run, aborted one CI run here (SIGABRT, "terminate
    # called without an active exception", rank 1); a worker that leaves without it cannot.
    os._exit(0)


def test_distributed_data_parallel_over_gloo_equals_one_process_on_the_whole_batch(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "grads.pt"
    mp.spawn(_ddp_worker, args=(2, str(path), port), nprocs=2, join=True)
    got = torch.load(path)
    module, _ = module_and_sequential("none", "gelu")
    _, _, want = run(module, channels_last((4, 3, 5, 5)), channels_last((4, 5, 5, 5), seed=2))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


@pytest.mark.parametrize("channels, options", [
    ((4, 6), dict(groups=2)), ((4, 8), dict(groups=4)),  # grouped, and depthwise with a channel multiplier 2
    ((3, 5), dict(dilation=2)), ((4, 6), dict(dilation=(1, 2), groups=2, stride=2))],
    ids=["groups2", "depthwise", "dilation2", "dilation_groups_stride"])
@pytest.mark.parametrize("norm", NORMS)
def test_groups_and_dilation_match_pytorchs_conv(channels, options, norm):
    torch.manual_seed(0)
    ours = perturbed(Conv2dNormActivation(*channels, 3, padding=1, norm=norm, activation="gelu",
                                          dtype=torch.float64, **options))
    theirs = reference_sequential(ours)
    assert theirs[0].groups == ours._spec.groups and ours.conv.weight.shape == theirs[0].weight.shape
    x = channels_last((3, channels[0], 9, 8))
    assert_same_step(ours, theirs, x, channels_last(tuple(theirs(x).shape), seed=2))


@pytest.mark.parametrize("kernel, options", [
    (4, dict(padding="same")), (3, dict(padding="same", dilation=2)), (3, dict(padding="valid")),
    (3, dict(padding=1, padding_mode="reflect")), (3, dict(padding=(2, 1), padding_mode="replicate")),
    (4, dict(padding="same", padding_mode="circular"))],
    ids=["same_even", "same_dilated", "valid", "reflect", "replicate_pair", "same_circular"])
@pytest.mark.parametrize("norm", NORMS)
def test_padding_strings_and_modes_match_pytorchs_conv(kernel, options, norm):
    torch.manual_seed(0)
    ours = perturbed(Conv2dNormActivation(3, 5, kernel, norm=norm, activation="tanh", dtype=torch.float64,
                                          **options))
    theirs = reference_sequential(ours)
    x = channels_last((3, 3, 9, 8))
    assert_same_step(ours, theirs, x, channels_last(tuple(theirs(x).shape), seed=2))


@pytest.mark.parametrize("norm, options", [
    ("batch_norm", dict(affine=False)), ("batch_norm", dict(track_running_stats=False)),
    ("batch_norm", dict(affine=False, track_running_stats=False)), ("layer_norm", dict(affine=False))])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_norm_options_match_pytorchs_norms(norm, options, training):
    torch.manual_seed(0)
    ours = Conv2dNormActivation(3, 5, 3, padding=1, norm=norm, activation="gelu", dtype=torch.float64, **options)
    theirs = reference_sequential(ours)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ours.train(training), theirs.train(training)
    assert_same_step(ours, theirs, channels_last((4, 3, 7, 6)), channels_last((4, 5, 7, 6), seed=2))
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, msg=k)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_call_that_wants_no_gradient_builds_no_autograd_node_and_gives_the_same_bits(monkeypatch, train):
    # Acting and target computations: under no_grad the module runs the backend's forward
    # without its autograd Function: the same y, the same running statistics.
    import copy

    from conv2d.torch import eager

    with_grad, _ = module_and_sequential(norm="batch_norm", activation="relu")
    with_grad.train(train)
    without = copy.deepcopy(with_grad)
    x = channels_last((4, 3, 8, 8))
    want = with_grad(x).detach()

    def refuse(*args):
        raise AssertionError("an autograd node was built for a call that wants no gradient")
    monkeypatch.setattr(eager.EagerConv2d, "apply", refuse)
    with torch.no_grad():
        got = without(x)
    assert torch.equal(got, want)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(without.norm, name), getattr(with_grad.norm, name)), name
