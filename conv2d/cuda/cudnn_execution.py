"""Running built cuDNN graphs: `Execution`, one graph's execute prepared once for a handle
and workspace, and `Convolutions`, the three convolutions of one input shape with the
plans plan_choice.py chose and one workspace for all."""

from __future__ import annotations

from typing import Any

import numpy as np

from conv2d.cuda import cudnn, plan_autotune, plan_choice, plan_heuristic, plan_invariant
from conv2d.cuda.launch import device_pointer
from conv2d.spec import DType, LayerSpec


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

    def __init__(self, graph: cudnn.Graph, handle: Any, workspace_ptr: int, native: bool = True) -> None:
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
            raise cudnn.CudnnError(f"cuDNN {g.op} for {g.spec}: {e}") from e

    @property
    def native(self) -> bool:
        """Whether runs go through the frontend's native pointer-array entry point."""
        return self._native is not None


class Convolutions:
    """The three convolutions of one input shape through cuDNN (`spec` is the spec at that
    shape), on a layer's handle, with one workspace sized at construction for all of its
    graphs (it never grows, so a frozen layer allocates nothing here).

    Arguments are numba device arrays, NHWC/C-contiguous, in the layer's storage format:
    `forward(x, w, b, y, relu)` writes y = [relu](conv(x, w) + b) (b None without bias);
    `forward_pre_relu(x, w, b, z, y)` writes z = conv(x, w) + b and y = relu(z) in one
    graph where `pre_relu` holds (else it writes nothing and returns False);
    `backward_data(d_z, w, d_x)` writes d_x; `backward_filter(x, d_z, d_w)` writes d_w
    (storage format too). `plans` names the cuDNN plan of each graph.

    `pre_relu_fusion` asks for forward_pre_relu (16-bit ReLU layers without a norm: its
    float32 engine fails at execute, docs/cudnn_fusions_cuda.md). Where its graph does not
    build, or its first execute fails, `pre_relu` is False and the layer runs the
    convolution and its activation pass apart (`pre_relu_failure` says why).
    """

    def __init__(self, cuda, spec: LayerSpec, handle: Any, stream_ptr: int, device: int, allow_tf32: bool,
                 relu_fusion: bool, autotune: bool = False, fast_paths: bool = True,
                 pre_relu_fusion: bool = False) -> None:
        self.cuda = cuda
        ops = ["forward", "backward_data", "backward_filter"]
        if relu_fusion:
            ops.append("forward_relu")
        self.pre_relu_failure: str | None = None
        # One layer at a time builds its cuDNN resources: on the H200 two threads that
        # constructed layers together hung once, one in cudnnCreate, the other
        # allocating its workspace (tests/test_cuda_layer.py, two-thread test).
        with cudnn.BUILD_LOCK:
            self.handle = handle
            bench = plan_autotune.Bench(cuda, spec, stream_ptr, self.handle) if autotune else None
            probe = plan_invariant.InvarianceProbe(cuda, stream_ptr) if spec.batch_invariant else None
            accuracy = plan_heuristic.AccuracyProbe(cuda, stream_ptr) if spec.dtype is DType.FLOAT32 and not allow_tf32 else None
            self.graphs = {op: plan_choice.graph(op, spec, device, allow_tf32, self.handle, bench, probe, accuracy) for op in ops}
            if pre_relu_fusion:
                try:
                    self.graphs["forward_pre_relu"] = plan_choice.graph("forward_pre_relu", spec, device, allow_tf32,
                                                                        self.handle, bench, probe, accuracy)
                except cudnn.CudnnError as e:  # no engine: the unfused pair stays
                    self.pre_relu_failure = str(e)
            del probe, accuracy  # their buffers go back before the workspace is allocated
            size = max(g.workspace_size for g in self.graphs.values())
            self._workspace = cuda.device_array(max(size, 1), np.uint8)
        self.plans = {op: g.plan for op, g in self.graphs.items()}
        self.relu_fusion = relu_fusion
        self.pre_relu = "forward_pre_relu" in self.graphs
        self._pre_relu_ran = False
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

    def forward_pre_relu(self, x, w, b, z, y) -> bool:
        """z = conv(x, w) + b and y = relu(z) (b None without bias) in one graph; False
        (nothing written) where the fused graph is not available."""
        if not self.pre_relu:
            return False
        arrays = dict(x=x, w=w, z=z, y=y) if b is None else dict(x=x, w=w, b=b, z=z, y=y)
        if self._pre_relu_ran:
            self._run("forward_pre_relu", **arrays)
            return True
        try:
            self._run("forward_pre_relu", **arrays)
        except cudnn.CudnnError as e:  # its engine fails at execute: the unfused pair from now on
            self.pre_relu, self.pre_relu_failure = False, str(e)
            return False
        self._pre_relu_ran = True
        return True

    def backward_data(self, d_z, w, d_x) -> None:
        self._run("backward_data", dy=d_z, w=w, dx=d_x)

    def backward_filter(self, x, d_z, d_w) -> None:
        self._run("backward_filter", x=x, dy=d_z, dw=d_w)
