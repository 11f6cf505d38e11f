"""Saving and loading a layer (or a Sequential): one .npz file holding the specs and state.

File format (version 2), a NumPy .npz archive (zip) with:
- `header`: a uint8 array holding UTF-8 JSON: {"format": "conv2d", "version": 2,
  "spec": LayerSpec.to_dict(), "arrays": {name: {"dtype", "shape", "sha256"}},
  "header_sha256": ...} ("format": "conv2d-sequential" and "specs": [...] for a stack);
  `header_sha256` is over the canonical JSON of the rest of the header, so an edited
  spec is caught too (version 1 files, without it, still load);
- `state.<name>` for every state entry (weights, bias, gamma, beta, running_mean,
  running_var as the spec has them; "<layer index>.<name>" in a stack), C order;
  bfloat16 arrays are stored as their raw uint16 bits (npz has no bfloat16), the header
  naming the real dtype. `sha256` is over each array's raw bytes.

`load` reads the zip's end records, directory and header first and checks everything
it can before reading any array (a directory of at most MAX_DIRECTORY_BYTES within the
file, members stored uncompressed as `save` writes them, member names, declared sizes
against the arrays' shapes), so a load's memory is bounded by the arrays' own size, which
the file's own bytes hold, and a small constant: a zip bomb or a sparse file declaring a
huge directory is refused unread; any damage, foreign or tampered content raises
`ValueError` and no layer changes. State with NaN or infinite values (one NaN batch
makes the running statistics NaN) is saved and loaded as it is, with a RuntimeWarning,
so that a diverged run can be inspected: what `save` writes, `load` reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from conv2d.dtypes import storage_dtype
from conv2d.files import atomic_write, open_regular, writable_target
from conv2d.layer import Conv2d, layer_locks
from conv2d.sequential import Sequential
from conv2d.spec import CALL_FIELDS, DType, LayerSpec
from conv2d.checks import warn_non_finite
from conv2d.state import state_layout

FORMAT = "conv2d"
SEQUENTIAL_FORMAT = "conv2d-sequential"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MAX_HEADER_BYTES = 1 << 20
NPY_HEADER_SLACK = 1 << 16  # a .npy member's own header, beyond its array's bytes
MAX_ARRAY_BYTES = 1 << 40


def _dtype_name(dt: np.dtype) -> str:
    return "bfloat16" if dt == storage_dtype(DType.BFLOAT16) else dt.name


def _dtype_from_name(name: Any) -> np.dtype:
    if name == "bfloat16":
        return storage_dtype(DType.BFLOAT16)
    if name in ("float16", "float32", "float64", "int64"):  # int64: num_batches_tracked
        return np.dtype(name)
    raise ValueError(f"unknown dtype {name!r}")


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _header_digest(header: dict) -> str:
    rest = {k: v for k, v in header.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def save(layer: Conv2d | Sequential, path: str | os.PathLike) -> None:
    """Write a layer's (or a Sequential's) specs and state to `path` (.npz), atomically: a
    failed write leaves any existing file as it was. Written through a temporary file in
    the same directory, synced, then renamed over the target (through a symbolic link,
    the file it names); the file's mode is what `open` would give it (conv2d.files). An existing
    target that is not a regular file (a device, FIFO, directory) is refused. State with
    NaN or infinite values is written as it is, with a RuntimeWarning naming the array
    (a diverged run, kept for inspection). The layers' locks are held while the state is read, so an optimizer step
    in another thread is saved whole or not at all."""
    if isinstance(layer, Sequential):
        described = {"format": SEQUENTIAL_FORMAT, "specs": [item.spec.to_dict() for item in layer]}
    elif isinstance(layer, Conv2d):
        described = {"format": FORMAT, "spec": layer.spec.to_dict()}
    else:
        raise TypeError(f"layer: expected a Conv2d or a Sequential, got {type(layer).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
    with layer_locks(layer):  # one version of every layer's weights, not an optimizer step's half
        state = layer.state_dict()
    for k, v in state.items():
        warn_non_finite(f"save: state[{k!r}]", v)
    writable_target("save: path", path)  # before the work of packing the arrays
    header = {**described, "version": VERSION,
              "arrays": {k: {"dtype": _dtype_name(v.dtype), "shape": list(v.shape), "sha256": _digest(v)}
                         for k, v in state.items()}}
    header["header_sha256"] = _header_digest(header)
    payload = {"header": np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)}
    for k, v in state.items():
        payload[f"state.{k}"] = v.view(np.uint16) if _dtype_name(v.dtype) == "bfloat16" else v
    atomic_write("save: path", path, lambda f: np.savez(f, **payload))


def _check_header(where: str, header: Any) -> tuple[list[LayerSpec] | LayerSpec, dict[str, tuple[np.dtype, tuple, str]]]:
    """The specs and the declared arrays (dtype, shape, sha256) of a parsed header."""
    if not isinstance(header, dict) or header.get("format") not in (FORMAT, SEQUENTIAL_FORMAT):
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise ValueError(f"{where}: not a conv2d file (header format {got!r})")
    version = header.get("version")
    # JSON's true and 1.0 compare equal to 1, the version that has no checksum.
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise ValueError(f"{where}: file format version {version!r}, this conv2d reads {list(READABLE_VERSIONS)}")
    if version >= 2 and header.get("header_sha256") != _header_digest(header):
        raise ValueError(f"{where}: header checksum mismatch (the header was edited or damaged)")
    try:
        if header["format"] == SEQUENTIAL_FORMAT:
            if not isinstance(header["specs"], list) or not header["specs"]:
                raise ValueError("specs: expected a non-empty list")
            spec: list[LayerSpec] | LayerSpec = [LayerSpec.from_dict(d) for d in header["specs"]]
        else:
            spec = LayerSpec.from_dict(header["spec"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: invalid spec in header: {e}") from e
    described = header.get("arrays")
    if not isinstance(described, dict):
        raise ValueError(f"{where}: header 'arrays' is a {type(described).__name__}, expected a dict")
    arrays = {}
    for name, meta in described.items():
        try:
            if not isinstance(meta, dict):
                raise ValueError(f"a {type(meta).__name__}, expected a dict")
            dt = _dtype_from_name(meta.get("dtype"))
            shape = meta.get("shape")
            if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                       for d in shape)):
                raise ValueError(f"shape {shape!r}, expected a list of ints >= 0")
            if math.prod(shape) * dt.itemsize > MAX_ARRAY_BYTES:
                raise ValueError(f"shape {shape} declares more than {MAX_ARRAY_BYTES} bytes")
            digest = meta.get("sha256")
            if not isinstance(digest, str):
                raise ValueError(f"sha256 {digest!r}, expected a str")
        except ValueError as e:
            raise ValueError(f"{where}: array {name!r} in the header: {e}") from e
        arrays[str(name)] = (dt, tuple(shape), digest)
    _check_declared(where, spec, arrays)
    return spec, arrays


def _check_declared(where: str, spec: list[LayerSpec] | LayerSpec, arrays: dict[str, tuple]) -> None:
    """The declared arrays must be exactly the spec's state layout (names, dtypes, shapes):
    a header whose spec promises gigabytes over a few bytes of arrays is refused before
    any layer is built from it."""
    specs = spec if isinstance(spec, list) else [spec]
    layout = {(f"{i}.{k}" if isinstance(spec, list) else k): v
              for i, s in enumerate(specs) for k, v in state_layout(s).items()}
    if set(layout) != set(arrays):
        raise ValueError(f"{where}: the header lists arrays {sorted(arrays)}, its spec has {sorted(layout)}")
    for name, (shape, dt) in layout.items():
        got_dt, got_shape, _ = arrays[name]
        if got_dt != dt or got_shape != tuple(shape):
            raise ValueError(f"{where}: array {name!r}: the header declares {got_dt} {list(got_shape)}, its spec "
                             f"needs {dt} {list(shape)}")


# The zip's central directory: a conv2d file has a header and at most seven arrays a
# layer, about 100 bytes of directory each; 1 MiB holds thousands of layers.
MAX_DIRECTORY_BYTES = 1 << 20
_EOCD, _EOCD64, _LOCATOR64 = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"


def _check_directory(where: str, f: Any) -> None:
    """The zip's end records of the open file `f` read on their own, before zipfile reads
    the directory they declare: a directory larger than MAX_DIRECTORY_BYTES, or past the
    file's end (a sparse file declaring gigabytes), is refused unread."""
    size = os.fstat(f.fileno()).st_size
    tail_at = max(0, size - (22 + 0xFFFF + 20))  # the end record, its comment, the zip64 locator
    f.seek(tail_at)
    tail = f.read()
    at = tail.rfind(_EOCD)
    if at < 0 or at + 22 > len(tail):
        raise ValueError(f"{where}: not a readable conv2d file (no zip end record: not a zip archive, or truncated)")
    directory_size = int.from_bytes(tail[at + 12:at + 16], "little")
    directory_at = int.from_bytes(tail[at + 16:at + 20], "little")
    if 0xFFFFFFFF in (directory_size, directory_at) and at >= 20 and tail[at - 20:at - 16] == _LOCATOR64:
        record_at = int.from_bytes(tail[at - 12:at - 4], "little")
        if record_at + 56 > size:
            raise ValueError(f"{where}: the zip64 end record is placed past the file's end ({record_at})")
        f.seek(record_at)
        record = f.read(56)
        if record[:4] != _EOCD64:
            raise ValueError(f"{where}: no zip64 end record where its locator says ({record_at})")
        directory_size = int.from_bytes(record[40:48], "little")
        directory_at = int.from_bytes(record[48:56], "little")
    if directory_size > MAX_DIRECTORY_BYTES or directory_at + directory_size > size:
        raise ValueError(f"{where}: a zip directory of {directory_size} bytes at byte {directory_at} in a file of "
                         f"{size} bytes (more than a conv2d file's, or past its end); refused unread")


