"""conv2d.torch.graphs.CallGraphs, the policy of the module's CUDA graph replays, on the CPU:
which calls run eagerly, which are captured and which replay, with the capture stood in
for (the graphs themselves, bitwise against launched steps, are tested on the GPU in
tests/test_torch_graphs_cuda.py)."""

import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra brings it)")

from conv2d import LayerSpec  # noqa: E402
from conv2d.torch.graphs import CallGraphs  # noqa: E402


class FakeGraph:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def replay(self):
        self.log.append(("replay", self.name))


class Policy(CallGraphs):
    """CallGraphs with the capture stood in for: a capture calls `call` (as a real one
    records it) and gives a graph that logs its replays, or fails when told."""

    def __init__(self, fail=(), **kw):
        self.log, self.fail = [], set(fail)
        spec = LayerSpec(batch_size=None, in_height=3, in_width=3, in_channels=2, out_channels=4, kernel=3,
                         normalization="batch_norm", dtype="bfloat16")
        fn = types.SimpleNamespace(spec=spec, follow=lambda t: self.log.append(("follow",)),
                                   release=lambda resources: None)
        super().__init__(fn, torch.device("cpu"), **kw)
        self._capturing = None

    def _capture(self, call):
        self.log.append(("capture", self._capturing))
        resources = call()
        if self._capturing in self.fail:
            return None, None
        return FakeGraph(self.log, self._capturing), resources

    def call(self, key):
        self._capturing = key

        def run():
            self.log.append(("call", key))
            return f"plan of {key}"
        self.run(key, run, None)
        return self.log


def test_a_key_runs_eagerly_once_then_is_captured_and_replayed():
    g = Policy()
    for _ in range(3):
        g.call("a")
    assert g.log == [("call", "a"), ("capture", "a"), ("call", "a"), ("follow",), ("replay", "a"),
                     ("follow",), ("replay", "a")]
    assert g.counts == {"eager": 1, "captured": 1, "replayed": 1, "failed": 0}  # the capturing call: "captured"


def test_keys_are_counted_apart():
    g = Policy()
    for key in "abab":
        g.call(key)
    assert g.counts == {"eager": 2, "captured": 2, "replayed": 0, "failed": 0}


def test_more_sightings_delay_the_capture():
    g = Policy(sightings=3)
    for _ in range(4):
        g.call("a")
    assert g.counts == {"eager": 2, "captured": 1, "replayed": 1, "failed": 0}


def test_a_key_whose_capture_failed_runs_eagerly_from_then_on():
    g = Policy(fail={"a"})
    for _ in range(5):
        g.call("a")
    assert g.counts == {"eager": 4, "captured": 0, "replayed": 0, "failed": 1}  # and one call after the failure
    assert [e for e in g.log if e[0] == "capture"] == [("capture", "a")]
    assert ("replay", "a") not in g.log


def test_at_most_capacity_graphs_are_kept_the_least_recently_used_dropped():
    g = Policy(capacity=2)
    for key in "aabbbacc":  # "b" (replayed once) is the least recently used when "c" is captured
        g.call(key)
    assert list(g._graphs) == ["a", "c"]
    g.log.clear()
    g.call("b")  # a dropped graph's key starts over: one eager call, then a capture
    g.call("b")
    assert g.log == [("call", "b"), ("capture", "b"), ("call", "b"), ("follow",), ("replay", "b")]


def test_a_graph_dropped_without_a_replay_doubles_the_sightings():
    g = Policy(capacity=1)
    for key in "aabb":  # "a" is dropped unreplayed when "b" is captured
        g.call(key)
    assert g.sightings == 4
    for key in "ccc":
        g.call(key)
    assert g.counts["captured"] == 2  # "c" only after its fourth call
    g.call("c")
    assert g.counts["captured"] == 3 and g.sightings == 8  # "b" went unreplayed too


def test_the_default_keeps_every_graph_of_a_module_called_twice_a_step():
    """The keys an H200 step loop gave a module called twice a step (forward, forward,
    backward, backward): three settling steps, then two sets of four that alternate. Every
    graph captured is replayed before it could be dropped, so the repeats a capture waits
    for stay at two (with 8 graphs kept, the warm-up's dropped graph doubled them)."""
    g = Policy()
    a, b = [11, 5, 12, 13], [14, 15, 16, 17]
    for key in [0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 9, 10] + (a + b) * 3:
        g.call(key)
    assert g.sightings == 2
    g.log.clear()
    for key in a + b:
        g.call(key)
    assert [e for e in g.log if e[0] != "follow"] == [("replay", key) for key in a + b]


def test_a_graph_keeps_what_its_capture_call_returned():
    g = Policy()
    g.call("a")
    g.call("a")
    assert g._graphs["a"][1] == "plan of a"


@pytest.mark.parametrize("capacity, sightings", [(0, 2), (4, 0)])
def test_capacity_and_sightings_below_one_are_refused(capacity, sightings):
    with pytest.raises(ValueError, match="capacity and sightings: expected ints >= 1"):
        Policy(capacity=capacity, sightings=sightings)


def test_new_gradients_have_the_backends_gradient_layout():
    g = Policy()
    grads = g.new_gradients(torch.empty(1, dtype=torch.bfloat16))
    assert {k: (tuple(t.shape), t.dtype) for k, t in grads.items()} == {
        "weights": ((4, 3, 3, 2), torch.bfloat16), "bias": ((4,), torch.bfloat16),
        "gamma": ((4,), torch.float32), "beta": ((4,), torch.float32)}
