"""The layer's steps on the GPU, named as `conv2d/reference/functional.py` names them,
over one input shape's plan (plans.ShapePlan) and device arrays:

| reference | here | runs |
| --- | --- | --- |
| conv.pad | pad_input | pad_input (padding modes other than zeros) |
| _pre_activations | pre_activations | cuDNN forward (bias fused) |
| _statistics | statistics | batch_norm_statistics; layer_norm_partials + layer_norm_statistics; running_statistics |
| _activation_input + activations.forward | normalise_and_activate | normalise_and_activate |
| grad_pre_activations + bias_backward | grad_pre_activations | norm_gradients (+ layer norm's partials), grad_pre_activations |
| conv_backward_data (+ conv.unpad) | input_gradient | cuDNN backward-data (+ unpad_gradient) |
| conv_backward_filter | weight_gradient | cuDNN backward-filter (+ accumulate_stored) |
| forward | forward_steps | the forward's steps in order (a 16-bit ReLU layer without a norm: cuDNN's forward_pre_relu writes z and y) |

The kernels are kernels/fast.py's (or, with kernels="simple", kernels/simple.py's one
kernel a reference step). Every launch is prepared once per plan under a `LaunchKey`
(the step, the saved buffers it reads or writes, what is fixed under it) and replayed
with only its changed arrays swapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from conv2d.cuda import kernels as K
from conv2d.cuda.kernels import simple
from conv2d.cuda.kernels.layout import window_geometry
from conv2d.cuda.launch import Launch, Launcher, LaunchKey
from conv2d.cuda.plans import Saved, ShapePlan
from conv2d.spec import LayerSpec, Normalization

# Row-engine arguments fixed under a launch's key (set when it is prepared).
_FIXED_ROW_ARGS = ("batch_stats", "count", "var_scale", "accumulate")


@dataclass
class Kernels:
    """What the steps launch with, for one layer: its spec, the fast kernel sets (wide
    loads, and `narrow` for d_y that is not 8-byte aligned: the same sums, one load a
    value), or the simple sets; the one-element dummy array that stands for arrays a
    kernel does not use; the launcher; the padding kernels (kernels/padding.py) where the
    spec pads with a mode other than zeros; for a norm without gamma and beta
    (bn_affine=False), gamma = 1 and beta = 0 arrays and two arrays their gradients go
    to, unread."""

    spec: LayerSpec
    cuda: Any
    fast: Any
    narrow: Any
    simple: Any
    simple32: Any
    dummy: Any
    launch: Launcher
    padding: tuple | None = None
    constants: dict | None = None
    discard: dict | None = None
    count_dummy: Any = None  # int64, one element: num_batches_tracked where the spec has none

    def norm_params(self, p: dict) -> dict[str, Any]:
        return {"gamma": p.get("gamma", self.dummy), "beta": p.get("beta", self.dummy)}

    def with_constants(self, p: dict) -> dict:
        """The parameters, with gamma = 1 and beta = 0 where the norm has none."""
        return p if self.constants is None else {**self.constants, **p}

    def with_discard(self, g: dict) -> dict:
        """The gradient arrays, with unread ones for gamma and beta where the norm has none."""
        return g if self.discard is None or not g else {**self.discard, **g}


def _rows(k: Kernels, plan: ShapePlan, key: LaunchKey, **args: Any) -> None:
    """A row-engine kernel (kernels/rows.py), `key.step` naming it, over the plan's (M, C)
    values, its partials in plan.col and phase two folded in; `args` by the kernel's
    names (arrays that change per call, and the scalars `batch_stats`, `count`,
    `accumulate`, `var_scale`, fixed under the key)."""
    launch = plan.launches.get(key)
    if launch is not None:
        k.launch.call(launch, {n: v for n, v in args.items() if n not in _FIXED_ROW_ARGS})
        return
    # One signature for four jobs: what a job does not read or write is the dummy.
    s, d = k.spec, k.dummy
    counter = k.cuda.to_device(np.zeros(plan.counter_size, np.int32), stream=k.launch.current())
    full = dict(z=d, d_y=d, out=d, mean=d, inv_std=d, gamma=d, beta=d, sums=d, batch_stats=False,
                count=np.float32(1.0), epsilon=np.float32(s.bn_epsilon),
                momentum=simple.momentum_argument(s), batches=k.count_dummy,
                var_scale=np.float32(1.0), M=plan.M, C=plan.C, S=plan.S, out0=plan.col[0], out1=plan.col[1],
                counter=counter, acc0=d, acc1=d, accumulate=K.ACC_NONE)
    full.update({n: (np.float32(v) if n in ("count", "var_scale") else v) for n, v in args.items()})
    kernel = getattr(k.narrow if key.narrow else k.fast, key.step)
    launch = plan.launches[key] = Launch(kernel, plan.P, K.ROW_THREADS, k.launch.current(), full, fast=k.launch.fast)
    launch()


def pad_input(k: Kernels, plan: ShapePlan, x: Any) -> Any:
    """x (N, H, W, C) as cuDNN reads it: itself, or padded into the plan's buffer (N, Hp,
    Wp, C) by the spec's padding mode (reference: conv.pad)."""
    pads = plan.padding
    if pads is None:
        return x
    k.launch(plan.launches, LaunchKey("pad_input"), k.padding[0], *K.elementwise_grid(pads.x.size),
             {"xp": pads.x, "rows": pads.rows, "cols": pads.cols, **pads.geometry}, x=x)
    return pads.x


