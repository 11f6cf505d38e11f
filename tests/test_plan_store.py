"""conv2d.cuda.plan_store: autotuned cuDNN plan choices kept in a JSON file across
processes (the file handling; tests/test_cuda_capture.py checks a second process reusing a
first one's choices on a GPU)."""

import json

import pytest

from conv2d.cuda import plan_store
from conv2d.cuda.plan_store import ENV, PlanStore
from conv2d.spec import DType


@pytest.fixture(autouse=True)
def no_process_store(monkeypatch):
    """Each test chooses the process's store itself (none chosen, no environment variable)."""
    monkeypatch.setattr(plan_store, "_CURRENT", [])
    monkeypatch.delenv(ENV, raising=False)


KEY = PlanStore.key(device="NVIDIA H100 (sm_90)", cudnn=91900, frontend="1.28.0", op="forward",
                    convolution=((4, 9, 9, 8), 16, (3, 3), DType.FLOAT32), tf32=False)


def test_a_stored_choice_is_read_back_by_another_store_over_the_same_file(tmp_path):
    path = tmp_path / "plans.json"
    PlanStore(path).put(KEY, 7, {"TILE_SIZE": 2, "SPLIT_K": 0})
    other = PlanStore(path)
    assert other.get(KEY) == (7, {"TILE_SIZE": 2, "SPLIT_K": 0})
    assert other.counts == {"hits": 1, "misses": 0}


def test_a_key_never_stored_is_a_miss(tmp_path):
    store = PlanStore(tmp_path / "plans.json")
    assert store.get(KEY) is None and store.counts == {"hits": 0, "misses": 1}
    assert not (tmp_path / "plans.json").exists()  # nothing written by a lookup


def test_a_put_keeps_what_another_process_stored_since_this_store_was_opened(tmp_path):
    path = tmp_path / "plans.json"
    ours, theirs = PlanStore(path), PlanStore(path)
    other_key = KEY.replace('"forward"', '"backward_data"')
    theirs.put(other_key, 3, {})
    ours.put(KEY, 7, {})
    assert PlanStore(path).get(other_key) == (3, {}) and PlanStore(path).get(KEY) == (7, {})


def test_the_key_names_its_parts_readably_and_is_the_same_for_equal_parts():
    assert json.loads(KEY) == {"convolution": [[4, 9, 9, 8], 16, [3, 3], "float32"], "cudnn": 91900,
                               "device": "NVIDIA H100 (sm_90)", "frontend": "1.28.0", "op": "forward", "tf32": False}
    assert PlanStore.key(op="forward", tf32=False) == PlanStore.key(tf32=False, op="forward")


def test_the_file_is_replaced_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "plans.json"  # a missing folder is made
    store = PlanStore(path)
    store.put(KEY, 1, {})
    store.put(KEY, 2, {"K": 1})
    assert json.loads(path.read_text()) == {"format": 1, "plans": {KEY: {"engine": 2, "knobs": {"K": 1}}}}
    assert [p.name for p in path.parent.iterdir()] == ["plans.json"]


@pytest.mark.parametrize("content, expected", [
    ("not json", "does not read as JSON"),
    ("[1, 2]", "got list"),
    ('{"format": 2, "plans": {}}', "got format 2"),
    ('{"format": 1, "plans": {"k": {"engine": "7", "knobs": {}}}}', "expected each plan as"),
], ids=["not-json", "not-an-object", "another-format", "bad-entry"])
def test_a_file_that_is_not_a_plan_store_is_refused_naming_it(tmp_path, content, expected):
    path = tmp_path / "plans.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=expected) as e:
        PlanStore(path)
    assert str(path) in str(e.value) and ENV in str(e.value)
    assert path.read_text() == content  # left as it was


def test_the_process_store_is_the_environment_variables_until_use_chooses_another(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "env.json"))
    assert plan_store.current().path == tmp_path / "env.json"
    assert plan_store.use(tmp_path / "mine.json").path == tmp_path / "mine.json"
    assert plan_store.current().path == tmp_path / "mine.json"
    assert plan_store.use(None) is None and plan_store.current() is None


def test_without_the_environment_variable_there_is_no_store():
    assert plan_store.current() is None
