"""What a backend provides, what it declares it can do, and the registry that
`Conv2d(spec, backend=NAME)` reads.

A backend is two things:
- a `Backend` declaration (one subclass in the backend's own package, importable without
  the backend's heavy dependencies): its name, options, dtypes and capabilities as class
  attributes with the defaults below, and the few hooks a capability needs (whether it can
  run here, a new stream). Code above the backends (`Conv2d`, `Sequential`, the command
  line, the demos, `conv2d check`) reads these, never a backend's name;
- a `Functions` object for one spec (`Backend.make`): the layer's functions over explicit
  arrays, the memory operations a stateful layer needs on the backend's own arrays, and
  the optimizers' steps. The parameters, gradients and running statistics belong to the
  caller (a `Conv2d`, a torch module, an optimizer); the functions read them in place and
  write only what the docstrings say.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import numpy as np

from conv2d.spec import LayerSpec

ALL_DTYPES = ("float64", "float32", "float16", "bfloat16")


# The contract, split by job ---------------------------------------------------------------
@runtime_checkable
class LayerFunctions(Protocol):
    """The layer's math over explicit arrays (the backend's own: NumPy on the reference;
    device arrays, or any __cuda_array_interface__/DLPack object, on CUDA)."""

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


@runtime_checkable
class Memory(Protocol):
    """The backend's own arrays as a stateful layer keeps them."""

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
class OptimizerSteps(Protocol):
    """The optimizers' in-place steps over a layer's arrays (conv2d.optim)."""

    def adam_step(self, params: Mapping[str, Any], grads: Mapping[str, Any], buffers: Mapping[str, dict],
                  step: Any, h: dict, prepared: dict) -> None:
        """One Adam step of a layer's parameters (conv2d.optim), in place; `step` the count."""
        ...

    def sgd_step(self, params: Mapping[str, Any], grads: Mapping[str, Any], buffers: Mapping[str, dict],
                 step: Any, h: dict, prepared: dict) -> None:
        """One SGD step of a layer's parameters (conv2d.optim), in place."""
        ...


@runtime_checkable
class Functions(LayerFunctions, Memory, OptimizerSteps, Protocol):
    """Every function a backend provides, with these names and parameters (tests check
    each backend against it, `tests/test_backend_contract.py`): what a new backend
    implements."""


@runtime_checkable
class Preallocating(Functions, Protocol):
    """The extension of a backend that declares `fills_outputs` (conv2d.torch asks for
    it): outputs and saved values written into arrays the caller allocated (torch's
    allocator, a CUDA graph's pool), so that a call allocates nothing of its own."""

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


@runtime_checkable
class Streamed(Protocol):
    """The functions of a backend that declares `has_stream`: its calls run on a stream."""

    @property
    def stream(self) -> Any:
        """The layer's own stream (the one it was given, or a new one)."""
        ...

    @property
    def current_stream(self) -> Any:
        """The stream of the last call: what the host waits for before reading."""
        ...


@runtime_checkable
class Capturing(Protocol):
    """The functions of a backend that declares `captures_graphs` (Conv2d.freeze, capture
    and capture_evaluate, Sequential's captures)."""

    def freeze(self) -> None:
        """Forbid allocation from now on (for graph capture)."""
        ...

    def capture(self, run: Callable[[], dict], inputs: dict, snapshot: Callable, followers: tuple = ()) -> Any:
        """A graph of `run` over the device arrays `inputs` (see conv2d.layer.Conv2d.capture)."""
        ...

    def capture_evaluate(self, run: Callable[[], dict], inputs: dict, snapshot: Callable,
                         followers: tuple = ()) -> Any:
        """As `capture`, of an evaluate."""
        ...


@runtime_checkable
class Preparing(Protocol):
    """The function of a backend that declares `prepares_evaluate` (conv2d.torch's calls
    without gradients on the host: acting)."""

    def prepare_evaluate(self, params: Mapping[str, Any], running: Mapping[str, Any] | None,
                         x_shape: tuple[int, int, int, int]) -> Callable[[Any], Any]:
        """`evaluate` of inputs of shape `x_shape` (N, H, W, C) over `params` and `running`
        as a function of x alone, with every check made once, here: the function checks
        nothing. The caller keeps the arrays' memory (their values may change)."""
        ...


