"""`Conv2dRun`: consecutive `Conv2dNormActivation` layers called as one.

A run is an `nn.Sequential` of the layers (its `state_dict` is that Sequential's: "0.0.weight",
"0.1.running_mean", "1.0.weight", ...) whose eager call is one autograd node for the whole
run (`EagerRun`), not one a layer: the layers' backend functions run one after another,
each on the previous one's NHWC output, and the backward runs them in reverse, handing
each layer's input gradient to the layer before. On a GPU with the layers' `cuda_graphs`
on, the run's whole forward is one CUDA graph replay (and its backward another, and a
call without gradients a third) when every address repeats, keyed as a layer's call is
(conv2d.torch.graphs) by the addresses of every layer's tensors. Each layer runs the
same backend calls as it does alone, so a run's outputs, gradients and running
statistics are bitwise those of calling its layers in turn.

What a run cannot do in one node it does layer by layer, as `nn.Sequential` would: under
torch.compile, torch.jit, torch.autocast, for tensor subclasses, an empty batch,
`momentum=None`, or a layer with forward hooks; the results are the same.

On the host, a lone layer's call without gradients runs as a run of one (`act_alone`), so
that acting again through it is a kept call too.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn

from conv2d.arrays import host_view, to_library
from conv2d.checks import describe
from conv2d.spec import Normalization
from conv2d.torch import eager
from conv2d.torch.calls import call_context, first_order_only, refuse_function_transforms, saved_outputs
from conv2d.torch.graphs import CallGraphs
from conv2d.torch.module import _PLAIN, Conv2dNormActivation, _height_width, _member

_EACH = 6  # tensors a layer passes through the node: weight, bias, gamma, beta, running_mean, running_var


class _Together:
    """Several layers' CUDA functions as the one `fn` a run's CallGraphs follows, releases
    and defers frees through; a call's resources are a tuple, one entry a layer."""

    def __init__(self, fns: tuple) -> None:
        self.fns = fns

    def follow(self, a: Any) -> None:
        for fn in self.fns:
            fn.follow(a)

    def release(self, resources: tuple) -> None:
        for fn, r in zip(self.fns, resources):
            if r is not None:
                fn.release(r)

    def deferred_frees(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for fn in self.fns:
            stack.enter_context(fn.deferred_frees())
        return stack


class RunCall(NamedTuple):
    """A run's call: each layer's `eager.Call` (launching: graphs None; the first layer's
    `nchw` the run's, the others' False, they read the NHWC output before them), the
    run's CallGraphs (None: always launch), each layer's own CallGraphs (for its gradient
    layout) and the addresses of every layer's parameters and running statistics."""

    calls: tuple
    graphs: Optional[CallGraphs]
    layer_graphs: tuple
    ptrs: tuple


def _ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _out_ptrs(out: dict) -> tuple:
    return tuple(_ptr(out[k]) for k in ("pre", "mean", "inv_std"))


def _forward_graphed(x: Tensor, run: RunCall) -> list[tuple]:
    """Each layer's (y, pre, mean, inv_std) of a training-kind forward of x (N, H, W, C)
    through the run, allocated here and written by one graph replay (or its launches)."""
    outs, ys, h = [], [], x
    for call in run.calls:
        out = saved_outputs(call.fn, h, placeholders=False)
        y = torch.empty(out["pre"].shape, dtype=h.dtype, device=h.device)
        outs.append(out)
        ys.append(y)
        h = y
    key = ("forward", tuple(c.training for c in run.calls), x.shape, x.data_ptr(),
           tuple((y.data_ptr(), *_out_ptrs(o)) for y, o in zip(ys, outs)), run.ptrs)

    def launch() -> tuple:
        resources, h = [], x
        for call, out, y in zip(run.calls, outs, ys):
            _, saved = call.fn.forward(call.params, h, call.training, call.running, saved_out=out, y_out=y)
            resources.append(saved.resources)
            h = y
        return tuple(resources)
    run.graphs.run(key, launch, x)
    return [(y.detach(), o["pre"], o["mean"], o["inv_std"]) for y, o in zip(ys, outs)]


def _forward_launched(x: Tensor, run: RunCall) -> list[tuple]:
    """As `_forward_graphed`, each layer launched (or computed on the host) in turn."""
    kept, h = [], x
    for call in run.calls:
        y, pre, mean, inv_std = eager.forward_call(h, call)
        kept.append((y, pre, mean, inv_std))
        h = y  # (N, OH, OW, OC): the next layer's input, NHWC
    return kept


def _first_input(x: Tensor, call: Any) -> Tensor:
    return x.detach().permute(0, 2, 3, 1) if call.nchw else x.detach()


def _evaluate(x: Tensor, run: RunCall) -> Tensor:
    """y (N, OH, OW, OC) of a call without gradients: each layer's evaluate (or, where it
    updates batch statistics, its forward), in one graph replay when the run has graphs."""
    if run.graphs is None:
        if all(call.views is not None and call.evaluates for call in run.calls):
            return _evaluate_prepared(x, run)[0]
        h = x
        for call in run.calls:
            h = eager.evaluate_call(h, call) if call.evaluates else eager.forward_call(h, call)[0]
        return h
    h0 = _first_input(x, run.calls[0])
    ys, outs, h = [], [], h0
    for call in run.calls:
        out = None if call.evaluates else saved_outputs(call.fn, h, placeholders=False)
        shape = call.fn.spec.at(*h.shape[:3]).output_shape
        y = torch.empty(shape, dtype=h.dtype, device=h.device)
        ys.append(y)
        outs.append(out)
        h = y
    key = ("evaluate", tuple(c.training for c in run.calls), h0.shape, x.data_ptr(),
           tuple((y.data_ptr(), *(_out_ptrs(o) if o else ())) for y, o in zip(ys, outs)), run.ptrs)

    def launch() -> tuple:
        resources, h = [], h0
        for call, out, y in zip(run.calls, outs, ys):
            if out is None:
                call.fn.evaluate(call.params, h, call.running, y_out=y)
                resources.append(call.fn.resources(h.shape))
            else:
                _, saved = call.fn.forward(call.params, h, call.training, call.running, saved_out=out, y_out=y)
                resources.append(saved.resources)
            h = y
        return tuple(resources)
    run.graphs.run(key, launch, x)
    return ys[-1].detach()


def _evaluate_prepared(x: Tensor, run: RunCall) -> tuple[Tensor, tuple]:
    """(y (N, OH, OW, OC), the prepared evaluates) of a call without gradients on a host
    backend that prepares its evaluates (conv2d.backend.Preparing): each layer's prepared
    evaluate (conv2d.torch.eager.ParameterViews.prepared) on the NumPy output before it,
    one view of x in and one tensor out, no checks between the layers (their shapes follow
    from the first's)."""
    h = _first_input(x, run.calls[0])
    prepared = []
    with call_context(run.calls[0].fn, h):
        a, _ = host_view("x", h)
        for call in run.calls:
            prepared.append(call.views.prepared(call.fn, a.shape))
            a = prepared[-1](a)
    return to_library(a, "torch"), tuple(prepared)


class _Acting(NamedTuple):
    """A run's call without gradients, kept to be called again (`Conv2dRun._stamp`): the
    stamp of what it rests on, the tensors the stamp names by id (kept, so that the ids
    stay theirs), the RunCall, the host's prepared evaluates (None: the RunCall's
    `_evaluate`, a CUDA graph replay) and whether the layers are NCHW."""

    stamp: tuple
    tensors: tuple
    run: RunCall
    prepared: Optional[tuple]
    nchw: bool


def _act(x: Tensor, acting: _Acting) -> Tensor:
    """y of x through a kept call, in the layers' layout ((N, OC, OH, OW) channels_last,
    or NHWC): the prepared evaluates on the host, the run's `_evaluate` on a GPU."""
    if acting.nchw:  # x in the layout the first call made of it (a copy where it came in another)
        if not x.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
    else:
        x = x.contiguous()
    if acting.prepared is None:
        y = _evaluate(x, acting.run)
        return y.permute(0, 3, 1, 2) if acting.nchw else y
    # NumPy swaps the axes, in and out: a third of torch's detach and permute (~3 us a call).
    a, _ = host_view("x", x)
    a = a.transpose(0, 2, 3, 1) if acting.nchw else a
    for evaluate in acting.prepared:
        a = evaluate(a)
    return to_library(a.transpose(0, 3, 1, 2) if acting.nchw else a, "torch")


class EagerRun(torch.autograd.Function):
    """y (N, OH, OW, OC) of the run's last layer, contiguous, of x ((N, C, H, W) in
    channels_last memory when the first call's `nchw`, else (N, H, W, C) contiguous);
    `tensors`: each layer's weight, bias, gamma, beta, running_mean, running_var. The
    gradients: x's in its layout, each layer's weight (OC, IC, KH, KW), bias, gamma and
    beta."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: RunCall, *tensors: Optional[Tensor]) -> Tensor:
        if run.graphs is not None:
            kept = _forward_graphed(_first_input(x, run.calls[0]), run)
        else:
            kept = _forward_launched(x, run)
        ctx.run = run
        ctx.layers = len(kept)
        saved: list = [x]
        for j, (y, pre, mean, inv_std) in enumerate(kept):
            weight, _, gamma, beta = tensors[_EACH * j:_EACH * j + 4]
            # A layer's input is the output before it: saved, as each layer alone saves its x.
            saved += [weight, gamma, beta, pre, mean, inv_std, y if j + 1 < len(kept) else None]
        ctx.save_for_backward(*saved)
        return kept[-1][0]

    @staticmethod
    @first_order_only
    def backward(ctx: Any, d_y: Tensor) -> tuple:
        run, needs = ctx.run, ctx.needs_input_grad
        tensors = ctx.saved_tensors
        x, rest = tensors[0], tensors[1:]
        layers = [rest[7 * j:7 * j + 7] for j in range(ctx.layers)]
        inputs = [_first_input(x, run.calls[0])] + [layer[6] for layer in layers[:-1]]
        wants = [any(needs[2 + _EACH * j:2 + _EACH * j + 4]) for j in range(ctx.layers)]
        d_y = (d_y if d_y.is_contiguous() else d_y.contiguous()).detach()
        if run.graphs is not None:
            grads, d_x = _backward_graphed(run, layers, inputs, d_y, wants, needs[0])
        else:
            grads, d_x = [None] * ctx.layers, d_y
            for j in reversed(range(ctx.layers)):
                call, (_, _, _, pre, mean, inv_std, _) = run.calls[j], layers[j]
                saved = call.fn.saved(inputs[j], pre, mean, inv_std, call.batch_stats)
                with call_context(call.fn, d_x):
                    grads[j], d_x = call.fn.backward(call.params, saved, d_x, wants[j], j > 0 or needs[0])
        if d_x is not None and run.calls[0].nchw:
            d_x = d_x.permute(0, 3, 1, 2)
        out: list = [d_x, None]
        for j, g in enumerate(grads):
            if not g:
                out += [None] * _EACH
                continue
            weight = layers[j][0]
            d_w = g["weights"].permute(0, 3, 1, 2)
            if d_w.stride() != weight.stride():  # as EagerConv2d: the parameter's own strides
                d_w = d_w.as_strided(weight.size(), weight.stride())
            out += [d_w, g.get("bias"), g.get("gamma"), g.get("beta"), None, None]
        return tuple(out)


def _backward_graphed(run: RunCall, layers: list, inputs: list, d_y: Tensor, wants: list,
                      want_input: bool) -> tuple[list, Optional[Tensor]]:
    """Every layer's gradients, last to first, into tensors allocated here, as one graph
    replay when every address repeats."""
    d_xs = [torch.empty(h.shape, dtype=h.dtype, device=h.device) if j > 0 or want_input else None
            for j, h in enumerate(inputs)]
    grads = [g.new_gradients(h) if w else None for g, h, w in zip(run.layer_graphs, inputs, wants)]
    key = ("backward", tuple(c.batch_stats for c in run.calls), inputs[0].shape, d_y.data_ptr(),
           tuple(h.data_ptr() for h in inputs),
           tuple(_ptr(t) for layer in layers for t in layer[3:6]),
           tuple(_ptr(d) for d in d_xs),
           tuple(() if g is None else tuple(t.data_ptr() for t in g.values()) for g in grads), run.ptrs)

    def launch() -> tuple:
        resources, d = [None] * len(layers), d_y
        for j in reversed(range(len(layers))):
            call, (_, _, _, pre, mean, inv_std, _) = run.calls[j], layers[j]
            saved = call.fn.saved(inputs[j], pre, mean, inv_std, call.batch_stats)
            call.fn.backward(call.params, saved, d, wants[j], d_xs[j] is not None, grads_out=grads[j],
                             d_x_out=d_xs[j])
            resources[j] = saved.resources
            d = d_xs[j]
        return tuple(resources)
    if torch.cuda.is_current_stream_capturing():
        with run.graphs.fn.deferred_frees():
            launch()
    else:
        run.graphs.run(key, launch, d_y)
    return grads, d_xs[0]


def act_alone(layer: Conv2dNormActivation, x: Any) -> Optional[Tensor]:
    """A lone layer's call without gradients on the host, as a run of the layer alone (a
    Conv2dRun the layer holds outside its modules, so its state_dict and `modules()` are
    unchanged): acting again while the run's stamp holds is the run's kept call (the
    prepared evaluates), not the layer's set-up anew (on the CPU about 15 us a call, a
    small layer's whole time). None where a run cannot take the call
    (`Conv2dRun._one_node`: autocast, hooks, an empty batch, ...): the layer runs it. Not
    on a GPU: there the layer's own call graphs replay already, and a run of one measured
    no faster (IMPALA's acting, whose lone layers are three, at 1.30 of PyTorch's time
    either way), while its graphs were a second set beside the layer's."""
    run = layer.__dict__.get("_alone")
    if run is None:
        run = layer.__dict__["_alone"] = Conv2dRun(layer)  # not setattr: no child module
    y = run._act_again(x)[1]
    if y is not None:
        return y
    if not run._one_node(x, [layer]):
        return None
    return run.forward(x)


