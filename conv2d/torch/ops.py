"""The layer as two PyTorch operators, `conv2d::forward` and `conv2d::backward`, over a
backend's functions, and `Conv2dFunction`, the autograd function between them: what
`Conv2dNormActivation` calls under torch.compile and for tensor subclasses, always through
torch's dispatcher (for plain tensors in eager mode it calls `conv2d.torch.eager`: the
same functions without the round trip through tensors).

The operators are opaque to `torch.compile` (one node each, no graph break) and take and
return tensors only, so the forward returns its saved values as tensors (the
pre-activations, and the norm's mean and inv_std) and the backward takes them back. The
forward updates batch norm's running statistics in place, as PyTorch's BatchNorm2d does
(its schema declares the two mutated arguments, so compile functionalises them).
A backend's `Functions` object is named by a string key that says what it computes
(`key_for`: the backend, the spec, the device and the backend's options, as JSON), and the
ops make the functions of a key on first use (`functions`): a graph that torch.export or
torch.compile recorded runs in any process where conv2d is installed, whatever became of
the module that traced it. Options that are no JSON value (a stream object, a stand-in for
cuDNN) cannot be named: their functions are registered under a key of this process only.
The module's key leaves TF32 and plan timing to PyTorch's switches (`FOLLOW`): the op
reads them when it runs (`key_now`), as the module's eager path reads them at each call,
so a traced call reads none of them and a compiled graph follows them afterwards.

Neither op has a second derivative: a backward asked to build a graph (create_graph=True)
returns gradients that raise PyTorch's once_differentiable error when differentiated
(`first_order_only`), instead of gradients silently without a graph.

They are defined with `torch.library.Library` and autograd lives in a
`torch.autograd.Function` outside them, rather than `torch.library.custom_op` with
`register_autograd`: custom_op's wrappers cost host time on every call (PyTorch issues
139500, 176592), and register_autograd refuses an operator that mutates its arguments,
which made the running statistics a clone in and a copy out (four more kernels a step).

The ops hand the functions detached tensors, and return y detached from what the
functions hold: the CUDA functions keep their last arguments and outputs (prepared
launches), and a tensor with autograd history kept there would keep the last step's
graph, and the AccumulateGrad nodes of the leaves in it, alive into the next step (more
memory, and a capture after eager steps on another stream fails on the node's stream).
"""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any, Optional

import torch
from torch import Tensor

from conv2d.arrays import to_library
from conv2d.backend import make_functions
from conv2d.spec import LayerSpec, Normalization
from conv2d.torch.calls import (call_context, choice_now, detached, first_order_only, keeping_nothing, param_dict,
                                saved_outputs)

_FUNCTIONS: dict[str, Any] = {}  # key -> a backend's Functions; one per distinct layer, device and options
_LOCK = threading.Lock()
_SERIALS = itertools.count()  # of the "object:" keys (next() on a count is atomic in CPython)
# An option value of a key for the CUDA options CHOICE_OPTIONS: what PyTorch would choose
# for its own convolutions when the op runs (calls.choice_now), not when torch.compile
# traced the call. A compiled graph then follows the switches as PyTorch's own compiled
# convolutions do, and the traced code reads none of them (reading torch.backends'
# fp32_precision settings is a graph break).
FOLLOW = "as PyTorch"
CHOICE_OPTIONS = ("allow_tf32", "autotune")
# key -> () for a key that follows nothing, else (float32, allow_tf32, autotune, {choice:
# key}) with None for an option that follows PyTorch.
_CHOICES: dict[str, tuple] = {}


def key_for(backend: str, spec: LayerSpec, device: torch.device, options: dict[str, Any]) -> str:
    """The ops' name for the functions of `backend` over `spec` on `device` with `options`:
    JSON that `functions` can make them from, or, for options that are no JSON value, a
    name of this process ("object:" and a serial number, new at each call) under which
    they must be registered (`register`)."""
    try:
        return json.dumps({"backend": backend, "spec": spec.to_dict(), "device": str(device), "options": options},
                          sort_keys=True)
    except TypeError:
        return f"object:{next(_SERIALS)}:{backend}:{device}"


def register(key: str, functions: Any) -> None:
    """Name `functions` (a backend's Functions for one spec) `key` for the ops."""
    with _LOCK:
        _FUNCTIONS[key] = functions


def register_choices(key: str, float32: bool, allow_tf32: Optional[bool], autotune: Optional[bool],
                     keys: dict[tuple[bool, bool], str]) -> None:
    """Name `key` (an "object:" key, whose options cannot be read back) the functions of
    `keys[choice]` for the choice `calls.choice_now(float32, allow_tf32, autotune)` makes
    at each call."""
    with _LOCK:
        _CHOICES[key] = (float32, allow_tf32, autotune, dict(keys))


