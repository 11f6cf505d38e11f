"""`swap` on the model definitions users bring (tests/swap_models.py: ResNet with BasicBlock
and Bottleneck, MobileNetV2, EfficientNet; timm's when it is installed): at least 95% of
the convolutions convert, the converted model computes what the original did (float64,
outputs and every gradient, training and eval), checkpoints load both ways with
strict=True, the state_dict keeps the original keys in their order, and unswap gives the
original modules back."""

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
from torch import nn  # noqa: E402

from conv2d.torch import Conv2dNormActivation, swap, unswap  # noqa: E402
from swap_models import MODELS  # noqa: E402


def _model(name):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    with torch.no_grad():  # statistics and affine parameters away from their defaults
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2), m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)
    return model


def _input(seed=1):
    return torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _convs(model):
    return sum(isinstance(m, nn.Conv2d) for m in model.modules())


@pytest.mark.parametrize("name", MODELS)
def test_at_least_95_percent_of_the_convolutions_convert(name):
    model = _model(name)
    total = _convs(model)
    swapped, report = swap(copy.deepcopy(model), report=True)
    assert report.traced and report.fraction >= 0.95, str(report)
    assert sum(isinstance(m, Conv2dNormActivation) for m in swapped.modules()) == len(report.converted)
    assert len(report.converted) + sum(map(len, report.left.values())) == total


@pytest.mark.parametrize("name", MODELS)
def test_every_norm_that_follows_its_convolution_alone_is_fused(name):
    """Each BatchNorm2d of these models reads a convolution's output and nothing else does:
    all of them fuse with their convolution."""
    model = _model(name)
    norms = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    _, report = swap(copy.deepcopy(model), report=True)
    assert sum(n is not None for _, n, _ in report.converted) == norms


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", MODELS)
def test_the_converted_model_computes_outputs_and_every_gradient_as_the_original(name, training):
    model = _model(name)
    swapped = swap(copy.deepcopy(model))
    results = []
    for m in (model, swapped):
        m.train(training)
        x = _input().requires_grad_()
        y = m(x)
        y.backward(torch.ones_like(y) + torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) / y.numel())
        # Gradients under the original model's keys (keep_vars: the parameters themselves).
        grads = {k: v.grad for k, v in m.state_dict(keep_vars=True).items() if isinstance(v, nn.Parameter)}
        results.append((y, x.grad, grads, m.state_dict()))
    (y0, dx0, g0, s0), (y1, dx1, g1, s1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dx1, dx0, rtol=1e-9, atol=1e-11)
    assert list(g1) == list(g0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-9, atol=1e-11, msg=k)
    for k in s0:  # running statistics and counters included
        torch.testing.assert_close(s1[k], s0[k], rtol=1e-10, atol=1e-12, msg=k)


@pytest.mark.parametrize("name", MODELS)
def test_the_state_dict_keeps_the_original_keys_in_their_order(name):
    model = _model(name)
    swapped = swap(copy.deepcopy(model))
    assert list(swapped.state_dict()) == list(model.state_dict())
    assert list(swapped.layer1.state_dict() if hasattr(swapped, "layer1") else swapped.features.state_dict()) == \
        list(model.layer1.state_dict() if hasattr(model, "layer1") else model.features.state_dict())


@pytest.mark.parametrize("name", MODELS)
def test_checkpoints_load_both_ways_with_strict_keys(name):
    model, other = _model(name), _model(name)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.25)
    swapped = swap(copy.deepcopy(model))
    swapped.load_state_dict(other.state_dict(), strict=True)
    x = _input()
    model.eval(), other.eval(), swapped.eval()
    torch.testing.assert_close(swapped(x), other(x), rtol=1e-10, atol=1e-12)
    model.load_state_dict(swapped.state_dict(), strict=True)
    torch.testing.assert_close(model(x), other(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", MODELS)
def test_an_optimizer_made_before_the_swap_trains_the_swapped_model(name):
    """The new modules hold the original Parameter objects."""
    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    swap(model)
    model(_input()).sum().backward()
    opt.step()
    after = model.state_dict()
    assert all(not torch.equal(after[k], before[k]) for k in before if k.endswith("conv1.weight"))


@pytest.mark.parametrize("name", MODELS)
def test_unswap_gives_back_the_original_modules_with_the_trained_values(name):
    model = _model(name)
    kinds = [(n, type(m), getattr(m, "inplace", None)) for n, m in model.named_modules()]
    swap(model)
    model.train()
    model(_input()).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.01 * p.grad)
    model.eval()
    want, state = model(_input(2)), model.state_dict()
    unswap(model)
    assert [(n, type(m), getattr(m, "inplace", None)) for n, m in model.named_modules()] == kinds
    assert list(model.state_dict()) == list(state)
    torch.testing.assert_close(model(_input(2)), want)


def test_a_model_that_cannot_be_traced_falls_back_to_its_sequentials_and_says_why():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
            self.head = nn.Conv2d(4, 2, 1)

        def forward(self, x):
            y = self.body(x)
            if y.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
                y = y * 2
            return self.head(y)
    model = Branchy().double()
    swapped, report = swap(copy.deepcopy(model), report=True)
    assert not report.traced and "TraceError" in report.reason
    assert report.converted == [("body.0", "body.1", "body.2")]
    assert report.left == {"outside an nn.Sequential, and the forward was not traced": ["head"]}
    torch.testing.assert_close(swapped(_input()), model(_input()))
    assert "not traced" in str(report)


def test_a_conv_subclass_is_left_and_named_in_the_report():
    class MyConv(nn.Conv2d):
        pass
    model = nn.Sequential(MyConv(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).double()
    _, report = swap(model, report=True)
    assert report.left == {"a subclass of nn.Conv2d (its forward may do something else)": ["0"]}
    assert report.fraction == 0.5


@pytest.mark.parametrize("bad, match", [(dict(model=[nn.Conv2d(3, 4, 3)]), "model: expected a torch.nn.Module, got list"),
                                        (dict(report="yes"), "report: expected a bool, got 'yes'")])
def test_swap_refuses_a_model_that_is_no_module_and_a_report_that_is_no_bool_before_changing_anything(bad, match):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    args = {"model": model, **bad}
    with pytest.raises(TypeError, match=match):
        swap(args.pop("model"), **args)
    assert [type(m) for m in model] == [nn.Conv2d, nn.ReLU]


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2_100", "efficientnet_b0"])
def test_timm_models_convert(name):
    timm = pytest.importorskip("timm", reason="timm is not installed (an optional test extra: pip install timm)")
    model = timm.create_model(name, pretrained=False, num_classes=5).double().eval()
    swapped, report = swap(copy.deepcopy(model), report=True)
    assert report.fraction >= 0.95, str(report)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    torch.testing.assert_close(swapped(x), model(x), rtol=1e-9, atol=1e-11)
    assert list(swapped.state_dict()) == list(model.state_dict())
