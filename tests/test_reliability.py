"""The defects found by attacking the library as the trusted numerical libraries are
tested: the loader (header edits, damaged archives, zip bombs, odd paths, fuzzing), the
saver (modes, links, non-finite state), validation that masked or strided arrays cannot
bypass, spec fields checked in the compute dtype and against sizes no call can hold,
clear errors, and a layer shared between threads."""

import dataclasses
import os
import stat
import threading
import zipfile

import numpy as np
import pytest

import conv2d
from conftest import edit_header, make_layer, random_inputs, rewrite_npz, small_layer_spec
from conv2d import Conv2d, LayerSpec

SPEC = small_layer_spec(activation="gelu")


def saved(tmp_path, spec=SPEC, name="layer.npz"):
    layer = make_layer(spec)
    path = tmp_path / name
    conv2d.save(layer, path)
    return layer, path


# 1. The header has a checksum ------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("activation", "relu"), ("stride", [2, 2]), ("padding", [0, 0]),
                                          ("bn_momentum", 0.5), ("bn_epsilon", 1e-3), ("batch_size", 7),
                                          ("in_height", 9), ("in_width", 8)])
def test_an_edited_spec_field_in_the_header_is_refused(tmp_path, field, value):
    _, path = saved(tmp_path)
    edit_header(path, lambda h: h["spec"].__setitem__(field, value))
    with pytest.raises(ValueError, match="header checksum mismatch"):
        conv2d.load(path)


def test_a_version_1_file_without_a_header_checksum_still_loads(tmp_path):
    layer, path = saved(tmp_path)

    def downgrade(h):
        del h["header_sha256"]
        h["version"] = 1
    edit_header(path, downgrade)
    np.testing.assert_array_equal(conv2d.load(path).state_dict()["weights"], layer.state_dict()["weights"])


# 2. Masked and strided arrays cannot bypass validation -----------------------------------------
def test_masked_arrays_are_refused_in_state_inputs_and_gradients():
    layer = make_layer(SPEC)
    state = layer.state_dict()
    bad = dict(state, running_var=np.ma.masked_array(np.full(4, -5.0, np.float32), mask=True))
    with pytest.raises(TypeError, match=r"state\['running_var'\].*masked array"):
        layer.load_state_dict(bad)
    x, dy = random_inputs(SPEC)
    with pytest.raises(TypeError, match="^x: .*masked array"):
        layer.forward(np.ma.masked_array(x, mask=np.isnan(x)))
    layer.forward(x)
    with pytest.raises(TypeError, match="^d_y: .*masked array"):
        layer.backward(x, np.ma.masked_array(dy))
    grads = dict(layer.grad_dict(), gamma=np.ma.masked_array(np.zeros(4, np.float32)))
    with pytest.raises(TypeError, match=r"grads\['gamma'\].*masked array"):
        layer.load_grad_dict(grads)


@pytest.mark.parametrize("layout", ["fortran", "negative_stride", "broadcast", "strided"])
def test_state_arrays_must_be_c_contiguous(layout):
    layer = make_layer(SPEC)
    state = layer.state_dict()
    w = state["weights"]
    state["weights"] = {"fortran": np.asfortranarray(w), "negative_stride": w[::-1].copy()[::-1],
                        "broadcast": np.broadcast_to(w[:1], w.shape),
                        "strided": np.repeat(w, 2, axis=3)[..., ::2]}[layout]
    with pytest.raises(ValueError, match=r"state\['weights'\]: expected a C-contiguous array"):
        layer.load_state_dict(state)


# 3, 4. load raises ValueError for any damage, and refuses a zip bomb before inflating it ------
def test_a_plain_npy_file_and_odd_paths_raise_clear_errors(tmp_path):
    npy = tmp_path / "a.npy"
    np.save(npy, np.zeros(3))
    with pytest.raises(ValueError, match="not a readable conv2d file"):
        conv2d.load(npy)
    for bad in (None, 3, b"layer.npz"):
        with pytest.raises(TypeError, match="^path: expected a str or os.PathLike"):
            conv2d.load(bad)
    with pytest.raises(ValueError, match="not a regular file"):
        conv2d.load(tmp_path)


def test_a_fifo_as_the_path_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        conv2d.load(fifo)