class Conv2dRun(nn.Sequential):
    """Consecutive `Conv2dNormActivation` layers (each reading the one before's output)
    called as one (see the module docstring). `layers`: at least one, all of one layout,
    each layer's in_channels the out_channels before it. x and y as the layers': (N, C, H,
    W) in, (N, OC, OH, OW) channels_last out (or NHWC for layout "NHWC"). The state_dict,
    train/eval, `.to()` and indexing are nn.Sequential's."""

    def __init__(self, *layers: Conv2dNormActivation) -> None:
        if not layers:
            raise ValueError("layers: expected at least one Conv2dNormActivation, got none")
        for j, layer in enumerate(layers):
            if not isinstance(layer, Conv2dNormActivation):
                raise TypeError(f"layers[{j}]: expected a Conv2dNormActivation, got {type(layer).__name__}")
            if layer.layout != layers[0].layout:
                raise ValueError(f"layers[{j}]: expected layout {layers[0].layout!r} (layers[0]'s), got "
                                 f"{layer.layout!r}")
            if j and layer._spec.in_channels != layers[j - 1]._spec.out_channels:
                raise ValueError(f"layers[{j}]: expected {layers[j - 1]._spec.out_channels} input channels "
                                 f"(layers[{j - 1}]'s output), got {layer._spec.in_channels}")
        super().__init__(*layers)
        self._graphs: dict[tuple, tuple] = {}  # the layers' functions' ids -> (functions, CallGraphs)
        self._sizes: set[tuple[int, int]] = set()  # input (H, W) whose every layer's input fits its kernel
        self._acting: Optional[_Acting] = None  # the last call without gradients, to call again

    def _apply(self, fn: Any, recurse: bool = True) -> "Conv2dRun":
        self._graphs = {}  # graphs of the old memory's addresses
        self._acting = None
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_graphs": {}, "_acting": None}  # as the layers': caches stay behind

    def forward(self, x: Tensor) -> Tensor:
        stamp = None
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            stamp, y = self._act_again(x)
            if y is not None:
                return y
        layers = list(self._modules.values())
        if not self._one_node(x, layers):
            return super().forward(x)
        first = layers[0]
        weight = _member(first.conv, "weight")
        first._check_input(x, weight)
        nchw = first.layout == "NCHW"
        self._check_sizes(x, layers, nchw)
        refuse_function_transforms(x, weight)
        if nchw:
            if not x.is_contiguous(memory_format=torch.channels_last):
                x = x.contiguous(memory_format=torch.channels_last)
        else:
            x = x.contiguous()
        calls, tensors, graphs, ptrs, counted = [], [], [], [], []
        for j, layer in enumerate(layers):
            norm = layer._modules.get("1")
            training = layer._follow_norm(norm)
            conv = layer._modules["0"]
            params = (_member(conv, "weight"), _member(conv, "bias"), None, None)
            running = (None, None)
            if norm is not None:
                params = (*params[:2], _member(norm, "weight"), _member(norm, "bias"))
                if layer._spec.normalization is Normalization.BATCH_NORM:
                    running = (_member(norm, "running_mean"), _member(norm, "running_var"))
            call, params = layer._eager_call(x, params, *running, training, nchw and j == 0)
            graphs.append(call.graphs)
            ptrs.append(call.ptrs)
            calls.append(call._replace(graphs=None, ptrs=()))
            tensors += [*params, *running]
            counted.append((layer, norm, running[0], training))
        together = None
        if all(g is not None for g in graphs):
            together = self._run_graphs(tuple(c.fn for c in calls), x.device)
        run = RunCall(tuple(calls), together, tuple(graphs), tuple(ptrs))
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *tensors)):
            y = EagerRun.apply(x, run, *tensors)
        elif stamp is not None and all(c.evaluates for c in calls) and (
                run.graphs is not None or all(c.views is not None for c in calls)):
            # Kept to call again: a graph replay on a GPU, the prepared evaluates on the host.
            prepared = None
            if run.graphs is None:
                y, prepared = _evaluate_prepared(x, run)
            else:
                y = _evaluate(x, run)
            self._acting = _Acting(stamp, tuple(tensors), run, prepared, nchw)
        else:
            y = _evaluate(x, run)
        for layer, norm, running_mean, training in counted:
            eager.count_batch(y, norm, running_mean, training)
        return y.permute(0, 3, 1, 2) if nchw else y

    def _act_again(self, x: Any) -> tuple[tuple, Optional[Tensor]]:
        """(the stamp of this call without gradients, y through the kept call where the
        stamp is the kept call's: the same call while nothing it rests on changed; else None)."""
        stamp = self._stamp(x)
        acting = self._acting
        if acting is not None and stamp == acting.stamp:
            refuse_function_transforms(x)
            return stamp, _act(x, acting)
        return stamp, None

    def _stamp(self, x: Any) -> tuple:
        """What a kept call without gradients rests on: x's type, shape, dtype, device and
        strides, autocast, PyTorch's global forward hooks (on a GPU: whether a capture is
        under way), and each layer (the object), its backend, hooks, norm flags (training,
        eps, momentum), tensors (the objects, kept with the call so their ids stay theirs,
        and their addresses: `.data = ...` moves them) and, on a GPU, its `cuda_graphs` and
        TF32 and plan-timing choice."""
        hooks = nn.modules.module
        if type(x) is not torch.Tensor:
            return (type(x),)
        cuda = x.is_cuda
        parts = [type(x), x.shape, x.dtype, x.device if cuda else None, x.stride(), torch.is_autocast_enabled("cpu"),
                 bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)]
        if cuda:
            parts += [torch.is_autocast_enabled("cuda"), torch.cuda.is_current_stream_capturing()]
        for layer in self._modules.values():
            conv, norm = layer._modules["0"], layer._modules.get("1")
            tensors = [_member(conv, "weight"), _member(conv, "bias")]
            parts += [id(layer), id(conv), id(norm), layer.cpu_backend,
                      bool(layer._forward_hooks or layer._forward_pre_hooks)]
            if cuda:  # which functions and graphs the layer's call takes
                parts += [layer.cuda_graphs, layer._choice(x)]
            if isinstance(norm, nn.BatchNorm2d):
                parts += [norm.training, norm.eps, norm.momentum]
            if norm is not None:
                tensors += [_member(norm, "weight"), _member(norm, "bias")]
                if layer._spec.normalization is Normalization.BATCH_NORM:
                    tensors += [_member(norm, "running_mean"), _member(norm, "running_var")]
            parts += [(id(t), t.data_ptr()) for t in tensors if t is not None]
        return tuple(parts)

    def _one_node(self, x: Any, layers: list) -> bool:
        """Whether this call can run as one node (else layer by layer, see the module docstring)."""
        if (type(x) is not torch.Tensor or x.dim() != 4 or x.shape[0] == 0 or torch.jit.is_tracing()
                or torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type)):
            return False
        hooks = nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return False
        w0 = _member(layers[0].conv, "weight")
        for layer in layers:
            w = _member(layer.conv, "weight")
            if type(w) not in _PLAIN or w.dtype != w0.dtype or w.device != w0.device:
                return False
            if layer._forward_hooks or layer._forward_pre_hooks:
                return False
            norm = layer.norm
            if isinstance(norm, nn.BatchNorm2d) and norm.momentum is None and norm.training:
                return False
        return True

    def _check_sizes(self, x: Tensor, layers: list, nchw: bool) -> None:
        """ValueError, before anything runs, where a layer after the first would get an
        input smaller than its dilated kernel over its padding."""
        hw = _height_width(x, nchw)
        if hw in self._sizes:
            return
        h, w = hw
        for j, layer in enumerate(layers):
            least = layer._least_hw
            if j and (h < least[0] or w < least[1]):
                raise ValueError(f"x: layers[{j}] of the run would get a {h}x{w} input from {describe(x)}, "
                                 f"expected height >= {max(least[0], 1)} and width >= {max(least[1], 1)} (its "
                                 f"kernel {layer._spec.kernel}, dilated by {layer._spec.dilation}, over the "
                                 f"padded input)")
            _, h, w, _ = layer._spec.at(1, h, w).output_shape
        self._sizes.add(hw)

    def _run_graphs(self, fns: tuple, device: torch.device) -> CallGraphs:
        key = tuple(map(id, fns))
        found = self._graphs.get(key)
        if found is None:
            if len(self._graphs) >= 8:  # functions remade (eps or momentum changed, another dtype): drop old
                self._graphs.clear()
            found = self._graphs[key] = (fns, CallGraphs(_Together(fns), device))
        return found[1]

    def graph_counts(self) -> dict[str, int]:
        """How the run's one-node CUDA calls went (as Conv2dNormActivation.graph_counts)."""
        total: dict[str, int] = {}
        for _, graphs in self._graphs.values():
            for k, v in graphs.counts.items():
                total[k] = total.get(k, 0) + v
        return total

