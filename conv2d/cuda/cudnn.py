"""The one module that talks to cuDNN, through NVIDIA's cudnn-frontend graph API: the
library, handles, and the graphs the layer runs, built and cached.

For a LayerSpec it builds, once per (spec, device, TF32 choice, plan choice), the graphs
the layer runs: forward (convolution + bias, and convolution + bias + ReLU for evaluation
without a norm), backward-data and backward-filter; for a 16-bit ReLU layer without a
norm also forward_pre_relu, which writes the pre-activations and their ReLU in one graph
(the training forward's two outputs; cuDNN 9.19's float32 engine for it fails at execute,
docs/cudnn_fusions_cuda.md, so float32 keeps the ReLU in the numba pass). Which
plan a graph runs is chosen by one of three policies (plan_choice.py: heuristics with an
accuracy check, plan_heuristic.py; autotune, plan_autotune.py; one plan at every batch
size, plan_invariant.py); executing a built graph is cudnn_execution.py's job.

Tensors are NHWC in memory and described to cuDNN in its NCHW dimension order with NHWC
strides; weights (OC, KH, KW, IC / groups) likewise: cuDNN infers the groups from the
filter's channel count (as PyTorch's cuDNN path does). Padding goes to the frontend as
pre/post padding (so asymmetric zero padding is cuDNN's too), dilation as the
convolution's; other padding modes are padded by the layer first (steps.pad_input), and
the graphs see zeros. Only engines without the NONDETERMINISTIC numerical note are kept;
float32 keeps only engines without TENSOR_CORE / DOWN_CONVERT_INPUTS (no TF32) unless TF32
is allowed; 16-bit types compute in float32 and drop REDUCED_PRECISION_REDUCTION engines.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from conv2d.cuda.runtime import INSTALL_HINT, CudaUnavailableError
from conv2d.spec import DType, LayerSpec


class CudnnError(RuntimeError):
    """A cuDNN failure: names the operation, the spec and cuDNN's message."""


_IMPORT_LOCK = threading.Lock()
# cuDNN's engine heuristics by storage dtype, asked in this order (heur_mode names); a
# plan is a pure function of the graph, the device and these, so the choice is
# reproducible. Mode B's float32 plans were the faster ones on the RL shapes and A's the
# faster for bfloat16 (a one-off study, since removed: git before commit 233f8cb keeps it
# and its results), so float32 asks B first and 16-bit layers A.
HEUR_MODES = {DType.FLOAT32: ("B", "FALLBACK"), DType.BFLOAT16: ("A", "FALLBACK"), DType.FLOAT16: ("A", "FALLBACK")}
_cudnn = None


def import_cudnn():
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


BUILD_LOCK = threading.RLock()


def create_handle(stream_ptr: int) -> Any:
    """A cuDNN handle on the stream `stream_ptr`, created under the build lock (two threads
    creating handles and workspaces together hung once on the H200)."""
    cudnn = import_cudnn()
    with BUILD_LOCK:
        try:
            handle = cudnn.create_handle()
            cudnn.set_stream(handle, stream_ptr)
        except Exception as e:
            raise CudnnError(f"cuDNN create_handle: {e}") from e
    return handle


def set_stream(handle: Any, stream_ptr: int) -> None:
    """Point the handle's work at another stream."""
    try:
        import_cudnn().set_stream(handle, stream_ptr)
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


def planned(op: str, spec: LayerSpec, handle: Any, allow_tf32: bool, config: Any = None,
             modes: tuple[str, ...] | None = None) -> tuple[Any, dict]:
    """The frontend graph of `op` for `spec` and its tensors by role, its plan list made
    (cuDNN's heuristics `modes`, by default HEUR_MODES', or the one recorded (engine id,
    knobs) `config`) and filtered by the numerical notes, not yet built."""
    cudnn = import_cudnn()
    dt = {DType.FLOAT32: cudnn.data_type.FLOAT, DType.FLOAT16: cudnn.data_type.HALF,
          DType.BFLOAT16: cudnn.data_type.BFLOAT16}[spec.dtype]
    f32 = cudnn.data_type.FLOAT
    d = _dims(spec)
    conv = _geometry(spec)
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def tensor(role, dtype=dt):
        dim, stride = d[role]
        return g.tensor(name=role, dim=dim, stride=stride, data_type=dtype)

    if op in ("forward", "forward_relu", "forward_pre_relu"):
        t = {"x": tensor("x"), "w": tensor("w")}
        out = g.conv_fprop(image=t["x"], weight=t["w"], **conv)
        if spec.bias:
            t["b"] = tensor("b")
            out = g.bias(input=out, bias=t["b"])
        if op == "forward_pre_relu":  # the pre-activations kept beside their ReLU
            out.set_output(True).set_data_type(dt)
            t["z"] = out
        if op != "forward":
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


def failure(op: str, spec: LayerSpec, e: Exception,
             what: str = "no deterministic engine could be built") -> CudnnError:
    detail = ""
    try:
        detail = import_cudnn().get_last_error_string()
    except Exception:
        pass
    return CudnnError(f"cuDNN {op} for {spec}: {what} ({type(e).__name__}: {e}{'; ' + detail if detail else ''})")


def build(op: str, spec: LayerSpec, handle: Any, allow_tf32: bool, config: Any = None,
          modes: tuple[str, ...] | None = None, select: Callable[[Any, Any, dict], Any] | None = None) -> Graph:
    """The built graph: cuDNN's heuristic choice (heuristics `modes`), the recorded
    `config` (engine id, frozenset of (knob, value)), or the plan `select(cudnn, g,
    tensors)` picks and builds (a policy's; None where it picked none: the heuristic's
    choice is built)."""
    cudnn = import_cudnn()
    if spec.pads_with_copies:
        raise ValueError(f"cuDNN pads with zeros only; pad the input first (padding_mode={spec.padding_mode!r})")
    try:
        g, t = planned(op, spec, handle, allow_tf32, config, modes)
        plan = None if select is None else select(cudnn, g, t)
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
        raise failure(op, spec, e, what) from e
    return Graph(op, spec, g, t, workspace, threading.Lock(), name)


_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()
_KEY_LOCKS: dict = {}


def conv_key(spec: LayerSpec, batch: bool = True) -> tuple:
    # The convolutions do not depend on the activation or norm: key by what they read.
    shape = spec.input_shape if batch else spec.input_shape[1:]
    return (shape, spec.out_channels, spec.kernel, spec.stride, spec.pads, spec.dilation, spec.groups, spec.dtype,
            spec.bias)


def cached(key: tuple, make: Any) -> Any:
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
