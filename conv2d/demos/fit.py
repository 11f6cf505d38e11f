"""`conv2d demo --task fit`: a student layer learns to match a teacher layer of the same
spec by SGD with momentum; a numerical check of training through the layer."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from conv2d.dtypes import UNIT_ROUNDOFF, storage_dtype
from conv2d.arrays import to_host
from conv2d.layer import Conv2d
from conv2d.spec import LayerSpec
from conv2d.demos.common import require_matplotlib, save_figure

DEMO_SPEC = dict(batch_size=32, in_height=16, in_width=16, in_channels=3, out_channels=8,
                 kernel=3, stride=1, padding=1, activation="tanh")


def run(args: argparse.Namespace) -> int:
    """Train a student layer to reproduce a teacher of the same spec, by SGD with momentum
    on half the mean squared error of their outputs on fresh Gaussian inputs."""
    from tqdm import tqdm

    if args.plot:
        require_matplotlib()  # before training, not after it

    spec = LayerSpec(**DEMO_SPEC, normalization=args.normalization, dtype=args.dtype)
    rng = np.random.default_rng(args.seed)
    teacher = Conv2d(spec, "reference")
    teacher.init_weights(np.random.default_rng(args.seed + 1))
    student = Conv2d(spec, args.backend)
    student.init_weights(np.random.default_rng(args.seed + 2))
    st = storage_dtype(spec.dtype)
    velocity = {k: np.zeros(v.shape, np.float64) for k, v in student.grad_dict().items()}
    held_out = rng.standard_normal(spec.input_shape).astype(st)
    target = args.target if args.target is not None else max(1e-3, 8 * UNIT_ROUNDOFF[spec.dtype])

    def output_error() -> float:
        # Inference on inputs never trained on; with batch norm both layers use their
        # running statistics, so the student must have learnt those too.
        want = teacher.evaluate(held_out).astype(np.float64)
        got = to_host(student.evaluate(held_out), st).astype(np.float64)
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    print(f"demo: {spec.batch_size}x{spec.in_height}x{spec.in_width}x{spec.in_channels} -> "
          f"{spec.out_channels} channels, kernel {spec.kernel}, {spec.activation.value}, "
          f"{spec.normalization.value}, {spec.dtype.value}, backend {args.backend}; "
          f"{args.steps} SGD steps, lr {args.lr}, momentum 0.9")
    losses = []
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="training", unit="step", file=sys.stderr,
               disable=args.quiet, mininterval=0.5)
    for step in bar:
        x = rng.standard_normal(spec.input_shape).astype(st)
        # The teacher runs as the student does, so that with batch norm both use batch
        # statistics and both keep running ones.
        want = teacher.forward(x, training=True).astype(np.float64)
        y = to_host(student.forward(x, training=True), st).astype(np.float64)
        diff = y - want
        loss = 0.5 * float((diff * diff).mean())
        losses.append(loss)
        student.zero_gradient()
        student.backward(x, (diff / diff.size).astype(st))
        state = student.state_dict()
        for k, g in student.grad_dict().items():
            velocity[k] = 0.9 * velocity[k] + g.astype(np.float64)
            state[k] = (state[k].astype(np.float64) - args.lr * velocity[k]).astype(state[k].dtype)
        student.load_state_dict(state)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            bar.write(f"step {step:5d}  loss {loss:.3e}  held-out relative error {output_error():.3e}")
    elapsed = time.perf_counter() - start
    err = output_error()
    if args.plot:
        _plot(losses, args.plot)
        print(f"demo: loss plot written to {args.plot}")
    ok = err < target
    verdict = "matches" if ok else "does NOT match"
    print(f"demo: the student {verdict} the teacher: held-out relative error {err:.2e} "
          f"({'<' if ok else '>='} {target:g}), loss {losses[0]:.2e} -> {losses[-1]:.2e}, "
          f"{args.steps} steps in {elapsed:.1f} s")
    return 0 if ok else 1


def _plot(losses: list[float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (0.5 * mean squared error)")
    ax.set_title("conv2d demo: student vs teacher")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
