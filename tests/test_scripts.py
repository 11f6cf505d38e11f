"""Every script in scripts/ still starts: its --help runs (imports, argument parsing), so a
script cannot rot unnoticed while the library under it changes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Programs (a __main__ block); scripts/bench_shapes.py is the benchmark scripts' shared module.
SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_there_are_scripts_to_check():
    assert SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_prints_its_help(script):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower(), done.stdout[:500]
