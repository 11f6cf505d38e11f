"""What a backend provides to `Conv2d`, and the registry `Conv2d(spec, backend=NAME)` reads.

A backend is a `Functions` object for one spec: the layer's two functions over explicit
arrays (`forward`, `backward`, and `evaluate`, which keeps nothing), and the few memory
operations a stateful layer needs on the backend's own arrays. The parameters, gradients
and running statistics belong to the caller (a `Conv2d`, a torch module, an optimizer);
the functions read them in place and write only what the docstrings say.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from conv2d.spec import LayerSpec


class Functions(Protocol):
    name: str
    spec: LayerSpec

    def forward(self, params: Mapping[str, Any], x: Any, training: bool,
                running: Mapping[str, Any] | None = None) -> tuple[Any, Any]: ...
    def evaluate(self, params: Mapping[str, Any], x: Any, running: Mapping[str, Any] | None = None) -> Any: ...
    def backward(self, params: Mapping[str, Any], saved: Any, d_y: Any, want_params: bool = True,
                 want_input: bool = True, accumulate: Mapping[str, Any] | None = None) -> tuple[Any, Any]: ...
    def pre_activations(self, saved: Any) -> np.ndarray: ...
    def from_host(self, values: Mapping[str, np.ndarray]) -> dict[str, Any]: ...
    def write(self, arrays: Mapping[str, Any], values: Mapping[str, np.ndarray]) -> None: ...
    def read(self, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]: ...
    def zero(self, arrays: Mapping[str, Any]) -> None: ...


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
             "launch_config", "evaluate_kernel"),
}


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