def _read(path: Path) -> tuple[list[LayerSpec] | LayerSpec, dict[str, np.ndarray]]:
    where = f"load({str(path)!r})"
    with open_regular(where, path) as opened:
        return _read_open(where, opened)


def _read_open(where: str, opened: Any) -> tuple[list[LayerSpec] | LayerSpec, dict[str, np.ndarray]]:
    try:
        _check_directory(where, opened)
        opened.seek(0)
        with zipfile.ZipFile(opened) as z:
            infos = {info.filename: info for info in z.infolist()}
            packed = [name for name, info in infos.items()
                      if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size]
            if packed:  # save stores every member; an inflated member's size is the file's word only
                raise ValueError(f"{where}: compressed members {sorted(packed)[:5]} (conv2d's save stores every "
                                 f"member uncompressed); refused before inflating them")
            head = infos.get("header.npy")
            if head is None:
                raise ValueError(f"{where}: not a conv2d file (no header; the archive holds {sorted(infos)[:10]})")
            if head.file_size > MAX_HEADER_BYTES:
                raise ValueError(f"{where}: a header of {head.file_size} bytes, more than a conv2d header's")
            with z.open(head) as f:
                raw = np.lib.format.read_array(f, allow_pickle=False)
            if raw.dtype != np.uint8 or raw.ndim != 1:
                raise ValueError(f"{where}: header stored as {raw.dtype} {raw.shape}, expected uint8 bytes")
            header = json.loads(raw.tobytes().decode())
            spec, declared = _check_header(where, header)
            expected = {"header.npy"} | {f"state.{k}.npy" for k in declared}
            if set(infos) != expected:
                raise ValueError(f"{where}: header lists arrays {sorted(declared)}, file holds "
                                 f"{sorted(n.removesuffix('.npy') for n in infos)}")
            for name, (dt, shape, _) in declared.items():
                size = infos[f"state.{name}.npy"].file_size
                need = math.prod(shape) * dt.itemsize
                if not need <= size <= need + NPY_HEADER_SLACK:
                    raise ValueError(f"{where}: array {name!r}: member of {size} bytes for a {dt} {list(shape)} "
                                     f"array of {need} bytes (refused before inflating it)")
            state = {}
            for name, (dt, shape, digest) in declared.items():
                with z.open(infos[f"state.{name}.npy"]) as f:
                    a = np.lib.format.read_array(f, allow_pickle=False)
                if dt == storage_dtype(DType.BFLOAT16):
                    if a.dtype != np.uint16:
                        raise ValueError(f"{where}: array {name!r}: bfloat16 bits stored as {a.dtype}")
                    a = a.view(dt)
                if a.dtype != dt or a.shape != shape:
                    raise ValueError(f"{where}: array {name!r}: header says {dt} {list(shape)}, array is {a.dtype} "
                                     f"{list(a.shape)}")
                if _digest(a) != digest:
                    raise ValueError(f"{where}: array {name!r}: checksum mismatch (the file was modified or damaged)")
                state[name] = np.asarray(a, order="C")  # (ascontiguousarray makes a 0-d array 1-d)
    except ValueError:
        raise
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as e:  # zipfile, zlib, npy-format, JSON, recursion and memory errors of a damaged file
        raise ValueError(f"{where}: not a readable conv2d file (truncated or corrupt?): {type(e).__name__}: {e}") from e
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
    parameters do not depend on. Any problem raises before a layer is changed: a damaged,
    tampered or foreign file a ValueError."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
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
        into.load_state_dict(state)  # its layout was checked with the header
        return into
    if into is not None:
        if not isinstance(into, Conv2d):
            raise TypeError(f"into: expected a Conv2d, got {type(into).__name__}")
        _check_same(path, spec, into.spec, "layer")
        into.load_state_dict(state)  # its layout was checked with the header
        return into
    layer = Conv2d(spec, backend, **backend_options)
    layer.load_state_dict(state)
    return layer


