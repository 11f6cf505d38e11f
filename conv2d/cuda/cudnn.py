"""The one module that talks to cuDNN, through NVIDIA's cudnn-frontend graph API.

For a LayerSpec it builds, once per (spec, device, TF32 choice), the graphs the layer
runs: forward (convolution + bias, and convolution + bias + ReLU for evaluation without
a norm), backward-data and backward-filter. Tensors are NHWC in memory and described to
cuDNN in its NCHW dimension order with NHWC strides; weights (OC, KH, KW, IC) likewise.
Only engines without the NONDETERMINISTIC numerical note are kept; float32 keeps only
engines without TENSOR_CORE / DOWN_CONVERT_INPUTS (no TF32) unless TF32 is allowed;
16-bit types compute in float32 and drop REDUCED_PRECISION_REDUCTION engines.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from conv2d.cuda.runtime import INSTALL_HINT, CudaUnavailableError
from conv2d.spec import DType, LayerSpec


class CudnnError(RuntimeError):
    """A cuDNN failure: names the operation, the spec and cuDNN's message."""


_IMPORT_LOCK = threading.Lock()
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


def create_handle(stream_ptr: int) -> Any:
    cudnn = _import_cudnn()
    try:
        handle = cudnn.create_handle()
        cudnn.set_stream(handle, stream_ptr)
    except Exception as e:
        raise CudnnError(f"cuDNN create_handle: {e}") from e
    return handle


@dataclass
class Graph:
    """One built cuDNN graph and its tensors by role; `run` executes it on raw pointers."""

    op: str
    spec: LayerSpec
    graph: Any
    tensors: dict  # role -> frontend tensor
    workspace_size: int
    lock: threading.Lock

    def run(self, handle: Any, pointers: dict, workspace_ptr: int) -> None:
        pack = {self.tensors[role]: ptr for role, ptr in pointers.items()}
        try:
            # The frontend's graph object keeps lazily built execution caches: one
            # thread at a time per graph (launches are asynchronous, so this is brief).
            with self.lock:
                self.graph.execute(pack, workspace_ptr, handle=handle)
        except Exception as e:
            raise CudnnError(f"cuDNN {self.op} for {self.spec}: {e}") from e


def _dims(spec: LayerSpec) -> dict[str, tuple[list[int], list[int]]]:
    n, h, w, c = spec.input_shape
    _, oh, ow, oc = spec.output_shape
    kh, kw = spec.kernel
    return {
        "x": ([n, c, h, w], [h * w * c, 1, w * c, c]),
        "y": ([n, oc, oh, ow], [oh * ow * oc, 1, ow * oc, oc]),
        "w": ([oc, c, kh, kw], [kh * kw * c, 1, kw * c, c]),
        "b": ([1, oc, 1, 1], [oc, 1, oc, oc]),
    }


def _build(op: str, spec: LayerSpec, handle: Any, allow_tf32: bool) -> Graph:
    cudnn = _import_cudnn()
    dt = {DType.FLOAT32: cudnn.data_type.FLOAT, DType.FLOAT16: cudnn.data_type.HALF,
          DType.BFLOAT16: cudnn.data_type.BFLOAT16}[spec.dtype]
    f32 = cudnn.data_type.FLOAT
    d = _dims(spec)
    conv = dict(padding=list(spec.padding), stride=list(spec.stride), dilation=[1, 1])
    try:
        g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

        def tensor(role, dtype=dt):
            dim, stride = d[role]
            return g.tensor(name=role, dim=dim, stride=stride, data_type=dtype)

        if op in ("forward", "forward_relu"):
            t = {"x": tensor("x"), "w": tensor("w"), "b": tensor("b")}
            out = g.bias(input=g.conv_fprop(image=t["x"], weight=t["w"], **conv), bias=t["b"])
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
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        notes = [cudnn.numerical_note.NONDETERMINISTIC]
        if spec.dtype is DType.FLOAT32 and not allow_tf32:
            notes += [cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS]
        if spec.dtype in (DType.FLOAT16, DType.BFLOAT16):
            notes += [cudnn.numerical_note.REDUCED_PRECISION_REDUCTION]
        g.deselect_numeric_notes(notes)
        g.check_support()
        g.build_plans()
        workspace = int(g.get_workspace_size())
    except CudnnError:
        raise
    except Exception as e:
        detail = ""
        try:
            detail = cudnn.get_last_error_string()
        except Exception:
            pass
        raise CudnnError(f"cuDNN {op} for {spec}: no deterministic engine could be built "
                         f"({type(e).__name__}: {e}{'; ' + detail if detail else ''})") from e
    return Graph(op, spec, g, t, workspace, threading.Lock())


