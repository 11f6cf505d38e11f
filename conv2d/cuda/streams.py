"""The stream the CUDA functions' calls run on: the layer's own (or the one it was
given), or torch's current stream for torch tensors when the layer was given none; while
a CUDA graph is captured, the capture's. A switch orders the new stream after the old
one, and the cuDNN handle and prepared launches follow it (launches when next called)."""

from __future__ import annotations

from typing import Any

from conv2d.arrays import TORCH
from conv2d.cuda import cudnn
from conv2d.cuda.runtime import simulating, stream_handle, torch_current_stream


def capturing(stream: Any) -> bool:
    """Whether `stream` is being captured into a CUDA graph (torch.cuda.graph, say)."""
    if simulating():
        return False
    from cuda.bindings import driver

    err, status = driver.cuStreamIsCapturing(driver.CUstream(stream_handle(stream)))
    return err == driver.CUresult.CUDA_SUCCESS and status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


class Streams:
    """The layer's stream (`own`, given or not), the stream of its last call (`current`)
    and, while a graph is captured, the one every call uses (`capture`)."""

    def __init__(self, cuda: Any, own: Any, given: bool, handle: Any) -> None:
        self.cuda, self.own, self.given, self._handle = cuda, own, given, handle
        self.current = own
        self.capture = None

    def current_stream(self) -> Any:
        """The stream of the last call (what prepared launches and outputs follow)."""
        return self.current

    def enter(self, lib: str, a: Any) -> Any:
        """The stream of a call with arrays of library `lib` (`a` one of them), switched to."""
        stream = self.capture or self.own
        if lib == TORCH and not self.given and self.capture is None:
            ptr = torch_current_stream(a)
            if ptr != stream_handle(self.current):
                stream = self.cuda.external_stream(ptr) if ptr else self.cuda.default_stream()
            else:
                stream = self.current
        if stream is not self.current:
            self._switch(stream)
        return stream

    def _switch(self, stream: Any) -> None:
        # The new stream waits for what the old one was given (the scratch and free
        # buffers are shared), then the handle and launches move to it.
        if not capturing(stream):  # a capture may not wait on work recorded outside it
            event = self.cuda.event(timing=False)
            event.record(self.current)
            event.wait(stream)
        if self._handle is not None:
            cudnn.set_stream(self._handle, stream_handle(stream))
        self.current = stream  # each prepared launch follows it when next called (Launcher.call)
