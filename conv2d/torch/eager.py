"""The module's eager path (`run`): one `torch.autograd.Function` straight over a backend's
`Functions`, or, for a call that wants no gradient (under `torch.no_grad`, or nothing
requiring one: acting, a target network), no autograd node: on the GPU in eval (or
without batch norm) the backend's `evaluate` into one new tensor (`evaluate_call`), else
its forward alone (`forward_call`), the same launches as the autograd node's. The call
graphs (conv2d.torch.graphs) wrap each route's backend call, never a route of their own.

`conv2d.torch.ops` is what `torch.compile` sees: two opaque operators that take and
return tensors only, with a permute node in the graph for x and for the weight and fresh
dicts of detached parameters every call (so the backend's per-dict view cache never
hits). `EagerConv2d` reads the module's parameters through one cached dict of detached
NHWC views (`ParameterViews`), and permutes x, the weight and their gradients itself.
Python on autograd's device thread costs more than on the calling thread (about twice,
in a one-off probe since removed: git before commit 233f8cb), so the
backward does little besides the backend's call. With the module's `cuda_graphs`, the
node allocates the call's outputs and saved values itself and hands the backend call to
`Call.graphs` (conv2d.torch.graphs), which replays a captured graph of it when every
address repeats.

Saved values: x, the weight, gamma, beta and the forward's pre-activations and
statistics all go through `save_for_backward`, nothing is kept on ctx. So a backward
after one of the inputs was changed in place raises, as PyTorch's own layers do;
autograd frees the activations after the backward (unless retain_graph), so a graph
still referenced (a loss kept for logging) holds none; and saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`: offloading, checkpointing) see them all.
The backward rebuilds the backend's `Saved` from them (`Functions.saved`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from conv2d.arrays import host_view, to_library
from conv2d.torch.graphs import CallGraphs
from conv2d.torch.calls import detached, first_order_only, call_context, param_dict, saved_outputs


class Call(NamedTuple):
    """What one module call passes through autograd besides the tensors: the backend's
    functions, the cached views of the parameters and running statistics (dicts, the same
    objects while the tensors are), training, whether x is NCHW-shaped (channels_last
    memory) rather than NHWC, whether the norm uses the batch's statistics, and for CUDA
    graph replays the functions' `CallGraphs` (None: always launch) with the addresses of
    the parameters and running statistics (part of every call's key), whether a call
    without a gradient runs the backend's `evaluate` (`run`), and, for a host backend that
    prepares its evaluates, the cached views that hold them."""

    fn: Any
    params: dict
    running: Optional[dict]
    training: bool
    nchw: bool
    batch_stats: bool = False
    graphs: Optional[CallGraphs] = None
    ptrs: tuple = ()
    evaluates: bool = False  # without a gradient, the backend's evaluate (no statistics to update)
    views: Optional["ParameterViews"] = None  # whose prepared evaluates a host call runs (conv2d.backend.Preparing)


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
        self._ids: tuple = ()
        self._dicts: tuple[dict, Optional[dict]] = ({}, None)
        self._prepared: dict = {}  # (functions, x's shape) -> the functions' prepared evaluate over _dicts

    def get(self, weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor], beta: Optional[Tensor],
            running_mean: Optional[Tensor], running_var: Optional[Tensor]) -> tuple[dict, Optional[dict], tuple]:
        """(params, running, the tensors' addresses)."""
        tensors = (weight, bias, gamma, beta, running_mean, running_var)
        ptrs = tuple([0 if t is None else t.data_ptr() for t in tensors])
        if ptrs != self._ptrs or tuple(map(id, tensors)) != self._ids:
            self._tensors, self._ptrs, self._dicts = tensors, ptrs, parameter_dicts(*tensors)
            self._ids = tuple(map(id, tensors))  # the objects are kept (self._tensors): their ids stay theirs
            self._prepared = {}
        return (*self._dicts, ptrs)

    def evaluate(self, fn: Any, x: Tensor) -> Tensor:
        """fn.evaluate(params, x, running) over the views, for a host x (N, H, W, C)
        (contiguous, the parameters' dtype): the backend's prepared evaluate
        (conv2d.backend.Preparing) for x's shape, made on the first call of each shape
        and kept while the views are these (the module's own dicts, which nothing else
        changes), so a call checks nothing again."""
        a, _ = host_view("x", x)
        return to_library(self.prepared(fn, a.shape)(a), "torch")

    def prepared(self, fn: Any, x_shape: tuple) -> Any:
        """fn's prepared evaluate over the views for inputs of shape `x_shape`."""
        key = (fn, x_shape)
        found = self._prepared.get(key)
        if found is None:
            if len(self._prepared) >= 16:  # shapes of another kind every call: keep a few
                self._prepared.clear()
            found = self._prepared[key] = fn.prepare_evaluate(*self._dicts, x_shape)
        return found


def _ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


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
        y, pre, mean, inv_std = forward_call(x, call)
        ctx.call = call
        # Every saved value goes through save_for_backward, none on ctx: autograd frees
        # them after the backward (unless retain_graph), as it does nn.BatchNorm2d's, so a
        # graph kept alive (a loss held for logging) holds no activations, and the next
        # step gets the same blocks from torch's allocator (the graph keys repeat).
        ctx.save_for_backward(x, weight, gamma, beta, pre, mean, inv_std)
        return y

    @staticmethod
    @first_order_only  # a double backward raises, never returns gradients without a graph
    def backward(ctx: Any, d_y: Tensor) -> tuple:
        # Raises if x or a parameter was changed in place after the forward, or if the
        # graph was freed by an earlier backward.
        x, weight, _, _, pre, mean, inv_std = ctx.saved_tensors
        call, needs = ctx.call, ctx.needs_input_grad
        want_input, want_params = needs[0], any(needs[1:5])
        # Autograd may hand d_y in another layout; the backends read C-contiguous (NHWC).
        if not d_y.is_contiguous():
            d_y = d_y.contiguous()
        d_y = d_y.detach()
        x = _nhwc(x, call.nchw)
        if call.graphs is not None:
            grads, d_x = _graph_backward(call, (x, pre, mean, inv_std), d_y, want_params, want_input)
        else:
            saved = call.fn.saved(x, pre, mean, inv_std, call.batch_stats)
            with call_context(call.fn, d_y):
                grads, d_x = call.fn.backward(call.params, saved, d_y, want_params, want_input)
        if d_x is not None and call.nchw:
            d_x = d_x.permute(0, 3, 1, 2)  # (N, C, H, W) in channels_last memory, as x
        if not grads:  # parameters not wanted
            return d_x, None, None, None, None, None, None, None
        d_w = grads["weights"].permute(0, 3, 1, 2)
        if d_w.stride() != weight.stride():
            # They differ only in the strides of size-1 dimensions (one input channel, a
            # 1x1 kernel), which torch's channels_last leaves free: the parameter's own, as
            # DDP's gradient buckets expect (no copy: the same memory order).
            d_w = d_w.as_strided(weight.size(), weight.stride())
        return d_x, d_w, grads.get("bias"), grads.get("gamma"), grads.get("beta"), None, None, None


def run(x: Tensor, params: tuple, running_mean: Optional[Tensor], running_var: Optional[Tensor],
        call: Call) -> Tensor:
    """The module's eager road, one route a kind of call: with a gradient wanted, the
    autograd node (`EagerConv2d`); without one (`torch.no_grad`, or nothing requires
    one: acting, a target network), no node: the backend's evaluate into one new tensor
    where `call.evaluates` (`evaluate_call`), else its forward alone (`forward_call`, the
    node's launches). Either route replays its call graph where `call.graphs` has one
    for the call's addresses. y (N, OH, OW, OC)."""
    weight, bias, gamma, beta = params
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params)):
        return EagerConv2d.apply(x, weight, bias, gamma, beta, running_mean, running_var, call)
    if call.evaluates:
        return evaluate_call(x, call)
    return forward_call(x, call)[0]


