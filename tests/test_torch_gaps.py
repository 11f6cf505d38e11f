"""PyTorch-integration gaps found by trying real model definitions (the swap issue, part 3):
a dilated kernel without padding, and momentum=None exact in float64."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra brings it)")

from conv2d.torch import Conv2dNormActivation, reference_sequential  # noqa: E402


def test_a_dilated_kernel_without_padding_constructs_and_runs_as_nn_conv2d():
    torch.manual_seed(0)
    ours = Conv2dNormActivation(4, 8, 3, dilation=2, norm="none", activation="identity").double()
    theirs = reference_sequential(ours)
    x = torch.randn(2, 4, 9, 9, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-13, atol=1e-13)


def test_the_cumulative_average_of_momentum_none_agrees_with_batchnorm2d_in_float64():
    torch.manual_seed(0)
    ours = Conv2dNormActivation(3, 5, 3, padding=1, momentum=None).double()
    theirs = reference_sequential(ours)
    for _ in range(7):
        x = torch.randn(4, 3, 6, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
        ours(x)
        theirs(x)
    # a float32 reciprocal of the counter was 1e-8 off; float64 roundoff is left
    torch.testing.assert_close(ours.norm.running_mean, theirs[1].running_mean, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(ours.norm.running_var, theirs[1].running_var, rtol=1e-14, atol=1e-15)
    assert int(ours.norm.num_batches_tracked) == int(theirs[1].num_batches_tracked) == 7


@pytest.mark.parametrize("norm", ["batch_norm", "layer_norm", "none"])
def test_a_batch_of_no_samples_gives_the_empty_result_nn_gives(norm):
    torch.manual_seed(0)
    ours = Conv2dNormActivation(4, 8, 3, padding=1, norm=norm)
    theirs = reference_sequential(ours)
    x = torch.zeros(0, 4, 8, 8).contiguous(memory_format=torch.channels_last).requires_grad_()
    y, want = ours(x), theirs(x)
    assert y.shape == want.shape == (0, 8, 8, 8) and y.is_contiguous(memory_format=torch.channels_last)
    y.sum().backward()
    assert x.grad.shape == x.shape and float(ours.conv.weight.grad.abs().sum()) == 0.0
    if norm == "batch_norm":  # counted as nn.BatchNorm2d counts it; statistics unchanged
        assert int(ours.norm.num_batches_tracked) == int(theirs[1].num_batches_tracked) == 1
        torch.testing.assert_close(ours.norm.running_mean, theirs[1].running_mean)
    with torch.no_grad():
        assert ours.eval()(torch.zeros(0, 4, 8, 8)).shape == (0, 8, 8, 8)


@pytest.mark.parametrize("layout, shape", [("NCHW", (2, 4, 1, 1)), ("NHWC", (2, 2, 2, 4))])
def test_an_input_too_small_for_the_kernel_is_named_in_the_modules_layout(layout, shape):
    module = Conv2dNormActivation(4, 8, 3, layout=layout)
    with pytest.raises(ValueError, match=f"x: expected a {layout} tensor of height >= 3 and width >= 3 .*got a "
                                         f"Tensor of shape"):
        module(torch.zeros(shape))


def test_functional_call_with_replaced_parameters_gives_the_sequentials_result():
    torch.manual_seed(0)
    ours = Conv2dNormActivation(3, 4, 3, padding=1, norm="batch_norm").double()
    theirs = reference_sequential(ours)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    params = {k: v.detach() * 2 for k, v in ours.named_parameters()}
    torch.testing.assert_close(torch.func.functional_call(ours, params, (x,)),
                               torch.func.functional_call(theirs, params, (x,)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("transform", ["grad of the input", "grad of the parameters"])
def test_torch_func_transforms_are_refused_naming_what_to_use(transform):
    module = Conv2dNormActivation(3, 4, 3, padding=1, norm="none").double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    params = {k: v.detach() for k, v in module.named_parameters()}
    run = ((lambda: torch.func.grad(lambda xx: module(xx).sum())(x)) if transform == "grad of the input" else
           (lambda: torch.func.grad(lambda p: torch.func.functional_call(module, p, (x,)).sum())(params)))
    with pytest.raises(NotImplementedError, match="torch.func transforms.*use torch.autograd.grad"):
        run()


@pytest.mark.parametrize("norm", ["batch_norm", "layer_norm", "none"])
def test_under_autocast_the_module_computes_and_returns_the_autocast_dtype_as_nn_does(norm):
    torch.manual_seed(0)
    ours = Conv2dNormActivation(3, 4, 3, padding=1, norm=norm)
    theirs = reference_sequential(ours)
    x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = ours(xo), theirs(xt)
    assert y.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2)
    y.float().sum().backward()
    want.float().sum().backward()
    # gradients reach the float32 leaves through autocast's casts, in their dtypes
    assert xo.grad.dtype == torch.float32 and ours.conv.weight.grad.dtype == torch.float32
    torch.testing.assert_close(xo.grad, xt.grad, rtol=2e-2, atol=2e-2)
    if norm != "none":  # the norm's statistics and parameters stay float32
        assert ours.norm.weight.dtype == ours.norm.weight.grad.dtype == torch.float32


def test_autocast_leaves_a_float64_module_in_float64():
    module = Conv2dNormActivation(3, 4, 3, padding=1).double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module(torch.randn(2, 3, 6, 6, dtype=torch.float64)).dtype == torch.float64
