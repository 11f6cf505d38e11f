"""Make conv2d/golden/*.npz with PyTorch in float64 as the oracle (conv2d.testing.torch_oracle).

Each file holds one spec (as JSON in `spec`), its inputs `x`, `d_y`, the parameters
`state.<name>`, and for each mode in (train, eval) the oracle's `<mode>.y`,
`<mode>.pre_activations`, `<mode>.d_pre_activations`, `<mode>.d_x`,
`<mode>.grad.<name>` and, with batch norm, `<mode>.running_mean` / `<mode>.running_var`
after the forward. Run: python scripts/make_golden.py [--out conv2d/golden]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from conv2d.spec import LayerSpec
from conv2d.state import state_layout
from conv2d.testing import torch_oracle

# name -> (spec fields, input scale, seed). Together they cover every activation, every norm,
# training and eval, strides 1/2/4, paddings 0/1/2, non-square inputs and kernels, 1x1
# kernels, batch 1, one channel and odd counts.
GOLDEN = {
    "identity_plain_k3": (dict(batch_size=2, in_height=8, in_width=8, in_channels=3, out_channels=4, kernel=3, padding=1, activation="identity"), 1.0, 8),
    "relu_bn_nonsquare": (dict(batch_size=4, in_height=7, in_width=9, in_channels=3, out_channels=5, kernel=3, padding=1, activation="relu", normalization="batch_norm"), 1.0, 10),
    "tanh_bn_stride2": (dict(batch_size=3, in_height=9, in_width=9, in_channels=2, out_channels=3, kernel=3, stride=2, padding=1, activation="tanh", normalization="batch_norm"), 1.0, 15),
    "sigmoid_rect_kernel": (dict(batch_size=2, in_height=8, in_width=7, in_channels=3, out_channels=4, kernel=(3, 2), stride=(2, 1), padding=(1, 0), activation="sigmoid"), 1.0, 14),
    "fast_tanh_bn_k5_c1": (dict(batch_size=2, in_height=9, in_width=8, in_channels=1, out_channels=3, kernel=5, padding=2, activation="fast_tanh", normalization="batch_norm"), 1.0, 0),
    "fast_tanh_saturating": (dict(batch_size=2, in_height=6, in_width=6, in_channels=4, out_channels=3, kernel=3, padding=1, activation="fast_tanh"), 6.0, 1),
    "gelu_tanh_1x1": (dict(batch_size=5, in_height=6, in_width=6, in_channels=7, out_channels=5, kernel=1, activation="gelu_tanh"), 1.0, 5),
    "gelu_bn_dqn_like": (dict(batch_size=2, in_height=20, in_width=20, in_channels=4, out_channels=6, kernel=8, stride=4, activation="gelu", normalization="batch_norm"), 1.0, 2),
    "gelu_original_ln": (dict(batch_size=2, in_height=6, in_width=6, in_channels=3, out_channels=4, kernel=3, padding=1, activation="gelu_original", normalization="layer_norm"), 1.0, 4),
    "relu_batch1_c1": (dict(batch_size=1, in_height=5, in_width=5, in_channels=1, out_channels=1, kernel=3, activation="relu"), 1.0, 9),
    "relu_ln_stride2_pad2": (dict(batch_size=3, in_height=7, in_width=5, in_channels=5, out_channels=7, kernel=3, stride=2, padding=2, activation="relu", normalization="layer_norm"), 1.0, 11),
    # Kernel 2 with padding 2: whole windows of padding, outputs that are the bias alone.
    # Not with ReLU: many equal values near its jump would all flip together in 16 bits.
    "sigmoid_ln_padding_windows": (dict(batch_size=3, in_height=7, in_width=5, in_channels=5, out_channels=7, kernel=2, stride=2, padding=2, activation="sigmoid", normalization="layer_norm"), 1.0, 13),
    "tanh_stride4_pad2": (dict(batch_size=2, in_height=11, in_width=13, in_channels=3, out_channels=2, kernel=4, stride=4, padding=2, activation="tanh"), 1.0, 16),
    "sigmoid_bn_batch1_1x1_s2": (dict(batch_size=1, in_height=5, in_width=7, in_channels=9, out_channels=3, kernel=1, stride=2, activation="sigmoid", normalization="batch_norm"), 1.0, 12),
    "gelu_tanh_bn_momentum": (dict(batch_size=3, in_height=6, in_width=10, in_channels=3, out_channels=5, kernel=(1, 3), stride=(1, 2), padding=(0, 1), activation="gelu_tanh", normalization="batch_norm", bn_momentum=0.3, bn_epsilon=1e-3), 1.0, 6),
    "identity_bn_k3": (dict(batch_size=4, in_height=5, in_width=5, in_channels=2, out_channels=3, kernel=3, padding=1, activation="identity", normalization="batch_norm"), 1.0, 7),
    "gelu_odd_sizes": (dict(batch_size=3, in_height=13, in_width=11, in_channels=5, out_channels=7, kernel=(5, 3), stride=(3, 2), padding=(2, 1), activation="gelu"), 1.0, 3),
    # Added later, each with its own seed (the seeds above are the files' original ones).
    "silu_bn_k3": (dict(batch_size=3, in_height=7, in_width=6, in_channels=3, out_channels=5, kernel=3, padding=1, activation="silu", normalization="batch_norm"), 2.0, 17),
    "relu6_ln_stride2": (dict(batch_size=2, in_height=9, in_width=8, in_channels=4, out_channels=6, kernel=3, stride=2, padding=1, activation="relu6", normalization="layer_norm"), 4.0, 18),
    "hardswish_plain_k5": (dict(batch_size=2, in_height=8, in_width=8, in_channels=2, out_channels=4, kernel=5, padding=2, activation="hardswish"), 4.0, 19),
    "leaky_relu_bn_slope": (dict(batch_size=3, in_height=6, in_width=7, in_channels=3, out_channels=4, kernel=3, padding=1, activation="leaky_relu", negative_slope=0.2, normalization="batch_norm"), 1.0, 20),
    "elu_ln_alpha": (dict(batch_size=2, in_height=7, in_width=7, in_channels=4, out_channels=5, kernel=3, stride=2, padding=1, activation="elu", elu_alpha=0.7, normalization="layer_norm"), 1.0, 21),
    "relu_groups2_bn": (dict(batch_size=3, in_height=7, in_width=6, in_channels=4, out_channels=6, kernel=3, padding=1, groups=2, activation="relu", normalization="batch_norm"), 1.0, 22),
    "gelu_depthwise_x2": (dict(batch_size=2, in_height=8, in_width=7, in_channels=3, out_channels=6, kernel=3, stride=2, padding=1, groups=3, activation="gelu"), 1.0, 23),
    "tanh_dilation2_ln": (dict(batch_size=2, in_height=9, in_width=10, in_channels=3, out_channels=4, kernel=3, padding=2, dilation=2, activation="tanh", normalization="layer_norm"), 1.0, 24),
    "silu_dilation_rect_groups": (dict(batch_size=2, in_height=11, in_width=9, in_channels=4, out_channels=4, kernel=(3, 2), stride=(1, 2), padding=(2, 1), dilation=(2, 3), groups=2, activation="silu", normalization="batch_norm"), 1.0, 25),
    "relu_same_even_k4": (dict(batch_size=2, in_height=7, in_width=6, in_channels=3, out_channels=4, kernel=4, padding="same", activation="relu", normalization="batch_norm"), 1.0, 26),
    "tanh_reflect_pad2": (dict(batch_size=2, in_height=6, in_width=7, in_channels=2, out_channels=3, kernel=3, padding=2, padding_mode="reflect", activation="tanh"), 1.0, 27),
    "gelu_replicate_stride2_ln": (dict(batch_size=3, in_height=8, in_width=7, in_channels=3, out_channels=4, kernel=3, stride=2, padding=(1, 2), padding_mode="replicate", activation="gelu", normalization="layer_norm"), 1.0, 28),
    "sigmoid_circular_same_k2": (dict(batch_size=2, in_height=5, in_width=6, in_channels=2, out_channels=3, kernel=2, padding="same", padding_mode="circular", activation="sigmoid", normalization="batch_norm"), 1.0, 29),
    "identity_asymmetric": (dict(batch_size=2, in_height=6, in_width=6, in_channels=3, out_channels=2, kernel=3, padding=((0, 2), (1, 0)), activation="identity"), 1.0, 30),
    "relu6_same_odd_rect": (dict(batch_size=2, in_height=7, in_width=8, in_channels=2, out_channels=3, kernel=(5, 3), padding="same", activation="relu6", normalization="layer_norm"), 3.0, 31),
    "tanh_bn_no_affine": (dict(batch_size=3, in_height=6, in_width=5, in_channels=2, out_channels=4, kernel=3, padding=1, activation="tanh", normalization="batch_norm", bn_affine=False), 1.0, 32),
    "gelu_bn_no_running_stats": (dict(batch_size=4, in_height=5, in_width=6, in_channels=3, out_channels=3, kernel=3, padding=1, activation="gelu", normalization="batch_norm", bn_track_running_stats=False), 1.0, 33),
    "relu_bn_cumulative": (dict(batch_size=3, in_height=5, in_width=5, in_channels=2, out_channels=4, kernel=3, padding=1, activation="relu", normalization="batch_norm", bn_momentum=None, bn_running_var="unbiased"), 1.0, 35),
    "sigmoid_ln_no_affine": (dict(batch_size=2, in_height=6, in_width=6, in_channels=3, out_channels=4, kernel=3, stride=2, padding=1, activation="sigmoid", normalization="layer_norm", bn_affine=False), 1.0, 34),
}


def random_state(spec: LayerSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Parameters away from their trivial initial values, so that every term is exercised."""
    bound = 1.0 / math.sqrt(spec.fan_in)
    draws = {
        "weights": lambda s: rng.uniform(-bound, bound, s),
        "bias": lambda s: rng.uniform(-bound, bound, s),
        "gamma": lambda s: rng.uniform(0.5, 1.5, s),
        "beta": lambda s: rng.uniform(-0.5, 0.5, s),
        "running_mean": lambda s: rng.normal(0.0, 0.2, s),
        "running_var": lambda s: rng.uniform(0.5, 2.0, s),
        "num_batches_tracked": lambda s: rng.integers(1, 6, s),  # a count: the next batch weighs 1/2 .. 1/6
    }
    return {k: draws[k](shape).astype(dt if k == "num_batches_tracked" else np.float64)
            for k, (shape, dt) in state_layout(spec).items()}


