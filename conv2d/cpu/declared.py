"""What the CPU backend declares (conv2d.backend.Backend), known without importing numba:
NumPy arrays (or torch CPU tensors) on the host, every dtype, one option (`threads`), no
stream, no graphs; forward keeps a view of the caller's x; an evaluate checked once for
many calls (`prepare_evaluate`). It runs where numba's CPU compiler is installed (the `cpu`
extra; `torch` and `test` bring it too)."""

from __future__ import annotations

from conv2d.backend import Backend


class CpuBackend(Backend):
    name = "cpu"
    functions = "conv2d.cpu.functional:Functions"
    options = ("threads",)
    prepares_evaluate = True

    def unavailable(self) -> str | None:
        import importlib.util

        if importlib.util.find_spec("numba") is None or importlib.util.find_spec("threadpoolctl") is None:
            return "numba and threadpoolctl are not installed: pip install 'conv2d[cpu]'"
        return None
