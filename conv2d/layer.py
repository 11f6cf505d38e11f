"""`Conv2d`: the thin stateful layer object over a backend."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from conv2d.backend import Backend, make_backend
from conv2d.spec import LayerSpec, Normalization
from conv2d.state import check_arrays, grad_layout, initial_state, state_layout


class Conv2d:
    """y = act(norm(conv(x, W) + b)) over NHWC arrays, on the backend named at construction.

    `x` is (N, H, W, C) and `y` (N, OH, OW, OC) with the spec's sizes and storage dtype,
    C-contiguous; the reference backend takes and returns NumPy arrays, the CUDA backend
    NumPy arrays or `__cuda_array_interface__` objects in, device arrays out. Gradients of
    the parameters accumulate across backward calls until `zero_gradient()`; the input
    gradient is returned fresh. `backend_options` go to the backend (e.g. `allow_tf32`,
    `stream` on CUDA).
    """

    def __init__(self, spec: LayerSpec, backend: str = "reference", **backend_options: Any) -> None:
        if not isinstance(spec, LayerSpec):
            raise TypeError(f"spec: expected a LayerSpec, got {type(spec).__name__}")
        self.spec = spec
        self.backend = backend
        self._impl: Backend = make_backend(backend, spec, **backend_options)

    def __repr__(self) -> str:
        return f"Conv2d({self.spec!r}, backend={self.backend!r})"

    # Forward -------------------------------------------------------------------------------
    def evaluate(self, x: Any) -> Any:
        """Inference: batch norm uses the running statistics; nothing is kept."""
        return self._impl.evaluate(x)

    def forward(self, x: Any, training: bool = True) -> Any:
        """Keeps pre-activations and norm statistics for backward. Training batch norm uses
        the batch's statistics and updates the running ones; otherwise as `evaluate`."""
        if not isinstance(training, bool):
            raise TypeError(f"training: expected a bool, got {training!r}")
        return self._impl.forward(x, training)

    # Backward ------------------------------------------------------------------------------
    def backward(self, x: Any, d_y: Any) -> None:
        """Accumulate the parameter gradients of the last forward; `x` is that forward's input."""
        self._impl.backward(x, d_y, param_grads=True, input_grad=False)

    def backward_full(self, x: Any, d_y: Any) -> Any:
        """Accumulate the parameter gradients and return d_x (N, H, W, C)."""
        return self._impl.backward(x, d_y, param_grads=True, input_grad=True)

    def backward_input(self, d_y: Any) -> Any:
        """Return d_x (N, H, W, C) only; parameter gradients are left as they are."""
        return self._impl.backward(None, d_y, param_grads=False, input_grad=True)

    def zero_gradient(self) -> None:
        self._impl.zero_gradient()

    # Parameters ----------------------------------------------------------------------------
    def init_weights(self, rng: np.random.Generator) -> None:
        """PyTorch's default initialisation: weights uniform in +-sqrt(6 / ((1 + 5) * fan_in))
        (Kaiming-uniform with a = sqrt(5)), bias uniform in +-1/sqrt(fan_in), gamma 1, beta 0,
        running mean 0, running var 1. Draws weights, then bias, in float64 from `rng`."""
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng: expected a numpy.random.Generator, got {type(rng).__name__}")
        layout = state_layout(self.spec)
        fan_in = self.spec.fan_in
        w_bound = math.sqrt(6.0 / ((1 + 5) * fan_in))
        b_bound = 1.0 / math.sqrt(fan_in)
        state = initial_state(self.spec)
        state["weights"] = rng.uniform(-w_bound, w_bound, layout["weights"][0]).astype(layout["weights"][1])
        state["bias"] = rng.uniform(-b_bound, b_bound, layout["bias"][0]).astype(layout["bias"][1])
        self._impl.set_state(state)

    def reset_running_stats(self) -> None:
        """running_mean = 0, running_var = 1 (batch norm only; a no-op otherwise)."""
        if self.spec.normalization is not Normalization.BATCH_NORM:
            return
        state = self._impl.get_state()
        fresh = initial_state(self.spec)
        state["running_mean"], state["running_var"] = fresh["running_mean"], fresh["running_var"]
        self._impl.set_state(state)

    def state_dict(self) -> dict[str, np.ndarray]:
        """NumPy copies: weights (OC, KH, KW, IC), bias (OC,); with a norm gamma and beta (OC,);
        with batch norm running_mean and running_var (OC,)."""
        return self._impl.get_state()

    def grad_dict(self) -> dict[str, np.ndarray]:
        """NumPy copies of the accumulated gradients, keyed as the parameters."""
        return self._impl.get_grads()

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replace the state. Every key, shape and dtype must match `state_dict()`'s exactly
        and every value be finite (running_var >= 0); checked whole before anything changes."""
        self._impl.set_state(check_arrays("state", state, state_layout(self.spec), finite=True))

    def load_grad_dict(self, grads: dict[str, np.ndarray]) -> None:
        """Replace the accumulated gradients (checked as `load_state_dict` checks, NaN allowed)."""
        self._impl.set_grads(check_arrays("grads", grads, grad_layout(self.spec), finite=False))

    def freeze(self) -> None:
        """CUDA backend: forbid device allocation from now on (for CUDA graph capture).
        The cuDNN workspace is sized at construction and never grows, NumPy inputs are
        refused (they need a device copy), and outputs go to layer-owned buffers that the
        next call of the same operation overwrites."""
        freeze = getattr(self._impl, "freeze", None)
        if freeze is None:
            raise TypeError(f"freeze: the {self.backend!r} backend allocates with NumPy and has nothing to freeze")
        freeze()

    def capture(self, x: Any, d_y: Any) -> Any:
        """CUDA backend: capture forward(training=True) + backward_full as one CUDA graph.

        `x` (N, H, W, C) and `d_y` (N, OH, OW, OC) must be device arrays; the graph reads
        them where they are, so write new data into them and call `.replay()`. The layer
        is frozen; `.outputs["y"]` and `.outputs["d_x"]` are the buffers each replay
        writes. Parameters, gradients and running statistics change with each replay
        exactly as with an eager step, bitwise."""
        capture = getattr(self._impl, "capture_step", None)
        if capture is None:
            raise TypeError(f"capture: the {self.backend!r} backend has no CUDA graphs")
        return capture(x, d_y)

    def capture_evaluate(self, x: Any) -> Any:
        """CUDA backend: capture evaluate(x) as one CUDA graph (see `capture`);
        `.outputs["y"]` receives each replay's output."""
        capture = getattr(self._impl, "capture_evaluate", None)
        if capture is None:
            raise TypeError(f"capture_evaluate: the {self.backend!r} backend has no CUDA graphs")
        return capture(x)

    @property
    def pre_activations(self) -> Any:
        """conv(x, W) + b of the last `forward`, (N, OH, OW, OC), or None before any."""
        return self._impl.pre_activations

    def to(self, backend: str, **backend_options: Any) -> "Conv2d":
        """A copy of this layer, state and gradients, on `backend` (the forward cache stays)."""
        other = Conv2d(self.spec, backend, **backend_options)
        other.load_state_dict(self.state_dict())
        other.load_grad_dict(self.grad_dict())
        return other
