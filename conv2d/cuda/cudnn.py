"""The one module that talks to cuDNN, through NVIDIA's cudnn-frontend graph API.

For a LayerSpec it builds, once per (spec, device, TF32 choice, plan choice), the graphs
the layer runs: forward (convolution + bias, and convolution + bias + ReLU for evaluation
without a norm), backward-data and backward-filter. (A forward graph writing both the
pre-activations and their ReLU builds, but cuDNN 9.19's engine for it fails at execute
with CUDNN_STATUS_INTERNAL_ERROR, so training keeps the ReLU in the numba pass.) Plans
are cuDNN's heuristic first choice, or with `autotune` the fastest deterministic plan
measured on this GPU (`Graph.plan`, the engine's name, says which); strict float32
takes the more accurate of two heuristic modes' first plans (`_build_accurate`); a batch-invariant
layer's forward and backward-data run one recorded engine and knobs at every batch size
(`invariant_choice`). Tensors are NHWC
in memory and described to cuDNN in its NCHW dimension order with NHWC strides; weights
(OC, KH, KW, IC / groups) likewise: cuDNN infers the groups from the filter's channel count
(as PyTorch's cuDNN path does). Padding goes to the frontend as pre/post padding (so
asymmetric zero padding is cuDNN's too), dilation as the convolution's; other padding
modes are padded by the layer first (steps.pad_input), and the graphs see zeros. Only
engines without the NONDETERMINISTIC numerical note are kept; float32 keeps only engines
without TENSOR_CORE / DOWN_CONVERT_INPUTS (no TF32) unless TF32 is allowed; 16-bit types
compute in float32 and drop REDUCED_PRECISION_REDUCTION engines.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from conv2d.cuda import plan_store
from conv2d.cuda.launch import device_pointer
from conv2d.cuda.runtime import INSTALL_HINT, CudaUnavailableError, to_device_bits
from conv2d.dtypes import storage_dtype
from conv2d.spec import DType, LayerSpec


class CudnnError(RuntimeError):
    """A cuDNN failure: names the operation, the spec and cuDNN's message."""


_IMPORT_LOCK = threading.Lock()
# cuDNN's engine heuristics by storage dtype, asked in this order (heur_mode names); a
# plan is a pure function of the graph, the device and these, so the choice is
# reproducible. Measured on the H200 (with scripts/heuristics_cuda.py, a one-off study
# since removed; git keeps it and its results in the commits that used it): for float32, mode B's plans made the rl_small / rl_dqn_l1 steps 1.6x / 1.4x faster than
# mode A's and left the ResNet shapes unchanged; for bfloat16, B was 4-8% slower on
# tiny_latency and rl_dqn_l1 and equal elsewhere, so 16-bit layers keep A.
HEUR_MODES = {DType.FLOAT32: ("B", "FALLBACK"), DType.BFLOAT16: ("A", "FALLBACK"), DType.FLOAT16: ("A", "FALLBACK")}
_cudnn = None


def _import_cudnn():
    """The frontend module, bound to the libcudnn.so.9 that cuda.pathfinder finds (the
    nvidia-cudnn-cu12/-cu13 wheel, or a system install)."""
    global _cudnn
    with _IMPORT_LOCK:
        if _cudnn is not None:
            return _cudnn
        try:
            from cuda import pathfinder
            lib = pathfinder.load_nvidia_dynamic_lib("cudnn")
        except Exception as e:
            raise CudaUnavailableError(f"libcudnn.so.9 was not found ({e}); {INSTALL_HINT}") from e
        # The frontend dlopens cuDNN at import, searching LD_LIBRARY_PATH first: point it
        # at the library pathfinder chose, for the import only.
        old = os.environ.get("LD_LIBRARY_PATH")
        os.environ["LD_LIBRARY_PATH"] = os.path.dirname(lib.abs_path) + (os.pathsep + old if old else "")
        try:
            import cudnn
        except ImportError as e:
            raise CudaUnavailableError(f"nvidia-cudnn-frontend is not importable ({e}); {INSTALL_HINT}") from e
        finally:
            if old is None:
                os.environ.pop("LD_LIBRARY_PATH", None)
            else:
                os.environ["LD_LIBRARY_PATH"] = old
        _cudnn = cudnn
        return cudnn


_BUILD_LOCK = threading.RLock()


