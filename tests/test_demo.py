"""The main job, `conv2d demo`: the digits classifier reaches its held-out accuracy (a
correctness check, not a timing), the Breakout DQN runs (a short smoke run; the full run
is the demo's own), and the teacher-student fit still matches."""

import subprocess
import sys

import numpy as np
import pytest

from conv2d import LayerSpec, Sequential
from conv2d.cli import main
from conv2d.demos import breakout
from conv2d.optim import Adam

pytest.importorskip("sklearn", reason="scikit-learn (the demo extra) is not installed")


def test_the_digits_demo_reaches_its_held_out_accuracy_and_says_so(capsys):
    assert main(["demo", "--quiet"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("demo: held-out accuracy 0.9") and ">= target 0.98" in last


def test_the_digits_demo_fails_loudly_when_the_target_is_missed(capsys):
    assert main(["demo", "--quiet", "--epochs", "1", "--target", "0.999"]) == 1
    assert "< target 0.999" in capsys.readouterr().out


def test_the_digits_demo_writes_its_curves_as_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
    path = tmp_path / "digits.png"
    assert main(["demo", "--quiet", "--epochs", "2", "--target", "0", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_short_breakout_run_acts_trains_and_reports_its_return_curve(capsys, tmp_path):
    pytest.importorskip("minatar", reason="MinAtar (the demo extra) is not installed")
    pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
    path = tmp_path / "breakout.png"
    assert main(["demo", "--task", "breakout", "--quiet", "--steps", "400", "--seeds", "2", "--target", "0",
                 "--plot", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[1] for line in lines if line.startswith("demo: seed")] == [" seed 0", " seed 1"]
    last = lines[-1]
    assert last.startswith("demo: breakout mean return of the last 200 episodes, averaged over 2 seed(s)")
    assert "400 steps a seed" in last
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("normalization", ["none", "batch_norm"])
def test_the_fit_task_reaches_its_target_and_says_so(capsys, normalization):
    assert main(["demo", "--task", "fit", "--quiet", "--normalization", normalization]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("demo: the student matches the teacher: held-out relative error")


def test_the_fit_task_fails_loudly_when_the_target_is_missed(capsys):
    assert main(["demo", "--task", "fit", "--quiet", "--steps", "3"]) == 1
    assert "does NOT match" in capsys.readouterr().out


def test_python_dash_m_runs_the_demo():
    out = subprocess.run([sys.executable, "-m", "conv2d", "demo", "--quiet", "--epochs", "1", "--target", "0"],
                         capture_output=True, text=True, check=True).stdout
    assert "demo: held-out accuracy" in out


@pytest.mark.parametrize("flag", ["--steps", "--epochs", "--batch-size"])
def test_a_count_below_one_is_a_usage_error(flag):
    with pytest.raises(SystemExit) as info:
        main(["demo", flag, "0"])
    assert info.value.code == 2


def test_the_breakout_graphs_refuse_a_network_with_batch_norm_before_any_capture():
    q = Sequential.from_specs([LayerSpec(batch_size=4, in_height=10, in_width=10, in_channels=4, out_channels=3,
                                         kernel=10, normalization="batch_norm")], "reference")
    with pytest.raises(ValueError, match="^q: layer 0 has batch norm"):
        breakout._Graphs(q, q, Adam(q), 4, 3, np.dtype(np.float32))
