"""The loaders' fuzz, run as a program so that it runs under a memory cap of its own
(`resource.RLIMIT_AS`): `python tests/loader_fuzz.py DIR SEED CASES CAP_MB` writes a
good file of each format into DIR, loads CASES seeded mutations of each, and prints one
JSON line: per format, how many mutations loaded identically and how many were refused
with a ValueError, and every other outcome (an exception of another type, with its
message). A loader that allocates past the cap raises MemoryError, which counts as a
failure; a hang is caught by the caller's timeout."""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import sys
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np


def _spec():
    from conv2d import LayerSpec

    return LayerSpec(batch_size=2, in_height=6, in_width=5, in_channels=3, out_channels=4, kernel=3, padding=1,
                     activation="relu", normalization="batch_norm", dtype="float32")


def _layer():
    from conv2d import Conv2d

    layer = Conv2d(_spec())
    layer.init_weights(np.random.default_rng(0))
    return layer


def _flip(data: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        p = int(rng.integers(0, len(b)))
        b[p] ^= 1 << int(rng.integers(0, 8))
    return bytes(b)


def _truncate(data: bytes, rng: np.random.Generator) -> bytes:
    return data[:int(rng.integers(0, len(data)))]


def npz_mutations(good: Path, rng: np.random.Generator, out: Path) -> Callable[[int], None]:
    """Write mutation i of the .npz file `good` to `out`: a truncation, bit flips, a
    header edit with its checksum recomputed (a size, a field's type, the version), the
    members deflated (a header declaring up to 2**20 output channels over zero arrays: a bomb
    of a few hundred KB), or an end record declaring a directory of up to 1.5 GB in a
    sparse file of that size."""
    from conv2d.io import _header_digest

    data = good.read_bytes()
    edits: list[Callable[[dict], Any]] = [
        lambda h: h["spec"].__setitem__("out_channels", int(rng.choice([2 ** 20, 2 ** 26, 2 ** 33, 2 ** 62]))),
        lambda h: h["spec"].__setitem__("stride", [int(rng.choice([2 ** 31, 10 ** 29])), 1]),
        lambda h: h["spec"].__setitem__("padding", [2 ** 40, 0]),
        lambda h: h["spec"].__setitem__("in_channels", 1 << int(rng.integers(1, 40))),
        lambda h: h["arrays"]["weights"].__setitem__("shape", [1 << int(rng.integers(1, 40)), 3, 3, 3]),
        lambda h: h["arrays"]["bias"].__setitem__("dtype", str(rng.choice(["float64", "float16", "int8", "c8"]))),
        lambda h: h.__setitem__("version", [True, 1.0, "2", 3, None][int(rng.integers(0, 5))]),
        lambda h: h["spec"].__setitem__("bn_epsilon", float(rng.choice([0.0, -1.0, 1e300]))),
        lambda h: h["spec"].__setitem__("activation", ["relu", 3, None, "nope"][int(rng.integers(0, 4))]),
        lambda h: h.__setitem__("arrays", {}),
    ]

    def header_edit() -> None:
        import zipfile

        with np.load(good) as f:
            arrays = {k: f[k].copy() for k in f.files}
        header = json.loads(arrays["header"].tobytes())
        edits[int(rng.integers(0, len(edits)))](header)
        header["header_sha256"] = _header_digest(header)
        arrays["header"] = np.frombuffer(json.dumps(header, sort_keys=True).encode(), np.uint8)
        with zipfile.ZipFile(out, "w") as z:  # np.savez's layout, written member by member
            for k, v in arrays.items():
                with z.open(f"{k}.npy", "w") as m:
                    np.lib.format.write_array(m, v, allow_pickle=False)

    def deflated() -> None:
        """The members written deflated, zeros streamed a block at a time (the writer must
        not hold what the bomb would inflate to, under the same memory cap)."""
        import zipfile

        from conv2d import LayerSpec
        from conv2d.state import state_layout

        with np.load(good) as f:
            header = json.loads(f["header"].tobytes())
        spec = dict(header["spec"], out_channels=int(rng.choice([2 ** 16, 2 ** 20])))
        layout = state_layout(LayerSpec.from_dict(spec))
        block = bytes(1 << 20)

        def zeros_digest(n: int) -> str:
            h = hashlib.sha256()
            for start in range(0, n, len(block)):
                h.update(block[:min(len(block), n - start)])
            return h.hexdigest()
        header["spec"] = spec
        header["arrays"] = {k: {"dtype": dt.name, "shape": list(shape),
                                "sha256": zeros_digest(math.prod(shape) * dt.itemsize)}
                            for k, (shape, dt) in layout.items()}
        header["header_sha256"] = _header_digest(header)
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            with z.open("header.npy", "w") as m:
                np.lib.format.write_array(m, np.frombuffer(json.dumps(header, sort_keys=True).encode(), np.uint8),
                                          allow_pickle=False)
            for k, (shape, dt) in layout.items():
                with z.open(f"state.{k}.npy", "w", force_zip64=True) as m:
                    np.lib.format.write_array_header_1_0(m, {"descr": np.lib.format.dtype_to_descr(dt),
                                                             "fortran_order": False, "shape": tuple(shape)})
                    n = math.prod(shape) * dt.itemsize
                    for start in range(0, n, len(block)):
                        m.write(block[:min(len(block), n - start)])

    def sparse_directory() -> None:
        b = bytearray(data)
        at = b.rfind(b"PK\x05\x06")
        declared = int(rng.choice([1 << 24, 1 << 28, 1_500_000_000]))
        b[at + 12:at + 16] = declared.to_bytes(4, "little")
        with open(out, "wb") as f:
            f.truncate(declared + len(b))
            f.seek(declared)
            f.write(bytes(b))

    def mutate(i: int) -> None:
        kind = i % 5
        if kind == 2:
            header_edit()
        elif kind == 3:
            deflated()
        elif kind == 4:
            sparse_directory()
        else:
            out.write_bytes(_truncate(data, rng) if kind == 0 else _flip(data, rng))
    return mutate


def h5_mutations(good: Path, rng: np.random.Generator, out: Path, secret: Path) -> Callable[[int], None]:
    """Write mutation i of the rl_tools file `good` to `out`: a truncation, bit flips, or a
    crafted edit (external storage, a virtual dataset, links, huge or odd datasets,
    attributes out of range)."""
    import h5py

    data = good.read_bytes()
    shape = (4, 3, 3, 3)

    def dataset(make: Callable[[Any, str], Any]) -> Callable[[Any], None]:
        def edit(f: Any) -> None:
            g = f["layer/weights"]
            del g["parameters"]
            make(g, "parameters")
        return edit

    def virtual(g: Any, n: str) -> None:
        layout = h5py.VirtualLayout(shape=shape, dtype=np.float32)
        layout[...] = h5py.VirtualSource(str(out.parent / "missing.h5"), "w", shape=shape)
        g.create_virtual_dataset(n, layout, fillvalue=0)

    crafted: list[Callable[[Any], None]] = [
        dataset(lambda g, n: g.create_dataset(n, shape=shape, dtype=np.float32, external=[(str(secret), 0, 432)])),
        dataset(virtual),
        dataset(lambda g, n: g.__setitem__(n, h5py.SoftLink("/nowhere"))),
        dataset(lambda g, n: g.__setitem__(n, h5py.SoftLink("/layer/weights/parameters"))),
        dataset(lambda g, n: g.__setitem__(n, h5py.ExternalLink(str(secret), "/w"))),
        dataset(lambda g, n: g.create_dataset(n, shape=(int(rng.choice([2 ** 31, 2 ** 40])),), dtype=np.float32)),
        dataset(lambda g, n: g.create_dataset(n, shape=shape, dtype=[np.complex64, np.int64, h5py.string_dtype(),
                                                                     np.dtype([("a", "f4")])][int(rng.integers(0, 4))])),
        dataset(lambda g, n: g.create_group(n)),
        lambda f: f["layer"].attrs.__setitem__("output_channels", str(int(rng.choice([2 ** 26, 2 ** 33, 10 ** 29])))),
        lambda f: f["layer"].attrs.__setitem__("stride_h", str(10 ** 29)),
        lambda f: f["layer"].attrs.__setitem__("kernel_height", np.arange(3)),
        lambda f: f["layer"].attrs.__setitem__(str(rng.choice(["activation_function", "normalization"])), "??"),
        lambda f: f["layer/running_var"].__setitem__(slice(None), -1.0),
        # a chunk bomb: 4 values in one gzip chunk of up to 2**24 (64 MiB inflated; larger
        # ones would not be written under the fuzz's own memory cap)
        lambda f: _rechunk(f["layer"], "running_mean", (int(rng.choice([2 ** 20, 2 ** 24])),)),
    ]

    def heap_object_size() -> None:
        """One string object's size in the global heap grown by 16 (0x01 -> 0x11 in its
        low byte), the change that made the library spin."""
        b = bytearray(data)
        at = b.find(b"GCOL") + 16
        objects = []
        while at + 16 <= len(b) and int.from_bytes(b[at:at + 2], "little") != 0 and len(objects) < 200:
            objects.append(at)
            at += 16 + (int.from_bytes(b[at + 8:at + 16], "little") + 7) // 8 * 8
        b[objects[int(rng.integers(0, len(objects)))] + 8] ^= 0x10
        out.write_bytes(bytes(b))

    def mutate(i: int) -> None:
        kind = i % 4
        if kind == 2:
            out.write_bytes(data)
            with h5py.File(out, "a") as f:
                crafted[int(rng.integers(0, len(crafted)))](f)
        elif kind == 3:
            heap_object_size()
        else:
            out.write_bytes(_truncate(data, rng) if kind == 0 else _flip(data, rng))
    return mutate


def _rechunk(group: Any, name: str, chunks: tuple[int, ...]) -> None:
    values = group[name][()]
    del group[name]
    group.create_dataset(name, data=values, chunks=chunks, maxshape=(None,) * len(chunks), compression="gzip")


# Cases loaded at once: an HDF5 case reads in a child process (rltools.load), so two
# at a time halve the fuzz's time on CI's two cores.
WORKERS = max(1, min(2, os.cpu_count() or 1))


# The most a load of the fuzz's small layer may allocate (traced by tracemalloc, the
# .npz loads; the HDF5 reader children's peak resident size is reported beside): its
# arrays are a few KB, so this is "a small constant", whatever a file declares.
PEAK_BOUND_MB = 64
CHILD_PEAK_BOUND_MB = 512


def _outcome(load: Callable[[Path], Any], path: Path, want: dict[str, np.ndarray]) -> str:
    """"identical", "refused", or what else loading `path` gave."""
    try:
        got = load(path).state_dict()
    except ValueError:
        return "refused"
    except Exception as e:  # noqa: BLE001  (what the fuzz is for: anything else is a finding)
        return f"{type(e).__name__}: {str(e)[:200]}"
    same = got.keys() == want.keys() and all(np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8))
                                             for k in want)
    return "identical" if same else "loaded, but not the saved state"


