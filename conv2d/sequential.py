"""`Sequential`: a stack of `Conv2d` layers, forward through them and backward in reverse.

A convolution whose kernel covers its whole input is a dense layer, so an
all-convolutional network needs nothing else: a classifier ends in a layer of kernel
(H, W) giving (N, 1, 1, classes).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from conv2d import backend as backends
from conv2d.layer import Conv2d, check_step_optimizer, layer_locks, restoring, step_snapshot, training_step
from conv2d.spec import LayerSpec, Normalization


class Sequential:
    """Layers applied in order; each layer's out_channels is the next one's in_channels.

    `forward` keeps what each layer's backward needs (the layers keep their own saved
    values, this stack their inputs); `backward(x, d_y)` accumulates every layer's
    parameter gradients, `backward_full` also returns d_x. State and gradient dicts key
    each layer's entries by its index: "0.weights", "1.gamma", ...

    On the CUDA backend the layers run on one stream (a layer's output is the next one's
    input, with no synchronisation between them): `from_specs` gives them one, and layers
    made apart must be given the same `stream=` (a ValueError says so otherwise).
    """

    def __init__(self, layers: list[Conv2d]) -> None:
        layers = list(layers)
        if not layers or not all(isinstance(layer, Conv2d) for layer in layers):
            raise TypeError(f"layers: expected a non-empty list of Conv2d, got "
                            f"{[type(layer).__name__ for layer in layers]}")
        first_at: dict[int, int] = {}
        for i, layer in enumerate(layers):
            j = first_at.setdefault(id(layer), i)
            if j != i:
                raise ValueError(f"layers[{i}]: the same Conv2d object as layers[{j}]; a layer keeps one forward's "
                                 f"saved values and one set of gradients, so a stack needs a layer object for each "
                                 f"position (Conv2d.to or a new Conv2d with its state_dict makes a copy)")
        for i in range(1, len(layers)):
            a, b = layers[i - 1].spec, layers[i].spec
            if a.out_channels != b.in_channels:
                raise ValueError(f"layers[{i}]: in_channels {b.in_channels} differs from layers[{i - 1}]'s "
                                 f"out_channels {a.out_channels}")
            if a.dtype is not b.dtype or layers[i].backend != layers[0].backend:
                raise ValueError(f"layers[{i}]: dtype {b.dtype.value} on {layers[i].backend!r} differs from "
                                 f"layers[0]'s {layers[0].spec.dtype.value} on {layers[0].backend!r}")
        declared = layers[0].capabilities
        if declared.has_stream:
            for i, layer in enumerate(layers[1:], 1):
                if not declared.same_stream(layer.functions.stream, layers[0].functions.stream):
                    raise ValueError(f"layers[{i}]: runs on another CUDA stream than layers[0] (each layer's output "
                                     f"is the next one's input, unsynchronised); give every layer the same stream= "
                                     f"or use Sequential.from_specs, which does")
        self.layers = layers
        self._inputs: list[Any] | None = None

    @classmethod
    def from_specs(cls, specs: list[LayerSpec], backend: str = "reference", **options: Any) -> "Sequential":
        """Layers of `specs` on `backend` with the backend `options` (on CUDA one stream for
        all: the `stream` option, or a new one)."""
        options = _one_stream(backend, options)
        return cls([Conv2d(spec, backend, **options) for spec in specs])

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Conv2d]:
        return iter(self.layers)

    def __getitem__(self, i: int) -> Conv2d:
        return self.layers[i]

    def __repr__(self) -> str:
        return "Sequential([\n" + "".join(f"  {layer!r},\n" for layer in self.layers) + "])"

    @property
    def backend(self) -> str:
        return self.layers[0].backend

    def call_specs(self, x: Any, training: bool = False) -> list[LayerSpec]:
        """Each layer's spec for a call on input `x`, checked through the whole stack (x's
        shape, dtype and layout for the first layer; for each further one, that the shape
        the one before gives fits its kernel, and for a training forward that its batch
        norm's running-variance rule takes the values a channel gets) before any layer
        runs: a stack that would fail at layer 3 fails here, with layers 0-2's running
        statistics unchanged."""
        call = self.layers[0].functions.check_input("x", x)
        calls = [call]
        for i, layer in enumerate(self.layers[1:], 1):
            n, h, w, _ = call.output_shape
            try:
                call = layer.spec.at(n, h, w)
            except ValueError as e:
                raise ValueError(f"x: layers[{i}] cannot take the (N, H, W, C) = {(n, h, w, call.out_channels)} "
                                 f"that layers[{i - 1}] gives for x of shape {tuple(x.shape)}: {e}") from e
            calls.append(call)
        if training:
            for i, call in enumerate(calls):
                if call.normalization is Normalization.BATCH_NORM and call.bn_track_running_stats:
                    n, oh, ow, _ = call.output_shape
                    try:
                        call.running_var_scale(n * oh * ow)
                    except ValueError as e:
                        raise ValueError(f"x: layers[{i}] (for x of shape {tuple(x.shape)}): {e}") from e
        return calls

    def evaluate(self, x: Any) -> Any:
        """Inference through every layer (running statistics; nothing kept), holding every
        layer's lock, so that an optimizer step in another thread is seen whole or not at all."""
        self.call_specs(x)
        with layer_locks(self):
            for layer in self.layers:
                x = layer.evaluate(x)
        return x

    def forward(self, x: Any, training: bool = True) -> Any:
        """Through every layer, keeping what backward needs. The input is checked against
        the whole stack first (`call_specs`): a refused x changes no layer."""
        self.call_specs(x, training)
        inputs = []
        with layer_locks(self):
            for layer in self.layers:
                inputs.append(x)
                x = layer.forward(x, training)
            self._inputs = inputs
        return x

    def _backward(self, x: Any, d_y: Any, want_input: bool) -> Any:
        if self._inputs is None:
            raise RuntimeError("backward: no forward pass to differentiate; call forward(x) first")
        # Every check before any layer accumulates: x is the last forward's input,
        # unchanged since (the first layer says what is wrong with it), and no layer's
        # parameters changed after its forward.
        self.layers[0]._last_forward(x, check_x=True)
        for layer in self.layers[1:]:
            layer._last_forward()
        d = d_y
        for i in range(len(self.layers) - 1, 0, -1):
            d = self.layers[i].backward_full(self._inputs[i], d)
        first = self.layers[0]
        if want_input:
            return first.backward_full(x, d)
        first.backward(x, d)
        return None

    def backward(self, x: Any, d_y: Any) -> None:
        """Accumulate every layer's parameter gradients; `x` is the last forward's input."""
        with layer_locks(self):
            self._backward(x, d_y, want_input=False)

    def backward_full(self, x: Any, d_y: Any) -> Any:
        """Accumulate every layer's parameter gradients and return d_x."""
        with layer_locks(self):
            return self._backward(x, d_y, want_input=True)

    def capture(self, x: Any, d_y: Any, optimizer: Any = None) -> Any:
        """CUDA backend: capture forward(training=True) + backward_full through every layer
        as one CUDA graph; with `optimizer` (a conv2d.optim optimizer over these layers)
        the whole training step: zero_gradient, forward, backward_full, optimizer.step().
        As `Conv2d.capture`: `x` and `d_y` are device arrays the graph reads where they
        are, the layers are frozen, `.outputs["y"]` and `.outputs["d_x"]` are what each
        replay writes, and every replay changes the state exactly as an eager step."""
        self._capturing("capture")
        check_step_optimizer(optimizer, self.layers, "this Sequential's layers")
        return self._capture(training_step(self, x, d_y, optimizer), {"x": x, "d_y": d_y},
                             step_snapshot(self._snapshot, optimizer))

    def capture_evaluate(self, x: Any) -> Any:
        """CUDA backend: capture evaluate(x) through every layer as one CUDA graph (see
        `capture`): write new values into `x`, `.replay()`, and read `.outputs["y"]`. An
        agent acting at batch 1 replays it per step instead of one eager call per layer."""
        self._capturing("capture_evaluate")
        return self._capture(lambda: {"y": self.evaluate(x)}, {"x": x}, self._snapshot)

    def _capturing(self, name: str) -> None:
        if not self.layers[0].capabilities.captures_graphs:
            raise TypeError(f"{name}: the {self.backend!r} backend has no CUDA graphs")

    def _capture(self, run: Any, inputs: dict, snapshot: Any) -> Any:
        """The first layer's capture of `run`, every further layer held at the shape the
        one before gives it."""
        first = self.layers[0]
        calls = self.call_specs(inputs["x"])
        followers = tuple((layer.functions, call) for layer, call in zip(self.layers[1:], calls[1:]))
        return first.functions.capture(run, inputs, snapshot, followers)

    def _snapshot(self) -> Any:
        """A function that puts every layer's state, and the inputs the stack keeps, back
        as they are now (Conv2d._snapshot for the stack)."""
        inputs = self._inputs
        return restoring([layer._snapshot() for layer in self.layers] + [lambda: setattr(self, "_inputs", inputs)])

    def zero_gradient(self) -> None:
        for layer in self.layers:
            layer.zero_gradient()

    def init_weights(self, rng: np.random.Generator) -> None:
        """Each layer's `init_weights` in order, from the one generator."""
        for layer in self.layers:
            layer.init_weights(rng)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every layer's state, keyed "<index>.<name>", read under every layer's lock: an
        optimizer step in another thread is in all of it or in none."""
        with layer_locks(self):
            return {f"{i}.{k}": v for i, layer in enumerate(self.layers) for k, v in layer.state_dict().items()}

    def grad_dict(self) -> dict[str, np.ndarray]:
        """Every layer's accumulated gradients, keyed as `state_dict`, under every layer's lock."""
        with layer_locks(self):
            return {f"{i}.{k}": v for i, layer in enumerate(self.layers) for k, v in layer.grad_dict().items()}

    def _split(self, what: str, arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        if not isinstance(arrays, dict):
            raise TypeError(f"{what}: expected a dict of arrays, got {type(arrays).__name__}")
        parts: list[dict[str, np.ndarray]] = [{} for _ in self.layers]
        for key, value in arrays.items():
            index, _, name = str(key).partition(".")
            if not index.isdigit() or int(index) >= len(self.layers) or not name:
                raise KeyError(f"{what}: key {key!r} is not '<layer index>.<name>' for {len(self.layers)} layers")
            parts[int(index)][name] = value
        return parts

    def _load(self, what: str, arrays: dict[str, np.ndarray], grads: bool) -> None:
        from conv2d.state import check_arrays, grad_layout, state_layout

        parts = self._split(what, arrays)
        layout = grad_layout if grads else state_layout
        for i, (layer, part) in enumerate(zip(self.layers, parts)):
            check_arrays(f"{what}[layer {i}]", part, layout(layer.spec), warn_non_finite=False)
        for layer, part in zip(self.layers, parts):
            (layer.load_grad_dict if grads else layer.load_state_dict)(part)

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Every layer's state, all checked (as Conv2d.load_state_dict checks) before any changes."""
        self._load("state", state, grads=False)

    def load_grad_dict(self, grads: dict[str, np.ndarray]) -> None:
        """Every layer's accumulated gradients, all checked before any changes."""
        self._load("grads", grads, grads=True)

    def to(self, backend: str, **options: Any) -> "Sequential":
        """A copy of the stack, state and gradients, on `backend` (on CUDA one stream for
        all, as `from_specs`)."""
        options = _one_stream(backend, options)
        return Sequential([layer.to(backend, **options) for layer in self.layers])


def _one_stream(backend: str, options: dict[str, Any]) -> dict[str, Any]:
    """The backend options for every layer of a stack: on a backend with streams, with a
    stream for all (the caller's, or a new one)."""
    declared = backends.get(backend)
    if not declared.has_stream or options.get("stream") is not None:
        return options
    return dict(options, stream=declared.new_stream())
