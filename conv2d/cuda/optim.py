"""The optimizers' update of one layer as numba kernels: one launch updates every
parameter of the layer (up to four arrays: weights, bias, gamma, beta), with the same
arithmetic as `conv2d/reference/optim.py` in float32, elementwise (so bitwise
deterministic). Storage arrays are float32, float16 or uint16 bfloat16 bits; moments,
momentum buffers and 16-bit parameters' master copies are float32.

The step count lives on the device (`step`, one int64): a launch reads the count before
it, t - 1, computes step t's bias corrections in float64 (as the reference does on the
host), and its last block to finish (an atomic ticket) stores t. Nothing of a step is
passed from the host, so a CUDA graph that captured a training step replays with the
right t each time, bitwise like the eager steps.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping

import numpy as np

from conv2d.cuda.kernels import elementwise_grid, storage_io
from conv2d.cuda.runtime import numba_cuda

cuda = numba_cuda()
f32 = np.float32
ZERO, ONE, TWO = f32(0), f32(1), f32(2)
# Adam's update rules (the kernel's `rule` argument): rl_tools' (eps inside and outside the
# square root), torch.optim.Adam's (L2 weight decay), torch.optim.AdamW's (decoupled decay).
RULE_RL_TOOLS, RULE_TORCH, RULE_TORCH_W = 0, 1, 2
RULES = {"rl_tools": RULE_RL_TOOLS, "torch": RULE_TORCH, "torch_w": RULE_TORCH_W}
# The kernels' `flags` argument: HAS_MASTER << k where slot k keeps a float32 master copy;
# Adam: DECAYED << k where slot k is weight-decayed; SGD: HAS_MOMENTUM where the step
# keeps momentum buffers.
HAS_MASTER, DECAYED, HAS_MOMENTUM = 1, 16, 16
SLOTS = ("weights", "bias", "gamma", "beta")  # a layer's parameters, in the kernels' slot order


def _adam_one(io: Any) -> Any:
    load, store = io.load, io.store

    @cuda.jit(device=True, inline=True)
    def update(value, grad, m, v, master, has_master, decay, i, rule, lr, beta1, beta2, eps, eps_sqrt,
               weight_decay, c1, c2, step_size, bc2_sqrt):
        p = master[i] if has_master else load(value, i)
        g = load(grad, i)
        if rule == RULE_RL_TOOLS:
            mi = beta1 * m[i] + (ONE - beta1) * g
            vi = beta2 * v[i] + (ONE - beta2) * g * g
            update = lr * c1 * mi / (math.sqrt(max(vi * c2, eps_sqrt)) + eps)
            if decay:
                update += p * weight_decay / TWO
            p = p - update
        else:
            if rule == RULE_TORCH and weight_decay != ZERO:  # Adam's L2 term
                g = g + weight_decay * p
            elif rule == RULE_TORCH_W and weight_decay != ZERO:  # AdamW's decoupled decay
                p = p * (ONE - lr * weight_decay)
            mi = m[i] + (g - m[i]) * (ONE - beta1)
            vi = v[i] * beta2 + g * g * (ONE - beta2)
            p = p - step_size * mi / (math.sqrt(vi) / bc2_sqrt + eps)
        m[i] = mi
        v[i] = vi
        if has_master:
            master[i] = p
        store(value, i, p)
    return update


def _sgd_one(io: Any) -> Any:
    load, store = io.load, io.store

    @cuda.jit(device=True, inline=True)
    def update(value, grad, buf, master, has_master, has_buf, first, i, lr, momentum, dampening, weight_decay,
               nesterov):
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
    return update


@cuda.jit(device=True, inline=True)
def _finish_step(step, ticket, t):
    # Every thread of the block has read step[0] (before the barrier); the block's ticket
    # says it is done, and the last block stores t and resets the ticket for the next step.
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.threadfence()
        if cuda.atomic.add(ticket, 0, 1) == cuda.gridDim.x - 1:
            step[0] = t
            ticket[0] = 0


@functools.lru_cache(maxsize=None)
def adam_kernel(storages: tuple[str, str, str, str]) -> Any:
    """The fused Adam kernel for a layer whose four parameter slots store `storages`."""
    u0, u1, u2, u3 = (_adam_one(storage_io(s)) for s in storages)

    @cuda.jit
    def adam_layer(value0, grad0, m0, v0, master0, value1, grad1, m1, v1, master1, value2, grad2, m2, v2, master2,
                   value3, grad3, m3, v3, master3, n0, n1, n2, n3, flags, step, ticket, rule, lr64, beta1_64,
                   beta2_64, eps64, eps_sqrt64, weight_decay64):
        t = step[0] + 1
        b1t = math.pow(beta1_64, np.float64(t))
        b2t = math.pow(beta2_64, np.float64(t))
        c1 = np.float32(1.0 / (1.0 - b1t))
        c2 = np.float32(1.0 / (1.0 - b2t))
        step_size = np.float32(lr64 / (1.0 - b1t))
        bc2_sqrt = np.float32(math.sqrt(1.0 - b2t))
        lr, beta1, beta2 = np.float32(lr64), np.float32(beta1_64), np.float32(beta2_64)
        eps, eps_sqrt, wd = np.float32(eps64), np.float32(eps_sqrt64), np.float32(weight_decay64)
        e1 = n0 + n1
        e2 = e1 + n2
        for i in range(cuda.grid(1), e2 + n3, cuda.gridsize(1)):
            if i < n0:
                u0(value0, grad0, m0, v0, master0, flags & (HAS_MASTER << 0), flags & (DECAYED << 0), i,
                   rule, lr, beta1, beta2, eps, eps_sqrt, wd, c1, c2, step_size, bc2_sqrt)
            elif i < e1:
                u1(value1, grad1, m1, v1, master1, flags & (HAS_MASTER << 1), flags & (DECAYED << 1), i - n0,
                   rule, lr, beta1, beta2, eps, eps_sqrt, wd, c1, c2, step_size, bc2_sqrt)
            elif i < e2:
                u2(value2, grad2, m2, v2, master2, flags & (HAS_MASTER << 2), flags & (DECAYED << 2), i - e1,
                   rule, lr, beta1, beta2, eps, eps_sqrt, wd, c1, c2, step_size, bc2_sqrt)
            else:
                u3(value3, grad3, m3, v3, master3, flags & (HAS_MASTER << 3), flags & (DECAYED << 3), i - e2,
                   rule, lr, beta1, beta2, eps, eps_sqrt, wd, c1, c2, step_size, bc2_sqrt)
        _finish_step(step, ticket, t)
    return adam_layer


@functools.lru_cache(maxsize=None)
def sgd_kernel(storages: tuple[str, str, str, str]) -> Any:
    """The fused SGD kernel for a layer whose four parameter slots store `storages`."""
    u0, u1, u2, u3 = (_sgd_one(storage_io(s)) for s in storages)

    @cuda.jit
    def sgd_layer(value0, grad0, buf0, master0, value1, grad1, buf1, master1, value2, grad2, buf2, master2,
                  value3, grad3, buf3, master3, n0, n1, n2, n3, flags, step, ticket, lr64, momentum64,
                  dampening64, weight_decay64, nesterov):
        t = step[0] + 1
        first = t == 1
        has_buf = flags & HAS_MOMENTUM
        lr, momentum = np.float32(lr64), np.float32(momentum64)
        dampening, wd = np.float32(dampening64), np.float32(weight_decay64)
        e1 = n0 + n1
        e2 = e1 + n2
        for i in range(cuda.grid(1), e2 + n3, cuda.gridsize(1)):
            if i < n0:
                u0(value0, grad0, buf0, master0, flags & (HAS_MASTER << 0), has_buf, first, i, lr,
                   momentum, dampening, wd, nesterov)
            elif i < e1:
                u1(value1, grad1, buf1, master1, flags & (HAS_MASTER << 1), has_buf, first, i - n0, lr,
                   momentum, dampening, wd, nesterov)
            elif i < e2:
                u2(value2, grad2, buf2, master2, flags & (HAS_MASTER << 2), has_buf, first, i - e1, lr,
                   momentum, dampening, wd, nesterov)
            else:
                u3(value3, grad3, buf3, master3, flags & (HAS_MASTER << 3), has_buf, first, i - e2, lr,
                   momentum, dampening, wd, nesterov)
        _finish_step(step, ticket, t)
    return sgd_layer


def _slots(dtype: str, params: Mapping[str, Any], grads: Mapping[str, Any], buffers: Mapping[str, dict],
           per_slot: tuple[str, ...], absent: Any) -> tuple[dict, tuple, int]:
    """The kernel arguments of the four slots (absent ones: `absent`, size 0), their
    storage formats, and the flags' has-master bits."""
    args, storages, flags = {}, [], 0
    for k, name in enumerate(SLOTS):
        value = params.get(name)
        b = buffers.get(name, {})
        if value is None:
            storages.append("float32")
            args.update({f"value{k}": absent, f"grad{k}": absent, f"n{k}": np.int64(0)})
            args.update({f"{x}{k}": absent for x in per_slot})
            continue
        storages.append(dtype if value.dtype != np.float32 else "float32")
        master = b.get("master")
        flags |= (HAS_MASTER << k) if master is not None else 0
        args.update({f"value{k}": value, f"grad{k}": grads[name], f"n{k}": np.int64(value.size)})
        args.update({f"{x}{k}": b[x] if b.get(x) is not None else absent for x in per_slot})
    return args, tuple(storages), flags


