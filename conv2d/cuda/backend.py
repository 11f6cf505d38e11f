"""The CUDA backend: the layer's operations in the design's order, on one GPU stream.

cuDNN (conv2d/cuda/cudnn.py) runs the three convolutions; the numba kernels
(conv2d/cuda/kernels.py) the norm, activation and bias gradient. Every launch and copy
goes on the layer's stream (its own, or the caller's), which the cuDNN handle shares.
The method list mirrors conv2d/reference/backend.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conv2d.cuda import cudnn, kernels as K
from conv2d.cuda.launch import Launch, device_pointer
from conv2d.cuda.memory import OutputAllocator
from conv2d.cuda.runtime import (as_stream, device_dtype, device_input, from_device_bits, numba_cuda,
                                 require_gpu, stream_handle, to_device_bits)
from conv2d.dtypes import storage_dtype
from conv2d.spec import DType, LayerSpec, Normalization
from conv2d.state import grad_layout, initial_state, state_layout


class CudaBackend:
    name = "cuda"

    def __init__(self, spec: LayerSpec, stream: Any = None, allow_tf32: bool = False, autotune: bool = False,
                 convolutions: Any = None) -> None:
        """`stream`: the caller's stream (numba, torch or cupy stream, or a CUstream int);
        a new one by default. `allow_tf32`: let float32 convolutions use TF32 tensor cores.
        `autotune`: time every deterministic cuDNN plan of each convolution once per
        process and use the fastest (else cuDNN's heuristic choice). `convolutions`: a
        stand-in for cuDNN with `cudnn.Convolutions`' methods (tests use one in numba's
        simulator, where cuDNN cannot run)."""
        if spec.dtype is DType.FLOAT64:
            raise ValueError("dtype: float64 is the reference backend's oracle type; the CUDA backend takes "
                             "float32, float16 or bfloat16")
        for name, value in (("allow_tf32", allow_tf32), ("autotune", autotune)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {value!r}")
        cuda = numba_cuda() if convolutions is not None else require_gpu()
        self.cuda = cuda
        self.spec = spec
        self.stream = as_stream(cuda, stream)
        norm = spec.normalization
        self.relu_fusion = norm is Normalization.NONE and spec.activation.value == "relu"
        if convolutions is None:
            convolutions = cudnn.Convolutions(cuda, spec, stream_handle(self.stream), cuda.get_current_device().id,
                                              allow_tf32, self.relu_fusion, autotune)
        self.conv = convolutions
        # Row-kernel threads keep `lanes` channels read with one 8-byte load; d_y that is
        # not 8-byte aligned (a caller's offset view) is read one value at a time by the
        # same sums in the same order (`_narrow`), so results do not depend on it.
        self.lanes = K.lanes_for(spec.dtype.value, spec.out_channels) if K.WIDE_ROWS else 1
        kinds = (spec.dtype.value, spec.activation, spec.normalization, self.lanes)
        self.k = K.kernel_set(*kinds, self.lanes > 1)
        self._narrow = K.kernel_set(*kinds, False) if self.lanes > 1 else self.k
        self.dev_dt = device_dtype(spec.dtype)
        self.st = storage_dtype(spec.dtype)

        n, oh, ow, oc = spec.output_shape
        self.M, self.C, self.S = n * oh * ow, oc, oh * ow * oc
        self.total = self.M * self.C
        self.groups = {Normalization.BATCH_NORM: oc, Normalization.LAYER_NORM: n}.get(norm, 1)
        self.P = K.row_partition(self.M, self.C)
        self.Q = K.segment_partition(self.S)
        f32 = np.float32
        alloc = cuda.device_array
        self.params = {k: alloc(int(np.prod(shape)), self._dt(dt)) for k, (shape, dt) in state_layout(spec).items()}
        self.grads = {k: alloc(int(np.prod(shape)), self._dt(dt)) for k, (shape, dt) in grad_layout(spec).items()}
        self.set_state(initial_state(spec))
        self.zero_gradient()
        # Forward caches (kept by forward) and the same for evaluate, which keeps nothing.
        self._pre = alloc(self.total, self.dev_dt)
        self._stats = (alloc(self.groups, f32), alloc(self.groups, f32))
        self._eval_pre = None
        self._eval_stats = (alloc(self.groups, f32), alloc(self.groups, f32))
        self._have_cache = False
        self._batch_stats = False
        self._dummy = alloc(1, f32)  # stands for absent norm arrays in kernel arguments
        # Reduction scratch: partials for channels (P, C) and samples (Q, N); totals.
        # The row kernels' partials: one row a block, then one a group of blocks.
        rows = self.P + K.phase_groups(self.P)
        self._col = (alloc(rows * oc, f32), alloc(rows * oc, f32))
        self._seg = (alloc(self.Q * n, f32), alloc(self.Q * n, f32))
        self._sums_col = alloc(2 * oc, f32)
        self._sums_seg = alloc(2 * n, f32)
        self._d_z = alloc(self.total, self.dev_dt)
        self._d_w = alloc(int(np.prod(spec.weight_shape)), self.dev_dt)
        self._allocator = OutputAllocator(cuda, self.stream)
        self._launches: dict = {}
        self._frozen = False
        self._outputs = None

    def _dt(self, dt: np.dtype) -> np.dtype:
        return self.dev_dt if dt == self.st else dt

    @property
    def conv_plans(self) -> dict[str, str]:
        """The cuDNN plan (engine name) of each of the layer's convolution graphs."""
        return dict(getattr(self.conv, "plans", {}))

    # Memory --------------------------------------------------------------------------------
    def freeze(self) -> None:
        """Forbid allocation from now on (the cuDNN workspace is sized at construction):
        outputs are written into layer-owned buffers (y, d_x) that the next call of the
        same operation reuses. Freezing a frozen layer changes nothing."""
        if self._frozen:
            return
        alloc = self.cuda.device_array
        self._outputs = {"y": alloc(self.spec.output_shape, self.dev_dt),
                         "d_x": alloc(self.spec.input_shape, self.dev_dt)}
        if self._eval_pre is None:
            self._eval_pre = alloc(self.total, self.dev_dt)
        self._frozen = True

    def _output(self, name: str, shape: tuple[int, ...]):
        if self._outputs is not None:
            return self._outputs[name]
        return self._allocator.array(shape, self.dev_dt)

    def _input(self, name: str, a: Any, shape: tuple[int, ...]):
        if self._frozen and isinstance(a, np.ndarray):
            raise RuntimeError(f"{name}: the layer is frozen; pass a device array (a NumPy array would be "
                               f"copied into newly allocated device memory)")
        return device_input(self.cuda, name, a, shape, self.spec.dtype, self.stream)

    # Capture -------------------------------------------------------------------------------
    @property
    def stream_ptr(self) -> int:
        return stream_handle(self.stream)

    def _device_only(self, name: str, a: Any, shape: tuple[int, ...]):
        if isinstance(a, np.ndarray):
            raise TypeError(f"{name}: a captured graph reads fixed device buffers; pass a device array "
                            f"(e.g. numba.cuda.to_device(x)), got a numpy.ndarray")
        return device_input(self.cuda, name, a, shape, self.spec.dtype, self.stream)

    def capture_step(self, x: Any, d_y: Any):
        """A CUDA graph of forward(training=True) + backward_full on the device arrays x, d_y."""
        from conv2d.cuda.capture import CapturedGraph

        s = self.spec
        x = self._device_only("x", x, s.input_shape)
        d_y = self._device_only("d_y", d_y, s.output_shape)
        if not self._frozen:
            self.freeze()

        def run():
            self.forward(x, training=True)
            self.backward(x, d_y, param_grads=True, input_grad=True)
        return CapturedGraph(self, run, {"x": x, "d_y": d_y},
                             {"y": self._outputs["y"], "d_x": self._outputs["d_x"]})

    def capture_evaluate(self, x: Any):
        """A CUDA graph of evaluate on the device array x."""
        from conv2d.cuda.capture import CapturedGraph

        x = self._device_only("x", x, self.spec.input_shape)
        if not self._frozen:
            self.freeze()
        return CapturedGraph(self, lambda: self.evaluate(x), {"x": x}, {"y": self._outputs["y"]})

    # Launches ------------------------------------------------------------------------------
    def _launch(self, key: Any, make: Any) -> Launch:
        """The prepared launch named `key`; `make()` gives (kernel, grid, block, args) the
        first time (the arguments as the kernel is prepared with; see `Launch.set`)."""
        found = self._launches.get(key)
        if found is None:
            kernel, grid, block, args = make()
            found = self._launches[key] = Launch(kernel, grid, block, self.stream, args)
        return found

    def _aligned(self, a: Any) -> bool:
        """Whether a row kernel may read `a` with 8-byte loads."""
        return self.lanes == 1 or device_pointer(a) % 8 == 0

    def _rows(self, key: Any, kind: int, z, d_y=None, out=None, stats=None, sums=None, batch_stats: bool = False,
              count: float = 1.0, acc=(None, None), accumulate: bool = False, narrow: bool = False) -> Launch:
        """A row kernel (kernels.rows) over the (M, C) values, its partials in self._col
        and phase two folded in (`acc`: the arrays it accumulates into); `narrow`: one
        load a value (for inputs that are not 8-byte aligned)."""
        def make():
            d = self._dummy
            gamma, beta = self._gamma_beta()
            s = self.spec
            counter = self.cuda.to_device(np.zeros(1 + K.phase_groups(self.P), np.int32), stream=self.stream)
            args = (z, d if d_y is None else d_y, d if out is None else out, *(stats or (d, d)), gamma, beta,
                    d if sums is None else sums, batch_stats, np.float32(count), np.float32(s.bn_epsilon),
                    np.float32(s.bn_momentum), self.M, self.C, self.S, *self._col, counter,
                    *(d if a is None else a for a in acc), accumulate)
            return (self._narrow if narrow else self.k).rows[kind], self.P, K.ROW_THREADS, args
        return self._launch((key, narrow), make)

    def _gamma_beta(self):
        if self.spec.normalization is Normalization.NONE:
            return self._dummy, self._dummy
        return self.params["gamma"], self.params["beta"]

    # Forward -------------------------------------------------------------------------------
    def _statistics(self, z, stats, training: bool, keep: bool) -> bool:
        """Fill stats = (mean, inv_std) from z; returns whether they came from the batch."""
        s, norm, d, p = self.spec, self.spec.normalization, self._dummy, self.params
        if norm is Normalization.NONE:
            return False
        eps, mom = np.float32(s.bn_epsilon), np.float32(s.bn_momentum)
        if norm is Normalization.BATCH_NORM and not training:
            self._launch(("running", keep), lambda: (self.k.running_stats, *K.small_grid(self.C),
                                                     (p["running_mean"], p["running_var"], eps, *stats)))()
            return False
        if norm is Normalization.BATCH_NORM:
            self._rows(("stats", keep), K.SUM_STATS, z, stats=stats, count=self.M,
                       acc=(p["running_mean"], p["running_var"]), accumulate=True)()
        else:
            n = s.batch_size
            gamma, beta = self._gamma_beta()
            self._launch(("seg_stats", keep), lambda: (self.k.segment_partials[K.SUM_STATS], (n, self.Q),
                                                       K.SEG_THREADS, (z, z, d, d, gamma, beta, self.C, self.S,
                                                                       *self._seg)))()
            self._launch(("seg_stats_final", keep), lambda: (self.k.stats_final, n, K.WARP, (
                *self._seg, self.Q, n, z, self.S, np.float32(self.S), eps, mom, *stats, d, d, False)))()
        return True

    def _run(self, x: Any, training: bool, keep: bool):
        s = self.spec
        x = self._input("x", x, s.input_shape)
        y = self._output("y", s.output_shape)
        p = self.params
        if not keep and self.relu_fusion:
            self.conv.forward(x, p["weights"], p["bias"], y, relu=True)
            return y
        if keep:
            z, stats = self._pre, self._stats
        else:
            if self._eval_pre is None:
                self._eval_pre = self.cuda.device_array(self.total, self.dev_dt)
            z, stats = self._eval_pre, self._eval_stats
        self.conv.forward(x, p["weights"], p["bias"], z)
        from_batch = self._statistics(z, stats, training, keep)
        # Arguments that change per call are prepared with a layer buffer of the same
        # size and dtype standing in, then set.
        apply = self._rows(("apply", keep), K.WRITE_Y, z, out=self._d_z,
                           stats=stats if s.normalization is not Normalization.NONE else None)
        apply.set(2, y)
        apply()
        if keep:
            self._have_cache, self._batch_stats = True, from_batch
        return y

    def evaluate(self, x: Any):
        return self._run(x, training=False, keep=False)

    def forward(self, x: Any, training: bool):
        return self._run(x, training=training, keep=True)

    # Backward ------------------------------------------------------------------------------
    def backward(self, x: Any, d_y: Any, param_grads: bool, input_grad: bool):
        s, norm, g = self.spec, self.spec.normalization, self.grads
        if param_grads:
            x = self._input("x", x, s.input_shape)
        d_y = self._input("d_y", d_y, s.output_shape)
        if not self._have_cache:
            raise RuntimeError("backward: no forward pass to differentiate; call forward(x) first")
        stats = self._stats if norm is not Normalization.NONE else None
        sums, count = None, 1.0
        narrow = not self._aligned(d_y)
        if norm is not Normalization.NONE:
            # Per channel: sum d_a and sum d_a * x_hat, the beta and gamma gradients, and
            # for batch norm with batch statistics also what its backward needs.
            grads = self._rows(("grads", param_grads), K.SUM_GRADS, self._pre, self._d_z, stats=stats,
                               sums=self._sums_col, acc=(g["beta"], g["gamma"]), accumulate=param_grads, narrow=narrow)
            grads.set(1, d_y)
            grads()
            if norm is Normalization.LAYER_NORM:
                n = s.batch_size
                gamma, beta = self._gamma_beta()
                seg = self._launch("seg_grads", lambda: (self.k.segment_partials[K.SUM_GRADS], (n, self.Q),
                                                         K.SEG_THREADS, (self._pre, self._d_z, *stats, gamma, beta,
                                                                         self.C, self.S, *self._seg)))
                seg.set(1, d_y)
                seg()
                self._launch("seg_grads_final", lambda: (self.k.partials_final, n, K.WARP,
                                                         (*self._seg, self.Q, n, self._sums_seg)))()
                sums, count = self._sums_seg, self.S
            elif self._batch_stats:
                sums, count = self._sums_col, self.M
        # d_z through the activation and the norm, and in the same pass its per-channel
        # sums: the bias gradient.
        dz = self._rows(("dz", self._batch_stats, param_grads), K.WRITE_DZ, self._pre, self._pre, self._d_z, stats,
                        sums, self._batch_stats, count, acc=(g["bias"], None), accumulate=param_grads, narrow=narrow)
        dz.set(1, d_y)
        dz()
        d_x = None
        if input_grad:
            d_x = self._output("d_x", s.input_shape)
            self.conv.backward_data(self._d_z, self.params["weights"], d_x)
        if param_grads:
            self.conv.backward_filter(x, self._d_z, self._d_w)
            n = self._d_w.size
            self._launch("accumulate_w", lambda: (self.k.accumulate_stored, *K.elementwise_grid(n),
                                                  (g["weights"], self._d_w, n)))()
        return d_x

    # State ---------------------------------------------------------------------------------
    def _to_host(self, arrays: dict, layout: dict) -> dict[str, np.ndarray]:
        out = {}
        for k, a in arrays.items():
            shape, dt = layout[k]
            out[k] = from_device_bits(a.copy_to_host(stream=self.stream), dt).reshape(shape)
        self.stream.synchronize()
        return out

    def _from_host(self, arrays: dict, values: dict) -> None:
        for k, v in values.items():
            arrays[k].copy_to_device(np.ascontiguousarray(to_device_bits(v)).reshape(-1), stream=self.stream)
        self.stream.synchronize()

    def zero_gradient(self) -> None:
        self._from_host(self.grads, {k: np.zeros(shape, dt) for k, (shape, dt) in grad_layout(self.spec).items()})

    def get_state(self) -> dict[str, np.ndarray]:
        return self._to_host(self.params, state_layout(self.spec))

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        self._from_host(self.params, state)

    def get_grads(self) -> dict[str, np.ndarray]:
        return self._to_host(self.grads, grad_layout(self.spec))

    def set_grads(self, grads: dict[str, np.ndarray]) -> None:
        self._from_host(self.grads, grads)

    @property
    def pre_activations(self):
        return self._pre.reshape(self.spec.output_shape) if self._have_cache else None
