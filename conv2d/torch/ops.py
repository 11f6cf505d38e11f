"""The layer as two PyTorch custom ops, `conv2d::forward` and `conv2d::backward`, over a
backend's functions, with autograd between them: what `Conv2dNormActivation` calls.

Custom ops are opaque to `torch.compile` (one node of the graph, no graph break) and take
and return tensors only, so the forward returns its saved values as tensors (the
pre-activations, and the norm's mean and inv_std) and the backward takes them back.
A backend's `Functions` object is named by a string key (`register`); the ops look it up.

The ops hand the functions detached tensors, and return y detached from what the
functions hold: the CUDA functions keep their last arguments and outputs (prepared
launches), and a tensor with autograd history kept there would keep the last step's
graph, and the AccumulateGrad nodes of the leaves in it, alive into the next step (more
memory, and a capture after eager steps on another stream fails on the node's stream).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from conv2d.arrays import to_library
from conv2d.spec import Normalization

_FUNCTIONS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def register(key: str, functions: Any) -> None:
    """Name `functions` (a backend's Functions for one spec) `key` for the ops."""
    _FUNCTIONS[key] = functions


def _lookup(key: str) -> Any:
    fn = _FUNCTIONS.get(key)
    if fn is None:
        raise RuntimeError(f"conv2d ops: no functions registered as {key!r} (the module that made them is gone)")
    return fn


def _detached(*tensors: Optional[Tensor]) -> list:
    return [t if t is None else t.detach() for t in tensors]


def _groups(fn: Any, n: int) -> int:
    norm = fn.spec.normalization
    return {Normalization.BATCH_NORM: fn.spec.out_channels, Normalization.LAYER_NORM: n}.get(norm, 0)


def _params(weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor], beta: Optional[Tensor]) -> dict:
    params = {"weights": weight}
    if bias is not None:
        params["bias"] = bias
    if gamma is not None:
        params["gamma"], params["beta"] = gamma, beta
    return params


