import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from conv2d.cuda.runtime import simulating  # reads NUMBA_ENABLE_CUDASIM when called; imports no numba


def _cuda_device_count() -> int:
    """NVIDIA GPUs the driver reports, asked without importing numba (which must see
    NUMBA_ENABLE_CUDASIM before its first import)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


HAVE_GPU = _cuda_device_count() > 0 and not simulating()
NO_GPU_REASON = ("no NVIDIA GPU here (libcuda.so.1 missing or no device): the CUDA backend's tests need one "
                 "and the cuda12/cuda13 extra")
if not HAVE_GPU:
    # Without a GPU the numba kernels run in numba's CUDA simulator.
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if simulating():
    try:
        from conv2d.cuda.private import yielding_simulator
        yielding_simulator()
    except ImportError:  # numba is not installed: the simulator tests skip
        pass

import conv2d
from conv2d import Conv2d, LayerSpec

GOLDEN_DIR = Path(conv2d.__file__).parent / "golden"  # shipped in the package: `conv2d check` runs them


def spec_for(activation: str = "relu", normalization: str = "batch_norm", dtype: str = "float32",
             **fields) -> LayerSpec:
    """A small layer: N=4, 12x10 input, 5 -> 6 channels, 3x3 kernel, padding 1, with
    `activation`, `normalization` and `dtype`; `fields` set any other LayerSpec field."""
    base = dict(batch_size=4, in_height=12, in_width=10, in_channels=5, out_channels=6, kernel=3, stride=1,
                padding=1)
    base.update(fields)
    return LayerSpec(activation=activation, normalization=normalization, dtype=dtype, **base)


def small_layer_spec(**fields) -> LayerSpec:
    """The smaller layer most single-behaviour tests use: N=2, 6x5 input, 3 -> 4 channels,
    3x3 kernel, padding 1, ReLU, batch norm, float32; `fields` set any other field."""
    base = dict(batch_size=2, in_height=6, in_width=5, in_channels=3, out_channels=4, kernel=3, padding=1,
                activation="relu", normalization="batch_norm", dtype="float32")
    base.update(fields)
    return LayerSpec(**base)


def make_layer(spec: LayerSpec, seed: int = 0, backend: str = "reference", **options) -> Conv2d:
    """A layer with PyTorch-style random weights and non-trivial norm parameters."""
    layer = Conv2d(spec, backend, **options)
    rng = np.random.default_rng(seed)
    layer.init_weights(rng)
    state = layer.state_dict()
    oc = spec.out_channels
    for key, draw in (("gamma", lambda: rng.uniform(0.5, 1.5, oc)), ("beta", lambda: rng.uniform(-0.5, 0.5, oc)),
                      ("running_mean", lambda: rng.normal(0, 0.2, oc)), ("running_var", lambda: rng.uniform(0.5, 2, oc))):
        if key in state:
            state[key] = draw().astype(state[key].dtype)
    layer.load_state_dict(state)
    return layer


def random_inputs(spec: LayerSpec, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    from conv2d.dtypes import storage_dtype

    rng = np.random.default_rng(seed)
    st = storage_dtype(spec.dtype)
    return rng.standard_normal(spec.input_shape).astype(st), rng.standard_normal(spec.output_shape).astype(st)


def assert_same_gradients(a, b) -> None:
    """The layers (or stacks) `a` and `b` hold bitwise the same gradients, key by key."""
    want = b.grad_dict()
    got = a.grad_dict()
    assert got.keys() == want.keys()
    for k, g in got.items():
        np.testing.assert_array_equal(g, want[k], err_msg=k)


@pytest.fixture
def small_spec() -> LayerSpec:
    return small_layer_spec(activation="tanh", dtype="float64")


def rewrite_npz(path, change):
    """Rewrite the .npz at `path` with `change(arrays)` applied to its dict of arrays."""
    with np.load(path) as f:
        arrays = {k: f[k].copy() for k in f.files}
    change(arrays)
    with open(path, "wb") as out:
        np.savez(out, **arrays)


def edit_header(path, change, keep_checksum=False):
    """Apply `change(header)` to the JSON header of a saved file; with `keep_checksum` the
    header's checksum is computed again, as a deliberate edit would."""
    import json

    from conv2d.io import _header_digest

    def edit(arrays):
        header = json.loads(arrays["header"].tobytes())
        change(header)
        if keep_checksum:
            header["header_sha256"] = _header_digest(header)
        arrays["header"] = np.frombuffer(json.dumps(header, sort_keys=True).encode(), np.uint8)
    rewrite_npz(path, edit)


def autograd_history_kept(module, x) -> list[str]:
    """Names of the leaves (x and the module's parameters) whose AccumulateGrad node outlives
    a forward and backward of `module` on `x` (a leaf that requires grad): what keeps the
    step's graph alive after it (a library holding a tensor with autograd history). A node
    lives while anything refers to it, and a leaf hands out its live node again, so a mark
    put in its metadata after the step is still there only if something kept it."""
    import gc

    def node(t):
        return t.view_as(t).grad_fn.next_functions[0][0]

    leaves = {"x": x, **dict(module.named_parameters())}
    module(x).sum().backward()
    for t in leaves.values():
        node(t).metadata["conv2d test mark"] = True
    gc.collect()
    return [name for name, t in leaves.items() if "conv2d test mark" in node(t).metadata]
