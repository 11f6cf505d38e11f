"""Which plan a cuDNN graph runs: one policy a module, chosen here per graph.
- plan_invariant.py: a batch-invariant layer's forward and backward-data run one recorded
  engine and knobs at every batch size;
- plan_heuristic.py: strict float32 takes the more accurate of two heuristic modes' first
  plans; other dtypes and TF32 the heuristic's first plan (cudnn.build);
- plan_autotune.py: with `autotune`, the fastest deterministic plan measured on this GPU
  (with a plan store, measured once across processes).
`Graph.plan`, the engine's name, says which plan was chosen."""

from __future__ import annotations

from typing import Any

from conv2d.cuda import cudnn, plan_autotune, plan_heuristic, plan_invariant, plan_store
from conv2d.spec import DType, LayerSpec


def graph(op: str, spec: LayerSpec, device: int, allow_tf32: bool, handle: Any, autotune: Any = None,
          probe: Any = None, accuracy: Any = None) -> cudnn.Graph:
    """The built graph for (op, the spec's convolution, device, allow_tf32, autotuned or
    not), from the cache or built now. `autotune`, if given, times a plan (a
    `plan_autotune.Bench`). With `spec.batch_invariant`, forward and backward-data run
    the plan `plan_invariant.invariant_choice` recorded for the convolution at any batch
    size (`probe`: an `InvarianceProbe`). Strict float32 heuristic plans are checked for
    accuracy (`plan_heuristic.build_accurate`; `accuracy`: an `AccuracyProbe`)."""
    tf32 = bool(allow_tf32) and spec.dtype is DType.FLOAT32
    if spec.batch_invariant and op != "backward_filter":
        config = plan_invariant.invariant_choice(op, spec, device, allow_tf32, handle, probe, autotune)
        return cudnn.cached((op, cudnn.conv_key(spec), device, tf32, "invariant", config),
                            lambda: cudnn.build(op, spec, handle, allow_tf32, config=config))
    if accuracy is not None and autotune is None and spec.dtype is DType.FLOAT32 and not tf32:
        return cudnn.cached((op, cudnn.conv_key(spec), device, tf32, False, "accurate"),
                            lambda: plan_heuristic.build_accurate(op, spec, handle, accuracy))
    store = plan_store.current() if autotune is not None else None
    if store is not None:
        return cudnn.cached((op, cudnn.conv_key(spec), device, tf32, True),
                            lambda: plan_autotune.build_stored(op, spec, handle, allow_tf32, autotune, store))
    if autotune is not None:
        return cudnn.cached((op, cudnn.conv_key(spec), device, tf32, True),
                            lambda: plan_autotune.autotuned(op, spec, handle, allow_tf32, autotune))
    return cudnn.cached((op, cudnn.conv_key(spec), device, tf32, False),
                        lambda: cudnn.build(op, spec, handle, allow_tf32))
