"""rl_tools' HDF5 layout for a conv2d layer (needs h5py: the `hdf5` extra).

The layout of rl_tools' `nn/layers/conv2d/persist.h` (and `nn/parameters/persist.h`): a
layer is a group with the string attributes `type="conv2d"`, `output_channels`,
`input_channels`, `kernel_height`, `kernel_width`, `stride_h`, `stride_w`, `padding_h`,
`padding_w` (decimal strings) and, in newer versions, `activation_function` (IDENTITY,
RELU, TANH, FAST_TANH, SIGMOID, GELU) and `normalization` (NONE, BATCH_NORM, LAYER_NORM);
subgroups `weights/` (OC, KH, KW, IC) and `biases/` (OC,), with a norm `gamma/` and
`beta/`, each holding a `parameters` dataset and optionally `gradient`,
`gradient_first_order_moment`, `gradient_second_order_moment` (Adam); with batch norm the
datasets `running_mean`, `running_var` in the layer group; optionally `pre_activations`
and `output`. A tensor is a dataset of its own shape with the string attributes
`type="tensor"`, `num_dims` and `dim_0`... (a reader checks the shape, not these).

Matches rl_tools' persist code as of its conv2d layer with normalization (2025); older
versions stored weights as (OC, IC, KH, KW): `read` tells the two apart by shape, and
where the shapes coincide (KH == KW == IC) asks the caller for `weight_layout`. rl_tools
stores float32 or float64: 16-bit layers are written as float32 (exact) and read back
rounded to their storage type. rl_tools' GELU is the original library's constant, this
library's `gelu_original`; `gelu` and `gelu_tanh` have no rl_tools name and are refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conv2d.activations import Activation
from conv2d.layer import Conv2d
from conv2d.spec import LayerSpec, Normalization
from conv2d.state import RUNNING, grad_layout, state_layout

_ACTIVATIONS = {Activation.IDENTITY: "IDENTITY", Activation.RELU: "RELU", Activation.TANH: "TANH",
                Activation.FAST_TANH: "FAST_TANH", Activation.SIGMOID: "SIGMOID", Activation.GELU_ORIGINAL: "GELU"}
_NORMS = {Normalization.NONE: "NONE", Normalization.BATCH_NORM: "BATCH_NORM",
          Normalization.LAYER_NORM: "LAYER_NORM"}
_GROUPS = {"weights": "weights", "bias": "biases", "gamma": "gamma", "beta": "beta"}
ADAM_MOMENTS = ("gradient_first_order_moment", "gradient_second_order_moment")


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as e:
        raise ImportError("conv2d.rltools needs h5py: pip install 'conv2d[hdf5]'") from e
    return h5py


def _tensor(group: Any, name: str, value: np.ndarray) -> None:
    ds = group.create_dataset(name, data=value)
    ds.attrs["type"] = "tensor"
    ds.attrs["num_dims"] = str(value.ndim)
    for i, d in enumerate(value.shape):
        ds.attrs[f"dim_{i}"] = str(d)


def _stored(value: np.ndarray) -> np.ndarray:
    """float64 stays; float32 and the 16-bit types are written as float32 (exact)."""
    return np.ascontiguousarray(value, dtype=np.float64 if value.dtype == np.float64 else np.float32)


def attributes(spec: LayerSpec) -> dict[str, str]:
    """The layer group's attributes for `spec`, as rl_tools writes them."""
    if spec.activation not in _ACTIVATIONS:
        raise ValueError(f"activation: rl_tools has no {spec.activation.value!r}; it knows "
                         f"{sorted(a.value for a in _ACTIVATIONS)}")
    return {"type": "conv2d", "output_channels": str(spec.out_channels), "input_channels": str(spec.in_channels),
            "kernel_height": str(spec.kernel[0]), "kernel_width": str(spec.kernel[1]),
            "stride_h": str(spec.stride[0]), "stride_w": str(spec.stride[1]), "padding_h": str(spec.padding[0]),
            "padding_w": str(spec.padding[1]), "activation_function": _ACTIVATIONS[spec.activation],
            "normalization": _NORMS[spec.normalization]}


