"""What the GPU extras install, and which nvidia-cudnn-frontend versions carry what
conv2d/cuda/cudnn.py uses. Needs pip and the package index; runs no GPU code.

    python scripts/extras_report.py [--extras cuda13,cuda12] [--frontends 1.12.0,1.24.0,1.28.0,1.32.0]

1. `pip install --dry-run --ignore-installed --report` of `.[EXTRA]` in a throwaway
   resolution: every package the extra brings, as a Markdown table (name, version,
   whether this project imports it; "resolves" is the check that the extra has no
   conflict).
2. For each frontend version: its wheel's required dependencies and which of the names
   cudnn.py calls its files contain (public graph API, autotune's `select_plan`, and the
   private fast path of `cudnn_execution.Execution`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What conv2d imports of an extra's packages, directly (the rest come as their needs).
IMPORTED = {"numba", "numba-cuda", "cuda-python", "cuda-bindings", "cuda-pathfinder", "nvidia-cudnn-cu12",
            "nvidia-cudnn-cu13", "nvidia-cudnn-frontend", "numpy", "ml-dtypes", "scipy", "tqdm"}
NAMES = {"public": ["deselect_numeric_notes", "get_plan_name_at_index", "execute_plan_at_index",
                    "get_workspace_size_plan_at_index", "build_plan_policy"],
         "autotune": ["select_plan"],
         "fast path": ["_execute_with_raw_ptrs", "_variant_pack_uids", "_materialize_backend_plan",
                       "to_backend_handle", "selected_engine"]}


def resolve(extra: str) -> list[tuple[str, str, int | None, list[str]]]:
    """(name, version, wheel bytes, the resolved packages that require it) for `.[extra]`."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(report), f"{ROOT}[{extra}]"], check=True)
        data = json.loads(report.read_text())
    items = {canonicalize_name(i["metadata"]["name"]): i for i in data["install"]}
    # The extras each package was asked for (numba-cuda[cu13] brings cuda-toolkit[...]
    # under `extra == "cu13"` markers), to a fixed point from the project's own extra.
    extras: dict[str, set[str]] = {k: set(i.get("requested_extras") or []) for k, i in items.items()}
    extras["conv2d"] = {extra}
    needed_by: dict[str, list[str]] = {k: [] for k in items}
    changed = True
    while changed:
        changed = False
        for parent, item in items.items():
            for text in item["metadata"].get("requires_dist", []):
                req = Requirement(text)
                child = canonicalize_name(req.name)
                if child not in items or not (req.marker is None or any(
                        req.marker.evaluate({"extra": e}) for e in extras[parent] | {""})):
                    continue
                if parent not in needed_by[child]:
                    needed_by[child].append(parent)
                    changed = True
                if not set(req.extras) <= extras[child]:
                    extras[child] |= set(req.extras)
                    changed = True
    names = {k: i["metadata"]["name"] for k, i in items.items()}
    return sorted((i["metadata"]["name"], i["metadata"]["version"], wheel_size(i["download_info"]["url"]),
                   [names[p] for p in needed_by[k]]) for k, i in items.items())


def wheel_size(url: str) -> int | None:
    """The file's size from the index's JSON simple API (PEP 691/700), None if not given."""
    import urllib.request

    if url.startswith("file://"):
        path = Path(urllib.request.url2pathname(url[len("file://"):]))
        return path.stat().st_size if path.is_file() else None
    if not url.startswith("https://"):
        return None
    filename = url.rsplit("/", 1)[1]
    project = filename.split("-", 1)[0].replace("_", "-").lower()
    request = urllib.request.Request(f"https://pypi.org/simple/{project}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            files = json.load(r)["files"]
    except OSError:
        return None
    return next((f.get("size") for f in files if f["filename"] == filename), None)


def frontend(version: str) -> tuple[list[str], dict[str, bool]]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_17_x86_64", "-d", tmp,
                        f"nvidia-cudnn-frontend=={version}"], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith("METADATA"))
            requires = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                        if line.startswith("Requires-Dist:") and "extra ==" not in line]
            blob = b"".join(z.read(n) for n in z.namelist() if n.endswith((".py", ".so", ".pyi")))
    found = {name: name.encode() in blob for names in NAMES.values() for name in names}
    return requires, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default="cuda13,cuda12")
    ap.add_argument("--frontends", default="1.12.0,1.20.0,1.24.0,1.26.0,1.28.0,1.29.1,1.32.0")
    args = ap.parse_args()
    for extra in args.extras.split(","):
        rows = resolve(extra)
        known = [size for *_, size, _ in rows if size is not None]
        print(f"\n### `.[{extra}]` resolves: {len(rows)} packages, {sum(known) / 1e6:.0f} MB of wheels\n")
        print("| package | version | wheel MB | why it is there |\n| --- | --- | ---: | --- |")
        for name, version, size, parents in rows:
            why = ["imported by conv2d"] if name.lower().replace("_", "-") in IMPORTED else []
            why += [f"required by {', '.join(p for p in parents)}"] if parents else []
            mb = "?" if size is None else f"{size / 1e6:.1f}"
            print(f"| {name} | {version} | {mb} | {'; '.join(why) or '(the project)'} |", flush=True)
    print("\n### nvidia-cudnn-frontend versions\n")
    print("| version | required dependencies | public API | select_plan (autotune) | private fast path |")
    print("| --- | --- | --- | --- | --- |")
    for version in args.frontends.split(","):
        requires, found = frontend(version)
        cells = ["all" if all(found[n] for n in NAMES[k]) else
                 "missing " + ", ".join(n for n in NAMES[k] if not found[n]) for k in NAMES]
        print(f"| {version} | {'; '.join(requires) or 'none'} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
