"""The house rules that keep the code readable as it grows (issue: architecture III): code
above the backends reads their declared capabilities, never their names; files,
functions and classes stay small; every path the docs cite exists; the README stays a
front door; nothing binary is tracked."""

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conv2d import backend

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "conv2d"
CODE_DIRS = ("conv2d", "scripts", "tests")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_CLASS_LINES = 600, 120, 400
README_MAX_LINES = 200


def python_files(*dirs):
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _named_strings(node):
    """The str constants of a comparison operand (one, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _named_strings(e)]
    return []


def backend_name_comparisons(source, names):
    """(line, name) of every comparison in `source` with a literal backend name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                found += [(node.lineno, s) for s in _named_strings(operand) if s in names]
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue):
            found += [(node.pattern.lineno, s) for s in _named_strings(node.pattern.value) if s in names]
    return found


def test_the_scan_finds_a_comparison_with_a_backend_name():
    source = 'if layer.backend == "cuda":\n    pass\nok = name in ("reference", "x")\nfine = kind == "numpy"\n'
    assert backend_name_comparisons(source, {"cuda", "reference"}) == [(1, "cuda"), (3, "reference")]


def test_no_code_above_the_backends_compares_a_backend_name():
    """Only a backend's own package and conv2d/torch/ (where "cuda" is a torch device) may
    name a backend in a comparison; everything else reads `conv2d.backend.Backend`'s
    declared capabilities, so that a new backend meets no name checks."""
    names = set(backend.backend_names())
    exempt = [PACKAGE / "torch"] + [PACKAGE / n for n in names if (PACKAGE / n).is_dir()]
    offences = []
    for path in python_files("conv2d"):
        if any(path.is_relative_to(d) for d in exempt):
            continue
        offences += [f"{path.relative_to(ROOT)}:{line}: {name!r}"
                     for line, name in backend_name_comparisons(path.read_text(), names)]
    assert not offences, "backend names compared outside their packages:\n" + "\n".join(offences)


def test_files_functions_and_classes_stay_within_their_size_limits():
    too_big = []
    for path in python_files(*CODE_DIRS):
        source = path.read_text()
        where = path.relative_to(ROOT)
        if source.count("\n") > MAX_FILE_LINES:
            too_big.append(f"{where}: {source.count(chr(10))} lines > {MAX_FILE_LINES}")
        for node in ast.walk(ast.parse(source)):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_big.append(f"{where}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines > "
                               f"{limit}")
    assert not too_big, "\n".join(too_big)


# A cited path: a word with a directory part and a file suffix (docs/benchmarks.md,
# scripts/bench_cuda.py, kernels/oracle.py, or one outside the repository: ../x/NOTES.md).
CITED = re.compile(r"(?<![\w/.:-])((?:\.\./)*[\w.-]+(?:/[\w.-]+)+\.(?:py|md|sh|toml|npz|png|json|txt))\b")


def cited_paths(text):
    return [m.group(1) for m in CITED.finditer(text) if "*" not in m.group(1)]


def _resolves(cited, citing):
    """Whether `cited` names a file of the repository: from its root, the citing file's
    folder, or (for a docstring's short path) one of the package's folders."""
    bases = [ROOT, citing.parent, PACKAGE, *[p for p in PACKAGE.iterdir() if p.is_dir()]]
    for base in bases:
        target = (base / cited).resolve()
        if target.is_relative_to(ROOT) and target.exists():
            return True
    return False


def test_the_scan_finds_cited_paths():
    text = "see docs/benchmarks.md and `scripts/bench_cuda.py`, tests/golden/*.npz, ../outside/NOTES.md."
    assert cited_paths(text) == ["docs/benchmarks.md", "scripts/bench_cuda.py", "../outside/NOTES.md"]
    assert not _resolves("../outside/NOTES.md", ROOT / "README.md")


def test_every_path_the_readme_the_docs_and_the_code_cite_exists():
    """README, docs/ and every comment or docstring of the code: a cited file that moved or
    was deleted (or lives outside the repository, as ../shared/) is a dead reference."""
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "pyproject.toml",
               *python_files(*CODE_DIRS)]
    dead = []
    for path in sources:
        if path == Path(__file__).resolve():  # its own examples
            continue
        for cited in cited_paths(path.read_text()):
            if not _resolves(cited, path):
                dead.append(f"{path.relative_to(ROOT)}: {cited}")
    assert not dead, "cited paths that do not exist in the repository:\n" + "\n".join(sorted(set(dead)))


def test_the_readme_is_a_front_door_of_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md: {lines} lines > {README_MAX_LINES}"


def test_nothing_binary_or_third_party_is_tracked():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (the tracked files are what git lists)")
    tracked = subprocess.run(["git", "ls-files", "*.whl", "*.so", "*.tar.gz", "*.zip", "*.egg"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked == []
