"""The NumPy backend: the layer's operations in the design's order, on the CPU.

Every computation runs in the compute dtype (float64 for the float64 policy, float32
otherwise) and is rounded to the storage dtype exactly where the GPU stores a tensor:
pre-activations, outputs, d_z before it feeds the convolution gradients, d_x, each new
weight gradient before it is accumulated, and the accumulated gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conv2d import activations
from conv2d.checks import check_numpy
from conv2d.dtypes import compute_dtype, storage_dtype
from conv2d.reference import conv, norm
from conv2d.spec import LayerSpec, Normalization
from conv2d.state import grad_layout, initial_state


class ReferenceBackend:
    name = "reference"

    def __init__(self, spec: LayerSpec) -> None:
        self.spec = spec
        self.st = storage_dtype(spec.dtype)
        self.ct = compute_dtype(spec.dtype)
        self.params = initial_state(spec)
        self.grads = {k: np.zeros(shape, dt) for k, (shape, dt) in grad_layout(spec).items()}
        self._pre: np.ndarray | None = None
        self._mean: np.ndarray | None = None
        self._inv_std: np.ndarray | None = None
        self._batch_stats = False  # whether the cached statistics came from the batch itself
        if spec.normalization is Normalization.LAYER_NORM:
            self._axes = norm.LAYER_AXES
        else:
            self._axes = norm.BATCH_AXES

    # Inputs --------------------------------------------------------------------------------
    def _input(self, x: Any) -> np.ndarray:
        return check_numpy("x", x, self.spec.input_shape, self.st)

    def _grad_output(self, d_y: Any) -> np.ndarray:
        return check_numpy("d_y", d_y, self.spec.output_shape, self.st)

    # Forward -------------------------------------------------------------------------------
    def _pre_activations(self, x: np.ndarray) -> np.ndarray:
        """conv(x, W) + b, (N, OH, OW, OC), rounded to the storage dtype."""
        s = self.spec
        z = conv.conv_forward(x.astype(self.ct, copy=False), self.params["weights"].astype(self.ct, copy=False), s.stride, s.padding)
        z += self.params["bias"].astype(self.ct, copy=False)
        return z.astype(self.st, copy=False)

    def _statistics(self, z: np.ndarray, training: bool) -> tuple[np.ndarray, np.ndarray, bool]:
        """(mean, inv_std, from_batch) for the norm, updating running stats when training."""
        s, p = self.spec, self.params
        if s.normalization is Normalization.LAYER_NORM:
            mean, var = norm.statistics(z, self._axes)
            return mean, norm.inverse_std(var, s.bn_epsilon), True
        if training:
            mean, var = norm.statistics(z, self._axes)
            p["running_mean"] = norm.update_running(p["running_mean"], mean, s.bn_momentum)
            p["running_var"] = norm.update_running(p["running_var"], var, s.bn_momentum)
            return mean, norm.inverse_std(var, s.bn_epsilon), True
        return p["running_mean"].copy(), norm.inverse_std(p["running_var"], s.bn_epsilon), False

    def _activation_input(self, z: np.ndarray, mean: np.ndarray | None,
                          inv_std: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(a, x_hat): a = gamma * x_hat + beta with a norm, a = z without one."""
        if self.spec.normalization is Normalization.NONE:
            return z, None
        x_hat = norm.normalize(z, mean, inv_std, self._axes)
        return norm.affine(x_hat, self.params["gamma"], self.params["beta"]), x_hat

    def _run(self, x: Any, training: bool, keep: bool) -> np.ndarray:
        x = self._input(x)
        pre = self._pre_activations(x)
        z = pre.astype(self.ct, copy=False)
        mean = inv_std = None
        from_batch = False
        if self.spec.normalization is not Normalization.NONE:
            mean, inv_std, from_batch = self._statistics(z, training)
        a, _ = self._activation_input(z, mean, inv_std)
        y = activations.forward(self.spec.activation, a).astype(self.st, copy=False)
        if keep:
            self._pre, self._mean, self._inv_std, self._batch_stats = pre, mean, inv_std, from_batch
        return y

    def evaluate(self, x: Any) -> np.ndarray:
        return self._run(x, training=False, keep=False)

    def forward(self, x: Any, training: bool) -> np.ndarray:
        return self._run(x, training=training, keep=True)

    # Backward ------------------------------------------------------------------------------
    def _grad_pre_activations(self, d_y: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """d_z (N, OH, OW, OC) in the compute dtype, and the norm's parameter gradients."""
        z = self._pre.astype(self.ct, copy=False)
        a, x_hat = self._activation_input(z, self._mean, self._inv_std)
        d_a = activations.derivative(self.spec.activation, a)
        d_a *= d_y.astype(self.ct, copy=False)
        if self.spec.normalization is Normalization.NONE:
            return d_a, {}
        d_gamma, d_beta = norm.param_backward(d_a, x_hat)
        gamma = self.params["gamma"]
        if self._batch_stats:
            d_z = norm.backward_batch_statistics(d_a, x_hat, self._inv_std, gamma, self._axes)
        else:
            d_z = norm.backward_fixed_statistics(d_a, self._inv_std, gamma, self._axes)
        return d_z, {"gamma": d_gamma, "beta": d_beta}

    def backward(self, x: Any, d_y: Any, param_grads: bool, input_grad: bool) -> np.ndarray | None:
        s = self.spec
        if param_grads:
            x = self._input(x)
        d_y = self._grad_output(d_y)
        if self._pre is None:
            raise RuntimeError("backward: no forward pass to differentiate; call forward(x) first")
        d_z, norm_grads = self._grad_pre_activations(d_y)
        # The convolution gradients read d_z as stored (rounded to the storage dtype).
        d_z_stored = d_z.astype(self.st, copy=False).astype(self.ct, copy=False)
        d_x = None
        if input_grad:
            w = self.params["weights"].astype(self.ct, copy=False)
            d_x = conv.conv_backward_data(w, d_z_stored, (s.in_height, s.in_width), s.stride, s.padding)
            d_x = d_x.astype(self.st, copy=False)
        if param_grads:
            new = dict(norm_grads)
            new["bias"] = conv.bias_backward(d_z)
            d_w = conv.conv_backward_filter(x.astype(self.ct, copy=False), d_z_stored, s.kernel, s.stride, s.padding)
            new["weights"] = d_w.astype(self.st, copy=False).astype(self.ct, copy=False)  # stored, as cuDNN writes it
            for k, g in new.items():
                acc = self.grads[k]
                self.grads[k] = (acc.astype(self.ct, copy=False) + g).astype(acc.dtype, copy=False)
        return d_x

    # State ---------------------------------------------------------------------------------
    def zero_gradient(self) -> None:
        for g in self.grads.values():
            g[...] = 0

    def get_state(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.params.items()}

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        self.params = {k: np.array(v, copy=True) for k, v in state.items()}

    def get_grads(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.grads.items()}

    def set_grads(self, grads: dict[str, np.ndarray]) -> None:
        self.grads = {k: np.array(v, copy=True) for k, v in grads.items()}

    @property
    def pre_activations(self) -> np.ndarray | None:
        return self._pre
