"""The command line refuses bad options before any work, names what is wrong, and exits
non-zero when it did not do what was asked."""

import os
import sys

import pytest

from conv2d import __version__
from conv2d.cli import main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"conv2d {__version__}"


@pytest.mark.parametrize("backends", ["foo", "", ",", "reference,foo"])
def test_check_refuses_unknown_or_no_backends_as_a_usage_error(capsys, backends):
    with pytest.raises(SystemExit) as e:
        main(["check", "--backends", backends])
    assert e.value.code == 2
    assert "--backends: expected a comma list of reference, cpu, cuda" in capsys.readouterr().err


def test_check_fails_when_a_backend_it_was_asked_for_cannot_run(capsys):
    from conftest import HAVE_GPU

    if HAVE_GPU:
        pytest.skip("a GPU is here: the cuda backend runs")
    assert main(["check", "--backends", "cuda"]) == 1
    assert "--backends names cuda, which cannot run here" in capsys.readouterr().out


@pytest.mark.parametrize("specs", [",", " , "])
def test_check_refuses_a_specs_list_that_names_none_as_a_usage_error(capsys, specs):
    with pytest.raises(SystemExit) as e:
        main(["check", "--specs", specs])
    assert e.value.code == 2 and "--specs: expected a comma list of golden spec names" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed: expected an int >= 0, got -1"),
    (["--lr", "1e308"], "--lr: expected a number the optimizer's float32 arithmetic holds"),
    (["--batch-size", "1000000000"], "--batch-size: expected an int in [1, 65536], got 1000000000"),
    (["--task", "fit", "--steps", "99999999999999999999"], "--steps: expected an int in [1, 2147483647]"),
    (["--plot", "/proc/x.png"], "--plot: no file can be written in '/proc'"),
])
def test_demo_refuses_values_it_cannot_run_with_as_usage_errors_before_any_work(capsys, argv, message):
    if argv[-1].startswith("/proc") and not os.path.isdir("/proc"):
        pytest.skip("no /proc on this system")
    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_ctrl_c_ends_the_demo_with_one_line_and_status_130():
    import signal
    import subprocess
    import time

    pytest.importorskip("sklearn", reason="scikit-learn (the demo extra) is not installed")
    proc = subprocess.Popen([sys.executable, "-m", "conv2d", "demo", "--epochs", "1000", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    line = ""
    while time.time() < deadline and "demo:" not in line:  # training has started
        line = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1] == "conv2d: interrupted" and "Traceback" not in err


@pytest.mark.parametrize("lr", ["nan", "-1", "inf", "0"])
def test_demo_refuses_a_learning_rate_that_is_not_finite_and_positive_before_training(capsys, lr):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--lr", lr])
    assert e.value.code == 2 and "--lr: expected a finite number > 0" in capsys.readouterr().err


def test_demo_refuses_a_plot_path_in_a_missing_directory_before_training(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--plot", str(tmp_path / "missing" / "c.png")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_demo_refuses_a_plot_path_that_is_not_a_regular_file(capsys, tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit) as e:
        main(["demo", "--plot", str(fifo)])
    assert e.value.code == 2 and "is a FIFO" in capsys.readouterr().err


def test_demo_on_cuda_without_a_gpu_names_the_librarys_error(capsys):
    from conftest import HAVE_GPU

    if HAVE_GPU:
        pytest.skip("a GPU is here")
    assert main(["demo", "--backend", "cuda"]) == 1
    assert "CudaUnavailableError" in capsys.readouterr().err


def test_breakout_without_minatar_names_the_breakout_extra(monkeypatch):
    from conv2d.demos import breakout

    monkeypatch.setitem(sys.modules, "minatar", None)
    with pytest.raises(SystemExit, match=r"pip install 'conv2d\[breakout\]'"):
        breakout._environment(0)


def test_a_plot_interrupted_while_written_leaves_no_truncated_file(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from conv2d.demos.common import save_figure

    path = tmp_path / "curves.png"
    path.write_bytes(b"old")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])

    def interrupted(f, **kw):
        f.write(b"\x89PNG partial")
        raise KeyboardInterrupt
    fig.savefig = interrupted
    with pytest.raises(KeyboardInterrupt):
        save_figure(fig, str(path))
    assert path.read_bytes() == b"old" and not list(tmp_path.glob(".*.tmp"))
    fig2, ax2 = plt.subplots()
    ax2.plot([0, 1])
    save_figure(fig2, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