def test_deeply_nested_header_json_and_wrong_types_are_value_errors(tmp_path):
    _, path = saved(tmp_path)
    rewrite_npz(path, lambda a: a.__setitem__("header", np.frombuffer(("[" * 100000 + "]" * 100000).encode(),
                                                                         np.uint8)))
    with pytest.raises(ValueError):
        conv2d.load(path)
    for arrays in ("not a dict", [1, 2], {"weights": "x"}):
        _, path = saved(tmp_path, name="b.npz")
        edit_header(path, lambda h, arrays=arrays: h.__setitem__("arrays", arrays), keep_checksum=True)
        with pytest.raises(ValueError):
            conv2d.load(path)


def test_a_declared_shape_of_terabytes_is_refused_before_allocating(tmp_path):
    _, path = saved(tmp_path)
    edit_header(path, lambda h: h["arrays"]["weights"].__setitem__("shape", [1 << 20, 1 << 20, 1, 1]),
                keep_checksum=True)
    with pytest.raises(ValueError, match="more than"):
        conv2d.load(path)


def test_a_zip_bomb_member_is_refused_before_it_is_inflated(tmp_path):
    _, path = saved(tmp_path)
    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "state.bias.npy":
                data = data + b"\0" * (64 << 20)  # 64 MiB of zeros: a few KiB deflated
            dst.writestr(info.filename, data)
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(ValueError, match="refused before inflating"):
        conv2d.load(bomb)


def test_fuzzed_files_load_identically_or_raise_value_error(tmp_path):
    layer, path = saved(tmp_path)
    data = path.read_bytes()
    want = layer.state_dict()
    rng = np.random.default_rng(0)
    target = tmp_path / "fuzz.npz"
    outcomes = {"identical": 0, "refused": 0}
    for i in range(1500):
        b = bytearray(data)
        kind = i % 3
        if kind == 0:  # truncation
            b = b[:int(rng.integers(0, len(b)))]
        elif kind == 1:  # bit flips anywhere: local headers, data, the central directory
            for _ in range(int(rng.integers(1, 4))):
                p = int(rng.integers(0, len(b)))
                b[p] ^= 1 << int(rng.integers(0, 8))
        else:  # a byte of the header JSON replaced
            start = data.find(b'{"arrays"')
            p = start + int(rng.integers(0, 400))
            b[p] = int(rng.integers(32, 127))
        target.write_bytes(bytes(b))
        try:
            got = conv2d.load(target).state_dict()
        except ValueError:
            outcomes["refused"] += 1
            continue
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"mutation {i}: {k}")
        outcomes["identical"] += 1
    assert outcomes["refused"] > 1000, outcomes


# 5. a diverged run is saved and loaded as it is ------------------------------------------------
def _diverged(spec=SPEC):
    layer = make_layer(spec)
    x, _ = random_inputs(spec)
    x[0, 0, 0, 0] = np.nan  # one NaN sample in a training batch
    layer.forward(x, training=True)
    state = layer.state_dict()
    assert np.isnan(state["running_mean"]).any()
    return layer


def _same_bits(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)) for k in a)


def test_a_diverged_layer_saves_and_loads_its_nan_state_bitwise_with_a_warning(tmp_path):
    layer = _diverged()
    with pytest.warns(RuntimeWarning, match=r"save: state\['running_mean'\]: \d+ NaN or infinite"):
        conv2d.save(layer, tmp_path / "nan.npz")
    with pytest.warns(RuntimeWarning, match=r"state\['running_mean'\]"):
        loaded = conv2d.load(tmp_path / "nan.npz")
    assert _same_bits(loaded.state_dict(), layer.state_dict())


def test_load_state_dict_takes_nan_and_infinite_values_with_a_warning():
    layer = _diverged()
    state = layer.state_dict()
    state["weights"][0, 0, 0, 0] = np.inf
    with pytest.warns(RuntimeWarning, match=r"state\['weights'\]: 1 NaN or infinite"):
        layer.load_state_dict(state)
    assert _same_bits(layer.state_dict(), state)
    with pytest.warns(RuntimeWarning):
        assert _same_bits(layer.to("reference").state_dict(), state)


