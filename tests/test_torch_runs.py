"""conv2d.torch.Conv2dRun: consecutive layers called as one autograd node give bitwise what
calling the layers in turn gives (outputs, input and parameter gradients, running
statistics, batch counts), on every device present (the cpu backend, the reference, and
the CUDA backend with its call graphs replayed); its state_dict is nn.Sequential's; what
one node cannot do runs layer by layer; bad layers and inputs are refused before anything
runs; `swap` groups a Sequential's consecutive chains into runs."""

import copy
import pickle

import pytest

from conftest import HAVE_GPU, NO_GPU_REASON

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra brings it)")
from torch import nn  # noqa: E402

from conv2d.torch import Conv2dNormActivation, Conv2dRun, swap, unswap  # noqa: E402

# (device, cpu_backend): every backend a run can call.
PLACES = [pytest.param(("cpu", "cpu"), id="cpu"), pytest.param(("cpu", "reference"), id="reference"),
          pytest.param(("cuda", "cpu"), id="cuda", marks=pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON))]


def layers(place, dtype, layout="NCHW", momentum=0.1):
    """Four layers of every kind a network chains: a batch-normed conv, a depthwise one,
    a layer-normed 1x1 and a strided one without a norm."""
    device, host = place
    torch.manual_seed(0)
    kw = dict(dtype=dtype, device=device, layout=layout, cpu_backend=host)
    out = [Conv2dNormActivation(3, 8, 3, padding=1, norm="batch_norm", momentum=momentum, **kw),
           Conv2dNormActivation(8, 8, 3, padding=1, groups=8, norm="batch_norm", activation="relu6", **kw),
           Conv2dNormActivation(8, 4, 1, norm="layer_norm", activation="silu", **kw),
           Conv2dNormActivation(4, 6, 3, stride=2, norm="none", activation="identity", **kw)]
    with torch.no_grad():
        for p in (p for m in out for p in m.parameters()):
            p.add_(0.1 * torch.randn_like(p))
    return out


def pair(place, dtype, **kw):
    """(the layers in an nn.Sequential, the same layers' copies in a Conv2dRun)."""
    seq = nn.Sequential(*layers(place, dtype, **kw))
    return seq, Conv2dRun(*copy.deepcopy(list(seq)))


def sample(place, dtype, layout="NCHW", n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, 3, 9, 9), generator=g, dtype=dtype).to(place[0])
    return x.to(memory_format=torch.channels_last) if layout == "NCHW" else x.permute(0, 2, 3, 1).contiguous()


def step(model, x, d_y=None):
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.backward(torch.ones_like(y) if d_y is None else d_y)
    return [y.detach(), x.grad, *(p.grad for p in model.parameters()), *model.state_dict().values()]


def assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and torch.equal(a, b), i


# float64 is the host backends' (the CUDA backend refuses it, as the next test checks).
PLACE_DTYPES = [pytest.param(p.values[0], dtype, id=f"{p.id}-{name}", marks=p.marks)
                for p in PLACES for dtype, name in ((torch.float64, "float64"), (torch.float32, "float32"))
                if not (p.id == "cuda" and dtype == torch.float64)]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize(("place", "dtype"), PLACE_DTYPES)
def test_a_run_trains_bitwise_as_its_layers_in_turn(place, dtype, layout):
    seq, run = pair(place, dtype, layout=layout)
    for seed in (1, 1, 1, 2):  # repeats: on a GPU the run's forward and backward graphs replay
        x = sample(place, dtype, layout, seed=seed)
        assert_bitwise(step(run, x), step(seq, x))


@pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
def test_a_run_on_the_gpu_refuses_float64_as_its_layers_do():
    seq, run = pair(("cuda", "cpu"), torch.float64)
    x = sample(("cuda", "cpu"), torch.float64)
    with pytest.raises(ValueError) as by_layers:
        seq(x)
    with pytest.raises(ValueError) as by_run:
        run(x)
    assert str(by_run.value) == str(by_layers.value)
    assert all(p.grad is None for p in run.parameters())


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("place", PLACES)
def test_a_run_evaluates_bitwise_as_its_layers_in_turn(place, grad):
    seq, run = pair(place, torch.float32)
    seq.eval(), run.eval()
    for _ in range(3):
        x = sample(place, torch.float32)
        with torch.set_grad_enabled(grad):
            assert torch.equal(run(x), seq(x))