# What a backend declares ----------------------------------------------------------------
class Backend:
    """A backend's declaration: the attributes below, with these defaults, overridden by
    each backend's own subclass (`conv2d/<package>/declared.py`). Reading one never
    imports the backend's functions or their dependencies."""

    name: str = ""
    functions: str | Callable[..., Functions] = ""  # "module:attribute" of the factory, or the factory
    options: tuple[str, ...] = ()  # the keyword options `functions(spec, **options)` takes
    dtypes: tuple[str, ...] = ALL_DTYPES  # the storage dtypes it takes
    copies_host_input: bool = False  # forward copies a host x into memory of its own, differentiated from there
    has_stream: bool = False  # calls run on a stream (`Streamed`); a stack's layers share one (`new_stream`)
    captures_graphs: bool = False  # freeze and graph capture (`Capturing`)
    fills_outputs: bool = False  # writes into the caller's arrays (`Preallocating`)
    checks_repeats: bool = False  # `conv2d check` runs each case twice and compares the bits
    prepares_evaluate: bool = False  # an evaluate checked once for many calls (`Preparing`)

    def unavailable(self) -> str | None:
        """Why this backend cannot run here (a missing GPU or library), or None."""
        return None

    def new_stream(self) -> Any:
        """A new stream, for the layers of a stack to share (backends with `has_stream`)."""
        raise TypeError(f"the {self.name!r} backend runs on no stream")

    def same_stream(self, a: Any, b: Any) -> bool:
        """Whether two of this backend's streams are one."""
        return a is b

    def check_options(self, options: Any) -> dict[str, Any]:
        """`options` as a dict after checking that this backend takes every key."""
        if options is None:
            return {}
        if not isinstance(options, dict):
            raise TypeError(f"backend_options: expected a dict of the {self.name} backend's options, got "
                            f"{type(options).__name__}")
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise TypeError(f"backend_options: the {self.name} backend takes {list(self.options)}; unknown {unknown}")
        return dict(options)

    def make(self, spec: LayerSpec, **options: Any) -> Functions:
        """The functions for `spec`, with `options` (checked by name first)."""
        self.check_options(options)
        factory = self.functions
        if isinstance(factory, str):
            module, attr = factory.split(":")
            factory = getattr(importlib.import_module(module), attr)
        return factory(spec, **options)


class _Registered(Backend):
    """A backend added by `register_backend` with its factory and options, the other
    capabilities left at their defaults."""

    def __init__(self, name: str, factory: str | Callable[..., Functions], options: tuple[str, ...]) -> None:
        self.name, self.functions, self.options = name, factory, tuple(options)


# name -> the Backend, or "module:attribute" of it (imported on first use, so that the CPU
# install never imports the GPU stack).
_REGISTRY: dict[str, str | Backend] = {
    "reference": "conv2d.reference.declared:ReferenceBackend",
    "cpu": "conv2d.cpu.declared:CpuBackend",
    "cuda": "conv2d.cuda.declared:CudaBackend",
}


def get(name: str) -> Backend:
    """The declaration of backend `name` (ValueError naming the known ones otherwise)."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"backend: expected one of {backend_names()}, got {name!r}")
    found = _REGISTRY[name]
    if isinstance(found, str):
        module, attr = found.split(":")
        found = _REGISTRY[name] = getattr(importlib.import_module(module), attr)()
    return found


def check_options(name: str, options: Any) -> dict[str, Any]:
    """`options` as a dict after checking that backend `name` takes every key."""
    return get(name).check_options(options)


def register_backend(name: str, factory: str | Callable[..., Functions] | Backend,
                     options: tuple[str, ...] = ()) -> None:
    """Add a backend: a `Backend` declaration, or `factory(spec, **options)` returning an
    object with `Functions`' methods (`options` names the keyword options it takes; every
    capability at `Backend`'s default)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend: name must be a non-empty str, got {name!r}")
    _REGISTRY[name] = factory if isinstance(factory, Backend) else _Registered(name, factory, options)


def backend_names() -> list[str]:
    """The registered backends, in the order they were registered (the reference first)."""
    return list(_REGISTRY)


def make_functions(name: str, spec: LayerSpec, **options: Any) -> Functions:
    """Backend `name`'s functions for `spec`."""
    return get(name).make(spec, **options)
