"""save/load and the PyTorch layout conversion."""

import dataclasses
import json
import zipfile

import numpy as np
import pytest

import conv2d
from conftest import edit_header, make_layer, random_inputs, rewrite_npz, small_layer_spec
from conv2d import Conv2d, LayerSpec
from conv2d.torch_layout import state_from_torch, state_to_torch, weights_from_torch, weights_to_torch

SPEC = small_layer_spec(kernel=(3, 2), stride=(2, 1), activation="gelu")


def saved(tmp_path, spec=SPEC):
    layer = make_layer(spec)
    path = tmp_path / "layer.npz"
    conv2d.save(layer, path)
    return layer, path


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("norm", ["none", "batch_norm", "layer_norm"])
def test_save_then_load_gives_the_same_spec_state_and_outputs(tmp_path, norm, dtype):
    spec = dataclasses.replace(SPEC, normalization=norm, dtype=dtype)
    layer, path = saved(tmp_path, spec)
    loaded = conv2d.load(path)
    assert loaded.spec == spec
    for k, v in layer.state_dict().items():
        got = loaded.state_dict()[k]
        assert got.dtype == v.dtype
        np.testing.assert_array_equal(got.view(np.uint8), v.view(np.uint8), err_msg=k)
    x, _ = random_inputs(spec)
    np.testing.assert_array_equal(loaded.evaluate(x), layer.evaluate(x))


def test_a_cumulative_batch_norm_keeps_its_batch_count_through_a_file(tmp_path):
    spec = dataclasses.replace(SPEC, normalization="batch_norm", bn_momentum=None)
    layer = make_layer(spec)
    for seed in range(2):
        layer.forward(random_inputs(spec, seed=seed)[0], training=True)
    conv2d.save(layer, tmp_path / "layer.npz")
    loaded = conv2d.load(tmp_path / "layer.npz")
    assert loaded.spec.bn_momentum is None
    state = loaded.state_dict()
    assert state["num_batches_tracked"].shape == () and state["num_batches_tracked"] == 2
    x = random_inputs(spec, seed=5)[0]
    loaded.forward(x, training=True)
    layer.forward(x, training=True)
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)


def test_load_into_an_existing_layer_replaces_its_state(tmp_path):
    layer, path = saved(tmp_path)
    other = make_layer(SPEC, seed=9)
    assert conv2d.load(path, into=other) is other
    np.testing.assert_array_equal(other.state_dict()["weights"], layer.state_dict()["weights"])


def test_load_into_a_layer_of_another_spec_raises_and_leaves_it(tmp_path):
    _, path = saved(tmp_path)
    other = make_layer(dataclasses.replace(SPEC, out_channels=5))
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"differs from the one loaded into in out_channels: file 4, layer 5$"):
        conv2d.load(path, into=other)
    np.testing.assert_array_equal(other.state_dict()["weights"], before["weights"])


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_a_layer_saved_at_one_batch_size_loads_into_a_layer_planned_for_another(tmp_path, backend):
    if backend == "cuda":
        from conftest import HAVE_GPU, NO_GPU_REASON
        if not HAVE_GPU:
            pytest.skip(NO_GPU_REASON)
    layer, path = saved(tmp_path)
    actor = Conv2d(dataclasses.replace(SPEC, batch_size=1), backend)
    conv2d.load(path, into=actor)
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(actor.state_dict()[k], v, err_msg=k)
    assert conv2d.load(path, backend=backend).spec == SPEC


def test_a_spec_mismatch_names_only_the_fields_that_differ(tmp_path):
    _, path = saved(tmp_path)
    other = make_layer(dataclasses.replace(SPEC, batch_size=7, activation="relu", bn_momentum=0.3))
    with pytest.raises(ValueError) as info:
        conv2d.load(path, into=other)
    message = str(info.value)
    assert "activation" in message and "bn_momentum" in message
    assert "batch_size" not in message and "in_channels" not in message and len(message) < 300


def test_a_truncated_file_raises_a_clear_error(tmp_path):
    _, path = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable conv2d file"):
        conv2d.load(path)


