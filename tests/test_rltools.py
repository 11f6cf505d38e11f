"""conv2d.rltools: rl_tools' HDF5 layout for a conv2d layer, written and read back, and a
file written by h5py directly in the documented layout."""

import dataclasses

import numpy as np
import pytest

h5py = pytest.importorskip("h5py", reason="h5py is not installed (the test extra brings it)")

from conftest import make_layer, random_inputs, small_layer_spec  # noqa: E402
from conv2d import Conv2d, LayerSpec, rltools  # noqa: E402

SPEC = small_layer_spec(in_channels=2, kernel=(3, 2), stride=(2, 1))


def trained(spec):
    layer = make_layer(spec)
    x, dy = random_inputs(spec)
    layer.forward(x)
    layer.backward(x, dy)
    return layer


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("norm", ["none", "batch_norm", "layer_norm"])
def test_a_layer_round_trips_through_rl_tools_hdf5_bitwise(tmp_path, norm, dtype):
    spec = dataclasses.replace(SPEC, normalization=norm, dtype=dtype)
    layer = trained(spec)
    rltools.save(layer, tmp_path / "l.h5")
    back = rltools.load(tmp_path / "l.h5", into=Conv2d(spec))
    for got, want in ((back.state_dict(), layer.state_dict()), (back.grad_dict(), layer.grad_dict())):
        for k in want:
            np.testing.assert_array_equal(got[k].view(np.uint8), want[k].view(np.uint8), err_msg=k)


def test_the_file_has_rl_tools_groups_datasets_and_string_attributes(tmp_path):
    rltools.save(trained(SPEC), tmp_path / "l.h5")
    with h5py.File(tmp_path / "l.h5") as f:
        g = f["layer"]
        assert sorted(g.keys()) == ["beta", "biases", "gamma", "running_mean", "running_var", "weights"]
        assert sorted(g["weights"].keys()) == ["gradient", "gradient_first_order_moment",
                                               "gradient_second_order_moment", "parameters"]
        assert g["weights/parameters"].shape == (4, 3, 2, 2) and g["weights/parameters"].dtype == np.float32
        assert dict(g.attrs) == {"type": "conv2d", "output_channels": "4", "input_channels": "2",
                                 "kernel_height": "3", "kernel_width": "2", "stride_h": "2", "stride_w": "1",
                                 "padding_h": "1", "padding_w": "1", "activation_function": "RELU",
                                 "normalization": "BATCH_NORM", "conv2d_weight_layout": "ohwi"}
        ds = g["running_var"]
        assert (ds.attrs["type"], ds.attrs["num_dims"], ds.attrs["dim_0"]) == ("tensor", "1", "4")


def _write_by_hand(path, weights, extra_attrs=True):
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as f:
        g = f.create_group("actor_conv")
        attrs = {"type": "conv2d", "output_channels": "4", "input_channels": "2", "kernel_height": "3",
                 "kernel_width": "2", "stride_h": "2", "stride_w": "1", "padding_h": "1", "padding_w": "1"}
        if extra_attrs:
            attrs.update(activation_function="RELU", normalization="BATCH_NORM")
        for k, v in attrs.items():
            g.attrs[k] = v
        g.create_group("weights").create_dataset("parameters", data=weights)
        values = {}
        for sub in ("biases", "gamma", "beta"):
            values[sub] = rng.uniform(0.5, 1.5, 4).astype(np.float32)
            g.create_group(sub).create_dataset("parameters", data=values[sub])
        values["running_mean"] = rng.normal(size=4).astype(np.float32)
        values["running_var"] = rng.uniform(0.5, 2, 4).astype(np.float32)
        g.create_dataset("running_mean", data=values["running_mean"])
        g.create_dataset("running_var", data=values["running_var"])
    return values


@pytest.mark.parametrize("layout", ["ohwi", "oihw"])
def test_a_file_written_by_h5py_in_the_documented_layout_reads_correctly(tmp_path, layout):
    w = np.random.default_rng(0).standard_normal((4, 3, 2, 2)).astype(np.float32)  # (OC, KH, KW, IC)
    stored = w if layout == "ohwi" else np.ascontiguousarray(w.transpose(0, 3, 1, 2))  # older (OC, IC, KH, KW)
    values = _write_by_hand(tmp_path / "f.h5", stored, extra_attrs=layout == "ohwi")
    layer = rltools.load(tmp_path / "f.h5", into=Conv2d(SPEC), name="actor_conv")
    state = layer.state_dict()
    np.testing.assert_array_equal(state["weights"], w)
    np.testing.assert_array_equal(state["bias"], values["biases"])
    for k in ("gamma", "beta", "running_mean", "running_var"):
        np.testing.assert_array_equal(state[k], values[k], err_msg=k)
    assert not any(g.any() for g in layer.grad_dict().values())  # no gradients in the file


