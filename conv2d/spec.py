"""The layer description shared by both backends: `LayerSpec`, and its enum-like fields."""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any, Union

from conv2d.activations import Activation

IntPair = Union[int, tuple[int, int]]

# No array of a layer or of one call may hold more values (2**36: 256 GiB of float32,
# more than any one GPU or host here holds).
MAX_ELEMENTS = 1 << 36
# No size, kernel, stride or padding may exceed the GPU kernels' int32 indices.
MAX_DIM = (1 << 31) - 1

# The fields that describe a call's input rather than the layer: the same layer runs
# at any of them, and a layer saved at one loads at another.
CALL_FIELDS = ("batch_size", "in_height", "in_width")


class Normalization(str, Enum):
    NONE = "none"
    BATCH_NORM = "batch_norm"
    LAYER_NORM = "layer_norm"


class RunningVariance(str, Enum):
    """What batch norm's running variance averages: the batch's biased variance (the
    original library's rule) or the unbiased one, times n / (n - 1) (PyTorch's)."""

    BIASED = "biased"
    UNBIASED = "unbiased"


class DType(str, Enum):
    """The type policy of a layer (see conv2d.dtypes for what each one stores and computes in)."""

    FLOAT64 = "float64"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


def _enum_value(enum: type[Enum], name: str, value: Any) -> Enum:
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        for member in enum:
            if value == member.value:
                return member
    allowed = ", ".join(repr(m.value) for m in enum)
    raise ValueError(f"LayerSpec.{name}: expected one of {allowed}, got {value!r}")


PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _paddings(padding: Any, padding_end: Any, kernel: tuple[int, int], stride: tuple[int, int],
              dilation: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(padding, padding_end) as pairs, from an int, a pair, "valid", "same" or
    ((top, bottom), (left, right))."""
    if isinstance(padding, str) or (isinstance(padding, (tuple, list)) and len(padding) == 2
                                    and all(isinstance(p, (tuple, list)) for p in padding)):
        if padding_end is not None:
            raise ValueError(f"LayerSpec.padding_end: given beside padding={padding!r}, which says both ends")
        if padding == "valid":
            return (0, 0), (0, 0)
        if padding == "same":
            if stride != (1, 1):
                raise ValueError(f"LayerSpec.padding: 'same' needs stride 1 (as PyTorch's), got stride {stride}")
            totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
            begin = tuple(t // 2 for t in totals)
            return begin, tuple(t - b for t, b in zip(totals, begin))
        if isinstance(padding, str):
            raise ValueError(f"LayerSpec.padding: expected an int, a pair, 'same', 'valid' or ((top, bottom), "
                             f"(left, right)), got {padding!r}")
        (top, bottom), (left, right) = (_pair("padding", tuple(p)) for p in padding)
        return (top, left), (bottom, right)
    begin = _pair("padding", padding)
    return begin, (begin if padding_end is None else _pair("padding_end", padding_end))


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `kernel=True` is a bug, not a size.
    return isinstance(value, int) and not isinstance(value, bool)


def _pair(name: str, value: Any) -> tuple[int, int]:
    if _is_int(value):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
        return (int(value[0]), int(value[1]))
    raise ValueError(f"LayerSpec.{name}: expected an int or a pair of ints, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """Everything that fixes a layer's shapes and semantics; hashable, so it keys caches.
    Fields are keyword-only.

    Input `(N, H, W, C)` = (batch_size, in_height, in_width, in_channels); output
    `(N, OH, OW, OC)`; weights `(OC, KH, KW, IC)`. `kernel`, `stride` and `padding` take an
    int or an (H, W) pair and are stored as pairs. `padding` is the rows above and the
    columns left of the input; `padding_end` the rows below and columns right (None: as
    `padding`). `padding` may also be "valid" (none), "same" (PyTorch's rule: the output
    keeps the input's size at stride 1, the odd extra row or column at the bottom/right)
    or ((top, bottom), (left, right)); either way both fields are stored as the pairs.
    `padding_mode`: "zeros", "reflect", "replicate" or "circular", as PyTorch's.
    `dilation` (an int or pair, as PyTorch's) spaces the kernel's taps; `groups` splits the
    channels into that many independent convolutions (PyTorch's; `groups == in_channels`
    is depthwise), the weights then `(OC, KH, KW, IC / groups)`.

    `batch_size` is the batch a layer plans for (the CUDA backend builds its cuDNN plans
    for it at construction, and `capture` records at it), or None for none: every call
    takes any N >= 1, and any H, W the kernel fits (`at` gives the spec of such a call).
    `bias=False` drops the bias parameter and its gradient. `bn_running_var` chooses the
    running variance's rule: "biased" (the original's) or "unbiased" (PyTorch's).
    `batch_invariant=True`: each sample's results do not depend on the batch it is
    computed in (its size, its other samples, the sample's position), bit for bit, for
    every output that is a function of the sample alone: evaluate (any norm), the training
    forward without batch norm or with layer norm, and the input gradient of those. Batch
    norm's training statistics and the parameter gradients sum over the batch: they stay
    deterministic, not invariant. Every backend takes it (docs/design.md says how each
    gets it).
    `bn_affine=False`: the norm has no gamma and beta (PyTorch's `affine=False`);
    `bn_track_running_stats=False`: batch norm keeps no running statistics and normalises
    with the batch's in evaluation too (PyTorch's `track_running_stats=False`).
    `bn_momentum=None`: the running statistics are the cumulative average of the batches'
    (PyTorch's `momentum=None`): the state then counts the training batches
    (`num_batches_tracked`, an int64 scalar) and each moves them 1/count of the way.
    `negative_slope` (LeakyReLU's, as PyTorch's) and `elu_alpha` (ELU's `alpha`) are the
    parameters of those two activations; another activation refuses a value other than
    the default.
    """

    batch_size: int | None = None
    in_height: int
    in_width: int
    in_channels: int
    out_channels: int
    kernel: IntPair = 3
    stride: IntPair = 1
    padding: IntPair | str | tuple = 0
    padding_end: IntPair | None = None
    padding_mode: str = "zeros"
    dilation: IntPair = 1
    groups: int = 1
    activation: Activation | str = Activation.IDENTITY
    normalization: Normalization | str = Normalization.NONE
    bn_momentum: float | None = 0.1
    bn_epsilon: float = 1e-5
    bn_affine: bool = True
    bn_track_running_stats: bool = True
    dtype: DType | str = DType.FLOAT32
    bias: bool = True
    bn_running_var: RunningVariance | str = RunningVariance.BIASED
    batch_invariant: bool = False
    negative_slope: float = 0.01
    elu_alpha: float = 1.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("batch_size", "in_height", "in_width", "in_channels", "out_channels"):
            value = getattr(self, name)
            if name == "batch_size" and value is None:
                continue
            if not _is_int(value) or value < 1:
                raise ValueError(f"LayerSpec.{name}: expected an int >= 1, got {value!r}")
        kernel = _pair("kernel", self.kernel)
        stride = _pair("stride", self.stride)
        dilation = _pair("dilation", self.dilation)
        padding, padding_end = _paddings(self.padding, self.padding_end, kernel, stride, dilation)
        for name, pair, least in (("kernel", kernel, 1), ("stride", stride, 1), ("padding", padding, 0),
                                  ("padding_end", padding_end, 0), ("dilation", dilation, 1)):
            if min(pair) < least:
                raise ValueError(f"LayerSpec.{name}: expected every entry >= {least}, got {getattr(self, name)!r}")
            if max(pair) > MAX_DIM:
                raise ValueError(f"LayerSpec.{name}: expected every entry <= 2**31 - 1, got {getattr(self, name)!r}")
        for name in ("batch_size", "in_height", "in_width", "in_channels", "out_channels"):
            if (getattr(self, name) or 0) > MAX_DIM:
                raise ValueError(f"LayerSpec.{name}: expected an int <= 2**31 - 1, got {getattr(self, name)!r}")
        g = self.groups
        if not _is_int(g) or g < 1 or self.in_channels % g or self.out_channels % g:
            raise ValueError(f"LayerSpec.groups: expected an int >= 1 that divides in_channels "
                             f"({self.in_channels}) and out_channels ({self.out_channels}), got {g!r}")
        if self.padding_mode not in PADDING_MODES:
            raise ValueError(f"LayerSpec.padding_mode: expected one of {list(PADDING_MODES)}, got "
                             f"{self.padding_mode!r}")
        for axis, size, k, p, q, d in (("height", self.in_height, kernel[0], padding[0], padding_end[0], dilation[0]),
                                       ("width", self.in_width, kernel[1], padding[1], padding_end[1], dilation[1])):
            extent = (k - 1) * d + 1
            if extent > size + p + q:
                spread = f" (dilated by {d}: {extent})" if d > 1 else ""
                raise ValueError(
                    f"LayerSpec.kernel: the kernel's {axis} {k}{spread} is larger than the padded input's "
                    f"{axis} {size} + {p} + {q} = {size + p + q}")
            # PyTorch's limits: a reflection needs a row (column) beyond the edge; a wrap
            # at most the whole input.
            if self.padding_mode == "reflect" and max(p, q) >= size:
                raise ValueError(f"LayerSpec.padding: padding_mode='reflect' needs padding < the input's {axis} "
                                 f"{size}, got {max(p, q)}")
            if self.padding_mode == "circular" and max(p, q) > size:
                raise ValueError(f"LayerSpec.padding: padding_mode='circular' needs padding <= the input's "
                                 f"{axis} {size}, got {max(p, q)}")
        set_(self, "kernel", kernel)
        set_(self, "dilation", dilation)
        set_(self, "stride", stride)
        set_(self, "padding", padding)
        set_(self, "padding_end", padding_end)
        set_(self, "activation", _enum_value(Activation, "activation", self.activation))
        set_(self, "normalization", _enum_value(Normalization, "normalization", self.normalization))
        set_(self, "dtype", _enum_value(DType, "dtype", self.dtype))
        set_(self, "bn_running_var", _enum_value(RunningVariance, "bn_running_var", self.bn_running_var))
        m = self.bn_momentum
        if m is not None and (not isinstance(m, (int, float)) or isinstance(m, bool) or not 0.0 <= m <= 1.0):
            raise ValueError(f"LayerSpec.bn_momentum: expected a number in [0, 1] or None, got {m!r}")
        e = self.bn_epsilon
        if not isinstance(e, (int, float)) or isinstance(e, bool) or not (e > 0 and math.isfinite(e)):
            raise ValueError(f"LayerSpec.bn_epsilon: expected a finite number > 0, got {e!r}")
        set_(self, "bn_momentum", None if m is None else float(m))
        set_(self, "bn_epsilon", float(e))
        if self.dtype is not DType.FLOAT64:
            # The norm computes in float32 for every other dtype: an epsilon that is 0 or
            # infinite there would divide by zero on a constant channel, or by infinity.
            e32 = struct.unpack("f", struct.pack("f", e))[0] if e < 3.5e38 else math.inf
            if not (e32 > 0 and math.isfinite(e32)):
                raise ValueError(f"LayerSpec.bn_epsilon: {e!r} is {e32!r} in float32, the compute type of "
                                 f"{self.dtype.value}; expected a value > 0 and finite there (about 1.4e-45 to 3.4e38)")
        self._check_sizes()
        for name, act, default in (("negative_slope", Activation.LEAKY_RELU, 0.01),
                                   ("elu_alpha", Activation.ELU, 1.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"LayerSpec.{name}: expected a finite number, got {v!r}")
            if self.activation is not act and v != default:
                raise ValueError(f"LayerSpec.{name}: only activation={act.value!r} takes it, got {name}={v!r} "
                                 f"with activation={self.activation.value!r}")
            set_(self, name, float(v))
        for name in ("bias", "batch_invariant", "bn_affine", "bn_track_running_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LayerSpec.{name}: expected a bool, got {getattr(self, name)!r}")
        if not self.bn_affine and self.normalization is Normalization.NONE:
            raise ValueError("LayerSpec.bn_affine: False means a norm without gamma and beta; this layer has no norm")
        if not self.bn_track_running_stats and self.normalization is not Normalization.BATCH_NORM:
            raise ValueError(f"LayerSpec.bn_track_running_stats: only batch norm keeps running statistics, got "
                             f"normalization={self.normalization.value!r}")

    def _check_sizes(self) -> None:
        # A spec whose arrays cannot exist fails here, naming the field, rather than in an
        # allocation (int64 sizes, and no array of one call over MAX_ELEMENTS values).
        (top, bottom), (left, right) = self.pads
        sh, sw = self.stride
        arrays = {"weights (out_channels*kernel*in_channels/groups)": (math.prod(self.weight_shape),
                                                                 "out_channels"),
                  "the padded input of one sample": ((self.in_height + top + bottom) * (self.in_width + left + right)
                                                     * self.in_channels, "padding"),
                  "the output of one sample": (self.out_height * self.out_width * self.out_channels, "out_channels"),
                  # a window view steps stride rows (or columns) of the padded input at a time
                  "one stride's step through the padded input": (max(sh * (self.in_width + left + right), sw)
                                                                 * self.in_channels, "stride")}
        if self.batch_size is not None:
            arrays["the planned batch's output"] = (self.batch_size * self.out_height * self.out_width
                                                   * self.out_channels, "batch_size")
        for what, (count, field) in arrays.items():
            if count > MAX_ELEMENTS:
                raise ValueError(f"LayerSpec.{field}: {what} would hold {count} values, more than {MAX_ELEMENTS} "
                                 f"(2**36); got {field}={getattr(self, field)!r}")

    # Derived sizes -------------------------------------------------------------------------
    @property
    def out_height(self) -> int:
        return self.output_size(self.in_height, self.in_width)[0]

    @property
    def out_width(self) -> int:
        return self.output_size(self.in_height, self.in_width)[1]

    def output_size(self, in_height: Any, in_width: Any) -> tuple[Any, Any]:
        """(OH, OW) for an input of height and width `in_height`, `in_width`: arithmetic
        only (no validation, no hashing), so that it also computes with torch's symbolic
        sizes under torch.compile."""
        (kh, kw), (dh, dw) = self.kernel, self.dilation
        (top, bottom), (left, right) = self.pads
        return ((in_height + top + bottom - (kh - 1) * dh - 1) // self.stride[0] + 1,
                (in_width + left + right - (kw - 1) * dw - 1) // self.stride[1] + 1)

    def _planned_batch(self) -> int:
        if self.batch_size is None:
            raise ValueError("LayerSpec.batch_size is None: this spec plans no batch; use spec.at(n) for the "
                             "spec of a call with n samples")
        return self.batch_size

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        """`(N, H, W, C)` at the planned batch."""
        return (self._planned_batch(), self.in_height, self.in_width, self.in_channels)

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        """`(N, OH, OW, OC)` at the planned batch."""
        return (self._planned_batch(), self.out_height, self.out_width, self.out_channels)

    def at(self, batch_size: int, in_height: int | None = None, in_width: int | None = None) -> "LayerSpec":
        """This spec for a call on `batch_size` samples (and another input height and
        width, if given): the same layer, validated again (the kernel must fit)."""
        h = self.in_height if in_height is None else in_height
        w = self.in_width if in_width is None else in_width
        if (batch_size, h, w) == (self.batch_size, self.in_height, self.in_width):
            return self
        return _at(self, batch_size, h, w)

    @property
    def pads(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((top, bottom), (left, right)): the padding on each side."""
        return ((self.padding[0], self.padding_end[0]), (self.padding[1], self.padding_end[1]))

    @property
    def pads_with_copies(self) -> bool:
        """Whether the padding copies input values (a padding_mode other than zeros, and
        some padding) rather than adding zeros: cuDNN has only zeros, so the CUDA backend
        pads such an input itself first."""
        return self.padding_mode != "zeros" and self.pads != ((0, 0), (0, 0))

    @property
    def activation_parameter(self) -> float | None:
        """The activation's parameter: LeakyReLU's negative_slope, ELU's alpha; else None."""
        return {Activation.LEAKY_RELU: self.negative_slope, Activation.ELU: self.elu_alpha}.get(self.activation)

    def batch_statistics(self, training: bool) -> bool:
        """Whether the norm normalises with statistics of the values it is given: layer norm
        always, batch norm in training or without running statistics (else with its running
        ones); False without a norm."""
        return self.normalization is Normalization.LAYER_NORM or (
            self.normalization is Normalization.BATCH_NORM and (training or not self.bn_track_running_stats))

    def running_var_scale(self, count: int) -> float:
        """The factor of the biased batch variance over `count` values that the running
        variance averages: 1, or count / (count - 1) for the unbiased rule."""
        if self.bn_running_var is RunningVariance.BIASED:
            return 1.0
        if count < 2:
            raise ValueError(f"x: batch norm's unbiased running variance needs more than one value per channel, "
                             f"got N*OH*OW = {count} (as PyTorch's BatchNorm2d in training)")
        return count / (count - 1)

    def differences(self, other: "LayerSpec", ignore: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
        """field -> (self's value, other's value) for every field that differs, except `ignore`."""
        return {f.name: (getattr(self, f.name), getattr(other, f.name)) for f in fields(self)
                if f.name not in ignore and getattr(self, f.name) != getattr(other, f.name)}

    def same_layer(self, other: "LayerSpec") -> bool:
        """Whether `other` describes the same parameters and semantics (the planned batch
        and input size may differ)."""
        return not self.differences(other, ignore=CALL_FIELDS)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """`(OC, KH, KW, IC / groups)`, cuDNN's NHWC filter layout."""
        return (self.out_channels, self.kernel[0], self.kernel[1], self.in_channels // self.groups)

    @property
    def fan_in(self) -> int:
        return self.kernel[0] * self.kernel[1] * (self.in_channels // self.groups)

    # Serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values; `LayerSpec.from_dict` inverts it."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, Enum) else (list(value) if isinstance(value, tuple) else value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayerSpec":
        if not isinstance(data, dict):
            raise ValueError(f"LayerSpec.from_dict: expected a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"LayerSpec.from_dict: unknown fields {unknown}; known are {sorted(known)}")
        values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()}
        return cls(**values)


@functools.lru_cache(maxsize=256)
def _at(spec: LayerSpec, batch_size: int, in_height: int, in_width: int) -> LayerSpec:
    # Validating a new spec costs tens of microseconds: a layer acting at batch 1 and
    # training at 32 asks for the same two every call.
    return replace(spec, batch_size=batch_size, in_height=in_height, in_width=in_width)
