"""The layer's two functions in NumPy, on the CPU: `forward` and `backward` over explicit
parameters, running statistics and a `Saved` object, and `Functions`, the same two bound
to a spec with the memory operations a layer needs (the CUDA backend's
`conv2d/cuda/functional.py` has the same names).

Every computation runs in the compute dtype (float64 for the float64 policy, float32
otherwise) and is rounded to the storage dtype exactly where the GPU stores a tensor:
pre-activations, outputs, d_z before it feeds the convolution gradients and the bias
gradient, d_x, each new weight gradient, and accumulated gradients. Batch statistics:
mean, then the mean squared deviation from it (two passes over z, as the CUDA backend's
simple kernels; its fast kernels take one pass of sums shifted by the group's first
value, which agrees within the tolerance).

Arrays: `x` (N, H, W, C) and `d_y` (N, OH, OW, OC), C-contiguous, in the storage dtype,
NumPy arrays or torch CPU tensors (outputs come back in the input's library). `params`:
"weights" (OC, KH, KW, IC) and, with the spec's bias, "bias" (OC,) in the storage dtype;
with a norm "gamma", "beta" (OC,) in the compute dtype; read in place. `running`:
"running_mean", "running_var" (OC,), updated in place by a training batch-norm forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from conv2d import activations
from conv2d.arrays import host_view, to_library
from conv2d.checks import check_numpy, check_shape_dtype, input_spec
from conv2d.dtypes import compute_dtype, storage_dtype
from conv2d.reference import conv, norm, optim
from conv2d.spec import CALL_FIELDS, LayerSpec, Normalization
from conv2d.state import MAX_BATCHES, RUNNING, grad_layout, state_layout


@dataclass(frozen=True, eq=False)
class Saved:
    """What `backward` needs from one `forward`: the call's spec (its N, H, W), the input,
    the pre-activations conv(x, W) + b (N, OH, OW, OC, storage dtype), the norm's mean and
    inv_std ((OC,) for batch norm, (N,) for layer norm, else None) and whether they came
    from the batch itself."""

    spec: LayerSpec
    x: np.ndarray
    pre: np.ndarray
    mean: np.ndarray | None
    inv_std: np.ndarray | None
    batch_stats: bool
    library: str


def _axes(spec: LayerSpec) -> tuple[int, ...]:
    return norm.LAYER_AXES if spec.normalization is Normalization.LAYER_NORM else norm.BATCH_AXES


def _sample_wise(spec: LayerSpec) -> bool:
    """Whether the norm's reductions run one sample at a time: layer norm's, in a
    batch-invariant layer (numpy's reduction over one sample then has one shape whatever N)."""
    return spec.batch_invariant and spec.normalization is Normalization.LAYER_NORM


def _per_sample(fn: Any, *arrays: np.ndarray, **fixed: Any) -> Any:
    """fn over each sample of `arrays` (leading axis N), the results joined along N (each
    of a tuple of results, for a function that returns one)."""
    parts = [fn(*(a[i:i + 1] for a in arrays), **fixed) for i in range(arrays[0].shape[0])]
    if isinstance(parts[0], tuple):
        return tuple(np.concatenate(p) for p in zip(*parts))
    return np.concatenate(parts)


def check_params(spec: LayerSpec, params: Mapping[str, Any], running: Mapping[str, Any] | None,
                 need_running: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """NumPy views of `params` and `running`, each key, shape and dtype as the spec's state
    layout says (torch CPU tensors are viewed, not copied), checked at every call."""
    layout = state_layout(spec)
    views = {}
    for group, arrays, names in (("params", params, [k for k in layout if k not in RUNNING]),
                                 ("running", running, [k for k in layout if k in RUNNING])):
        if arrays is None:
            if names and (group == "params" or need_running):
                raise ValueError(f"{group}: expected arrays {names}, got None")
            continue
        if not isinstance(arrays, Mapping) or set(arrays) != set(names):
            got = sorted(arrays) if isinstance(arrays, Mapping) else type(arrays).__name__
            raise ValueError(f"{group}: expected keys {names}, got {got}")
        for k in names:
            a, _ = host_view(f"{group}[{k!r}]", arrays[k])
            check_shape_dtype(f"{group}[{k!r}]", a, *layout[k])
            # A view of a NumPy array, not the caller's object: `a.shape = ...` on it later
            # must not reshape a view that check_params keeps.
            views[k] = a.view() if a is arrays[k] else a
    run = {k: views.pop(k) for k in RUNNING if k in views} if running is not None else None
    return views, run or None  # {} for a layout without running statistics: none, as None says


def _pre_activations(spec: LayerSpec, params: dict, x: np.ndarray) -> np.ndarray:
    """conv(x, W) + b, (N, OH, OW, OC), rounded to the storage dtype."""
    ct, st = compute_dtype(spec.dtype), storage_dtype(spec.dtype)
    z = conv.conv_forward(x.astype(ct, copy=False), params["weights"].astype(ct, copy=False), spec.stride,
                          spec.pads, per_sample=spec.batch_invariant, dilation=spec.dilation, groups=spec.groups,
                          mode=spec.padding_mode)
    if spec.bias:
        z += params["bias"].astype(ct, copy=False)
    return z.astype(st, copy=False)


def _statistics(spec: LayerSpec, z: np.ndarray, training: bool,
                running: dict | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """(mean, inv_std, from_batch) of the norm; a training batch norm updates `running` in place."""
    axes = _axes(spec)
    if spec.batch_statistics(training):
        mean, var = (_per_sample(norm.statistics, z, axes=axes) if _sample_wise(spec)
                     else norm.statistics(z, axes))
        if spec.normalization is Normalization.BATCH_NORM and running is not None:
            count = z.size // z.shape[-1]
            scaled = var * var.dtype.type(spec.running_var_scale(count))
            momentum = spec.bn_momentum
            if momentum is None:  # the cumulative average, as PyTorch's momentum=None
                counted = running["num_batches_tracked"]
                if counted < MAX_BATCHES:  # saturates: a wrap would make the count negative
                    counted[...] += 1
                momentum = 1.0 / float(counted)
            for k, stat in (("running_mean", mean), ("running_var", scaled)):
                running[k][...] = norm.update_running(running[k], stat, momentum)
        return mean, norm.inverse_std(var, spec.bn_epsilon), True
    mean = running["running_mean"].astype(z.dtype)
    return mean, norm.inverse_std(running["running_var"].astype(z.dtype), spec.bn_epsilon), False


def _with_identity_affine(spec: LayerSpec, params: dict) -> dict:
    """`params` with gamma = 1 and beta = 0 for a norm without them (bn_affine=False)."""
    if spec.normalization is Normalization.NONE or spec.bn_affine:
        return params
    ct = compute_dtype(spec.dtype)
    return {**params, "gamma": np.ones(spec.out_channels, ct), "beta": np.zeros(spec.out_channels, ct)}


def _activation_input(spec: LayerSpec, params: dict, z: np.ndarray, mean: np.ndarray | None,
                      inv_std: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(a, x_hat): a = gamma * x_hat + beta with a norm, a = z without one."""
    if spec.normalization is Normalization.NONE:
        return z, None
    x_hat = norm.normalize(z, mean, inv_std, _axes(spec))
    return norm.affine(x_hat, params["gamma"], params["beta"]), x_hat


def layer_differences(call: LayerSpec, spec: LayerSpec) -> tuple:
    """((field, (call's, spec's)), ...): how the layer of a call's spec differs from `spec`,
    the call fields (N, H, W) aside."""
    return tuple(call.differences(spec, ignore=CALL_FIELDS).items())


def check_running_writable(running: dict) -> None:
    """Refuse read-only running statistics before a training batch norm updates either."""
    for k, a in running.items():
        if not a.flags.writeable:
            raise ValueError(f"running[{k!r}]: a training batch-norm forward updates it in place, got a "
                             f"read-only array")


def check_input(spec: LayerSpec, name: str, x: Any) -> tuple[np.ndarray, str, LayerSpec]:
    """(NumPy view of input x, its library, the call's spec) after every check of x:
    (N, H, W, C) with the spec's C, a size the kernel fits, storage dtype, C-contiguous."""
    x, lib = host_view(name, x)
    call = input_spec(name, x, spec)
    check_numpy(name, x, call.input_shape, storage_dtype(spec.dtype))
    return x, lib, call


def forward(spec: LayerSpec, params: Mapping[str, Any], x: Any, training: bool,
            running: Mapping[str, Any] | None = None) -> tuple[Any, Saved]:
    """(y (N, OH, OW, OC), saved) for input x (N, H, W, C) at any N, H, W the kernel fits.

    Batch norm in training normalises with the batch's statistics and updates `running`
    in place (if given); otherwise it uses `running`. Layer norm uses each sample's own."""
    if not isinstance(training, bool):
        raise TypeError(f"training: expected a bool, got {training!r}")
    x, lib, call = check_input(spec, "x", x)
    st = storage_dtype(spec.dtype)
    need_running = spec.normalization is Normalization.BATCH_NORM and not spec.batch_statistics(training)
    params, running = check_params(spec, params, running, need_running)
    params = _with_identity_affine(spec, params)
    if running is not None and training and spec.normalization is Normalization.BATCH_NORM:
        check_running_writable(running)
    pre = _pre_activations(call, params, x)
    z = pre.astype(compute_dtype(spec.dtype), copy=False)
    mean = inv_std = None
    from_batch = False
    if spec.normalization is not Normalization.NONE:
        mean, inv_std, from_batch = _statistics(call, z, training, running)
    a, _ = _activation_input(call, params, z, mean, inv_std)
    y = activations.forward(spec.activation, a, spec.activation_parameter).astype(st, copy=False)
    return to_library(y, lib), Saved(call, x, pre, mean, inv_std, from_batch, lib)


def grad_pre_activations(params: dict, saved: Saved, d_y: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """d_z (N, OH, OW, OC) in the compute dtype, and the norm's parameter gradients."""
    spec = saved.spec
    ct = compute_dtype(spec.dtype)
    z = saved.pre.astype(ct, copy=False)
    a, x_hat = _activation_input(spec, params, z, saved.mean, saved.inv_std)
    d_a = activations.derivative(spec.activation, a, spec.activation_parameter)
    d_a *= d_y.astype(ct, copy=False)
    if spec.normalization is Normalization.NONE:
        return d_a, {}
    d_gamma, d_beta = norm.param_backward(d_a, x_hat)
    gamma = params["gamma"]
    if saved.batch_stats:
        if _sample_wise(spec):
            d_z = _per_sample(norm.backward_batch_statistics, d_a, x_hat, saved.inv_std, gamma=gamma,
                              axes=_axes(spec))
        else:
            d_z = norm.backward_batch_statistics(d_a, x_hat, saved.inv_std, gamma, _axes(spec))
    else:
        d_z = norm.backward_fixed_statistics(d_a, saved.inv_std, gamma, _axes(spec))
    return d_z, {"gamma": d_gamma, "beta": d_beta}


def backward(spec: LayerSpec, params: Mapping[str, Any], saved: Saved, d_y: Any, want_params: bool = True,
             want_input: bool = True, accumulate: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """(grads, d_x) of the forward that gave `saved`, for d_y (N, OH, OW, OC) of its shape.

    grads: {"weights", "bias", "gamma", "beta"} as the spec has them, new arrays in the
    parameters' dtypes, or, with `accumulate` (arrays of the same keys), added into those
    in place (+=, rounded to their dtype) and returned; None unless `want_params`.
    d_x (N, H, W, C), new, or None unless `want_input`."""
    call = check_saved(spec, saved, "reference")
    st, ct = storage_dtype(spec.dtype), compute_dtype(spec.dtype)
    d_y, lib = host_view("d_y", d_y)
    check_numpy("d_y", d_y, call.output_shape, st)
    params, _ = check_params(spec, params, None, False)
    params = _with_identity_affine(spec, params)
    acc = None
    if want_params and accumulate is not None:
        acc, _ = check_params(spec, {k: accumulate.get(k) for k in grad_layout(spec)}, None, False)
    d_z, norm_grads = grad_pre_activations(params, saved, d_y)
    # The convolution gradients and the bias gradient read d_z as stored (rounded to the
    # storage dtype), as the GPU, which sums the d_z it stored for cuDNN.
    d_z_stored = d_z.astype(st, copy=False).astype(ct, copy=False)
    d_x = None
    if want_input:
        w = params["weights"].astype(ct, copy=False)
        d_x = conv.conv_backward_data(w, d_z_stored, (call.in_height, call.in_width), call.stride, call.pads,
                                      per_sample=spec.batch_invariant, dilation=call.dilation, groups=call.groups,
                                      mode=call.padding_mode)
        d_x = to_library(d_x.astype(st, copy=False), lib)
    if not want_params:
        return None, d_x
    new = dict(norm_grads)
    if spec.bias:
        new["bias"] = conv.bias_backward(d_z_stored)
    d_w = conv.conv_backward_filter(saved.x.astype(ct, copy=False), d_z_stored, call.kernel, call.stride,
                                    call.pads, call.dilation, call.groups, call.padding_mode)
    new["weights"] = d_w.astype(st, copy=False).astype(ct, copy=False)  # stored, as cuDNN writes it
    return gradients_out(spec, new, acc, accumulate, lib), d_x


def check_saved(spec: LayerSpec, saved: Any, backend: str) -> LayerSpec:
    """The call's spec of `saved` after checking that it is a host backend's Saved made by
    a forward of this layer (any N, H, W)."""
    if not isinstance(saved, Saved):
        raise TypeError(f"saved: expected the Saved of a {backend} forward, got {type(saved).__name__}")
    other = layer_differences(saved.spec, spec)
    if other:
        raise ValueError("saved: made by a forward of another layer (" + "; ".join(
            f"{k}: saved's {a!r}, this layer's {b!r}" for k, (a, b) in other) + ")")
    return saved.spec


def gradients_out(spec: LayerSpec, new: dict[str, np.ndarray], acc: dict | None, accumulate: Any,
                  lib: str) -> Any:
    """A backward's gradients `new` (compute dtype): new arrays in the parameters' dtypes
    and the caller's library, or, with `acc` (the checked views of `accumulate`), added
    into those in place (rounded to their dtype) and `accumulate` returned."""
    if acc is None:
        layout = grad_layout(spec)
        return {k: to_library(new[k].astype(layout[k][1]), lib) for k in layout}
    ct = compute_dtype(spec.dtype)
    for k, g in new.items():
        if k in acc:  # gamma and beta are absent without an affine norm
            acc[k][...] = (acc[k].astype(ct, copy=False) + g).astype(acc[k].dtype, copy=False)
    return accumulate


class Functions:
    """`forward`, `evaluate` and `backward` bound to one spec, with the memory operations
    of `conv2d.layer.Conv2d` over NumPy arrays (`from_host`, `write`, `read`, `zero`)."""

    name = "reference"

    def __init__(self, spec: LayerSpec) -> None:
        self.spec = spec

    def check_input(self, name: str, x: Any) -> LayerSpec:
        """The call's spec for input `x`, after the checks `forward` makes of it."""
        return check_input(self.spec, name, x)[2]

    def forward(self, params: Mapping[str, Any], x: Any, training: bool,
                running: Mapping[str, Any] | None = None) -> tuple[Any, Saved]:
        return forward(self.spec, params, x, training, running)

    def evaluate(self, params: Mapping[str, Any], x: Any, running: Mapping[str, Any] | None = None) -> Any:
        """forward(training=False)'s y, keeping nothing."""
        return forward(self.spec, params, x, False, running)[0]

    def saved(self, x: Any, pre: Any, mean: Any, inv_std: Any, batch_stats: bool) -> Saved:
        """A Saved made of the caller's arrays (a forward's saved values that the caller
        kept: a torch custom op returns them), for `backward`; mean and inv_std are
        ignored without a norm."""
        x_np, lib, call = check_input(self.spec, "x", x)
        pre_np, _ = host_view("pre", pre)
        check_shape_dtype("pre", pre_np, call.output_shape, storage_dtype(self.spec.dtype))
        stats = (None, None)
        if self.spec.normalization is not Normalization.NONE:
            stats = tuple(host_view(name, a)[0].astype(compute_dtype(self.spec.dtype), copy=False)
                          for name, a in (("mean", mean), ("inv_std", inv_std)))
        return Saved(call, x_np, pre_np, stats[0], stats[1], bool(batch_stats), lib)

    def backward(self, params: Mapping[str, Any], saved: Saved, d_y: Any, want_params: bool = True,
                 want_input: bool = True, accumulate: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
        return backward(self.spec, params, saved, d_y, want_params, want_input, accumulate)

    def pre_activations(self, saved: Saved) -> np.ndarray:
        """A read-only view of the saved pre-activations (N, OH, OW, OC)."""
        view = saved.pre.view()
        view.flags.writeable = False
        return view

    # Optimizer updates of one parameter (conv2d.optim), in place.
    def adam_step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
                  buffers: Mapping[str, dict], step: np.ndarray, h: dict, prepared: dict) -> None:
        """One Adam step of a layer's parameters (conv2d.optim); `prepared` is unused here."""
        optim.adam_step(params, grads, buffers, step, h)

    def sgd_step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
                 buffers: Mapping[str, dict], step: np.ndarray, h: dict, prepared: dict) -> None:
        """One SGD step of a layer's parameters (conv2d.optim); `prepared` is unused here."""
        optim.sgd_step(params, grads, buffers, step, h)

    # Memory: the layer's arrays are NumPy arrays of the state layout's shapes.
    def from_host(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: np.array(v, copy=True) for k, v in values.items()}

    def write(self, arrays: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray]) -> None:
        for k, v in values.items():
            arrays[k][...] = v

    def read(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in arrays.items()}

    def zero(self, arrays: Mapping[str, np.ndarray]) -> None:
        for v in arrays.values():
            v[...] = 0

