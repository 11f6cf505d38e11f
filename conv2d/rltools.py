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

What rl_tools' loader requires is always written: every parameter's `gradient` and both
Adam moments (rl_tools' loader opens them whenever its Adam persist code is compiled in,
and throws where they are missing): the layer's accumulated gradients (zeros with
`gradient=False`), and the moments of the `optimizer` given (a `conv2d.optim.Adam` over the
layer), else zeros. A bias-free layer is written with zero biases (rl_tools' layers always
have them; the outputs are the same), and read back into a bias-free layer only when they
are zero. Files this library writes carry the attribute `conv2d_weight_layout="ohwi"`,
so that they read back without `weight_layout=` whatever their shapes.

Datasets are written with HDF5's Fletcher-32 checksum filter, so a damaged value in a
file of ours fails to read instead of loading. Reading trusts nothing in the file: every
dataset is checked before any of it is read (a hard link, no external raw storage, no
virtual dataset, a real floating-point dtype, the shape the layer needs), so a crafted
file can neither make the reader open another file nor allocate more than the layer's own
arrays; links (soft, external) are refused, and any damage is a ValueError naming the
dataset (conv2d/hdf5_safe.py).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from conv2d.activations import Activation
from conv2d import hdf5_safe
from conv2d.files import atomic_write, open_regular
from conv2d.layer import Conv2d, layer_locks
from conv2d.spec import LayerSpec, Normalization
from conv2d.state import RUNNING_STATISTICS, check_arrays, grad_layout, state_layout

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


WEIGHT_LAYOUT_ATTRIBUTE = "conv2d_weight_layout"  # written by this library: weights are (OC, KH, KW, IC)


def _tensor(group: Any, name: str, value: np.ndarray) -> None:
    # HDF5's Fletcher-32 filter (built into every HDF5, read transparently by rl_tools'
    # HighFive) checksums each chunk: a damaged value is a read error, never a weight.
    ds = group.create_dataset(name, data=value, chunks=value.shape or None, fletcher32=value.ndim > 0)
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
    for name, value, plain in (("groups", spec.groups, 1), ("dilation", spec.dilation, (1, 1)),
                               ("padding_mode", spec.padding_mode, "zeros"), ("padding_end", spec.padding_end,
                                                                                spec.padding),
                               ("bn_affine", spec.bn_affine, True),
                               ("bn_track_running_stats", spec.bn_track_running_stats, True)):
        if value != plain:
            raise ValueError(f"{name}: rl_tools' conv2d layer has no {name} (got {name}={value!r}); it would read "
                             f"the weights as a plain convolution's")
    if spec.normalization is Normalization.BATCH_NORM and spec.bn_momentum is None:
        raise ValueError("bn_momentum: rl_tools' conv2d layer keeps no batch count, which the cumulative average "
                         "(bn_momentum=None) needs; save this layer with conv2d.io.save")
    return {"type": "conv2d", "output_channels": str(spec.out_channels), "input_channels": str(spec.in_channels),
            "kernel_height": str(spec.kernel[0]), "kernel_width": str(spec.kernel[1]),
            "stride_h": str(spec.stride[0]), "stride_w": str(spec.stride[1]), "padding_h": str(spec.padding[0]),
            "padding_w": str(spec.padding[1]), "activation_function": _ACTIVATIONS[spec.activation],
            "normalization": _NORMS[spec.normalization]}


def _adam_index(optimizer: Any, layer: Conv2d, what: str) -> int:
    """The index of `layer` among the layers of `optimizer`, a conv2d.optim.Adam."""
    from conv2d.optim import Adam

    if not isinstance(optimizer, Adam):
        raise TypeError(f"optimizer: expected a conv2d.optim.Adam (rl_tools stores Adam's moments), got "
                        f"{type(optimizer).__name__}")
    for i, other in enumerate(optimizer.layers):
        if other is layer:
            return i
    raise ValueError(f"optimizer: an Adam over {len(optimizer.layers)} layers, none of which is the layer {what}")