def test_a_tampered_array_fails_its_checksum(tmp_path):
    _, path = saved(tmp_path)

    def change(a):
        a["state.weights"][0, 0, 0, 0] += 1
    rewrite_npz(path, change)
    with pytest.raises(ValueError, match="array 'weights': checksum mismatch"):
        conv2d.load(path)


def test_a_tampered_spec_is_reported(tmp_path):
    _, path = saved(tmp_path)
    edit_header(path, lambda h: h["spec"].__setitem__("kernel", [0, 0]))
    with pytest.raises(ValueError, match="header checksum mismatch"):
        conv2d.load(path)


def test_an_invalid_spec_under_a_valid_header_checksum_is_reported(tmp_path):
    _, path = saved(tmp_path)
    edit_header(path, lambda h: h["spec"].__setitem__("kernel", [0, 0]), keep_checksum=True)
    with pytest.raises(ValueError, match="invalid spec in header: LayerSpec.kernel"):
        conv2d.load(path)


def test_a_missing_array_is_reported(tmp_path):
    _, path = saved(tmp_path)
    rewrite_npz(path, lambda a: a.pop("state.gamma"))
    with pytest.raises(ValueError, match="header lists arrays"):
        conv2d.load(path)


def test_a_file_of_another_kind_is_rejected(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, a=np.zeros(3))
    with pytest.raises(ValueError, match=r"not a conv2d file \(no header"):
        conv2d.load(path)
    path.write_text("hello")
    with pytest.raises(ValueError, match="not a readable conv2d file"):
        conv2d.load(path)


def test_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        conv2d.load(tmp_path / "nope.npz")


def test_the_file_is_a_plain_npz_with_a_json_header(tmp_path):
    layer, path = saved(tmp_path)
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == sorted(["header.npy"] + [f"state.{k}.npy" for k in layer.state_dict()])
    with np.load(path) as f:
        header = json.loads(f["header"].tobytes())
    assert header["format"] == "conv2d" and header["version"] == 2
    assert LayerSpec.from_dict(header["spec"]) == SPEC


def test_weights_layout_round_trips():
    w = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)  # (OC, KH, KW, IC)
    t = weights_to_torch(w)
    assert t.shape == (2, 5, 3, 4) and t[1, 4, 2, 3] == w[1, 2, 3, 4]
    np.testing.assert_array_equal(weights_from_torch(t), w)


def test_state_names_round_trip_and_num_batches_tracked_is_ignored():
    state = make_layer(SPEC).state_dict()
    t = state_to_torch(state)
    assert set(t) == {"conv.weight", "conv.bias", "norm.weight", "norm.bias", "norm.running_mean", "norm.running_var"}
    back = state_from_torch({**t, "norm.num_batches_tracked": np.array(3)})
    for k, v in state.items():
        np.testing.assert_array_equal(back[k], v)


def test_torch_modules_loaded_from_our_state_compute_our_eval_output():
    torch = pytest.importorskip("torch", reason="PyTorch (the oracle) is not installed")
    spec = dataclasses.replace(SPEC, dtype="float64")
    layer = make_layer(spec)
    t = state_to_torch(layer.state_dict())
    conv = torch.nn.Conv2d(3, 4, spec.kernel, spec.stride, spec.padding).double()
    bn = torch.nn.BatchNorm2d(4, eps=spec.bn_epsilon).double().eval()
    conv.load_state_dict({k.split(".")[1]: torch.from_numpy(v) for k, v in t.items() if k.startswith("conv.")})
    bn.load_state_dict({k.split(".")[1]: torch.from_numpy(v) for k, v in t.items() if k.startswith("norm.")}, strict=False)
    x, _ = random_inputs(spec)
    with torch.no_grad():
        want = torch.nn.functional.gelu(bn(conv(torch.from_numpy(x).permute(0, 3, 1, 2)))).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(layer.evaluate(x), want, rtol=1e-12, atol=1e-12)
    back = state_from_torch({**{f"conv.{k}": v for k, v in conv.state_dict().items()},
                             **{f"norm.{k}": v for k, v in bn.state_dict().items()}})
    np.testing.assert_array_equal(back["weights"], layer.state_dict()["weights"])
