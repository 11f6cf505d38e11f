"""Saving and loading a layer: one .npz file holding the spec and the state.

File format (version 1), a NumPy .npz archive (zip) with:
- `header`: a uint8 array holding UTF-8 JSON: {"format": "conv2d", "version": 1,
  "spec": LayerSpec.to_dict(), "arrays": {name: {"dtype", "shape", "sha256"}}};
- `state.<name>` for every state entry (weights, bias, gamma, beta, running_mean,
  running_var as the spec has them), C order; bfloat16 arrays are stored as their raw
  uint16 bits (npz has no bfloat16), the header naming the real dtype.
`sha256` is over each array's raw bytes, so truncation or tampering is caught on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from conv2d.dtypes import storage_dtype
from conv2d.layer import Conv2d
from conv2d.sequential import Sequential
from conv2d.spec import CALL_FIELDS, DType, LayerSpec

FORMAT = "conv2d"
SEQUENTIAL_FORMAT = "conv2d-sequential"
VERSION = 1


def _dtype_name(dt: np.dtype) -> str:
    return "bfloat16" if dt == storage_dtype(DType.BFLOAT16) else dt.name


def _dtype_from_name(name: str) -> np.dtype:
    if name == "bfloat16":
        return storage_dtype(DType.BFLOAT16)
    if name in ("float16", "float32", "float64"):
        return np.dtype(name)
    raise ValueError(f"unknown dtype {name!r}")


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def save(layer: Conv2d | Sequential, path: str | os.PathLike) -> None:
    """Write a layer's (or a Sequential's) specs and state to `path` (.npz), atomically: a
    failed write leaves any existing file as it was."""
    if isinstance(layer, Sequential):
        described = {"format": SEQUENTIAL_FORMAT, "specs": [item.spec.to_dict() for item in layer]}
    elif isinstance(layer, Conv2d):
        described = {"format": FORMAT, "spec": layer.spec.to_dict()}
    else:
        raise TypeError(f"layer: expected a Conv2d or a Sequential, got {type(layer).__name__}")
    path = Path(path)
    state = layer.state_dict()
    header = {
        **described,
        "version": VERSION,
        "arrays": {k: {"dtype": _dtype_name(v.dtype), "shape": list(v.shape), "sha256": _digest(v)}
                   for k, v in state.items()},
    }
    payload = {"header": np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)}
    for k, v in state.items():
        payload[f"state.{k}"] = v.view(np.uint16) if _dtype_name(v.dtype) == "bfloat16" else v
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **payload)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read(path: Path) -> tuple[list[LayerSpec] | LayerSpec, dict[str, np.ndarray]]:
    where = f"load({str(path)!r})"
    try:
        with np.load(path, allow_pickle=False) as archive:
            files = {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise ValueError(f"{where}: not a readable conv2d file (truncated or corrupt?): {e}") from e
    try:
        header = json.loads(files.pop("header").tobytes().decode())
    except (KeyError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: missing or unreadable header: {e!r}") from e
    if not isinstance(header, dict) or header.get("format") not in (FORMAT, SEQUENTIAL_FORMAT):
        raise ValueError(f"{where}: not a conv2d file (header format {header.get('format') if isinstance(header, dict) else header!r})")
    if header.get("version") != VERSION:
        raise ValueError(f"{where}: file format version {header.get('version')!r}, this conv2d reads {VERSION}")
    try:
        if header["format"] == SEQUENTIAL_FORMAT:
            if not isinstance(header["specs"], list) or not header["specs"]:
                raise ValueError("specs: expected a non-empty list")
            spec = [LayerSpec.from_dict(d) for d in header["specs"]]
        else:
            spec = LayerSpec.from_dict(header["spec"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: invalid spec in header: {e}") from e
    described = header.get("arrays", {})
    stored = {k[len("state."):]: v for k, v in files.items() if k.startswith("state.")}
    if set(described) != set(stored) or len(stored) != len(files):
        raise ValueError(f"{where}: header lists arrays {sorted(described)}, file holds {sorted(files)}")
    state = {}
    for name, meta in described.items():
        try:
            dt = _dtype_from_name(meta["dtype"])
            a = stored[name]
            if dt == storage_dtype(DType.BFLOAT16):
                if a.dtype != np.uint16:
                    raise ValueError(f"bfloat16 bits stored as {a.dtype}")
                a = a.view(dt)
            if a.dtype != dt or list(a.shape) != list(meta["shape"]):
                raise ValueError(f"header says {meta['dtype']} {meta['shape']}, array is {a.dtype} {list(a.shape)}")
            if _digest(a) != meta["sha256"]:
                raise ValueError("checksum mismatch (the file was modified or damaged)")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: array {name!r}: {e}") from e
        state[name] = a
    return spec, state


def _check_same(path: Path, file_spec: LayerSpec, layer_spec: LayerSpec, what: str) -> None:
    if not layer_spec.same_layer(file_spec):
        diff = "; ".join(f"{k}: file {a!r}, layer {b!r}" for k, (a, b) in
                         file_spec.differences(layer_spec, ignore=CALL_FIELDS).items())
        raise ValueError(f"load({str(path)!r}): the file's {what} differs from the one loaded into in {diff}")


def load(path: str | os.PathLike, backend: str = "reference", into: Conv2d | Sequential | None = None,
         **backend_options: Any) -> Conv2d | Sequential:
    """Read a file written by `save`. Returns a new layer (or Sequential) on `backend`, or,
    with `into`, loads the state into it and returns it; each layer's spec must equal the
    file's but for the planned batch size and input height and width, which the
    parameters do not depend on. Any problem raises before a layer is changed."""
    path = Path(path)
    spec, state = _read(path)
    if isinstance(spec, list):
        if into is None:
            into = Sequential.from_specs(spec, backend, **backend_options)
        if not isinstance(into, Sequential) or len(into) != len(spec):
            raise TypeError(f"into: expected a Sequential of {len(spec)} layers (the file's), got "
                            f"{type(into).__name__}" + (f" of {len(into)}" if isinstance(into, Sequential) else ""))
        for i, (file_spec, layer) in enumerate(zip(spec, into)):
            _check_same(path, file_spec, layer.spec, f"layer {i}")
        into.load_state_dict(state)
        return into
    if into is not None:
        if not isinstance(into, Conv2d):
            raise TypeError(f"into: expected a Conv2d, got {type(into).__name__}")
        _check_same(path, spec, into.spec, "layer")
        into.load_state_dict(state)
        return into
    layer = Conv2d(spec, backend, **backend_options)
    layer.load_state_dict(state)
    return layer