def test_weights_whose_shape_fits_both_layouts_need_the_callers_word_in_a_foreign_file(tmp_path):
    spec = dataclasses.replace(SPEC, in_channels=3, kernel=3)
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    layer = make_layer(spec)
    layer.load_state_dict({**layer.state_dict(), "weights": w})
    rltools.save(layer, tmp_path / "l.h5")
    with h5py.File(tmp_path / "l.h5", "a") as f:  # as rl_tools writes it: no marker
        del f["layer"].attrs["conv2d_weight_layout"]
    target = Conv2d(spec)
    with pytest.raises(ValueError, match="both \\(OC, KH, KW, IC\\) and the older"):
        rltools.load(tmp_path / "l.h5", into=target)
    np.testing.assert_array_equal(rltools.load(tmp_path / "l.h5", into=target, weight_layout="ohwi")
                                  .state_dict()["weights"], w)
    old = rltools.load(tmp_path / "l.h5", into=Conv2d(spec), weight_layout="oihw").state_dict()["weights"]
    np.testing.assert_array_equal(old, w.transpose(0, 2, 3, 1))


def test_a_group_that_does_not_fit_the_layer_is_refused_and_changes_nothing(tmp_path):
    rltools.save(trained(SPEC), tmp_path / "l.h5")
    other = make_layer(dataclasses.replace(SPEC, stride=1, activation="tanh"))
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"differs from the one loaded into in stride: group \(2, 1\), layer \(1, 1\); "
                                         r"activation"):
        rltools.load(tmp_path / "l.h5", into=other)
    for k, v in other.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_what_rl_tools_cannot_hold_is_refused_when_writing_and_no_file_is_made(tmp_path):
    with pytest.raises(ValueError, match="rl_tools has no 'gelu'"):
        rltools.save(make_layer(dataclasses.replace(SPEC, activation="gelu")), tmp_path / "b.h5")
    assert list(tmp_path.iterdir()) == []


def test_a_cumulative_batch_norm_is_refused_since_rl_tools_keeps_no_batch_count(tmp_path):
    spec = dataclasses.replace(SPEC, normalization="batch_norm", bn_momentum=None)
    with pytest.raises(ValueError, match="bn_momentum: rl_tools' conv2d layer keeps no batch count"):
        rltools.save(make_layer(spec), tmp_path / "b.h5")
    assert list(tmp_path.iterdir()) == []


def test_spec_from_group_takes_the_input_size_from_the_caller(tmp_path):
    rltools.save(trained(SPEC), tmp_path / "l.h5")
    with h5py.File(tmp_path / "l.h5") as f:
        spec = rltools.spec_from_group(f["layer"], 6, 5, batch_size=2, dtype="float32")
    assert spec == SPEC


# Reliability II, item 5: what rl_tools' loader requires, and this library's own files ----------
def test_a_files_own_marker_reads_the_readmes_ambiguous_layer_back_without_weight_layout(tmp_path):
    spec = LayerSpec(batch_size=8, in_height=16, in_width=16, in_channels=3, out_channels=8, kernel=3, stride=1,
                     padding=1, activation="relu", normalization="batch_norm", dtype="float32")  # the README's
    layer = make_layer(spec)
    rltools.save(layer, tmp_path / "layer.h5")
    back = rltools.load(tmp_path / "layer.h5", into=Conv2d(spec))
    np.testing.assert_array_equal(back.state_dict()["weights"], layer.state_dict()["weights"])
    with pytest.raises(ValueError, match="the file says its weights are"):
        rltools.load(tmp_path / "layer.h5", into=Conv2d(spec), weight_layout="oihw")


