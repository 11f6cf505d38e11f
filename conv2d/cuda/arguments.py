"""The CUDA functions' arguments: the backend options (`check_options`), and the calls'
arguments checked and viewed as flat device arrays: the input x
(N, H, W, C) and d_y, the caller's parameter and running-statistics dicts (checked once
per set of array objects and cached by identity: a layer passes the same dicts every
step), arrays the caller gives for outputs, and the caller's saved values."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from conv2d.arrays import NUMPY, library
from conv2d.checks import describe, input_spec
from conv2d.cuda import kernels as K
from conv2d.cuda.depthwise import is_depthwise
from conv2d.cuda.runtime import device_input, device_view
from conv2d.spec import DType, LayerSpec, Normalization
from conv2d.state import RUNNING, state_layout


def check_options(spec: LayerSpec, allow_tf32: bool, autotune: bool, fast_paths: bool, kernels: str,
                  launch_config: Any, evaluate_kernel: str, max_shapes: int, depthwise_kernel: str) -> None:
    """The checks of `Functions`' backend options for `spec`, before anything is built:
    which argument, what was expected, what came."""
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
    if evaluate_kernel == "direct" and not spec.bn_track_running_stats:
        raise ValueError("evaluate_kernel: 'direct' normalises with running statistics; this batch norm has "
                         "none (bn_track_running_stats=False) and needs the batch's first (use 'cudnn')")
    if depthwise_kernel not in ("auto", "cudnn", "numba"):
        raise ValueError(f"depthwise_kernel: expected 'auto', 'cudnn' or 'numba', got {depthwise_kernel!r}")
    if depthwise_kernel == "numba" and not is_depthwise(spec):
        raise ValueError(f"depthwise_kernel: 'numba' takes depthwise layers (groups == in_channels), got groups="
                         f"{spec.groups} with in_channels={spec.in_channels}")
    if kernels not in ("fast", "simple"):
        raise ValueError(f"kernels: expected 'fast' or 'simple', got {kernels!r}")
    if not isinstance(launch_config, K.LaunchConfig):
        raise TypeError(f"launch_config: expected a conv2d.cuda.kernels.LaunchConfig, got {launch_config!r}")
    if not isinstance(max_shapes, int) or isinstance(max_shapes, bool) or max_shapes < 1:
        raise ValueError(f"max_shapes: expected an int >= 1, got {max_shapes!r}")


def _memory(a: Any) -> Any:
    """What a view of the array object `a` depends on that can change under the same
    object: a torch tensor's address and shape (`t.data = ...`, `set_`, `resize_`), so a
    cached view is not used over freed memory; None for the others (numba, CuPy and JAX
    arrays keep their memory for life)."""
    ptr = getattr(a, "data_ptr", None)
    return None if ptr is None else (ptr(), a.shape)


class Arguments:
    """Checks and views of one layer's arguments (spec `spec`, device arrays of numba
    `cuda`, storage dtype `storage`); `frozen()` says whether host arrays are refused
    (a frozen layer allocates nothing); `allocate(shape, dtype)` makes the device copy of
    a host input; `dummy` stands for the saved statistics a layer without a norm has not."""

    def __init__(self, spec: LayerSpec, cuda: Any, storage: np.dtype, stream: Any,
                 allocate: Callable[..., Any], frozen: Callable[[], bool], dummy: Any) -> None:
        self.spec, self.cuda, self.storage, self.stream = spec, cuda, storage, stream
        self._allocate, self._frozen, self._dummy = allocate, frozen, dummy
        self._layout = state_layout(spec)
        self.param_names = [k for k in self._layout if k not in RUNNING]
        self._views: dict = {}  # caller arrays -> checked flat device views, by identity

    def input(self, name: str, a: Any) -> tuple[LayerSpec, Any, str]:
        """(call spec, device array, library) of an input (N, H, W, C), checked."""
        lib = library(a)
        if lib is None or not hasattr(a, "shape"):
            raise TypeError(f"{name}: expected a numpy.ndarray or a device array with __cuda_array_interface__, "
                            f"got {describe(a)}")
        self.refuse_host(name, lib)
        call = input_spec(name, a, self.spec)
        return call, device_input(self.cuda, name, a, call.input_shape, self.spec.dtype, self.stream,
                                  self._allocate), lib

    def d_y(self, d_y: Any, call: LayerSpec) -> Any:
        """The device array of d_y (N, OH, OW, OC) for a forward of `call`'s shape (the
        caller has refused a host d_y of a frozen layer first, before its other checks)."""
        return device_input(self.cuda, "d_y", d_y, call.output_shape, self.spec.dtype, self.stream, self._allocate)

    def refuse_host(self, name: str, lib: str | None) -> None:
        if self._frozen() and lib == NUMPY:
            raise RuntimeError(f"{name}: the layer is frozen; pass a device array (a NumPy array would be "
                               f"copied into newly allocated device memory)")

    def params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return self._arrays("params", params, self.param_names)

    def running(self, running: Mapping[str, Any] | None, need: bool) -> dict[str, Any] | None:
        if (self.spec.normalization is not Normalization.BATCH_NORM or not self.spec.bn_track_running_stats
                or (running is None and not need)):
            return None
        return self._arrays("running", running, [k for k in self._layout if k in RUNNING])

    def accumulate(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        return self._arrays("accumulate", arrays, self.param_names)

    def forget(self) -> None:
        """Drop the cached views (and the caller's arrays they keep)."""
        self._views.clear()

    def _arrays(self, group: str, arrays: Mapping[str, Any] | None, names: list[str]) -> dict[str, Any]:
        """Flat device views of the caller's arrays `names` (state layout shapes, or flat),
        checked once per set of array objects over the same memory."""
        last = self._views.get(group)
        if last is not None and last[0] is arrays and all(arrays.get(k) is a and _memory(a) == m
                                                           for k, a, m in last[1]):
            return last[2]  # the same dict of the same arrays as last time (a layer's own)
        self._check_keys(group, arrays, names)
        held = [(k, arrays[k], _memory(arrays[k])) for k in names]
        key = (group, *(id(a) for _, a, _ in held))
        found = self._views.get(key)
        if found is not None and [m for *_, m in held] == [m for *_, m in found[0]]:
            self._views[group] = (arrays, held, found[1])
            return found[1]
        views = self.flat_views(group, arrays, names)
        if len(self._views) >= 32:
            self._views.clear()
        # The originals pin the ids; their memory then is what a later hit must still have.
        self._views[key] = (held, views)
        self._views[group] = (arrays, held, views)
        return views

    @staticmethod
    def _check_keys(group: str, arrays: Any, names: list[str]) -> None:
        if not isinstance(arrays, Mapping) or set(arrays) != set(names):
            got = sorted(arrays) if isinstance(arrays, Mapping) else arrays
            raise ValueError(f"{group}: expected keys {names}, got {got!r}")

    def flat_views(self, group: str, arrays: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
        """Checked flat device views of `arrays[k]` for k in `names` (keys checked by the
        caller), each of its state layout's shape (or flat) and dtype."""
        views = {}
        for k in names:
            a = arrays[k]
            shape, dt = self._layout[k]
            if isinstance(a, np.ndarray) or not hasattr(a, "shape"):
                raise TypeError(f"{group}[{k!r}]: expected a device array (the CUDA backend reads and writes "
                                f"them in place), got {type(a).__name__}")
            as_ = self.spec.dtype if dt == self.storage else (dt if dt == np.int64 else DType.FLOAT32)
            views[k] = device_view(self.cuda, f"{group}[{k!r}]", a, as_, shape, flat=True)
        return views

    def grads_out(self, grads_out: Mapping[str, Any]) -> dict[str, Any]:
        """Checked flat views of the caller's arrays to write the gradients into (not
        cached by identity: new arrays come every call, and a cache would keep them)."""
        self._check_keys("grads_out", grads_out, self.param_names)
        return self.flat_views("grads_out", grads_out, self.param_names)  # a gradient has its parameter's layout

    def given(self, name: str, a: Any, lib: str, shape: tuple[int, ...]) -> Any:
        """The checked device view of an output array the caller gives (`y_out`, `d_x_out`), or None."""
        if a is None:
            return None
        if lib == NUMPY or isinstance(a, np.ndarray):
            raise TypeError(f"{name}: expected a device array beside device inputs (a NumPy call's results are "
                            f"host copies), got {describe(a)} with {lib} inputs")
        return device_view(self.cuda, name, a, self.spec.dtype, shape)

    def saved_arrays(self, total: int, groups: int, pre: Any, mean: Any, inv_std: Any) -> tuple:
        """The caller's device arrays for saved values, checked and flat: pre (N, OH, OW,
        OC: `total` values) in the storage dtype, mean and inv_std float32 per norm group
        (unused without a norm: anything)."""
        views = [device_view(self.cuda, "saved_out['pre']", pre, self.spec.dtype, (total,), flat=True)]
        for name, a in (("mean", mean), ("inv_std", inv_std)):
            if self.spec.normalization is Normalization.NONE:
                views.append(self._dummy)
            else:
                views.append(device_view(self.cuda, f"saved_out[{name!r}]", a, DType.FLOAT32, (groups,), flat=True))
        return tuple(views)
