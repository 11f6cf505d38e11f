"""Device inputs for running cuDNN plans outside a layer's calls (timing a plan, probing
its accuracy or its batch invariance): fixed random buffers, made once and kept."""

from __future__ import annotations

import numpy as np

from conv2d.cuda.runtime import to_device_bits
from conv2d.dtypes import storage_dtype
from conv2d.spec import DType


class DeviceInputs:
    """Inputs for running plans outside a layer's calls: device buffers of Gaussian (or
    zero) values in a storage dtype, made on first use and kept by (role, size, dtype), on
    the layer's stream. Shared by the plan policies' probes
    (plan_autotune.Bench, plan_invariant.InvarianceProbe, plan_heuristic.AccuracyProbe)."""

    def __init__(self, cuda, stream_ptr: int) -> None:
        self.cuda, self.stream_ptr = cuda, stream_ptr
        self.stream = cuda.external_stream(stream_ptr) if stream_ptr else cuda.default_stream()
        self._buffers: dict = {}

    def _buffer(self, role: str, n: int, dtype: DType = DType.FLOAT32, zero: bool = False, seed: int | None = None):
        """`n` values for `role`: zeros, or Gaussian from `seed` (default: how many buffers
        came before, so that each role gets its own values)."""
        key = (role, n, dtype)
        found = self._buffers.get(key)
        if found is None:
            v = np.zeros(n, np.float32) if zero else np.random.default_rng(
                len(self._buffers) if seed is None else seed).standard_normal(n, dtype=np.float32)
            bits = to_device_bits(v.astype(storage_dtype(dtype)))
            found = self._buffers[key] = self.cuda.to_device(bits, stream=self.stream)
        return found
