"""The module's eager CUDA calls, replayed as CUDA graphs when every address repeats.

A small layer's eager step is host-bound: the backend's Python and its launches cost more
host time than the GPU spends (docs/bench_cuda.md, the module table: launched). But a training loop
calls a layer with its tensors at the same addresses step after step, because torch's
caching allocator hands the same blocks back when the same sizes are asked for in the
same order. So the eager node (conv2d.torch.eager) keys each call by everything its
kernels read and write: the addresses of x, of the parameters and running statistics,
of the outputs and saved values (all allocated by the node before the call), the input
shape and the call's flags. The second call with a key is captured into a CUDA graph
(torch.cuda.CUDAGraph, on a side stream, thread-local capture mode) and every later one
replays it on torch's current stream: one launch in place of the Python, cuDNN's
executes and the kernel launches. This is torch.compile's "reduce-overhead" idea for one
op, without the copies in and out: nothing is copied, because a graph is only replayed
when the call's own tensors are at the captured addresses.

A replay runs the captured call's kernels with the same arguments, so its results are
bitwise the eager call's. What the key leaves out is the backend's own memory for the
call (its shape's plan: reduction scratch, cuDNN workspace, launch counters): the entry
keeps the `Saved.resources` of its capture, so that memory stays allocated while the
graph may run. Graphs are not used while torch's current stream is being captured (a
`torch.cuda.graph` of the caller's step: the calls go into that capture) nor for a
backend given a stream of its own; a call that fails to capture runs eagerly under its
key from then on.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch

from conv2d.dtypes import storage_dtype
from conv2d.state import grad_layout


COUNTS = ("eager", "captured", "replayed", "failed")  # CallGraphs.counts' keys, in this order


class CallGraphs:
    """CUDA graphs of one backend `Functions`' calls, keyed by the calls' addresses.

    `run(key, call)` does `call()` (a backend call that allocates nothing: its outputs
    were allocated by the caller, and `key` names every address and flag it depends on)
    or replays the graph captured from an earlier call with the same key. After a call
    that launched (or was captured), the backend lets go of the call's tensors
    (`Functions.release`), so that the caller's next step gets the same blocks from
    torch's allocator. `capacity`: graphs kept (least recently used dropped; 32: a
    module called twice a step has four keys a step, in two sets that alternate, and with
    8 the H200 dropped some before their first replay); `sightings`: calls with one key
    before it is captured (2: the first runs eagerly, which prepares the launches and
    cuDNN plans a capture may not build), doubled (up to 64) whenever a graph is dropped
    unreplayed. `counts`: how the calls went ("eager",
    "captured" (a capture and its first replay), "replayed" (a graph captured before),
    "failed": captures that failed, whose keys run eagerly from then on)."""

    def __init__(self, fn: Any, device: torch.device, capacity: int = 32, sightings: int = 2) -> None:
        if sightings < 1 or capacity < 1:
            raise ValueError(f"capacity and sightings: expected ints >= 1, got {capacity!r} and {sightings!r}")
        self.fn, self.device = fn, device
        self.capacity, self.sightings = capacity, sightings
        self.counts = dict.fromkeys(COUNTS, 0)
        self._graphs: OrderedDict[tuple, list] = OrderedDict()  # key -> [graph, resources, replays]
        self._seen: OrderedDict[tuple, int] = OrderedDict()  # key -> eager calls so far, -1: failed
        self._side: torch.cuda.Stream | None = None
        self._grads: list | None = None  # new_gradients' layout, made at its first call

    def new_gradients(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Uninitialised gradient tensors of the backend's gradient layout (the weights'
        (OC, KH, KW, IC)), in `like`'s dtype, float32 for the norm's, on its device (for
        graphs of one layer's functions: `fn.spec`)."""
        if self._grads is None:
            st = storage_dtype(self.fn.spec.dtype)
            self._grads = [(k, shape, dt == st) for k, (shape, dt) in grad_layout(self.fn.spec).items()]
        return {k: torch.empty(shape, dtype=like.dtype if stored else torch.float32, device=like.device)
                for k, shape, stored in self._grads}

    def run(self, key: tuple, call: Callable[[], Any], stream_of: torch.Tensor) -> None:
        """`call()` (which returns its Saved's `resources`), or the replay of its graph,
        on torch's current stream (that of `stream_of`'s device)."""
        found = self._graphs.get(key)
        if found is not None:
            self._graphs.move_to_end(key)
            self.fn.follow(stream_of)  # orders the replay after the backend's own calls
            found[0].replay()
            found[2] += 1
            self.counts["replayed"] += 1
            return
        seen = self._seen.pop(key, 0)  # eager calls with this key so far; -1: its capture failed
        if seen < 0 or seen + 1 < self.sightings:
            self.fn.release(call())
            self.counts["eager"] += 1
            self._remember(key, seen if seen < 0 else seen + 1)
            return
        graph, resources = self._capture(call)
        if graph is None:
            self.counts["failed"] += 1
            self.fn.release(call())
            self._remember(key, -1)
            return
        self.counts["captured"] += 1
        self.fn.release(resources)
        self._graphs[key] = [graph, resources, 0]
        while len(self._graphs) > self.capacity:
            _, (_, _, replays) = self._graphs.popitem(last=False)
            if replays == 0:
                # A capture that never paid off: the addresses cycle through more keys
                # than are kept. Ask for more repeats before the next capture (a capture
                # costs far more than the launches it replaces).
                self.sightings = min(2 * self.sightings, 64)
        self.fn.follow(stream_of)
        graph.replay()  # the capture recorded the call; this does it

    def _remember(self, key: tuple, seen: int) -> None:
        self._seen[key] = seen
        while len(self._seen) > 4 * self.capacity:
            self._seen.popitem(last=False)

    def _capture(self, call: Callable[[], Any]) -> tuple[Any, Any]:
        """(graph, the call's resources), or (None, None) if the call could not be captured."""
        # A capture records the work without running it, so the side stream (torch's
        # legacy default stream cannot be captured) need not wait for anything.
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        graph = torch.cuda.CUDAGraph()
        try:
            # No free of numba's while capturing (a dropped array's, queued earlier).
            with torch.cuda.stream(side), self.fn.deferred_frees():
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    resources = call()
                finally:
                    graph.capture_end()
        except Exception:  # noqa: BLE001 - the eager call that follows raises any real error
            # An operation a capture forbids (a launch or plan built for the first time
            # when the shape's plan was dropped in between, say): the caller runs it eagerly.
            return None, None
        return graph, resources
