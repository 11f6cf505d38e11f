"""`swap` on the hand-written real models (tests/swap_models.py) on a GPU: the converted
model, on the CUDA backend, computes the original's outputs and gradients (float32, TF32
off on both sides) in training and eval, each within twice PyTorch's own float32 error
against float64, or 1e-4 of the largest value, whichever is larger."""

import copy

import pytest

from conftest import HAVE_GPU, NO_GPU_REASON

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
torch = pytest.importorskip("torch", reason="torch is not installed")

from swap_models import MODELS  # noqa: E402


def _results(model, x, training):
    model.train(training)
    xr = x.detach().clone().to(next(model.parameters()).dtype).requires_grad_(True)
    y = model(xr)
    y.backward(torch.ones_like(y))
    grads = {k: v.grad.double() for k, v in model.state_dict(keep_vars=True).items()
             if isinstance(v, torch.nn.Parameter)}
    return {"y": y.double(), "d_x": xr.grad.double(), **grads}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", MODELS)
def test_a_converted_model_on_the_gpu_computes_what_the_original_does(name, training):
    from conv2d.torch import swap

    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    original = MODELS[name]().cuda().to(memory_format=torch.channels_last)
    truth = copy.deepcopy(original).double()
    ours, report = swap(copy.deepcopy(original), report=True)
    assert report.fraction >= 0.95
    x = torch.randn(4, 3, 32, 32, device="cuda").to(memory_format=torch.channels_last)
    want, theirs, got = (_results(m, x, training) for m in (truth, original, ours))
    for k in want:
        scale = want[k].abs().max().item()
        pytorch_error = (theirs[k] - want[k]).abs().max().item()
        assert (got[k] - want[k]).abs().max().item() <= max(2 * pytorch_error, 1e-4 * scale), k
