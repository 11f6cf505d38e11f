"""The DQN loop end to end, in environment steps per second: the Breakout demo's DQN
(`conv2d demo --task breakout`: its Q-network, batch, discount, Huber loss, target network
copy, replay buffer and MinAtar environment) written the usual PyTorch way, and the demo's
own path, each driving its own environment through the same loop (`Loop`).

Variants (`VARIANTS`):
- "torch": plain PyTorch, eager (nn.Conv2d in channels_last memory, torch.optim.Adam);
  acting is a no_grad eval call at batch 1 and `.item()` of its argmax; one training step
  (values of a sampled batch, the target network's values, smooth_l1_loss, backward, Adam)
  per environment step;
- "module": the same script with the module swapped in (`conv2d.torch.swap`);
- "torch graph": plain PyTorch with its training step captured once in `torch.cuda.graph`
  (the sampled batch copied into the captured inputs, then a replay), acting eager;
- "demo": this library's own path (`conv2d.demos.breakout`: on CUDA its CUDA graphs over
  the NumPy-level API, on the CPU the reference backend's calls).

The timed steps are late-training steps: the replay buffer is filled with `warmup`
random-action steps first (learning starts there), then every step acts greedily with
probability 0.9 (epsilon at the demo's floor, 0.1) and trains once.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

from conv2d.demos import breakout

VARIANTS = ("torch", "module", "torch graph", "demo")


def torch_network(actions: int, device: str):
    """The demo's Q-network in PyTorch: (N, 4, 10, 10) in channels_last memory -> (N, actions)."""
    import torch
    from torch import nn

    net = nn.Sequential(nn.Conv2d(4, 16, 3), nn.ReLU(), nn.Conv2d(16, 128, 8), nn.ReLU(), nn.Conv2d(128, actions, 1),
                        nn.Flatten())
    return net.to(device=device, memory_format=torch.channels_last)


class TorchAgent:
    """The DQN as a PyTorch user writes it (eager), or with its training step in one
    `torch.cuda.graph` (`graph`)."""

    def __init__(self, q: Any, actions: int, batch: int, device: str, graph: bool = False) -> None:
        import torch

        self.torch, self.device, self.batch = torch, device, batch
        self.q, self.target = q, copy.deepcopy(q)
        self.opt = torch.optim.Adam(self.q.parameters(), lr=1e-3, eps=1e-8, capturable=graph)
        self.graph = None
        if graph:
            f32 = dict(device=device, dtype=torch.float32)
            self.inputs = {"s": torch.zeros(batch, 10, 10, 4, **f32), "s2": torch.zeros(batch, 10, 10, 4, **f32),
                           "a": torch.zeros(batch, dtype=torch.int64, device=device),
                           "r": torch.zeros(batch, **f32), "d": torch.zeros(batch, **f32)}

    def _nchw(self, s: Any) -> Any:
        return s.permute(0, 3, 1, 2)  # (N, H, W, C) as (N, C, H, W) in channels_last memory: a view

    def act(self, state: np.ndarray) -> int:
        torch = self.torch
        with torch.no_grad():
            x = torch.as_tensor(state, device=self.device, dtype=torch.float32)[None]
            return int(self.q(self._nchw(x)).argmax())

    def _step(self, s: Any, a: Any, r: Any, d: Any, s2: Any) -> None:
        torch = self.torch
        with torch.no_grad():
            y = r + breakout.GAMMA * (1.0 - d) * self.target(self._nchw(s2)).max(dim=1).values
        values = self.q(self._nchw(s)).gather(1, a[:, None])[:, 0]
        loss = torch.nn.functional.smooth_l1_loss(values, y)
        self.opt.zero_grad(set_to_none=self.graph is None)
        loss.backward()
        self.opt.step()

    def learn(self, rng: np.random.Generator, replay: tuple, size: int) -> None:
        torch = self.torch
        obs, next_obs, taken, rewards, done = replay
        idx = rng.integers(size, size=self.batch)
        batch = {"s": obs[idx], "s2": next_obs[idx], "a": taken[idx], "r": rewards[idx], "d": done[idx]}
        if self.inputs_captured():
            for k, v in batch.items():
                self.inputs[k].copy_(torch.from_numpy(v), non_blocking=False)
            self.graph.replay()
            return
        t = {k: torch.as_tensor(v, device=self.device, dtype=torch.int64 if k == "a" else torch.float32)
             for k, v in batch.items()}
        if hasattr(self, "inputs"):  # the first step: warm up on a side stream, then capture
            for k, v in t.items():
                self.inputs[k].copy_(v)
            self._capture()
            self.graph.replay()
            return
        self._step(t["s"], t["a"], t["r"], t["d"], t["s2"])

    def inputs_captured(self) -> bool:
        return self.graph is not None

    def _capture(self) -> None:
        torch, i = self.torch, self.inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._step(i["s"], i["a"], i["r"], i["d"], i["s2"])
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step(i["s"], i["a"], i["r"], i["d"], i["s2"])

    def sync_target(self) -> None:
        self.target.load_state_dict(self.q.state_dict())