def write(layer: Conv2d, group: Any, gradient: bool = True, optimizer: Any = None,
          pre_activations: bool = False) -> None:
    """Write `layer` into the empty h5py group `group` in rl_tools' layout: parameters,
    gradients (the accumulated ones; zeros with `gradient=False`), Adam's two moments
    (those of `optimizer`, a conv2d.optim.Adam over the layer, else zeros), running
    statistics, and with `pre_activations` the last forward's. A bias-free layer is
    written with zero biases (see the module docstring)."""
    if not isinstance(layer, Conv2d):
        raise TypeError(f"layer: expected a Conv2d, got {type(layer).__name__}")
    if not isinstance(gradient, bool):
        raise TypeError(f"gradient: expected a bool, got {gradient!r}")
    spec = layer.spec
    attrs = attributes(spec)
    moments: dict[str, np.ndarray] = {}
    if optimizer is not None:
        i = _adam_index(optimizer, layer, "written")
        arrays = optimizer.state_dict()["arrays"]
        moments = {f"{name}.{k}": arrays[f"{i}.{name}.{k}"] for name in grad_layout(spec) for k in ("m", "v")}
    if len(group.keys()) or len(group.attrs.keys()):
        raise ValueError(f"group: expected an empty group, got one holding {sorted(group.keys())}")
    state, grads = layer.state_dict(), layer.grad_dict()
    if not spec.bias:
        state["bias"] = np.zeros(spec.out_channels, state["weights"].dtype)
        grads["bias"] = state["bias"]
    for name, sub in _GROUPS.items():
        if name not in state:
            continue
        g = group.create_group(sub)
        zeros = np.zeros_like(_stored(state[name]))
        _tensor(g, "parameters", _stored(state[name]))
        _tensor(g, "gradient", _stored(grads[name]) if gradient else zeros)
        for moment, k in zip(ADAM_MOMENTS, ("m", "v")):
            _tensor(g, moment, _stored(moments[f"{name}.{k}"]) if f"{name}.{k}" in moments else zeros)
    for name in RUNNING_STATISTICS:
        if name in state:
            _tensor(group, name, _stored(state[name]))
    if pre_activations and layer.pre_activations is not None:
        _tensor(group, "pre_activations", _stored(layer.pre_activations))
    for k, v in {**attrs, WEIGHT_LAYOUT_ATTRIBUTE: "ohwi"}.items():
        group.attrs[k] = v


def _weight_shapes(spec: LayerSpec) -> dict[str, tuple[int, ...]]:
    """The weights' shape in each layout rl_tools has used: "ohwi" (OC, KH, KW, IC), now,
    and "oihw" (OC, IC, KH, KW), older files."""
    oc, kh, kw, ic = spec.weight_shape
    return {"ohwi": (oc, kh, kw, ic), "oihw": (oc, ic, kh, kw)}


def wanted(spec: LayerSpec) -> dict[str, list[tuple[int, ...]]]:
    """The datasets a group of a layer of `spec` may hold, with their allowed shapes (the
    weights in either layout): what `hdf5_safe.snapshot` reads."""
    out: dict[str, list[tuple[int, ...]]] = {}
    for name, sub in _GROUPS.items():
        shapes = list(_weight_shapes(spec).values()) if name == "weights" else [(spec.out_channels,)]
        for key in ("parameters", "gradient") + ADAM_MOMENTS:
            out[f"{sub}/{key}"] = shapes
    for name in RUNNING_STATISTICS:
        out[name] = [(spec.out_channels,)]
    return out


def spec_from_group(group: Any, in_height: int, in_width: int, **fields: Any) -> LayerSpec:
    """The LayerSpec of an rl_tools conv2d group (an h5py group, or a snapshot of one):
    its sizes, activation and norm from the attributes, the input size from the caller
    (rl_tools does not store it), and any other field (`dtype`, `bn_momentum`,
    `bn_epsilon`, `batch_size`) from `fields`."""
    if not isinstance(group, dict):
        group = {"name": group.name, "attrs": {k: hdf5_safe.attribute_text(group.attrs[k]) for k in group.attrs}}
    where = f"rl_tools group {group['name']!r}"
    attrs = group["attrs"]
    if attrs.get("type") != "conv2d":
        raise ValueError(f"{where}: attribute type is {attrs.get('type')!r}, expected 'conv2d'")
    values = {}
    for key in ("output_channels", "input_channels", "kernel_height", "kernel_width", "stride_h", "stride_w",
                "padding_h", "padding_w"):
        text = attrs.get(key)
        if text is None or not (text.isascii() and text.isdigit()) or len(text) > 12:
            raise ValueError(f"{where}: attribute {key} is {text!r}, expected a decimal integer")
        values[key] = int(text)
    activation = attrs.get("activation_function")
    norm = attrs.get("normalization")
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
    try:
        return LayerSpec(in_height=in_height, in_width=in_width, **derived, **fields)
    except ValueError as e:
        raise ValueError(f"{where}: the attributes give no valid layer: {e}") from e


