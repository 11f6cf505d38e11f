"""conv2d.optim: Adam (rl_tools' formula, and torch's presets) and SGD, in place on a
layer's parameters, on the reference backend (float64, against torch.optim and the
formula written out here) and the CUDA backend's kernels (in numba's simulator without a
GPU) against the reference."""

import dataclasses

import numpy as np
import pytest

from conftest import HAVE_GPU, make_layer, small_layer_spec
from conv2d.optim import SGD, Adam
from conv2d.state import RUNNING

SPEC = small_layer_spec(in_height=5, in_width=4, in_channels=2, out_channels=3, dtype="float64")
STEPS = 20


def gradient_sequence(spec, steps=STEPS, seed=4):
    rng = np.random.default_rng(seed)
    layer = make_layer(spec)
    return [{k: rng.standard_normal(g.shape).astype(g.dtype) for k, g in layer.grad_dict().items()}
            for _ in range(steps)]


def run_ours(layer, opt, grads):
    for g in grads:
        layer.load_grad_dict(g)
        opt.step()
    return {k: v for k, v in layer.state_dict().items() if k not in RUNNING}


def run_torch(state, make_opt, grads):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    params = {k: torch.tensor(v, requires_grad=True) for k, v in state.items() if k not in RUNNING}
    opt = make_opt(list(params.values()))
    for g in grads:
        for k, p in params.items():
            p.grad = torch.tensor(g[k])
        opt.step()
    return {k: p.detach().numpy() for k, p in params.items()}


@pytest.mark.parametrize("case", ["adam", "adam_l2", "adamw", "sgd", "sgd_momentum", "sgd_nesterov"])
def test_the_torch_presets_match_torch_optim_in_float64(case):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    layer = make_layer(SPEC)
    grads = gradient_sequence(SPEC)
    ours, theirs = {
        "adam": (lambda m: Adam(m, preset="torch", lr=1e-2), lambda p: torch.optim.Adam(p, lr=1e-2)),
        "adam_l2": (lambda m: Adam(m, preset="torch", lr=1e-2, weight_decay=0.1),
                    lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)),
        "adamw": (lambda m: Adam(m, preset="torch_adamw", lr=1e-2, weight_decay=0.1),
                  lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
        "sgd": (lambda m: SGD(m, lr=0.05, weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.01)),
        "sgd_momentum": (lambda m: SGD(m, lr=0.05, momentum=0.9, dampening=0.1),
                         lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1)),
        "sgd_nesterov": (lambda m: SGD(m, lr=0.05, momentum=0.9, nesterov=True),
                         lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    }[case]
    want = run_torch(layer.state_dict(), theirs, grads)
    got = run_ours(layer, ours(layer), grads)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-14, err_msg=k)


