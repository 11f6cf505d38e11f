"""`conv2d check`: the golden-output regression test in users' hands, to run after an
install or an upgrade of a driver, cuDNN or NumPy.

Every golden file shipped in the package (outputs, gradients and running statistics that
PyTorch computed in float64, `scripts/make_golden.py`) runs, in training and in eval, on
every backend available here at every dtype it takes; on the GPU each case runs twice and
must repeat bit for bit. A table gives, per spec, dtype and backend, the worst relative
error as a fraction of its tolerance (`conv2d.dtypes.tolerance`), then one verdict line;
the exit code is 1 on any failure.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from conv2d import backend as backends_module

GOLDEN_DIR = Path(__file__).parent / "golden"


def _reason(name: str) -> str | None:
    """None where backend `name` can run here, else why not (its first clause)."""
    reason = backends_module.get(name).unavailable()
    return None if reason is None else reason.split(";")[0]


def _usage(parser: argparse.ArgumentParser | None, message: str) -> None:
    """A usage error: argparse's (exit status 2) from the command line, else a ValueError."""
    if parser is not None:
        parser.error(message)  # exits 2
    raise ValueError(message)


def _backends(args: argparse.Namespace, parser: argparse.ArgumentParser | None) -> list[str] | None:
    """The backends to check, or None after printing why the command cannot run: by default
    every registered one, each that cannot run here skipped with the reason; a list given
    must name known backends, each of which must run here."""
    known = backends_module.backend_names()
    if args.backends is None:
        here = []
        for name in known:
            reason = _reason(name)
            if reason is None:
                here.append(name)
            else:
                print(f"conv2d check: the {name} backend is not checked here: {reason}")
        return here
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in wanted if b not in known]
    if not wanted or unknown:
        _usage(parser, f"--backends: expected a comma list of {', '.join(known)}, got {args.backends!r}")
    for name in dict.fromkeys(wanted):
        reason = _reason(name)
        if reason is not None:
            print(f"conv2d check: --backends names {name}, which cannot run here: {reason}")
            return None
    return list(dict.fromkeys(wanted))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    from conv2d.testing.golden import MODES, case_errors, golden_files, load_case, run_case

    files = golden_files(GOLDEN_DIR)
    if not files:
        print(f"conv2d check: no golden files in {GOLDEN_DIR} (a broken install?)")
        return 1
    given = getattr(args, "specs", "")
    wanted = [name.strip() for name in given.split(",") if name.strip()]
    if given.strip() and not wanted:  # as --backends: a list given must name something
        _usage(parser, f"--specs: expected a comma list of golden spec names, got {given!r}")
    known = [path.stem for path in files]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        print(f"conv2d check: --specs: unknown {unknown}; the shipped golden specs are {known}")
        return 2
    if wanted:
        files = [path for path in files if path.stem in wanted]
    backends = _backends(args, parser)
    if backends is None:
        return 1
    backends_declared = {name: backends_module.get(name) for name in backends}
    rows, failures, start = [], 0, time.perf_counter()
    print("| spec | dtype | backend | worst error / tolerance | bitwise repeat | result |")
    print("| --- | --- | --- | ---: | --- | --- |")
    for path in files:
        case = load_case(path)
        for backend in backends:
            declared = backends_declared[backend]
            for dtype in declared.dtypes:
                worst, repeat, error = 0.0, "-", None
                try:
                    for mode in MODES:
                        got = run_case(case, dtype, mode, backend=backend)
                        worst = max([worst] + [err / tol for _, err, tol in case_errors(case, got, dtype, mode)])
                        if declared.checks_repeats:
                            again = run_case(case, dtype, mode, backend=backend)
                            same = all(np.array_equal(np.asarray(got[k]).view(np.uint8),
                                                      np.asarray(again[k]).view(np.uint8)) for k in got)
                            repeat = "yes" if same and repeat != "NO" else "NO"
                except Exception as e:  # a backend that raises fails its row, not the command
                    error = f"{type(e).__name__}: {e}"
                ok = error is None and worst <= 1.0 and repeat != "NO"
                failures += not ok
                result = "ok" if ok else ("FAILED: " + error if error else "FAILED")
                rows.append(ok)
                print(f"| {case.name} | {dtype} | {backend} | {worst:.3f} | {repeat} | {result} |", flush=True)
    elapsed = time.perf_counter() - start
    repeated = [b for b in backends if backends_declared[b].checks_repeats]
    repeats = f", bitwise repeats on {', '.join(repeated)}" if repeated else ""
    if failures:
        print(f"conv2d check: {failures} of {len(rows)} checks FAILED ({len(files)} golden specs, backends "
              f"{', '.join(backends)}, {elapsed:.1f} s)")
        return 1
    print(f"conv2d check: all {len(rows)} checks passed ({len(files)} golden specs x dtypes, backends "
          f"{', '.join(backends)}, train and eval{repeats}; {elapsed:.1f} s)")
    return 0
