"""numba kernel launches prepared once and replayed with one driver call.

A launch through numba's dispatcher costs 25-50 us of host time (it types every
argument, picks the overload and packs the arguments anew); a layer launches the same
kernels on the same buffers every step. `Launch` does that work once: it compiles the
kernel for its arguments, lets numba pack them (private.packed_launch, so the layout is
numba's own), keeps the packed values in ctypes slots, and launches with
`cuLaunchKernel` on those slots. Arguments are named as the kernel names its parameters;
one that changes between calls (the caller's input, a fresh output) is passed by name to
the call, which rewrites its slot (nothing, when it is the array already there).

In numba's CUDA simulator there is no driver: a `Launch` calls the dispatcher with its
current arguments, so the orchestration above it runs unchanged in CI.
"""

from __future__ import annotations

import ctypes
import inspect
from typing import Any, Callable, Mapping, NamedTuple

from conv2d.cuda.runtime import simulating
from conv2d.cuda.views import ForeignArray, as_numba


def device_pointer(a: Any) -> int:
    """The device address of a numba device array or a ForeignArray (in numba's
    simulator, the address of the host memory its array wraps)."""
    if type(a) is ForeignArray:
        return a.ptr
    ptr = getattr(a, "device_ctypes_pointer", None)
    if ptr is None:
        return int(a.ctypes.data)
    return int(ptr.value or 0)


class LaunchError(RuntimeError):
    """A prepared launch the driver refused: names the kernel and the driver's error."""


class Launch:
    """One kernel with its grid, block, stream and arguments, ready to launch.

    `args` maps each of the kernel's parameter names to what the dispatcher would be
    called with: numba device arrays or ForeignArrays (the kernels here index them flat,
    so each is passed as its 1-D view) and scalars (numpy scalar types or bool). numba
    types and packs the first arguments; later ones go to the driver as addresses alone.
    `launch(name=value, ...)` replaces those arguments, each by a device array of the
    same size and dtype or a scalar of the same type, and launches. With `fast=False` every
    call goes through numba's dispatcher (the public path the prepared one is tested
    against).
    """

    def __init__(self, kernel: Any, grid: int | tuple, block: int | tuple, stream: Any,
                 args: Mapping[str, Any], fast: bool = True) -> None:
        names = list(inspect.signature(kernel.py_func).parameters)
        if set(names) != set(args):
            raise ValueError(f"Launch of {kernel.py_func.__name__}: arguments {sorted(args)}, the kernel takes "
                             f"{names}")
        self.kernel = kernel
        self.grid = _dim3(grid)
        self.block = _dim3(block)
        self.stream = stream
        self.names = names
        self._index = {n: i for i, n in enumerate(names)}
        given = [_flat(args[n]) for n in names]
        self.args = [as_numba(a) for a in given]
        self._raw = None
        if fast and not simulating():
            self._prepare()
            if self._raw is not None:
                # Prepared, the launch needs addresses alone: keep the caller's ForeignArrays,
                # whose tensors release() lets go of, not numba's views of them (made for
                # numba to type and pack the arguments), which would hold the tensors of the
                # first call until the next one.
                self.args = given

    def _prepare(self) -> None:
        from cuda.bindings import driver

        from conv2d.cuda.private import packed_launch

        packed = packed_launch(self.kernel, self.args, self.stream)
        if packed is None:
            return  # numba packed these arguments in a way the packing does not know: keep the dispatcher
        slots, self._slot, function = packed
        self._slots = slots
        self._params = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        self._driver = driver
        self._function = driver.CUfunction(function)
        self._name = getattr(self.kernel, "__name__", "kernel")
        self.set_stream(self.stream)

    @property
    def prepared(self) -> bool:
        """Whether calls go straight to the driver (False: through numba's dispatcher)."""
        return self._raw is not None

    def set_stream(self, stream: Any) -> None:
        """Launch on `stream` (a numba stream) from now on."""
        from conv2d.cuda.runtime import stream_handle

        self.stream = stream
        if self._raw is not None or hasattr(self, "_function"):
            cu_stream = self._driver.CUstream(stream_handle(stream))
            self._raw = (self._function, *self.grid, *self.block, 0, cu_stream, ctypes.addressof(self._params), 0)

    def release(self) -> None:
        """Let go of the caller's arrays (torch tensors' views) kept from the last call:
        their memory goes back to torch's stream-ordered allocator once the caller drops
        them, so that a training loop gets the same blocks step after step (the slots
        keep the addresses, which the next call rewrites). Prepared launches only (the
        dispatcher's path keeps its numba views)."""
        if self._raw is None:
            return
        for i, a in enumerate(self.args):
            if type(a) is ForeignArray and a.owner is not None:
                self.args[i] = ForeignArray(a.ptr, a.shape, a.dtype, None)

    def _set(self, i: int, value: Any) -> None:
        # The argument is kept (so that an identical one costs nothing next time, and its
        # memory lives as long as a launch may read it).
        prepared = self.args[i]
        if value is prepared:
            return
        if self._raw is None:
            if getattr(value, "ndim", 0) != getattr(prepared, "ndim", 0):
                value = value.reshape(prepared.shape)
            value = as_numba(value)
        else:
            slot = self._slots[self._slot[i]]
            slot.value = device_pointer(value) if hasattr(value, "device_ctypes_pointer") else value
        self.args[i] = value

    def __call__(self, **changes: Any) -> None:
        args, index = self.args, self._index
        for name, value in changes.items():
            i = index[name]
            if value is not args[i]:
                self._set(i, value)
        if self._raw is None:
            self.kernel[self.grid, self.block, self.stream](*self.args)
            return
        err, = self._driver.cuLaunchKernel(*self._raw)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            _, name = self._driver.cuGetErrorName(err)
            raise LaunchError(f"launch of {self._name}: {name.decode() if isinstance(name, bytes) else name}")


