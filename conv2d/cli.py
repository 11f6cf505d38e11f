"""The command line: `conv2d demo` and `conv2d check` (also `python -m conv2d ...`)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Sequence

from conv2d import __version__
from conv2d.backend import backend_names

TASKS = {"digits": "an all-convolutional classifier of scikit-learn's digits (the main job)",
         "breakout": "DQN on MinAtar Breakout: act at batch 1, train at batch 32, same layers",
         "fit": "a student layer learns to match a teacher layer (a numerical check)"}
# Per-task defaults of the options they share.
DEFAULTS = {"digits": dict(lr=3e-3, target=0.98, steps=None),
            "breakout": dict(lr=1e-3, target=4.0, steps=60_000),
            "fit": dict(lr=0.5, target=None, steps=300)}


# Upper bounds of the demos' counts (a usage error past them, before any work): far above
# what a run takes, below what the loops and the layers' specs can hold.
MAX_COUNT = 2 ** 31 - 1
MAX_BATCH = 2 ** 16


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; Ctrl-C ends it with one line and exit status 130, as a shell's."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("conv2d: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="conv2d", description="conv2d command line")
    parser.add_argument("--version", action="version", version=f"conv2d {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a network with conv2d layers",
                       description="; ".join(f"{k}: {v}" for k, v in TASKS.items()))
    d.add_argument("--task", default="digits", choices=list(TASKS))
    d.add_argument("--backend", default="reference", choices=backend_names())
    d.add_argument("--dtype", default="float32", choices=["float64", "float32", "float16", "bfloat16"])
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--seeds", type=int, default=3,
                   help="breakout: runs on seeds --seed, --seed + 1, ...; the verdict is their mean (default 3)")
    d.add_argument("--lr", type=float, default=None, help="learning rate (default per task: "
                   + ", ".join(f"{k} {v['lr']:g}" for k, v in DEFAULTS.items()) + ")")
    d.add_argument("--target", type=float, default=None,
                   help="what to reach: held-out accuracy (digits, default 0.98), mean return of the last 200 "
                        "episodes averaged over the seeds (breakout, default 4), held-out relative output error "
                        "(fit, default 1e-3 or 8 units of roundoff of a 16-bit dtype)")
    d.add_argument("--steps", type=int, default=None, help="training steps (breakout 60000, fit 300)")
    d.add_argument("--epochs", type=int, default=15, help="digits: passes over the training images")
    d.add_argument("--batch-size", type=int, default=32, help="digits and breakout: the training batch")
    d.add_argument("--normalization", default="none", choices=["none", "batch_norm", "layer_norm"],
                   help="fit: the layer's norm")
    d.add_argument("--plot", metavar="PNG", help="write the training curves to this PNG file")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    c = sub.add_parser("check", help="run the shipped golden outputs on every backend here (exit 1 on failure)")
    c.add_argument("--backends", default=None, help=f"comma list of {', '.join(backend_names())} (default: "
                   "every one, those that cannot run here skipped with the reason; a backend named here that "
                   "cannot run is an error)")
    c.add_argument("--specs", default="", help="comma list of golden spec names to run (default: all of them; "
                   "an unknown name is an error that lists the known ones)")
    args = parser.parse_args(argv)
    if args.command == "check":
        from conv2d import golden_check
        return golden_check.run(args, parser)
    _check_demo_arguments(parser, args)
    from conv2d import backend

    reason = backend.get(args.backend).unavailable()
    if reason is not None:
        print(f"conv2d demo: --backend {args.backend}: {reason}", file=sys.stderr)
        return 1
    if args.task == "digits":
        from conv2d.demos import digits
        return digits.run(args)
    if args.task == "breakout":
        from conv2d.demos import breakout
        return breakout.run(args)
    from conv2d.demos import fit
    return fit.run(args)


def _check_demo_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every demo option checked before any training (argparse usage errors, exit 2): a run
    must not train for minutes and then fail on its output path."""
    from conv2d import backend

    dtypes = backend.get(args.backend).dtypes
    if args.dtype not in dtypes:
        parser.error(f"--dtype: the {args.backend} backend takes {', '.join(dtypes)}; got {args.dtype}")
    for k, v in DEFAULTS[args.task].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for name in ("steps", "epochs", "batch_size", "seeds"):
        value, most = getattr(args, name), MAX_BATCH if name == "batch_size" else MAX_COUNT
        if value is not None and not 1 <= value <= most:
            parser.error(f"--{name.replace('_', '-')}: expected an int in [1, {most}], got {value}")
    if args.seed < 0:
        parser.error(f"--seed: expected an int >= 0, got {args.seed}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr: expected a finite number > 0, got {args.lr}")
    import numpy as np

    if not np.isfinite(np.float32(args.lr)) or np.float32(args.lr) == 0:
        parser.error(f"--lr: expected a number the optimizer's float32 arithmetic holds (finite and nonzero "
                     f"there), got {args.lr}")
    if args.target is not None and not math.isfinite(args.target):
        parser.error(f"--target: expected a finite number, got {args.target}")
    if args.plot is not None:
        import os

        from conv2d.files import writable_target

        try:
            target = writable_target("--plot", args.plot)
        except (TypeError, ValueError, FileNotFoundError) as e:
            parser.error(str(e))
        directory = target.parent if str(target.parent) else "."
        if not os.access(directory, os.W_OK | os.X_OK):
            parser.error(f"--plot: the directory {str(directory)!r} is not writable")
        import tempfile

        try:  # access() says yes for root in /proc and /sys, where no file can be made
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".conv2d-plot-check."):
                pass
        except OSError as e:
            parser.error(f"--plot: no file can be written in {str(directory)!r} ({e.strerror or e})")


if __name__ == "__main__":
    sys.exit(main())
