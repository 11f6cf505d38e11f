"""The loaders against seeded damage and crafted content, both formats (`conv2d.load`'s .npz
and `conv2d.rltools.load`'s HDF5; compressed members and sparse zip directories, HDF5
chunk bombs and damaged global heaps among them): every mutation loads bitwise
identically or is refused with a ValueError; no other exception, no case's peak memory
past its bound, no allocation past a memory cap, no hang, no crash.
The fuzz runs as its own process (tests/loader_fuzz.py) under `resource.RLIMIT_AS`, which
its HDF5 reader processes inherit, and a timeout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("h5py", reason="h5py is not installed (the test extra brings it)")

CASES = 300  # per format: truncations, bit flips and header or crafted edits in turn
CAP_MB = 1024


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_damage_to_either_format_loads_identically_or_is_a_value_error(tmp_path, seed):
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(root / "tests" / "loader_fuzz.py"), str(tmp_path), str(seed),
                           str(CASES), str(CAP_MB)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name, counts in report.items():
        assert counts["other"] == [], f"{name}: {counts['other'][:10]}"
        assert counts["over_memory_bound"] == [], f"{name}: {counts['over_memory_bound'][:10]}"
        assert counts["identical"] + counts["refused"] == CASES
        assert counts["refused"] > CASES // 2, (name, counts)
