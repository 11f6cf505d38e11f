"""Reading an HDF5 group without trusting the file (numpy and h5py only).

`snapshot(group, wanted)` reads a group's attributes (as strings), which of its members
exist, and the datasets named in `wanted` ({"sub/dataset": [allowed shapes]}), checking
each before reading any of it: reached through hard links only (a soft or external link
may name another file, dangle or loop: refused unfollowed), a dataset and not a group,
not virtual (it reads other files), no external raw storage (any file on disk), a real
floating-point dtype, one of the allowed shapes (so a crafted shape allocates nothing),
chunks no larger than the dataset (a compressed chunk is inflated whole: a chunk beyond
the dataset would allocate past what its shape allows), and storage for every value
(unallocated storage reads as a fill value, not as data). Before any of that the file's
global heaps (variable-length strings) are walked on its bytes (`check_global_heaps`):
a damaged one made the library loop for ever. Any failure is a ValueError naming the
member. A load's memory is so bounded by the arrays its spec allows.

The HDF5 C library itself can crash on a damaged file (fuzzing found a segmentation
fault reading a corrupted attribute), so `conv2d.rltools.load` runs this module as a
script in a child process: `python hdf5_safe.py` reads a JSON request on stdin
({"path", "name", "wanted"}, and "fd", a descriptor of the file the caller opened and
checked, which is read instead of the path) and writes the snapshot as an .npz on stdout, or a refusal
on stderr with exit status REFUSED. As a script it imports nothing of conv2d, so the
child starts in about the time of importing numpy and h5py.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import sys
from typing import Any

import numpy as np

REFUSED = 3  # the script's exit status for a file it refused (the reason on stderr)
META = "__snapshot__"  # the .npz member holding the attributes and members, as JSON bytes


def _h5py() -> Any:
    import h5py

    return h5py


def member(group: Any, name: str, where: str) -> Any:
    """group[name] if it is there as a hard link, None if absent; links refused unfollowed."""
    h5py = _h5py()
    link = group.get(name, getlink=True)
    if link is None:
        return None
    if not isinstance(link, h5py.HardLink):
        kind = "an external" if isinstance(link, h5py.ExternalLink) else "a soft"
        raise ValueError(f"{where}: {name!r} is {kind} link; rl_tools files hold no links (a link may name "
                         f"another file), refused unfollowed")
    return group[name]


def subgroup(group: Any, name: str, where: str) -> Any:
    """member(group, name) if it is a group (None if absent)."""
    obj = member(group, name, where)
    if obj is not None and not isinstance(obj, _h5py().Group):
        raise ValueError(f"{where}: {name!r} is a {type(obj).__name__}, expected a group")
    return obj


# Global heap collections (where variable-length strings, such as rl_tools' attributes,
# live): "GCOL", version 1, three reserved bytes, the collection's size in bytes (the
# superblock's size of lengths, 8 for every file h5py and rl_tools write), then objects of
# a 16-byte header (index, reference count, reserved, size) and their data padded to 8.
# A damaged object size made the HDF5 library loop for ever reading an attribute.
GLOBAL_HEAP_MIN_BYTES = 4096  # the library's smallest collection


def check_global_heaps(source: str | int, where: str) -> None:
    """ValueError where a global heap collection of the file does not hold objects that
    tile it: every object within the collection, no index twice, and the walk ending at
    the free-space object (index 0) whose size is exactly the rest of the collection, or
    at the collection's end. Checked on the
    file's bytes before the HDF5 library reads any of it."""
    import mmap

    with open(source, "rb", closefd=not isinstance(source, int)) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            start = m.find(b"GCOL")
            while start != -1:
                _check_collection(m, start, size, where)
                start = m.find(b"GCOL", start + 4)


def _check_collection(m: Any, start: int, size: int, where: str) -> None:
    if start + 16 > size or m[start + 4] != 1 or m[start + 5:start + 8] != b"\0\0\0":
        return  # not a collection header (raw data that happens to read "GCOL")
    length = int.from_bytes(m[start + 8:start + 16], "little")
    if length < GLOBAL_HEAP_MIN_BYTES:
        return
    end = start + length
    if end > size:
        raise ValueError(f"{where}: a global heap at byte {start} declares {length} bytes, past the file's end "
                         f"(damaged?); refused unread")
    pos, seen, whole = start + 16, set(), False
    while pos + 16 <= end:
        index = int.from_bytes(m[pos:pos + 2], "little")
        length = int.from_bytes(m[pos + 8:pos + 16], "little")
        if index == 0:  # free space: exactly the rest of the collection, its header included
            whole = length == end - pos
            break
        if index in seen or pos + 16 + length > end:
            break
        seen.add(index)
        pos += 16 + (length + 7) // 8 * 8
    else:
        whole = pos <= end  # full to the last bytes, too few for a free-space object
    if not whole:
        raise ValueError(f"{where}: the global heap at byte {start} (variable-length strings) does not hold "
                         f"whole objects (an object's size is damaged); refused unread")


