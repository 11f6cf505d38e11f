"""The loaders' fuzz, run as a program so that it runs under a memory cap of its own
(`resource.RLIMIT_AS`): `python tests/loader_fuzz.py DIR SEED CASES CAP_MB` writes a
good file of each format into DIR, loads CASES seeded mutations of each, and prints one
JSON line: per format, how many mutations loaded identically and how many were refused
with a ValueError, and every other outcome (an exception of another type, with its
message). A loader that allocates past the cap raises MemoryError, which counts as a
failure; a hang is caught by the caller's timeout."""

from __future__ import annotations

import json
import os
import resource
import sys
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
    """Write mutation i of the .npz file `good` to `out`: a truncation, bit flips, or a
    header edit with its checksum recomputed (a size, a field's type, the version)."""
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

    def mutate(i: int) -> None:
        kind = i % 3
        if kind == 2:
            header_edit()
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
    ]

    def mutate(i: int) -> None:
        kind = i % 3
        if kind == 2:
            out.write_bytes(data)
            with h5py.File(out, "a") as f:
                crafted[int(rng.integers(0, len(crafted)))](f)
        else:
            out.write_bytes(_truncate(data, rng) if kind == 0 else _flip(data, rng))
    return mutate


# Cases loaded at once: an HDF5 case reads in a child process (rltools.load), so two
# at a time halve the fuzz's time on CI's two cores.
WORKERS = max(1, min(2, os.cpu_count() or 1))


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
    import shutil
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
            shutil.copyfile(out, paths[-1])
        with ThreadPoolExecutor(WORKERS) as pool:
            outcomes = list(pool.map(lambda path: _outcome(load, path, want), paths))
        report[name] = {"identical": outcomes.count("identical"), "refused": outcomes.count("refused"),
                        "other": [f"case {i}: {o}" for i, o in enumerate(outcomes) if o not in ("identical", "refused")]}
    return report


def main(argv: list[str]) -> int:
    directory, seed, cases, cap_mb = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (cap_mb << 20, cap_mb << 20))
    print(json.dumps(run(directory, seed, cases)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    sys.exit(main(sys.argv[1:]))
