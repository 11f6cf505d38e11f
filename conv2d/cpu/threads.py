"""How many threads the CPU backend's calls use, and setting them.

The rule: `threads=None` (the default of `Conv2d(spec, "cpu")`) leaves numba's and BLAS's
own counts as they are (numba: `NUMBA_NUM_THREADS`, the cores; BLAS: its own setting);
an int sets both to it for each call; "torch" (what conv2d.torch's module passes) sets
both to `torch.get_num_threads()` at each call, so that a PyTorch caller's thread count
is ours too and the two pools never take more cores than PyTorch's setting. The results
are the same bits whatever the count (conv2d.cpu.kernels' fixed chunks; BLAS splits a
product's rows and columns among threads, never its sums).
"""

from __future__ import annotations

from typing import Any

_BLAS_SET: list[int | None] = [None]  # the count this module last gave BLAS (threadpoolctl is slow to ask)


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


def use(count: int | None) -> None:
    """Set numba's count (this thread's) and BLAS's (the process's, only when it changes)."""
    if count is None:
        return
    import numba

    numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
    if _BLAS_SET[0] != count:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=count, user_api="blas")
        _BLAS_SET[0] = count