@pytest.mark.parametrize("called", ["as_a_run", "layer_by_layer"])
@pytest.mark.parametrize("place", PLACES)
def test_acting_follows_parameters_stepped_in_place_replaced_and_loaded(place, called):
    """A call without gradients in eval (acting: on the cpu backend its prepared evaluates,
    made once for the parameters' memory) gives bitwise the y of the same call with
    gradients, after an optimizer's step (values changed in place), `.data = ...` (new
    memory), running statistics changed in place and load_state_dict."""
    seq, run = pair(place, torch.float32)
    model = run if called == "as_a_run" else seq
    model.eval()
    x = sample(place, torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def acts_as_it_trains():
        with torch.no_grad():
            acted = model(x)
        assert torch.equal(acted, model(x.clone().requires_grad_(True)).detach())
    acts_as_it_trains()
    model(x.clone().requires_grad_(True)).square().sum().backward()
    optimizer.step()
    acts_as_it_trains()
    model[0].conv.weight.data = model[0].conv.weight.data * 0.5  # new memory, channels_last kept
    acts_as_it_trains()
    model[1].norm.running_var.mul_(2.0)
    acts_as_it_trains()
    model.load_state_dict(pair(place, torch.float32)[0].state_dict())
    acts_as_it_trains()


def _change(model, change, place, dtype):
    """Make one change to `model` (a run or its Sequential) that an acting call rests on."""
    if change == "train_mode":
        model.train()
    elif change == "eps":
        model[0].norm.eps = 1e-2
    elif change == "momentum":
        model.train()
        model[0].norm.momentum = 0.5
    elif change == "new_parameter_object":
        model[2].conv.weight = nn.Parameter(model[2].conv.weight.detach() * 0.5)
    elif change == "data_assigned":
        model[1].norm.running_mean.data = model[1].norm.running_mean + 0.25
    elif change == "layer_replaced":
        torch.manual_seed(3)
        model[3] = Conv2dNormActivation(4, 6, 3, stride=2, norm="none", activation="tanh", dtype=dtype,
                                        device=place[0], cpu_backend=place[1])
    elif change == "cpu_backend_changed":
        for layer in model:
            layer.cpu_backend = "reference" if place[1] == "cpu" else "cpu"
    elif change == "moved_to_another_dtype":
        model.to(torch.float64 if place[0] == "cpu" else torch.bfloat16)
    elif change == "cuda_graphs_off":
        for layer in model:
            layer.cuda_graphs = False


ACTING_CHANGES = ["train_mode", "eps", "momentum", "new_parameter_object", "data_assigned", "layer_replaced",
                  "cpu_backend_changed", "moved_to_another_dtype", "cuda_graphs_off"]


def with_gradients(model, x):
    """model(x) through the calls that keep nothing (autograd's: the parameters require
    gradients), the same calls in train mode's statistics too."""
    with torch.enable_grad():
        return model(x).detach()


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("place", PLACES)
def test_a_kept_call_gives_the_layers_output_in_its_dtype_layout_and_strides(place, dtype, layout):
    """Acting again through a run's kept call (on the host: NumPy views in and out, bfloat16
    through its bits) gives bitwise the call with gradients, the same shape and strides."""
    _, run = pair(place, dtype, layout=layout)
    run.eval()
    x = sample(place, dtype, layout)
    want = with_gradients(run, x)
    with torch.no_grad():
        for y in (run(x), run(x)):
            assert torch.equal(y, want) and y.dtype == want.dtype and y.stride() == want.stride()


@pytest.mark.parametrize("change", ACTING_CHANGES)
@pytest.mark.parametrize("place", PLACES)
def test_acting_again_after_a_change_gives_what_the_layers_in_turn_give(place, change):
    """An acting call (eval, no gradients) is kept and called again while nothing it rests
    on changed (`Conv2dRun._stamp`: on the cpu backend its prepared evaluates, on a GPU
    its RunCall's graph replay), for a run and for each lone layer (`runs.act_alone`):
    after each change, bitwise what the layers called with gradients give, running
    statistics included."""
    dtype = torch.float32
    seq, run = pair(place, dtype)
    want = copy.deepcopy(seq)
    for model in (seq, run, want):
        model.eval()
    x = sample(place, dtype)
    with torch.no_grad():
        for _ in range(2):
            expected = with_gradients(want, x)
            assert torch.equal(run(x), expected) and torch.equal(seq(x), expected)
        for model in (seq, run, want):
            _change(model, change, place, dtype)
        x = x.to(next(run.parameters()).dtype)
        for _ in range(2):
            expected = with_gradients(want, x)
            assert torch.equal(run(x), expected) and torch.equal(seq(x), expected)
    for model in (seq, run):
        assert_bitwise(list(model.state_dict().values()), list(want.state_dict().values()))


@pytest.mark.parametrize("place", [p for p in PLACES if p.values[0][0] == "cpu"])
def test_a_lone_layers_acting_is_kept_outside_its_modules_and_state_dict(place):
    """A lone layer acting twice on the host keeps the call (a run of itself, held outside
    the layer's modules; not on the reference, which prepares nothing): its children,
    state_dict keys and parameters stay nn.Sequential's, and a copy of it acts as it does."""
    layer = layers(place, torch.float32)[0].eval()
    names, keys = [n for n, _ in layer.named_modules()], list(layer.state_dict())
    x = sample(place, torch.float32)
    with torch.no_grad():
        first, again = layer(x), layer(x)
    assert (layer.__dict__["_alone"]._acting is not None) == (place != ("cpu", "reference"))
    assert torch.equal(first, again) and torch.equal(again, with_gradients(layer, x))
    assert [n for n, _ in layer.named_modules()] == names and list(layer.state_dict()) == keys
    assert len(list(layer.parameters())) == 4
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(layer)(x), again)


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("place", PLACES)
def test_a_copy_made_after_calls_acts_as_the_original_and_stays_apart_from_it(place, copier):
    """A DQN's target network: a deep copy (or pickle) of a model that has trained and acted,
    its caches filled (functions, call graphs, views of its memory, kept calls), acts
    bitwise as the original, and changing the original's parameters leaves it as it was."""
    seq, run = pair(place, torch.float32)
    x = sample(place, torch.float32)
    for model in (seq[0], seq, run):
        step(model, x)
        model.eval()
        with torch.no_grad():
            model(x)
            acted = model(x)
            target = copier(model)
            assert torch.equal(target(x), acted)
            for p in model.parameters():
                p.add_(1.0)
            assert torch.equal(target(x), acted) and not torch.equal(model(x), acted)


