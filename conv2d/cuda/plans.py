"""What the CUDA functions keep per input shape (`ShapePlan`: cuDNN graphs, scratch,
prepared launches, saved-value buffers), the cache of them (`ShapePlans`), and `Saved`,
what a forward hands its backward.

Any input shape (N, H, W) the kernel fits is taken: each new one gets a plan, built on
first use and cached (at most `max_shapes`, least recently used dropped; the spec's
batch_size is planned at construction). A frozen layer allocates nothing: every planned
shape gets fixed buffers for its outputs (y, d_x) and saved values, and new shapes are
refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from conv2d.cuda.kernels import simple
from conv2d.cuda.kernels.padding import source_tables
from conv2d.cuda.launch import Launch, LaunchKey
from conv2d.spec import LayerSpec, Normalization


def convolution_spec(spec: LayerSpec) -> LayerSpec:
    """The spec cuDNN's graphs run for `spec`: itself, or where it pads with a mode other
    than zeros (which cuDNN does not have), that of its padded input, unpadded."""
    if not spec.pads_with_copies:
        return spec
    (top, bottom), (left, right) = spec.pads
    return dataclasses.replace(spec, in_height=spec.in_height + top + bottom, in_width=spec.in_width + left + right,
                               padding=0, padding_end=None, padding_mode="zeros")


class PaddingPlan:
    """A padding mode's device buffers at one input shape: the padded input `x` and its
    gradient `d_x` (N, Hp, Wp, C), kernels/padding.py's tables of each axis (`rows`,
    `cols`; `row_copies` (H, KR) and `col_copies` (W, KC), flat), and the sizes the
    kernels take (`geometry`)."""

    def __init__(self, spec: LayerSpec, padded: LayerSpec, cuda: Any, device_dtype: np.dtype) -> None:
        (top, bottom), (left, right) = spec.pads
        rows, row_copies = source_tables(spec.in_height, top, bottom, spec.padding_mode)
        cols, col_copies = source_tables(spec.in_width, left, right, spec.padding_mode)
        self.rows, self.cols = cuda.to_device(rows), cuda.to_device(cols)
        self.row_copies, self.col_copies = cuda.to_device(row_copies.ravel()), cuda.to_device(col_copies.ravel())
        self.KR, self.KC = row_copies.shape[1], col_copies.shape[1]
        _, h, w, c = spec.input_shape
        _, hp, wp, _ = padded.input_shape
        self.geometry = {"H": h, "W": w, "C": c, "HP": hp, "WP": wp}  # what both padding kernels take
        self.input_size = math.prod(spec.input_shape)
        size = math.prod(padded.input_shape)
        self.x, self.d_x = cuda.device_array(size, device_dtype), cuda.device_array(size, device_dtype)


class ShapePlan:
    """One input shape of a layer: the spec at that shape, its cuDNN convolutions, the
    reduction scratch, prepared launches, free saved buffers, and once frozen the fixed
    buffers. Sizes: M = N*OH*OW rows of C = OC channels, S = OH*OW*OC values a sample,
    `groups` norm groups (channels for batch norm, samples for layer norm), P row-kernel
    blocks, Q segment blocks a sample. `conv_spec` is the spec cuDNN runs
    (convolution_spec) and `padding` its PaddingPlan where that is another."""

    def __init__(self, spec: LayerSpec, cuda: Any, device_dtype: np.dtype, config: Any, convolutions: Any,
                 simple_kernels: bool) -> None:
        f32 = np.float32
        alloc = cuda.device_array
        n, oh, ow, oc = spec.output_shape
        self.cuda, self.device_dtype = cuda, device_dtype
        self.spec = spec
        self.M, self.C, self.S = n * oh * ow, oc, oh * ow * oc
        self.total = self.M * self.C
        self.groups = {Normalization.BATCH_NORM: oc, Normalization.LAYER_NORM: n}.get(spec.normalization, 1)
        self.P = config.row_partition(self.M, self.C)
        self.Q = config.segment_partition(self.S)
        self.counter_size = 1 + config.phase_groups(self.P)
        self.conv_spec = convolution_spec(spec)
        self.padding = None if self.conv_spec is spec else PaddingPlan(spec, self.conv_spec, cuda, device_dtype)
        self.conv = convolutions(self.conv_spec)
        # Reduction scratch: the row kernels' partials (one row a block, then one a group
        # of blocks), the per-sample partials of layer norm, the totals.
        rows = self.P + config.phase_groups(self.P)
        self.col = (alloc(rows * oc, np.float64), alloc(rows * oc, np.float64))  # the row kernels' partials
        self.seg = (alloc(self.Q * n, f32), alloc(self.Q * n, f32))
        self.sums_col = alloc(2 * oc, f32)
        self.sums_seg = alloc(2 * n, f32)
        self.d_z = alloc(self.total, device_dtype)
        self.d_w = alloc(math.prod(spec.weight_shape), device_dtype)
        self.launches: dict[LaunchKey, Launch] = {}
        self.free_saved: list[tuple] = []
        self.slots: dict[int, tuple[int, Any]] = {}
        self.eval_buffers: tuple | None = None
        self.frozen: dict[str, Any] | None = None
        self.generation = 0
        self.wrapped: dict = {}  # frozen outputs as torch tensors, made once
        self.scratch = simple.Scratch(cuda, self.total, self.groups, oc) if simple_kernels else None

    def saved_buffers(self) -> tuple:
        """A new set of (pre, mean, inv_std) buffers, numbered: prepared launches are kept
        per set, so that a launch always sees the same buffers and sets no pointer."""
        alloc, f32 = self.cuda.device_array, np.float32
        buffers = alloc(self.total, self.device_dtype), alloc(self.groups, f32), alloc(self.groups, f32)
        self.slots[id(buffers[0])] = (len(self.slots), buffers[0])  # the array pins its id
        return buffers

    def slot(self, buffers: tuple) -> Any:
        """The number of a set of saved buffers ("caller" for the caller's own arrays)."""
        found = self.slots.get(id(buffers[0]))
        return found[0] if found is not None and found[1] is buffers[0] else "caller"

    def forward_buffers(self) -> tuple[tuple, int | None]:
        """(saved buffers for a forward, its generation): a frozen plan's fixed set (each
        forward a new generation, overwriting the last), else a free or new set."""
        if self.frozen is not None:
            self.generation += 1
            return self.frozen["saved"], self.generation
        return (self.free_saved.pop() if self.free_saved else self.saved_buffers()), None

    def evaluate_buffers(self) -> tuple:
        """The plan's own (pre, mean, inv_std) scratch for evaluate."""
        if self.eval_buffers is None:
            self.eval_buffers = self.saved_buffers()
        return self.eval_buffers

    def freeze(self) -> None:
        """Fixed buffers for y, d_x and the saved values (and evaluate's scratch)."""
        alloc, s = self.cuda.device_array, self.spec
        self.frozen = {"y": alloc(s.output_shape, self.device_dtype), "d_x": alloc(s.input_shape, self.device_dtype),
                       "saved": self.saved_buffers()}
        self.evaluate_buffers()

    def release(self) -> None:
        """Let the prepared launches go of the caller's arrays of their last call."""
        for launch in self.launches.values():
            launch.release()
        release = getattr(self.conv, "release", None)  # convolutions with launches of their own
        if release is not None:
            release()


class ShapePlans:
    """The plans of a layer's input shapes, least recently used dropped beyond
    `max_shapes`; frozen, it makes no new ones."""

    def __init__(self, make: Callable[[LayerSpec], ShapePlan], max_shapes: int) -> None:
        self._make = make
        self.max_shapes = max_shapes
        self._plans: OrderedDict[tuple, ShapePlan] = OrderedDict()
        self.frozen = False

    @staticmethod
    def key(spec: LayerSpec) -> tuple[int, int, int]:
        return (spec.batch_size, spec.in_height, spec.in_width)

    def get(self, call: LayerSpec) -> ShapePlan:
        """The plan of `call`'s input shape, made on first use."""
        key = self.key(call)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        if self.frozen:
            raise RuntimeError(f"x: the layer is frozen and has no plan for input shape {call.input_shape} "
                               f"(planned: {[p.spec.input_shape for p in self._plans.values()]}); a new shape "
                               f"needs device memory")
        plan = self._plans[key] = self._make(call)
        while len(self._plans) > self.max_shapes:
            self._plans.popitem(last=False)
        return plan

    def find(self, call: LayerSpec) -> ShapePlan | None:
        return self._plans.get(self.key(call))

    def items(self) -> Any:
        return self._plans.items()

    def values(self) -> Any:
        return self._plans.values()

    def __bool__(self) -> bool:
        return bool(self._plans)

    def is_frozen(self) -> bool:
        return self.frozen

    def freeze(self) -> None:
        if not self.frozen:
            for plan in self._plans.values():
                plan.freeze()
            self.frozen = True


class Saved:
    """What `backward` needs from one `forward`: the call's spec (its N, H, W), the input
    (a device array), the pre-activations (flat, storage format), the norm's mean and
    inv_std (float32; per channel or per sample) and whether they came from the batch.
    Its device buffers go back to the shape's free list when it is dropped; a frozen
    layer's are fixed, and `generation` tells whether a later forward overwrote them."""

    __slots__ = ("spec", "x", "pre", "mean", "inv_std", "batch_stats", "owner", "generation", "slot", "_plan",
                 "_buffers")

    def __init__(self, owner: Any, plan: ShapePlan, x: Any, buffers: tuple, batch_stats: bool,
                 generation: int | None, recycle: bool = True) -> None:
        self.spec, self.x, self.batch_stats, self.owner = plan.spec, x, batch_stats, owner
        self.pre, self.mean, self.inv_std = buffers
        self.generation = generation
        self.slot = plan.slot(buffers)
        self._plan = plan
        self._buffers = buffers if generation is None and recycle else None

    def __del__(self) -> None:
        if self._buffers is not None:
            self._plan.free_saved.append(self._buffers)

    @property
    def plan(self) -> ShapePlan:
        return self._plan

    @property
    def overwritten(self) -> bool:
        """Whether a later forward of a frozen layer overwrote these saved values."""
        return self.generation is not None and self.generation != self._plan.generation

    @property
    def resources(self) -> Any:
        """What the call's kernels used besides the caller's arrays: its shape's plan
        (reduction scratch, cuDNN workspace, prepared launches' counters). Whoever keeps a
        captured CUDA graph of the call keeps this too, so that they stay allocated."""
        return self._plan
