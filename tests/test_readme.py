"""Every Python example of the README runs as written (on the CPU here; the PyTorch one
on a GPU too where there is one)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_example_runs_as_written(index, tmp_path, monkeypatch):
    code = BLOCKS[index]
    if "import torch" in code:
        pytest.importorskip("torch", reason="PyTorch is not installed (the torch extra brings it)")
    monkeypatch.chdir(tmp_path)  # examples write files (layer.npz, model.npz)
    exec(compile(code, f"README.md example {index}", "exec"), {"__name__": "readme_example"})
