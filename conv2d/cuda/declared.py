"""What the CUDA backend declares (conv2d.backend.Backend), known without importing numba
or cuDNN: its options, dtypes (no float64: that is the oracle's), and capabilities: host
input is copied to the device, calls run on a stream, graphs are captured, outputs can go
into the caller's arrays, and `conv2d check` compares each case's bits over two runs."""

from __future__ import annotations

from typing import Any

from conv2d.backend import Backend


class CudaBackend(Backend):
    name = "cuda"
    functions = "conv2d.cuda.functional:Functions"
    options = ("stream", "allow_tf32", "autotune", "convolutions", "max_shapes", "fast_paths", "kernels",
               "launch_config", "evaluate_kernel", "depthwise_kernel")
    dtypes = ("float32", "float16", "bfloat16")
    copies_host_input = True
    has_stream = True
    captures_graphs = True
    fills_outputs = True
    checks_repeats = True

    def unavailable(self) -> str | None:
        try:
            from conv2d.cuda.runtime import require_gpu

            require_gpu()
        except Exception as e:  # CudaUnavailableError, or anything a broken install raises
            return f"{type(e).__name__}: {e}"
        return None

    def new_stream(self) -> Any:
        from conv2d.cuda.runtime import numba_cuda

        return numba_cuda().stream()

    def same_stream(self, a: Any, b: Any) -> bool:
        from conv2d.cuda.runtime import same_stream

        return same_stream(a, b)