def create_handle(stream_ptr: int) -> Any:
    """A cuDNN handle on the stream `stream_ptr`, created under the build lock (two threads
    creating handles and workspaces together hung once on the H200)."""
    cudnn = _import_cudnn()
    with _BUILD_LOCK:
        try:
            handle = cudnn.create_handle()
            cudnn.set_stream(handle, stream_ptr)
        except Exception as e:
            raise CudnnError(f"cuDNN create_handle: {e}") from e
    return handle


def set_stream(handle: Any, stream_ptr: int) -> None:
    """Point the handle's work at another stream."""
    try:
        _import_cudnn().set_stream(handle, stream_ptr)
    except Exception as e:
        raise CudnnError(f"cuDNN set_stream: {e}") from e


@dataclass
class Graph:
    """One built cuDNN graph, its tensors by role and the name of its plan."""

    op: str
    spec: LayerSpec
    graph: Any
    tensors: dict  # role -> frontend tensor
    workspace_size: int
    lock: threading.Lock
    plan: str = "?"


class Execution:
    """A graph's execute prepared once for a handle and a workspace: `set(role, ptr)`
    rewrites one device pointer, `run()` executes.

    The frontend's `execute` normalises its variant pack on every call (25-30 us of host
    time measured on the H200); its native entry point takes an array of pointers in the
    graph's uid order (6 us). That array is built here once. Where the frontend does not
    offer that entry point, its public `execute` over a {uid: pointer} variant pack is used
    instead (the form every frontend version takes; 1.28's has no `tensor_uids=`), and
    always with `native=False` (the public path the native one is tested against).
    """

    def __init__(self, graph: Graph, handle: Any, workspace_ptr: int, native: bool = True) -> None:
        self.graph = graph
        self._handle = handle
        self._workspace = workspace_ptr
        roles = list(graph.tensors)
        uids = [graph.tensors[r].uid for r in roles]
        self._uids = uids
        self._ptrs = [0] * len(roles)
        self._index = {r: i for i, r in enumerate(roles)}
        self._native = None
        self._proven = False
        try:
            if not native:
                raise LookupError("the public execute was asked for")
            from conv2d.cuda.private import native_execute

            entry, args, self._array, self._slot = native_execute(graph.graph, dict(zip(roles, uids)), handle,
                                                                  workspace_ptr)
            self._native = (entry, *args)
        except Exception:  # another frontend version: its public ordered execute
            self._native = None

    def set(self, role: str, ptr: int) -> None:
        self._ptrs[self._index[role]] = ptr
        if self._native is not None:
            self._array[self._slot[role]] = ptr

    def run(self) -> None:
        g = self.graph
        try:
            # The frontend's graph object keeps lazily built execution caches: one
            # thread at a time per graph (launches are asynchronous, so this is brief).
            with g.lock:
                if self._native is not None:
                    fn, *args = self._native
                    try:
                        fn(*args)
                        self._proven = True
                        return
                    except Exception:
                        if self._proven:
                            raise
                        # The native entry point refused this graph on its first call: the
                        # public form from now on (it raises in turn if the graph cannot run).
                        self._native = None
                g.graph.execute(dict(zip(self._uids, self._ptrs)), self._workspace, handle=self._handle)
        except Exception as e:
            raise CudnnError(f"cuDNN {g.op} for {g.spec}: {e}") from e

    @property
    def native(self) -> bool:
        """Whether runs go through the frontend's native pointer-array entry point."""
        return self._native is not None


def _dims(spec: LayerSpec) -> dict[str, tuple[list[int], list[int]]]:
    n, h, w, c = spec.input_shape
    _, oh, ow, oc = spec.output_shape
    kh, kw = spec.kernel
    # cuDNN infers the groups from the filter's channel count: C / groups.
    cg = c // spec.groups
    return {
        "x": ([n, c, h, w], [h * w * c, 1, w * c, c]),
        "y": ([n, oc, oh, ow], [oh * ow * oc, 1, ow * oc, oc]),
        "w": ([oc, cg, kh, kw], [kh * kw * cg, 1, kw * cg, cg]),
        "b": ([1, oc, 1, 1], [oc, 1, oc, oc]),
    }


def _geometry(spec: LayerSpec) -> dict[str, list[int]]:
    """The convolution's arguments to the frontend: padding before (top, left) and after
    (bottom, right), stride, dilation."""
    return dict(pre_padding=list(spec.padding), post_padding=list(spec.padding_end), stride=list(spec.stride),
                dilation=list(spec.dilation))


