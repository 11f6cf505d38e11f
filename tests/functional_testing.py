"""What tests/test_functional.py and tests/test_bias_and_running_variance.py share: the
backends and norms they run, a small layer on either backend (the CUDA one in numba's
simulator where there is no GPU), inputs at any batch size, one training step's results
and their comparison."""

import dataclasses

import numpy as np
import pytest

from conftest import HAVE_GPU, make_layer, random_inputs, spec_for
from conv2d.arrays import to_host
from conv2d.dtypes import storage_dtype

BACKENDS = ["reference", "cpu", "cuda"]
NORMS = ["none", "batch_norm", "layer_norm"]


def functional_spec(norm="batch_norm", backend="reference", **fields):
    """This file's layer (N=4, 5x4, 2 -> 3 channels, tanh), float64 on the host backends
    and float32 on the CUDA one; `fields` set any other field."""
    fields = dict(dict(batch_size=4, in_height=5, in_width=4, in_channels=2, out_channels=3, activation="tanh",
                       dtype="float32" if backend == "cuda" else "float64"), **fields)
    return spec_for(normalization=norm, **fields)


def layer_on(backend, spec, seed=0):
    if backend == "cuda":
        pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")
        if HAVE_GPU:
            return make_layer(spec, seed, backend="cuda")
        from host_convolutions import HostConvolutions
        return make_layer(spec, seed, backend="cuda", convolutions=HostConvolutions)
    return make_layer(spec, seed, backend=backend)


def inputs_at(spec, n, seed=1):
    return random_inputs(dataclasses.replace(spec, batch_size=n), seed)


def train_step(layer, x, dy):
    st = storage_dtype(layer.spec.dtype)
    y = to_host(layer.forward(x, training=True), st).copy()
    dx = to_host(layer.backward_full(x, dy), st).copy()
    return y, dx, layer.grad_dict(), layer.state_dict()


def assert_same(got, want, exact):
    for a, b, name in zip(got[:2], want[:2], ("y", "d_x")):
        if exact:
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=name)
    for i in (2, 3):
        for k in want[i]:
            if exact:
                np.testing.assert_array_equal(got[i][k].view(np.uint8), want[i][k].view(np.uint8), err_msg=k)
            else:
                np.testing.assert_allclose(got[i][k], want[i][k], rtol=0, atol=1e-12, err_msg=k)