def write(layer: Conv2d, group: Any, gradient: bool = True, moments: dict[str, dict[str, np.ndarray]] | None = None,
          pre_activations: bool = False) -> None:
    """Write `layer` into the empty h5py group `group` in rl_tools' layout: parameters,
    their accumulated gradients (`gradient`), Adam's moments if given (`moments[name]`
    with the keys of `ADAM_MOMENTS`), running statistics, and with `pre_activations` the
    last forward's. rl_tools' layers always have biases: a bias-free layer is refused."""
    if not isinstance(layer, Conv2d):
        raise TypeError(f"layer: expected a Conv2d, got {type(layer).__name__}")
    spec = layer.spec
    if not spec.bias:
        raise ValueError("layer: rl_tools' conv2d layers always have biases; a bias=False layer cannot be "
                         "written (use bias=True with a zero bias)")
    attrs = attributes(spec)
    if len(group.keys()) or len(group.attrs.keys()):
        raise ValueError(f"group: expected an empty group, got one holding {sorted(group.keys())}")
    state, grads = layer.state_dict(), layer.grad_dict()
    for name, sub in _GROUPS.items():
        if name not in state:
            continue
        g = group.create_group(sub)
        _tensor(g, "parameters", _stored(state[name]))
        if gradient:
            _tensor(g, "gradient", _stored(grads[name]))
        for moment in ADAM_MOMENTS:
            if moments is not None and name in moments:
                _tensor(g, moment, _stored(moments[name][moment]))
    for name in RUNNING:
        if name in state:
            _tensor(group, name, _stored(state[name]))
    if pre_activations and layer.pre_activations is not None:
        _tensor(group, "pre_activations", _stored(layer.pre_activations))
    for k, v in attrs.items():
        group.attrs[k] = v


def _attr(group: Any, name: str) -> str | None:
    if name not in group.attrs:
        return None
    value = group.attrs[name]
    return value.decode() if isinstance(value, bytes) else str(value)


def spec_from_group(group: Any, in_height: int, in_width: int, **fields: Any) -> LayerSpec:
    """The LayerSpec of an rl_tools conv2d group: its sizes, activation and norm from the
    attributes, the input size from the caller (rl_tools does not store it), and any other
    field (`dtype`, `bn_momentum`, `bn_epsilon`, `batch_size`) from `fields`."""
    where = f"rl_tools group {getattr(group, 'name', '?')!r}"
    if _attr(group, "type") != "conv2d":
        raise ValueError(f"{where}: attribute type is {_attr(group, 'type')!r}, expected 'conv2d'")
    values = {}
    for key in ("output_channels", "input_channels", "kernel_height", "kernel_width", "stride_h", "stride_w",
                "padding_h", "padding_w"):
        text = _attr(group, key)
        if text is None or not text.isdigit():
            raise ValueError(f"{where}: attribute {key} is {text!r}, expected a decimal integer")
        values[key] = int(text)
    activation = _attr(group, "activation_function")
    norm = _attr(group, "normalization")
    by_name = {v: k for k, v in _ACTIVATIONS.items()}
    norms = {v: k for k, v in _NORMS.items()}
    if activation is not None and activation not in by_name:
        raise ValueError(f"{where}: activation_function {activation!r} is not one of {sorted(by_name)}")
    if norm is not None and norm not in norms:
        raise ValueError(f"{where}: normalization {norm!r} is not one of {sorted(norms)}")
    derived = dict(in_channels=values["input_channels"], out_channels=values["output_channels"],
                   kernel=(values["kernel_height"], values["kernel_width"]),
                   stride=(values["stride_h"], values["stride_w"]), padding=(values["padding_h"], values["padding_w"]))
    if activation is not None:
        derived["activation"] = by_name[activation]
    if norm is not None:
        derived["normalization"] = norms[norm]
    for k in derived:
        if k in fields:
            raise ValueError(f"{k}: the group's attributes give it; it cannot be passed")
    return LayerSpec(in_height=in_height, in_width=in_width, **derived, **fields)