def _planned(op: str, spec: LayerSpec, handle: Any, allow_tf32: bool, config: Any = None,
             modes: tuple[str, ...] | None = None) -> tuple[Any, dict]:
    """The frontend graph of `op` for `spec` and its tensors by role, its plan list made
    (cuDNN's heuristics `modes`, by default HEUR_MODES', or the one recorded (engine id,
    knobs) `config`) and filtered by the numerical notes, not yet built."""
    cudnn = _import_cudnn()
    dt = {DType.FLOAT32: cudnn.data_type.FLOAT, DType.FLOAT16: cudnn.data_type.HALF,
          DType.BFLOAT16: cudnn.data_type.BFLOAT16}[spec.dtype]
    f32 = cudnn.data_type.FLOAT
    d = _dims(spec)
    conv = _geometry(spec)
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def tensor(role, dtype=dt):
        dim, stride = d[role]
        return g.tensor(name=role, dim=dim, stride=stride, data_type=dtype)

    if op in ("forward", "forward_relu"):
        t = {"x": tensor("x"), "w": tensor("w")}
        out = g.conv_fprop(image=t["x"], weight=t["w"], **conv)
        if spec.bias:
            t["b"] = tensor("b")
            out = g.bias(input=out, bias=t["b"])
        if op == "forward_relu":
            out = g.relu(input=out)
        out.set_output(True).set_data_type(dt)
        t["y"] = out
    elif op == "backward_data":
        t = {"dy": g.tensor(name="dy", dim=d["y"][0], stride=d["y"][1], data_type=dt), "w": tensor("w")}
        dx = g.conv_dgrad(loss=t["dy"], filter=t["w"], **conv)
        dx.set_output(True).set_dim(d["x"][0]).set_stride(d["x"][1]).set_data_type(dt)
        t["dx"] = dx
    elif op == "backward_filter":
        t = {"x": tensor("x"), "dy": g.tensor(name="dy", dim=d["y"][0], stride=d["y"][1], data_type=dt)}
        dw = g.conv_wgrad(image=t["x"], loss=t["dy"], **conv)
        # In the storage type: cuDNN has no 16-bit wgrad engine with a float32 output
        # (INVALID_DATA_CONFIG); the layer accumulates it into the gradient itself.
        dw.set_output(True).set_dim(d["w"][0]).set_stride(d["w"][1]).set_data_type(dt)
        t["dw"] = dw
    else:
        raise ValueError(f"unknown cuDNN graph {op!r}")
    g.validate()
    g.build_operation_graph()
    if config is None:
        g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in (modes or HEUR_MODES[spec.dtype])])
    else:  # the frontend's replay of a recorded choice: the one plan of this graph
        engine_id, knobs = config
        g.create_execution_plan(engine_id, dict(knobs))
    notes = [cudnn.numerical_note.NONDETERMINISTIC]
    if spec.dtype is DType.FLOAT32 and not allow_tf32:
        notes += [cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS]
    if spec.dtype in (DType.FLOAT16, DType.BFLOAT16):
        notes += [cudnn.numerical_note.REDUCED_PRECISION_REDUCTION]
    g.deselect_numeric_notes(notes)
    g.check_support()
    return g, t


def _failure(op: str, spec: LayerSpec, e: Exception,
             what: str = "no deterministic engine could be built") -> CudnnError:
    detail = ""
    try:
        detail = _import_cudnn().get_last_error_string()
    except Exception:
        pass
    return CudnnError(f"cuDNN {op} for {spec}: {what} ({type(e).__name__}: {e}{'; ' + detail if detail else ''})")


def _build(op: str, spec: LayerSpec, handle: Any, allow_tf32: bool, autotune: Any = None,
           config: Any = None, modes: tuple[str, ...] | None = None, chosen: dict | None = None) -> Graph:
    """The built graph: cuDNN's heuristic choice, the fastest with `autotune` (its
    engine and knobs into `chosen`, see `_autotune`), or the recorded `config` (engine
    id, frozenset of (knob, value))."""
    cudnn = _import_cudnn()
    if spec.pads_with_copies:
        raise ValueError(f"cuDNN pads with zeros only; pad the input first (padding_mode={spec.padding_mode!r})")
    try:
        g, t = _planned(op, spec, handle, allow_tf32, config, modes)
        plan = None
        if autotune is not None:
            plan = _autotune(cudnn, g, t, autotune, chosen)
        if plan is None:
            g.build_plans()
        workspace = int(g.get_workspace_size())
        try:
            name = str(g.get_plan_name_at_index(g._plan_index))
        except Exception:
            name = "?"
    except CudnnError:
        raise
    except Exception as e:
        what = ("no deterministic engine could be built" if config is None
                else f"the batch-invariant plan (engine {config[0]}) did not build at this batch size")
        raise _failure(op, spec, e, what) from e
    return Graph(op, spec, g, t, workspace, threading.Lock(), name)