def _choices(key: str) -> tuple:
    made = json.loads(key)
    options = made["options"]
    if not any(name in options for name in CHOICE_OPTIONS):
        return ()
    keys = {(tf32, autotune): json.dumps({**made, "options": {**options, "allow_tf32": tf32, "autotune": autotune}},
                                         sort_keys=True)
            for tf32 in (False, True) for autotune in (False, True)}
    # A key that gives both (the eager path's) names itself, or a key of the same functions.
    given = (None if options.get(name) == FOLLOW else bool(options.get(name, False)) for name in CHOICE_OPTIONS)
    return (made["spec"]["dtype"] == "float32", *given, keys)


def key_now(key: str) -> str:
    """`key`, or for a key whose options follow PyTorch (FOLLOW), the key of the choice
    `calls.choice_now` makes now."""
    choices = _CHOICES.get(key)
    if choices is None:
        choices = () if key.startswith("object:") else _choices(key)
        with _LOCK:
            _CHOICES[key] = choices
    if not choices:
        return key
    float32, allow_tf32, autotune, keys = choices
    return keys[choice_now(float32, allow_tf32, autotune)]


@torch.compiler.disable
def functions(key: str) -> Any:
    """The functions named `key` (for a key that follows PyTorch's switches, those of
    the choice made now: `key_now`), made from it on first use (outside torch.compile's
    tracing: the CUDA functions compile numba kernels)."""
    fn = _FUNCTIONS.get(key)
    if fn is not None:
        return fn
    now = key_now(key)
    if now != key:
        return functions(now)
    if key.startswith("object:"):
        raise RuntimeError(f"conv2d ops: no functions registered as {key!r}: a module whose backend_options are "
                           f"no JSON values (a stream object, a stand-in for cuDNN) runs only in the process "
                           f"that made it")
    made = json.loads(key)
    spec = LayerSpec.from_dict(made["spec"])
    if made["backend"] == "cuda":
        with torch.cuda.device(torch.device(made["device"])):
            fn = make_functions("cuda", spec, **made["options"])
    else:
        fn = make_functions(made["backend"], spec, **made["options"])
    with _LOCK:
        return _FUNCTIONS.setdefault(key, fn)



_LIB = torch.library.Library("conv2d", "DEF")
_LIB.define("forward(Tensor x, Tensor weight, Tensor? bias, Tensor? gamma, Tensor? beta, Tensor(a!)? running_mean, "
            "Tensor(b!)? running_var, bool training, bool nchw, str key) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define("backward(Tensor x, Tensor weight, Tensor? bias, Tensor? gamma, Tensor? beta, Tensor pre, Tensor mean, "
            "Tensor inv_std, Tensor d_y, bool batch_stats, bool want_input, bool want_params, bool nchw, str key) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _nhwc(t: Tensor, nchw: bool) -> Tensor:
    # A (N, C, H, W) tensor in channels_last memory viewed as (N, H, W, C): no copy. The
    # view is made here, inside the op, and not in the caller's graph: a view of x saved
    # for backward there is what reduce-overhead's CUDA graph trees report overwritten.
    return t.permute(0, 2, 3, 1).contiguous() if nchw else t.contiguous()


def _nchw(t: Tensor, nchw: bool) -> Tensor:
    return t.permute(0, 3, 1, 2) if nchw else t


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor], beta: Optional[Tensor],
            running_mean: Optional[Tensor], running_var: Optional[Tensor], training: bool, nchw: bool,
            key: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, pre-activations, mean, inv_std) of x (N, H, W, C), or of x (N, C, H, W) in
    channels_last memory when `nchw` (y then (N, OC, OH, OW) in channels_last memory; the
    pre-activations stay (N, OH, OW, OC)); mean and inv_std are empty without a norm.
    Batch norm in training updates running_mean and running_var in place; otherwise it
    normalises with them."""
    fn = functions(key)
    x, weight, bias, gamma, beta = detached(_nhwc(x, nchw), weight.permute(0, 2, 3, 1), bias, gamma, beta)
    running = None if running_mean is None else {"running_mean": running_mean, "running_var": running_var}
    params = param_dict(weight, bias, gamma, beta)
    if x.is_cuda:
        saved_out = saved_outputs(fn, x)
        with call_context(fn, x), keeping_nothing(fn, x):
            y, _ = fn.forward(params, x, training, running, saved_out=saved_out)
        stats = [saved_out["mean"], saved_out["inv_std"]]
        pre = saved_out["pre"]
    else:
        with call_context(fn, x):
            y, saved = fn.forward(params, x, training, running)
        stats = [torch.from_numpy(a.copy()) if a is not None else torch.empty(0, dtype=torch.float32)
                 for a in (saved.mean, saved.inv_std)]
        pre = to_library(saved.pre.copy(), "torch")
    # The CUDA functions keep y (a prepared launch's argument, or a captured plan's tensor,
    # the same object every step), and autograd sets its grad_fn on the tensor it is
    # given: hand out an alias that they do not hold.
    return _nchw(y.detach(), nchw), pre, stats[0], stats[1]


def _forward_fake(x, weight, bias, gamma, beta, running_mean, running_var, training, nchw, key):
    # Shapes by arithmetic on x's (possibly symbolic) sizes: no spec is made or hashed.
    spec = LayerSpec.from_dict(json.loads(key)["spec"]) if not key.startswith("object:") else functions(key).spec
    n, h, w = (x.shape[0], x.shape[2], x.shape[3]) if nchw else x.shape[:3]
    oh, ow = spec.output_size(h, w)
    norm = spec.normalization
    groups = spec.out_channels if norm is Normalization.BATCH_NORM else n if norm is Normalization.LAYER_NORM else 0
    if x.is_cuda and norm is Normalization.NONE:
        groups = 1
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    shape = (n, oh, ow, spec.out_channels)
    y = x.new_empty(shape)
    return (_nchw(y, nchw), x.new_empty(shape), x.new_empty((groups,), dtype=stats_dtype),
            x.new_empty((groups,), dtype=stats_dtype))


def backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor], beta: Optional[Tensor],
             pre: Tensor, mean: Tensor, inv_std: Tensor, d_y: Tensor, batch_stats: bool, want_input: bool,
             want_params: bool, nchw: bool, key: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_x, d_weight, d_bias, d_gamma, d_beta), fresh; empty where not wanted or absent.
    x, d_y and d_x in the forward's layout (`nchw`); d_weight (OC, KH, KW, IC)."""
    fn = functions(key)
    x, weight, bias, gamma, beta, d_y = detached(_nhwc(x, nchw), weight.permute(0, 2, 3, 1), bias, gamma, beta,
                                                 _nhwc(d_y, nchw))
    with call_context(fn, x), keeping_nothing(fn, x):
        saved = fn.saved(x, pre, mean, inv_std, batch_stats)
        grads, d_x = fn.backward(param_dict(weight, bias, gamma, beta), saved, d_y, want_params, want_input)
    grads = grads or {}

    def got(a):  # outputs may not alias each other: a new empty tensor for each absent one
        return a if a is not None else x.new_empty(0)
    return (got(None if d_x is None else _nchw(d_x, nchw)), got(grads.get("weights")), got(grads.get("bias")), got(grads.get("gamma")),
            got(grads.get("beta")))


