"""The optimizers' per-array updates as numba kernels, the same arithmetic as
`conv2d/reference/optim.py` in float32, elementwise (so bitwise deterministic): one
launch a parameter array. Storage arrays are float32, float16 or uint16 bfloat16 bits;
moments, momentum buffers and 16-bit parameters' master copies are float32."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from conv2d.cuda.kernels import elementwise_grid, storage_io
from conv2d.cuda.runtime import numba_cuda

cuda = numba_cuda()
f32 = np.float32
ZERO, ONE, TWO = f32(0), f32(1), f32(2)
RULES = {"rl_tools": 0, "torch": 1, "torch_w": 2}


@functools.lru_cache(maxsize=None)
def kernels(storage: str) -> tuple[Any, Any]:
    """(adam, sgd) kernels for arrays of one storage format."""
    load, store, _, _, _ = storage_io(storage)

    @cuda.jit
    def adam(value, grad, m, v, master, has_master, rule, lr, beta1, beta2, eps, eps_sqrt, weight_decay, decay,
             c1, c2, step_size, bc2_sqrt, total):
        for i in range(cuda.grid(1), total, cuda.gridsize(1)):
            p = master[i] if has_master else load(value, i)
            g = load(grad, i)
            if rule == 0:  # rl_tools
                mi = beta1 * m[i] + (ONE - beta1) * g
                vi = beta2 * v[i] + (ONE - beta2) * g * g
                update = lr * c1 * mi / (math.sqrt(max(vi * c2, eps_sqrt)) + eps)
                if decay:
                    update += p * weight_decay / TWO
                p = p - update
            else:
                if rule == 1 and weight_decay != ZERO:  # Adam's L2 term
                    g = g + weight_decay * p
                elif rule == 2 and weight_decay != ZERO:  # AdamW's decoupled decay
                    p = p * (ONE - lr * weight_decay)
                mi = m[i] + (g - m[i]) * (ONE - beta1)
                vi = v[i] * beta2 + g * g * (ONE - beta2)
                p = p - step_size * mi / (math.sqrt(vi) / bc2_sqrt + eps)
            m[i] = mi
            v[i] = vi
            if has_master:
                master[i] = p
            store(value, i, p)

    @cuda.jit
    def sgd(value, grad, buf, master, has_master, has_buf, first, lr, momentum, dampening, weight_decay,
            nesterov, total):
        for i in range(cuda.grid(1), total, cuda.gridsize(1)):
            p = master[i] if has_master else load(value, i)
            g = load(grad, i)
            if weight_decay != ZERO:
                g = g + weight_decay * p
            if has_buf:
                b = g if first else buf[i] * momentum + g * (ONE - dampening)
                buf[i] = b
                g = g + momentum * b if nesterov else b
            p = p - lr * g
            if has_master:
                master[i] = p
            store(value, i, p)

    return adam, sgd


def adam(cuda_fn: Any, value: Any, grad: Any, m: Any, v: Any, master: Any, h: dict) -> None:
    """One Adam step of a flat device parameter on the functions' current stream."""
    k, _ = kernels(cuda_fn.spec.dtype.value if value.dtype != np.float32 else "float32")
    total = value.size
    d = master if master is not None else m
    k[elementwise_grid(total)[0], elementwise_grid(total)[1], cuda_fn.current_stream](
        value, grad, m, v, d, master is not None, RULES[h["rule"]], f32(h["lr"]), f32(h["beta1"]), f32(h["beta2"]),
        f32(h["eps"]), f32(h.get("eps_sqrt", 0.0)), f32(h["weight_decay"]), bool(h.get("decay", False)),
        f32(h.get("c1", 1.0)), f32(h.get("c2", 1.0)), f32(h.get("step_size", 0.0)), f32(h.get("bc2_sqrt", 1.0)),
        total)


def sgd(cuda_fn: Any, value: Any, grad: Any, buf: Any, master: Any, h: dict) -> None:
    """One SGD step of a flat device parameter on the functions' current stream."""
    _, k = kernels(cuda_fn.spec.dtype.value if value.dtype != np.float32 else "float32")
    total = value.size
    d = master if master is not None else (buf if buf is not None else value)
    k[elementwise_grid(total)[0], elementwise_grid(total)[1], cuda_fn.current_stream](
        value, grad, buf if buf is not None else d, master if master is not None else d, master is not None,
        buf is not None, bool(h["first"]), f32(h["lr"]), f32(h["momentum"]), f32(h["dampening"]),
        f32(h["weight_decay"]), bool(h["nesterov"]), total)