def pre_activations(k: Kernels, plan: ShapePlan, p: dict, x: Any, z: Any, relu: bool = False) -> None:
    """z = conv(x, W) + b (cuDNN), stored; with `relu` (evaluate without a norm) z's ReLU."""
    plan.conv.forward(pad_input(k, plan, x), p["weights"], p.get("bias"), z, relu=relu)


def statistics(k: Kernels, plan: ShapePlan, p: dict, r: dict | None, z: Any, stats: tuple, training: bool,
               buffers: Any) -> bool:
    """Fill stats = (mean, inv_std) from z, updating the running statistics in a training
    batch norm (if `r` is given); returns whether they came from the batch."""
    s, norm, d = k.spec, k.spec.normalization, k.dummy
    mean, inv_std = stats
    if norm is Normalization.NONE:
        return False
    eps = np.float32(s.bn_epsilon)
    if norm is Normalization.BATCH_NORM and not training:
        k.launch(plan.launches, LaunchKey("running_statistics", buffers), k.fast.running_statistics,
                 *K.small_grid(plan.C), {"epsilon": eps}, running_mean=r["running_mean"],
                 running_var=r["running_var"], mean=mean, inv_std=inv_std)
        return False
    if norm is Normalization.BATCH_NORM:
        update = r is not None
        batches = k.count_dummy
        if update and s.bn_momentum is None:  # the cumulative average: count this batch first
            batches = r["num_batches_tracked"]
            k.launch(plan.launches, LaunchKey("count_batch", buffers), simple.count_batch, 1, 1, {},
                     batches=batches)
        _rows(k, plan, LaunchKey("batch_norm_statistics", buffers, (("update", update),)), z=z, mean=mean,
              inv_std=inv_std, count=plan.M, var_scale=s.running_var_scale(plan.M) if update else 1.0,
              acc0=r["running_mean"] if update else d, acc1=r["running_var"] if update else d, batches=batches,
              accumulate=K.ACC_ADD if update else K.ACC_NONE)
        return True
    n = plan.spec.batch_size
    k.launch(plan.launches, LaunchKey("layer_norm_partials", buffers), k.fast.layer_norm_partials, (n, plan.Q),
             K.SEG_THREADS, {"mean": d, "inv_std": d, "C": plan.C, "S": plan.S, "out0": plan.seg[0],
                             "out1": plan.seg[1]},
             z=z, d_y=z, **k.norm_params(p))
    k.launch(plan.launches, LaunchKey("layer_norm_statistics", buffers), k.fast.layer_norm_statistics, n, K.WARP,
             {"p0": plan.seg[0], "p1": plan.seg[1], "P": plan.Q, "G": n, "S": plan.S, "count": np.float32(plan.S),
              "epsilon": eps},
             z=z, mean=mean, inv_std=inv_std)
    return True


