"""The fast kernels' launch shapes: block sizes, the tuned settings (`LaunchConfig`), how
a shape is partitioned into blocks, and the grids of the small kernels. A partition
depends only on the shape, the storage format and these settings, never on timing, so a
reduction's order (and its bits) is fixed by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from conv2d.cuda.runtime import simulating

# Row kernels: blocks of ROW_THREADS threads, each block a fixed slice of rows; at most
# `row_max_blocks` blocks, at least ROW_MIN_VALUES values per thread: one wave of three
# blocks an SM of an H100/H200 (132 SMs). The lane-group row kernels take 60-80
# registers (ptxas, sm_90), so three blocks of 256 fit an SM (four need <= 64) and a
# launch of four an SM ran its last blocks in a second wave. scripts/breakdown_cuda.py
# on the H200, graph step, bf16 batch norm (resnet_28 / resnet_56 / rl_small): 396
# blocks 431 / 375 / 95 us; 528 blocks 469 / 413 / 105, or 444 / 392 / 102 with launch
# bounds of four blocks (64 registers, with spills in the gradient kernels). Before the
# lane groups (one channel a thread, <= 64 registers) 528 blocks had won over 1056 and 264.
ELEMENTWISE_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 132 * 16
ROW_THREADS = 256
SMS = 132
ROW_MIN_VALUES = 16
MAX_LANES = 4  # channels a row-kernel thread keeps at most (8 bytes of 16-bit values)
# numba sizes local and shared arrays only by constants (module constants or the names
# a kernel factory binds before it defines the kernels), not expressions.
ROW_SHARED = ROW_THREADS * MAX_LANES
SEG_THREADS = 256
SEG_MAX_PARTIALS = 64
WARP = 32


@dataclass(frozen=True)
class LaunchConfig:
    """The fast kernels' tuned launch settings: compile-time constants of the kernels and
    part of their cache key (`kernel_set`), chosen per layer (the backend option
    `launch_config`), never patched into this module. The defaults are the H200's
    (scripts/breakdown_cuda.py sweeps them)."""

    wide_rows: bool = True  # row kernels read lane groups with 8-byte loads (lanes_for)
    row_unroll: int = 4  # rows a row-kernel thread loads before it adds them
    phase_two_unroll: int = 4  # partials in flight per thread in phase two
    row_max_blocks: int = SMS * 3  # at most this many row-kernel blocks (one wave of three an SM)
    # Blocks whose partials one block adds in phase two's first level (phase_groups).
    phase_group: int = 16
    # Row kernels compiled with launch bounds of row_max_blocks // SMS resident blocks an
    # SM, so that a change that needs more registers spills (visible in ptxas -v) instead
    # of silently putting a launch in two waves.
    row_bounded: bool = True
    # Fixed block counts instead of the shape's partition (tests: several partials on a
    # small shape); None: row_partition and segment_partition decide.
    row_blocks: Optional[int] = None
    segment_blocks: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("row_unroll", "phase_two_unroll", "row_max_blocks", "phase_group", "row_blocks",
                     "segment_blocks"):
            v = getattr(self, name)
            if v is None and name in ("row_blocks", "segment_blocks"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"launch_config.{name}: expected an int >= 1, got {v!r}")
        for name in ("wide_rows", "row_bounded"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"launch_config.{name}: expected a bool, got {getattr(self, name)!r}")

    def row_partition(self, M: int, C: int) -> int:
        """Blocks of a row kernel over (M, C) values: enough to fill the GPU, each thread
        with at least ROW_MIN_VALUES values, no block without a row. Depends on the shape
        alone (and `row_blocks`, where given)."""
        if self.row_blocks is not None:
            return self.row_blocks
        return max(1, min(self.row_max_blocks, M, -(-M * C // (ROW_THREADS * ROW_MIN_VALUES))))

    def phase_groups(self, P: int) -> int:
        """Groups of `phase_group` blocks that a row kernel of P blocks adds up in phase
        two's first level: its partials need P + phase_groups(P) rows of C, its counter 1
        + phase_groups(P) zeros."""
        return -(-P // self.phase_group)

    def segment_partition(self, S: int) -> int:
        """Blocks along one sample of a segment reduction: ~16 values per thread, at most 64."""
        if self.segment_blocks is not None:
            return self.segment_blocks
        return max(1, min(SEG_MAX_PARTIALS, -(-S // (SEG_THREADS * 16))))

    def jit_options(self) -> dict:
        """cuda.jit options of the row kernels: launch bounds (`row_bounded`), on a GPU only
        (the simulator takes none)."""
        if not self.row_bounded or simulating():
            return {}
        return {"launch_bounds": (ROW_THREADS, max(1, self.row_max_blocks // SMS))}


DEFAULT_CONFIG = LaunchConfig()


def lanes_in_8_bytes(storage: str) -> int:
    return 8 // np.dtype(np.float32 if storage == "float32" else np.uint16).itemsize


def lanes_for(storage: str, C: int) -> int:
    """Channels a row-kernel thread keeps: as many as fill 8 bytes of its storage format
    where C divides into them, else one. Depends on the shape and dtype alone."""
    lanes = lanes_in_8_bytes(storage)
    return lanes if C % lanes == 0 else 1


def small_grid(total: int) -> tuple[int, int]:
    """One thread per value for per-channel or per-sample work."""
    return (max(1, -(-total // WARP)), WARP)


# In numba's simulator every CUDA thread is a Python thread, started per block and polled
# by the block's manager: a launch of 2 blocks of 256 threads over 500 values took seconds
# (CI). The elementwise kernels loop over the grid's stride, so a smaller grid computes the
# same values; two blocks keep the several-block paths (optim's last-block ticket) tested.
SIMULATOR_ELEMENTWISE_GRID = (2, WARP)


def elementwise_grid(total: int) -> tuple[int, int]:
    """(blocks, threads) of a grid-stride kernel over `total` values."""
    blocks = max(1, min(ELEMENTWISE_MAX_BLOCKS, -(-total // ELEMENTWISE_THREADS)))
    if simulating():
        sim_blocks, threads = SIMULATOR_ELEMENTWISE_GRID
        return min(blocks * ELEMENTWISE_THREADS // threads, sim_blocks), threads
    return blocks, ELEMENTWISE_THREADS
