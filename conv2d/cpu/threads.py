"""How many threads the CPU backend's calls use, and setting them.

The rule: the backend's work is split into tasks fixed by the shapes (chunks of rows,
blocks of samples), run on a pool of threads (conv2d.cpu.kernels.run_tasks); BLAS runs
one thread inside each task (set once for the process with threadpoolctl: BLAS's own
pool spins between calls and took the cores from ours). How many threads share the
tasks: `threads=None` (the default of `Conv2d(spec, "cpu")`): numba's configured count
(`NUMBA_NUM_THREADS`: the cores, unless set); an int: that many; "torch" (what
conv2d.torch's module passes): `torch.get_num_threads()` at each call, so that a PyTorch
caller's setting is ours too and never more. The results are the same bits whatever the
count: the tasks and the order their partial sums are added in do not depend on it.
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


def count() -> int:
    """The compiled loops' thread count now (`use`'s, else numba's configured count)."""
    if _COUNT[0] is None:
        import numba

        return numba.config.NUMBA_NUM_THREADS
    return _COUNT[0]


def use(threads: int | str | None) -> None:
    """Set the count the next calls' tasks run on (`check`'s values: None, numba's
    configured count; "torch", `torch.get_num_threads()` now; an int), and BLAS to one
    thread (once: the process's setting, checked by threadpoolctl)."""
    if threads == "torch":
        import torch

        threads = torch.get_num_threads()
    _COUNT[0] = threads
    if _BLAS_SET[0] != 1:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1, user_api="blas")
        _BLAS_SET[0] = 1