@torch.library.custom_op("conv2d::forward", mutates_args=())
def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor], beta: Optional[Tensor],
            running_mean: Optional[Tensor], running_var: Optional[Tensor], training: bool,
            key: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, pre-activations, mean, inv_std, new running mean, new running variance) of x
    (N, H, W, C). The op is functional (autograd needs that): batch norm in training
    returns the updated running statistics, which the caller copies into its buffers;
    they are empty otherwise, and mean and inv_std are empty without a norm."""
    fn = _lookup(key)
    x, weight, bias, gamma, beta = _detached(x, weight, bias, gamma, beta)
    update = running_mean is not None and training and fn.spec.normalization is Normalization.BATCH_NORM
    running = None
    if running_mean is not None:
        running = {"running_mean": running_mean.clone() if update else running_mean,
                   "running_var": running_var.clone() if update else running_var}
    params = _params(weight, bias, gamma, beta)
    if x.is_cuda:
        call = fn.spec.at(*x.shape[:3])
        groups = max(_groups(fn, x.shape[0]), 1)
        saved_out = {"pre": torch.empty(call.output_shape, dtype=x.dtype, device=x.device),
                     "mean": torch.empty(groups, dtype=torch.float32, device=x.device),
                     "inv_std": torch.empty(groups, dtype=torch.float32, device=x.device)}
        y, _ = fn.forward(params, x, training, running, saved_out=saved_out)
        stats = [saved_out["mean"], saved_out["inv_std"]]
        pre = saved_out["pre"]
    else:
        y, saved = fn.forward(params, x, training, running)
        stats = [torch.from_numpy(a.copy()) if a is not None else torch.empty(0, dtype=torch.float32)
                 for a in (saved.mean, saved.inv_std)]
        pre = to_library(saved.pre.copy(), "torch")
    empty = x.new_empty(0, dtype=torch.float32)
    new = (running["running_mean"], running["running_var"]) if update else (empty, empty.clone())
    # The op's output becomes the autograd node's output (its grad_fn is set on it), and
    # the CUDA functions keep y (a prepared launch's argument, or a captured plan's
    # tensor, the same object every step): hand out an alias that they do not hold.
    return y.detach(), pre, stats[0], stats[1], new[0], new[1]


@forward.register_fake
def _(x, weight, bias, gamma, beta, running_mean, running_var, training, key):
    fn = _lookup(key)
    call = fn.spec.at(*x.shape[:3])
    groups = _groups(fn, x.shape[0])
    if x.is_cuda:
        groups = max(groups, 1)
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    update = running_mean is not None and training and fn.spec.normalization is Normalization.BATCH_NORM
    new = running_mean.new_empty(running_mean.shape) if update else x.new_empty(0, dtype=torch.float32)
    return (x.new_empty(call.output_shape), x.new_empty(call.output_shape),
            x.new_empty((groups,), dtype=stats_dtype), x.new_empty((groups,), dtype=stats_dtype), new,
            new.new_empty(new.shape))


@torch.library.custom_op("conv2d::backward", mutates_args=())
def backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor], beta: Optional[Tensor],
             pre: Tensor, mean: Tensor, inv_std: Tensor, d_y: Tensor, batch_stats: bool, want_input: bool,
             want_params: bool, key: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_weight, d_bias, d_gamma, d_beta), fresh; empty where not wanted or absent."""
    fn = _lookup(key)
    x, weight, bias, gamma, beta, d_y = _detached(x, weight, bias, gamma, beta, d_y)
    saved = fn.saved(x, pre, mean, inv_std, batch_stats)
    grads, d_x = fn.backward(_params(weight, bias, gamma, beta), saved, d_y, want_params, want_input)
    grads = grads or {}

    def got(a):  # outputs may not alias each other: a new empty tensor for each absent one
        return a if a is not None else x.new_empty(0)
    return (got(d_x), got(grads.get("weights")), got(grads.get("bias")), got(grads.get("gamma")),
            got(grads.get("beta")))


@backward.register_fake
def _(x, weight, bias, gamma, beta, pre, mean, inv_std, d_y, batch_stats, want_input, want_params, key):
    def like(t, wanted):
        return t.new_empty(t.shape) if wanted and t is not None else x.new_empty(0)
    return (like(x, want_input), like(weight, want_params), like(bias, want_params), like(gamma, want_params),
            like(beta, want_params))


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, gamma, beta, running_mean, running_var, training, key = inputs
    _, pre, mean, inv_std, new_mean, new_var = output
    ctx.mark_non_differentiable(pre, mean, inv_std, new_mean, new_var)
    ctx.save_for_backward(x, weight, bias, gamma, beta, pre, mean, inv_std)
    norm = _lookup(key).spec.normalization
    ctx.batch_stats = norm is Normalization.LAYER_NORM or (norm is Normalization.BATCH_NORM and training)
    ctx.key = key


def _backward(ctx: Any, d_y: Tensor, *_: Tensor) -> tuple:
    x, weight, bias, gamma, beta, pre, mean, inv_std = ctx.saved_tensors
    want_input = ctx.needs_input_grad[0]
    want_params = any(ctx.needs_input_grad[1:5])
    # Autograd may hand d_y in another layout; the backends read C-contiguous (NHWC).
    d_x, d_w, d_b, d_g, d_be = torch.ops.conv2d.backward(x, weight, bias, gamma, beta, pre, mean, inv_std,
                                                         d_y.contiguous(), ctx.batch_stats, want_input, want_params,
                                                         ctx.key)
    return (d_x if want_input else None, d_w if want_params else None,
            d_b if want_params and bias is not None else None, d_g if want_params and gamma is not None else None,
            d_be if want_params and beta is not None else None, None, None, None, None)


torch.library.register_autograd("conv2d::forward", _backward, setup_context=_setup_context)