def normalise_and_activate(k: Kernels, plan: ShapePlan, p: dict, z: Any, y: Any, stats: tuple,
                           buffers: Any) -> None:
    """y = act(gamma * (z - mean) * inv_std + beta), or act(z) without a norm, stored."""
    mean, inv_std = stats
    _rows(k, plan, LaunchKey("normalise_and_activate", buffers), z=z, out=y, mean=mean, inv_std=inv_std,
          **k.norm_params(p))


def forward_steps(k: Kernels, plan: ShapePlan, p: dict, r: dict | None, x: Any, y: Any, saved: tuple,
                  training: bool, buffers: Any) -> bool:
    """The forward's steps, as the reference's forward: pre-activations, statistics,
    normalise and activate, into the saved (pre, mean, inv_std) arrays and y; returns
    whether the statistics came from the batch. `buffers` names the launches (LaunchKey)."""
    z, mean, inv_std = saved
    if k.simple is None and getattr(plan.conv, "pre_relu", False) and \
            plan.conv.forward_pre_relu(pad_input(k, plan, x), p["weights"], p.get("bias"), z, y):
        return False  # z and y = ReLU(z) in one cuDNN graph; no norm, no statistics
    pre_activations(k, plan, p, x, z)
    if k.simple is not None:
        return simple.forward_steps(k.simple, k.spec, (plan.M, plan.C, plan.S, plan.groups), plan.scratch, p, r, z,
                                    y, mean, inv_std, training, k.launch.current(), k.count_dummy)
    from_batch = statistics(k, plan, p, r, z, (mean, inv_std), training, buffers)
    normalise_and_activate(k, plan, p, z, y, (mean, inv_std), buffers)
    return from_batch


def grad_pre_activations(k: Kernels, plan: ShapePlan, p: dict, saved: Saved, d_y: Any, narrow: bool, g: dict,
                         acc: int) -> None:
    """plan.d_z (stored) from d_y through the activation and the norm, and the bias, gamma
    and beta gradients written or added into g (`acc`: kernels.ACC_*) (reference:
    grad_pre_activations and bias_backward)."""
    d, norm, call = k.dummy, k.spec.normalization, saved.spec
    mean, inv_std = (saved.mean, saved.inv_std) if norm is not Normalization.NONE else (d, d)
    if k.simple is not None:
        simple.backward_steps(k.simple, k.simple32, k.spec, (plan.M, plan.C, plan.S, plan.groups), plan.scratch, p,
                              saved.pre, mean, inv_std, saved.batch_stats, d_y, plan.d_z,
                              {n: v for n, v in g.items() if n != "weights"}, acc != K.ACC_ADD, k.launch.current())
        return
    sums, count = d, 1.0
    batch_stats = saved.batch_stats
    if norm is not Normalization.NONE:
        # Per channel: sum d_a and sum d_a * x_hat, the beta and gamma gradients, and
        # for batch norm with batch statistics also what its backward needs.
        _rows(k, plan, LaunchKey("norm_gradients", saved.slot, (("accumulate", acc),), narrow), z=saved.pre,
              d_y=d_y, out=plan.d_z, mean=mean, inv_std=inv_std, **k.norm_params(p), sums=plan.sums_col,
              acc0=g.get("beta", d), acc1=g.get("gamma", d), accumulate=acc)
        if norm is Normalization.LAYER_NORM:
            n = call.batch_size
            k.launch(plan.launches, LaunchKey("layer_norm_gradient_partials", saved.slot),
                     k.fast.layer_norm_gradient_partials, (n, plan.Q), K.SEG_THREADS,
                     {"C": plan.C, "S": plan.S, "out0": plan.seg[0], "out1": plan.seg[1]},
                     z=saved.pre, d_y=d_y, mean=mean, inv_std=inv_std, **k.norm_params(p))
            k.launch(plan.launches, LaunchKey("partials_final"), k.fast.partials_final, n, K.WARP,
                     {"p0": plan.seg[0], "p1": plan.seg[1], "P": plan.Q, "G": n, "sums": plan.sums_seg})
            sums, count = plan.sums_seg, plan.S
        elif batch_stats:
            sums, count = plan.sums_col, plan.M
    # d_z through the activation and the norm, and in the same pass its per-channel
    # sums: the bias gradient.
    bias_acc = acc if k.spec.bias else K.ACC_NONE
    _rows(k, plan, LaunchKey("grad_pre_activations", saved.slot, (("accumulate", bias_acc),
                                                                   ("batch_stats", batch_stats)), narrow),
          z=saved.pre, d_y=d_y, out=plan.d_z, mean=mean, inv_std=inv_std, **k.norm_params(p), sums=sums,
          batch_stats=batch_stats, count=count, acc0=g.get("bias", d), accumulate=bias_acc)


