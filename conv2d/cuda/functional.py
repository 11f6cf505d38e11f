"""The layer's two functions on the GPU: `Functions(spec, ...)` with `forward`,
`evaluate` and `backward` over explicit parameters, running statistics and a `Saved`
object, the same names as `conv2d/reference/functional.py`.

cuDNN (conv2d/cuda/cudnn.py) runs the three convolutions; the numba kernels
(conv2d/cuda/kernels/) the norm, activation and bias gradient. Batch statistics are
one pass of sums shifted by the channel's first value (sum(z - s), sum((z - s)^2)), where
the reference takes two passes; both are within the dtype's tolerance of the oracle.

Any input shape (N, H, W) the kernel fits is taken: each new one gets a `_Plan` (its
cuDNN graphs and workspace, reduction scratch and prepared launches), built on first use
and cached (at most `max_shapes`, least recently used dropped; the spec's batch_size is
planned at construction). Every call runs on one stream: the layer's own (or the one it
was given), or torch's current stream for torch tensors when the layer was given none;
the cuDNN handle and the prepared launches follow it, and a switch orders the new stream
after the old one. Arrays:

- inputs `x` (N, H, W, C) and `d_y` (N, OH, OW, OC): NumPy arrays (copied to the device,
  results copied back: NumPy out) or device arrays (torch CUDA tensors, CuPy, numba, any
  `__cuda_array_interface__`), read in place; outputs in the input's library (torch
  tensors from torch's allocator, bfloat16 as torch.bfloat16; CuPy and numba arrays hold
  bfloat16 as uint16 bits, neither having a bfloat16 type).
- `params` ("weights", "bias" if the spec has it, "gamma"/"beta" with a norm), `running`
  ("running_mean"/"running_var") and gradient arrays: device arrays of the state layout's
  shapes (or flat), storage dtype for weights and bias, float32 for the norm's, read
  and written in place.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from conv2d.arrays import CUPY, NUMPY, TORCH, library
from conv2d.checks import describe, input_spec
from conv2d.cuda import cudnn, kernels as K
from conv2d.cuda.kernels import simple
from conv2d.cuda.launch import Launch, device_pointer
from conv2d.cuda.memory import OutputAllocator
from conv2d.cuda.runtime import (as_stream, device_dtype, device_input, device_view, from_device_bits, numba_cuda,
                                 require_gpu, same_stream, simulating, stream_handle, to_device_bits,
                                 torch_current_stream, torch_dtype, torch_tensor_over, zero_fill)
from conv2d.dtypes import storage_dtype
from conv2d.spec import Activation, DType, LayerSpec, Normalization
from conv2d.state import RUNNING, grad_layout, state_layout


def _capturing(stream: Any) -> bool:
    """Whether `stream` is being captured into a CUDA graph (torch.cuda.graph, say)."""
    if simulating():
        return False
    from cuda.bindings import driver

    err, status = driver.cuStreamIsCapturing(driver.CUstream(stream_handle(stream)))
    return err == driver.CUresult.CUDA_SUCCESS and status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


# Row-kernel arguments fixed under a launch's key (set when it is prepared).
_FIXED_ROW_ARGS = ("batch_stats", "count", "var_scale", "accumulate")


class Saved:
    """What `backward` needs from one `forward`: the call's spec (its N, H, W), the input
    (a device array), the pre-activations (flat, storage format), the norm's mean and
    inv_std (float32; per channel or per sample) and whether they came from the batch.
    Its device buffers go back to the shape's free list when it is dropped; a frozen
    layer's are fixed, and `generation` tells whether a later forward overwrote them."""

    __slots__ = ("spec", "x", "pre", "mean", "inv_std", "batch_stats", "owner", "generation", "slot", "_plan",
                 "_buffers")

    def __init__(self, owner: "Functions", plan: "_Plan", x: Any, buffers: tuple, batch_stats: bool,
                 generation: int | None, recycle: bool = True) -> None:
        self.spec, self.x, self.batch_stats, self.owner = plan.spec, x, batch_stats, owner
        self.pre, self.mean, self.inv_std = buffers
        self.generation = generation
        self.slot = plan.slot(buffers)
        self._plan = plan
        self._buffers = buffers if generation is None and recycle else None

    def __del__(self) -> None:
        if self._buffers is not None:
            self._plan.free_saved.append(self._buffers)

    @property
    def resources(self) -> Any:
        """What the call's kernels used besides the caller's arrays: its shape's plan
        (reduction scratch, cuDNN workspace, prepared launches' counters). Whoever keeps a
        captured CUDA graph of the call keeps this too, so that they stay allocated."""
        return self._plan


class _Plan:
    """One input shape of a layer: the spec at that shape, its cuDNN convolutions, the
    reduction scratch, prepared launches, free saved buffers, and once frozen the fixed
    buffers."""

    def __init__(self, fn: "Functions", spec: LayerSpec) -> None:
        cuda, f32 = fn.cuda, np.float32
        alloc = cuda.device_array
        n, oh, ow, oc = spec.output_shape
        self.spec = spec
        self.M, self.C, self.S = n * oh * ow, oc, oh * ow * oc
        self.total = self.M * self.C
        self.groups = {Normalization.BATCH_NORM: oc, Normalization.LAYER_NORM: n}.get(spec.normalization, 1)
        self.P = fn.config.row_partition(self.M, self.C)
        self.Q = fn.config.segment_partition(self.S)
        self.conv = fn._convolutions(spec)
        # Reduction scratch: the row kernels' partials (one row a block, then one a group
        # of blocks), the per-sample partials of layer norm, the totals.
        rows = self.P + fn.config.phase_groups(self.P)
        self.col = (alloc(rows * oc, f32), alloc(rows * oc, f32))
        self.seg = (alloc(self.Q * n, f32), alloc(self.Q * n, f32))
        self.sums_col = alloc(2 * oc, f32)
        self.sums_seg = alloc(2 * n, f32)
        self.d_z = alloc(self.total, fn.dev_dt)
        self.d_w = alloc(math.prod(spec.weight_shape), fn.dev_dt)
        self.launches: dict[Any, Launch] = {}
        self.free_saved: list[tuple] = []
        self.slots: dict[int, tuple[int, Any]] = {}
        self.eval_buffers: tuple | None = None
        self.frozen: dict[str, Any] | None = None
        self.generation = 0
        self.wrapped: dict = {}  # frozen outputs as torch tensors, made once
        self.scratch = simple.Scratch(cuda, self.total, self.groups, oc) if fn.kernels == "simple" else None

    def saved_buffers(self, fn: "Functions") -> tuple:
        """A new set of (pre, mean, inv_std) buffers, numbered: prepared launches are kept
        per set, so that a launch always sees the same buffers and sets no pointer."""
        alloc, f32 = fn.cuda.device_array, np.float32
        buffers = alloc(self.total, fn.dev_dt), alloc(self.groups, f32), alloc(self.groups, f32)
        self.slots[id(buffers[0])] = (len(self.slots), buffers[0])  # the array pins its id
        return buffers

    def slot(self, buffers: tuple) -> Any:
        """The number of a set of saved buffers ("caller" for the caller's own arrays)."""
        found = self.slots.get(id(buffers[0]))
        return found[0] if found is not None and found[1] is buffers[0] else "caller"