def _weights(group: Any, spec: LayerSpec, array: np.ndarray, weight_layout: str | None) -> np.ndarray:
    oc, kh, kw, ic = spec.weight_shape
    new, old = (oc, kh, kw, ic), (oc, ic, kh, kw)
    where = f"rl_tools group {getattr(group, 'name', '?')!r}: weights/parameters"
    if weight_layout not in (None, "ohwi", "oihw"):
        raise ValueError(f"weight_layout: expected None, 'ohwi' or 'oihw', got {weight_layout!r}")
    if array.shape not in (new, old):
        raise ValueError(f"{where}: expected shape {new} (or the older {old}), got {array.shape}")
    if weight_layout is None:
        if new == old:
            raise ValueError(f"{where}: shape {array.shape} is both (OC, KH, KW, IC) and the older (OC, IC, KH, KW); "
                             f"say which with weight_layout='ohwi' or 'oihw'")
        weight_layout = "ohwi" if array.shape == new else "oihw"
    elif array.shape != (new if weight_layout == "ohwi" else old):
        raise ValueError(f"{where}: weight_layout={weight_layout!r} expects shape "
                         f"{new if weight_layout == 'ohwi' else old}, got {array.shape}")
    return array if weight_layout == "ohwi" else np.ascontiguousarray(array.transpose(0, 2, 3, 1))


def read(group: Any, into: Conv2d, weight_layout: str | None = None) -> Conv2d:
    """Load an rl_tools conv2d group into the layer `into` (state, and gradients where the
    group has them), after checking every attribute the group has against the layer's spec
    and every dataset's shape; nothing changes on a mismatch. Returns `into`."""
    if not isinstance(into, Conv2d):
        raise TypeError(f"into: expected a Conv2d, got {type(into).__name__}")
    spec = into.spec
    where = f"rl_tools group {getattr(group, 'name', '?')!r}"
    found = spec_from_group(group, spec.in_height, spec.in_width, batch_size=spec.batch_size, dtype=spec.dtype,
                            bn_momentum=spec.bn_momentum, bn_epsilon=spec.bn_epsilon, bias=spec.bias,
                            bn_running_var=spec.bn_running_var,
                            **({} if _attr(group, "activation_function") else {"activation": spec.activation}),
                            **({} if _attr(group, "normalization") else {"normalization": spec.normalization}))
    diff = found.differences(spec)
    if diff:
        raise ValueError(f"{where}: the group's layer differs from the one loaded into in "
                         + "; ".join(f"{k}: group {a!r}, layer {b!r}" for k, (a, b) in diff.items()))
    layout, glayout = state_layout(spec), grad_layout(spec)
    state, grads = {}, {}
    for name, sub in _GROUPS.items():
        if name not in layout:
            if sub in group:
                raise ValueError(f"{where}: holds {sub}/, which a {spec.normalization.value} layer does not have")
            continue
        if sub not in group or "parameters" not in group[sub]:
            raise ValueError(f"{where}: missing {sub}/parameters")
        for key, target in (("parameters", state), ("gradient", grads)):
            if key not in group[sub]:
                continue
            a = np.asarray(group[sub][key][()])
            if name == "weights":
                a = _weights(group, spec, a, weight_layout)
            shape, dt = layout[name]
            if a.shape != shape:
                raise ValueError(f"{where}: {sub}/{key}: expected shape {shape}, got {a.shape}")
            target[name] = a.astype(dt)
    for name in RUNNING:
        if name in layout:
            if name not in group:
                raise ValueError(f"{where}: missing dataset {name}")
            a = np.asarray(group[name][()])
            shape, dt = layout[name]
            if a.shape != shape:
                raise ValueError(f"{where}: {name}: expected shape {shape}, got {a.shape}")
            state[name] = a.astype(dt)
    if grads and set(grads) != set(glayout):
        raise ValueError(f"{where}: gradients for {sorted(grads)} only; expected all of {sorted(glayout)} or none")
    into.load_state_dict(state)  # checks values (finite, running_var >= 0) before changing anything
    if grads:
        into.load_grad_dict(grads)
    return into


def save(layer: Conv2d, path: str, name: str = "layer", **options: Any) -> None:
    """Write `layer` as the group `name` of a new HDF5 file at `path` (see `write`)."""
    with _h5py().File(path, "w") as f:
        write(layer, f.create_group(name), **options)


def load(path: str, into: Conv2d, name: str = "layer", **options: Any) -> Conv2d:
    """Read the group `name` of the HDF5 file at `path` into `into` (see `read`)."""
    with _h5py().File(path, "r") as f:
        if name not in f:
            raise ValueError(f"{path!r}: no group {name!r}; the file holds {sorted(f.keys())}")
        return read(f[name], into, **options)