def forward_call(x: Tensor, call: Call) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(y, pre, mean, inv_std) of the backend's forward of x through `call` (see
    EagerConv2d): what the autograd node saves, and what a call that builds no graph
    (no gradient wanted: `torch.no_grad`, or nothing requires one) runs alone, with the
    same launches and so the same bits."""
    fn, graphs = call.fn, call.graphs
    x_nhwc = _nhwc(x, call.nchw)
    if not x.is_cuda:
        with call_context(fn, x):
            y, saved = fn.forward(call.params, x_nhwc, call.training, call.running)
        # The reference's saved arrays are its own (new each call): tensors over them,
        # no copy, so that autograd keeps and frees them as it does its own.
        pre, mean, inv_std = (None if a is None else to_library(a, "torch")
                              for a in (saved.pre, saved.mean, saved.inv_std))
    else:
        # The saved values in tensors from torch's allocator (not the backend's own
        # recycled buffers): captured in torch.cuda.graph, they land in the graph's pool.
        out = saved_outputs(fn, x_nhwc, placeholders=False)
        pre, mean, inv_std = out["pre"], out["mean"], out["inv_std"]
        if graphs is None:
            with call_context(fn, x):
                y, _ = fn.forward(call.params, x_nhwc, call.training, call.running, saved_out=out)
        else:
            y = torch.empty(pre.shape, dtype=x.dtype, device=x.device)
            key = (True, call.training, x_nhwc.shape, x.data_ptr(), y.data_ptr(), pre.data_ptr(),
                   _ptr(mean), _ptr(inv_std), call.ptrs)
            graphs.run(key, lambda: fn.forward(call.params, x_nhwc, call.training, call.running, saved_out=out,
                                               y_out=y)[1].resources, x)
    # The CUDA functions keep y (a prepared launch's argument), and autograd sets its
    # grad_fn on the tensor it is given: hand out an alias that they do not hold.
    return y.detach(), pre, mean, inv_std


def evaluate_call(x: Tensor, call: Call) -> Tensor:
    """y of the backend's `evaluate` of x through `call`: for a call that wants no
    gradient and updates no statistics (eval, or no batch norm), the forward without its
    saved values. One output tensor, where forward_call allocates y, pre, mean and
    inv_std: on CUDA the pre-activations and statistics go to the shape plan's own
    scratch, on the host they are dropped, and nothing is kept. With the backend's default evaluate_kernel ("cudnn")
    it runs the forward's kernels (its ReLU fused into the convolution where the layer
    has no norm, as cuDNN's forward_relu graph); "direct" runs the direct kernel."""
    fn, graphs = call.fn, call.graphs
    x_nhwc = _nhwc(x, call.nchw)
    if graphs is None:
        with call_context(fn, x):
            if call.views is not None:
                y = call.views.evaluate(fn, x_nhwc)
            else:
                y = fn.evaluate(call.params, x_nhwc, call.running)
    else:
        y = torch.empty(fn.spec.at(*x_nhwc.shape[:3]).output_shape, dtype=x.dtype, device=x.device)

        def run() -> Any:
            fn.evaluate(call.params, x_nhwc, call.running, y_out=y)
            return fn.resources(x_nhwc.shape)
        graphs.run(("evaluate", x_nhwc.shape, x.data_ptr(), y.data_ptr(), call.ptrs), run, x)
    return y.detach()


