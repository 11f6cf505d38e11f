"""The PyTorch module without surprises: every nn.Conv2d/BatchNorm2d argument honoured or
refused, no second derivative returned silently, torch.compile over changing batch sizes,
torch.export, TorchScript and vmap refused with a message, errors in the caller's layout,
gradients with their parameters' strides, SyncBatchNorm refused loudly, and a whole
model swapped in one call (CPU, float64, against PyTorch's own modules)."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the test extra brings it)")
from torch import nn  # noqa: E402

from conftest import make_layer, random_inputs  # noqa: E402
from conv2d import Conv2d, LayerSpec  # noqa: E402
from conv2d.torch import Conv2dNormActivation, reference_sequential, swap, unswap  # noqa: E402

F64 = torch.float64


def nchw(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=F64, generator=g).contiguous(memory_format=torch.channels_last)


def module(norm="batch_norm", activation="tanh", **kw):
    torch.manual_seed(0)
    return Conv2dNormActivation(3, 4, 3, padding=1, norm=norm, activation=activation, dtype=F64, **kw)


# 1. Every argument honoured or refused ----------------------------------------------------------
@pytest.mark.parametrize("set_later", [False, True], ids=["constructed", "set_later"])
def test_momentum_none_keeps_pytorchs_cumulative_average(set_later):
    ours = module("batch_norm", momentum=0.1 if set_later else None)
    theirs = reference_sequential(ours)
    if set_later:
        ours.norm.momentum = theirs[1].momentum = None
    assert theirs[1].momentum is None and "momentum=None" in repr(ours)
    for step in range(4):
        x = nchw(2 + step, 3, 5, 5, seed=step)
        torch.testing.assert_close(ours(x), theirs(x))
        for k, v in theirs.state_dict().items():
            torch.testing.assert_close(ours.state_dict()[k], v, msg=k)
    assert int(ours.norm.num_batches_tracked) == 4 and sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ours.eval(), theirs.eval()
    torch.testing.assert_close(ours(x), theirs(x))


def test_momentum_none_under_torch_compile_keeps_the_cumulative_average():
    ours = module("batch_norm", momentum=None)
    theirs = reference_sequential(ours)
    compiled = torch.compile(ours, backend="aot_eager")  # no C++ toolchain needed on CI
    for step in range(3):
        x = nchw(2 + step, 3, 5, 5, seed=step)
        torch.testing.assert_close(compiled(x), theirs(x))
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, msg=k)


@pytest.mark.parametrize("option", [dict(groups=1), dict(dilation=1), dict(dilation=(1, 1)),
                                    dict(padding_mode="zeros"), dict(affine=True), dict(track_running_stats=True)])
def test_pytorchs_defaults_of_those_options_are_accepted(option):
    Conv2dNormActivation(3, 3, 3, **option)


def test_an_unknown_keyword_is_a_type_error_as_in_pytorch():
    with pytest.raises(TypeError, match="unexpected keyword argument 'kernal_size'"):
        Conv2dNormActivation(3, 3, kernal_size=3)


def test_backend_options_are_checked_against_the_backends_options():
    with pytest.raises(TypeError, match=r"backend_options: the cuda backend takes .*unknown \['allow_tf33'\]"):
        Conv2dNormActivation(3, 3, 3, backend_options={"allow_tf33": True})
    with pytest.raises(TypeError, match="backend_options: expected a dict"):
        Conv2dNormActivation(3, 3, 3, backend_options=["allow_tf32"])
    assert Conv2dNormActivation(3, 3, 3, backend_options={"allow_tf32": True}).backend_options == {"allow_tf32": True}


def test_the_declared_backend_options_are_the_cuda_functions_keywords():
    import inspect

    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")
    from conv2d import backend
    from conv2d.cuda.functional import Functions

    params = list(inspect.signature(Functions.__init__).parameters)[2:]  # self, spec
    assert tuple(params) == backend.get("cuda").options


# 2. Double backward raises ----------------------------------------------------------------------
@pytest.mark.parametrize("compiled_ops", [False, True])
def test_a_double_backward_raises_pytorchs_once_differentiable_error(compiled_ops, monkeypatch):
    m = module()
    if compiled_ops:  # the registered ops' path, as torch.compile and tensor subclasses take it
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = nchw(2, 3, 5, 5).requires_grad_()
    g, = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    assert g.grad_fn is not None
    with pytest.raises(RuntimeError, match="trying to differentiate twice a function that was marked with "
                                           "@once_differentiable"):
        g.sum().backward()


def test_gradgradcheck_fails_with_the_error_not_a_jacobian_mismatch():
    m = module()
    x = nchw(2, 3, 5, 5).requires_grad_()
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.gradgradcheck(lambda t: m(t), (x,))


def test_first_order_gradients_are_unchanged_when_a_graph_is_asked_for():
    m = module()
    x = nchw(2, 3, 5, 5).requires_grad_()
    plain, = torch.autograd.grad(m(x).sum(), x)
    graphed, = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    torch.testing.assert_close(graphed.detach(), plain, rtol=0, atol=0)


# 3. The NumPy-level Conv2d does not cut a gradient path silently --------------------------------
@pytest.mark.parametrize("call", ["forward", "evaluate"])
def test_the_numpy_layer_refuses_a_tensor_that_requires_grad(call):
    spec = LayerSpec(batch_size=2, in_height=5, in_width=5, in_channels=3, out_channels=4, kernel=3,
                     dtype="float64")
    layer = make_layer(spec)
    x = torch.from_numpy(random_inputs(spec)[0]).requires_grad_()
    with pytest.raises(TypeError, match="a torch tensor that requires grad; .*conv2d.torch.Conv2dNormActivation"):
        getattr(layer, call)(x)
    getattr(layer, call)(x.detach())


# 4. torch.compile with changing batch sizes ------------------------------------------------------
@pytest.mark.parametrize("dynamic", [None, True, False])
def test_a_compiled_module_takes_changing_batch_sizes_with_eager_values_and_gradients(dynamic):
    torch._dynamo.reset()
    eager_m = module()
    compiled_m = copy.deepcopy(eager_m)
    run = torch.compile(compiled_m, dynamic=dynamic, backend="aot_eager")  # dynamo and AOT autograd's fake
    # tensors (where symbolic sizes met the ops), with no C++ toolchain needed on CI
    for n in (32, 30, 1, 64):
        x = nchw(n, 3, 6, 6, seed=n)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager_m(xe), run(xc)
        torch.testing.assert_close(yc, ye, rtol=0, atol=0)
        ye.square().sum().backward()
        yc.square().sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad, rtol=0, atol=0)
    for (name, a), (_, b) in zip(eager_m.named_parameters(), compiled_m.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(compiled_m.norm.running_mean, eager_m.norm.running_mean, rtol=0, atol=0)


# 5. torch.export runs in the process, whatever became of the module ----------------------------
def test_an_exported_program_runs_after_the_module_is_gone():
    import gc

    m = module().eval()
    x = nchw(2, 3, 6, 6)
    want = m(x)
    ep = torch.export.export(m, (x,))
    del m
    gc.collect()
    torch.testing.assert_close(ep.module()(x), want, rtol=0, atol=0)


def test_the_compiled_forward_has_no_graph_break():
    m = module().eval()
    assert torch._dynamo.explain(m)(nchw(2, 3, 6, 6)).graph_break_count == 0
    m.train()
    torch._dynamo.reset()
    assert torch._dynamo.explain(m)(nchw(2, 3, 6, 6)).graph_break_count == 0


def test_the_ops_make_their_functions_from_the_key_alone():
    from conv2d.torch import ops

    m = module()
    key = m._op_keys[(False, False)]
    ops._FUNCTIONS.pop(key, None)
    made = ops.functions(key)
    assert made.spec == m.spec and made is ops.functions(key)


@pytest.mark.parametrize("how", ["trace", "script"])
def test_torchscript_is_refused_naming_compile_and_export(how):
    m = module()
    with pytest.raises(TypeError, match=f"torch.jit.{how}: .*torch.compile, or torch.export"):
        torch.jit.trace(m, (nchw(1, 3, 5, 5),)) if how == "trace" else torch.jit.script(m)


# 6. vmap refused with a message -----------------------------------------------------------------
def test_vmap_is_refused_with_a_message():
    with pytest.raises(NotImplementedError, match="torch.func.vmap: .*call it on the stacked inputs"):
        torch.func.vmap(module())(torch.randn(2, 2, 3, 5, 5, dtype=F64))


# 8. Errors in the caller's layout and type --------------------------------------------------------
@pytest.mark.parametrize("layout, shape, want", [("NCHW", (2, 4, 5, 5), r"expected a NCHW tensor of shape \(N, 3, H, W\)"),
                                                 ("NHWC", (2, 5, 5, 4), r"expected a NHWC tensor of shape \(N, H, W, 3\)")])
def test_a_wrong_channel_count_is_named_in_the_modules_layout(layout, shape, want):
    m = module(layout=layout)
    with pytest.raises(ValueError, match=want + r" \(3 input channels\), got a Tensor of shape " + str(shape)
                       .replace("(", r"\(").replace(")", r"\)")):
        m(torch.zeros(shape, dtype=F64))


# 9. Gradients with the parameter's strides; SyncBatchNorm ----------------------------------------
@pytest.mark.parametrize("in_channels, kernel", [(1, 3), (3, 1), (1, 1), (3, 3)])
def test_the_weight_gradient_has_the_weights_strides(in_channels, kernel):
    m = Conv2dNormActivation(in_channels, 4, kernel, dtype=F64)
    m(nchw(2, in_channels, 5, 5)).sum().backward()
    assert m.conv.weight.grad.stride() == m.conv.weight.stride()
    ref = reference_sequential(m)
    ref(nchw(2, in_channels, 5, 5)).sum().backward()
    torch.testing.assert_close(m.conv.weight.grad, ref[0].weight.grad)


def test_convert_sync_batchnorm_is_refused_loudly_at_the_first_call():
    m = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(module()))
    assert isinstance(m[0].norm, nn.SyncBatchNorm)
    with pytest.raises(NotImplementedError, match="SyncBatchNorm.convert_sync_batchnorm replaced"):
        m(nchw(2, 3, 5, 5))


def test_the_batch_norms_own_train_flag_and_momentum_are_followed_as_batchnorm2ds():
    m = module()
    ref = reference_sequential(m)
    for net in (m, ref):
        for child in net.modules():
            if isinstance(child, nn.BatchNorm2d):
                child.eval()  # the "freeze batch norm" idiom
                child.momentum = 0.5
    x = nchw(4, 3, 5, 5)
    torch.testing.assert_close(m(x), ref(x))
    for child in (m, ref):
        child.train()
    for _ in range(2):
        torch.testing.assert_close(m(x), ref(x))
    torch.testing.assert_close(m.norm.running_mean, ref[1].running_mean)


# 10. swap and unswap -----------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.GroupNorm(1, 8), nn.GELU()),
                         nn.Conv2d(8, 8, 1), nn.Tanh(), nn.Conv2d(8, 4, 1, groups=2), nn.SiLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 10)).double()


def test_swap_converts_every_run_and_computes_what_the_model_did():
    model = _model()
    x = nchw(4, 3, 6, 6)
    model.train()
    model(x)
    model.eval()
    want = model(x)
    swapped = swap(copy.deepcopy(model))
    kinds = [type(m).__name__ for m in swapped.modules()]
    assert kinds.count("Conv2dNormActivation") == 4 and kinds.count("Conv2d") == 0  # groups=2 too, on the CPU
    torch.testing.assert_close(swapped(x), want)
    model.train()
    swapped.train()
    torch.testing.assert_close(swapped(x), model(x))


@pytest.mark.parametrize("activation", [nn.SiLU(), nn.ReLU6(), nn.Hardswish(), nn.LeakyReLU(0.2), nn.ELU(0.7)],
                         ids=lambda m: repr(m))
def test_swap_converts_the_newer_activations_and_unswap_restores_them(activation):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), activation).double().eval()
    x = nchw(4, 3, 6, 6) * 4  # past hardswish's and relu6's ends
    swapped = swap(copy.deepcopy(model))
    assert [type(m).__name__ for m in swapped.modules()].count("Conv2dNormActivation") == 1
    torch.testing.assert_close(swapped(x), model(x))
    assert repr(unswap(swapped)[2]) == repr(activation)  # its parameter included


def test_swap_converts_a_depthwise_separable_block():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(4, 8, 3, padding="same", groups=4, bias=False, padding_mode="reflect"),
                          nn.BatchNorm2d(8), nn.ReLU6(), nn.Conv2d(8, 6, 1), nn.BatchNorm2d(6), nn.Hardswish()
                          ).double().eval()
    x = nchw(2, 4, 7, 7)
    swapped = swap(copy.deepcopy(block))
    assert [type(m).__name__ for m in swapped.modules()].count("Conv2dNormActivation") == 2
    torch.testing.assert_close(swapped(x), block(x))
    restored = unswap(swapped)
    assert restored[0].groups == 4 and restored[0].padding == "same" and restored[0].padding_mode == "reflect"


@pytest.mark.parametrize("norm", [nn.BatchNorm2d(8, affine=False), nn.BatchNorm2d(8, track_running_stats=False),
                                  nn.BatchNorm2d(8, momentum=None), nn.GroupNorm(1, 8, affine=False)], ids=repr)
def test_swap_converts_norms_without_affine_parameters_or_running_statistics(norm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm, nn.ReLU()).double()
    x = nchw(4, 3, 6, 6)
    swapped = swap(copy.deepcopy(model))
    assert [type(m).__name__ for m in swapped] == ["Conv2dNormActivation", "Identity", "Identity"]
    assert sorted(swapped.state_dict()) == sorted(model.state_dict())
    for training in (True, False):
        model.train(training), swapped.train(training)
        torch.testing.assert_close(swapped(x), model(x))


def test_swap_converts_a_cumulative_batch_norm():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU()).double()
    swapped = swap(copy.deepcopy(model))
    assert [type(m).__name__ for m in swapped] == ["Conv2dNormActivation", "Identity", "Identity"]
    for seed in range(3):
        x = nchw(4, 3, 6, 6, seed=seed)
        torch.testing.assert_close(swapped(x), model(x))
    torch.testing.assert_close(swapped.state_dict()["1.running_var"], model.state_dict()["1.running_var"])


def test_checkpoints_load_either_way_between_a_model_and_its_swap():
    model = _model()
    swapped = swap(copy.deepcopy(model))
    assert sorted(swapped.state_dict()) == sorted(model.state_dict())
    other = _model()
    for p in other.parameters():
        p.data.add_(1)
    swapped.load_state_dict(other.state_dict())
    model.load_state_dict(swapped.state_dict())
    for k, v in other.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, msg=k)


def test_unswap_gives_back_pytorchs_modules_with_the_trained_values():
    model = swap(_model())
    x = nchw(4, 3, 6, 6)
    model(x).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)
    model.eval()
    want = model(x)
    state = model.state_dict()
    unswap(model)
    assert not any(isinstance(m, Conv2dNormActivation) for m in model.modules())
    assert sorted(model.state_dict()) == sorted(state)
    torch.testing.assert_close(model(x), want)


def test_the_numpy_layer_still_takes_a_detached_tensor():
    spec = LayerSpec(batch_size=2, in_height=5, in_width=5, in_channels=3, out_channels=4, kernel=3, dtype="float64")
    layer = Conv2d(spec)
    y = layer.evaluate(torch.zeros(2, 5, 5, 3, dtype=F64))
    assert isinstance(y, torch.Tensor) and np.isfinite(y.numpy()).all()


@pytest.mark.parametrize("setting, expected", [
    (dict(allow_tf32=True), True), (dict(allow_tf32=False), False)], ids=["allow_tf32", "no_tf32"])
def test_the_tf32_choice_follows_pytorchs_cudnn_setting(setting, expected):
    from conv2d.torch.calls import torch_uses_tf32

    with torch.backends.cudnn.flags(enabled=True, **setting):
        assert torch_uses_tf32() is expected


def test_the_tf32_choice_reads_the_fp32_precision_settings_where_torch_has_them():
    from conv2d.torch.calls import torch_uses_tf32

    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is None or not hasattr(conv, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision settings")
    kept = conv.fp32_precision, torch.backends.cudnn.fp32_precision
    try:
        for conv_setting, cudnn_setting, expected in (("ieee", "tf32", False), ("tf32", "ieee", True),
                                                      ("none", "tf32", True), ("none", "none", False)):
            conv.fp32_precision, torch.backends.cudnn.fp32_precision = conv_setting, cudnn_setting
            assert torch_uses_tf32() is expected, (conv_setting, cudnn_setting)
    finally:
        conv.fp32_precision, torch.backends.cudnn.fp32_precision = kept


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_ops_key_that_follows_pytorch_names_the_functions_of_pytorchs_choice_when_the_op_runs(dtype):
    # The key a compiled graph holds; the op reads the switches when it runs, so the
    # traced code reads none (and a compiled graph follows them as PyTorch's own does).
    from conv2d.torch import ops

    spec = LayerSpec(batch_size=2, in_height=5, in_width=5, in_channels=3, out_channels=4, kernel=3, dtype=dtype)
    device = torch.device("cuda", 0)
    follows = ops.key_for("cuda", spec, device, {"allow_tf32": ops.FOLLOW, "autotune": ops.FOLLOW})
    for tf32 in (False, True):
        for benchmark in (False, True):
            with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32, benchmark=benchmark):
                now = ops.key_now(follows)
            want = {"allow_tf32": tf32 and dtype == "float32", "autotune": benchmark}
            assert now == ops.key_for("cuda", spec, device, want), (tf32, benchmark)


def test_an_ops_key_follows_pytorch_only_in_what_the_backend_options_leave_open():
    from conv2d.torch import ops

    spec = LayerSpec(batch_size=2, in_height=5, in_width=5, in_channels=3, out_channels=4, kernel=3)
    device = torch.device("cuda", 0)
    given = ops.key_for("cuda", spec, device, {"allow_tf32": True, "autotune": ops.FOLLOW, "fast_paths": False})
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False, benchmark=True):
        assert ops.key_now(given) == ops.key_for("cuda", spec, device,
                                                 {"allow_tf32": True, "autotune": True, "fast_paths": False})
    chosen = ops.key_for("cuda", spec, device, {"allow_tf32": False, "autotune": False})
    assert ops.key_now(chosen) == chosen
    reference = ops.key_for("reference", spec, torch.device("cpu"), {})
    assert ops.key_now(reference) == reference


def test_ops_keys_of_options_that_are_no_json_are_distinct_names():
    # A module's four (TF32, autotune) choices with a stream option each need their own
    # functions; one shared name would hand the ops whichever was registered last.
    from conv2d.torch import ops

    spec = LayerSpec(batch_size=2, in_height=5, in_width=5, in_channels=3, out_channels=4, kernel=3)
    keys = {ops.key_for("cuda", spec, torch.device("cuda", 0), {"stream": object(), "allow_tf32": tf32})
            for tf32 in (False, True)}
    assert len(keys) == 2 and all(k.startswith("object:") for k in keys)