def _allocated(ds: Any) -> bool:
    """Whether every value of `ds` has storage: a contiguous dataset all its bytes, a
    chunked one a chunk at every position of its chunk grid (a chunk indexed at another
    position leaves its own unread, as the fill value)."""
    if ds.size == 0:
        return True
    if ds.chunks is None:
        return ds.id.get_storage_size() == ds.size * ds.dtype.itemsize
    grid = [range(0, n, c) for n, c in zip(ds.shape, ds.chunks)]
    count = math.prod(len(axis) for axis in grid)
    if ds.id.get_num_chunks() != count or count > 1 << 16:
        return False
    found = {tuple(ds.id.get_chunk_info(i).chunk_offset) for i in range(count)}
    return found == set(itertools.product(*grid))


def dataset(group: Any, name: str, where: str, shapes: list[tuple[int, ...]]) -> np.ndarray | None:
    """The values of the dataset group[name] (None if absent), every check (see the module
    docstring) made before any of it is read."""
    obj = member(group, name, where)
    if obj is None:
        return None
    at = f"{where}: {group.name.rsplit('/', 1)[-1]}/{name}"
    if not isinstance(obj, _h5py().Dataset):
        raise ValueError(f"{at}: a {type(obj).__name__}, expected a dataset")
    if obj.is_virtual:
        raise ValueError(f"{at}: a virtual dataset (it reads other files); refused unread")
    if obj.external:
        raise ValueError(f"{at}: stored in external raw files {[e[0] for e in obj.external][:3]}; refused unread")
    dt = obj.dtype
    if dt.kind != "f" or dt.itemsize not in (2, 4, 8) or dt.fields is not None:
        raise ValueError(f"{at}: dtype {dt}, expected real floating point (float32 or float64)")
    if obj.shape not in shapes:
        expected = " or ".join(str(s) for s in dict.fromkeys(shapes))
        raise ValueError(f"{at}: expected shape {expected}, got {obj.shape} (refused unread)")
    if obj.chunks is not None and any(c > max(n, 1) for c, n in zip(obj.chunks, obj.shape)):
        raise ValueError(f"{at}: stored in chunks of {obj.chunks} values for a dataset of {obj.shape} (a chunk "
                         f"the library would inflate whole, beyond the dataset's own size); refused unread")
    if not _allocated(obj):
        raise ValueError(f"{at}: holds no data for some of its values (unallocated storage reads as the fill "
                         f"value, not as weights)")
    return np.asarray(obj[()])


def attribute_text(value: Any) -> str:
    """An attribute as text: a string as it is, anything else by its (shortened) repr."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else repr(value)[:80]


def snapshot(group: Any, wanted: dict[str, list[tuple[int, ...]]], where: str) -> dict[str, Any]:
    """{"name": the group's path, "attrs": {name: text}, "members": [first-level member
    names present], "arrays": {"sub/dataset" or "dataset": values}} of an HDF5 group, the
    datasets of `wanted` read after their checks (absent ones left out)."""
    attrs = {str(k): attribute_text(group.attrs[k]) for k in group.attrs.keys()}
    members = sorted(str(k) for k in group.keys())
    arrays = {}
    for path, shapes in wanted.items():
        sub, _, name = path.rpartition("/")
        parent = subgroup(group, sub, where) if sub else group
        if parent is None:
            continue
        a = dataset(parent, name, where, [tuple(s) for s in shapes])
        if a is not None:
            arrays[path] = a
    return {"name": group.name, "attrs": attrs, "members": members, "arrays": arrays}


def _main() -> int:
    request = json.loads(sys.stdin.buffer.read())
    h5py = _h5py()
    where = f"rl_tools file {request['path']!r}"
    try:
        # The descriptor the caller opened and checked (a regular file), else the path.
        source = request.get("fd", request["path"])
        check_global_heaps(source, where)
        with h5py.File(os.fdopen(source, "rb", closefd=False) if isinstance(source, int) else source, "r") as f:
            group = subgroup(f, request["name"], where)
            if group is None:
                raise ValueError(f"{where}: no group {request['name']!r}; the file holds {sorted(f.keys())[:20]}")
            snap = snapshot(group, request["wanted"], f"rl_tools group {group.name!r}")
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return REFUSED
    except Exception as e:  # noqa: BLE001  h5py's errors of a damaged file: OSError, KeyError, RuntimeError, ...
        print(f"{where}: not a readable rl_tools file (damaged?): {type(e).__name__}: {e}", file=sys.stderr)
        return REFUSED
    meta = json.dumps({k: snap[k] for k in ("name", "attrs", "members")}).encode()
    out = io.BytesIO()
    np.savez(out, **{META: np.frombuffer(meta, np.uint8)}, **snap["arrays"])
    sys.stdout.buffer.write(out.getvalue())
    return 0


def from_npz(data: bytes) -> dict[str, Any]:
    """The snapshot the script wrote."""
    with np.load(io.BytesIO(data), allow_pickle=False) as f:
        snap = json.loads(f[META].tobytes())
        snap["arrays"] = {k: f[k] for k in f.files if k != META}
    return snap


if __name__ == "__main__":
    sys.exit(_main())