def _total(args: dict) -> int:
    return int(args["n0"] + args["n1"] + args["n2"] + args["n3"])


def adam_step(launch: Callable[..., None], absent: Any, dtype: str, stream: Any, params: Mapping[str, Any],
              grads: Mapping[str, Any], buffers: Mapping[str, dict], step: Any, h: Mapping[str, Any],
              prepared: dict) -> None:
    """One Adam step of every parameter of a layer, one launch on `stream`, through the
    layer functions' `launch(launches, key, kernel, grid, block, fixed, **arrays)` into the
    dict `prepared` the caller keeps per layer (which also holds the ticket).
    `buffers[name]` holds "m", "v" (and "master" for a 16-bit parameter), float32; `step`
    the device step count; `absent` stands for missing arrays; `dtype` the layer's storage."""
    args, storages, flags = _slots(dtype, params, grads, buffers, ("m", "v", "master"), absent)
    for k, name in enumerate(SLOTS):
        if name in params and name in h["decayed"] and h["weight_decay"] > 0:
            flags |= DECAYED << k
    args.update(flags=np.int32(flags), step=step, ticket=_ticket(prepared, stream), rule=np.int32(RULES[h["rule"]]),
                lr64=np.float64(h["lr"]), beta1_64=np.float64(h["beta1"]), beta2_64=np.float64(h["beta2"]),
                eps64=np.float64(h["eps"]), eps_sqrt64=np.float64(h.get("eps_sqrt", 0.0)),
                weight_decay64=np.float64(h["weight_decay"]))
    launch(prepared, "adam", adam_kernel(storages), *elementwise_grid(_total(args)), {}, **args)


