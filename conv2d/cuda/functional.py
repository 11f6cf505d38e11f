"""The layer's functions on the GPU: `Functions(spec, ...)` with `forward`, `evaluate`
and `backward` over explicit parameters, running statistics and a `Saved` object, the
same names as `conv2d/reference/functional.py`, and the memory operations a layer needs.

Read beside the reference: `forward` runs steps.forward_steps (pre-activations,
statistics, normalise and activate), `backward` steps.grad_pre_activations, then
steps.input_gradient and steps.weight_gradient. cuDNN (cudnn.py) runs the three
convolutions; the numba kernels (kernels/) the norm, activation and bias gradient. Batch
statistics are one pass of sums shifted by the channel's first value (sum(z - s),
sum((z - s)^2)), where the reference takes two passes; both are within the dtype's
tolerance of the oracle. What the functions keep per input shape is in plans.py,
argument checks in arguments.py, streams in streams.py, outputs in memory.py, prepared
launches in launch.py, CUDA graphs in capture.py.

Arrays:
- inputs `x` (N, H, W, C) and `d_y` (N, OH, OW, OC): NumPy arrays (copied to the device,
  results copied back: NumPy out) or device arrays (torch CUDA tensors, CuPy, numba, any
  `__cuda_array_interface__`), read in place; outputs in the input's library (torch
  tensors from torch's allocator, bfloat16 as torch.bfloat16; CuPy and numba arrays hold
  bfloat16 as uint16 bits, neither having a bfloat16 type).
- `params` ("weights", "bias" if the spec has it, "gamma"/"beta" with a norm), `running`
  ("running_mean"/"running_var") and gradient arrays: device arrays of the state layout's
  shapes (or flat), storage dtype for weights and bias, float32 for the norm's, read
  and written in place.
Every call runs on one stream (streams.py): the layer's own (or the one it was given),
or torch's current stream for torch tensors when the layer was given none.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from conv2d.arrays import NUMPY, library
from conv2d.cuda import cudnn, cudnn_execution, kernels as K, steps
from conv2d.cuda.arguments import Arguments, check_options
from conv2d.cuda.kernels import simple
from conv2d.cuda.kernels.padding import padding_kernels
from conv2d.cuda.launch import Launch, Launcher, device_pointer
from conv2d.cuda.memory import OutputAllocator, Outputs
from conv2d.cuda.optim import OptimizerSteps
from conv2d.cuda.plans import Saved, ShapePlan, ShapePlans
from conv2d.cuda.depthwise import DepthwiseConvolutions, is_depthwise
from conv2d.cuda.runtime import (as_stream, device_dtype, from_device_bits, numba_cuda, require_gpu, same_stream,
                                 simulating, stream_handle, to_device_bits, zero_fill)
from conv2d.cuda.streams import Streams
from conv2d.dtypes import storage_dtype
from conv2d.spec import Activation, DType, LayerSpec, Normalization
from conv2d.state import state_layout

__all__ = ["Functions", "Saved"]


class Functions(OptimizerSteps):
    """The CUDA backend's functions for one spec; see the module docstring. The
    optimizers' steps come from `optim.OptimizerSteps`."""

    name = "cuda"

    def __init__(self, spec: LayerSpec, stream: Any = None, allow_tf32: bool = False, autotune: bool = False,
                 convolutions: Callable[[LayerSpec], Any] | None = None, max_shapes: int = 8,
                 fast_paths: bool = True, kernels: str = "fast",
                 launch_config: K.LaunchConfig = K.DEFAULT_CONFIG, evaluate_kernel: str = "cudnn",
                 depthwise_kernel: str = "auto") -> None:
        """`stream`: the caller's stream (numba, torch or cupy stream, or a CUstream int);
        by default a new one, and torch's current stream for torch tensors. `allow_tf32`:
        let float32 convolutions use TF32 tensor cores. `autotune`: time every
        deterministic cuDNN plan of each convolution once per process and use the fastest
        (else cuDNN's heuristic choice). `convolutions`: a stand-in for cuDNN, called with
        the spec of an input shape, with `cudnn_execution.Convolutions`' methods (tests use one in
        numba's simulator, where cuDNN cannot run). `max_shapes`: input shapes kept planned.
        `fast_paths`: prepared kernel launches straight to the driver and cuDNN executes
        through the frontend's native pointer array (private APIs, `launch.py`,
        `cudnn_execution.Execution`); False takes numba's dispatcher and the frontend's public
        execute, with bitwise the same results (tests/test_cuda_capture.py), for a new numba or
        frontend whose private API moved. `kernels`: "fast" (kernels/fast.py, fused) or
        "simple" (kernels/simple.py: one plain kernel per reference step, through numba's
        dispatcher; for reading, and for checking a new fast kernel against).
        `launch_config`: the fast kernels' launch settings (kernels.LaunchConfig).
        `evaluate_kernel`: "cudnn" (the convolution through cuDNN, then the norm and
        activation kernels) or "direct" (one kernel that sums the convolution itself and
        applies the norm and activation: for acting at small N, where launches and cuDNN's
        execute cost more than the math; no norm or batch norm). The two agree within the
        tolerance, not bitwise (another summation order); each is deterministic.
        `depthwise_kernel`: "numba" (a depthwise layer's three convolutions by
        depthwise.py's kernels, no cuDNN; they also run in numba's simulator; with
        kernels="simple" the simple kernels), "cudnn", or "auto" (the default: "numba"
        for a depthwise layer, whose cuDNN graphs are the slower (docs/bench_cuda.md's
        depthwise table), "cudnn" for any other); `depthwise_kernel` holds the choice."""
        check_options(spec, allow_tf32, autotune, fast_paths, kernels, launch_config, evaluate_kernel, max_shapes,
                       depthwise_kernel)
        if depthwise_kernel == "auto":
            depthwise_kernel = "numba" if is_depthwise(spec) else "cudnn"
        self.depthwise_kernel = depthwise_kernel
        own_convolutions = convolutions is None and depthwise_kernel == "numba"
        cuda = numba_cuda() if convolutions is not None or (own_convolutions and simulating()) else require_gpu()
        self.cuda, self.spec = cuda, spec
        self.allow_tf32, self.autotune = allow_tf32, autotune
        own = as_stream(cuda, stream)
        self.relu_fusion = spec.normalization is Normalization.NONE and spec.activation is Activation.RELU
        # The training forward's z and ReLU(z) in one cuDNN graph: 16-bit types only (the
        # float32 engine fails at execute) and the fast kernels (the simple set is one
        # kernel a reference step, to read and check against).
        pre_relu = self.pre_relu_fusion = (self.relu_fusion and spec.dtype is not DType.FLOAT32
                                           and kernels == "fast")
        handle = None
        if convolutions is None and not own_convolutions:
            handle = cudnn.create_handle(stream_handle(own))
            # Closes over the stream, not self: no reference cycle, so a dropped layer's
            # device memory goes back when its last reference does, not when the garbage
            # collector runs (which may be inside a caller's CUDA graph capture, where
            # numba's frees would invalidate it).
            device, relu_fusion = cuda.get_current_device().id, self.relu_fusion
            convolutions = lambda s: cudnn_execution.Convolutions(  # noqa: E731
                cuda, s, handle, stream_handle(own), device, allow_tf32, relu_fusion, autotune, fast_paths, pre_relu)
        self._handle = handle
        self.streams = Streams(cuda, own, stream is not None, handle)
        if own_convolutions:
            launcher = Launcher(self.streams.current_stream, fast_paths)  # the streams' method: no cycle via self
            simple_kernels = kernels == "simple"
            convolutions = lambda s: DepthwiseConvolutions(cuda, s, launcher, simple_kernels)  # noqa: E731
        self.fast_paths, self.kernels, self.evaluate_kernel = fast_paths, kernels, evaluate_kernel
        # Row-kernel threads keep `lanes` channels read with one 8-byte load; d_y that is
        # not 8-byte aligned (a caller's offset view) is read one value at a time by the
        # same sums in the same order (`narrow`), so results do not depend on it.
        self.config = launch_config
        self.lanes = K.lanes_for(spec.dtype.value, spec.out_channels) if launch_config.wide_rows else 1
        kinds = (spec.dtype.value, spec.activation, spec.normalization, self.lanes)
        parameter = spec.activation_parameter
        fast = K.kernel_set(*kinds, self.lanes > 1, launch_config, parameter)
        dev_dt = self.dev_dt = device_dtype(spec.dtype)
        self.st = storage_dtype(spec.dtype)
        self._lock = threading.RLock()
        self._dummy = cuda.device_array(1, np.float32)  # stands for absent arrays in kernel arguments
        # The helpers get the streams' and plans' own methods, never closures over self:
        # a reference cycle would keep a dropped layer's device memory until the garbage
        # collector runs (which may be inside a caller's CUDA graph capture).
        current = self.streams.current_stream
        constants = discard = None
        if spec.normalization is not Normalization.NONE and not spec.bn_affine:
            oc = spec.out_channels
            constants = {"gamma": cuda.to_device(np.ones(oc, np.float32)),
                         "beta": cuda.to_device(np.zeros(oc, np.float32))}
            discard = {"gamma": cuda.device_array(oc, np.float32), "beta": cuda.device_array(oc, np.float32)}
        self._k = steps.Kernels(
            spec, cuda, fast, K.kernel_set(*kinds, False, launch_config, parameter) if self.lanes > 1 else fast,
            simple.simple_set(spec.dtype.value, spec.activation, parameter) if kernels == "simple" else None,
            simple.simple_set("float32", spec.activation, parameter) if kernels == "simple" else None,
            self._dummy, Launcher(current, fast_paths),
            padding_kernels(spec.dtype.value) if spec.pads_with_copies else None, constants, discard,
            cuda.device_array(1, np.int64))
        self._allocator = OutputAllocator(cuda, own)
        self._outputs = Outputs(spec, cuda, self._allocator, current)
        simple_kernels = kernels == "simple"
        plans = self._plans = ShapePlans(lambda call: ShapePlan(call, cuda, dev_dt, launch_config, convolutions,
                                                                simple_kernels), max_shapes)
        self._args = Arguments(spec, cuda, self.st, own, self._allocator.array, plans.is_frozen, self._dummy)
        if spec.batch_size is not None:
            self._plans.get(spec)

    @property
    def stream(self) -> Any:
        """The layer's own stream (the one it was given, or its new one)."""
        return self.streams.own

    @property
    def stream_given(self) -> bool:
        """Whether the layer was given its stream (else torch tensors run on torch's current one)."""
        return self.streams.given

    @property
    def current_stream(self) -> Any:
        """The stream of the last call (the layer's own, or torch's current one)."""
        return self.streams.current

    @property
    def conv_plans(self) -> dict[str, str]:
        """The cuDNN plan (engine name) of each convolution graph of the planned (else the
        last) input shape."""
        with self._lock:
            if not self._plans:
                return {}
            plan = self._plans.find(self.spec) if self.spec.batch_size else None
            plan = plan or next(reversed(list(self._plans.values())))
            return dict(getattr(plan.conv, "plans", {}))

    @property
    def launches(self) -> dict[tuple, Launch]:
        """Every prepared kernel launch, keyed by (input shape (N, H, W), LaunchKey)."""
        with self._lock:
            return {(shape, key): launch for shape, plan in self._plans.items()
                    for key, launch in plan.launches.items()}

    # The functions ------------------------------------------------------------------------
    def check_input(self, name: str, x: Any) -> LayerSpec:
        """The call's spec for input `x`, after the checks `forward` makes of it."""
        return self._args.input(name, x)[0]

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
            call, x_dev, lib = self._args.input("x", x)
            p = self._k.with_constants(self._args.params(params))
            r = self._args.running(running, need=not training)
            plan = self._plans.get(call)
            # Batch norm without running statistics normalises with the batch's in evaluation too.
            training = training or self.spec.batch_statistics(False)
            if r is not None and training:
                self.spec.running_var_scale(plan.M)  # raises before any work where the rule cannot apply
            outside = None if saved_out is None else self._args.saved_arrays(
                plan.total, plan.groups, saved_out["pre"], saved_out.get("mean"), saved_out.get("inv_std"))
            given = self._args.given("y_out", y_out, lib, call.output_shape)
            stream = self.streams.enter(lib, x)
            y_dev, y = (given, y_out) if y_out is not None else self._outputs.output(plan, "y", call.output_shape,
                                                                                       lib, x)
            if outside is not None:
                from_batch = steps.forward_steps(self._k, plan, p, r, x_dev, y_dev, outside, training, "caller")
                return self._outputs.result(y, lib, stream), Saved(self, plan, x_dev, outside, from_batch, None,
                                                                   recycle=False)
            buffers, generation = plan.forward_buffers()
            from_batch = steps.forward_steps(self._k, plan, p, r, x_dev, y_dev, buffers, training,
                                             plan.slot(buffers))
            return self._outputs.result(y, lib, stream), Saved(self, plan, x_dev, buffers, from_batch, generation)

    def evaluate(self, params: Mapping[str, Any], x: Any, running: Mapping[str, Any] | None = None,
                 y_out: Any = None) -> Any:
        """forward(training=False)'s y, keeping nothing: the plan's own scratch holds the
        pre-activations and statistics. `y_out`: a device array (N, OH, OW, OC),
        C-contiguous, to write y into (and return) instead of a new one, as forward's: a
        call that allocates nothing, for a caller that replays a captured graph of it
        (conv2d.torch.graphs; `resources` names what else it uses)."""
        with self._lock:
            call, x_dev, lib = self._args.input("x", x)
            p = self._k.with_constants(self._args.params(params))
            from_batch = self.spec.batch_statistics(False)  # layer norm, batch norm without running ones
            r = self._args.running(running, need=not from_batch)
            plan = self._plans.get(call)
            given = self._args.given("y_out", y_out, lib, call.output_shape)
            stream = self.streams.enter(lib, x)
            y_dev, y = (given, y_out) if y_out is not None else self._outputs.output(plan, "y", call.output_shape,
                                                                                       lib, x)
            if self.evaluate_kernel == "direct":
                steps.direct_evaluate(self._k, plan, p, r, x_dev, y_dev)
            elif self.relu_fusion and not getattr(plan.conv, "pre_relu", False):
                # (A layer whose forward runs forward_pre_relu evaluates through it too, below,
                # so that evaluate's y is bitwise its forward's: the two graphs' engines differ.)
                steps.pre_activations(self._k, plan, p, x_dev, y_dev, relu=True)
            else:
                steps.forward_steps(self._k, plan, p, r, x_dev, y_dev, plan.evaluate_buffers(), from_batch,
                                    "evaluate")
            return self._outputs.result(y, lib, stream)

    def resources(self, input_shape: tuple[int, int, int, int]) -> Any:
        """What a call on an input of `input_shape` (N, H, W, C) uses besides the caller's
        arrays, as `Saved.resources`: its shape's plan (scratch, cuDNN workspace, prepared
        launches), or None where none is planned. For a caller that keeps a captured graph
        of an `evaluate` call, which has no Saved."""
        with self._lock:
            return self._plans.find(self.spec.at(*input_shape[:3]))

    def saved(self, x: Any, pre: Any, mean: Any, inv_std: Any, batch_stats: bool) -> Saved:
        """A Saved made of the caller's arrays (a forward's `saved_out`, kept by the caller:
        a torch custom op returns them), for `backward`."""
        with self._lock:
            call, x_dev, _ = self._args.input("x", x)
            plan = self._plans.get(call)
            return Saved(self, plan, x_dev, self._args.saved_arrays(plan.total, plan.groups, pre, mean, inv_std),
                         bool(batch_stats), None, recycle=False)

    def pre_activations(self, saved: Saved) -> np.ndarray:
        """A read-only host copy of the saved pre-activations (N, OH, OW, OC)."""
        with self._lock:
            self._check_saved(saved)
            current = self.streams.current
            host = from_device_bits(saved.pre.copy_to_host(stream=current), self.st)
            current.synchronize()
        host = host.reshape(saved.spec.output_shape)
        host.flags.writeable = False
        return host

    def _check_saved(self, saved: Any) -> None:
        if not isinstance(saved, Saved) or saved.owner is not self:
            raise TypeError(f"saved: expected the Saved of a forward of these functions, got {type(saved).__name__}")
        if saved.overwritten:
            raise RuntimeError("saved: a later forward of this frozen layer overwrote this forward's saved values "
                               "(a frozen layer keeps one forward's, in fixed buffers); call forward again")

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
            plan, call = saved.plan, saved.spec
            lib = library(d_y)
            self._args.refuse_host("d_y", lib)
            if grads_out is not None and (accumulate is not None or not want_params):
                raise ValueError("grads_out: given with accumulate or without want_params; the gradients are "
                                 "either written into grads_out, or added into accumulate")
            if d_x_out is not None and not want_input:
                raise ValueError("d_x_out: given with want_input=False")
            d_y_dev = self._args.d_y(d_y, call)
            p = self._k.with_constants(self._args.params(params))
            given_g = None if grads_out is None else self._args.grads_out(grads_out)
            if given_g is not None and lib == NUMPY:
                raise TypeError("grads_out: given beside a NumPy d_y (a NumPy call's results are host copies)")
            given_d_x = self._args.given("d_x_out", d_x_out, lib, call.input_shape)
            stream = self.streams.enter(lib, d_y)
            if given_g is not None:
                g, grads = given_g, grads_out
            elif not want_params:
                g, grads = {}, None
            elif accumulate is not None:
                g, grads = self._args.accumulate(accumulate), accumulate
            else:
                g, grads = self._outputs.gradients(self._args.param_names, lib, d_y)
            # Parameter gradients: added into the caller's `accumulate`, or written fresh.
            acc = (K.ACC_ADD if accumulate is not None else K.ACC_WRITE) if want_params else K.ACC_NONE
            narrow = self.lanes > 1 and device_pointer(d_y_dev) % 8 != 0
            steps.grad_pre_activations(self._k, plan, p, saved, d_y_dev, narrow, self._k.with_discard(g), acc)
            d_x = None
            if want_input:
                d_x_dev, d_x = ((given_d_x, d_x_out) if d_x_out is not None
                                else self._outputs.output(plan, "d_x", call.input_shape, lib, d_y))
                steps.input_gradient(self._k, plan, p, d_x_dev)
            if want_params:
                steps.weight_gradient(self._k, plan, saved.x, g["weights"], accumulate is not None)
            if lib == NUMPY:
                if grads is not None and accumulate is None:
                    grads = self._outputs.host(grads)
                d_x = None if d_x is None else self._outputs.result(d_x, lib, stream)
            return grads, d_x

    # Memory: the layer's arrays are flat numba device arrays ----------------------------------
    def from_host(self, values: Mapping[str, np.ndarray]) -> dict[str, Any]:
        with self._lock:
            arrays = {k: self.cuda.device_array(v.size, self.dev_dt if v.dtype == self.st else v.dtype)
                      for k, v in values.items()}
            self.write(arrays, values)
            return arrays

    def write(self, arrays: Mapping[str, Any], values: Mapping[str, np.ndarray]) -> None:
        with self._lock:
            current = self.streams.current
            for k, v in values.items():
                arrays[k].copy_to_device(np.ascontiguousarray(to_device_bits(v)).reshape(-1), stream=current)
            current.synchronize()

    def read(self, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
        with self._lock:
            return self._outputs.host(arrays, state_layout(self.spec))

    def zero(self, arrays: Mapping[str, Any]) -> None:
        with self._lock:
            for a in arrays.values():
                zero_fill(self.cuda, a, self.streams.current)

    # Streams and the caller's arrays (the Preallocating extension, conv2d.torch) ------------------
    def follow(self, a: Any) -> None:
        """Make the stream that a call on the array `a` would run on (torch's current one
        for a torch tensor) this layer's current stream, ordered after the calls before it,
        as such a call does first; for a caller that replays a captured graph of these
        functions' calls on that stream (conv2d.torch.graphs)."""
        with self._lock:
            self.streams.enter(library(a), a)

    def release(self, resources: Any) -> None:
        """Let the prepared launches of a call's plan (its Saved's `resources`) go of the
        caller's torch tensors of their last call (Launch.release), which they keep
        otherwise until the next call: for a caller that replays graphs keyed by
        addresses (conv2d.torch.graphs), where kept tensors make torch hand out other
        blocks on the next step."""
        with self._lock:
            resources.release()

    def release_all(self) -> None:
        """`release` for every planned shape, and the checked views of the caller's
        parameter and running arrays dropped: afterwards the functions keep none of the
        caller's tensors. For callers whose tensors come from a memory pool that may hold
        only what they track (torch.compile's CUDA graph trees, mode="reduce-overhead",
        where functionalisation hands the running statistics as fresh clones)."""
        with self._lock:
            for plan in self._plans.values():
                plan.release()
            self._args.forget()

    def deferred_frees(self) -> contextlib.AbstractContextManager:
        """A context in which numba frees no device memory, events or streams (it queues
        them): for calls inside a CUDA graph capture, which a free would invalidate."""
        return self.cuda.defer_cleanup()

    # Freezing and capture ------------------------------------------------------------------
    def freeze(self) -> None:
        """Forbid allocation from now on: every planned shape gets fixed buffers for its
        outputs (y, d_x) and saved values, overwritten by the next call of the same
        operation; new input shapes are refused. Freezing a frozen layer changes nothing."""
        with self._lock:
            self._plans.freeze()

    def capture(self, run: Callable[[], dict], inputs: dict, snapshot: Callable,
                followers: tuple = ()) -> Any:
        """A CUDA graph of `run` (a layer's forward(training=True) + backward_full, or its
        evaluate, on the device arrays `inputs`; or a whole training step), captured on
        the layer's stream with the layer frozen; see conv2d/cuda/capture.py.
        `followers`: (functions, call spec) of further layers that `run` calls on the same
        stream (the rest of a Sequential), frozen and held on that stream as well."""
        from conv2d.cuda.capture import capture_layers

        for name, a in inputs.items():
            if isinstance(a, np.ndarray):
                raise TypeError(f"{name}: a captured graph reads fixed device buffers; pass a device array "
                                f"(e.g. numba.cuda.to_device(x)), got a numpy.ndarray")
        call = self._args.input("x", inputs["x"])[0]
        held = [(self, call), *followers]
        for fn, _ in held[1:]:
            if not same_stream(fn.stream, self.stream):
                raise ValueError("a captured graph runs on one stream: every layer needs the same stream=")
        return capture_layers(held, run, inputs, snapshot)

    capture_evaluate = capture  # the same capture; the layer's run says what it does

    @contextlib.contextmanager
    def held_for_capture(self, call: LayerSpec) -> Iterator[None]:
        """Plan `call`'s shape, freeze, and run every call on the layer's own stream until exit."""
        with self._lock:
            self._plans.get(call)
            self.freeze()
            self.streams.enter(NUMPY, None)  # the layer's own stream
            self.streams.capture = self.streams.own
            try:
                yield
            finally:
                self.streams.capture = None