def _weight_layout(snap: dict[str, Any], spec: LayerSpec, shape: tuple[int, ...], weight_layout: str | None) -> str:
    """Which layout the weights dataset of `shape` has: the caller's word, this library's
    marker, or the shape where it tells."""
    shapes = _weight_shapes(spec)
    new, old = shapes["ohwi"], shapes["oihw"]
    where = f"rl_tools group {snap['name']!r}: weights/parameters"
    marker = snap["attrs"].get(WEIGHT_LAYOUT_ATTRIBUTE)
    if marker is not None:
        if marker != "ohwi":
            raise ValueError(f"{where}: attribute {WEIGHT_LAYOUT_ATTRIBUTE} is {marker!r}, expected 'ohwi'")
        if weight_layout == "oihw":
            raise ValueError(f"weight_layout: 'oihw' given, but the file says its weights are (OC, KH, KW, IC) "
                             f"({WEIGHT_LAYOUT_ATTRIBUTE}='ohwi', written by conv2d)")
        weight_layout = "ohwi"
    if weight_layout is None:
        if new == old:
            raise ValueError(f"{where}: shape {shape} is both (OC, KH, KW, IC) and the older (OC, IC, KH, KW); "
                             f"say which with weight_layout='ohwi' or 'oihw'")
        weight_layout = "ohwi" if shape == new else "oihw"
    if shape != (new if weight_layout == "ohwi" else old):
        raise ValueError(f"{where}: weight_layout={weight_layout!r} expects shape "
                         f"{new if weight_layout == 'ohwi' else old}, got {shape}")
    return weight_layout


def _parameter(snap: dict[str, Any], sub: str, name: str, spec: LayerSpec, where: str,
               weight_layout: str | None) -> dict[str, np.ndarray]:
    """key -> array (in the layer's layout) of the parameter group `sub`: "parameters" and
    what else of "gradient" and Adam's moments it holds; {} where the group is absent."""
    if sub not in snap["members"]:
        return {}
    values = {key: snap["arrays"][f"{sub}/{key}"] for key in ("parameters", "gradient") + ADAM_MOMENTS
              if f"{sub}/{key}" in snap["arrays"]}
    if "parameters" not in values:
        raise ValueError(f"{where}: missing {sub}/parameters")
    if name == "weights":
        layout = _weight_layout(snap, spec, values["parameters"].shape, weight_layout)
        want = _weight_shapes(spec)[layout]
        for key, a in values.items():
            if a.shape != want:
                raise ValueError(f"{where}: {sub}/{key}: expected shape {want} as its parameters, got {a.shape}")
            if layout == "oihw":
                values[key] = np.ascontiguousarray(a.transpose(0, 2, 3, 1))
    return values


def read(group: Any, into: Conv2d, weight_layout: str | None = None, optimizer: Any = None) -> Conv2d:
    """Load an rl_tools conv2d group (an open h5py group) into the layer `into` (state, and
    gradients where the group has them; with `optimizer`, a conv2d.optim.Adam over `into`,
    also Adam's two moments, which the group must then hold for every parameter), after
    checking every attribute the group has against the layer's spec and every dataset (see
    the module docstring); nothing changes on a mismatch. Returns `into`. In this process:
    `load` reads a file in a child process, safe from the HDF5 library's crashes."""
    index = _check_load_arguments(into, weight_layout, optimizer)
    where = f"rl_tools group {getattr(group, 'name', '?')!r}"
    snap = hdf5_safe.snapshot(group, wanted(into.spec), where)
    return _apply(into, optimizer, index, *parse(snap, into.spec, weight_layout, optimizer is not None), where=where)


