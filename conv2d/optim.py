"""Optimizers over layers' parameters, in place, on either backend, deterministic.

    opt = Adam(model)          # a Conv2d, a Sequential, or a list of them
    ...forward, backward...
    opt.step()                 # updates every parameter from its accumulated gradient
    opt.zero_grad()            # the layers' zero_gradient()

`Adam`'s presets are named for the formula they compute. By default, "rl_tools": rl_tools'
`nn/optimizers/adam` with its default hyper-parameters (its "TensorFlow" preset: alpha
1e-3, beta1 0.9, beta2 0.999, eps = eps_sqrt = 1e-7); "rl_tools_eps_1e-8": the same
formula with eps = eps_sqrt = 1e-8 (rl_tools' "PyTorch" preset, which is not torch's
formula); with t the step count from 1:

    m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
    update = alpha / (1 - beta1^t) * m / (sqrt(max(v / (1 - beta2^t), eps_sqrt)) + eps)
    update += value * weight_decay / 2   (weights and gamma only)
    value -= update

and "torch" / "torch_adamw": exactly as `torch.optim.Adam` / `AdamW` compute
(weight decay on every parameter: added to the gradient, or decoupled). `SGD` computes as
`torch.optim.SGD` (momentum, dampening, Nesterov, weight decay). 16-bit parameters keep a
float32 master copy here (the original's master parameters), taken when the optimizer is
made: load weights first, then make the optimizer (or load its `state_dict`); moments are
float32 (float64 for float64 layers). `state_dict()`/`load_state_dict()` save and restore
the step count and every buffer. The arithmetic is `conv2d/reference/optim.py` (NumPy) or
`conv2d/cuda/optim.py` (one kernel launch a layer), per the layer's backend.

The step count t lives beside each layer's buffers on its backend (on the GPU, in device
memory, read and advanced by the update kernel), so that a CUDA graph of a whole training
step (`Conv2d.capture(x, d_y, optimizer=...)`) replays with the right t; `t` reads it.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

from conv2d.dtypes import compute_dtype, storage_dtype
from conv2d.layer import Conv2d, layer_locks, synchronize
from conv2d.checks import check_finite
from conv2d.state import state_layout

ADAM_PRESETS = {
    "rl_tools": dict(rule="rl_tools", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-7, eps_sqrt=1e-7),
    "rl_tools_eps_1e-8": dict(rule="rl_tools", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, eps_sqrt=1e-8),
    "torch": dict(rule="torch", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, eps_sqrt=0.0),
    "torch_adamw": dict(rule="torch_w", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, eps_sqrt=0.0),
}
# The earlier names, which said whose defaults rather than which formula: "pytorch" read
# as torch.optim.Adam's formula beside "torch", which is.
RENAMED_PRESETS = {"tensorflow": "rl_tools", "pytorch": "rl_tools_eps_1e-8"}
DECAYED = ("weights", "gamma")  # what rl_tools' weight decay applies to
# The largest step count loaded: counted exactly in float64 (the bias corrections'
# exponent) and far from int64's end, so that no step overflows the count.
MAX_STEPS = 1 << 53


def _layers(model: Any) -> list[Conv2d]:
    if isinstance(model, Conv2d):
        return [model]
    layers = getattr(model, "layers", model)
    if isinstance(layers, Iterable):
        out = list(layers)
        if out and all(isinstance(layer, Conv2d) for layer in out):
            return out
    raise TypeError(f"model: expected a Conv2d, a Sequential or a list of Conv2d, got {type(model).__name__}")


def _number(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False,
            high_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name}: expected a number in {lo}{low}, {high}{hi}, got {value!r}")
    return float(value)


class _Optimizer:
    """The state common to both: the layers, the step count, and per parameter the
    optimizer's arrays on the layer's backend (and a float32 master copy of 16-bit ones)."""

    def __init__(self, model: Any) -> None:
        self.layers = _layers(model)
        _check_representable(self.hyper, {compute_dtype(layer.spec.dtype) for layer in self.layers})
        self.state: list[dict[str, dict[str, Any]]] = []
        self._steps: list[Any] = []  # per layer, the step count (one int64) on its backend
        self._prepared: list[dict] = []  # per layer, what its backend keeps between steps (CUDA: the launch)
        for layer in self.layers:
            params = layer.state_dict()
            fn = layer.functions
            per = {}
            for name in layer.parameters():
                value = params[name]
                ct = compute_dtype(layer.spec.dtype)
                arrays = {k: np.zeros(value.shape, ct) for k in self._buffers()}
                if value.dtype != ct and value.dtype == storage_dtype(layer.spec.dtype):
                    arrays["master"] = value.astype(np.float32)
                per[name] = fn.from_host(arrays)
            self.state.append(per)
            self._steps.append(fn.from_host({"step": np.zeros(1, np.int64)})["step"])
            self._prepared.append({})

    @property
    def t(self) -> int:
        """Steps taken (after the steps queued on the GPU, which this waits for)."""
        return int(self._host(self.layers[0], {"t": self._steps[0]})["t"][0])

    @staticmethod
    def _host(layer: Conv2d, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
        """Host copies of a layer's optimizer arrays, after the updates queued before them."""
        synchronize(layer)
        return {k: a.copy() if isinstance(a, np.ndarray) else a.copy_to_host() for k, a in arrays.items()}

    def _buffers(self) -> tuple[str, ...]:
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Zero every layer's accumulated gradients."""
        for layer in self.layers:
            layer.zero_gradient()

    def step(self) -> None:
        """Update every parameter from its layer's accumulated gradient, in place (one
        launch a layer on the GPU, on the layer's current stream), holding every layer's
        lock (conv2d.layer.layer_locks): other threads' calls see all of a step or none."""
        with layer_locks(self.layers):
            for layer, per, step, prepared in zip(self.layers, self.state, self._steps, self._prepared):
                self._step(layer.functions, layer.parameters(), layer.gradients(), per, step, prepared)
                layer.parameters_changed()

    def _step(self, fn: Any, params: dict, grads: dict, buffers: dict, step: Any, prepared: dict) -> None:
        raise NotImplementedError

    def snapshot(self) -> Any:
        """A function that puts the step count and every buffer back as they are now (what
        a capture's warm-up step changed)."""
        state = self.state_dict()
        return lambda: self.load_state_dict(state)

    def _layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """"<layer>.<parameter>.<buffer>" -> (shape, dtype) of every buffer (the parameter's
        shape; the buffer's own dtype, float32 or float64), without reading any."""
        return {f"{i}.{name}.{k}": (state_layout(layer.spec)[name][0], np.dtype(a.dtype))
                for i, (layer, per) in enumerate(zip(self.layers, self.state))
                for name, buffers in per.items() for k, a in buffers.items()}

    def state_dict(self) -> dict[str, Any]:
        """The step count and every buffer as NumPy copies, keyed "<layer>.<parameter>.<buffer>"
        ("m", "v" for Adam, "buf" for SGD with momentum, "master" for 16-bit parameters)."""
        layout, arrays = self._layout(), {}
        for i, (layer, per) in enumerate(zip(self.layers, self.state)):
            for name, buffers in per.items():
                for k, v in self._host(layer, buffers).items():
                    key = f"{i}.{name}.{k}"
                    arrays[key] = v.reshape(layout[key][0])
        return {"t": self.t, "arrays": arrays}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the step count and buffers; every key, shape and dtype is checked first."""
        if not isinstance(state, dict) or set(state) != {"t", "arrays"}:
            raise ValueError(f"state: expected a dict with keys ['arrays', 't'], got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        t = state["t"]
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_STEPS:
            raise ValueError(f"state['t']: expected an int in [0, 2**53], got {t!r}")
        mine = self._layout()
        arrays = state["arrays"]
        if not isinstance(arrays, dict) or set(arrays) != set(mine):
            raise KeyError(f"state['arrays']: expected keys {sorted(mine)}, got "
                           f"{sorted(map(str, arrays)) if isinstance(arrays, dict) else type(arrays).__name__}")
        for k, (shape, dtype) in mine.items():
            a = arrays[k]
            if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != dtype:
                raise ValueError(f"state['arrays'][{k!r}]: expected a {dtype} array of shape {shape}, got "
                                 f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
            check_finite(f"state['arrays'][{k!r}]", a)
            if k.endswith(".v") and (a < 0).any():
                raise ValueError(f"state['arrays'][{k!r}]: a second moment must be >= 0, got min {a.min()}")
        for i, (layer, per, step) in enumerate(zip(self.layers, self.state, self._steps)):
            for name, buffers in per.items():
                layer.functions.write(buffers, {k: arrays[f"{i}.{name}.{k}"] for k in buffers})
            layer.functions.write({"step": step}, {"step": np.array([t], np.int64)})


def _check_representable(hyper: dict[str, Any], dtypes: set[np.dtype]) -> None:
    """Every number of `hyper` must stay finite, and nonzero if it is, in each dtype the
    updates compute in (lr=1e300 is infinite in float32 and would make every parameter NaN)."""
    for name, value in hyper.items():
        if not isinstance(value, float):
            continue
        for dt in dtypes:
            with np.errstate(over="ignore", under="ignore"):
                there = dt.type(value)
            if not np.isfinite(there) or (value != 0 and there == 0):
                raise ValueError(f"{name}: {value!r} is {there!r} in {dt}, the dtype the update computes in; "
                                 f"expected a value finite and nonzero there")


class Adam(_Optimizer):
    """Adam over the parameters of `model`; see the module docstring for the presets.
    `lr` is rl_tools' alpha."""

    def __init__(self, model: Any, preset: str = "rl_tools", lr: float | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None, eps_sqrt: float | None = None,
                 weight_decay: float = 0.0) -> None:
        if preset in RENAMED_PRESETS:
            raise ValueError(f"preset: {preset!r} is now {RENAMED_PRESETS[preset]!r} (presets are named for the "
                             f"formula they compute; torch.optim.Adam's is 'torch')")
        if preset not in ADAM_PRESETS:
            raise ValueError(f"preset: expected one of {sorted(ADAM_PRESETS)}, got {preset!r}")
        h = dict(ADAM_PRESETS[preset])
        if lr is not None:
            h["lr"] = _number("lr", lr, 0.0, low_open=True)
        if betas is not None:
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ValueError(f"betas: expected a pair of numbers in [0, 1), got {betas!r}")
            h["beta1"] = _number("betas[0]", betas[0], 0.0, 1.0, high_open=True)
            h["beta2"] = _number("betas[1]", betas[1], 0.0, 1.0, high_open=True)
        if eps is not None:
            h["eps"] = _number("eps", eps, 0.0)
        if eps_sqrt is not None:
            h["eps_sqrt"] = _number("eps_sqrt", eps_sqrt, 0.0)
        h["weight_decay"] = _number("weight_decay", weight_decay, 0.0)
        self.hyper = h
        super().__init__(model)

    def _buffers(self) -> tuple[str, ...]:
        return ("m", "v")

    def _step(self, fn: Any, params: dict, grads: dict, buffers: dict, step: Any, prepared: dict) -> None:
        fn.adam_step(params, grads, buffers, step, dict(self.hyper, decayed=DECAYED), prepared)


class SGD(_Optimizer):
    """torch.optim.SGD's rule over the parameters of `model`."""

    def __init__(self, model: Any, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        self.hyper = dict(lr=_number("lr", lr, 0.0, low_open=True), momentum=_number("momentum", momentum, 0.0),
                          dampening=_number("dampening", dampening, 0.0, 1.0),
                          weight_decay=_number("weight_decay", weight_decay, 0.0), nesterov=nesterov)
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov: expected a bool, got {nesterov!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: needs a momentum > 0 and zero dampening (as torch.optim.SGD)")
        super().__init__(model)

    def _buffers(self) -> tuple[str, ...]:
        return ("buf",) if self.hyper["momentum"] > 0 else ()

    def _step(self, fn: Any, params: dict, grads: dict, buffers: dict, step: Any, prepared: dict) -> None:
        fn.sgd_step(params, grads, buffers, step, self.hyper, prepared)
