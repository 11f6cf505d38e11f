"""How many threads the CPU backend's calls use, and setting them.

The rule: `threads=None` (the default of `Conv2d(spec, "cpu")`) runs the compiled loops
on numba's count (`NUMBA_NUM_THREADS`: the cores, unless set) and leaves BLAS at its own;
an int sets both to it for each call; "torch" (what conv2d.torch's module passes) sets
both to `torch.get_num_threads()` at each call, so that a PyTorch caller's thread count
is ours too and never more. The loops and BLAS run one after the other, never at once.
The results are the same bits whatever the count (conv2d.cpu.kernels' fixed chunks; BLAS
splits a product's rows and columns among threads, never its sums).
"""

from __future__ import annotations

from typing import Any

_BLAS_SET: list[int | None] = [None]  # the count this module last gave BLAS (threadpoolctl is slow to ask)
_COUNT: list[int | None] = [None]  # the compiled loops' count, for the call that runs now


def check(threads: Any) -> int | str | None:
    """`threads` after checking it: None, "torch", or an int >= 1."""
    if threads is None or threads == "torch":
        return threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected None, 'torch' or an int >= 1, got {threads!r}")
    return threads


def wanted(threads: int | str | None) -> int | None:
    """The count a call runs with under `threads` (None: leave the pools alone)."""
    if threads == "torch":
        import torch

        return torch.get_num_threads()
    return threads


def count() -> int:
    """The compiled loops' thread count now (`use`'s, else numba's configured count)."""
    if _COUNT[0] is None:
        import numba

        return numba.config.NUMBA_NUM_THREADS
    return _COUNT[0]


def use(count: int | None) -> None:
    """Set the compiled loops' count and BLAS's (the process's, only when it changes);
    None: numba's configured count, BLAS left alone."""
    _COUNT[0] = count
    if count is None:
        return
    if _BLAS_SET[0] != count:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=count, user_api="blas")
        _BLAS_SET[0] = count
