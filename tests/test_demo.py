"""The main job: `conv2d demo` trains a student to match its teacher."""

import subprocess
import sys

import pytest

from conv2d.cli import main


@pytest.mark.parametrize("normalization", ["none", "batch_norm"])
def test_demo_reaches_its_target_and_says_so(capsys, normalization):
    assert main(["demo", "--quiet", "--normalization", normalization]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("demo: the student matches the teacher: held-out relative error")


def test_demo_fails_loudly_when_the_target_is_missed(capsys):
    assert main(["demo", "--quiet", "--steps", "3"]) == 1
    assert "does NOT match" in capsys.readouterr().out


def test_demo_writes_a_png_loss_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
    path = tmp_path / "loss.png"
    assert main(["demo", "--quiet", "--steps", "20", "--target", "10", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_dash_m_runs_the_demo():
    out = subprocess.run([sys.executable, "-m", "conv2d", "demo", "--quiet", "--steps", "5", "--target", "10"],
                         capture_output=True, text=True, check=True).stdout
    assert "the student matches the teacher" in out


def test_bad_steps_is_a_usage_error():
    with pytest.raises(SystemExit) as info:
        main(["demo", "--steps", "0"])
    assert info.value.code == 2
