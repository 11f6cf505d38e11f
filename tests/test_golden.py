"""The host backends (the reference and cpu) reproduce the PyTorch-float64 golden files at every dtype."""

import pytest

from conftest import GOLDEN_DIR
from conv2d.testing.golden import MODES, check_case, golden_files, load_case, run_case

FILES = golden_files(GOLDEN_DIR)
DTYPES = ["float64", "float32", "float16", "bfloat16"]


def test_golden_files_are_present():
    assert len(FILES) >= 12, f"expected >= 12 golden files in tests/golden, found {len(FILES)}"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_host_backends_match_golden(path, dtype, mode, backend):
    case = load_case(path)
    check_case(case, run_case(case, dtype, mode, backend), dtype, mode)