def _backward_fake(x, weight, bias, gamma, beta, pre, mean, inv_std, d_y, batch_stats, want_input, want_params, nchw,
                   key):
    def like(t, wanted):
        return t.new_empty(t.shape) if wanted and t is not None else x.new_empty(0)
    d_x = _nchw(x.new_empty((x.shape[0], x.shape[2], x.shape[3], x.shape[1]) if nchw else x.shape), nchw) \
        if want_input else x.new_empty(0)
    d_weight = weight.new_empty((weight.shape[0], weight.shape[2], weight.shape[3], weight.shape[1])) \
        if want_params else x.new_empty(0)  # (OC, KH, KW, IC)
    return (d_x, d_weight, like(bias, want_params), like(gamma, want_params),
            like(beta, want_params))


for _name, _impl, _fake in (("forward", forward, _forward_fake), ("backward", backward, _backward_fake)):
    for _key in ("CPU", "CUDA"):
        _LIB.impl(_name, _impl, _key)
    torch.library.register_fake(f"conv2d::{_name}", _fake, lib=_LIB)


class Conv2dFunction(torch.autograd.Function):
    """y (N, OH, OW, OC) of x (N, H, W, C) with autograd, or y (N, OC, OH, OW) of x
    (N, C, H, W), both in channels_last memory, when `nchw`: `conv2d::forward`, and
    `conv2d::backward` for the gradients of x and of the four parameters. `batch_stats`:
    whether the norm normalises with the batch's statistics (the caller knows its spec;
    the key is not looked up here, which torch.compile would have to trace)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor],
                beta: Optional[Tensor], running_mean: Optional[Tensor], running_var: Optional[Tensor],
                training: bool, batch_stats: bool, nchw: bool, key: str) -> Tensor:
        y, pre, mean, inv_std = torch.ops.conv2d.forward(x, weight, bias, gamma, beta, running_mean, running_var,
                                                         training, nchw, key)
        ctx.save_for_backward(x, weight, bias, gamma, beta, pre, mean, inv_std)
        ctx.batch_stats, ctx.nchw, ctx.key = batch_stats, nchw, key
        return y

    @staticmethod
    @first_order_only
    def backward(ctx: Any, d_y: Tensor) -> tuple:
        x, weight, bias, gamma, beta, pre, mean, inv_std = ctx.saved_tensors
        want_input = ctx.needs_input_grad[0]
        want_params = any(ctx.needs_input_grad[1:5])
        # Autograd may hand d_y in another memory format; the backends read NHWC memory.
        d_y = d_y.contiguous(memory_format=torch.channels_last) if ctx.nchw else d_y.contiguous()
        d_x, d_w, d_b, d_g, d_be = torch.ops.conv2d.backward(x, weight, bias, gamma, beta, pre, mean, inv_std,
                                                             d_y, ctx.batch_stats, want_input, want_params,
                                                             ctx.nchw, ctx.key)
        return (d_x if want_input else None, d_w.permute(0, 3, 1, 2) if want_params else None,
                d_b if want_params and bias is not None else None,
                d_g if want_params and gamma is not None else None,
                d_be if want_params and beta is not None else None, None, None, None, None, None, None)
