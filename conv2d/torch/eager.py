"""The module's eager path: one `torch.autograd.Function` straight over a backend's
`Functions`, with the functional `Saved` kept in autograd's context.

`conv2d.torch.ops` is what `torch.compile` sees: two opaque operators that take and
return tensors only, so the forward hands its saved values out as tensors and the
backward rebuilds a `Saved` from them. In eager mode nothing needs them to be tensors,
and every step through the operators paid for it: three saved tensors allocated and
viewed, eight tensors saved and unpacked, the `Saved` rebuilt from its input on
autograd's thread, fresh dicts of detached parameters (so the backend's per-dict view
cache never hit), and a permute node in the graph for x and for the weight.
`EagerConv2d` keeps the `Saved` itself, reads the module's parameters through one cached
dict of detached NHWC views (`ParameterViews`), and permutes x, the weight and their
gradients itself. The work left on autograd's device thread is the backend's backward
and little else: Python there costs more than on the calling thread (on the H200's
virtual machine the backend's backward took 125 us of host time on the calling thread
and about 240 on autograd's: scripts/probe_module.py, tiny_latency bn float32).
A weight in another memory format is read through its channels_last copy (one
differentiable copy a call).

Versions: x, the weight, gamma and beta are still saved with `save_for_backward`, so a
backward after one of them was changed in place raises, as PyTorch's own layers do.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from conv2d.torch.ops import _detached as detached, _params as param_dict, saved_outputs


class Call(NamedTuple):
    """What one module call passes through autograd besides the tensors: the backend's
    functions, the cached views of the parameters and running statistics (dicts, the same
    objects while the tensors are), training, and whether x is NCHW-shaped (channels_last
    memory) rather than NHWC."""

    fn: Any
    params: dict
    running: Optional[dict]
    training: bool
    nchw: bool


def parameter_dicts(weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor], beta: Optional[Tensor],
                    running_mean: Optional[Tensor], running_var: Optional[Tensor]) -> tuple[dict, Optional[dict]]:
    """(params, running) for the backend's functions: detached views of the tensors, the
    weight (OC, IC, KH, KW) in channels_last memory as (OC, KH, KW, IC); running is None
    without batch norm's statistics."""
    params = param_dict(weight.detach().permute(0, 2, 3, 1), *detached(bias, gamma, beta))
    running = None if running_mean is None else {"running_mean": running_mean.detach(),
                                                 "running_var": running_var.detach()}
    return params, running


class ParameterViews:
    """A module's `parameter_dicts`, made again only when one of the tensors is replaced
    (another object, or another address: `module.to`, `param.data = ...`). The same dict
    objects call after call let the backend check and view them once
    (`Functions._arrays`); detached, they hold no autograd history."""

    def __init__(self) -> None:
        self._tensors: tuple = ()
        self._ptrs: tuple = ()
        self._dicts: tuple[dict, Optional[dict]] = ({}, None)

    def get(self, weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor], beta: Optional[Tensor],
            running_mean: Optional[Tensor], running_var: Optional[Tensor]) -> tuple[dict, Optional[dict]]:
        tensors = (weight, bias, gamma, beta, running_mean, running_var)
        ptrs = tuple(0 if t is None else t.data_ptr() for t in tensors)
        if ptrs != self._ptrs or not all(a is b for a, b in zip(tensors, self._tensors)):
            self._tensors, self._ptrs, self._dicts = tensors, ptrs, parameter_dicts(*tensors)
        return self._dicts


def _nhwc(t: Tensor, nchw: bool) -> Tensor:
    return t.detach().permute(0, 2, 3, 1) if nchw else t.detach()


class EagerConv2d(torch.autograd.Function):
    """y (N, OH, OW, OC), contiguous, of x: (N, C, H, W) in channels_last memory when
    `call.nchw`, else (N, H, W, C) contiguous; weight (OC, IC, KH, KW) in channels_last
    memory. Gradients: x's and the weight's in their layouts, bias, gamma, beta."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor],
                beta: Optional[Tensor], running_mean: Optional[Tensor], running_var: Optional[Tensor],
                call: Call) -> Tensor:
        # running_mean and running_var come in as arguments so that autograd sees them
        # (nothing differentiates them); the backend reads and updates them through call.
        fn = call.fn
        x_nhwc = _nhwc(x, call.nchw)
        if x.is_cuda:
            # The saved values in tensors from torch's allocator (not the backend's own
            # recycled buffers): captured in torch.cuda.graph, they land in the graph's pool.
            y, saved = fn.forward(call.params, x_nhwc, call.training, call.running,
                                  saved_out=saved_outputs(fn, x_nhwc))
        else:
            y, saved = fn.forward(call.params, x_nhwc, call.training, call.running)
        ctx.saved, ctx.call = saved, call
        ctx.save_for_backward(x, weight, gamma, beta)
        # The CUDA functions keep y (a prepared launch's argument), and autograd sets its
        # grad_fn on the tensor it is given: hand out an alias that they do not hold.
        return y.detach()

    @staticmethod
    @once_differentiable  # its gradients have no graph: a double backward raises, not returns zeros
    def backward(ctx: Any, d_y: Tensor) -> tuple:
        ctx.saved_tensors  # raises if x or a parameter was changed in place after the forward
        call, needs = ctx.call, ctx.needs_input_grad
        want_input, want_params = needs[0], any(needs[1:5])
        # Autograd may hand d_y in another layout; the backends read C-contiguous (NHWC).
        if not d_y.is_contiguous():
            d_y = d_y.contiguous()
        grads, d_x = call.fn.backward(call.params, ctx.saved, d_y.detach(), want_params, want_input)
        if d_x is not None and call.nchw:
            d_x = d_x.permute(0, 3, 1, 2)  # (N, C, H, W) in channels_last memory, as x
        if not grads:  # parameters not wanted
            return d_x, None, None, None, None, None, None, None
        return (d_x, grads["weights"].permute(0, 3, 1, 2), grads.get("bias"), grads.get("gamma"), grads.get("beta"),
                None, None, None)
