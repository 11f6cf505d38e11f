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

from conv2d.backend import not_taken

GOLDEN_DIR = Path(__file__).parent / "golden"
DTYPES = {"reference": ("float64", "float32", "float16", "bfloat16"), "cuda": ("float32", "float16", "bfloat16")}


def _cuda_reason() -> str | None:
    """None where the CUDA backend can run here, else why not."""
    try:
        from conv2d.cuda.runtime import require_gpu

        require_gpu()
    except Exception as e:  # CudaUnavailableError, or anything a broken install raises
        return str(e).split(";")[0]
    return None


def _backends(args: argparse.Namespace, parser: argparse.ArgumentParser | None) -> list[str] | None:
    """The backends to check, or None after printing why the command cannot run: by default
    both, cuda skipped where it cannot run; a list given must name known backends, each
    of which must run here."""
    def usage(message: str) -> None:
        if parser is not None:
            parser.error(message)  # exits 2
        raise ValueError(message)

    if args.backends is None:
        reason = _cuda_reason()
        if reason is not None:
            print(f"conv2d check: the cuda backend is not checked here: {reason}")
            return ["reference"]
        return ["reference", "cuda"]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in DTYPES]
    if not backends or unknown:
        usage(f"--backends: expected a comma list of {', '.join(DTYPES)}, got {args.backends!r}")
    reason = _cuda_reason() if "cuda" in backends else None
    if reason is not None:
        print(f"conv2d check: --backends names cuda, which cannot run here: {reason}")
        return None
    return list(dict.fromkeys(backends))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    from conv2d.testing.golden import MODES, case_errors, golden_files, load_case, run_case

    files = golden_files(GOLDEN_DIR)
    if not files:
        print(f"conv2d check: no golden files in {GOLDEN_DIR} (a broken install?)")
        return 1
    wanted = [name for name in getattr(args, "specs", "").split(",") if name]
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
    rows, failures, not_taken_rows, start = [], 0, 0, time.perf_counter()
    print("| spec | dtype | backend | worst error / tolerance | bitwise repeat | result |")
    print("| --- | --- | --- | ---: | --- | --- |")
    for path in files:
        case = load_case(path)
        for backend in backends:
            reason = not_taken(backend, case.spec)
            if reason is not None:  # a feature the backend does not have yet: said, not failed
                not_taken_rows += 1
                print(f"| {case.name} | - | {backend} | - | - | not taken by this backend yet: {reason} |",
                      flush=True)
                continue
            for dtype in DTYPES[backend]:
                worst, repeat, error = 0.0, "-", None
                try:
                    for mode in MODES:
                        got = run_case(case, dtype, mode, backend=backend)
                        worst = max([worst] + [err / tol for _, err, tol in case_errors(case, got, dtype, mode)])
                        if backend == "cuda":
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
    if failures:
        print(f"conv2d check: {failures} of {len(rows)} checks FAILED ({len(files)} golden specs, backends "
              f"{', '.join(backends)}, {elapsed:.1f} s)")
        return 1
    skipped = f"; {not_taken_rows} spec x backend pairs not taken yet (listed)" if not_taken_rows else ""
    print(f"conv2d check: all {len(rows)} checks passed ({len(files)} golden specs x dtypes, backends "
          f"{', '.join(backends)}, train and eval{', bitwise repeats on the GPU' if 'cuda' in backends else ''}; "
          f"{elapsed:.1f} s{skipped})")
    return 0
