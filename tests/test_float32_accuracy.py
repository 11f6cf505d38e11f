"""Issue 39's promise: in deep networks our float32 (and bfloat16) gradients are at least as
accurate as PyTorch's. The first backward of scripts/bench_networks.py's CIFAR
conv-BN-ReLU network and Nature-DQN with the module swapped in, each side against the same
network in float64 taking that side's own ReLU decisions (scripts/accuracy_cuda.network_errors
with same_decisions: the arithmetic's error, not the luck of ReLUs flipped by rounding near
0), TF32 off on both sides. Accuracy is not timing: it is asserted."""

import math

import pytest

from conftest import HAVE_GPU, NO_GPU_REASON

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
torch = pytest.importorskip("torch", reason="torch is not installed (the test extra brings it)")


MARGIN = 1.1  # ours at most PyTorch's error times this


@pytest.fixture(scope="module", autouse=True)
def strict_float32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic = saved


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("network", ["cifar_resnet", "nature_dqn"])
def test_our_gradients_in_a_deep_network_are_as_accurate_as_pytorchs(network, dtype):
    """The worst parameter's gradient error, and the geometric mean over parameters of
    ours / PyTorch's, at most MARGIN."""
    from accuracy_cuda import network_errors

    errors = network_errors(network, dtype, "cuda", same_decisions=True)
    ours, theirs = max(o for o, _ in errors.values()), max(t for _, t in errors.values())
    table = "\n".join(f"{k}: ours {o:.2e}, PyTorch {t:.2e}" for k, (o, t) in errors.items())
    assert ours <= MARGIN * theirs, f"worst gradient error {ours:.2e} > {MARGIN} x PyTorch's {theirs:.2e}\n{table}"
    ratio = math.exp(sum(math.log(o / t) for o, t in errors.values()) / len(errors))
    assert ratio <= MARGIN, f"geometric mean of ours / PyTorch's {ratio:.2f} > {MARGIN}\n{table}"
