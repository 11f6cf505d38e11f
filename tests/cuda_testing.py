"""What the GPU test files share (tests/test_cuda_*.py, tests/test_torch_*_cuda.py): the
dtypes and norms they run, the golden files, host and torch copies of a layer's step."""

import numpy as np

from conftest import GOLDEN_DIR, HAVE_GPU

GPU_DTYPES = ["float32", "float16", "bfloat16"]
NORMS = ["none", "batch_norm", "layer_norm"]

if HAVE_GPU:
    from conv2d.arrays import to_host
    from conv2d.dtypes import storage_dtype
    from conv2d.testing.golden import MODES, golden_files

    FILES = golden_files(GOLDEN_DIR)
else:
    FILES, MODES = [], ()


def torch_cuda(torch, a, dtype):
    """The host array `a` as a torch CUDA tensor of the layer dtype `dtype`."""
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    return torch.from_numpy(a.astype(np.float32)).to(device="cuda", dtype=tdt)


def step(layer, x, dy, training=True):
    """forward and backward_full of `layer` as host copies, with its gradients and state."""
    st = storage_dtype(layer.spec.dtype)
    y = to_host(layer.forward(x, training=training), st).copy()
    dx = to_host(layer.backward_full(x, dy), st).copy()
    return y, dx, layer.grad_dict(), layer.state_dict()


def _module_pair(torch, norm, dtype, channels=(5, 6), **options):
    from conv2d.torch import Conv2dNormActivation, reference_sequential

    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    options = {"kernel_size": 3, "padding": 1, "activation": "gelu", **options}
    ours = Conv2dNormActivation(*channels, norm=norm, device="cuda", **options)
    theirs = reference_sequential(ours)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return ours.to(tdt), theirs.to(tdt), tdt
