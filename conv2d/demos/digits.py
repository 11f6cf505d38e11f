"""`conv2d demo` (task `digits`, the main job): an all-convolutional classifier of
scikit-learn's handwritten digits (8x8 grayscale, 1797 images, shipped inside
scikit-learn: no download), trained with batch norm and Adam; the last layer's kernel
covers its whole 4x4 input, a dense layer giving the ten logits.

    (N, 8, 8, 1) -> conv 3x3, 16, batch norm, ReLU -> conv 3x3 stride 2, 32, batch norm,
    ReLU -> (N, 4, 4, 32) -> conv 4x4, 10 -> (N, 1, 1, 10) logits
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from conv2d.demos.common import require_matplotlib, save_figure, softmax_cross_entropy
from conv2d.dtypes import storage_dtype
from conv2d.arrays import to_host
from conv2d.optim import Adam
from conv2d.sequential import Sequential
from conv2d.spec import LayerSpec

TEST_FRACTION = 0.2


def network(batch_size: int, dtype: str, backend: str) -> Sequential:
    common = dict(batch_size=batch_size, dtype=dtype)
    return Sequential.from_specs([
        LayerSpec(in_height=8, in_width=8, in_channels=1, out_channels=16, kernel=3, padding=1, activation="relu",
                  normalization="batch_norm", **common),
        LayerSpec(in_height=8, in_width=8, in_channels=16, out_channels=32, kernel=3, stride=2, padding=1,
                  activation="relu", normalization="batch_norm", **common),
        LayerSpec(in_height=4, in_width=4, in_channels=32, out_channels=10, kernel=4, activation="identity",
                  **common),
    ], backend)


def load_data(seed: int, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): images scaled to [0, 1] as (N, 8, 8, 1)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise SystemExit(f"the digits demo needs scikit-learn: pip install 'conv2d[demo]' ({e})")
    digits = load_digits()
    x = (digits.images / 16.0)[..., None].astype(storage_dtype(dtype))
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(TEST_FRACTION * len(y)))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def accuracy(model: Sequential, x: np.ndarray, y: np.ndarray, st: np.dtype) -> float:
    logits = to_host(model.evaluate(x), st).astype(np.float64).reshape(len(y), -1)
    return float((logits.argmax(axis=1) == y).mean())


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.plot:
        require_matplotlib()
    x_train, y_train, x_test, y_test = load_data(args.seed, args.dtype)
    st = storage_dtype(args.dtype)
    model = network(args.batch_size, args.dtype, args.backend)
    model.init_weights(np.random.default_rng(args.seed))
    opt = Adam(model, lr=args.lr)
    rng = np.random.default_rng(args.seed + 1)
    steps_per_epoch = -(-len(y_train) // args.batch_size)
    print(f"demo: digits, {len(y_train)} training and {len(y_test)} held-out images, 3 conv2d layers "
          f"({args.dtype}, backend {args.backend}), Adam lr {args.lr}, batch {args.batch_size}, {args.epochs} epochs")
    history: dict[str, list[float]] = {"loss": [], "train_accuracy": [], "test_accuracy": []}
    start = time.perf_counter()
    bar = tqdm(total=args.epochs * steps_per_epoch, desc="training", unit="step", file=sys.stderr,
               disable=args.quiet, mininterval=0.5)
    for epoch in range(args.epochs):
        order = rng.permutation(len(y_train))
        losses = []
        for i in range(0, len(order), args.batch_size):
            idx = order[i:i + args.batch_size]  # the last batch is smaller: any batch size runs
            x = np.ascontiguousarray(x_train[idx])
            logits = to_host(model.forward(x, training=True), st).astype(np.float64).reshape(len(idx), -1)
            loss, d_logits = softmax_cross_entropy(logits, y_train[idx])
            opt.zero_grad()
            model.backward(x, d_logits.reshape(len(idx), 1, 1, -1).astype(st))
            opt.step()
            losses.append(loss)
            bar.update(1)
        history["loss"].append(float(np.mean(losses)))
        history["train_accuracy"].append(accuracy(model, x_train, y_train, st))
        history["test_accuracy"].append(accuracy(model, x_test, y_test, st))
        bar.write(f"epoch {epoch + 1:2d}  loss {history['loss'][-1]:.4f}  "
                  f"train accuracy {history['train_accuracy'][-1]:.4f}  "
                  f"held-out accuracy {history['test_accuracy'][-1]:.4f}")
    bar.close()
    elapsed = time.perf_counter() - start
    if args.plot:
        _plot(history, args.plot)
        print(f"demo: loss and accuracy curves written to {args.plot}")
    acc = history["test_accuracy"][-1]
    ok = acc >= args.target
    print(f"demo: held-out accuracy {acc:.4f} on {len(y_test)} digits ({'>=' if ok else '<'} target "
          f"{args.target:g}), {args.epochs} epochs of {steps_per_epoch} steps in {elapsed:.1f} s")
    return 0 if ok else 1


def _plot(history: dict[str, list[float]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = range(1, len(history["loss"]) + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(epochs, history["loss"], "o-")
    a.set_xlabel("epoch")
    a.set_ylabel("training loss (cross entropy)")
    a.set_yscale("log")
    a.grid(True, alpha=0.3)
    b.plot(epochs, history["train_accuracy"], "o-", label="training")
    b.plot(epochs, history["test_accuracy"], "s-", label="held out")
    b.set_xlabel("epoch")
    b.set_ylabel("accuracy")
    b.grid(True, alpha=0.3)
    b.legend()
    fig.suptitle("conv2d demo: digits")
    fig.tight_layout()
    save_figure(fig, path)
