"""Folding evaluation-mode batch norm into the convolution: for inference, one layer
without a norm whose convolution does the normalisation's affine map.

With s = gamma / sqrt(running_var + eps) per output channel:
W'[oc] = W[oc] * s[oc] and b'[oc] = (b[oc] - running_mean[oc]) * s[oc] + beta[oc]
(b = 0 without a bias), computed in float64 and rounded to the storage dtype once.
The folded layer's y = act(conv(x, W') + b') equals the batch-norm layer's evaluate in
exact arithmetic; in floating point it rounds in other places (W' instead of W and the
normalisation), so it agrees within the dtype's tolerance, not bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from conv2d.spec import LayerSpec, Normalization
from conv2d.state import state_layout


def folded_spec(spec: LayerSpec) -> LayerSpec:
    """The spec of `spec`'s layer with its batch norm folded: no norm, with a bias."""
    if spec.normalization is Normalization.BATCH_NORM and not spec.bn_track_running_stats:
        raise ValueError("fold_batch_norm: this batch norm keeps no running statistics "
                         "(bn_track_running_stats=False): it normalises with each batch's, which do not fold")
    if spec.normalization is not Normalization.BATCH_NORM:
        raise ValueError(f"fold_batch_norm: the layer's normalization is {spec.normalization.value!r}; only batch "
                         f"norm's evaluation statistics are constants that fold into the convolution (layer norm "
                         f"normalises each sample with its own)")
    return dataclasses.replace(spec, normalization=Normalization.NONE, bias=True, bn_affine=True,
                               bn_track_running_stats=True)


def folded_state(spec: LayerSpec, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state ("weights" (OC, KH, KW, IC), "bias" (OC,)) of `folded_spec(spec)`'s layer
    from a batch-norm layer's state (its `state_dict()`), in the storage dtype."""
    target = folded_spec(spec)
    f64 = {k: np.asarray(v, dtype=np.float64) for k, v in state.items()}
    gamma = f64.get("gamma", np.ones(spec.out_channels))  # bn_affine=False: gamma 1, beta 0
    scale = gamma / np.sqrt(f64["running_var"] + spec.bn_epsilon)
    bias = f64["bias"] if spec.bias else np.zeros(spec.out_channels)
    values = {"weights": f64["weights"] * scale[:, None, None, None],
              "bias": (bias - f64["running_mean"]) * scale + f64.get("beta", np.zeros(spec.out_channels))}
    return {k: values[k].astype(dtype) for k, (_, dtype) in state_layout(target).items()}
