"""Reliability II: a file reads only itself, a save replaces only a regular file, and no call
changes state before it fails (the loaders' fuzz is tests/test_loader_fuzz.py, the rl_tools
file cases tests/test_rltools.py, the command line tests/test_cli.py)."""

import dataclasses
import os
import stat
import threading

import numpy as np
import pytest

import conv2d
from conftest import edit_header, make_layer, random_inputs, small_layer_spec
from conv2d import Conv2d, LayerSpec, Sequential
from conv2d.optim import SGD, Adam

SPEC = small_layer_spec()


def saved(tmp_path, layer=None, name="layer.npz"):
    layer = layer or make_layer(SPEC)
    path = tmp_path / name
    conv2d.save(layer, path)
    return layer, path


# 3. conv2d.load checks the header's spec against the arrays before building anything -----------
@pytest.mark.parametrize("out_channels", [2 ** 26, 2 ** 33])
def test_a_header_spec_larger_than_its_arrays_is_refused_before_a_layer_is_built(tmp_path, out_channels):
    import tracemalloc

    _, path = saved(tmp_path)
    edit_header(path, lambda h: h["spec"].__setitem__("out_channels", out_channels), keep_checksum=True)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="the header declares|LayerSpec.out_channels"):
            conv2d.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20, peak


def test_declared_arrays_that_fit_the_spec_but_not_the_members_are_refused(tmp_path):
    _, path = saved(tmp_path)

    def grow(h):
        h["spec"]["out_channels"] = 4096
        for name in ("bias", "gamma", "beta", "running_mean", "running_var"):
            h["arrays"][name]["shape"] = [4096]
        h["arrays"]["weights"]["shape"] = [4096, 3, 3, 3]
    edit_header(path, grow, keep_checksum=True)
    with pytest.raises(ValueError, match="member of \\d+ bytes for a"):
        conv2d.load(path)


@pytest.mark.parametrize("version", [True, 1.0, "1", None])
def test_only_the_integer_1_is_version_1(tmp_path, version):
    layer, path = saved(tmp_path)

    def downgrade(h):
        del h["header_sha256"]
        h["version"] = version
        h["spec"]["activation"] = "tanh"  # an edit version 1's missing checksum would let through
    edit_header(path, downgrade)
    with pytest.raises(ValueError, match="file format version"):
        conv2d.load(path)