def _flat(a: Any) -> Any:
    return a.reshape(a.size) if getattr(a, "ndim", 1) > 1 and hasattr(a, "reshape") else a


def _dim3(d: int | tuple) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(d)
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


class LaunchKey(NamedTuple):
    """The name of a prepared launch in a shape plan (ShapePlan.launches): the step it
    runs (a kernel's name), the set of saved buffers it reads or writes ("evaluate":
    evaluate's scratch; "caller": the caller's arrays; else the number of one of the
    layer's sets), the settings fixed under it (sorted (name, value) pairs) and whether it
    reads d_y one value a load (`narrow`: d_y not 8-byte aligned)."""

    step: str
    buffers: Any = None
    fixed: tuple = ()
    narrow: bool = False


class Launcher:
    """Prepared launches kept in a dict by key, launched on the current stream of the
    functions that own them (`current()`): the first call of a key prepares the launch
    with all its arguments, later calls swap only the arrays given by name."""

    def __init__(self, current: Callable[[], Any], fast: bool) -> None:
        self.current = current
        self.fast = fast

    def __call__(self, launches: dict, key: Any, kernel: Any, grid: Any, block: Any, fixed: Mapping[str, Any],
                 **arrays: Any) -> None:
        """Launch `kernel` as `launches[key]`: `fixed` are the arguments that do not change
        under the key (sizes, scalars, scratch), `arrays` by name those that may change
        per call."""
        launch = launches.get(key)
        if launch is None:
            launch = launches[key] = Launch(kernel, grid, block, self.current(), {**fixed, **arrays}, fast=self.fast)
            launch()
            return
        self.call(launch, arrays)

    def call(self, launch: Launch, arrays: dict[str, Any]) -> None:
        """A prepared launch on the current stream (it moves there after a stream switch;
        a plan dropped from the cache and still used by a Saved follows too)."""
        current = self.current()
        if launch.stream is not current:
            launch.set_stream(current)
        launch(**arrays)
