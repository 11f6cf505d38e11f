"""conv2d.rltools: rl_tools' HDF5 layout for a conv2d layer, written and read back, and a
file written by h5py directly in the documented layout."""

import dataclasses

import numpy as np
import pytest

h5py = pytest.importorskip("h5py", reason="h5py is not installed (the test extra brings it)")

from conftest import make_layer, random_inputs  # noqa: E402
from conv2d import Conv2d, LayerSpec, rltools  # noqa: E402

SPEC = LayerSpec(batch_size=2, in_height=6, in_width=5, in_channels=2, out_channels=4, kernel=(3, 2),
                 stride=(2, 1), padding=1, activation="relu", normalization="batch_norm", dtype="float32")


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
    rltools.save(trained(SPEC), tmp_path / "l.h5", moments={"weights": {
        "gradient_first_order_moment": np.zeros(SPEC.weight_shape, np.float32),
        "gradient_second_order_moment": np.ones(SPEC.weight_shape, np.float32)}})
    with h5py.File(tmp_path / "l.h5") as f:
        g = f["layer"]
        assert sorted(g.keys()) == ["beta", "biases", "gamma", "running_mean", "running_var", "weights"]
        assert sorted(g["weights"].keys()) == ["gradient", "gradient_first_order_moment",
                                               "gradient_second_order_moment", "parameters"]
        assert g["weights/parameters"].shape == (4, 3, 2, 2) and g["weights/parameters"].dtype == np.float32
        assert dict(g.attrs) == {"type": "conv2d", "output_channels": "4", "input_channels": "2",
                                 "kernel_height": "3", "kernel_width": "2", "stride_h": "2", "stride_w": "1",
                                 "padding_h": "1", "padding_w": "1", "activation_function": "RELU",
                                 "normalization": "BATCH_NORM"}
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


def test_weights_whose_shape_fits_both_layouts_need_the_callers_word(tmp_path):
    spec = dataclasses.replace(SPEC, in_channels=3, kernel=3)
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    layer = make_layer(spec)
    layer.load_state_dict({**layer.state_dict(), "weights": w})
    rltools.save(layer, tmp_path / "l.h5")
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


def test_what_rl_tools_cannot_hold_is_refused_when_writing(tmp_path):
    with pytest.raises(ValueError, match="always have biases"):
        rltools.save(make_layer(dataclasses.replace(SPEC, bias=False)), tmp_path / "a.h5")
    with pytest.raises(ValueError, match="rl_tools has no 'gelu'"):
        rltools.save(make_layer(dataclasses.replace(SPEC, activation="gelu")), tmp_path / "b.h5")


def test_spec_from_group_takes_the_input_size_from_the_caller(tmp_path):
    rltools.save(trained(SPEC), tmp_path / "l.h5")
    with h5py.File(tmp_path / "l.h5") as f:
        spec = rltools.spec_from_group(f["layer"], 6, 5, batch_size=2, dtype="float32")
    assert spec == SPEC