def make(name: str, fields: dict, scale: float, seed: int) -> dict[str, np.ndarray]:
    spec = LayerSpec(**fields, dtype="float64")
    rng = np.random.default_rng(seed)
    state = random_state(spec, rng)
    x = rng.standard_normal(spec.input_shape) * scale
    d_y = rng.standard_normal(spec.output_shape)
    out = {"spec": np.frombuffer(json.dumps(spec.to_dict()).encode(), dtype=np.uint8), "x": x, "d_y": d_y}
    out.update({f"state.{k}": v for k, v in state.items()})
    for mode, training in (("train", True), ("eval", False)):
        for k, v in torch_oracle.run(spec, state, x, d_y, training).items():
            out[f"{mode}.{k}"] = v
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "conv2d" / "golden")
    parser.add_argument("--only", help="comma-separated names of the files to write (default: all)")
    args = parser.parse_args()
    names = sorted(GOLDEN) if not args.only else args.only.split(",")
    unknown = sorted(set(names) - set(GOLDEN))
    if unknown:
        parser.error(f"--only: unknown {unknown}; known are {sorted(GOLDEN)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        fields, scale, seed = GOLDEN[name]
        np.savez_compressed(args.out / f"{name}.npz", **make(name, fields, scale, seed))
        print(f"wrote {args.out / (name + '.npz')}")


if __name__ == "__main__":
    main()
