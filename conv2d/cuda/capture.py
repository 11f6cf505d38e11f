"""CUDA graphs of a layer's step: forward(training) + backward_full, or evaluate, captured
once on the layer's stream through the driver's stream capture and replayed as one launch.

The captured work reads and writes fixed buffers: the input arrays given at capture (write
new values into them, then `replay()`), the layer's parameters, gradients and caches, and
the layer-owned outputs `y` and `d_x` (the layer is frozen first). Replays run exactly the
eager kernels, so their results are bitwise those of the eager calls.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np

from conv2d.checks import check_numpy
from conv2d.cuda.runtime import copy_into, device_view, from_device_bits, stream_handle, to_device_bits
from conv2d.dtypes import storage_dtype


def capture_layers(held: list[tuple[Any, Any]], run: Callable[[], dict], inputs: dict,
                   snapshot: Callable) -> "CapturedGraph":
    """A CapturedGraph of `run` over the layers `held` ((functions, call spec) each, the
    first the one whose input is x, all on its stream): each is planned for its call,
    frozen and kept on that stream while `run` is captured."""
    first, call = held[0]
    if "d_y" in inputs:
        device_view(first.cuda, "d_y", inputs["d_y"], first.spec.dtype, held[-1][1].output_shape)
    with contextlib.ExitStack() as stack:
        for fn, c in held:
            stack.enter_context(fn.held_for_capture(c))
        last = held[-1][0].spec.dtype
        dtypes = {"x": first.spec.dtype, "d_x": first.spec.dtype, "y": last, "d_y": last}
        return CapturedGraph(stream_handle(first.stream), first.stream.synchronize, run, snapshot, inputs,
                             stream=first.stream, dtypes={k: storage_dtype(d) for k, d in dtypes.items()})


def _driver():
    from cuda.bindings import driver
    return driver


def _check(what: str, result: Any) -> Any:
    driver = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"CUDA graph {what}: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


class CapturedGraph:
    """One instantiated CUDA graph and what it reads and writes.

    `run()` does the work once, eagerly, on the stream `stream_ptr` and returns the
    arrays it wrote (fixed buffers: the layer is frozen); `snapshot()` returns a function
    that puts the layer back as it was. `inputs` are the device arrays the graph reads
    (x, and d_y for a step); `outputs` what `run` returned (y, and d_x for a step).
    """

    def __init__(self, stream_ptr: int, synchronize: Callable[[], None], run: Callable[[], dict],
                 snapshot: Callable[[], Callable[[], None]], inputs: dict, stream: Any,
                 dtypes: dict[str, np.dtype]) -> None:
        driver = _driver()
        self.inputs = inputs
        self._numba_stream = stream
        self._dtypes = dtypes
        stream = driver.CUstream(stream_ptr)
        self._stream = stream
        # Warm-up outside the capture: compiles the kernels and builds cuDNN's execution
        # caches, which may not allocate or load modules while capturing. It must leave
        # the layer as it was, so its state and gradients are put back.
        restore = snapshot()
        run()
        restore()
        synchronize()
        _check("begin capture", driver.cuStreamBeginCapture(
            stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            self.outputs = run()
        except BaseException:
            driver.cuStreamEndCapture(stream)
            raise
        graph = _check("end capture", driver.cuStreamEndCapture(stream))
        self._graph = graph
        self._exec = _check("instantiate", driver.cuGraphInstantiate(graph, 0))

    def replay(self) -> None:
        """Run the captured work once more, asynchronously on the layer's stream."""
        _check("launch", _driver().cuGraphLaunch(self._exec, self._stream))

    def write(self, name: str, a: np.ndarray) -> None:
        """Copy the host array `a` into the captured input `name` ("x", "d_y"), queued on
        the graph's stream, so the next `replay()` reads it (one cuMemcpyHtoDAsync; `a` may
        change once this returns). `a`: C-contiguous, the input's shape, the layer's
        storage dtype (ml_dtypes.bfloat16 for bfloat16)."""
        dst = self._array("write", name, self.inputs)
        check_numpy(f"write({name!r})", a, tuple(dst.shape), self._dtypes[name])
        copy_into(dst, to_device_bits(a), self._numba_stream)

    def read(self, name: str) -> np.ndarray:
        """A new host array holding output `name` ("y", "d_x") once the work queued on
        the graph's stream (the last replay) is done, in the layer's storage dtype."""
        src = self._array("read", name, self.outputs)
        host = src.copy_to_host(stream=self._numba_stream)
        self._numba_stream.synchronize()
        return from_device_bits(host, self._dtypes[name])

    def _array(self, what: str, name: str, arrays: dict) -> Any:
        if name not in arrays or name not in self._dtypes or not hasattr(arrays[name], "copy_to_host"):
            have = sorted(k for k in arrays if k in self._dtypes and hasattr(arrays[k], "copy_to_host"))
            raise ValueError(f"{what}: expected one of {have} (numba device arrays of this graph), got {name!r}")
        return arrays[name]

    def __del__(self) -> None:
        try:
            driver = _driver()
            driver.cuGraphExecDestroy(self._exec)
            driver.cuGraphDestroy(self._graph)
        except Exception:  # interpreter shutdown, or a failed capture
            pass
