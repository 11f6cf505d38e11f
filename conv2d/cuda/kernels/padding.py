"""Padding modes other than zeros on the GPU (reference: conv.pad and its adjoint
conv.unpad): cuDNN pads with zeros only, so a layer with padding_mode "reflect",
"replicate" or "circular" pads its input first and runs cuDNN on the padded input without
padding; backward-data gives the padded input's gradient, and `unpad_gradient` adds each
padded position's gradient to the input position it copies.

Which input position a padded one copies is one table per axis (`source_tables`, made on
the host from conv2d/padding.py's `sources`, the rule every backend reads), so the kernels do not repeat the modes' rules:
`rows` (Hp,) and `cols` (Wp,) hold the input row / column of each padded one (-1: a zero).
For the adjoint each input position lists the padded positions that copy it, ascending,
-1 after the last (`copies`, (size, K)); the gradient adds them rows first, then columns,
in that order, so it is deterministic. Arrays are flat NHWC in the storage format.
"""

from __future__ import annotations

import functools

import numpy as np

from conv2d.cuda.kernels.activation import ZERO
from conv2d.cuda.kernels.bits import storage_io
from conv2d.cuda.kernels.layout import nhwc_position
from conv2d.cuda.runtime import numba_cuda
from conv2d.padding import sources

cuda = numba_cuda()


def source_tables(size: int, before: int, after: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(source (before + size + after,), copies (size, K)) of one axis, int32: the input
    position each padded position copies, and the padded positions copying each input
    position (ascending, -1 after the last)."""
    src = sources(size, before, after, mode).astype(np.int32)
    lists = [np.flatnonzero(src == i) for i in range(size)]
    width = max(1, max(len(found) for found in lists))
    copies = np.full((size, width), -1, np.int32)
    for i, found in enumerate(lists):
        copies[i, :len(found)] = found
    return src, copies


@functools.lru_cache(maxsize=None)
def padding_kernels(storage: str) -> tuple:
    """(pad_input, unpad_gradient) for storage format `storage`."""
    io = storage_io(storage)
    load, store = io.load, io.store

    @cuda.jit
    def pad_input(x, xp, rows, cols, H, W, C, HP, WP):
        """xp (N, HP, WP, C) = x (N, H, W, C) padded: a copy of the value the tables name,
        or zero. One thread a padded value."""
        for i in range(cuda.grid(1), xp.size, cuda.gridsize(1)):
            n, pr, pc, c = nhwc_position(i, HP, WP, C)
            sr, sc = rows[pr], cols[pc]
            if sr < 0 or sc < 0:
                store(xp, i, ZERO)
            else:
                xp[i] = x[((n * H + sr) * W + sc) * C + c]

    @cuda.jit
    def unpad_gradient(d_xp, d_x, row_copies, col_copies, KR, KC, H, W, C, HP, WP):
        """d_x (N, H, W, C) = the sum of d_xp (N, HP, WP, C) over the padded positions that
        copy each input position (float32 sums, stored once). One thread an input value."""
        for i in range(cuda.grid(1), d_x.size, cuda.gridsize(1)):
            n, row, col, c = nhwc_position(i, H, W, C)
            acc = ZERO
            for a in range(KR):
                pr = row_copies[row * KR + a]
                if pr < 0:
                    break
                for b in range(KC):
                    pc = col_copies[col * KC + b]
                    if pc < 0:
                        break
                    acc += load(d_xp, ((n * HP + pr) * WP + pc) * C + c)
            store(d_x, i, acc)

    return pad_input, unpad_gradient
