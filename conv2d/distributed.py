"""Data-parallel training over several processes (one GPU each, or CPU processes) through
`torch.distributed`: NCCL for the CUDA backend, gloo for the reference backend.

    conv2d.distributed.init("gloo")              # or "nccl"; under torchrun, or pass rank/world_size
    dp = DataParallel(model)                      # a Conv2d, a Sequential or a list of Conv2d
    dp.broadcast_parameters()                     # rank 0's state everywhere, once at the start
    ...forward/backward on this rank's part of the batch...
    dp.all_reduce_gradients()                     # in place: every rank gets the same gradients
    opt.step()

The gradients go into one flat buffer per dtype, in a fixed order (the layers', then
their parameters' order), so each step reduces the same buffer the same way. NCCL's
result is bitwise reproducible only while its algorithm is fixed: `init` sets
`NCCL_ALGO=Ring` unless `deterministic=False` (or the variable is already set), as
Megatron's deterministic mode does (NVLS, NVLink SHARP, is not deterministic between
calls). Batch norm keeps per-rank statistics (as `nn.BatchNorm2d` without
SyncBatchNorm). PyTorch users of `conv2d.torch.Conv2dNormActivation` use
`torch.nn.parallel.DistributedDataParallel` instead.

`python -m conv2d.demos.data_parallel --nproc 2` (conv2d/demos/data_parallel.py) trains
the digits demo's network with it on the CPU (gloo).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from conv2d.layer import Conv2d, synchronize


def init(backend: str = "gloo", rank: int | None = None, world_size: int | None = None,
         deterministic: bool = True, **options: Any) -> None:
    """`torch.distributed.init_process_group` with NCCL's algorithm pinned to Ring unless
    `deterministic=False`; rank and world size from the arguments or torchrun's variables."""
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if deterministic:
        os.environ.setdefault("NCCL_ALGO", "Ring")
    kwargs = dict(options)
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, **kwargs)


def _layers(model: Any) -> list[Conv2d]:
    from conv2d.optim import _layers as layers_of

    return layers_of(model)


def _as_torch(a: Any) -> Any:
    """A torch tensor over a layer's array, no copy: NumPy (reference) or a numba device
    array (CUDA; bfloat16 bits viewed as torch.bfloat16)."""
    import torch

    if isinstance(a, np.ndarray):
        from conv2d.arrays import BFLOAT16

        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == BFLOAT16 else torch.from_numpy(a)
    if not hasattr(a, "__cuda_array_interface__"):
        raise TypeError(f"expected a NumPy or a numba device array, got {type(a).__name__}")
    from conv2d.cuda.launch import device_pointer
    from conv2d.cuda.runtime import torch_tensor_over

    dtype = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
             np.dtype(np.uint16): "bfloat16"}[np.dtype(a.dtype)]
    return torch_tensor_over(a, device_pointer(a), tuple(a.shape), dtype)


class DataParallel:
    """The gradients and parameters of `model`'s layers kept equal across the ranks of
    `group` (the default process group by default)."""

    def __init__(self, model: Any, group: Any = None, average: bool = True) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("DataParallel: torch.distributed is not initialised; call conv2d.distributed.init "
                               "(or torch.distributed.init_process_group) first")
        if not isinstance(average, bool):
            raise TypeError(f"average: expected a bool, got {average!r}")
        self.layers = _layers(model)
        self.group = group
        self.average = average
        self.world_size = dist.get_world_size(group)

    def _synchronize(self) -> None:
        # The layers' work (on their streams) before torch's collectives (on torch's).
        for layer in self.layers:
            synchronize(layer)

    def broadcast_parameters(self, src: int = 0) -> None:
        """Every layer's state (parameters and running statistics) from rank `src`."""
        import torch.distributed as dist

        self._synchronize()
        for layer in self.layers:
            arrays = {**layer.parameters(), **(layer._running or {})}
            for name in sorted(arrays):
                dist.broadcast(_as_torch(arrays[name]), src=src, group=self.group)
            layer.parameters_changed()

    def all_reduce_gradients(self) -> None:
        """Sum (or, with `average`, average) every layer's accumulated gradients across the
        ranks, in place, through one flat buffer per dtype in a fixed order."""
        import torch
        import torch.distributed as dist

        self._synchronize()
        by_dtype: dict[Any, list[Any]] = {}
        for layer in self.layers:
            grads = layer.gradients()
            for name in sorted(grads):
                t = _as_torch(grads[name]).reshape(-1)
                by_dtype.setdefault(t.dtype, []).append(t)
        for tensors in by_dtype.values():
            flat = torch.cat(tensors)
            dist.all_reduce(flat, group=self.group)
            if self.average:
                flat /= self.world_size
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()])
                offset += t.numel()
        if any(t.is_cuda for ts in by_dtype.values() for t in ts):
            torch.cuda.synchronize()
