"""What the demo tasks share: the optional plotting dependency, writing a figure, and
the loss of a classifier."""

from __future__ import annotations

from typing import Any

import numpy as np

from conv2d.files import atomic_write


def require_matplotlib() -> None:
    """Fail before any training when --plot was asked for and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib: pip install 'conv2d[plot]' ({e})")


def save_figure(fig: Any, path: str) -> None:
    """Write a matplotlib figure as a PNG the way `conv2d.save` writes files: through a
    temporary file renamed into place, so an interrupted write (SIGINT) leaves no
    truncated image; then close the figure."""
    import matplotlib.pyplot as plt

    try:
        atomic_write("--plot", path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """(mean cross entropy, its gradient with respect to the logits) for (B, K) logits
    and (B,) integer labels, in float64."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    b = len(labels)
    loss = float(-np.log(p[np.arange(b), labels] + 1e-300).mean())
    p[np.arange(b), labels] -= 1.0
    return loss, p / b
