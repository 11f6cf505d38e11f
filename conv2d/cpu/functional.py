"""The CPU backend's functions: `forward` and `backward` over explicit parameters, running
statistics and a `Saved` object, and `Functions`, the two bound to a spec with the memory
operations a layer needs. The names, arguments and contract are the reference's
(conv2d/reference/functional.py), which this is checked against; what differs is how:

- convolutions as in conv2d.cpu.conv (BLAS products; numba loops for depthwise ones);
- the norm's statistics, the norm and the activation in compiled passes
  (conv2d.cpu.kernels): two passes of sums over z (mean, then squared deviations), one
  pass that writes y; in backward, one pass of sums and one that writes d_z, each
  recomputing the activation's input from the saved pre-activations;
- the parameter checks of a dict seen before are not made again (`conv2d.cpu.params`).

Every sum runs in float64 over chunks fixed by the shape, so results are bitwise the same
for any thread count (conv2d.cpu.threads says how many run). Rounding to the storage dtype
happens where the reference rounds: the pre-activations, y, d_z before the convolution
gradients, d_x and the weight gradients (bfloat16's casts by casts.cast and
casts.through, NumPy's bits in a compiled pass). Arrays: as the reference's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import numpy as np

from conv2d.activations import DEFAULT_PARAMETER
from conv2d.arrays import host_view, to_library
from conv2d.checks import check_numpy
from conv2d.cpu import casts, conv, kernels, params as checked, threads as pool
from conv2d.dtypes import compute_dtype, storage_dtype
from conv2d.reference import functional as reference
from conv2d.reference.functional import Saved, check_input, check_running_writable, check_saved, gradients_out
from conv2d.reference.norm import update_running
from conv2d.spec import LayerSpec, Normalization
from conv2d.state import MAX_BATCHES, grad_layout


_MODES = {Normalization.NONE: kernels.NO_NORM, Normalization.BATCH_NORM: kernels.BATCH_NORM,
          Normalization.LAYER_NORM: kernels.LAYER_NORM}


def _pixels(a: np.ndarray) -> np.ndarray:
    """(N, OH, OW, OC) -> (N, OH*OW, OC), a view."""
    return a.reshape(a.shape[0], -1, a.shape[-1])


def _pre_activations(spec: LayerSpec, params: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pre, z): conv(x, W) + b (N, OH, OW, OC) in the storage dtype, and the same values
    in the compute dtype (one array where the two dtypes are one)."""
    ct, st = compute_dtype(spec.dtype), storage_dtype(spec.dtype)
    z = conv.conv_forward(casts.cast(x, ct), casts.cast(params["weights"], ct), spec.stride,
                          spec.pads, per_sample=spec.batch_invariant, dilation=spec.dilation, groups=spec.groups,
                          mode=spec.padding_mode)
    if spec.bias:
        z += params["bias"].astype(ct, copy=False)
    pre = casts.cast(z, st)
    return pre, casts.cast(pre, ct)


def _statistics(spec: LayerSpec, z: np.ndarray, training: bool, running: dict | None
                ) -> tuple[np.ndarray, np.ndarray, bool]:
    """(mean, inv_std, from_batch) in the compute dtype; a training batch norm updates
    `running` in place. Two passes of float64 sums: the mean, then the squared deviations
    from it."""
    ct = z.dtype
    layer = spec.normalization is Normalization.LAYER_NORM
    if spec.batch_statistics(training):
        flat = z.reshape(z.shape[0], -1) if layer else z.reshape(-1, z.shape[-1])
        sums = kernels.row_sums if layer else kernels.column_sums
        count = flat.shape[1] if layer else flat.shape[0]
        width = flat.shape[0] if layer else flat.shape[1]
        mean = sums(flat, np.zeros(width), 1) / count
        var = sums(flat, mean, 2) / count
        if not layer and running is not None:
            momentum = spec.bn_momentum
            if momentum is None:  # the cumulative average, as PyTorch's momentum=None
                counted = running["num_batches_tracked"]
                if counted < MAX_BATCHES:
                    counted[...] += 1
                momentum = 1.0 / float(counted)
            scaled = var * spec.running_var_scale(count)
            for k, stat in (("running_mean", mean), ("running_var", scaled)):
                running[k][...] = update_running(running[k], stat.astype(ct), momentum)
        return mean.astype(ct), (1.0 / np.sqrt(var + spec.bn_epsilon)).astype(ct), True
    mean = running["running_mean"].astype(ct)
    var = running["running_var"].astype(np.float64)
    return mean, (1.0 / np.sqrt(var + spec.bn_epsilon)).astype(ct), False