@pytest.mark.parametrize("gradient", [True, False])
def test_every_parameter_has_the_gradient_and_both_adam_moments_rl_tools_opens(tmp_path, gradient):
    layer = trained(SPEC)
    rltools.save(layer, tmp_path / "l.h5", gradient=gradient)
    grads = layer.grad_dict()
    with h5py.File(tmp_path / "l.h5") as f:
        for name, sub in (("weights", "weights"), ("bias", "biases"), ("gamma", "gamma"), ("beta", "beta")):
            g = f["layer"][sub]
            assert sorted(g.keys()) == ["gradient", "gradient_first_order_moment", "gradient_second_order_moment",
                                        "parameters"]
            np.testing.assert_array_equal(g["gradient"][()], grads[name] if gradient else 0 * grads[name])
            assert not g["gradient_first_order_moment"][()].any() and not g["gradient_second_order_moment"][()].any()


def test_adams_moments_are_written_from_and_read_into_the_optimizer(tmp_path):
    from conv2d.optim import Adam

    layer = trained(SPEC)
    opt = Adam(layer)
    opt.step()
    rltools.save(layer, tmp_path / "l.h5", optimizer=opt)
    other = Conv2d(SPEC)
    other_opt = Adam(other)
    rltools.load(tmp_path / "l.h5", into=other, optimizer=other_opt)
    want, got = opt.state_dict()["arrays"], other_opt.state_dict()["arrays"]
    assert any(v.any() for v in want.values())
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_loading_moments_needs_them_in_the_file_and_changes_nothing_when_absent(tmp_path):
    from conv2d.optim import Adam, SGD

    rltools.save(trained(SPEC), tmp_path / "l.h5")
    with h5py.File(tmp_path / "l.h5", "a") as f:
        del f["layer/gamma/gradient_second_order_moment"]
    target = make_layer(SPEC, seed=5)
    before = target.state_dict()
    with pytest.raises(ValueError, match="gamma/ lacks"):
        rltools.load(tmp_path / "l.h5", into=target, optimizer=Adam(target))
    for k, v in target.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    with pytest.raises(TypeError, match="expected a conv2d.optim.Adam"):
        rltools.load(tmp_path / "l.h5", into=target, optimizer=SGD(target, lr=0.1))
    with pytest.raises(ValueError, match="none of which is the layer"):
        rltools.load(tmp_path / "l.h5", into=target, optimizer=Adam(Conv2d(SPEC)))


def test_a_bias_free_layer_is_written_with_zero_biases_and_reads_back(tmp_path):
    spec = dataclasses.replace(SPEC, bias=False)
    layer = trained(spec)
    rltools.save(layer, tmp_path / "l.h5")
    with h5py.File(tmp_path / "l.h5") as f:
        assert not f["layer/biases/parameters"][()].any()
    back = rltools.load(tmp_path / "l.h5", into=Conv2d(spec))
    np.testing.assert_array_equal(back.state_dict()["weights"], layer.state_dict()["weights"])
    with_bias = rltools.load(tmp_path / "l.h5", into=Conv2d(SPEC)).state_dict()
    assert not with_bias["bias"].any()


def test_nonzero_biases_are_refused_by_a_bias_free_layer_with_a_message_about_biases(tmp_path):
    rltools.save(trained(SPEC), tmp_path / "l.h5")
    with pytest.raises(ValueError, match="holds nonzero biases; the bias=False layer"):
        rltools.load(tmp_path / "l.h5", into=Conv2d(dataclasses.replace(SPEC, bias=False)))


def test_a_norm_group_a_layer_lacks_is_named_with_the_layers_normalization(tmp_path):
    rltools.save(trained(SPEC), tmp_path / "l.h5")
    with h5py.File(tmp_path / "l.h5", "a") as f:
        f["layer"].attrs["normalization"] = "NONE"
    with pytest.raises(ValueError, match="holds gamma/, which a layer with normalization 'none' does not have"):
        rltools.load(tmp_path / "l.h5", into=Conv2d(dataclasses.replace(SPEC, normalization="none")))


# Reliability II, items 1 and 2: a crafted file reads nothing but itself ----------------------------
def _saved_file(tmp_path):
    path = tmp_path / "l.h5"
    rltools.save(trained(SPEC), path)
    return path


def _replace_weights(path, make):
    """Replace layer/weights/parameters with what `make(group, name)` creates there."""
    with h5py.File(path, "a") as f:
        g = f["layer/weights"]
        del g["parameters"]
        make(g, "parameters")