# 4. save replaces only regular files, and reads the umask without changing it ---------------------
def test_save_onto_a_fifo_is_refused_and_leaves_it_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO; a save replaces only a regular file"):
        conv2d.save(make_layer(SPEC), fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_save_onto_a_character_device_through_a_symlink_is_refused(tmp_path):
    # A device node of our own (as /dev/null: major 1, minor 3), so that a regression here
    # replaces nothing the machine needs.
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    link = tmp_path / "layer.npz"
    link.symlink_to(device)
    with pytest.raises(ValueError, match="is a character device"):
        conv2d.save(make_layer(SPEC), link)
    assert stat.S_ISCHR(os.stat(device).st_mode)


def test_save_onto_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        conv2d.save(make_layer(SPEC), tmp_path)


def test_saves_in_several_threads_never_change_the_umask(tmp_path, monkeypatch):
    calls = []
    real = os.umask
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real(mask))
    layer = make_layer(SPEC)
    threads = [threading.Thread(target=conv2d.save, args=(layer, tmp_path / f"{i}.npz")) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == []
    mask = real(0o022)
    real(mask)
    assert {stat.S_IMODE((tmp_path / f"{i}.npz").stat().st_mode) for i in range(8)} == {0o666 & ~mask}


# 6. An input changed in place after forward ----------------------------------------------------
def _changed_in_place(x):
    x[0, 0, 0, 0] += 111


@pytest.mark.parametrize("call", ["backward", "backward_full"])
def test_a_numpy_input_changed_in_place_after_forward_is_refused_by_backward(call):
    layer = make_layer(SPEC)
    x, dy = random_inputs(SPEC)
    layer.forward(x)
    _changed_in_place(x)
    with pytest.raises(ValueError, match="x: changed in place since the last forward"):
        getattr(layer, call)(x, dy)
    assert not any(g.any() for g in layer.grad_dict().values())


@pytest.mark.parametrize("how", ["torch", "numpy_view"])
def test_a_torch_cpu_input_changed_in_place_after_forward_is_refused_by_backward(how):
    torch = pytest.importorskip("torch")
    layer = make_layer(SPEC)
    x, dy = random_inputs(SPEC)
    xt = torch.from_numpy(x)
    layer.forward(xt)
    if how == "torch":
        xt.mul_(2)
    else:
        xt.numpy()[0, 0, 0, 0] += 111  # bypasses torch's version counter
    with pytest.raises(ValueError, match="x: changed in place"):
        layer.backward(xt, torch.from_numpy(dy))


def test_an_unchanged_input_and_an_equal_copy_still_differentiate():
    layer = make_layer(SPEC)
    x, dy = random_inputs(SPEC)
    layer.forward(x)
    layer.backward(x, dy)
    layer.backward(x.copy(), dy)


def test_a_sequential_refuses_a_changed_intermediate_input():
    specs = [SPEC, dataclasses.replace(SPEC, in_channels=4)]
    model = Sequential([make_layer(s, seed=i) for i, s in enumerate(specs)])
    x, _ = random_inputs(SPEC)
    y = model.forward(x)
    model._inputs[1][0, 0, 0, 0] += 1  # what a user holding the first layer's output could do
    with pytest.raises(ValueError, match="changed in place"):
        model.backward(x, np.ones_like(y))


# 7. Sequential.forward checks the whole stack before the first layer runs ----------------------
def test_a_stack_that_refuses_the_input_at_a_later_layer_changes_no_running_statistics():
    first = LayerSpec(in_height=8, in_width=8, in_channels=3, out_channels=4, kernel=3, normalization="batch_norm")
    second = LayerSpec(in_height=6, in_width=6, in_channels=4, out_channels=4, kernel=5, normalization="batch_norm")
    model = Sequential([make_layer(first), make_layer(second, seed=1)])
    before = model.state_dict()
    x = np.random.default_rng(0).standard_normal((2, 6, 6, 3)).astype(np.float32)  # layer 1 gets 4x4 < 5
    for call in (model.forward, model.evaluate):
        with pytest.raises(ValueError, match=r"layers\[1\] cannot take the \(N, H, W, C\) = \(2, 4, 4, 4\)"):
            call(x)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


# 8. The optimizer step holds the layers' locks -------------------------------------------------
def _stepping_model():
    """(a two-layer stack with gradients, an SGD over it, its input), the optimizer's
    update of the first layer slowed, so that another thread would meet a half-done step."""
    specs = [SPEC, dataclasses.replace(SPEC, in_channels=4)]
    model = Sequential([make_layer(s, seed=i) for i, s in enumerate(specs)])
    x, _ = random_inputs(SPEC)
    y = model.forward(x)
    model.backward(x, np.ones_like(y))
    original = model[0].parameters_changed

    def slow_changed():
        original()
        threading.Event().wait(0.002)  # widen the window between the two layers' updates

    model[0].parameters_changed = slow_changed
    return model, SGD(model, lr=0.5), x


def test_evaluate_in_another_thread_never_sees_half_an_optimizer_step():
    model, opt, x = _stepping_model()
    outputs, states, stop = [], [], threading.Event()

    def stepper():
        for _ in range(20):
            opt.step()
            with conv2d.layer.layer_locks(model):
                states.append(model.state_dict())
        stop.set()

    def evaluator():
        while not stop.is_set():
            outputs.append(model.evaluate(x))

    states.append(model.state_dict())
    threads = [threading.Thread(target=stepper), threading.Thread(target=evaluator)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reference = Sequential([Conv2d(layer.spec) for layer in model])
    wants = []
    for state in states:
        reference.load_state_dict(state)
        wants.append(reference.evaluate(x))
    mixed = [o for o in outputs if not any(np.array_equal(o, w) for w in wants)]
    assert outputs and not mixed, f"{len(mixed)} of {len(outputs)} outputs mix two weight versions"


def test_save_in_another_thread_writes_whole_optimizer_steps(tmp_path):
    model, opt, _ = _stepping_model()
    states, stop = [model.state_dict()], threading.Event()

    def stepper():
        while not stop.is_set():
            opt.step()
            with conv2d.layer.layer_locks(model):
                states.append(model.state_dict())

    loaded = []

    def saver():
        for i in range(30):
            path = tmp_path / f"{i % 3}.npz"
            conv2d.save(model, path)
            loaded.append(conv2d.load(path).state_dict())
        stop.set()

    threads = [threading.Thread(target=stepper), threading.Thread(target=saver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torn = [s for s in loaded if not any(all(np.array_equal(s[k], w[k]) for k in w) for w in states)]
    assert loaded and not torn, f"{len(torn)} of {len(loaded)} saved files are torn"


# 9. The optimizer validates everything before changing anything --------------------------------
@pytest.mark.parametrize("t", [2 ** 63, 2 ** 63 - 1, 2 ** 53 + 1, -1])
def test_an_adam_step_count_out_of_range_is_refused_before_any_buffer_changes(t):
    model = Sequential([make_layer(SPEC), make_layer(dataclasses.replace(SPEC, in_channels=4), seed=1)])
    opt = Adam(model)
    before = opt.state_dict()
    bad = {"t": t, "arrays": {k: v + 1 for k, v in before["arrays"].items()}}
    with pytest.raises(ValueError, match=r"state\['t'\]: expected an int in \[0, 2\*\*53\]"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["t"] == before["t"]
    for k, v in before["arrays"].items():
        np.testing.assert_array_equal(after["arrays"][k], v, err_msg=k)


def test_the_largest_step_count_steps_without_overflow():
    layer = make_layer(SPEC)
    opt = Adam(layer)
    state = opt.state_dict()
    opt.load_state_dict({**state, "t": 2 ** 53})
    opt.step()
    assert opt.t == 2 ** 53 + 1
    assert all(np.isfinite(v).all() for v in layer.state_dict().values())


@pytest.mark.parametrize("bad", ["nan_m", "negative_v"])
def test_optimizer_buffers_that_are_not_finite_or_negative_second_moments_are_refused(bad):
    opt = Adam(make_layer(SPEC))
    state = opt.state_dict()
    arrays = {k: v.copy() for k, v in state["arrays"].items()}
    arrays["0.weights.m" if bad == "nan_m" else "0.weights.v"].flat[0] = np.nan if bad == "nan_m" else -1
    with pytest.raises(ValueError, match="expected finite values|a second moment must be >= 0"):
        opt.load_state_dict({"t": 3, "arrays": arrays})
    assert opt.t == 0


@pytest.mark.parametrize("make, name", [(lambda m: Adam(m, lr=1e300), "lr"), (lambda m: Adam(m, eps=1e-50), "eps"),
                                        (lambda m: SGD(m, lr=1e39), "lr"),
                                        (lambda m: Adam(m, weight_decay=1e40), "weight_decay")])
def test_hyper_parameters_must_be_finite_and_nonzero_in_the_parameters_compute_dtype(make, name):
    with pytest.raises(ValueError, match=rf"^{name}: .* in float32, the dtype the update computes in"):
        make(make_layer(SPEC))


def test_a_float64_layer_takes_hyper_parameters_float32_cannot_hold():
    Adam(make_layer(dataclasses.replace(SPEC, dtype="float64")), lr=1e39)


# 10. Every integer field is bounded ------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("stride", 2 ** 62), ("stride", 2 ** 31), ("padding", 2 ** 40),
                                          ("kernel", 2 ** 33), ("in_height", 2 ** 31)])
def test_integer_fields_beyond_int32_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"^LayerSpec\.{field}: "):
        dataclasses.replace(SPEC, **{field: value})


def test_a_stride_whose_step_through_the_input_no_array_could_take_is_refused():
    with pytest.raises(ValueError, match=r"^LayerSpec\.stride: one stride's step through the padded input"):
        LayerSpec(in_height=1, in_width=2 ** 20, in_channels=64, out_channels=1, kernel=1, stride=2 ** 20)


def test_a_forged_file_with_a_huge_stride_is_refused_as_a_value_error(tmp_path):
    _, path = saved(tmp_path)
    edit_header(path, lambda h: h["spec"].__setitem__("stride", [10 ** 29, 1]), keep_checksum=True)
    with pytest.raises(ValueError, match="LayerSpec.stride"):
        conv2d.load(path)


# 12. The functional core checks before it changes anything -------------------------------------
def test_a_read_only_running_var_is_refused_before_running_mean_changes():
    layer = make_layer(SPEC)
    state = layer.state_dict()
    params = {k: state[k] for k in ("weights", "bias", "gamma", "beta")}
    running = {"running_mean": state["running_mean"].copy(), "running_var": state["running_var"].copy()}
    running["running_var"].flags.writeable = False
    before = running["running_mean"].copy()
    x, _ = random_inputs(SPEC)
    with pytest.raises(ValueError, match=r"running\['running_var'\]: .*read-only"):
        layer.functions.forward(params, x, True, running)
    np.testing.assert_array_equal(running["running_mean"], before)


@pytest.mark.parametrize("other", [dict(activation="tanh"), dict(normalization="layer_norm"),
                                   dict(normalization="none", activation="relu")])
def test_backward_refuses_a_saved_of_another_layer(other):
    spec = dataclasses.replace(SPEC, **other)
    mine, theirs = make_layer(SPEC), make_layer(spec)
    x, dy = random_inputs(SPEC)
    _, saved_values = theirs.functions.forward(theirs.parameters(), x, True, None)
    with pytest.raises(ValueError, match="saved: made by a forward of another layer"):
        mine.functions.backward(mine.parameters(), saved_values, dy)


# 11. The PyTorch module ------------------------------------------------------------------------
def test_the_module_counts_no_batch_for_a_call_it_refuses():
    torch = pytest.importorskip("torch")
    from conv2d.torch import Conv2dNormActivation

    m = Conv2dNormActivation(3, 4, 3, norm="batch_norm", dtype=torch.float64)
    bad = torch.zeros(2, 5, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    for _ in range(3):
        with pytest.raises(ValueError):
            m(bad)
    assert int(m.norm.num_batches_tracked) == 0
    m(torch.zeros(2, 3, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last))
    assert int(m.norm.num_batches_tracked) == 1


def test_a_float64_module_takes_an_epsilon_float32_cannot_hold_as_batch_norm_does():
    torch = pytest.importorskip("torch")
    from conv2d.torch import Conv2dNormActivation

    torch.nn.BatchNorm2d(4, eps=1e-300, dtype=torch.float64)
    m = Conv2dNormActivation(3, 4, 3, norm="batch_norm", eps=1e-300, dtype=torch.float64)
    y = m(torch.randn(2, 3, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last))
    assert torch.isfinite(y).all()