@pytest.mark.parametrize("other", ["shape", "memory_format", "dtype"])
def test_acting_again_on_another_input_gives_what_the_layers_in_turn_give(other):
    seq, run = pair(("cpu", "cpu"), torch.float64)
    seq.eval(), run.eval()
    x = sample(("cpu", "cpu"), torch.float64)
    with torch.no_grad():
        assert torch.equal(run(x), seq(x))
        if other == "shape":
            x = sample(("cpu", "cpu"), torch.float64, n=2)[:, :, :7, :8]
        elif other == "memory_format":
            x = x.contiguous()
        else:
            x = x.float()
            with pytest.raises(TypeError, match="x: expected a torch.float64 tensor"):
                run(x)
            return
        assert torch.equal(run(x), seq(x))


@pytest.mark.parametrize("called", ["as_a_run", "lone_layer"])
def test_acting_again_runs_a_forward_hook_registered_since(called):
    _, run = pair(("cpu", "cpu"), torch.float64)
    run.eval()
    model = run if called == "as_a_run" else run[0]
    x = sample(("cpu", "cpu"), torch.float64)
    calls = []
    with torch.no_grad():
        want = model(x)
        run[0].register_forward_hook(lambda *args: calls.append(1))
        assert torch.equal(model(x), want)
    assert calls == [1]


@pytest.mark.parametrize("place", PLACES)
def test_a_run_in_training_without_gradients_updates_the_statistics_as_its_layers(place):
    seq, run = pair(place, torch.float32)
    for _ in range(3):
        x = sample(place, torch.float32)
        with torch.no_grad():
            assert torch.equal(run(x), seq(x))
    assert_bitwise(list(run.state_dict().values()), list(seq.state_dict().values()))


@pytest.mark.parametrize("place", PLACES)
def test_a_run_is_one_autograd_node(place):
    _, run = pair(place, torch.float32)
    y = run(sample(place, torch.float32).requires_grad_(True))
    node = y.grad_fn
    while type(node).__name__.startswith("Permute"):
        node = node.next_functions[0][0]
    assert type(node).__name__ == "EagerRunBackward"
    # Its inputs: x and every layer's parameters, nothing else of ours.
    names = {type(n).__name__ for n, _ in node.next_functions if n is not None}
    assert not any("Conv2d" in name for name in names)


@pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
def test_a_run_on_the_gpu_replays_one_graph_a_call():
    _, run = pair(("cuda", "cpu"), torch.float32)
    x = sample(("cuda", "cpu"), torch.float32)
    for _ in range(5):
        step(run, x)
    counts = run.graph_counts()
    assert counts["replayed"] >= 4 and counts["failed"] == 0, counts
    assert all(sum(layer.graph_counts().values()) == 0 for layer in run), "the layers' own graphs ran"


def test_a_runs_state_dict_is_the_sequentials_and_loads_either_way():
    seq, run = pair(("cpu", "cpu"), torch.float64)
    assert list(run.state_dict()) == list(seq.state_dict())
    other = nn.Sequential(*layers(("cpu", "cpu"), torch.float64))
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2)
    run.load_state_dict(other.state_dict(), strict=True)
    assert_bitwise(list(run.state_dict().values()), list(other.state_dict().values()))


@pytest.mark.parametrize("case", ["momentum_none", "forward_hook", "autocast", "empty_batch"])
def test_what_one_node_cannot_do_runs_layer_by_layer_with_the_same_results(case):
    place = ("cpu", "cpu")
    dtype = torch.float32 if case == "autocast" else torch.float64
    seq, run = pair(place, dtype, momentum=None if case == "momentum_none" else 0.1)
    x = sample(place, dtype, n=0 if case == "empty_batch" else 4)
    if case == "forward_hook":
        calls = []
        for model in (seq, run):
            model[2].register_forward_hook(lambda *args: calls.append(1))
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(run(x), seq(x))
        return
    assert_bitwise(step(run, x), step(seq, x))
    if case == "forward_hook":
        assert len(calls) == 2  # the hook ran in both


@pytest.mark.parametrize("bad, message", [
    ((), "layers: expected at least one"),
    ((nn.Conv2d(3, 8, 3),), r"layers\[0\]: expected a Conv2dNormActivation, got Conv2d"),
    ((Conv2dNormActivation(3, 8, 3), Conv2dNormActivation(8, 4, 3, layout="NHWC")),
     r"layers\[1\]: expected layout 'NCHW'"),
    ((Conv2dNormActivation(3, 8, 3), Conv2dNormActivation(4, 4, 3)), r"layers\[1\]: expected 8 input channels"),
])
def test_a_run_refuses_layers_that_do_not_chain(bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Conv2dRun(*bad)


def test_an_input_too_small_for_a_later_layer_is_refused_before_any_layer_runs():
    run = Conv2dRun(Conv2dNormActivation(3, 4, 3, dtype=torch.float64),
                    Conv2dNormActivation(4, 4, 5, dtype=torch.float64))
    before = copy.deepcopy(run.state_dict())
    with pytest.raises(ValueError, match=r"layers\[1\] of the run would get a 3x3 input.*height >= 5"):
        run(torch.randn(2, 3, 5, 5, dtype=torch.float64))
    assert_bitwise(list(run.state_dict().values()), list(before.values()))


def test_swap_calls_a_sequentials_consecutive_chains_as_one_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                          nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(8 * 16, 3)).double()
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    swapped, report = swap(model, report=True)
    assert report.runs == [["0", "3", "5"]] and "1 runs of consecutive layers" in str(report)
    assert isinstance(swapped[0], Conv2dRun) and len(swapped[0]) == 3
    assert list(swapped.state_dict()) == keys
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(swapped(x), original(x), rtol=1e-10, atol=1e-12)
    assert swapped.load_state_dict(original.state_dict(), strict=True)
    unswap(swapped)
    assert [type(m) for m in swapped] == [type(m) for m in original]


def test_swap_without_runs_keeps_one_module_a_chain():
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU())
    _, report = swap(model, report=True, runs=False)
    assert report.runs == [] and all(not isinstance(m, Conv2dRun) for m in model.modules())


def test_swap_starts_a_new_run_where_a_module_other_than_a_chain_comes_between():
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3), nn.ReLU(),
                          nn.Conv2d(8, 8, 1))
    _, report = swap(model, report=True)
    assert report.runs == [["3", "5"]]


def test_swap_opens_nested_sequentials_into_one_run():
    # MobileNetV2's inverted residual: Sequential(Sequential(conv, bn, relu6) x2, conv, bn), as torchvision's.
    from swap_models import MODELS

    torch.manual_seed(0)
    model = MODELS["mobilenet_v2"]().double()
    original, keys = copy.deepcopy(model), list(model.state_dict())
    _, report = swap(model, report=True)
    assert any(len(r) == 3 for r in report.runs), report.runs
    assert list(model.state_dict()) == keys
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(model(x), original(x), rtol=1e-10, atol=1e-12)
