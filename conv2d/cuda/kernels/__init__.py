"""The CUDA backend's numba kernels, as a package:

- `bits.py`: bfloat16/float16 bits and each storage format's load and store;
- `activation.py`: the activation table as device functions, and float32 constants;
- `simple.py`: the simple set, one plain kernel per step of the reference, named after
  the reference's functions (what a reader learns from, and what a new kernel is first
  written as; backend option kernels="simple");
- `fast.py`: the fast set, the same steps fused where fusion pays, tested against the
  simple set (tests/test_cuda_kernels.py) and tuned by `LaunchConfig`.

The names below are what the backend, the optimizer, the tests and the scripts use.
"""

from conv2d.cuda.kernels.activation import activation_functions
from conv2d.cuda.kernels.bits import bf16_to_f32, f32_to_bf16, storage_io
from conv2d.cuda.kernels.fast import (
    ACC_ADD, ACC_NONE, ACC_WRITE, DEFAULT_CONFIG, MAX_LANES, ROW_THREADS, SEG_THREADS, SUM_GRADS, SUM_STATS, WARP, WRITE_DZ, WRITE_Y, KernelSet,
    LaunchConfig, elementwise_grid, kernel_set, lanes_for, small_grid)

__all__ = ["ACC_ADD", "ACC_NONE", "ACC_WRITE", "activation_functions", "bf16_to_f32", "f32_to_bf16", "storage_io", "DEFAULT_CONFIG", "MAX_LANES",
           "ROW_THREADS", "SEG_THREADS", "SUM_GRADS", "SUM_STATS", "WARP", "WRITE_DZ", "WRITE_Y", "KernelSet",
           "LaunchConfig", "elementwise_grid", "kernel_set", "lanes_for", "small_grid"]