AUTOTUNE_MAX_WORKSPACE = 1 << 30


def _autotune(cudnn: Any, g: Any, tensors: dict, bench: Any, chosen: dict | None = None) -> int | None:
    """Build every plan, time each on random data (`bench(tensors, workspace, run)`
    returns ms) and pin the fastest; plans within 2% of it count as equal and the
    heuristic's earlier rank wins, so that noise changes the choice less often. Returns
    the index, or None where no plan could be timed (the caller builds the heuristic's
    choice). `chosen` (a dict) receives the pinned plan's "engine" id and "knobs" ({knob
    name: choice}), for a plan store."""
    g.build_plans(cudnn.build_plan_policy.ALL)
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


_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()
_KEY_LOCKS: dict = {}


def _conv_key(spec: LayerSpec, batch: bool = True) -> tuple:
    # The convolutions do not depend on the activation or norm: key by what they read.
    shape = spec.input_shape if batch else spec.input_shape[1:]
    return (shape, spec.out_channels, spec.kernel, spec.stride, spec.pads, spec.dilation, spec.groups, spec.dtype,
            spec.bias)


def _cached(key: tuple, make: Any) -> Any:
    """`_CACHE[key]`, made by `make()` once: threads asking for the same key wait for one
    build; other keys build in parallel."""
    with _CACHE_LOCK:
        found = _CACHE.get(key)
        if found is not None:
            return found
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:
        with _CACHE_LOCK:
            found = _CACHE.get(key)
        if found is None:
            found = make()
            with _CACHE_LOCK:
                _CACHE[key] = found
    return found


def graph(op: str, spec: LayerSpec, device: int, allow_tf32: bool, handle: Any, autotune: Any = None,
          probe: Any = None, accuracy: Any = None) -> Graph:
    """The built graph for (op, the spec's convolution, device, allow_tf32, autotuned or
    not), from the cache or built now. `autotune`, if given, times a plan (see `_autotune`).
    With `spec.batch_invariant`, forward and backward-data run the plan `invariant_choice`
    recorded for the convolution at any batch size (`probe`: an `InvarianceProbe`). Strict
    float32 heuristic plans are checked for accuracy (`_build_accurate`; `accuracy`: an
    `AccuracyProbe`)."""
    tf32 = bool(allow_tf32) and spec.dtype is DType.FLOAT32
    if spec.batch_invariant and op != "backward_filter":
        config = invariant_choice(op, spec, device, allow_tf32, handle, probe, autotune)
        return _cached((op, _conv_key(spec), device, tf32, "invariant", config),
                       lambda: _build(op, spec, handle, allow_tf32, config=config))
    if accuracy is not None and autotune is None and spec.dtype is DType.FLOAT32 and not tf32:
        return _cached((op, _conv_key(spec), device, tf32, False, "accurate"),
                       lambda: _build_accurate(op, spec, handle, accuracy))
    store = plan_store.current() if autotune is not None else None
    if store is not None:
        return _cached((op, _conv_key(spec), device, tf32, True),
                       lambda: _build_stored(op, spec, handle, allow_tf32, autotune, store))
    return _cached((op, _conv_key(spec), device, tf32, autotune is not None),
                   lambda: _build(op, spec, handle, allow_tf32, autotune))


def _build_stored(op: str, spec: LayerSpec, handle: Any, allow_tf32: bool, autotune: Any,
                  store: plan_store.PlanStore) -> Graph:
    """The autotuned graph with a plan store (conv2d.cuda.plan_store): the plan stored for
    this GPU, cuDNN and graph, built without timing; else (or where this cuDNN cannot
    build it) timed now, the choice stored and this process running the plan its record
    builds (what later processes build)."""
    cudnn = _import_cudnn()
    key = store.key(device=autotune.device_name(), cudnn=int(cudnn.backend_version()), frontend=cudnn.__version__,
                    op=op, convolution=_conv_key(spec), tf32=bool(allow_tf32) and spec.dtype is DType.FLOAT32)
    found = store.get(key)
    if found is not None:
        engine, knobs = found
        try:
            return _build(op, spec, handle, allow_tf32, config=_config(cudnn, engine, knobs))
        except (CudnnError, AttributeError):
            pass  # another cuDNN build's choice: timed again below, and replaced
    chosen: dict = {}
    built = _build(op, spec, handle, allow_tf32, autotune, chosen=chosen)
    if not chosen:
        return built
    # The frontend's (engine, knobs) of a timed plan does not always build that plan again
    # (H100, frontend 1.28: a second process built eng11 for a stored eng11_k2=4_k3=0, and
    # another engine altogether for one bfloat16 backward-data). What is stored is what
    # every later process builds, so this one runs it too, or stores nothing.
    try:
        replayed = _build(op, spec, handle, allow_tf32, config=_config(cudnn, chosen["engine"], chosen["knobs"]))
    except CudnnError:
        return built
    store.put(key, chosen["engine"], chosen["knobs"])
    return built if replayed.plan == built.plan else replayed