def _graph_backward(call: Call, kept: tuple, d_y: Tensor, want_params: bool, want_input: bool) -> tuple:
    """The backend's backward of a forward that went through `call.graphs` (its saved
    values are tensors in `kept`: x (N, H, W, C), pre, mean, inv_std), into gradients
    allocated here, as one graph replay when every address repeats."""
    fn, graphs = call.fn, call.graphs
    x, pre, mean, inv_std = kept
    d_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_input else None
    grads = graphs.new_gradients(x) if want_params else None
    key = (False, call.batch_stats, x.shape, x.data_ptr(), pre.data_ptr(), _ptr(mean), _ptr(inv_std),
           d_y.data_ptr(), _ptr(d_x),
           () if grads is None else tuple(g.data_ptr() for g in grads.values()), call.ptrs)

    def run() -> Any:
        saved = fn.saved(x, pre, mean, inv_std, call.batch_stats)
        fn.backward(call.params, saved, d_y, want_params, want_input, grads_out=grads, d_x_out=d_x)
        return saved.resources
    if torch.cuda.is_current_stream_capturing():
        # A capture of the caller's that began after the forward: the launches go into it.
        with fn.deferred_frees():
            run()
    else:
        graphs.run(key, run, d_y)
    return grads, d_x


def count_batch(y: torch.Tensor, norm: Optional[torch.nn.Module], running_mean: Optional[torch.Tensor], training: bool,
                cumulative: Optional[tuple] = None) -> torch.Tensor:
    """y, after counting a training batch (after the call: a refused input counts no
    batch) and, with momentum=None, moving the running statistics `cumulative` to
    the batch's by 1/(batches counted), as nn.BatchNorm2d does."""
    if running_mean is not None and training:
        tracked = norm.num_batches_tracked
        tracked.add_(1)
        if cumulative is not None:
            batch = norm.batch_buffers()
            with torch.no_grad():
                for running, new in zip(cumulative, batch):
                    # 1/count in the statistics' dtype (an int64 tensor's reciprocal is
                    # float32: 1e-8 off in a float64 module), as nn.BatchNorm2d's
                    # exponential_average_factor = 1.0 / float(num_batches_tracked)
                    running.lerp_(new, 1.0 / tracked.to(running.dtype))
    return y