@pytest.mark.parametrize("preset", ["rl_tools", "rl_tools_eps_1e-8"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adam_computes_rl_tools_formula_in_float64(preset, weight_decay):
    layer = make_layer(SPEC)
    grads = gradient_sequence(SPEC)
    eps = {"rl_tools": 1e-7, "rl_tools_eps_1e-8": 1e-8}[preset]
    lr, b1, b2 = 3e-3, 0.9, 0.999
    want = {k: v.copy() for k, v in layer.state_dict().items() if k not in RUNNING}
    m = {k: np.zeros_like(v) for k, v in want.items()}
    v2 = {k: np.zeros_like(v) for k, v in want.items()}
    for t, g in enumerate(grads, start=1):
        for k in want:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
            update = lr / (1 - b1 ** t) * m[k] / (np.sqrt(np.maximum(v2[k] / (1 - b2 ** t), eps)) + eps)
            if k in ("weights", "gamma"):
                update = update + want[k] * weight_decay / 2
            want[k] = want[k] - update
    got = run_ours(layer, Adam(layer, preset=preset, lr=lr, weight_decay=weight_decay), grads)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-15, err_msg=k)


def test_16_bit_parameters_keep_float32_master_copies():
    spec = dataclasses.replace(SPEC, dtype="bfloat16")
    layer = make_layer(spec)
    tiny = {k: np.full(g.shape, 1.0, g.dtype) for k, g in layer.grad_dict().items()}
    opt = SGD(layer, lr=1e-4)  # far below a bfloat16 ulp of the weights
    before = layer.state_dict()["weights"].astype(np.float32)
    for _ in range(100):
        layer.load_grad_dict(tiny)
        opt.step()
    after = layer.state_dict()["weights"].astype(np.float32)
    # 100 steps of 1e-4 move the master by 1e-2, which the stored weights show; without a
    # master each step would round back to where it was.
    np.testing.assert_allclose(after, before - 100 * 1e-4, atol=8e-3)
    assert np.abs(after - before).max() > 5e-3


def test_a_step_marks_the_parameters_changed_and_zero_grad_clears():
    layer = make_layer(SPEC)
    from conftest import random_inputs

    x, dy = random_inputs(SPEC)
    opt = Adam(layer)
    layer.forward(x)
    layer.backward(x, dy)
    opt.step()
    with pytest.raises(RuntimeError, match="the parameters changed"):
        layer.backward(x, dy)
    opt.zero_grad()
    assert all((g == 0).all() for g in layer.grad_dict().values())


@pytest.mark.parametrize("bad, message", [
    (dict(lr=0.0), "lr: expected a number in"), (dict(betas=(0.9, 1.0)), r"betas\[1\]"),
    (dict(preset="adamax"), "preset: expected one of"), (dict(weight_decay=-1.0), "weight_decay"),
])
def test_bad_hyper_parameters_are_refused_naming_them(bad, message):
    with pytest.raises(ValueError, match=message):
        Adam(make_layer(SPEC), **bad)


CUDA_KINDS = {"adam": lambda m: Adam(m, lr=1e-2, weight_decay=0.1),
              "adam_torch": lambda m: Adam(m, preset="torch", lr=1e-2, weight_decay=0.1),
              "adamw": lambda m: Adam(m, preset="torch_adamw", lr=1e-2, weight_decay=0.1),
              "sgd": lambda m: SGD(m, lr=0.05),
              "sgd_nesterov": lambda m: SGD(m, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)}


@pytest.mark.parametrize("norm, bias", [("batch_norm", True), ("layer_norm", False), ("none", True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", sorted(CUDA_KINDS))
def test_the_cuda_update_matches_the_reference_and_repeats_bitwise(kind, dtype, norm, bias):
    """One launch updates all of a layer's parameters (every slot combination: weights,
    bias, gamma and beta; weights and bias; weights, gamma and beta)."""
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")
    spec = dataclasses.replace(SPEC, dtype=dtype, normalization=norm, bias=bias)
    options = {} if HAVE_GPU else {"convolutions": __import__("host_convolutions").HostConvolutions}
    make = CUDA_KINDS[kind]
    grads = gradient_sequence(spec, steps=3)
    runs = []
    for _ in range(2):
        layer = make_layer(spec, backend="cuda", **options)
        runs.append(run_ours(layer, make(layer), grads))
    ref = make_layer(spec)
    want = run_ours(ref, make(ref), grads)
    tol = 1e-2 if dtype == "bfloat16" else 1e-5
    for k in want:
        np.testing.assert_array_equal(runs[0][k].view(np.uint8), runs[1][k].view(np.uint8), err_msg=k)
        np.testing.assert_allclose(runs[0][k].astype(np.float64), want[k].astype(np.float64), rtol=tol, atol=tol,
                                   err_msg=k)


@pytest.mark.parametrize("make", [lambda m: Adam(m, lr=1e-2), lambda m: SGD(m, lr=0.05, momentum=0.9)],
                         ids=["adam", "sgd"])
def test_an_optimizer_state_saved_and_loaded_continues_bitwise(make):
    spec = dataclasses.replace(SPEC, dtype="bfloat16")
    grads = gradient_sequence(spec, steps=6)
    straight = make_layer(spec)
    opt = make(straight)
    run_ours(straight, opt, grads)
    resumed = make_layer(spec)
    first = make(resumed)
    run_ours(resumed, first, grads[:3])
    state, weights = first.state_dict(), resumed.state_dict()
    again = make_layer(spec)
    again.load_state_dict(weights)
    second = make(again)
    second.load_state_dict(state)
    assert second.t == 3
    got = run_ours(again, second, grads[3:])
    for k, v in {k: v for k, v in straight.state_dict().items() if k not in RUNNING}.items():
        np.testing.assert_array_equal(got[k].view(np.uint8), v.view(np.uint8), err_msg=k)


def test_a_wrong_optimizer_state_is_refused_before_any_change():
    layer = make_layer(SPEC)
    opt = Adam(layer)
    state = opt.state_dict()
    state["arrays"]["0.weights.m"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"state\['arrays'\]\['0.weights.m'\]: expected a float64 array"):
        opt.load_state_dict(state)
    assert opt.t == 0


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_the_step_count_advances_with_each_step_on_the_layers_backend(backend):
    options = {}
    if backend == "cuda":
        pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")
        options = {} if HAVE_GPU else {"convolutions": __import__("host_convolutions").HostConvolutions}
    # 16 x 3 x 3 x 8 weights: a launch of several blocks, whose last one stores the count
    spec = dataclasses.replace(SPEC, dtype="float32", in_channels=8, out_channels=16)
    layer = make_layer(spec, backend=backend, **options)
    opt = Adam(layer, lr=1e-2)
    assert opt.t == 0
    grads = gradient_sequence(spec, steps=3)
    got = run_ours(layer, opt, grads)
    assert opt.t == 3 and opt.state_dict()["t"] == 3
    ref = make_layer(spec)
    want = run_ours(ref, Adam(ref, lr=1e-2), grads)
    for k in want:  # each step used its own t (bias corrections of steps 1, 2, 3)
        np.testing.assert_allclose(got[k], want[k].astype(np.float32), rtol=1e-5, atol=1e-6, err_msg=k)


def test_an_optimizer_state_round_trips_on_the_cuda_backend():
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")
    spec = dataclasses.replace(SPEC, dtype="bfloat16")
    options = {} if HAVE_GPU else {"convolutions": __import__("host_convolutions").HostConvolutions}
    layer = make_layer(spec, backend="cuda", **options)
    opt = Adam(layer, lr=1e-2)
    run_ours(layer, opt, gradient_sequence(spec, steps=2))
    state = opt.state_dict()
    other = Adam(make_layer(spec, backend="cuda", **options), lr=1e-2)
    other.load_state_dict(state)
    for k, v in other.state_dict()["arrays"].items():
        np.testing.assert_array_equal(v, state["arrays"][k], err_msg=k)


def test_a_capture_refuses_an_optimizer_over_other_layers_before_any_change():
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")
    options = {} if HAVE_GPU else {"convolutions": __import__("host_convolutions").HostConvolutions}
    spec = dataclasses.replace(SPEC, dtype="float32")
    layer, other = make_layer(spec, backend="cuda", **options), make_layer(spec, backend="cuda", **options)
    before = layer.state_dict()
    x, d_y = (np.zeros(s, np.float32) for s in (spec.input_shape, spec.output_shape))
    with pytest.raises(ValueError, match="^optimizer: expected a conv2d.optim optimizer over this layer alone, "
                                         "got Adam over 1 layers"):
        layer.capture(x, d_y, optimizer=Adam(other))
    for k, v in before.items():
        np.testing.assert_array_equal(layer.state_dict()[k], v, err_msg=k)


@pytest.mark.parametrize("old, new", [("tensorflow", "rl_tools"), ("pytorch", "rl_tools_eps_1e-8")])
def test_the_old_preset_names_are_refused_naming_the_new_one(old, new):
    with pytest.raises(ValueError, match=f"preset: '{old}' is now '{new}'"):
        Adam(make_layer(SPEC), preset=old)