def run(directory: Path, seed: int, cases: int) -> dict[str, Any]:
    """Each format's mutations written in order (one seeded generator), each to a file of
    its own, then loaded WORKERS at a time."""
    from concurrent.futures import ThreadPoolExecutor

    import conv2d
    from conv2d import Conv2d, rltools

    rng = np.random.default_rng(seed)
    layer = _layer()
    want = layer.state_dict()
    good_npz, good_h5 = directory / "good.npz", directory / "good.h5"
    conv2d.save(layer, good_npz)
    rltools.save(layer, good_h5)
    secret = directory / "secret"
    secret.write_bytes(np.arange(108, dtype=np.float32).tobytes())
    formats = {
        "npz": (npz_mutations(good_npz, rng, directory / "m.npz"), directory / "m.npz", conv2d.load),
        "h5": (h5_mutations(good_h5, rng, directory / "m.h5", secret), directory / "m.h5",
               lambda path: rltools.load(path, into=Conv2d(_spec()))),
    }
    report: dict[str, Any] = {}
    for name, (mutate, out, load) in formats.items():
        paths = []
        for i in range(cases):
            mutate(i)
            paths.append(directory / f"case-{name}-{i}{out.suffix}")
            os.replace(out, paths[-1])  # moved, not copied: a sparse case is gigabytes on paper
        over = []
        if name == "npz":  # in this process, one at a time: each case's peak traced alone
            outcomes = []
            tracemalloc.start()
            for i, path in enumerate(paths):
                tracemalloc.reset_peak()
                outcomes.append(_outcome(load, path, want))
                peak = tracemalloc.get_traced_memory()[1] >> 20
                if peak > PEAK_BOUND_MB:
                    over.append(f"case {i}: {peak} MB")
            tracemalloc.stop()
        else:
            with ThreadPoolExecutor(WORKERS) as pool:
                outcomes = list(pool.map(lambda path: _outcome(load, path, want), paths))
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss >> 10  # KB on Linux
            if peak > CHILD_PEAK_BOUND_MB:
                over.append(f"a reader child: {peak} MB")
        for path in paths:
            path.unlink()  # the sparse files are large on paper
        report[name] = {"identical": outcomes.count("identical"), "refused": outcomes.count("refused"),
                        "other": [f"case {i}: {o}" for i, o in enumerate(outcomes) if o not in ("identical", "refused")],
                        "over_memory_bound": over}
    return report


def main(argv: list[str]) -> int:
    directory, seed, cases, cap_mb = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (cap_mb << 20, cap_mb << 20))
    print(json.dumps(run(directory, seed, cases)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    sys.exit(main(sys.argv[1:]))