def _config(cudnn: Any, engine: int, knobs: dict[str, int]) -> tuple:
    """`_build`'s config (engine, frozenset of (knob type, value)) of a stored choice:
    the knob types by their names in the frontend's enum (AttributeError for a name this
    frontend lacks)."""
    return engine, frozenset((getattr(cudnn.knob_type, name), v) for name, v in knobs.items())


# Accuracy. Strict float32 takes heuristic mode B's first plan (faster than mode A's on
# the RL shapes: HEUR_MODES), but on some shapes B's plan sums less accurately than mode
# A's first, which is PyTorch's choice (H100: 4 of the 27 operations of the CIFAR network
# and the Nature-DQN, 5-11x PyTorch's error; docs/accuracy_cuda.md). Where the two
# differ, both run on fixed random inputs against a float64 oracle on the device
# (kernels/oracle.py) and A is kept where B's error is more than ACCURACY_MARGIN times
# A's: never far less accurate than PyTorch's plan, B's speed where it is as accurate.
# The margin, because plans that sum in a different order rank by the inputs within a
# few tens of percent: on rl_dqn_l1's backward-data (H100), B's plan was 0.92x A's error
# on one set of random inputs and above 1x on the probe's, and A's plan takes 2.4x as
# long (the whole float32 step 1.45x); the gaps that matter were 5-11x. The inputs and
# the oracle are fixed, the plans deterministic: the choice is too.
ACCURACY_MODES = ("A", "FALLBACK")
ACCURACY_MARGIN = 2.0
ACCURACY_SAMPLES = 8  # forward and backward-data are compared on this many samples
ACCURACY_MAX_WORK = 20_000_000_000  # multiply-adds the oracle may spend on a weight gradient


def _build_accurate(op: str, spec: LayerSpec, handle: Any, probe: Any) -> Graph:
    """The float32 (no TF32) graph: mode B's first plan, or mode A's first where the
    probe (an `AccuracyProbe`) measures B's error above ACCURACY_MARGIN times A's."""
    fast = _build(op, spec, handle, False)
    try:
        other = _build(op, spec, handle, False, modes=ACCURACY_MODES)
    except CudnnError:
        return fast
    if other.plan == fast.plan:
        return fast
    fast_error, other_error = probe.error(op, fast, handle), probe.error(op, other, handle)
    if fast_error is None or other_error is None or fast_error <= ACCURACY_MARGIN * other_error:
        return fast
    return other


class _DeviceInputs:
    """Inputs for running plans outside a layer's calls: device buffers of Gaussian (or
    zero) values in a storage dtype, made on first use and kept by (role, size, dtype), on
    the layer's stream. Shared by _Bench, InvarianceProbe and AccuracyProbe."""

    def __init__(self, cuda, stream_ptr: int) -> None:
        self.cuda, self.stream_ptr = cuda, stream_ptr
        self.stream = cuda.external_stream(stream_ptr) if stream_ptr else cuda.default_stream()
        self._buffers: dict = {}

    def _buffer(self, role: str, n: int, dtype: DType = DType.FLOAT32, zero: bool = False, seed: int | None = None):
        """`n` values for `role`: zeros, or Gaussian from `seed` (default: how many buffers
        came before, so that each role gets its own values)."""
        key = (role, n, dtype)
        found = self._buffers.get(key)
        if found is None:
            v = np.zeros(n, np.float32) if zero else np.random.default_rng(
                len(self._buffers) if seed is None else seed).standard_normal(n, dtype=np.float32)
            bits = to_device_bits(v.astype(storage_dtype(dtype)))
            found = self._buffers[key] = self.cuda.to_device(bits, stream=self.stream)
        return found


