"""Plan choice for batch-invariant layers: one recorded engine and knobs that keep a
sample's bits at every batch size, for forward and backward-data."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from conv2d.cuda import cudnn
from conv2d.cuda.launch import device_pointer
from conv2d.cuda.plan_autotune import AUTOTUNE_MAX_WORKSPACE
from conv2d.cuda.probe_inputs import DeviceInputs
from conv2d.dtypes import storage_dtype
from conv2d.spec import DType, LayerSpec


# Batch invariance. cuDNN's heuristics rank engines and knobs per problem size, so one
# convolution runs different plans (other reduction orders) at N = 1 and N = 256. A
# batch-invariant layer runs one plan, (engine id, knobs), at every N: chosen once per
# convolution shape (without N), device and TF32 choice, at a reference batch that
# depends on the shape alone, so that every layer of that shape (an actor's copy and the
# learner's) runs the same plan; rebuilt for each new N from the record. A candidate is
# taken only if it gives, byte for byte, the rows it gave at the reference batch when run
# at N = 1 (the first and the last sample) and N = 5 (samples from the middle): a fixed
# engine and knobs usually fix the reduction order over C*KH*KW, but not every engine
# (some choose their kernel by size; on the H200 about 8 of 40 float32 configurations
# kept their bits, all bfloat16 ones did). backward-filter sums over the batch: it stays
# deterministic, not invariant.
INVARIANT_BATCH = 128
INVARIANT_PROBE_BYTES = 1 << 28  # the reference batch halves (down to 8) until a batch's tensors fit this


def invariant_batch(spec: LayerSpec) -> int:
    """The reference batch at which a batch-invariant convolution's plan is chosen: 128,
    halved while a batch of inputs or outputs would exceed INVARIANT_PROBE_BYTES."""
    sample = max(math.prod(spec.input_shape[1:]), math.prod(spec.output_shape[1:])) * 4
    n = INVARIANT_BATCH
    while n > 8 and n * sample > INVARIANT_PROBE_BYTES:
        n //= 2
    return n


def invariant_choice(op: str, spec: LayerSpec, device: int, allow_tf32: bool, handle: Any, probe: Any,
                     autotune: Any = None) -> tuple:
    """The (engine id, knobs) that `op` of a batch-invariant `spec` runs at every batch
    size: the heuristics' first candidate at `invariant_batch(spec)` whose rows keep their
    bits at N = 1 and 5 (or with `autotune` the fastest such); recorded per process.
    Raises cudnn.CudnnError naming the spec where no candidate does."""
    tf32 = bool(allow_tf32) and spec.dtype is DType.FLOAT32
    key = (op, cudnn.conv_key(spec, batch=False), device, tf32, autotune is not None)
    return cudnn.cached(("choice", *key), lambda: _choose_invariant(op, spec, allow_tf32, handle, probe, autotune))


def _choose_invariant(op: str, spec: LayerSpec, allow_tf32: bool, handle: Any, probe: Any, autotune: Any) -> tuple:
    if probe is None:
        raise ValueError("a batch-invariant plan is chosen with an InvarianceProbe")
    frontend = cudnn.import_cudnn()
    n_ref = invariant_batch(spec)
    ref = spec.at(n_ref)
    checks = ((1, 0), (1, n_ref - 1), (5, n_ref // 2 - 2))  # (batch, first sample) runs compared to the reference
    tried = []
    try:
        g, t = cudnn.planned(op, ref, handle, allow_tf32)
        g.build_plans(frontend.build_plan_policy.ALL)
    except Exception as e:
        raise cudnn.failure(op, ref, e) from e
    passing = []
    for i in range(g.get_execution_plan_count()):
        try:
            name = str(g.get_plan_name_at_index(i))
            engine_id, knobs = g.get_engine_and_knobs_at_index(i)
            config = (int(engine_id), frozenset(dict(knobs or {}).items()))  # hashable: a cache key
            ws = int(g.get_workspace_size_plan_at_index(i))
            if ws > AUTOTUNE_MAX_WORKSPACE:
                continue
            want = probe.rows(op, ref, t, ws,
                              lambda pack, wsp, i=i: g.execute_plan_at_index(pack, wsp, i, handle=handle))
        except Exception:  # a plan that did not build or run is not a candidate
            continue
        kept = True
        for n, first in checks:
            try:
                r = cudnn.build(op, spec.at(n), handle, allow_tf32, config=config)
                got = probe.rows(op, r.spec, r.tensors, r.workspace_size,
                                 lambda pack, wsp, r=r: r.graph.execute_plan_at_index(pack, wsp, 0, handle=handle),
                                 first)
            except Exception:
                kept = False
                break
            if got != want[first:first + n]:
                kept = False
                break
        tried.append(name)
        if kept:
            passing.append((i, config, ws))
            if autotune is None:
                break
    if not passing:
        raise cudnn.CudnnError(f"batch_invariant: no deterministic cuDNN plan for {op} keeps a sample's bits at every "
                         f"batch size for {spec} (tried {', '.join(tried) or 'none that ran'}); use "
                         f"batch_invariant=False for this layer")
    if autotune is None or len(passing) == 1:
        return passing[0][1]
    bench = autotune.at(ref)
    timed = []
    for i, config, ws in passing:
        try:
            run = lambda pack, wsp, handle, i=i: g.execute_plan_at_index(pack, wsp, i, handle=handle)  # noqa: E731
            timed.append((bench(t, ws, run), i, config))
        except Exception:
            continue
    if not timed:
        return passing[0][1]
    fastest = min(ms for ms, _, _ in timed)
    return min((i, config) for ms, i, config in timed if ms <= fastest * 1.02)[1]


class InvarianceProbe(DeviceInputs):
    """What `invariant_choice` runs candidate plans on: random inputs at the reference
    batch."""

    def rows(self, op: str, spec: LayerSpec, tensors: dict, workspace: int, run: Any, first: int = 0) -> list[bytes]:
        """The output's samples, as bytes each, of running `run(pack, workspace_ptr)` on
        `spec`'s batch of inputs taken from sample `first` of the reference buffers."""
        # forward_pre_relu: its pre-activations (the ReLU, one epilogue over them, would
        # hide differences in negative values).
        batched, out = ("dy", "dx") if op == "backward_data" else ("x", "z" if "z" in tensors else "y")
        in_shape, out_shape = ((spec.output_shape, spec.input_shape) if op == "backward_data"
                               else (spec.input_shape, spec.output_shape))
        itemsize = np.dtype(storage_dtype(spec.dtype)).itemsize
        src = self._buffer(batched, invariant_batch(spec) * math.prod(in_shape[1:]), spec.dtype)
        if first:  # a copy of the samples, at an address as aligned as any batch's
            k = math.prod(in_shape[1:])
            part = self.cuda.device_array(in_shape[0] * k, src.dtype, stream=self.stream)
            part.copy_to_device(src[first * k:(first + in_shape[0]) * k], stream=self.stream)
            src = part
        ptrs = {batched: device_pointer(src),
                "w": device_pointer(self._buffer("w", math.prod(spec.weight_shape), spec.dtype))}
        if "b" in tensors:
            ptrs["b"] = device_pointer(self._buffer("b", spec.out_channels, spec.dtype))
        y = self.cuda.device_array(math.prod(out_shape) * itemsize, np.uint8, stream=self.stream)
        ptrs[out] = device_pointer(y)
        if out == "z":
            activated = self.cuda.device_array(math.prod(out_shape) * itemsize, np.uint8, stream=self.stream)
            ptrs["y"] = device_pointer(activated)
        ws = self.cuda.device_array(max(workspace, 1), np.uint8, stream=self.stream)
        run({t: ptrs[role] for role, t in tensors.items()}, device_pointer(ws))
        self.stream.synchronize()
        host = y.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        per = math.prod(out_shape[1:]) * itemsize
        return [host[i * per:(i + 1) * per].tobytes() for i in range(out_shape[0])]
