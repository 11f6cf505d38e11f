"""What the demo tasks share: the optional plotting dependency and the loss of a classifier."""

from __future__ import annotations

import numpy as np


def require_matplotlib() -> None:
    """Fail before any training when --plot was asked for and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib: pip install 'conv2d[plot]' ({e})")


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
