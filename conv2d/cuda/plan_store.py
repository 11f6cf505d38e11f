"""Autotuned cuDNN plan choices kept across processes: a JSON file of the plan (engine id
and knob choices) that `autotune=True` timed fastest for each convolution graph, keyed by
the GPU's name, cuDNN's and the frontend's versions, the graph (forward, backward-data or
backward-filter), the convolution's shapes, dtype and TF32 choice.

Without a store every process times the plans again, and timing noise can pick another
plan, and so other rounding, in another process (docs/design.md). With one, the first
process to time a graph writes its choice and every later process on that kind of GPU
and cuDNN builds that plan without timing: the same plan, the same bits, every run. A
stored choice that this cuDNN cannot build is timed again and replaced.

Where: `use(path)` for this process, else the environment variable CONV2D_PLAN_STORE,
read at the first autotuned graph; neither: no store. The file is read when the store is
opened (a file that is not a plan store is refused then, naming it) and rewritten whole
(a temporary file, then os.replace) with each new choice, merged with what other
processes wrote meanwhile. `PlanStore.counts` says how the lookups went ("hits",
"misses").
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

ENV = "CONV2D_PLAN_STORE"
FORMAT = 1  # the file's "format"; another is refused


class PlanStore:
    """The choices in the JSON file at `path` (made at the first `put` if missing)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._plans = self._read()
        self.counts = {"hits": 0, "misses": 0}

    @staticmethod
    def key(**parts: Any) -> str:
        """The key of a graph, from its named parts (JSON values, tuples and enums with a
        `value` allowed): a canonical JSON text, readable in the file."""
        return json.dumps(parts, sort_keys=True, default=_plain)

    def get(self, key: str) -> tuple[int, dict[str, int]] | None:
        """(engine id, {knob name: choice}) stored for `key`, or None."""
        with self._lock:
            found = self._plans.get(key)
            self.counts["hits" if found is not None else "misses"] += 1
        return None if found is None else (found["engine"], dict(found["knobs"]))

    def put(self, key: str, engine: int, knobs: dict[str, int]) -> None:
        """Store the choice for `key` (merged with the file's current content)."""
        entry = {"engine": int(engine), "knobs": {str(k): int(v) for k, v in knobs.items()}}
        with self._lock:
            plans = self._read()  # what other processes stored since
            plans[key] = entry
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": FORMAT, "plans": plans}, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._plans = plans

    def _read(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        what = f"plan store {str(self.path)!r} ({ENV} or conv2d.cuda.plan_store.use)"
        try:
            data = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{what}: expected a JSON file of conv2d's plan choices, got one that does not "
                             f"read as JSON ({e})") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("plans"), dict):
            got = f"format {data.get('format')!r}" if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{what}: expected an object with format {FORMAT} and its plans, got {got}")
        for key, entry in data["plans"].items():
            if not (isinstance(entry, dict) and isinstance(entry.get("engine"), int)
                    and isinstance(entry.get("knobs"), dict)
                    and all(isinstance(v, int) for v in entry["knobs"].values())):
                raise ValueError(f"{what}: expected each plan as {{'engine': int, 'knobs': {{name: int}}}}, got "
                                 f"{entry!r} for {key}")
        return data["plans"]


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "value"):  # an enum (DType)
        return value.value
    raise TypeError(f"a plan key's part: expected JSON values, tuples or enums, got {value!r}")


_CURRENT: list = []  # [store or None] once chosen
_CURRENT_LOCK = threading.Lock()


def use(path: str | os.PathLike | None) -> PlanStore | None:
    """Keep this process's autotuned choices in the file at `path` (None: in none), in
    place of CONV2D_PLAN_STORE; returns the store. Graphs built before keep their plans."""
    store = None if path is None else PlanStore(path)
    with _CURRENT_LOCK:
        _CURRENT[:] = [store]
    return store


def current() -> PlanStore | None:
    """The process's store: `use`'s, else CONV2D_PLAN_STORE's (opened at the first call),
    else None."""
    with _CURRENT_LOCK:
        if not _CURRENT:
            path = os.environ.get(ENV)
            _CURRENT.append(PlanStore(path) if path else None)
        return _CURRENT[0]
