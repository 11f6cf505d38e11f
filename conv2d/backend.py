"""What a backend provides to `Conv2d`, and the registry `Conv2d(spec, backend=NAME)` reads.

A backend owns the layer's arrays (parameters, gradients, forward cache) in its own memory
and implements the operations below with the design's semantics; `Conv2d` validates the
arguments that do not depend on where arrays live and chooses which gradients to compute.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

import numpy as np

from conv2d.spec import LayerSpec


class Backend(Protocol):
    spec: LayerSpec

    def evaluate(self, x: Any) -> Any: ...
    def forward(self, x: Any, training: bool) -> Any: ...
    def backward(self, x: Any, d_y: Any, param_grads: bool, input_grad: bool) -> Any: ...
    def zero_gradient(self) -> None: ...
    def get_state(self) -> dict[str, np.ndarray]: ...
    def set_state(self, state: dict[str, np.ndarray]) -> None: ...
    def get_grads(self) -> dict[str, np.ndarray]: ...
    def set_grads(self, grads: dict[str, np.ndarray]) -> None: ...
    @property
    def pre_activations(self) -> Any: ...


# name -> "module:attribute", imported on first use so that the CPU install never imports
# the GPU stack.
_REGISTRY: dict[str, str | Callable[..., Backend]] = {
    "reference": "conv2d.reference.backend:ReferenceBackend",
    "cuda": "conv2d.cuda.backend:CudaBackend",
}


def register_backend(name: str, factory: str | Callable[..., Backend]) -> None:
    """Add a backend: `factory(spec, **options)` returns an object with `Backend`'s methods."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend: name must be a non-empty str, got {name!r}")
    _REGISTRY[name] = factory


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def make_backend(name: str, spec: LayerSpec, **options: Any) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"backend: expected one of {backend_names()}, got {name!r}")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(spec, **options)
