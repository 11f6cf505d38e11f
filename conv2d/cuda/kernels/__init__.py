"""The CUDA backend's numba kernels, as a package:

- `bits.py`: bfloat16/float16 bits and each storage format's load and store;
- `activation.py`: the activation table as device functions, and float32 constants;
- `simple.py`: the simple set, one plain kernel per step of the reference, named after
  the reference's functions (what a reader learns from, and what a new kernel is first
  written as; backend option kernels="simple");
- `fast.py`: the fast set, the same steps fused where fusion pays, each kernel named for
  the steps it fuses, tested against the simple set (tests/test_cuda_kernels.py);
- `rows.py`: the row engine under fast.py's four per-value kernels;
- `layout.py`: where a flat NHWC index points;
- `depthwise.py`: depthwise convolutions (groups == in_channels) beside cuDNN's;
- `padding.py`: padding modes other than zeros (the input padded before cuDNN, and the
  adjoint for the input gradient);
- `config.py`: the fast kernels' launch shapes and tuned settings (`LaunchConfig`).

The names below are what the backend, the optimizer, the tests and the scripts use.
"""

from conv2d.cuda.kernels.activation import activation_functions
from conv2d.cuda.kernels.bits import StorageIO, bf16_to_f32, f32_to_bf16, storage_io
from conv2d.cuda.kernels.config import (DEFAULT_CONFIG, MAX_LANES, ROW_THREADS, SEG_THREADS, WARP, LaunchConfig,
                                        elementwise_grid, lanes_for, small_grid)
from conv2d.cuda.kernels.fast import KernelSet, kernel_set
from conv2d.cuda.kernels.rows import (ACC_ADD, ACC_NONE, ACC_WRITE, GRAD_PRE_ACTIVATIONS, NORM_GRADIENTS,
                                      NORMALISE_AND_ACTIVATE, STATISTICS)

__all__ = ["ACC_ADD", "ACC_NONE", "ACC_WRITE", "DEFAULT_CONFIG", "GRAD_PRE_ACTIVATIONS", "KernelSet", "LaunchConfig",
           "MAX_LANES", "NORMALISE_AND_ACTIVATE", "NORM_GRADIENTS", "ROW_THREADS", "SEG_THREADS", "STATISTICS",
           "StorageIO", "WARP", "activation_functions", "bf16_to_f32", "elementwise_grid", "f32_to_bf16",
           "kernel_set", "lanes_for", "small_grid", "storage_io"]
