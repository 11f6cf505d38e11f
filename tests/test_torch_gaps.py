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
