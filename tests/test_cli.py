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
    assert "--backends: expected a comma list of reference, cuda" in capsys.readouterr().err


def test_check_fails_when_a_backend_it_was_asked_for_cannot_run(capsys):
    from conftest import HAVE_GPU

    if HAVE_GPU:
        pytest.skip("a GPU is here: the cuda backend runs")
    assert main(["check", "--backends", "cuda"]) == 1
    assert "--backends names cuda, which cannot run here" in capsys.readouterr().out


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