def sgd_step(launch: Callable[..., None], absent: Any, dtype: str, stream: Any, params: Mapping[str, Any],
             grads: Mapping[str, Any], buffers: Mapping[str, dict], step: Any, h: Mapping[str, Any],
             prepared: dict) -> None:
    """One SGD step of every parameter of a layer, one launch (see `adam_step`);
    `buffers[name]` holds "buf" with momentum (and "master" for a 16-bit parameter)."""
    args, storages, flags = _slots(dtype, params, grads, buffers, ("buf", "master"), absent)
    flags |= HAS_MOMENTUM if h["momentum"] > 0 else 0
    args.update(flags=np.int32(flags), step=step, ticket=_ticket(prepared, stream), lr64=np.float64(h["lr"]),
                momentum64=np.float64(h["momentum"]), dampening64=np.float64(h["dampening"]),
                weight_decay64=np.float64(h["weight_decay"]), nesterov=bool(h["nesterov"]))
    launch(prepared, "sgd", sgd_kernel(storages), *elementwise_grid(_total(args)), {}, **args)


def _ticket(prepared: dict, stream: Any) -> Any:
    """The layer's zeroed ticket (made once; the last block of each step resets it)."""
    if "ticket" not in prepared:
        prepared["ticket"] = cuda.to_device(np.zeros(1, np.int32), stream=stream)
    return prepared["ticket"]


class OptimizerSteps:
    """The optimizers' steps (conv2d.backend.OptimizerSteps) of the CUDA functions: one
    launch over a layer's flat parameters on the functions' current stream, under their
    lock. Mixed into `functional.Functions`, whose `_lock`, `_k` (kernels and launcher),
    `_dummy`, `spec` and `streams` it uses."""

    def adam_step(self, params: Mapping[str, Any], grads: Mapping[str, Any], buffers: Mapping[str, dict],
                  step: Any, h: dict, prepared: dict) -> None:
        """One Adam step of a layer's parameters; `step` is the device step count and
        `prepared` a dict the caller keeps per layer for the prepared launch."""
        with self._lock:
            adam_step(self._k.launch, self._dummy, self.spec.dtype.value, self.streams.current, params, grads,
                      buffers, step, h, prepared)

    def sgd_step(self, params: Mapping[str, Any], grads: Mapping[str, Any], buffers: Mapping[str, dict],
                 step: Any, h: dict, prepared: dict) -> None:
        """One SGD step of a layer's parameters (see `adam_step`)."""
        with self._lock:
            sgd_step(self._k.launch, self._dummy, self.spec.dtype.value, self.streams.current, params, grads,
                     buffers, step, h, prepared)
