"""`Conv2d`: the thin stateful layer over a backend's functions, with the original
library's semantics: it owns the parameters, the running statistics, the accumulated
gradients and the last forward's saved values."""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, Iterator

import numpy as np

from conv2d.arrays import HOST_DEVICE, content_mark, equal_host_arrays, library, same_memory
from conv2d import backend as backends
from conv2d.backend import Backend, Functions
from conv2d.spec import LayerSpec, Normalization
from conv2d.state import RUNNING, check_arrays, grad_layout, initial_state, split_state, state_layout


class Conv2d:
    """y = act(norm(conv(x, W) + b)) over NHWC arrays, on the backend named at construction.

    `x` is (N, H, W, C) at any N >= 1 (and any H, W the kernel fits) in the spec's storage
    dtype, C-contiguous; `y` is (N, OH, OW, OC). Results come back in the library of the
    input: NumPy in, NumPy out; torch tensors in, torch tensors out (CPU tensors on the
    reference backend, CUDA tensors on the CUDA backend); CuPy or numba device arrays in,
    the same library out. Gradients of the parameters accumulate across backward calls
    until `zero_gradient()`; the input gradient is returned fresh. `backend_options` go to
    the backend (e.g. `allow_tf32`, `stream` on CUDA).

    One layer may be called from several threads: its calls take a lock, so they run
    one at a time, each whole.
    """

    def __init__(self, spec: LayerSpec, backend: str = "reference", **backend_options: Any) -> None:
        if not isinstance(spec, LayerSpec):
            raise TypeError(f"spec: expected a LayerSpec, got {type(spec).__name__}")
        self.spec = spec
        self.backend = backend
        self._declared = backends.get(backend)
        self._fn: Functions = self._declared.make(spec, **backend_options)
        fn = self._fn
        self._state = fn.from_host(initial_state(spec))
        self._params, running = split_state(self._state)
        self._running = running or None
        self._grads = fn.from_host({k: np.zeros(shape, dt) for k, (shape, dt) in grad_layout(spec).items()})
        self._lock = threading.RLock()
        # The last forward: its saved values, its input, and the parameters' version then.
        self._saved: Any = None
        self._saved_input: Any = None
        self._saved_mark: tuple | None = None
        self._saved_version = -1
        self._version = 0

    def __repr__(self) -> str:
        return f"Conv2d({self.spec!r}, backend={self.backend!r})"

    def parameters(self) -> dict[str, Any]:
        """The live parameter arrays of the backend ("weights", "bias", "gamma", "beta" as the
        spec has them; NumPy arrays of the state shapes on the reference, flat device
        arrays on CUDA). Changing them in place is what an optimizer does: call
        `parameters_changed()` after."""
        return dict(self._params)

    def gradients(self) -> dict[str, Any]:
        """The live accumulated-gradient arrays, keyed and laid out as `parameters()`."""
        return dict(self._grads)

    @property
    def capabilities(self) -> Backend:
        """What the backend declares it can do (conv2d.backend.Backend: `captures_graphs`,
        `has_stream`, `copies_host_input`, ...)."""
        return self._declared

    @property
    def functions(self) -> Functions:
        """The backend's functions for this spec (`forward`, `backward`, ... over explicit arrays)."""
        return self._fn

    # Forward -------------------------------------------------------------------------------
    def evaluate(self, x: Any) -> Any:
        """Inference: batch norm uses the running statistics; nothing is kept."""
        _no_autograd("x", x)
        with self._lock:
            return self._fn.evaluate(self._params, x, self._running)

    def forward(self, x: Any, training: bool = True) -> Any:
        """Keeps what backward needs (input, pre-activations, norm statistics). Training
        batch norm uses the batch's statistics and updates the running ones; otherwise as
        `evaluate`."""
        _no_autograd("x", x)
        with self._lock:
            y, saved = self._fn.forward(self._params, x, training, self._running)
            self._saved, self._saved_input, self._saved_version = saved, x, self._version
            # What backward differentiates is x itself where the backend keeps it (the
            # reference's view of host memory, a device array): a change in place must be
            # caught. A backend that copies host input (to a device) differentiates that
            # copy, whatever the caller does to x after the call: nothing to check.
            copied = self._declared.copies_host_input and not _on_device(x)
            self._saved_mark = None if copied else content_mark(x)
            return y

    # Backward ------------------------------------------------------------------------------
    def _last_forward(self, x: Any = None, check_x: bool = False) -> Any:
        """The saved values of the last forward, after checking that backward may use them."""
        if check_x and x is not self._saved_input:  # the forward checked its own input
            self._fn.check_input("x", x)
        if self._saved is None:
            raise RuntimeError("backward: no forward pass to differentiate; call forward(x) first")
        if check_x and not self._is_last_input(x):
            raise ValueError("x: not the input of the last forward; backward differentiates the last forward "
                             "(its saved input, pre-activations and statistics): call forward(x) before "
                             "backward(x, d_y)")
        if self._saved_version != self._version:
            raise RuntimeError("backward: the parameters changed (load_state_dict, init_weights or an optimizer "
                               "step) after the last forward, whose saved values belong to the old ones; call "
                               "forward again")
        return self._saved

    def _is_last_input(self, x: Any) -> bool:
        last = self._saved_input
        if same_memory(x, last):
            if self._saved_mark is not None and content_mark(x) != self._saved_mark:
                raise ValueError("x: changed in place since the last forward (its values, or a torch tensor's "
                                 "version counter, differ from the forward's): the saved pre-activations and "
                                 "statistics belong to the old values; call forward(x) again before backward")
            return True
        # Host arrays may be equal copies; device arrays must be the same memory.
        return library(x) in ("numpy", "torch") and not _on_device(x) and equal_host_arrays(x, last)

    def backward(self, x: Any, d_y: Any) -> None:
        """Accumulate the parameter gradients of the last forward; `x` is that forward's
        input (the same array, or for host arrays an equal one), unchanged since: a change
        in place is caught on host arrays (a CRC-32 of the bytes) and torch tensors (their
        version counter), not on other libraries' device arrays."""
        _no_autograd("d_y", d_y)
        with self._lock:
            saved = self._last_forward(x, check_x=True)
            self._fn.backward(self._params, saved, d_y, True, False, accumulate=self._grads)

    def backward_full(self, x: Any, d_y: Any) -> Any:
        """Accumulate the parameter gradients and return d_x (N, H, W, C)."""
        _no_autograd("d_y", d_y)
        with self._lock:
            saved = self._last_forward(x, check_x=True)
            return self._fn.backward(self._params, saved, d_y, True, True, accumulate=self._grads)[1]

    def backward_input(self, d_y: Any) -> Any:
        """Return d_x (N, H, W, C) only; parameter gradients are left as they are."""
        _no_autograd("d_y", d_y)
        with self._lock:
            saved = self._last_forward()
            return self._fn.backward(self._params, saved, d_y, False, True)[1]

    def zero_gradient(self) -> None:
        with self._lock:
            self._fn.zero(self._grads)

    # Parameters ----------------------------------------------------------------------------
    def _write_state(self, state: dict[str, np.ndarray]) -> None:
        with self._lock:
            self._fn.write(self._state, state)
            if any(k not in RUNNING for k in state):
                self._version += 1

    def parameters_changed(self) -> None:
        """Say that the parameters were changed in place (an optimizer step): a backward
        of a forward before it raises instead of mixing old saved values with new weights."""
        with self._lock:
            self._version += 1

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
        if "bias" in layout:
            state["bias"] = rng.uniform(-b_bound, b_bound, layout["bias"][0]).astype(layout["bias"][1])
        self._write_state(state)

    def reset_running_stats(self) -> None:
        """running_mean = 0, running_var = 1, num_batches_tracked = 0 (batch norm with running
        statistics only; a no-op otherwise)."""
        if self.spec.normalization is not Normalization.BATCH_NORM:
            return
        fresh = initial_state(self.spec)
        self._write_state({k: fresh[k] for k in RUNNING if k in fresh})

    def state_dict(self) -> dict[str, np.ndarray]:
        """NumPy copies: weights (OC, KH, KW, IC); unless `bias=False`, bias (OC,); with a norm
        gamma and beta (OC,); with batch norm running_mean and running_var (OC,)."""
        with self._lock:
            return self._fn.read(self._state)

    def grad_dict(self) -> dict[str, np.ndarray]:
        """NumPy copies of the accumulated gradients, keyed as the parameters."""
        with self._lock:
            return self._fn.read(self._grads)

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replace the state. Every key, shape and dtype must match `state_dict()`'s exactly
        (running_var >= 0); checked whole before anything changes. NaN and infinite values
        (a diverged run's) are loaded as they are, with a RuntimeWarning."""
        self._write_state(check_arrays("state", state, state_layout(self.spec), warn_non_finite=True))

    def load_grad_dict(self, grads: dict[str, np.ndarray]) -> None:
        """Replace the accumulated gradients (checked as `load_state_dict` checks, NaN allowed)."""
        grads = check_arrays("grads", grads, grad_layout(self.spec), warn_non_finite=False)
        with self._lock:
            self._fn.write(self._grads, grads)

    # CUDA graphs ---------------------------------------------------------------------------
    def _capturing(self, what: str) -> Any:
        """The backend's `what` (freeze, capture, capture_evaluate), where it declares
        `captures_graphs`."""
        if not self._declared.captures_graphs:
            raise TypeError(f"{what}: the {self.backend!r} backend has no CUDA graphs" if what.startswith("capture")
                            else f"{what}: the {self.backend!r} backend allocates with NumPy and has nothing to "
                                 f"freeze")
        return getattr(self._fn, what)

    def freeze(self) -> None:
        """CUDA backend: forbid device allocation from now on (for CUDA graph capture).
        Input shapes are those planned so far (the spec's batch_size at construction); the
        cuDNN workspace is sized and never grows, NumPy inputs are refused (they need a
        device copy), and outputs and saved values go to layer-owned buffers that the next
        call of the same operation overwrites."""
        with self._lock:
            self._capturing("freeze")()

    def _snapshot(self) -> Callable[[], None]:
        state, grads = self.state_dict(), self.grad_dict()
        saved = (self._saved, self._saved_input, self._saved_version)

        def restore() -> None:
            self._fn.write(self._state, state)
            self._fn.write(self._grads, grads)
            self._saved, self._saved_input, self._saved_version = saved
        return restore

    def capture(self, x: Any, d_y: Any, optimizer: Any = None) -> Any:
        """CUDA backend: capture forward(training=True) + backward_full as one CUDA graph;
        with `optimizer` (a conv2d.optim optimizer over this layer alone) the whole
        training step: zero_gradient, forward, backward_full and optimizer.step().

        `x` (N, H, W, C) and `d_y` (N, OH, OW, OC) must be device arrays; the graph reads
        them where they are, so write new data into them and call `.replay()`. The layer
        is frozen; `.outputs["y"]` and `.outputs["d_x"]` are the buffers each replay
        writes. Parameters, gradients, running statistics and the optimizer's state
        change with each replay exactly as with an eager step, bitwise."""
        capture = self._capturing("capture")
        check_step_optimizer(optimizer, [self], "this layer alone")
        with self._lock:
            return capture(training_step(self, x, d_y, optimizer), {"x": x, "d_y": d_y},
                           step_snapshot(self._snapshot, optimizer))

    def capture_evaluate(self, x: Any) -> Any:
        """CUDA backend: capture evaluate(x) as one CUDA graph (see `capture`);
        `.outputs["y"]` receives each replay's output."""
        capture = self._capturing("capture_evaluate")
        with self._lock:
            return capture(lambda: {"y": self.evaluate(x)}, {"x": x}, self._snapshot)

    @property
    def pre_activations(self) -> np.ndarray | None:
        """conv(x, W) + b of the last `forward`, (N, OH, OW, OC), as a read-only NumPy array
        (a view on the reference backend, a copy on CUDA), or None before any."""
        with self._lock:
            return None if self._saved is None else self._fn.pre_activations(self._saved)

    def fold_batch_norm(self, **backend_options: Any) -> "Conv2d":
        """A new layer for inference, on this layer's backend (with `backend_options`): batch
        norm's evaluation statistics and affine folded into the convolution's weights and
        bias (`conv2d.fold`). Its evaluate agrees with this layer's within the dtype's
        tolerance, not bitwise. ValueError for a layer without batch norm."""
        from conv2d.fold import folded_spec, folded_state

        spec = folded_spec(self.spec)
        state = folded_state(self.spec, self.state_dict())
        other = Conv2d(spec, self.backend, **backend_options)
        other.load_state_dict(state)
        return other

    def to(self, backend: str, **backend_options: Any) -> "Conv2d":
        """A copy of this layer, state and gradients, on `backend` (the forward's saved values stay)."""
        other = Conv2d(self.spec, backend, **backend_options)
        other.load_state_dict(self.state_dict())
        other.load_grad_dict(self.grad_dict())
        return other


@contextlib.contextmanager
def layer_locks(model: Any) -> Iterator[None]:
    """Hold the locks of every layer of `model` (a Conv2d, a Sequential or a list of
    Conv2d), taken in one global order (by id) so that two holders of overlapping sets
    cannot deadlock: an optimizer step is then seen whole by evaluate, forward and save
    in other threads."""
    layers = [model] if isinstance(model, Conv2d) else list(getattr(model, "layers", model))
    with contextlib.ExitStack() as stack:
        for layer in sorted({id(layer): layer for layer in layers}.values(), key=id):
            stack.enter_context(layer._lock)
        yield


def synchronize(layer: "Conv2d") -> None:
    """Wait for the work queued on the layer's current stream (nothing to wait for on the
    reference backend): before the host reads its arrays or another stream uses them."""
    if layer.capabilities.has_stream:
        layer.functions.current_stream.synchronize()


def check_step_optimizer(optimizer: Any, layers: list, what: str) -> None:
    """A captured training step's optimizer must be over exactly `layers` (or absent)."""
    if optimizer is not None and list(getattr(optimizer, "layers", ())) != layers:
        raise ValueError(f"optimizer: expected a conv2d.optim optimizer over {what}, got "
                         f"{type(optimizer).__name__} over {len(getattr(optimizer, 'layers', ()))} layers")


def training_step(model: Any, x: Any, d_y: Any, optimizer: Any) -> Callable[[], dict[str, Any]]:
    """What a capture of `model` (a Conv2d or a Sequential) runs: forward(training=True)
    and backward_full, with an optimizer the whole step (zero_gradient first, step last)."""
    def run() -> dict[str, Any]:
        if optimizer is not None:
            model.zero_gradient()
        y = model.forward(x, training=True)
        d_x = model.backward_full(x, d_y)
        if optimizer is not None:
            optimizer.step()
        return {"y": y, "d_x": d_x}
    return run


def restoring(restores: list[Callable[[], None]]) -> Callable[[], None]:
    """One restore that runs `restores` in order."""
    def restore() -> None:
        for r in restores:
            r()
    return restore


def step_snapshot(model_snapshot: Callable[[], Callable[[], None]], optimizer: Any) -> Callable[[], Callable[[], None]]:
    """The capture's snapshot: the model's, and the optimizer's state with it."""
    def snapshot() -> Callable[[], None]:
        return restoring([model_snapshot()] + ([optimizer.snapshot()] if optimizer is not None else []))
    return snapshot


def _no_autograd(name: str, a: Any) -> None:
    """A torch tensor that requires grad is refused: this layer's results carry no autograd
    history, so the caller's gradient path would end here without a word."""
    if getattr(a, "requires_grad", False):
        raise TypeError(f"{name}: a torch tensor that requires grad; conv2d.Conv2d records no autograd history, so "
                        f"its result would cut your gradient path. Use conv2d.torch.Conv2dNormActivation (an "
                        f"nn.Module with autograd), or pass {name}.detach()")


def _on_device(a: Any) -> bool:
    device = getattr(a, "device", None)
    return getattr(device, "type", HOST_DEVICE) != HOST_DEVICE