class DemoAgent:
    """The demo's own networks and calls (conv2d.demos.breakout)."""

    def __init__(self, actions: int, batch: int, backend: str, seed: int) -> None:
        from conv2d.optim import Adam

        self.st = np.dtype(np.float32)
        self.batch = batch
        self.q = breakout.q_network(actions, batch, "float32", backend)
        self.q.init_weights(np.random.default_rng(seed))
        self.target = breakout.q_network(actions, batch, "float32", backend)
        self.target.load_state_dict(self.q.state_dict())
        opt = Adam(self.q, lr=1e-3, preset="rl_tools_eps_1e-8")
        self.net = breakout.networks(self.q, self.target, opt, batch, actions, self.st)

    def act(self, state: np.ndarray) -> int:
        return int(self.net.act(state).astype(np.float64).reshape(-1).argmax())

    def learn(self, rng: np.random.Generator, replay: tuple, size: int) -> None:
        breakout._learn(self.net, rng, replay, size, self.batch, self.st)

    def sync_target(self) -> None:
        self.target.load_state_dict(self.q.state_dict())


def make_agent(variant: str, actions: int, batch: int, device: str, seed: int = 0) -> Any:
    """The agent of `variant` (one of VARIANTS) on `device` ("cuda" or "cpu")."""
    if variant == "demo":
        return DemoAgent(actions, batch, "cuda" if device == "cuda" else "reference", seed)
    import torch

    torch.manual_seed(seed)
    q = torch_network(actions, device)
    if variant == "module":
        from conv2d.torch import swap

        q = swap(q)
    return TorchAgent(q, actions, batch, device, graph=variant == "torch graph")


class Loop:
    """One agent's environment, replay buffer and random numbers; `run(steps)` advances it."""

    def __init__(self, agent: Any, seed: int, replay_size: int) -> None:
        self.agent = agent
        self.env = breakout._environment(seed)
        self.actions = self.env.minimal_action_set()
        self.rng = np.random.default_rng(seed + 1)
        n = self.n = replay_size
        self.replay = (np.zeros((n, 10, 10, 4), np.float32), np.zeros((n, 10, 10, 4), np.float32),
                       np.zeros(n, np.int64), np.zeros(n, np.float32), np.zeros(n, np.float32))
        self.env.reset()
        self.state = self.env.state().astype(np.float32)
        self.step = 0
        self.learning = False

    def run(self, steps: int, epsilon: float) -> float:
        """Advance `steps` environment steps (acting greedily with probability 1 - epsilon,
        and training once a step once `learning`); returns the seconds they took."""
        agent, env, rng = self.agent, self.env, self.rng
        obs, next_obs, taken, rewards, done = self.replay
        start = time.perf_counter()
        for _ in range(steps):
            a = int(rng.integers(len(self.actions))) if rng.random() < epsilon else agent.act(self.state)
            r, terminal = env.act(self.actions[a])
            new_state = env.state().astype(np.float32)
            i = self.step % self.n
            obs[i], next_obs[i], taken[i], rewards[i], done[i] = self.state, new_state, a, r, float(terminal)
            if terminal:
                env.reset()
                new_state = env.state().astype(np.float32)
            self.state = new_state
            self.step += 1
            if self.learning:
                agent.learn(rng, self.replay, min(self.step, self.n))
            if self.step % breakout.TARGET_EVERY == 0:
                agent.sync_target()
        return time.perf_counter() - start


def steps_per_second(device: str, variants: list[str], warmup: int, steps: int, rounds: int,
                     batch: int = 32, seed: int = 0) -> dict[str, float]:
    """Each variant's median environment steps per second over `rounds` rounds of `steps`
    late-training steps, the variants timed in turns within each round (after `warmup`
    random steps and one untimed round that captures, plans and compiles)."""
    import statistics

    loops = {}
    for v in variants:
        agent = make_agent(v, len(breakout._environment(seed).minimal_action_set()), batch, device, seed)
        loop = loops[v] = Loop(agent, seed, replay_size=max(warmup + (rounds + 1) * steps, batch))
        loop.run(warmup, epsilon=1.0)
        loop.learning = True
        loop.run(steps, epsilon=breakout.EPS_END)
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            rates[v].append(steps / loops[v].run(steps, epsilon=breakout.EPS_END))
    return {v: statistics.median(r) for v, r in rates.items()}