_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()
_KEY_LOCKS: dict = {}


def graph(op: str, spec: LayerSpec, device: int, allow_tf32: bool, handle: Any) -> Graph:
    """The built graph for (op, the spec's convolution, device, allow_tf32), from the cache
    or built now.
    Threads asking for the same key wait for one build; other keys build in parallel."""
    # The convolutions do not depend on the activation or norm: key by what they read.
    conv_key = (spec.input_shape, spec.out_channels, spec.kernel, spec.stride, spec.padding, spec.dtype)
    key = (op, conv_key, device, bool(allow_tf32) and spec.dtype is DType.FLOAT32)
    with _CACHE_LOCK:
        found = _CACHE.get(key)
        if found is not None:
            return found
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:
        with _CACHE_LOCK:
            found = _CACHE.get(key)
        if found is None:
            found = _build(op, spec, handle, allow_tf32)
            with _CACHE_LOCK:
                _CACHE[key] = found
    return found


def cache_size() -> int:
    with _CACHE_LOCK:
        return len(_CACHE)


class Convolutions:
    """A layer's three convolutions through cuDNN, on its handle and stream, with one
    workspace grown on demand (and not at all once frozen).

    Arguments are numba device arrays, NHWC/C-contiguous, in the layer's storage format:
    `forward(x, w, b, y, relu)` writes y = [relu](conv(x, w) + b); `backward_data(d_z, w,
    d_x)` writes d_x; `backward_filter(x, d_z, d_w)` writes d_w (storage format too).
    """

    def __init__(self, cuda, spec: LayerSpec, stream_ptr: int, device: int, allow_tf32: bool,
                 relu_fusion: bool) -> None:
        import numpy as np

        self._np = np
        self.cuda = cuda
        self.handle = create_handle(stream_ptr)
        ops = ["forward", "backward_data", "backward_filter"] + (["forward_relu"] if relu_fusion else [])
        self.graphs = {op: graph(op, spec, device, allow_tf32, self.handle) for op in ops}
        self.relu_fusion = relu_fusion
        self.frozen = False
        self._workspace = None
        self._workspace_size = 0
        self._reserve(max(g.workspace_size for g in self.graphs.values()))

    def _reserve(self, size: int) -> int:
        if self._workspace is None or size > self._workspace_size:
            if self.frozen:
                raise RuntimeError(f"workspace: the layer is frozen, and cuDNN needs {size} bytes of workspace "
                                   f"where {self._workspace_size} are allocated")
            self._workspace = self.cuda.device_array(max(size, 1), self._np.uint8)
            self._workspace_size = size
        return _pointer(self._workspace)

    def _run(self, op: str, pointers: dict) -> None:
        g = self.graphs[op]
        g.run(self.handle, pointers, self._reserve(g.workspace_size))

    def forward(self, x, w, b, y, relu: bool = False) -> None:
        op = "forward_relu" if relu else "forward"
        self._run(op, {"x": _pointer(x), "w": _pointer(w), "b": _pointer(b), "y": _pointer(y)})

    def backward_data(self, d_z, w, d_x) -> None:
        self._run("backward_data", {"dy": _pointer(d_z), "w": _pointer(w), "dx": _pointer(d_x)})

    def backward_filter(self, x, d_z, d_w) -> None:
        self._run("backward_filter", {"x": _pointer(x), "dy": _pointer(d_z), "dw": _pointer(d_w)})


def _pointer(a: Any) -> int:
    return int(a.__cuda_array_interface__["data"][0])