def _refused(path, match):
    target = make_layer(SPEC, seed=9)
    before = target.state_dict()
    with pytest.raises(ValueError, match=match):
        rltools.load(path, into=target)
    for k, v in target.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_a_dataset_with_external_raw_storage_is_refused_unread(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(np.arange(24, dtype=np.float32).tobytes())
    path = _saved_file(tmp_path)
    _replace_weights(path, lambda g, n: g.create_dataset(n, shape=(4, 3, 2, 2), dtype=np.float32,
                                                         external=[(str(secret), 0, 4 * 48)]))
    _refused(path, "weights/parameters: stored in external raw files")


def test_a_virtual_dataset_over_another_file_is_refused(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["w"] = np.ones((4, 3, 2, 2), np.float32)
    path = _saved_file(tmp_path)

    def virtual(g, n):
        layout = h5py.VirtualLayout(shape=(4, 3, 2, 2), dtype=np.float32)
        layout[...] = h5py.VirtualSource(str(tmp_path / "missing.h5"), "w", shape=(4, 3, 2, 2))
        g.create_virtual_dataset(n, layout, fillvalue=0)
    _replace_weights(path, virtual)
    _refused(path, "a virtual dataset")


@pytest.mark.parametrize("link", ["soft", "dangling", "loop", "external"])
def test_links_are_refused_unfollowed(tmp_path, link):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["w"] = np.ones((4, 3, 2, 2), np.float32)
    path = _saved_file(tmp_path)
    with h5py.File(path, "a") as f:
        f["copy"] = f["layer/weights/parameters"][()]
    make = {"soft": lambda g, n: g.__setitem__(n, h5py.SoftLink("/copy")),
            "dangling": lambda g, n: g.__setitem__(n, h5py.SoftLink("/nothing/here")),
            "loop": lambda g, n: g.__setitem__(n, h5py.SoftLink("/layer/weights/parameters")),
            "external": lambda g, n: g.__setitem__(n, h5py.ExternalLink(str(other), "/w"))}[link]
    _replace_weights(path, make)
    _refused(path, "link; rl_tools files hold no links")


def test_the_layer_group_itself_may_not_be_a_link(tmp_path):
    path = _saved_file(tmp_path)
    with h5py.File(path, "a") as f:
        f["alias"] = h5py.SoftLink("/layer")
    with pytest.raises(ValueError, match="'alias' is a soft link"):
        rltools.load(path, into=Conv2d(SPEC), name="alias")


@pytest.mark.parametrize("shape", [(2 ** 31,), (2 ** 40,), (4, 3, 2, 3)])
def test_a_dataset_of_the_wrong_shape_is_refused_before_it_is_read(tmp_path, shape):
    path = _saved_file(tmp_path)
    _replace_weights(path, lambda g, n: g.create_dataset(n, shape=shape, dtype=np.float32))  # unallocated
    assert path.stat().st_size < 100_000
    _refused(path, "refused unread")


@pytest.mark.parametrize("dtype", [np.complex64, np.int32, h5py.string_dtype(), np.dtype([("a", np.float32)])])
def test_a_dataset_that_is_not_real_floating_point_is_refused(tmp_path, dtype):
    path = _saved_file(tmp_path)
    _replace_weights(path, lambda g, n: g.create_dataset(n, shape=(4, 3, 2, 2), dtype=dtype))
    _refused(path, "expected real floating point")


def test_a_group_where_a_dataset_belongs_is_refused(tmp_path):
    path = _saved_file(tmp_path)
    _replace_weights(path, lambda g, n: g.create_group(n))
    _refused(path, "a Group, expected a dataset")


def test_paths_that_are_no_hdf5_file_are_prompt_value_errors(tmp_path):
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    text = tmp_path / "text.h5"
    text.write_text("not hdf5")
    for p, match in ((fifo, "not a regular file"), (tmp_path, "not a regular file"), (text, "not an HDF5 file")):
        with pytest.raises(ValueError, match=match):
            rltools.load(p, into=Conv2d(SPEC))
    with pytest.raises(FileNotFoundError):
        rltools.load(tmp_path / "absent.h5", into=Conv2d(SPEC))


@pytest.mark.parametrize("option", [dict(groups=2, in_channels=2), dict(dilation=2),
                                    dict(padding_mode="reflect", padding=1), dict(padding_end=2, padding=1)])
def test_a_layer_rl_tools_cannot_express_is_refused(tmp_path, option):
    layer = make_layer(small_layer_spec(**{"in_channels": 2, "out_channels": 4, **option}))
    with pytest.raises(ValueError, match=f"{next(iter(option))}: rl_tools' conv2d layer has no"):
        rltools.save(layer, tmp_path / "layer.h5")
    assert not (tmp_path / "layer.h5").exists()
