"""`conv2d check`: the shipped golden files on every backend here, a table and a verdict."""

import pytest

from conv2d.cli import main
from conv2d.testing.golden import golden_files
from conftest import GOLDEN_DIR

CHECKS = len(golden_files(GOLDEN_DIR)) * 4  # every golden spec at four dtypes


def test_check_passes_on_the_reference_backend_and_says_so(capsys):
    assert main(["check", "--backends", "reference"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| spec | dtype | backend | worst error / tolerance")
    assert sum("| reference |" in line for line in lines) == CHECKS
    assert lines[-1].startswith(f"conv2d check: all {CHECKS} checks passed")


def test_check_fails_with_exit_code_1_when_a_result_is_out_of_tolerance(capsys, monkeypatch):
    import conv2d.testing.golden as golden

    monkeypatch.setattr(golden, "tolerance", lambda dtype, n, jump=False: 1e-30)
    assert main(["check", "--backends", "reference"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and out.strip().splitlines()[-1].startswith(f"conv2d check: {CHECKS} of {CHECKS} checks FAILED")


def test_check_names_why_the_cuda_backend_is_not_checked(capsys):
    from conftest import HAVE_GPU

    if HAVE_GPU:
        pytest.skip("a GPU is here: the cuda backend is checked")
    assert main(["check"]) == 0
    assert capsys.readouterr().out.startswith("conv2d check: the cuda backend is not checked here:")


def test_check_runs_only_the_specs_named(capsys):
    assert main(["check", "--backends", "reference", "--specs", "relu_bn_nonsquare,gelu_original_ln"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert {row.split(" | ")[0][2:] for row in rows} == {"relu_bn_nonsquare", "gelu_original_ln"}
    assert len(rows) == 2 * 4  # two specs x the reference's four dtypes


def test_check_refuses_an_unknown_spec_name_and_lists_the_known_ones(capsys):
    assert main(["check", "--backends", "reference", "--specs", "relu_bn_nonsquare,nope"]) == 2
    out = capsys.readouterr().out
    assert "--specs: unknown ['nope']" in out and "'tanh_stride4_pad2'" in out
