"""CUDA graphs of a layer's step: forward(training) + backward_full, or evaluate, captured
once on the layer's stream through the driver's stream capture and replayed as one launch.

The captured work reads and writes fixed buffers: the input arrays given at capture (write
new values into them, then `replay()`), the layer's parameters, gradients and caches, and
the layer-owned outputs `y` and `d_x` (the layer is frozen first). Replays run exactly the
eager kernels, so their results are bitwise those of the eager calls.
"""

from __future__ import annotations

from typing import Any, Callable


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
                 snapshot: Callable[[], Callable[[], None]], inputs: dict) -> None:
        driver = _driver()
        self.inputs = inputs
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

    def __del__(self) -> None:
        try:
            driver = _driver()
            driver.cuGraphExecDestroy(self._exec)
            driver.cuGraphDestroy(self._graph)
        except Exception:  # interpreter shutdown, or a failed capture
            pass
