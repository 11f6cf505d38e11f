"""The layer's named arrays: which exist for a spec, with what shape and dtype, and checks."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from conv2d.checks import check_plain_array, check_shape_dtype, describe
from conv2d.checks import warn_non_finite as warn_of_non_finite
from conv2d.dtypes import compute_dtype, storage_dtype
from conv2d.spec import LayerSpec, Normalization


def state_layout(spec: LayerSpec) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name -> (shape, dtype) of every state entry the spec's layer has.

    weights (OC, KH, KW, IC) and, unless `bias=False`, bias (OC,) in the storage dtype; with
    a norm, gamma and beta (OC,) in the compute dtype (unless bn_affine=False); with batch
    norm, running_mean and running_var too (unless bn_track_running_stats=False), and with
    bn_momentum=None num_batches_tracked, () int64 (PyTorch's name): the training batches
    the cumulative average has taken.
    """
    st, ct, oc = storage_dtype(spec.dtype), compute_dtype(spec.dtype), spec.out_channels
    layout = {"weights": (spec.weight_shape, st)}
    if spec.bias:
        layout["bias"] = ((oc,), st)
    if spec.normalization is not Normalization.NONE and spec.bn_affine:
        layout["gamma"] = ((oc,), ct)
        layout["beta"] = ((oc,), ct)
    if spec.normalization is Normalization.BATCH_NORM and spec.bn_track_running_stats:
        layout["running_mean"] = ((oc,), ct)
        layout["running_var"] = ((oc,), ct)
        if spec.bn_momentum is None:
            layout["num_batches_tracked"] = ((), np.dtype(np.int64))
    return layout


# The running state: batch norm's statistics, and the batch count of the cumulative average,
# which saturates at MAX_BATCHES (the int64 maximum) instead of wrapping.
MAX_BATCHES = 2 ** 63 - 1
RUNNING_STATISTICS = ("running_mean", "running_var")
RUNNING = RUNNING_STATISTICS + ("num_batches_tracked",)


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(parameters, running statistics) of a state dict: the functional core's `params`
    and `running` arguments, the same arrays (no copy)."""
    return ({k: v for k, v in state.items() if k not in RUNNING}, {k: v for k, v in state.items() if k in RUNNING})


def grad_layout(spec: LayerSpec) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every parameter's gradient: the parameter's shape and dtype."""
    return {k: v for k, v in state_layout(spec).items() if k not in RUNNING}


def initial_state(spec: LayerSpec) -> dict[str, np.ndarray]:
    """Zeros, except gamma = 1 and running_var = 1."""
    state = {k: np.zeros(shape, dtype) for k, (shape, dtype) in state_layout(spec).items()}
    for k in ("gamma", "running_var"):
        if k in state:
            state[k][...] = 1
    return state


def check_arrays(what: str, arrays: Any, layout: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                 warn_non_finite: bool) -> dict[str, np.ndarray]:
    """Validate a whole dict against `layout` (keys, shapes, dtypes, a running variance
    >= 0 and a batch count >= 0) before any use. NaN and infinite values are kept (a
    diverged run's state), with a RuntimeWarning where `warn_non_finite`."""
    if not isinstance(arrays, Mapping):
        raise TypeError(f"{what}: expected a dict of arrays, got {describe(arrays)}")
    # Keys of any type (1, (2,)) are named by repr: they cannot be sorted together.
    missing = sorted(set(layout) - set(arrays))
    unexpected = sorted((repr(k) if not isinstance(k, str) else k for k in set(arrays) - set(layout)), key=str)
    if missing or unexpected:
        raise KeyError(f"{what}: expected keys {sorted(layout)}, missing {missing}, unexpected {unexpected}")
    out = {}
    for name, (shape, dtype) in layout.items():
        a = arrays[name]
        check_plain_array(f"{what}[{name!r}]", a)
        check_shape_dtype(f"{what}[{name!r}]", a, shape, dtype)
        if not a.flags.c_contiguous:
            raise ValueError(f"{what}[{name!r}]: expected a C-contiguous array, got strides {a.strides} "
                             f"(use numpy.ascontiguousarray)")
        if warn_non_finite:
            warn_of_non_finite(f"{what}[{name!r}]", a)
        out[name] = a
    if "running_var" in out and (out["running_var"] < 0).any():
        raise ValueError(f"{what}['running_var']: expected values >= 0, got min {out['running_var'].min()}")
    if "num_batches_tracked" in out and out["num_batches_tracked"] < 0:
        raise ValueError(f"{what}['num_batches_tracked']: expected a count >= 0, got {int(out['num_batches_tracked'])}")
    return out