def _norm_parameters(spec: LayerSpec, params: dict, ct: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(gamma, beta) in the compute dtype: ones and zeros without an affine (or a norm)."""
    if spec.normalization is not Normalization.NONE and spec.bn_affine:
        return params["gamma"].astype(ct, copy=False), params["beta"].astype(ct, copy=False)
    return np.ones(spec.out_channels, ct), np.zeros(spec.out_channels, ct)


@functools.lru_cache(maxsize=256)
def _activation(spec: LayerSpec) -> tuple[int, float]:
    """(the activation's kernel code, its parameter) of a spec (a layer asks every call)."""
    p = spec.activation_parameter
    return kernels.ACTIVATION_CODES[spec.activation], float(DEFAULT_PARAMETER.get(spec.activation, 0.0) if p is None
                                                              else p)


def forward(spec: LayerSpec, params: Mapping[str, Any], x: Any, training: bool,
            running: Mapping[str, Any] | None = None, cache: dict | None = None,
            threads: int | str | None = None) -> tuple[Any, Saved]:
    """(y (N, OH, OW, OC), saved) for input x (N, H, W, C), as the reference's forward.
    `cache`: conv2d.cpu.params' (a Functions' own); `threads`: conv2d.cpu.threads'."""
    if not isinstance(training, bool):
        raise TypeError(f"training: expected a bool, got {training!r}")
    x, lib, call = check_input(spec, "x", x)
    params, running = _checked(spec, params, running, training, cache)
    pool.use(threads)
    y, saved = _forward(call, params, running, x, training, lib)
    return to_library(y, lib), saved


def _checked(spec: LayerSpec, params: Mapping[str, Any], running: Mapping[str, Any] | None, training: bool,
             cache: dict | None) -> tuple[dict, dict | None]:
    """The NumPy views of params and running after the forward's checks."""
    need_running = spec.normalization is Normalization.BATCH_NORM and not spec.batch_statistics(training)
    params, running = checked.check_params(spec, params, running, need_running, cache)
    if running is not None and training and spec.normalization is Normalization.BATCH_NORM:
        check_running_writable(running)
    return params, running


def _forward(call: LayerSpec, params: dict, running: dict | None, x: np.ndarray, training: bool,
             lib: str = "numpy") -> tuple[np.ndarray, Saved]:
    """(y, saved) of checked arrays: `call` the spec at x's (N, H, W), y in the storage dtype."""
    ct, st = compute_dtype(call.dtype), storage_dtype(call.dtype)
    pre, z = _pre_activations(call, params, x)
    mean = inv_std = None
    from_batch = False
    if call.normalization is not Normalization.NONE:
        mean, inv_std, from_batch = _statistics(call, z, training, running)
    gamma, beta = _norm_parameters(call, params, ct)
    code, p = _activation(call)
    y = np.empty(pre.shape, ct)
    none = np.zeros(1, ct)  # the statistics' stand-in without a norm
    kernels.forward_epilogue(_pixels(z), _MODES[call.normalization], none if mean is None else mean,
                             none if inv_std is None else inv_std, gamma, beta, code, p, _pixels(y))
    return casts.cast(y, st), Saved(call, x, pre, mean, inv_std, from_batch, lib)


def _fused_evaluate(spec: LayerSpec) -> bool:
    """Whether an evaluate of `spec` is one pass after the convolution (evaluate_epilogue):
    no statistics of its own to compute (no norm, or batch norm's running statistics)."""
    return spec.normalization is Normalization.NONE or (spec.normalization is Normalization.BATCH_NORM
                                                        and not spec.batch_statistics(False))


def _evaluator(call: LayerSpec, params: dict, running: dict | None) -> Callable[[np.ndarray], np.ndarray]:
    """The evaluate of checked arrays x (N, H, W, C) of the shape `call` was made at: y
    (N, OH, OW, OC) in the storage dtype, a new array, bitwise forward(training=False)'s y.
    What depends on the spec and on the arrays' memory alone is looked up here, once;
    the parameters' and statistics' values are read at each call."""
    if not _fused_evaluate(call):
        return lambda x: _forward(call, params, running, x, False)[0]
    ct, st = compute_dtype(call.dtype), storage_dtype(call.dtype)
    weights = params["weights"]
    gamma, beta = _norm_parameters(call, params, ct)
    mode = _MODES[call.normalization]
    none = np.zeros(1, ct)
    mean, var = (running["running_mean"], running["running_var"]) if mode == kernels.BATCH_NORM else (none, none)
    code, p = _activation(call)
    eps = float(call.bn_epsilon)
    if st == ct:
        bias = params["bias"] if call.bias else np.zeros(0, ct)
        convolve = conv.forward_function(call.input_shape, weights, call.stride, call.pads, call.batch_invariant,
                                         call.dilation, call.groups, call.padding_mode)
    else:  # 16-bit storage: _pre_activations' z, bitwise, in fewer passes
        bias, stored_bias = np.zeros(0, ct), params["bias"] if call.bias else None
        # The weights in the compute dtype, cast into this one buffer at each call (their
        # values may have changed since), which the prepared convolution reads. Two
        # threads acting at once write the same values into it.
        w = np.empty(weights.shape, ct)
        prepared = conv.forward_function(call.input_shape, w, call.stride, call.pads, call.batch_invariant,
                                         call.dilation, call.groups, call.padding_mode)

        def convolve(x: np.ndarray) -> np.ndarray:
            casts.cast(weights, ct, out=w)
            z = prepared(casts.cast(x, ct))
            if stored_bias is not None:
                z += stored_bias.astype(ct, copy=False)
            return casts.through(z, st, out=z)  # the storage dtype's rounding, kept in ct

    def evaluate(x: np.ndarray) -> np.ndarray:
        z = convolve(x)
        y = np.empty(z.shape, ct)
        kernels.evaluate_epilogue(_pixels(z), bias, mode, mean, var, eps, gamma, beta, code, p, _pixels(y))
        return casts.cast(y, st)
    return evaluate


def grad_pre_activations(spec: LayerSpec, params: dict, saved: Saved, d_y: np.ndarray
                         ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """d_z (N, OH, OW, OC) in the compute dtype, and the norm's parameter gradients."""
    call = saved.spec
    ct = compute_dtype(spec.dtype)
    z = _pixels(casts.cast(saved.pre, ct))
    d_y3 = _pixels(casts.cast(d_y, ct))
    mode = _MODES[spec.normalization]
    gamma, beta = _norm_parameters(spec, params, ct)
    code, p = _activation(spec)
    none = np.zeros(1, ct)  # the statistics' stand-in without a norm
    mean = none if saved.mean is None else saved.mean
    inv_std = none if saved.inv_std is None else saved.inv_std
    d_z = np.empty(z.shape, ct)
    grads: dict[str, np.ndarray] = {}
    mean_g = mean_gx = none
    if mode != kernels.NO_NORM:
        channel, sample = kernels.backward_sums(z, d_y3, mode, mean, inv_std, gamma, beta, code, p)
        grads = {"gamma": channel[1].astype(ct), "beta": channel[0].astype(ct)}
        if saved.batch_stats and mode == kernels.BATCH_NORM:
            count = z.shape[0] * z.shape[1]
            mean_g, mean_gx = (gamma * (channel[0] / count)).astype(ct), (gamma * (channel[1] / count)).astype(ct)
        elif saved.batch_stats:
            count = z.shape[1] * z.shape[2]
            mean_g, mean_gx = (sample[0] / count).astype(ct), (sample[1] / count).astype(ct)
    kernels.backward_epilogue(z, d_y3, mode, mean, inv_std, gamma, beta, code, p, saved.batch_stats, mean_g, mean_gx,
                              d_z)
    return d_z.reshape(call.output_shape), grads


def backward(spec: LayerSpec, params: Mapping[str, Any], saved: Saved, d_y: Any, want_params: bool = True,
             want_input: bool = True, accumulate: Mapping[str, Any] | None = None,
             cache: dict | None = None, threads: int | str | None = None) -> tuple[Any, Any]:
    """(grads, d_x) of the forward that gave `saved`, as the reference's backward."""
    call = check_saved(spec, saved, "cpu or reference")
    st, ct = storage_dtype(spec.dtype), compute_dtype(spec.dtype)
    d_y, lib = host_view("d_y", d_y)
    check_numpy("d_y", d_y, call.output_shape, st)
    params, _ = checked.check_params(spec, params, None, False, cache)
    acc = None
    if want_params and accumulate is not None:
        acc, _ = checked.check_params(spec, {k: accumulate.get(k) for k in grad_layout(spec)}, None, False)
    pool.use(threads)
    d_z, norm_grads = grad_pre_activations(spec, params, saved, d_y)
    d_z_stored = casts.through(d_z, st)
    d_x = None
    if want_input:
        w = casts.cast(params["weights"], ct)
        d_x = conv.conv_backward_data(w, d_z_stored, (call.in_height, call.in_width), call.stride, call.pads,
                                      per_sample=spec.batch_invariant, dilation=call.dilation, groups=call.groups,
                                      mode=call.padding_mode)
        d_x = to_library(casts.cast(d_x, st), lib)
    if not want_params:
        return None, d_x
    new = dict(norm_grads)
    if spec.bias:
        new["bias"] = conv.bias_backward(d_z_stored)
    d_w = conv.conv_backward_filter(casts.cast(saved.x, ct), d_z_stored, call.kernel, call.stride,
                                    call.pads, call.dilation, call.groups, call.padding_mode)
    new["weights"] = casts.through(d_w, st)
    return gradients_out(spec, new, acc, accumulate, lib), d_x


class Functions(reference.Functions):
    """`forward`, `evaluate` and `backward` bound to one spec; the memory operations,
    the optimizers' steps, `saved` and `pre_activations` are the reference's (the same
    NumPy arrays, the same `Saved`). `threads`: conv2d.cpu.threads' rule."""

    name = "cpu"

    def __init__(self, spec: LayerSpec, threads: int | str | None = None) -> None:
        super().__init__(spec)
        self.threads = pool.check(threads)
        self._checked: dict = {}  # conv2d.cpu.params' views of the caller's dicts
        self._evaluators: dict = {}  # the call's spec -> (the views, their `_evaluator`)

    def forward(self, params: Mapping[str, Any], x: Any, training: bool,
                running: Mapping[str, Any] | None = None) -> tuple[Any, Saved]:
        return forward(self.spec, params, x, training, running, self._checked, self.threads)

    def evaluate(self, params: Mapping[str, Any], x: Any, running: Mapping[str, Any] | None = None) -> Any:
        """forward(training=False)'s y, keeping nothing."""
        x, lib, call = check_input(self.spec, "x", x)
        params, running = _checked(self.spec, params, running, False, self._checked)
        pool.use(self.threads)
        found = self._evaluators.get(call)
        if found is None or found[0] is not params or found[1] is not running:
            if len(self._evaluators) >= 8:
                self._evaluators.clear()
            found = self._evaluators[call] = (params, running, _evaluator(call, params, running))
        return to_library(found[2](x), lib)

    def prepare_evaluate(self, params: Mapping[str, Any], running: Mapping[str, Any] | None,
                         x_shape: tuple[int, int, int, int]) -> Callable[[np.ndarray], np.ndarray]:
        """`evaluate` of NumPy arrays x of shape `x_shape` (N, H, W, C), C-contiguous, of
        the spec's storage dtype, over `params` and `running`: every check made here, once,
        and none by the function returned, which gives y (N, OH, OW, OC), a new NumPy
        array, bitwise `evaluate`'s. The caller keeps the arrays' memory (values may
        change between calls, as an optimizer's steps change them; the memory may not)."""
        x = np.empty(x_shape, storage_dtype(self.spec.dtype))
        _, _, call = check_input(self.spec, "x", x)
        params, running = _checked(self.spec, params, running, False, None)
        run, threads = _evaluator(call, params, running), self.threads

        def evaluate(x: np.ndarray) -> np.ndarray:
            pool.use(threads)
            return run(x)
        return evaluate

    def backward(self, params: Mapping[str, Any], saved: Saved, d_y: Any, want_params: bool = True,
                 want_input: bool = True, accumulate: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
        return backward(self.spec, params, saved, d_y, want_params, want_input, accumulate, self._checked,
                        self.threads)