def test_a_negative_running_variance_is_still_refused_as_malformed():
    layer = make_layer(SPEC)
    state = layer.state_dict()
    state["running_var"][0] = -1.0
    with pytest.raises(ValueError, match=r"state\['running_var'\]: expected values >= 0"):
        layer.load_state_dict(state)


# 6. save follows open's rules ---------------------------------------------------------------
def test_save_keeps_an_existing_files_mode_and_follows_the_umask_for_a_new_one(tmp_path):
    layer, path = saved(tmp_path)
    os.chmod(path, 0o644)
    conv2d.save(layer, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    old = os.umask(0o027)
    try:
        conv2d.save(layer, tmp_path / "new.npz")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.npz").stat().st_mode) == 0o640
    assert not list(tmp_path.glob("*.tmp"))


def test_save_removes_the_temporary_files_of_killed_saves_but_not_fresh_ones(tmp_path):
    layer, path = saved(tmp_path)
    stale, fresh = tmp_path / ".layer.npz.abc123.tmp", tmp_path / ".layer.npz.def456.tmp"
    for f in (stale, fresh):
        f.write_bytes(b"\0" * 1024)
    old = os.path.getmtime(stale) - 3600
    os.utime(stale, (old, old))
    other = tmp_path / ".other.npz.ghi789.tmp"
    other.write_bytes(b"x")
    os.utime(other, (old, old))
    conv2d.save(layer, path)
    assert not stale.exists() and fresh.exists() and other.exists()


def test_save_removes_a_fresh_temporary_file_whose_writer_no_longer_runs(tmp_path):
    import subprocess
    import sys

    layer, path = saved(tmp_path)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(done.stdout)  # a process that has exited
    dead, alive = tmp_path / f".layer.npz.{gone}.abc123.tmp", tmp_path / f".layer.npz.{os.getppid()}.def456.tmp"
    for f in (dead, alive):
        f.write_bytes(b"\0" * 1024)
    conv2d.save(layer, path)
    assert not dead.exists() and alive.exists()  # fresh, but its writer is gone / still runs


def test_save_through_a_symlink_writes_the_file_it_names(tmp_path):
    layer, path = saved(tmp_path)
    link = tmp_path / "link.npz"
    link.symlink_to(path)
    other = make_layer(SPEC, seed=5)
    conv2d.save(other, link)
    assert link.is_symlink()
    np.testing.assert_array_equal(conv2d.load(path).state_dict()["weights"], other.state_dict()["weights"])


# 7, 8. Spec fields checked where they are used ----------------------------------------------
@pytest.mark.parametrize("epsilon", [1e-46, 1e300])
def test_bn_epsilon_is_checked_in_the_compute_dtype(epsilon):
    with pytest.raises(ValueError, match="LayerSpec.bn_epsilon: .* in float32, the compute type of float32"):
        dataclasses.replace(SPEC, bn_epsilon=epsilon)
    assert dataclasses.replace(SPEC, bn_epsilon=1e-46, dtype="float64").bn_epsilon == 1e-46


@pytest.mark.parametrize("changes, field", [(dict(out_channels=2**31 - 1, kernel=5), "out_channels"),
                                            (dict(padding=200000, in_height=1, in_width=1, kernel=1), "padding"),
                                            (dict(batch_size=10**9, in_height=512, in_width=512), "batch_size")])
def test_a_spec_no_call_could_hold_names_its_field(changes, field):
    with pytest.raises(ValueError, match=rf"^LayerSpec\.{field}: .* would hold \d+ values, more than"):
        dataclasses.replace(SPEC, **changes)


# 9. A layer shared between threads -----------------------------------------------------------
def test_a_layer_shared_between_threads_runs_each_call_whole():
    layer = make_layer(SPEC)
    states = [make_layer(SPEC, seed=s).state_dict() for s in (1, 2)]
    x, _ = random_inputs(SPEC)
    wants = []
    for state in states:
        layer.load_state_dict(state)
        wants.append(layer.evaluate(x))
    outputs, stop = [], threading.Event()

    def loader():
        i = 0
        while not stop.is_set():
            layer.load_state_dict(states[i % 2])
            i += 1

    def evaluator():
        for _ in range(300):
            outputs.append(layer.evaluate(x))

    threads = [threading.Thread(target=loader), threading.Thread(target=evaluator)]
    for t in threads:
        t.start()
    threads[1].join()
    stop.set()
    threads[0].join()
    mixed = [y for y in outputs if not any(np.array_equal(y, w) for w in wants)]
    assert not mixed, f"{len(mixed)} of {len(outputs)} outputs mix two states"


# 10. Clear errors -----------------------------------------------------------------------------
def test_an_unhashable_backend_name_gets_a_clear_error():
    with pytest.raises(ValueError, match=r"backend: expected one of \['reference', 'cpu', 'cuda'\], got \['x'\]"):
        Conv2d(SPEC, backend=["x"])


def test_state_keys_of_mixed_types_are_named_not_sorted():
    layer = make_layer(SPEC)
    state = dict(layer.state_dict())
    state[1] = np.zeros(1)
    state[(2,)] = np.zeros(1)
    with pytest.raises(KeyError, match=r"unexpected \['\(2,\)', '1'\]"):
        layer.load_state_dict(state)


# 11. The tolerance model of a norm over few or equal values ---------------------------------
def _against_float64(spec, x, dy, state):
    from conv2d.dtypes import storage_dtype

    st = storage_dtype(spec.dtype)
    ours = Conv2d(spec)
    ours.load_state_dict({k: v.astype(ours.state_dict()[k].dtype) for k, v in state.items()})
    ref = Conv2d(dataclasses.replace(spec, dtype="float64"))
    ref.load_state_dict(state)
    y = ours.forward(x.astype(st))
    d_x = ours.backward_full(x.astype(st), dy.astype(st))
    x64 = x.astype(st).astype(np.float64)
    dy64 = dy.astype(st).astype(np.float64)
    return (y, ref.forward(x64)), (d_x, ref.backward_full(x64, dy64)), (x64, dy64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_norm_over_two_values_is_within_the_conditioned_tolerance(dtype):
    from conv2d.testing import conditioning_scales, reduction_lengths, relative_error
    from conv2d.dtypes import tolerance

    spec = LayerSpec(batch_size=2, in_height=1, in_width=1, in_channels=3, out_channels=4, kernel=1,
                     activation="tanh", normalization="batch_norm", dtype=dtype)
    tol = tolerance(spec.dtype, reduction_lengths(spec)["d_x"])
    plain = []
    for seed in range(10):
        state = {k: v.astype(np.float64) for k, v in make_layer(dataclasses.replace(spec, dtype="float64"),
                                                                seed).state_dict().items()}
        rng = np.random.default_rng(seed)
        x, dy = rng.standard_normal((2, 1, 1, 3)), rng.standard_normal((2, 1, 1, 4))
        _, (d_x, want), (x64, dy64) = _against_float64(spec, x, dy, state)
        scale = conditioning_scales(spec, state, x64, dy64, True)["d_x"]
        assert relative_error(d_x, want, scale) <= tol
        plain.append(relative_error(d_x, want))
    # Measured against max|d_x| alone (d_z cancels to eps-small with two values) it fails:
    assert max(plain) > tol


def test_a_constant_channel_is_within_the_conditioned_tolerance():
    from conv2d.testing import conditioning_scales, reduction_lengths, relative_error
    from conv2d.dtypes import tolerance

    spec = LayerSpec(batch_size=3, in_height=4, in_width=4, in_channels=2, out_channels=3, kernel=3, padding=1,
                     activation="identity", normalization="batch_norm", dtype="float32")
    state = {k: v.astype(np.float64) for k, v in make_layer(dataclasses.replace(spec, dtype="float64")).state_dict()
             .items()}
    state["weights"][1] = 0.0  # channel 1 is its bias everywhere: variance 0, inv_std = 1/sqrt(eps)
    state["bias"][1] = 0.7
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 4, 4, 2)), rng.standard_normal((3, 4, 4, 3))
    (y, want), _, (x64, dy64) = _against_float64(spec, x, dy, state)
    scale = conditioning_scales(spec, state, x64, dy64, True)["y"]
    tol = tolerance(spec.dtype, reduction_lengths(spec)["y"])
    assert relative_error(y, want, scale) <= tol
    # The channel's statistics are summed in float64 (reference.norm.wide_mean): its mean is
    # its value, its variance 0, and it normalises to beta exactly, as in float64.
    np.testing.assert_array_equal(y[..., 1], np.float32(state["beta"][1]))