class AccuracyProbe(_DeviceInputs):
    """What `_build_accurate` measures candidate plans with: fixed random float32 inputs
    at a graph's shape and the float64 oracle's outputs for them."""

    def __init__(self, cuda, stream_ptr: int) -> None:
        super().__init__(cuda, stream_ptr)
        self._exact: dict = {}

    def error(self, op: str, g: Graph, handle: Any) -> float | None:
        """max|got - exact| / max|exact| of graph g's plan on the probe's inputs (its
        first ACCURACY_SAMPLES samples; all for the weight gradient), or None where the
        oracle would spend more than ACCURACY_MAX_WORK multiply-adds."""
        from conv2d.cuda.kernels import oracle
        from conv2d.cuda.kernels.layout import window_geometry

        s = g.spec
        n = s.batch_size
        kh, kw = s.kernel
        cg = s.in_channels // s.groups
        x = self._buffer("x", math.prod(s.input_shape))
        w = self._buffer("w", math.prod(s.weight_shape))
        dy = self._buffer("dy", math.prod(s.output_shape))
        if op == "backward_filter":
            if math.prod(s.weight_shape) * n * math.prod(s.output_shape[1:3]) > ACCURACY_MAX_WORK:
                return None
            out_size, kernel, args = math.prod(s.weight_shape), oracle.backward_filter, (x, dy)
        elif op == "backward_data":
            out_size = min(n, ACCURACY_SAMPLES) * math.prod(s.input_shape[1:])
            kernel, args = oracle.backward_data, (dy, w)
        else:
            out_size, kernel, args = min(n, ACCURACY_SAMPLES) * math.prod(s.output_shape[1:]), oracle.forward, (x, w)
        full = {"backward_filter": s.weight_shape, "backward_data": s.input_shape}.get(op, s.output_shape)
        out = self.cuda.device_array(math.prod(full), np.float32, stream=self.stream)
        ptrs = {"x": x, "w": w, "dy": dy, "b": self._buffer("b", s.out_channels, zero=True), "y": out, "dx": out,
                "dw": out}
        ws = self.cuda.device_array(max(g.workspace_size, 1), np.uint8, stream=self.stream)
        pack = {t.uid: device_pointer(ptrs[role]) for role, t in g.tensors.items()}
        with g.lock:
            g.graph.execute(pack, device_pointer(ws), handle=handle)
        key = (op, _conv_key(s))
        exact = self._exact.get(key)
        if exact is None:
            geo = window_geometry(s)
            e = self.cuda.device_array(out_size, np.float64, stream=self.stream)
            kernel[max(1, min(4096, (out_size + 127) // 128)), 128, self.stream](
                *args, e, n, geo["H"], geo["W"], geo["C"], geo["OH"], geo["OW"], geo["OC"], kh, kw, geo["SH"],
                geo["SW"], geo["PH"], geo["PW"], geo["DH"], geo["DW"], cg, s.out_channels // s.groups)
            exact = self._exact[key] = e.copy_to_host(stream=self.stream)
        got = out.copy_to_host(stream=self.stream)[:out_size].astype(np.float64)
        self.stream.synchronize()
        if op == "forward_relu":
            exact = np.maximum(exact, 0.0)
        return float(np.abs(got - exact).max() / max(np.abs(exact).max(), 1e-300))


# Batch invariance. cuDNN's heuristics rank engines and knobs per problem size, so one
# convolution runs different plans (other reduction orders) at N = 1 and N = 256. A
# batch-invariant layer runs one plan, (engine id, knobs), at every N: chosen once per
# convolution shape (without N), device and TF32 choice, at a reference batch that
# depends on the shape alone, so that every layer of that shape (an actor's copy and the
# learner's) runs the same plan; rebuilt for each new N from the record. A candidate is
# taken only if it gives, byte for byte, the rows it gave at the reference batch when run
# at N = 1 (the first and the last sample) and N = 5 (samples from the middle): a fixed
# engine and knobs usually fix the reduction order over C*KH*KW, but not every engine
# (some choose their kernel by size; on the H200 about 8 of 40 float32 configurations
# kept their bits, all bfloat16 ones did). backward-filter sums over the batch: it stays
# deterministic, not invariant.
INVARIANT_BATCH = 128
INVARIANT_PROBE_BYTES = 1 << 28  # the reference batch halves (down to 8) until a batch's tensors fit this


def invariant_batch(spec: LayerSpec) -> int:
    """The reference batch at which a batch-invariant convolution's plan is chosen: 128,
    halved while a batch of inputs or outputs would exceed INVARIANT_PROBE_BYTES."""
    sample = max(math.prod(spec.input_shape[1:]), math.prod(spec.output_shape[1:])) * 4
    n = INVARIANT_BATCH
    while n > 8 and n * sample > INVARIANT_PROBE_BYTES:
        n //= 2
    return n


def invariant_choice(op: str, spec: LayerSpec, device: int, allow_tf32: bool, handle: Any, probe: Any,
                     autotune: Any = None) -> tuple:
    """The (engine id, knobs) that `op` of a batch-invariant `spec` runs at every batch
    size: the heuristics' first candidate at `invariant_batch(spec)` whose rows keep their
    bits at N = 1 and 5 (or with `autotune` the fastest such); recorded per process.
    Raises CudnnError naming the spec where no candidate does."""
    tf32 = bool(allow_tf32) and spec.dtype is DType.FLOAT32
    key = (op, _conv_key(spec, batch=False), device, tf32, autotune is not None)
    return _cached(("choice", *key), lambda: _choose_invariant(op, spec, allow_tf32, handle, probe, autotune))


def _choose_invariant(op: str, spec: LayerSpec, allow_tf32: bool, handle: Any, probe: Any, autotune: Any) -> tuple:
    if probe is None:
        raise ValueError("a batch-invariant plan is chosen with an InvarianceProbe")
    cudnn = _import_cudnn()
    n_ref = invariant_batch(spec)
    ref = spec.at(n_ref)
    checks = ((1, 0), (1, n_ref - 1), (5, n_ref // 2 - 2))  # (batch, first sample) runs compared to the reference
    tried = []
    try:
        g, t = _planned(op, ref, handle, allow_tf32)
        g.build_plans(cudnn.build_plan_policy.ALL)
    except Exception as e:
        raise _failure(op, ref, e) from e
    passing = []
    for i in range(g.get_execution_plan_count()):
        try:
            name = str(g.get_plan_name_at_index(i))
            engine_id, knobs = g.get_engine_and_knobs_at_index(i)
            config = (int(engine_id), frozenset(dict(knobs or {}).items()))  # hashable: a cache key
            ws = int(g.get_workspace_size_plan_at_index(i))
            if ws > AUTOTUNE_MAX_WORKSPACE:
                continue
            want = probe.rows(op, ref, t, ws,
                              lambda pack, wsp, i=i: g.execute_plan_at_index(pack, wsp, i, handle=handle))
        except Exception:  # a plan that did not build or run is not a candidate
            continue
        kept = True
        for n, first in checks:
            try:
                r = _build(op, spec.at(n), handle, allow_tf32, config=config)
                got = probe.rows(op, r.spec, r.tensors, r.workspace_size,
                                 lambda pack, wsp, r=r: r.graph.execute_plan_at_index(pack, wsp, 0, handle=handle),
                                 first)
            except Exception:
                kept = False
                break
            if got != want[first:first + n]:
                kept = False
                break
        tried.append(name)
        if kept:
            passing.append((i, config, ws))
            if autotune is None:
                break
    if not passing:
        raise CudnnError(f"batch_invariant: no deterministic cuDNN plan for {op} keeps a sample's bits at every "
                         f"batch size for {spec} (tried {', '.join(tried) or 'none that ran'}); use "
                         f"batch_invariant=False for this layer")
    if autotune is None or len(passing) == 1:
        return passing[0][1]
    bench = autotune.at(ref)
    timed = []
    for i, config, ws in passing:
        try:
            run = lambda pack, wsp, handle, i=i: g.execute_plan_at_index(pack, wsp, i, handle=handle)  # noqa: E731
            timed.append((bench(t, ws, run), i, config))
        except Exception:
            continue
    if not timed:
        return passing[0][1]
    fastest = min(ms for ms, _, _ in timed)
    return min((i, config) for ms, i, config in timed if ms <= fastest * 1.02)[1]


class InvarianceProbe(_DeviceInputs):
    """What `invariant_choice` runs candidate plans on: random inputs at the reference
    batch."""

    def rows(self, op: str, spec: LayerSpec, tensors: dict, workspace: int, run: Any, first: int = 0) -> list[bytes]:
        """The output's samples, as bytes each, of running `run(pack, workspace_ptr)` on
        `spec`'s batch of inputs taken from sample `first` of the reference buffers."""
        batched, out = ("dy", "dx") if op == "backward_data" else ("x", "y")
        in_shape, out_shape = ((spec.output_shape, spec.input_shape) if op == "backward_data"
                               else (spec.input_shape, spec.output_shape))
        itemsize = np.dtype(storage_dtype(spec.dtype)).itemsize
        src = self._buffer(batched, invariant_batch(spec) * math.prod(in_shape[1:]), spec.dtype)
        if first:  # a copy of the samples, at an address as aligned as any batch's
            k = math.prod(in_shape[1:])
            part = self.cuda.device_array(in_shape[0] * k, src.dtype, stream=self.stream)
            part.copy_to_device(src[first * k:(first + in_shape[0]) * k], stream=self.stream)
            src = part
        ptrs = {batched: device_pointer(src),
                "w": device_pointer(self._buffer("w", math.prod(spec.weight_shape), spec.dtype))}
        if "b" in tensors:
            ptrs["b"] = device_pointer(self._buffer("b", spec.out_channels, spec.dtype))
        y = self.cuda.device_array(math.prod(out_shape) * itemsize, np.uint8, stream=self.stream)
        ptrs[out] = device_pointer(y)
        ws = self.cuda.device_array(max(workspace, 1), np.uint8, stream=self.stream)
        run({t: ptrs[role] for role, t in tensors.items()}, device_pointer(ws))
        self.stream.synchronize()
        host = y.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        per = math.prod(out_shape[1:]) * itemsize
        return [host[i * per:(i + 1) * per].tobytes() for i in range(out_shape[0])]


class Convolutions:
    """The three convolutions of one input shape through cuDNN (`spec` is the spec at that
    shape), on a layer's handle, with one workspace sized at construction for all of its
    graphs (it never grows, so a frozen layer allocates nothing here).

    Arguments are numba device arrays, NHWC/C-contiguous, in the layer's storage format:
    `forward(x, w, b, y, relu)` writes y = [relu](conv(x, w) + b) (b None without bias);
    `backward_data(d_z, w, d_x)` writes d_x; `backward_filter(x, d_z, d_w)` writes d_w
    (storage format too). `plans` names the cuDNN plan of each graph.
    """

    def __init__(self, cuda, spec: LayerSpec, handle: Any, stream_ptr: int, device: int, allow_tf32: bool,
                 relu_fusion: bool, autotune: bool = False, fast_paths: bool = True) -> None:
        self.cuda = cuda
        ops = ["forward", "backward_data", "backward_filter"]
        if relu_fusion:
            ops.append("forward_relu")
        # One layer at a time builds its cuDNN resources: on the H200 two threads that
        # constructed layers together hung once, one in cudnnCreate, the other
        # allocating its workspace (tests/test_cuda.py, two-thread test).
        with _BUILD_LOCK:
            self.handle = handle
            bench = _Bench(cuda, spec, stream_ptr, self.handle) if autotune else None
            probe = InvarianceProbe(cuda, stream_ptr) if spec.batch_invariant else None
            accuracy = AccuracyProbe(cuda, stream_ptr) if spec.dtype is DType.FLOAT32 and not allow_tf32 else None
            self.graphs = {op: graph(op, spec, device, allow_tf32, self.handle, bench, probe, accuracy) for op in ops}
            del probe, accuracy  # their buffers go back before the workspace is allocated
            size = max(g.workspace_size for g in self.graphs.values())
            self._workspace = cuda.device_array(max(size, 1), np.uint8)
        self.plans = {op: g.plan for op, g in self.graphs.items()}
        self.relu_fusion = relu_fusion
        self.workspace_ptr = device_pointer(self._workspace)
        self._executions = {op: Execution(g, self.handle, self.workspace_ptr, native=fast_paths)
                            for op, g in self.graphs.items()}

    def _run(self, op: str, **arrays) -> None:
        e = self._executions[op]
        for role, a in arrays.items():
            e.set(role, device_pointer(a))
        e.run()

    def forward(self, x, w, b, y, relu: bool = False) -> None:
        if b is None:
            self._run("forward_relu" if relu else "forward", x=x, w=w, y=y)
        else:
            self._run("forward_relu" if relu else "forward", x=x, w=w, b=b, y=y)

    def backward_data(self, d_z, w, d_x) -> None:
        self._run("backward_data", dy=d_z, w=w, dx=d_x)

    def backward_filter(self, x, d_z, d_w) -> None:
        self._run("backward_filter", x=x, dy=d_z, dw=d_w)


class _Bench(_DeviceInputs):
    """Times one plan of a graph for `_autotune`: random device buffers for its tensors,
    CUDA events on the layer's stream, the median of three rounds."""

    def __init__(self, cuda, spec: LayerSpec, stream_ptr: int, handle: Any) -> None:
        super().__init__(cuda, stream_ptr)
        self.spec, self.handle = spec, handle

    def at(self, spec: LayerSpec) -> "_Bench":
        """The same timer for another spec (another batch size)."""
        return _Bench(self.cuda, spec, self.stream_ptr, self.handle)

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