def parse(snap: dict[str, Any], spec: LayerSpec, weight_layout: str | None = None,
          moments: bool = False) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(state, gradients, Adam moments) of a snapshot (`hdf5_safe.snapshot`) of an rl_tools
    conv2d group, for a layer of `spec`. Gradients are {} where the group has none; moments
    ("<parameter>.m" and ".v") only with `moments`, which the group must then hold for
    every parameter."""
    where = f"rl_tools group {snap['name']!r}"
    attrs = snap["attrs"]
    found = spec_from_group(snap, spec.in_height, spec.in_width, batch_size=spec.batch_size, dtype=spec.dtype,
                            bn_momentum=spec.bn_momentum, bn_epsilon=spec.bn_epsilon, bias=spec.bias,
                            bn_running_var=spec.bn_running_var,
                            **({} if attrs.get("activation_function") else {"activation": spec.activation}),
                            **({} if attrs.get("normalization") else {"normalization": spec.normalization}))
    diff = found.differences(spec)
    if diff:
        raise ValueError(f"{where}: the group's layer differs from the one loaded into in "
                         + "; ".join(f"{k}: group {a!r}, layer {b!r}" for k, (a, b) in diff.items()))
    layout, glayout = state_layout(spec), grad_layout(spec)
    state: dict[str, np.ndarray] = {}
    grads: dict[str, np.ndarray] = {}
    adam: dict[str, np.ndarray] = {}
    for name, sub in _GROUPS.items():
        if name == "bias" and not spec.bias:
            values = _parameter(snap, sub, name, spec, where, weight_layout)
            if values and np.any(values["parameters"]):
                raise ValueError(f"{where}: {sub}/parameters holds nonzero biases; the bias=False layer loaded "
                                 f"into has none (load into a layer with bias=True)")
            continue
        if name not in layout:
            if sub in snap["members"]:
                raise ValueError(f"{where}: holds {sub}/, which a layer with normalization "
                                 f"{spec.normalization.value!r} does not have")
            continue
        values = _parameter(snap, sub, name, spec, where, weight_layout)
        if not values:
            raise ValueError(f"{where}: missing {sub}/parameters")
        dt = layout[name][1]
        state[name] = values["parameters"].astype(dt)
        if "gradient" in values:
            grads[name] = values["gradient"].astype(dt)
        if moments:
            missing = [m for m in ADAM_MOMENTS if m not in values]
            if missing:
                raise ValueError(f"{where}: {sub}/ lacks {missing}, which loading into an optimizer needs")
            adam[f"{name}.m"], adam[f"{name}.v"] = (values[m] for m in ADAM_MOMENTS)
    for name in RUNNING_STATISTICS:
        if name in layout:
            if name not in snap["arrays"]:
                raise ValueError(f"{where}: missing dataset {name}")
            state[name] = snap["arrays"][name].astype(layout[name][1])
    if grads and set(grads) != set(glayout):
        raise ValueError(f"{where}: gradients for {sorted(grads)} only; expected all of {sorted(glayout)} or none")
    return check_arrays("state", state, layout, warn_non_finite=True), grads, adam


def _check_load_arguments(into: Conv2d, weight_layout: str | None, optimizer: Any) -> int | None:
    """Check a load's arguments; the index of `into` among the optimizer's layers, if any."""
    if not isinstance(into, Conv2d):
        raise TypeError(f"into: expected a Conv2d, got {type(into).__name__}")
    if weight_layout not in (None, "ohwi", "oihw"):
        raise ValueError(f"weight_layout: expected None, 'ohwi' or 'oihw', got {weight_layout!r}")
    return None if optimizer is None else _adam_index(optimizer, into, "loaded into")


def _apply(into: Conv2d, optimizer: Any, index: int | None, state: dict[str, np.ndarray],
           grads: dict[str, np.ndarray], adam: dict[str, np.ndarray], where: str) -> Conv2d:
    """Load what `parse` gave into the layer (and layer `index` of the optimizer), all
    checked first."""
    adam_state = None
    if optimizer is not None:
        adam_state = _adam_state(optimizer, index, state, adam, where)
    into.load_state_dict(state)
    if grads:
        into.load_grad_dict(grads)
    if adam_state is not None:
        optimizer.load_state_dict(adam_state)
    return into


def _adam_state(optimizer: Any, index: int, state: dict[str, np.ndarray], moments: dict[str, np.ndarray],
                where: str) -> dict[str, Any]:
    """`optimizer`'s state_dict with layer `index`'s moments from the file (and its float32
    master copies of 16-bit parameters set to the loaded values), checked."""
    new = optimizer.state_dict()
    arrays = dict(new["arrays"])
    for name in (k for k in state if k not in RUNNING_STATISTICS):
        for key, value in ((f"{index}.{name}.m", moments[f"{name}.m"]), (f"{index}.{name}.v", moments[f"{name}.v"])):
            want = arrays[key]
            arrays[key] = value.astype(want.dtype).reshape(want.shape)
            if not np.isfinite(arrays[key]).all():
                raise ValueError(f"{where}: Adam moment of {name} for optimizer key {key!r} is not finite")
        if (arrays[f"{index}.{name}.v"] < 0).any():
            raise ValueError(f"{where}: the second moment of {name} has negative values")
        master = f"{index}.{name}.master"
        if master in arrays:
            arrays[master] = state[name].astype(arrays[master].dtype).reshape(arrays[master].shape)
    return {"t": new["t"], "arrays": arrays}


def save(layer: Conv2d, path: str | os.PathLike, name: str = "layer", gradient: bool = True,
         optimizer: Any = None, pre_activations: bool = False) -> None:
    """Write `layer` as the group `name` of a new HDF5 file at `path` (see `write`),
    atomically, as conv2d.save writes (conv2d.files)."""
    h5py = _h5py()
    if not isinstance(layer, Conv2d):
        raise TypeError(f"layer: expected a Conv2d, got {type(layer).__name__}")
    attributes(layer.spec)  # what rl_tools cannot hold is refused before a file is made
    if optimizer is not None:
        _adam_index(optimizer, layer, "written")

    def write_file(f: Any) -> None:
        # HDF5 1.8's format (every HDF5 since 2008 reads it) checksums its metadata too: a
        # damaged link or header is a read error, not another dataset's values. The file
        # is made in memory and written whole: a write that fails on disk (full, over a
        # size limit) is then one OSError here, where inside h5py it also printed
        # "Exception ignored" tracebacks as h5py's objects flushed while being freed.
        image = io.BytesIO()
        with h5py.File(image, "w", libver=("v108", "latest")) as h5:
            write(layer, h5.create_group(name), gradient, optimizer, pre_activations)
        f.write(image.getbuffer())
    with layer_locks([layer]):
        atomic_write("rltools.save: path", path, write_file)


LOAD_TIMEOUT_SECONDS = 120
_RUN_READER = "import sys; del sys.path[0]; import runpy; runpy.run_path(sys.argv[1], run_name='__main__')"


def load(path: str | os.PathLike, into: Conv2d, name: str = "layer", weight_layout: str | None = None,
         optimizer: Any = None) -> Conv2d:
    """Read the group `name` of the HDF5 file at `path` into `into` (see `read`).

    The file is read in a child process (`conv2d/hdf5_safe.py` run as a script, about the
    time of importing numpy and h5py): the HDF5 library can crash on a damaged or crafted
    file (fuzzing found a segmentation fault reading a corrupted attribute), and a crash
    there must be a ValueError here, not the end of the caller's process. A path that is
    no regular file, a file that is no HDF5, any damage or mismatch is a ValueError
    (FileNotFoundError and PermissionError pass through), and nothing changes in `into` or
    `optimizer` unless the whole file is good."""
    index = _check_load_arguments(into, weight_layout, optimizer)
    _h5py()
    where = f"rltools.load({str(path)!r})"
    with open_regular(where, path) as raw:  # opened once: the reader reads what was checked
        try:
            magic = raw.read(8)
        except OSError as e:  # a file the system will not read (/proc/self/mem, a failing disk)
            raise ValueError(f"{where}: the file cannot be read ({e.strerror or e})") from e
        if magic != b"\x89HDF\r\n\x1a\n":
            raise ValueError(f"{where}: not an HDF5 file")
        request = {"path": str(path), "fd": raw.fileno(), "name": name, "wanted": wanted(into.spec)}
        try:
            # Run by path, without conv2d/ (or the working directory) on sys.path: conv2d/io.py
            # would shadow the standard library's io there. PYTHONPATH is kept (h5py may be
            # there). The child reads the file through the descriptor opened here.
            done = subprocess.run([sys.executable, "-c", _RUN_READER, hdf5_safe.__file__],
                                  input=json.dumps(request).encode(), capture_output=True,
                                  timeout=LOAD_TIMEOUT_SECONDS, pass_fds=(raw.fileno(),))
        except subprocess.TimeoutExpired as e:
            raise ValueError(f"{where}: reading took more than {LOAD_TIMEOUT_SECONDS} s (a damaged file?)") from e
    message = done.stderr.decode(errors="replace").strip()
    if done.returncode == hdf5_safe.REFUSED:
        raise ValueError(message)
    if done.returncode < 0:
        raise ValueError(f"{where}: the HDF5 library crashed reading the file (signal {-done.returncode}): a "
                         f"damaged or crafted file")
    if done.returncode != 0:
        raise ValueError(f"{where}: not a readable rl_tools file (reader exit {done.returncode}): {message[-500:]}")
    snap = hdf5_safe.from_npz(done.stdout)
    return _apply(into, optimizer, index, *parse(snap, into.spec, weight_layout, optimizer is not None), where=where)
