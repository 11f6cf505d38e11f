"""Reading the golden files and checking a layer of any backend and dtype against them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from conv2d.activations import JUMPING_DERIVATIVE
from conv2d.dtypes import storage_dtype
from conv2d.arrays import to_host
from conv2d.layer import Conv2d
from conv2d.spec import DType, LayerSpec
from conv2d.state import RUNNING, state_layout
from conv2d.dtypes import tolerance
from conv2d.testing import cancellation_scales, conditioning_scales, reduction_lengths, relative_error

MODES = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class GoldenCase:
    name: str
    spec: LayerSpec  # float64, as the oracle ran it
    arrays: dict

    def spec_as(self, dtype: DType | str) -> LayerSpec:
        return dataclasses.replace(self.spec, dtype=dtype)

    def state_as(self, dtype: DType | str) -> dict[str, np.ndarray]:
        layout = state_layout(self.spec_as(dtype))
        return {k: self.arrays[f"state.{k}"].astype(dt) for k, (_, dt) in layout.items()}


def golden_files(directory: Path) -> list[Path]:
    """The golden files (made by scripts/make_golden.py) in `directory`, by name."""
    return sorted(Path(directory).glob("*.npz"))


def load_case(path: Path) -> GoldenCase:
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    spec = LayerSpec.from_dict(json.loads(arrays.pop("spec").tobytes().decode()))
    return GoldenCase(path.stem, spec, arrays)


def run_case(case: GoldenCase, dtype: DType | str, mode: str, backend: str = "reference",
             **options: Any) -> dict[str, np.ndarray]:
    """forward(training=mode == "train") then backward_full on the case's inputs at `dtype`."""
    spec = case.spec_as(dtype)
    layer = Conv2d(spec, backend, **options)
    layer.load_state_dict(case.state_as(dtype))
    st = storage_dtype(spec.dtype)
    x = case.arrays["x"].astype(st)
    d_y = case.arrays["d_y"].astype(st)
    out = {"y": to_host(layer.forward(x, training=(mode == "train")), st)}
    out["pre_activations"] = to_host(layer.pre_activations, st)
    out["d_x"] = to_host(layer.backward_full(x, d_y), st)
    out.update({f"grad.{k}": v for k, v in layer.grad_dict().items()})
    state = layer.state_dict()
    out.update({k: state[k] for k in RUNNING if k in state})
    return out


def case_errors(case: GoldenCase, got: dict[str, np.ndarray], dtype: DType | str,
                mode: str) -> list[tuple[str, float, float]]:
    """(result, relative error, tolerance) of every result against the oracle's."""
    lengths = reduction_lengths(case.spec)
    jumps = case.spec.activation in JUMPING_DERIVATIVE
    scales = cancellation_scales(case.spec, mode == "train", case.arrays["x"],
                                 case.arrays[f"{mode}.d_pre_activations"])
    state = {k[len("state."):]: v for k, v in case.arrays.items() if k.startswith("state.")}
    conditioning = conditioning_scales(case.spec, state, case.arrays["x"], case.arrays["d_y"], mode == "train")
    out = []
    for key, value in got.items():
        want = case.arrays[f"{mode}.{key}"]
        if key == "num_batches_tracked":  # a count: exact (any difference is >= 1 / the count)
            off = abs(int(value) - int(want)) / max(abs(int(want)), 1)
            out.append((key, float(off), 1e-9))
            continue
        name = key.removeprefix("grad.")
        scale = scales.get(name, 0.0) if key.startswith("grad.") else conditioning.get(key, 0.0)
        is_grad = key.startswith("grad.") or key == "d_x"
        out.append((key, relative_error(value, want, scale),
                    tolerance(DType(dtype), lengths[name], jumps and is_grad)))
    return out


def check_case(case: GoldenCase, got: dict[str, np.ndarray], dtype: DType | str, mode: str) -> None:
    """Every result within the dtype's tolerance of the oracle's."""
    for key, err, tol in case_errors(case, got, dtype, mode):
        if not err <= tol:
            raise AssertionError(f"{case.name} {mode} {key}: relative error {err:.3e} > tolerance {tol:.3e} "
                                 f"({DType(dtype).value})")