def input_gradient(k: Kernels, plan: ShapePlan, p: dict, d_x: Any) -> None:
    """d_x = conv_backward_data(W, d_z) (cuDNN), stored; with a padding mode, the padded
    input's gradient added back to the positions it copies (reference: conv.unpad)."""
    pads = plan.padding
    if pads is None:
        plan.conv.backward_data(plan.d_z, p["weights"], d_x)
        return
    plan.conv.backward_data(plan.d_z, p["weights"], pads.d_x)
    k.launch(plan.launches, LaunchKey("unpad_gradient"), k.padding[1], *K.elementwise_grid(pads.input_size),
             {"d_xp": pads.d_x, "row_copies": pads.row_copies, "col_copies": pads.col_copies, "KR": pads.KR,
              "KC": pads.KC, **pads.geometry}, d_x=d_x)


def weight_gradient(k: Kernels, plan: ShapePlan, x: Any, grad: Any, accumulate: bool) -> None:
    """The weights' gradient conv_backward_filter(x, d_z) (cuDNN) written into `grad`, or
    added into it (`accumulate`: written into the plan's d_w, then added, both stored)."""
    x = pad_input(k, plan, x)
    if not accumulate:
        plan.conv.backward_filter(x, plan.d_z, grad)
        return
    plan.conv.backward_filter(x, plan.d_z, plan.d_w)
    total = plan.d_w.size
    k.launch(plan.launches, LaunchKey("accumulate_stored"), k.fast.accumulate_stored, *K.elementwise_grid(total),
             {"new": plan.d_w, "total": total}, grad=grad)


def direct_evaluate(k: Kernels, plan: ShapePlan, p: dict, r: dict | None, x: Any, y: Any) -> None:
    """evaluate's y in one launch (kernels.fast's direct_evaluate), on the padded input
    where the spec pads with a mode other than zeros."""
    s, d = plan.conv_spec, k.dummy
    x = pad_input(k, plan, x)
    fixed = {"has_bias": k.spec.bias, "epsilon": np.float32(s.bn_epsilon), **window_geometry(s),
             "CG": s.in_channels // s.groups, "OCG": s.out_channels // s.groups}
    running = {"running_mean": r["running_mean"], "running_var": r["running_var"]} if r else {
        "running_mean": d, "running_var": d}
    k.launch(plan.launches, LaunchKey("direct_evaluate"), k.fast.direct_evaluate, *K.elementwise_grid(plan.total),
             fixed, x=x, w=p["weights"], b=p.get("bias", d), y=y, **running, **k.norm_params(p))
