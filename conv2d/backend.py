"""What a backend provides to `Conv2d`, and the registry `Conv2d(spec, backend=NAME)` reads.

A backend is a `Functions` object for one spec: the layer's two functions over explicit
arrays (`forward`, `backward`, and `evaluate`, which keeps nothing), and the few memory
operations a stateful layer needs on the backend's own arrays. The parameters, gradients
and running statistics belong to the caller (a `Conv2d`, a torch module, an optimizer);
the functions read them in place and write only what the docstrings say.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import numpy as np

from conv2d.spec import LayerSpec


@runtime_checkable
class Functions(Protocol):
    """Every function a backend provides, with these names and parameters (tests check
    both backends against it, `tests/test_backend_contract.py`): what a third backend
    implements. Arrays are the backend's own (NumPy on the reference; device arrays, or
    any __cuda_array_interface__/DLPack object, on CUDA)."""

    name: str
    spec: LayerSpec

    def check_input(self, name: str, x: Any) -> LayerSpec:
        """The call's spec for input `x` (N, H, W, C), after every check `forward` makes."""
        ...

    def forward(self, params: Mapping[str, Any], x: Any, training: bool,
                running: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
        """(y (N, OH, OW, OC), saved); training batch norm updates `running` in place."""
        ...

    def evaluate(self, params: Mapping[str, Any], x: Any, running: Mapping[str, Any] | None = None) -> Any:
        """forward(training=False)'s y, keeping nothing."""
        ...

    def saved(self, x: Any, pre: Any, mean: Any, inv_std: Any, batch_stats: bool) -> Any:
        """A `saved` made of a forward's saved values that the caller kept."""
        ...

    def backward(self, params: Mapping[str, Any], saved: Any, d_y: Any, want_params: bool = True,
                 want_input: bool = True, accumulate: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
        """(grads, d_x) of the forward that gave `saved`; fresh, or added into `accumulate`."""
        ...

    def pre_activations(self, saved: Any) -> np.ndarray:
        """The saved pre-activations (N, OH, OW, OC), read-only on the host."""
        ...

    def adam_step(self, params: Mapping[str, Any], grads: Mapping[str, Any], buffers: Mapping[str, dict],
                  step: Any, h: dict, prepared: dict) -> None:
        """One Adam step of a layer's parameters (conv2d.optim), in place; `step` the count."""
        ...

    def sgd_step(self, params: Mapping[str, Any], grads: Mapping[str, Any], buffers: Mapping[str, dict],
                 step: Any, h: dict, prepared: dict) -> None:
        """One SGD step of a layer's parameters (conv2d.optim), in place."""
        ...

    def from_host(self, values: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """The backend's own copies of host arrays."""
        ...

    def write(self, arrays: Mapping[str, Any], values: Mapping[str, np.ndarray]) -> None:
        """Copy host `values` into the backend's `arrays`, key by key."""
        ...

    def read(self, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Host copies of the backend's `arrays`."""
        ...

    def zero(self, arrays: Mapping[str, Any]) -> None:
        """Set the backend's `arrays` to zero."""
        ...


@runtime_checkable
class Preallocating(Functions, Protocol):
    """The CUDA backend's extension that `conv2d.torch` asks for: outputs and saved values
    written into arrays the caller allocated (torch's allocator, a CUDA graph's pool), so
    that a call allocates nothing of its own."""

    def forward(self, params: Mapping[str, Any], x: Any, training: bool, running: Mapping[str, Any] | None = None,
                saved_out: Mapping[str, Any] | None = None, y_out: Any = None) -> tuple[Any, Any]:
        """As Functions.forward; `saved_out` ("pre", "mean", "inv_std") and `y_out` receive
        the saved values and y."""
        ...

    def backward(self, params: Mapping[str, Any], saved: Any, d_y: Any, want_params: bool = True,
                 want_input: bool = True, accumulate: Mapping[str, Any] | None = None,
                 grads_out: Mapping[str, Any] | None = None, d_x_out: Any = None) -> tuple[Any, Any]:
        """As Functions.backward; `grads_out` and `d_x_out` receive the gradients."""
        ...

    def deferred_frees(self) -> contextlib.AbstractContextManager:
        """A context in which the backend frees no device memory (a free would invalidate
        a CUDA graph being captured)."""
        ...

    def follow(self, a: Any) -> None:
        """Make the stream a call on array `a` would run on the current one, ordered after
        the calls before it (for a caller that replays captured calls on that stream)."""
        ...

    def release(self, resources: Any) -> None:
        """Let go of the caller's arrays kept from the last call of one planned shape
        (a Saved's `resources`)."""
        ...

    def release_all(self) -> None:
        """Let go of every caller array kept from earlier calls."""
        ...


# name -> "module:attribute", imported on first use so that the CPU install never imports
# the GPU stack.
_REGISTRY: dict[str, str | Callable[..., Functions]] = {
    "reference": "conv2d.reference.functional:Functions",
    "cuda": "conv2d.cuda.functional:Functions",
}


# The keyword options each backend's `Functions` takes besides the spec (tests check them
# against the signatures): what `Conv2dNormActivation(backend_options=...)` may pass, known
# without importing the backend (the CUDA one imports numba).
OPTIONS: dict[str, tuple[str, ...]] = {
    "reference": (),
    "cuda": ("stream", "allow_tf32", "autotune", "convolutions", "max_shapes", "fast_paths", "kernels",
             "launch_config", "evaluate_kernel", "depthwise_kernel"),
}


def not_taken(name: str, spec: LayerSpec) -> str | None:
    """Why backend `name` does not take `spec` yet (a feature it lacks), or None: known
    without importing the backend, so that checks and tests can say so instead of
    failing. The backend raises NotImplementedError with the same words."""
    # Both backends take every spec today (batch_invariant was the last gap, closed by
    # cudnn.invariant_choice); an option that lands on one backend first is named here.
    return None


def check_options(name: str, options: Any) -> dict[str, Any]:
    """`options` as a dict after checking that backend `name` takes every key."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"backend_options: expected a dict of the {name} backend's options, got "
                        f"{type(options).__name__}")
    unknown = sorted(set(options) - set(OPTIONS[name]))
    if unknown:
        raise TypeError(f"backend_options: the {name} backend takes {list(OPTIONS[name])}; unknown {unknown}")
    return dict(options)


def register_backend(name: str, factory: str | Callable[..., Functions], options: tuple[str, ...] = ()) -> None:
    """Add a backend: `factory(spec, **options)` returns an object with `Functions`' methods;
    `options` names the keyword options it takes."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend: name must be a non-empty str, got {name!r}")
    _REGISTRY[name] = factory
    OPTIONS[name] = tuple(options)


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def make_functions(name: str, spec: LayerSpec, **options: Any) -> Functions:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"backend: expected one of {backend_names()}, got {name!r}")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(spec, **options)