class Functions:
    """The CUDA backend's functions for one spec; see the module docstring."""

    name = "cuda"

    def __init__(self, spec: LayerSpec, stream: Any = None, allow_tf32: bool = False, autotune: bool = False,
                 convolutions: Callable[[LayerSpec], Any] | None = None, max_shapes: int = 8,
                 fast_paths: bool = True, kernels: str = "fast",
                 launch_config: K.LaunchConfig = K.DEFAULT_CONFIG, evaluate_kernel: str = "cudnn") -> None:
        """`stream`: the caller's stream (numba, torch or cupy stream, or a CUstream int);
        by default a new one, and torch's current stream for torch tensors. `allow_tf32`:
        let float32 convolutions use TF32 tensor cores. `autotune`: time every
        deterministic cuDNN plan of each convolution once per process and use the fastest
        (else cuDNN's heuristic choice). `convolutions`: a stand-in for cuDNN, called with
        the spec of an input shape, with `cudnn.Convolutions`' methods (tests use one in
        numba's simulator, where cuDNN cannot run). `max_shapes`: input shapes kept planned.
        `fast_paths`: prepared kernel launches straight to the driver and cuDNN executes
        through the frontend's native pointer array (private APIs, `launch.py`,
        `cudnn.Execution`); False takes numba's dispatcher and the frontend's public
        execute, with bitwise the same results (tests/test_cuda.py), for a new numba or
        frontend whose private API moved. `kernels`: "fast" (kernels/fast.py, fused) or
        "simple" (kernels/simple.py: one plain kernel per reference step, through numba's
        dispatcher; for reading, and for checking a new fast kernel against).
        `launch_config`: the fast kernels' launch settings (kernels.LaunchConfig).
        `evaluate_kernel`: "cudnn" (the convolution through cuDNN, then the norm and
        activation kernels) or "direct" (one kernel that sums the convolution itself and
        applies the norm and activation: for acting at small N, where launches and cuDNN's
        execute cost more than the math; no norm or batch norm). The two agree within the
        tolerance, not bitwise (another summation order); each is deterministic."""
        if spec.dtype is DType.FLOAT64:
            raise ValueError("dtype: float64 is the reference backend's oracle type; the CUDA backend takes "
                             "float32, float16 or bfloat16")
        for name, value in (("allow_tf32", allow_tf32), ("autotune", autotune), ("fast_paths", fast_paths)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {value!r}")
        if evaluate_kernel not in ("cudnn", "direct"):
            raise ValueError(f"evaluate_kernel: expected 'cudnn' or 'direct', got {evaluate_kernel!r}")
        if evaluate_kernel == "direct" and spec.normalization is Normalization.LAYER_NORM:
            raise ValueError("evaluate_kernel: 'direct' takes no norm or batch norm; layer norm needs each "
                             "sample's statistics first (use 'cudnn')")
        if kernels not in ("fast", "simple"):
            raise ValueError(f"kernels: expected 'fast' or 'simple', got {kernels!r}")
        if not isinstance(launch_config, K.LaunchConfig):
            raise TypeError(f"launch_config: expected a conv2d.cuda.kernels.LaunchConfig, got {launch_config!r}")
        if not isinstance(max_shapes, int) or isinstance(max_shapes, bool) or max_shapes < 1:
            raise ValueError(f"max_shapes: expected an int >= 1, got {max_shapes!r}")
        cuda = numba_cuda() if convolutions is not None else require_gpu()
        self.cuda = cuda
        self.spec = spec
        self.stream_given = stream is not None
        self.stream = as_stream(cuda, stream)
        self._current = self.stream  # the stream of the last call
        self._capture_stream = None  # the stream every call uses while a graph is captured
        self.relu_fusion = spec.normalization is Normalization.NONE and spec.activation is Activation.RELU
        if convolutions is None:
            handle = cudnn.create_handle(stream_handle(self.stream))
            self._handle = handle
            device = cuda.get_current_device().id
            # Closes over the stream, not self: no reference cycle, so a dropped layer's
            # device memory goes back when its last reference does, not when the garbage
            # collector runs (which may be inside a caller's CUDA graph capture, where
            # numba's frees would invalidate it).
            own_stream, relu_fusion = self.stream, self.relu_fusion
            convolutions = lambda s: cudnn.Convolutions(cuda, s, handle, stream_handle(own_stream), device,  # noqa: E731
                                                        allow_tf32, relu_fusion, autotune, fast_paths)
        else:
            self._handle = None
        self._convolutions = convolutions
        self.fast_paths = fast_paths
        self.kernels = kernels
        self.evaluate_kernel = evaluate_kernel
        if kernels == "simple":
            self.simple = simple.simple_set(spec.dtype.value, spec.activation)
            self.simple32 = simple.simple_set("float32", spec.activation)
        # Row-kernel threads keep `lanes` channels read with one 8-byte load; d_y that is
        # not 8-byte aligned (a caller's offset view) is read one value at a time by the
        # same sums in the same order (`narrow`), so results do not depend on it.
        self.config = launch_config
        self.lanes = K.lanes_for(spec.dtype.value, spec.out_channels) if launch_config.wide_rows else 1
        kinds = (spec.dtype.value, spec.activation, spec.normalization, self.lanes)
        self.k = K.kernel_set(*kinds, self.lanes > 1, launch_config)
        self._narrow = K.kernel_set(*kinds, False, launch_config) if self.lanes > 1 else self.k
        self.dev_dt = device_dtype(spec.dtype)
        self.st = storage_dtype(spec.dtype)
        self.max_shapes = max_shapes
        self._layout = state_layout(spec)
        self._grad_layout = grad_layout(spec)
        self._param_names = [k for k in self._layout if k not in RUNNING]
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._lock = threading.RLock()
        self._dummy = cuda.device_array(1, np.float32)  # stands for absent arrays in kernel arguments
        self._allocator = OutputAllocator(cuda, self.stream)
        self._views: dict = {}  # caller arrays -> checked flat device views, by identity
        self._frozen = False
        if spec.batch_size is not None:
            self._plan(spec)

    @property
    def conv_plans(self) -> dict[str, str]:
        """The cuDNN plan (engine name) of each convolution graph of the planned (else the
        last) input shape."""
        with self._lock:
            if not self._plans:
                return {}
            plan = self._plans.get(self._key(self.spec)) if self.spec.batch_size else None
            plan = plan or next(reversed(self._plans.values()))
            return dict(getattr(plan.conv, "plans", {}))

    @property
    def current_stream(self) -> Any:
        """The stream of the last call (the layer's own, or torch's current one)."""
        return self._current

    # Optimizer steps of a layer's flat parameters (conv2d.optim), one launch on the current stream.
    def adam_step(self, params: Mapping[str, Any], grads: Mapping[str, Any], buffers: Mapping[str, dict],
                  step: Any, h: dict, prepared: dict) -> None:
        """One Adam step of a layer's parameters; `step` is the device step count and
        `prepared` a dict the caller keeps per layer for the prepared launch."""
        from conv2d.cuda import optim

        with self._lock:
            optim.adam_step(self._launch, self._dummy, self.spec.dtype.value, self._current, params, grads, buffers,
                            step, h, prepared)

    def sgd_step(self, params: Mapping[str, Any], grads: Mapping[str, Any], buffers: Mapping[str, dict],
                 step: Any, h: dict, prepared: dict) -> None:
        """One SGD step of a layer's parameters (see `adam_step`)."""
        from conv2d.cuda import optim

        with self._lock:
            optim.sgd_step(self._launch, self._dummy, self.spec.dtype.value, self._current, params, grads, buffers,
                           step, h, prepared)

    @property
    def launches(self) -> dict[tuple, Launch]:
        """Every prepared kernel launch, keyed by (input shape (N, H, W), launch name)."""
        with self._lock:
            return {(shape, key): launch for shape, plan in self._plans.items() for key, launch in plan.launches.items()}

    # Shapes --------------------------------------------------------------------------------
    @staticmethod
    def _key(spec: LayerSpec) -> tuple[int, int, int]:
        return (spec.batch_size, spec.in_height, spec.in_width)

    def _plan(self, call: LayerSpec) -> _Plan:
        key = self._key(call)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        if self._frozen:
            raise RuntimeError(f"x: the layer is frozen and has no plan for input shape {call.input_shape} "
                               f"(planned: {[p.spec.input_shape for p in self._plans.values()]}); a new shape "
                               f"needs device memory")
        plan = self._plans[key] = _Plan(self, call)
        while len(self._plans) > self.max_shapes:
            self._plans.popitem(last=False)
        return plan

    # Arrays --------------------------------------------------------------------------------
    def check_input(self, name: str, x: Any) -> LayerSpec:
        """The call's spec for input `x`, after the checks `forward` makes of it."""
        return self._input(name, x)[0]

    def _input(self, name: str, a: Any) -> tuple[LayerSpec, Any, str]:
        """(call spec, device array, library) of an input (N, H, W, C), checked."""
        lib = library(a)
        if lib is None or not hasattr(a, "shape"):
            raise TypeError(f"{name}: expected a numpy.ndarray or a device array with __cuda_array_interface__, "
                            f"got {describe(a)}")
        if self._frozen and lib == NUMPY:
            raise RuntimeError(f"{name}: the layer is frozen; pass a device array (a NumPy array would be "
                               f"copied into newly allocated device memory)")
        call = input_spec(name, a, self.spec)
        return call, device_input(self.cuda, name, a, call.input_shape, self.spec.dtype, self.stream,
                                  self._allocator.array), lib

    def _arrays(self, group: str, arrays: Mapping[str, Any] | None, names: list[str]) -> dict[str, Any]:
        """Flat device views of the caller's arrays `names` (state layout shapes, or flat),
        checked once per set of array objects."""
        last = self._views.get(group)
        if last is not None and last[0] is arrays and all(arrays.get(k) is a for k, a in last[1]):
            return last[2]  # the same dict of the same arrays as last time (a layer's own)
        if not isinstance(arrays, Mapping) or set(arrays) != set(names):
            got = sorted(arrays) if isinstance(arrays, Mapping) else arrays
            raise ValueError(f"{group}: expected keys {names}, got {got!r}")
        key = (group, *(id(arrays[k]) for k in names))
        found = self._views.get(key)
        if found is not None:
            self._views[group] = (arrays, [(k, arrays[k]) for k in names], found[1])
            return found[1]
        views = self._flat_views(group, arrays, names)
        if len(self._views) >= 32:
            self._views.clear()
        self._views[key] = ([arrays[k] for k in names], views)  # the originals pin the ids
        self._views[group] = (arrays, [(k, arrays[k]) for k in names], views)
        return views

    def _flat_views(self, group: str, arrays: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
        """Checked flat device views of `arrays[k]` for k in `names` (keys checked by the
        caller), each of its state layout's shape (or flat) and dtype."""
        layout = self._layout
        views = {}
        for k in names:
            a = arrays[k]
            shape, dt = layout[k]
            if isinstance(a, np.ndarray) or not hasattr(a, "shape"):
                raise TypeError(f"{group}[{k!r}]: expected a device array (the CUDA backend reads and writes "
                                f"them in place), got {type(a).__name__}")
            views[k] = device_view(self.cuda, f"{group}[{k!r}]", a, self.spec.dtype if dt == self.st else
                                   DType.FLOAT32, shape, flat=True)
        return views

    def _params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return self._arrays("params", params, self._param_names)

    def _running(self, running: Mapping[str, Any] | None, need: bool) -> dict[str, Any] | None:
        if self.spec.normalization is not Normalization.BATCH_NORM or (running is None and not need):
            return None
        return self._arrays("running", running, list(RUNNING))

    # Streams -------------------------------------------------------------------------------
    def _enter(self, lib: str, a: Any) -> Any:
        """The stream of a call with arrays of library `lib` (`a` one of them), switched to."""
        stream = self._capture_stream or self.stream
        if lib == TORCH and not self.stream_given and self._capture_stream is None:
            ptr = torch_current_stream(a)
            if ptr != stream_handle(self._current):
                stream = self.cuda.external_stream(ptr) if ptr else self.cuda.default_stream()
            else:
                stream = self._current
        if stream is not self._current:
            self._switch(stream)
        return stream

    def release(self, resources: Any) -> None:
        """Let the prepared launches of a call's plan (its Saved's `resources`) go of the
        caller's torch tensors of their last call (Launch.release), which they keep
        otherwise until the next call: for a caller that replays graphs keyed by
        addresses (conv2d.torch.graphs), where kept tensors make torch hand out other
        blocks on the next step."""
        with self._lock:
            for launch in resources.launches.values():
                launch.release()

    def release_all(self) -> None:
        """`release` for every planned shape, and the checked views of the caller's
        parameter and running arrays dropped: afterwards the functions keep none of the
        caller's tensors. For callers whose tensors come from a memory pool that may hold
        only what they track (torch.compile's CUDA graph trees, mode="reduce-overhead",
        where functionalisation hands the running statistics as fresh clones)."""
        with self._lock:
            for plan in self._plans.values():
                for launch in plan.launches.values():
                    launch.release()
            self._views.clear()

    def deferred_frees(self) -> contextlib.AbstractContextManager:
        """A context in which numba frees no device memory, events or streams (it queues
        them): for calls inside a CUDA graph capture, which a free would invalidate."""
        return self.cuda.defer_cleanup()

    def follow(self, a: Any) -> None:
        """Make the stream that a call on the array `a` would run on (torch's current one
        for a torch tensor) this layer's current stream, ordered after the calls before it,
        as such a call does first; for a caller that replays a captured graph of these
        functions' calls on that stream (conv2d.torch.graphs)."""
        with self._lock:
            self._enter(library(a), a)

    def _switch(self, stream: Any) -> None:
        # The new stream waits for what the old one was given (the scratch and free
        # buffers are shared), then the handle and launches move to it.
        if not _capturing(stream):  # a capture may not wait on work recorded outside it
            event = self.cuda.event(timing=False)
            event.record(self._current)
            event.wait(stream)
        if self._handle is not None:
            cudnn.set_stream(self._handle, stream_handle(stream))
        self._current = stream  # each prepared launch follows it when next called (_call)

    # Outputs -------------------------------------------------------------------------------
    def _output(self, plan: _Plan, name: str, shape: tuple[int, ...], lib: str, like: Any) -> tuple[Any, Any]:
        """(device array the kernels write, what the caller gets) for output `name`."""
        if plan.frozen is not None:
            arr = plan.frozen[name]
            if lib == TORCH:
                wrapped = plan.wrapped.get(name)
                if wrapped is None:
                    wrapped = plan.wrapped[name] = torch_tensor_over(arr, device_pointer(arr), shape,
                                                                     self.spec.dtype)
                return arr, wrapped
        elif lib == TORCH:
            import torch

            t = torch.empty(shape, dtype=torch_dtype(self.spec.dtype), device=like.device)
            return device_view(self.cuda, name, t, self.spec.dtype), t
        else:
            arr = self._allocator.array(shape, self.dev_dt)
        if lib == CUPY:
            import cupy

            return arr, cupy.asarray(arr)
        return arr, arr

    def _given(self, name: str, a: Any, lib: str, shape: tuple[int, ...]) -> Any:
        """The checked device view of an output array the caller gives (`y_out`, `d_x_out`), or None."""
        if a is None:
            return None
        if lib == NUMPY or isinstance(a, np.ndarray):
            raise TypeError(f"{name}: expected a device array beside device inputs (a NumPy call's results are "
                            f"host copies), got {describe(a)} with {lib} inputs")
        return device_view(self.cuda, name, a, self.spec.dtype, shape)

    def _result(self, out: Any, lib: str, stream: Any) -> Any:
        """NumPy callers get a host copy (after the stream finishes); others `out`."""
        if lib != NUMPY:
            return out
        host = out.copy_to_host(stream=stream)
        stream.synchronize()
        return from_device_bits(host, self.st)

    # Launches ------------------------------------------------------------------------------
    def _rows(self, plan: _Plan, key: Any, kind: int, narrow: bool = False, **args: Any) -> None:
        """A row kernel (kernels.rows) over the plan's (M, C) values, its partials in
        plan.col and phase two folded in; `args` by the kernel's names (arrays that change
        per call, and the scalars `batch_stats`, `count`, `accumulate`, fixed per key);
        `narrow`: one load a value (for inputs that are not 8-byte aligned)."""
        launch = plan.launches.get((key, narrow))
        if launch is None:
            # The row kernel is one skeleton for four jobs with one signature: what a job
            # does not read or write is the layer's one-element dummy array.
            s, d = self.spec, self._dummy
            counter = self.cuda.to_device(np.zeros(1 + self.config.phase_groups(plan.P), np.int32),
                                          stream=self._current)
            full = dict(z=d, d_y=d, out=d, mean=d, inv_std=d, gamma=d, beta=d, sums=d, batch_stats=False,
                        count=np.float32(1.0), epsilon=np.float32(s.bn_epsilon),
                        momentum=np.float32(s.bn_momentum), var_scale=np.float32(1.0), M=plan.M, C=plan.C,
                        S=plan.S, out0=plan.col[0], out1=plan.col[1], counter=counter, acc0=d, acc1=d,
                        accumulate=K.ACC_NONE)
            full.update({k: (np.float32(v) if k in ("count", "var_scale") else v) for k, v in args.items()})
            kernel = (self._narrow if narrow else self.k).rows[kind]
            plan.launches[(key, narrow)] = Launch(kernel, plan.P, K.ROW_THREADS, self._current, full,
                                                  fast=self.fast_paths)
            plan.launches[(key, narrow)]()
            return
        self._call(launch, {k: v for k, v in args.items() if k not in _FIXED_ROW_ARGS})

    def _call(self, launch: Launch, arrays: dict[str, Any]) -> None:
        """A prepared launch on the current stream (it moves there after a switch; a plan
        dropped from the cache and still used by a Saved follows too)."""
        if launch.stream is not self._current:
            launch.set_stream(self._current)
        launch(**arrays)

    def _launch(self, launches: dict, key: Any, kernel: Any, grid: Any, block: Any, fixed: Mapping[str, Any],
                **arrays: Any) -> None:
        """A prepared launch of `kernel` named `key` in `launches` (a plan's, or an
        optimizer's per layer): `fixed` are the arguments that do not change under the key
        (sizes, scalars, scratch), `arrays` by name those that may change per call (the
        first call prepares it, later ones swap them)."""
        launch = launches.get(key)
        if launch is None:
            launch = launches[key] = Launch(kernel, grid, block, self._current, {**fixed, **arrays},
                                            fast=self.fast_paths)
            launch()
            return
        self._call(launch, arrays)

    def _norm(self, p: dict) -> dict[str, Any]:
        d = self._dummy
        return {"gamma": p.get("gamma", d), "beta": p.get("beta", d)}

    # Forward -------------------------------------------------------------------------------
    def _statistics(self, plan: _Plan, p: dict, r: dict | None, z: Any, stats: tuple, training: bool,
                    keep: Any) -> bool:
        """Fill stats = (mean, inv_std) from z, updating the running statistics in a
        training batch norm; returns whether they came from the batch (reference:
        _statistics)."""
        s, norm, d = self.spec, self.spec.normalization, self._dummy
        mean, inv_std = stats
        if norm is Normalization.NONE:
            return False
        eps = np.float32(s.bn_epsilon)
        if norm is Normalization.BATCH_NORM and not training:
            self._launch(plan.launches, ("running", keep), self.k.running_stats, *K.small_grid(plan.C), {"epsilon": eps},
                         running_mean=r["running_mean"], running_var=r["running_var"], mean=mean, inv_std=inv_std)
            return False
        if norm is Normalization.BATCH_NORM:
            update = r is not None
            self._rows(plan, ("stats", keep, update), K.SUM_STATS, z=z, mean=mean, inv_std=inv_std, count=plan.M,
                       var_scale=s.running_var_scale(plan.M) if update else 1.0,
                       acc0=r["running_mean"] if update else d, acc1=r["running_var"] if update else d,
                       accumulate=K.ACC_ADD if update else K.ACC_NONE)
            return True
        n = plan.spec.batch_size
        self._launch(plan.launches, ("seg_stats", keep), self.k.segment_partials[K.SUM_STATS], (n, plan.Q), K.SEG_THREADS,
                     {"mean": d, "inv_std": d, "C": plan.C, "S": plan.S, "out0": plan.seg[0], "out1": plan.seg[1]},
                     z=z, d_y=z, **self._norm(p))
        self._launch(plan.launches, ("seg_stats_final", keep), self.k.stats_final, n, K.WARP,
                     {"p0": plan.seg[0], "p1": plan.seg[1], "P": plan.Q, "G": n, "S": plan.S,
                      "count": np.float32(plan.S), "epsilon": eps},
                     z=z, mean=mean, inv_std=inv_std)
        return True

    def _pre_activations(self, plan: _Plan, p: dict, x: Any, z: Any) -> None:
        """z = conv(x, W) + b (cuDNN), stored (reference: _pre_activations)."""
        plan.conv.forward(x, p["weights"], p.get("bias"), z)

    def _activation(self, plan: _Plan, p: dict, z: Any, y: Any, stats: tuple, keep: Any) -> None:
        """y = act(gamma * (z - mean) * inv_std + beta), or act(z) without a norm, stored
        (reference: _activation_input and activations.forward), one row kernel."""
        mean, inv_std = stats
        self._rows(plan, ("apply", keep), K.WRITE_Y, z=z, out=y, mean=mean, inv_std=inv_std, **self._norm(p))

    def _run(self, plan: _Plan, p: dict, r: dict | None, x: Any, y: Any, buffers: tuple, training: bool,
             keep: Any) -> bool:
        """The forward's steps, as the reference's forward: pre-activations, statistics,
        activation; returns whether the statistics came from the batch. `keep` names the
        launches: False for evaluate's scratch, ("keep", slot) for a forward's saved
        buffers (each set its own launches)."""
        z, mean, inv_std = buffers
        self._pre_activations(plan, p, x, z)
        if self.kernels == "simple":
            return simple.forward_steps(self.simple, self.spec, (plan.M, plan.C, plan.S, plan.groups), plan.scratch,
                                        p, r, z, y, mean, inv_std, training, self._current)
        from_batch = self._statistics(plan, p, r, z, (mean, inv_std), training, keep)
        self._activation(plan, p, z, y, (mean, inv_std), keep)
        return from_batch

    def _saved_arrays(self, plan: _Plan, pre: Any, mean: Any, inv_std: Any) -> tuple:
        """The caller's device arrays for saved values, checked and flat: pre (N, OH, OW,
        OC) in the storage dtype, mean and inv_std float32 per norm group (unused without
        a norm: anything)."""
        views = [device_view(self.cuda, "saved_out['pre']", pre, self.spec.dtype, (plan.total,), flat=True)]
        for name, a in (("mean", mean), ("inv_std", inv_std)):
            if self.spec.normalization is Normalization.NONE:
                views.append(self._dummy)
            else:
                views.append(device_view(self.cuda, f"saved_out[{name!r}]", a, DType.FLOAT32, (plan.groups,),
                                         flat=True))
        return tuple(views)

    def saved(self, x: Any, pre: Any, mean: Any, inv_std: Any, batch_stats: bool) -> Saved:
        """A Saved made of the caller's arrays (a forward's `saved_out`, kept by the caller:
        a torch custom op returns them), for `backward`."""
        with self._lock:
            call, x_dev, _ = self._input("x", x)
            plan = self._plan(call)
            return Saved(self, plan, x_dev, self._saved_arrays(plan, pre, mean, inv_std), bool(batch_stats), None,
                         recycle=False)

    def forward(self, params: Mapping[str, Any], x: Any, training: bool, running: Mapping[str, Any] | None = None,
                saved_out: Mapping[str, Any] | None = None, y_out: Any = None) -> tuple[Any, Saved]:
        """(y (N, OH, OW, OC), saved) for input x (N, H, W, C). Batch norm in training
        normalises with the batch's statistics and updates `running` in place (if given);
        otherwise it uses `running`. `saved_out`: device arrays "pre", "mean", "inv_std"
        (see `saved`) to hold the saved values, instead of the layer's own buffers.
        `y_out`: a device array (N, OH, OW, OC), C-contiguous, to write y into (and return)
        instead of a new one: with `saved_out`, a call that allocates nothing, which a
        caller can capture in a CUDA graph and replay (conv2d.torch.graphs)."""
        if not isinstance(training, bool):
            raise TypeError(f"training: expected a bool, got {training!r}")
        with self._lock:
            call, x_dev, lib = self._input("x", x)
            p = self._params(params)
            r = self._running(running, need=not training)
            plan = self._plan(call)
            if r is not None and training:
                self.spec.running_var_scale(plan.M)  # raises before any work where the rule cannot apply
            outside = None if saved_out is None else self._saved_arrays(plan, saved_out["pre"], saved_out.get("mean"),
                                                                        saved_out.get("inv_std"))
            given = self._given("y_out", y_out, lib, call.output_shape)
            stream = self._enter(lib, x)
            y_dev, y = (given, y_out) if y_out is not None else self._output(plan, "y", call.output_shape, lib, x)
            if outside is not None:
                from_batch = self._run(plan, p, r, x_dev, y_dev, outside, training, keep=("keep", "caller"))
                return self._result(y, lib, stream), Saved(self, plan, x_dev, outside, from_batch, None, recycle=False)
            if plan.frozen is not None:
                buffers = plan.frozen["saved"]
                plan.generation += 1
                generation = plan.generation
            else:
                buffers = plan.free_saved.pop() if plan.free_saved else plan.saved_buffers(self)
                generation = None
            from_batch = self._run(plan, p, r, x_dev, y_dev, buffers, training, keep=("keep", plan.slot(buffers)))
            return self._result(y, lib, stream), Saved(self, plan, x_dev, buffers, from_batch, generation)

    def evaluate(self, params: Mapping[str, Any], x: Any, running: Mapping[str, Any] | None = None) -> Any:
        """forward(training=False)'s y, keeping nothing."""
        with self._lock:
            call, x_dev, lib = self._input("x", x)
            p = self._params(params)
            r = self._running(running, need=True)
            plan = self._plan(call)
            stream = self._enter(lib, x)
            y_dev, y = self._output(plan, "y", call.output_shape, lib, x)
            if self.evaluate_kernel == "direct":
                self._direct_evaluate(plan, p, r, x_dev, y_dev)
            elif self.relu_fusion:
                plan.conv.forward(x_dev, p["weights"], p.get("bias"), y_dev, relu=True)
            else:
                if plan.eval_buffers is None:
                    plan.eval_buffers = plan.saved_buffers(self)
                self._run(plan, p, r, x_dev, y_dev, plan.eval_buffers, False, keep=False)
            return self._result(y, lib, stream)

    def _direct_evaluate(self, plan: _Plan, p: dict, r: dict | None, x: Any, y: Any) -> None:
        """y of evaluate in one launch (kernels.direct_evaluate)."""
        s, d = plan.spec, self._dummy
        n, h, w, c = s.input_shape
        _, oh, ow, oc = s.output_shape
        (kh, kw), (sh, sw), (ph, pw) = s.kernel, s.stride, s.padding
        fixed = {"has_bias": self.spec.bias, "epsilon": np.float32(s.bn_epsilon), "H": h, "W": w, "C": c, "OH": oh,
                 "OW": ow, "OC": oc, "KH": kh, "KW": kw, "SH": sh, "SW": sw, "PH": ph, "PW": pw}
        running = {"running_mean": r["running_mean"], "running_var": r["running_var"]} if r else {
            "running_mean": d, "running_var": d}
        self._launch(plan.launches, "direct_evaluate", self.k.direct_evaluate, *K.elementwise_grid(plan.total), fixed, x=x,
                     w=p["weights"], b=p.get("bias", d), y=y, **running, **self._norm(p))

    def pre_activations(self, saved: Saved) -> np.ndarray:
        """A read-only host copy of the saved pre-activations (N, OH, OW, OC)."""
        with self._lock:
            self._check_saved(saved)
            host = from_device_bits(saved.pre.copy_to_host(stream=self._current), self.st)
            self._current.synchronize()
        host = host.reshape(saved.spec.output_shape)
        host.flags.writeable = False
        return host

    # Backward ------------------------------------------------------------------------------
    def _check_saved(self, saved: Any) -> None:
        if not isinstance(saved, Saved) or saved.owner is not self:
            raise TypeError(f"saved: expected the Saved of a forward of these functions, got {type(saved).__name__}")
        if saved.generation is not None and saved.generation != saved._plan.generation:
            raise RuntimeError("saved: a later forward of this frozen layer overwrote this forward's saved values "
                               "(a frozen layer keeps one forward's, in fixed buffers); call forward again")

    def _grads_out(self, grads_out: Mapping[str, Any]) -> dict[str, Any]:
        """Checked flat views of the caller's arrays to write the gradients into (not
        cached by identity, unlike `_arrays`: new arrays come every call, and a cache would
        keep them alive)."""
        names = self._param_names
        if not isinstance(grads_out, Mapping) or set(grads_out) != set(names):
            got = sorted(grads_out) if isinstance(grads_out, Mapping) else grads_out
            raise ValueError(f"grads_out: expected keys {names}, got {got!r}")
        return self._flat_views("grads_out", grads_out, names)  # a gradient has its parameter's layout

    def _gradients(self, accumulate: Mapping[str, Any] | None, lib: str, like: Any) -> tuple[dict, Any]:
        """(flat device gradient arrays the kernels write or add into, what the caller
        gets). Fresh gradients are not zeroed: cuDNN's backward-filter writes the weights'
        whole and the row kernels write the others (ACC_WRITE), four memsets a step less."""
        names = self._param_names
        if accumulate is not None:
            return self._arrays("accumulate", accumulate, names), accumulate
        layout = self._grad_layout
        views, out = {}, {}
        for k in names:
            shape, dt = layout[k]
            if lib == TORCH:
                import torch

                t = torch.empty(shape, dtype=torch_dtype(self.spec.dtype) if dt == self.st else torch.float32,
                         device=like.device)
                views[k], out[k] = device_view(self.cuda, k, t, self.spec.dtype if dt == self.st else DType.FLOAT32,
                                               flat=True), t
            else:
                a = self.cuda.device_array(math.prod(shape), self.dev_dt if dt == self.st else dt,
                                           stream=self._current)
                views[k] = a
                out[k] = a.reshape(shape)
        return views, out

    def _grad_pre_activations(self, plan: _Plan, p: dict, saved: Saved, d_y_dev: Any, mean: Any, inv_std: Any,
                              g: dict, acc: int) -> None:
        """plan.d_z (stored) from d_y through the activation and the norm with the fast row
        kernels, and the bias, gamma and beta gradients written or added into g (`acc`:
        kernels.ACC_*) (reference: grad_pre_activations and bias_backward)."""
        d, norm, call = self._dummy, self.spec.normalization, saved.spec
        sums, count = d, 1.0
        narrow = self.lanes > 1 and device_pointer(d_y_dev) % 8 != 0
        batch_stats = saved.batch_stats
        if norm is not Normalization.NONE:
            # Per channel: sum d_a and sum d_a * x_hat, the beta and gamma gradients, and
            # for batch norm with batch statistics also what its backward needs.
            self._rows(plan, ("grads", acc, saved.slot), K.SUM_GRADS, narrow, z=saved.pre, d_y=d_y_dev,
                       out=plan.d_z, mean=mean, inv_std=inv_std, **self._norm(p), sums=plan.sums_col,
                       acc0=g.get("beta", d), acc1=g.get("gamma", d), accumulate=acc)
            if norm is Normalization.LAYER_NORM:
                n = call.batch_size
                self._launch(plan.launches, ("seg_grads", saved.slot), self.k.segment_partials[K.SUM_GRADS], (n, plan.Q),
                             K.SEG_THREADS, {"C": plan.C, "S": plan.S, "out0": plan.seg[0], "out1": plan.seg[1]},
                             z=saved.pre, d_y=d_y_dev, mean=mean, inv_std=inv_std, **self._norm(p))
                self._launch(plan.launches, "seg_grads_final", self.k.partials_final, n, K.WARP,
                             {"p0": plan.seg[0], "p1": plan.seg[1], "P": plan.Q, "G": n, "sums": plan.sums_seg})
                sums, count = plan.sums_seg, plan.S
            elif batch_stats:
                sums, count = plan.sums_col, plan.M
        # d_z through the activation and the norm, and in the same pass its per-channel
        # sums: the bias gradient.
        bias_acc = acc if self.spec.bias else K.ACC_NONE
        self._rows(plan, ("dz", batch_stats, bias_acc, saved.slot), K.WRITE_DZ, narrow, z=saved.pre,
                   d_y=d_y_dev, out=plan.d_z, mean=mean, inv_std=inv_std, **self._norm(p), sums=sums,
                   batch_stats=batch_stats, count=count, acc0=g.get("bias", d), accumulate=bias_acc)

    def backward(self, params: Mapping[str, Any], saved: Saved, d_y: Any, want_params: bool = True,
                 want_input: bool = True, accumulate: Mapping[str, Any] | None = None,
                 grads_out: Mapping[str, Any] | None = None, d_x_out: Any = None) -> tuple[Any, Any]:
        """(grads, d_x) of the forward that gave `saved`, for d_y (N, OH, OW, OC) of its shape.

        grads: {"weights", "bias", "gamma", "beta"} as the spec has them, new arrays in the
        library of d_y (device arrays; NumPy copies for a NumPy d_y), or, with `accumulate`
        (device arrays of the same keys), added into those in place and returned; None
        unless `want_params`. d_x (N, H, W, C), new, or None unless `want_input`.
        `grads_out` (device arrays of the same keys, gradient layout or flat) and `d_x_out`
        (a device array (N, H, W, C), C-contiguous): written (not added) and returned
        instead of new arrays, so that a call allocates nothing (see `forward`'s `y_out`)."""
        with self._lock:
            self._check_saved(saved)
            plan, call, norm = saved._plan, saved.spec, self.spec.normalization
            lib = library(d_y)
            if self._frozen and lib == NUMPY:
                raise RuntimeError("d_y: the layer is frozen; pass a device array (a NumPy array would be "
                                   "copied into newly allocated device memory)")
            if grads_out is not None and (accumulate is not None or not want_params):
                raise ValueError("grads_out: given with accumulate or without want_params; the gradients are "
                                 "either written into grads_out, or added into accumulate")
            if d_x_out is not None and not want_input:
                raise ValueError("d_x_out: given with want_input=False")
            d_y_dev = device_input(self.cuda, "d_y", d_y, call.output_shape, self.spec.dtype, self.stream,
                                   self._allocator.array)
            p = self._params(params)
            given_g = None if grads_out is None else self._grads_out(grads_out)
            if given_g is not None and lib == NUMPY:
                raise TypeError("grads_out: given beside a NumPy d_y (a NumPy call's results are host copies)")
            given_d_x = self._given("d_x_out", d_x_out, lib, call.input_shape)
            stream = self._enter(lib, d_y)
            if given_g is not None:
                g, grads = given_g, grads_out
            else:
                g, grads = self._gradients(accumulate, lib, d_y) if want_params else ({}, None)
            d = self._dummy
            mean, inv_std = (saved.mean, saved.inv_std) if norm is not Normalization.NONE else (d, d)
            # Parameter gradients: added into the caller's `accumulate`, or written fresh.
            acc = (K.ACC_ADD if accumulate is not None else K.ACC_WRITE) if want_params else K.ACC_NONE
            if self.kernels == "simple":
                simple.backward_steps(self.simple, self.simple32, self.spec, (plan.M, plan.C, plan.S, plan.groups),
                                      plan.scratch, p, saved.pre, mean, inv_std, saved.batch_stats, d_y_dev,
                                      plan.d_z, {k: v for k, v in g.items() if k != "weights"}, accumulate is None,
                                      self._current)
            else:
                self._grad_pre_activations(plan, p, saved, d_y_dev, mean, inv_std, g, acc)
            d_x = None
            if want_input:
                d_x_dev, d_x = ((given_d_x, d_x_out) if d_x_out is not None
                                else self._output(plan, "d_x", call.input_shape, lib, d_y))
                plan.conv.backward_data(plan.d_z, p["weights"], d_x_dev)
            if want_params:
                if accumulate is None:
                    plan.conv.backward_filter(saved.x, plan.d_z, g["weights"])
                else:
                    plan.conv.backward_filter(saved.x, plan.d_z, plan.d_w)
                    total = plan.d_w.size
                    self._launch(plan.launches, "accumulate_w", self.k.accumulate_stored, *K.elementwise_grid(total),
                                 {"new": plan.d_w, "total": total}, grad=g["weights"])
            if lib == NUMPY:
                if grads is not None and accumulate is None:
                    grads = self._host(grads)
                d_x = None if d_x is None else self._result(d_x, lib, stream)
            return grads, d_x

    def _host(self, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
        layout = self._grad_layout
        out = {k: from_device_bits(a.copy_to_host(stream=self._current), layout[k][1]).reshape(layout[k][0])
               for k, a in arrays.items()}
        self._current.synchronize()
        return out

    # Memory: the layer's arrays are flat numba device arrays ----------------------------------
    def from_host(self, values: Mapping[str, np.ndarray]) -> dict[str, Any]:
        with self._lock:
            arrays = {k: self.cuda.device_array(v.size, self.dev_dt if v.dtype == self.st else v.dtype)
                      for k, v in values.items()}
            self.write(arrays, values)
            return arrays

    def write(self, arrays: Mapping[str, Any], values: Mapping[str, np.ndarray]) -> None:
        with self._lock:
            for k, v in values.items():
                arrays[k].copy_to_device(np.ascontiguousarray(to_device_bits(v)).reshape(-1), stream=self._current)
            self._current.synchronize()

    def read(self, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
        layout = self._layout
        with self._lock:
            out = {k: from_device_bits(a.copy_to_host(stream=self._current), layout[k][1]).reshape(layout[k][0])
                   for k, a in arrays.items()}
            self._current.synchronize()
        return out

    def zero(self, arrays: Mapping[str, Any]) -> None:
        with self._lock:
            for a in arrays.values():
                zero_fill(self.cuda, a, self._current)

    # Freezing and capture ------------------------------------------------------------------
    def freeze(self) -> None:
        """Forbid allocation from now on: every planned shape gets fixed buffers for its
        outputs (y, d_x) and saved values, overwritten by the next call of the same
        operation; new input shapes are refused. Freezing a frozen layer changes nothing."""
        with self._lock:
            if self._frozen:
                return
            alloc = self.cuda.device_array
            for plan in self._plans.values():
                s = plan.spec
                plan.frozen = {"y": alloc(s.output_shape, self.dev_dt), "d_x": alloc(s.input_shape, self.dev_dt),
                               "saved": plan.saved_buffers(self)}
                if plan.eval_buffers is None:
                    plan.eval_buffers = plan.saved_buffers(self)
            self._frozen = True

    def capture(self, run: Callable[[], dict], inputs: dict, snapshot: Callable,
                followers: tuple = ()) -> Any:
        """A CUDA graph of `run` (a layer's forward(training=True) + backward_full, or its
        evaluate, on the device arrays `inputs`; or a whole training step), captured on
        the layer's stream with the layer frozen; see conv2d/cuda/capture.py.
        `followers`: (functions, call spec) of further layers that `run` calls on the same
        stream (the rest of a Sequential), frozen and held on that stream as well."""
        from conv2d.cuda.capture import CapturedGraph

        for name, a in inputs.items():
            if isinstance(a, np.ndarray):
                raise TypeError(f"{name}: a captured graph reads fixed device buffers; pass a device array "
                                f"(e.g. numba.cuda.to_device(x)), got a numpy.ndarray")
        call = self._input("x", inputs["x"])[0]
        if "d_y" in inputs:
            out = followers[-1][1] if followers else call
            device_view(self.cuda, "d_y", inputs["d_y"], self.spec.dtype, out.output_shape)
        held = [(self, call), *followers]
        for fn, _ in held[1:]:
            if not same_stream(fn.stream, self.stream):
                raise ValueError("a captured graph runs on one stream: every layer needs the same stream=")
        with contextlib.ExitStack() as stack:
            for fn, c in held:
                stack.enter_context(fn._held_for_capture(c))
            last = followers[-1][0].spec.dtype if followers else self.spec.dtype
            dtypes = {"x": self.spec.dtype, "d_x": self.spec.dtype, "y": last, "d_y": last}
            return CapturedGraph(stream_handle(self.stream), self.stream.synchronize, run, snapshot, inputs,
                                 stream=self.stream, dtypes={k: storage_dtype(d) for k, d in dtypes.items()})

    @contextlib.contextmanager
    def _held_for_capture(self, call: LayerSpec) -> Iterator[None]:
        """Plan `call`'s shape, freeze, and run every call on the layer's own stream until exit."""
        with self._lock:
            self._plan(call)
            self.freeze()
            self._enter(NUMPY, None)  # the layer's own stream
            self._capture_stream = self.stream
            try:
                yield
            finally:
                self._capture_stream = None

    capture_evaluate = capture  # the same capture; the layer's run says what it does
