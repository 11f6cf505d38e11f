"""Plan choice by measurement (the `autotune` option; PyTorch's cudnn.benchmark): every
deterministic plan of a graph built and timed on this GPU, the fastest kept; with a plan
store (conv2d.cuda.plan_store) the choice is kept across processes."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import numpy as np

from conv2d.cuda import cudnn, plan_store
from conv2d.cuda.launch import device_pointer
from conv2d.cuda.probe_inputs import DeviceInputs
from conv2d.spec import DType, LayerSpec

AUTOTUNE_MAX_WORKSPACE = 1 << 30


def autotuned(op: str, spec: LayerSpec, handle: Any, allow_tf32: bool, bench: Any,
              chosen: dict | None = None) -> cudnn.Graph:
    """The graph of `op` running its fastest plan as `bench` times them (`select_fastest`;
    the plan's engine and knobs into `chosen`)."""
    return cudnn.build(op, spec, handle, allow_tf32,
                       select=lambda frontend, g, t: select_fastest(frontend, g, t, bench, chosen))


def select_fastest(frontend: Any, g: Any, tensors: dict, bench: Any, chosen: dict | None = None) -> int | None:
    """Build every plan, time each on random data (`bench(tensors, workspace, run)`
    returns ms) and pin the fastest; plans within 2% of it count as equal and the
    heuristic's earlier rank wins, so that noise changes the choice less often. Returns
    the index, or None where no plan could be timed (the caller builds the heuristic's
    choice). `chosen` (a dict) receives the pinned plan's "engine" id and "knobs" ({knob
    name: choice}), for a plan store."""
    g.build_plans(frontend.build_plan_policy.ALL)
    timed = []
    for i in range(g.get_execution_plan_count()):
        try:
            ws = int(g.get_workspace_size_plan_at_index(i))
            if ws > AUTOTUNE_MAX_WORKSPACE:
                continue
            ms = bench(tensors, ws, lambda pack, wsp, handle, i=i: g.execute_plan_at_index(pack, wsp, i, handle=handle))
        except Exception:  # a plan that did not build or run is not a candidate
            continue
        timed.append((ms, i))
    if chosen is not None:  # for a store: only plans that their record builds again
        records = {i: _record(g, i) for _, i in timed}
        timed = [(ms, i) for ms, i in timed if records[i] is not None] or timed
    if not timed:
        return None
    fastest = min(ms for ms, _ in timed)
    best = min(i for ms, i in timed if ms <= fastest * 1.02)
    if chosen is not None and records.get(best) is not None:
        chosen.update(records[best])
    g.select_plan(best)
    g.build_plans()
    return best


def _record(g: Any, i: int) -> dict | None:
    """{"engine": id, "knobs": {knob name: choice}} of plan `i`, which
    `create_execution_plan` builds again; None where the frontend's record does not name
    the plan whole: the knob types its Python enum lacks all read as NOT_SET (frontend
    1.28, H100: eng33_k2=2_k6=0_k13=2_k14=0_k22=1 came back as four knobs, two of them
    NOT_SET), so a replay would build another plan."""
    try:
        engine, knobs = g.get_engine_and_knobs_at_index(i)
        name = str(g.get_plan_name_at_index(i))
    except Exception:
        return None
    named = {getattr(k, "name", str(k)): int(v) for k, v in dict(knobs or {}).items()}
    if "NOT_SET" in named or len(named) != name.count("_k"):
        return None
    return {"engine": int(engine), "knobs": named}


def build_stored(op: str, spec: LayerSpec, handle: Any, allow_tf32: bool, autotune: Any,
                  store: plan_store.PlanStore) -> cudnn.Graph:
    """The autotuned graph with a plan store (conv2d.cuda.plan_store): the plan stored for
    this GPU, cuDNN and graph, built without timing; else (or where this cuDNN cannot
    build it) timed now, the choice stored and this process running the plan its record
    builds (what later processes build)."""
    frontend = cudnn.import_cudnn()
    key = store.key(device=autotune.device_name(), cudnn=int(frontend.backend_version()), frontend=frontend.__version__,
                    op=op, convolution=cudnn.conv_key(spec), tf32=bool(allow_tf32) and spec.dtype is DType.FLOAT32)
    found = store.get(key)
    if found is not None:
        engine, knobs = found
        try:
            return cudnn.build(op, spec, handle, allow_tf32, config=_config(frontend, engine, knobs))
        except (cudnn.CudnnError, AttributeError):
            pass  # another cuDNN build's choice: timed again below, and replaced
    chosen: dict = {}
    built = autotuned(op, spec, handle, allow_tf32, autotune, chosen)
    if not chosen:
        return built
    # The frontend's (engine, knobs) of a timed plan does not always build that plan again
    # (H100, frontend 1.28: a second process built eng11 for a stored eng11_k2=4_k3=0, and
    # another engine altogether for one bfloat16 backward-data). What is stored is what
    # every later process builds, so this one runs it too, or stores nothing.
    try:
        replayed = cudnn.build(op, spec, handle, allow_tf32,
                               config=_config(frontend, chosen["engine"], chosen["knobs"]))
    except cudnn.CudnnError:
        return built
    store.put(key, chosen["engine"], chosen["knobs"])
    return built if replayed.plan == built.plan else replayed


def _config(frontend: Any, engine: int, knobs: dict[str, int]) -> tuple:
    """`cudnn.build`'s config (engine, frozenset of (knob type, value)) of a stored choice:
    the knob types by their names in the frontend's enum (AttributeError for a name this
    frontend lacks)."""
    return engine, frozenset((getattr(frontend.knob_type, name), v) for name, v in knobs.items())


class Bench(DeviceInputs):
    """Times one plan of a graph for `_autotune`: random device buffers for its tensors,
    CUDA events on the layer's stream, the median of three rounds."""

    def __init__(self, cuda, spec: LayerSpec, stream_ptr: int, handle: Any) -> None:
        super().__init__(cuda, stream_ptr)
        self.spec, self.handle = spec, handle

    def at(self, spec: LayerSpec) -> "Bench":
        """The same timer for another spec (another batch size)."""
        return Bench(self.cuda, spec, self.stream_ptr, self.handle)

    def device_name(self) -> str:
        """The current GPU's name and compute capability (a plan store's key part)."""
        dev = self.cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        return f"{name} (sm_{dev.compute_capability[0]}{dev.compute_capability[1]})"

    def _role_buffer(self, role: str):
        s = self.spec
        shape = {"x": s.input_shape, "dx": s.input_shape, "w": s.weight_shape, "dw": s.weight_shape,
                 "b": (s.out_channels,)}.get(role, s.output_shape)
        return self._buffer(role, math.prod(shape), s.dtype, seed=0)

    def __call__(self, tensors: dict, workspace: int, run) -> float:
        pack = {t: device_pointer(self._role_buffer(role)) for role, t in tensors.items()}
        ws = self.cuda.device_array(max(workspace, 1), np.uint8, stream=self.stream)
        wsp = device_pointer(ws)
        run(pack, wsp, self.handle)
        self.stream.synchronize()
        t0 = time.perf_counter()
        run(pack, wsp, self.handle)
        self.stream.synchronize()
        reps = max(1, min(20, int(2e-3 / max(time.perf_counter() - t0, 1e-6))))
        rounds = []
        for _ in range(3):
            start, end = self.cuda.event(), self.cuda.event()
            start.record(self.stream)
            for _ in range(reps):
                run(pack, wsp, self.handle)
            end.record(self.stream)
            end.synchronize()
            rounds.append(self.cuda.event_elapsed_time(start, end) / reps)
        return statistics.median(rounds)
