"""`swap(model)`: every `Conv2d [-> BatchNorm2d or GroupNorm(1, C)] [-> activation]` chain that
a model's forward runs becomes one `Conv2dNormActivation`, in place; `unswap(model)` puts
PyTorch's modules back. Checkpoints load either way: a swapped model's `state_dict` has
the original model's keys in the original order, and its `load_state_dict` takes them.

What forward does is read from a `torch.fx` symbolic trace of the model: a convolution
whose only use is a norm module, whose only use is an activation module (or a convolution
straight into an activation), each module called once, becomes one module, whatever
attributes hold the parts (ResNet's conv1, bn1, relu; a Sequential's 0, 1, 2). A chain
stops where a value is used elsewhere (a residual add, a pooling, a second reader) or a
module is called at several places (torchvision's BasicBlock calls its `relu` twice: its
conv1 and bn1 convert, the ReLU stays). Every other nn.Conv2d converts alone (norm and
activation "none"), so each one the forward calls runs here. Where tracing fails (data-
dependent control flow, an untraceable call), the runs of each `nn.Sequential`'s children
convert instead, and the report says why.

Then, by default, each run of two or more new modules that follow one another in an
nn.Sequential (the Identity modules left between them aside) becomes one `Conv2dRun` at the
first one's name (conv2d.torch.runs: one autograd node and one CUDA graph replay for the
run, the same results), the others' names holding nn.Identity (a forward hook on such a
placeholder sees what passes it: the run's output); `swap(model, runs=False)` keeps one
module a chain, each layer's output in the model.

The new module takes the Conv2d's place and shares its tensors (the same Parameter
objects: an optimizer made before the swap still trains them); the norm and the
activation become `nn.Identity`, so every name stays. `unswap` puts the original module
objects back, flags (`inplace=True`) and hooks included, holding the swapped module's
current tensors. `swap(model, report=True)` returns (model, SwapReport): what converted
and, for each convolution left, why. Hooks registered on the replaced modules do not run
while they are swapped out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from conv2d.torch.module import Conv2dNormActivation
from conv2d.torch.runs import Conv2dRun

_ACTIVATIONS = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.Identity: "identity", nn.SiLU: "silu",
                nn.ReLU6: "relu6", nn.Hardswish: "hardswish", nn.LeakyReLU: "leaky_relu", nn.ELU: "elu"}
_HANDLES = "_conv2d_swap_handles"  # on each module that renames keys for swapped ones: its hooks
_RECORD = "_conv2d_swapped"  # on each swapped-in module: (conv, norm, activation) names and originals
SUBCLASS = "a subclass of nn.Conv2d (its forward may do something else)"
UNTRACED = "outside an nn.Sequential, and the forward was not traced"


@dataclasses.dataclass
class SwapReport:
    """What `swap` did. `traced`: whether the forward was traced (else `reason` says why,
    and only nn.Sequential runs were read). `converted`: (conv, norm or None, activation
    or None) qualified names of each new module. `left`: reason -> the convolutions left.
    `runs`: the conv names of each Conv2dRun (consecutive modules called as one)."""

    traced: bool
    reason: str | None
    converted: list[tuple[str, str | None, str | None]]
    left: dict[str, list[str]]
    runs: list[list[str]] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        """The model's nn.Conv2d modules, converted or left."""
        return len(self.converted) + sum(map(len, self.left.values()))

    @property
    def fraction(self) -> float:
        """Converted convolutions / all nn.Conv2d modules (1.0 for a model with none)."""
        return len(self.converted) / self.total if self.total else 1.0

    def __str__(self) -> str:
        normed = sum(n is not None for _, n, _ in self.converted)
        activated = sum(a is not None for _, _, a in self.converted)
        lines = [f"swap: {len(self.converted)} of {self.total} convolutions converted ({normed} with their norm, {activated} with their activation); "
                 + ("traced" if self.traced else f"not traced ({self.reason}): Sequential runs only")]
        if self.runs:
            lines.append(f"  {len(self.runs)} runs of consecutive layers called as one "
                         f"({sum(map(len, self.runs))} layers)")
        lines += [f"  left, {reason}: {len(names)} ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
                  for reason, names in self.left.items()]
        return "\n".join(lines)


def _activation(module: nn.Module | None) -> str | None:
    if isinstance(module, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}[module.approximate]
    return _ACTIVATIONS.get(type(module))


def _norm_kind(norm: nn.Module | None, channels: int) -> str | None:
    if type(norm) is nn.BatchNorm2d and norm.num_features == channels:
        return "batch_norm"
    if type(norm) is nn.GroupNorm and norm.num_groups == 1 and norm.num_channels == channels:
        return "layer_norm"
    return None


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, with the modules swap makes (already swapped in) as leaves."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Conv2dNormActivation) or super().is_leaf_module(m, qualname)


def _only_reader(node: Any) -> Any:
    """The one node that reads `node`'s value, where it is a module called on that value
    alone; else None."""
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_module" and tuple(users[0].args) == (node,) and not users[0].kwargs:
        return users[0]
    return None


def _traced_chains(model: nn.Module, modules: dict[str, nn.Module]) -> list[tuple[str, str | None, str | None]]:
    """(conv, norm or None, activation or None) of each chain the traced forward runs,
    then each nn.Conv2d it never calls, alone."""
    graph = _Tracer().trace(model)
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    chains, seen = [], set()
    for node in graph.nodes:
        if node.op != "call_module" or type(modules[node.target]) is not nn.Conv2d or node.target in seen:
            continue
        seen.add(node.target)
        norm = act = None
        nxt = _only_reader(node) if calls[node.target] == 1 else None
        if nxt is not None and calls[nxt.target] == 1 and _norm_kind(modules[nxt.target],
                                                                      modules[node.target].out_channels):
            norm, nxt = nxt.target, _only_reader(nxt)
        if nxt is not None and calls[nxt.target] == 1 and _activation(modules[nxt.target]) is not None:
            act = nxt.target
        chains.append((node.target, norm, act))
    chains += [(name, None, None) for name, m in modules.items() if type(m) is nn.Conv2d and name not in seen]
    return chains


def _sequential_chains(modules: dict[str, nn.Module]) -> list[tuple[str, str | None, str | None]]:
    """(conv, norm or None, activation or None) of each run of an nn.Sequential's children."""
    chains = []
    for prefix, seq in modules.items():
        if not isinstance(seq, nn.Sequential):
            continue
        names = list(seq._modules)
        i = 0
        while i < len(names):
            conv = seq._modules[names[i]]
            if type(conv) is not nn.Conv2d:
                i += 1
                continue
            norm = act = None
            j = i + 1
            if j < len(names) and _norm_kind(seq._modules[names[j]], conv.out_channels):
                norm, j = names[j], j + 1
            if j < len(names) and _activation(seq._modules[names[j]]) is not None:
                act, j = names[j], j + 1
            full = (lambda n: f"{prefix}.{n}" if prefix else n)
            chains.append((full(names[i]), norm and full(norm), act and full(act)))
            i = j
    return chains


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _relative(name: str, prefix: str) -> str:
    return name[len(prefix) + 1:] if prefix else name


def _common_prefix(*names: str) -> str:
    """The qualified name of the innermost module holding every one of `names`."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def _make(conv: nn.Conv2d, norm: nn.Module | None, act: nn.Module | None) -> Conv2dNormActivation:
    """The module for one chain, holding the chain's own tensors (the same objects where
    it keeps them in the same dtype: a 16-bit model's norm stays float32 here, a copy)."""
    kind = _norm_kind(norm, conv.out_channels) if norm is not None else "none"
    options: dict[str, Any] = {}
    if kind == "batch_norm":
        options = dict(eps=norm.eps, momentum=norm.momentum, affine=norm.affine,
                       track_running_stats=norm.track_running_stats)
    elif kind == "layer_norm":
        options = dict(eps=norm.eps, affine=norm.affine)
    if isinstance(act, nn.LeakyReLU):
        options["negative_slope"] = act.negative_slope
    elif isinstance(act, nn.ELU):
        options["alpha"] = act.alpha
    ours = Conv2dNormActivation(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                                conv.dilation, conv.groups, bias=conv.bias is not None, padding_mode=conv.padding_mode,
                                norm=kind, activation=_activation(act) if act is not None else "identity",
                                device=conv.weight.device, dtype=conv.weight.dtype, **options)
    for source, target in ((conv, ours.conv), (norm, ours.norm)):
        for name, value in _own_tensors(source):
            _share(target, name, value)
    ours.train(conv.training)
    return ours


def _own_tensors(module: nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of `module`'s own parameters and buffers (none for None)."""
    if module is None:
        return []
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _share(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Give `module` the tensor `value` as its `name` (the same object), or its values
    where the module keeps another dtype."""
    mine = getattr(module, name)
    if mine is None:
        return
    if mine.dtype != value.dtype or mine.shape != value.shape:
        with torch.no_grad():
            mine.copy_(value)
    elif name in module._parameters:
        module._parameters[name] = value
    else:
        module._buffers[name] = value


def _renamer(renames: dict[str, str], order: list[str] | None) -> Any:
    """A function that renames the keys under `prefix` of a state dict by `renames`
    (relative name prefixes, longest first) and, with `order` (relative keys), puts them
    in that order (keys it does not list after those it does)."""
    by_length = sorted(renames, key=len, reverse=True)
    rank = {k: i for i, k in enumerate(order or [])}

    def rename(state: dict[str, Any], prefix: str) -> None:
        mine = [k for k in state if k.startswith(prefix)]
        moved = []
        for key in mine:
            rest = key[len(prefix):]
            new = next((renames[old] + rest[len(old):] for old in by_length if rest.startswith(old)), rest)
            moved.append((new, state.pop(key)))
        if order is not None:
            moved.sort(key=lambda kv: rank.get(kv[0], len(rank)))
        for new, value in moved:
            state[prefix + new] = value
    return rename


def _hook(holder: nn.Module, renames: dict[str, str], order: list[str]) -> None:
    """State-dict hooks on `holder`: what it saves is renamed by `renames` (the new
    module's keys to the original model's) and put in the original `order`, what it
    loads is renamed back."""
    to_original = _renamer(renames, order)
    from_original = _renamer({v: k for k, v in renames.items()}, None)

    def saving(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        to_original(state, prefix)

    def loading(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        from_original(state, prefix)

    post = getattr(holder, "register_state_dict_post_hook", None) or holder._register_state_dict_hook
    handles = getattr(holder, _HANDLES, [])
    handles += [post(saving), holder.register_load_state_dict_pre_hook(loading)]
    object.__setattr__(holder, _HANDLES, handles)


def _pure(m: nn.Module) -> bool:
    """An nn.Sequential whose forward is nn.Sequential's: each child reads the one before's output alone."""
    return isinstance(m, nn.Sequential) and not isinstance(m, Conv2dRun) and type(m).forward is nn.Sequential.forward


def _leaves(seq: nn.Module, inside: set[int]) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, child) of what `seq`'s forward calls in turn, nested pure
    Sequentials opened (a torchvision Conv2dNormActivation is one), their ids put in `inside`."""
    out = []
    for attr, child in seq._modules.items():
        if _pure(child):
            inside.add(id(child))
            out += _leaves(child, inside)
        elif child is not None:
            out.append((seq, attr, child))
    return out


def _group_runs(model: nn.Module, placed: dict[int, str]) -> list[list[str]]:
    """Put one Conv2dRun in place of each run of two or more swapped-in modules that an
    nn.Sequential calls one after another (nested Sequentials opened, only the Identity
    modules swap put in between; nn.Sequential's own forward, so each reads the one
    before's output alone): at the first one's name, the others' names holding
    nn.Identity. Returns each run's conv names, first to last."""
    grouped: list[list[str]] = []
    inside: set[int] = set()
    for seq in [m for m in model.modules() if _pure(m)]:
        if id(seq) in inside:  # opened as part of an outer Sequential
            continue
        runs: list[list] = [[]]
        for parent, attr, child in _leaves(seq, inside):
            if isinstance(child, Conv2dNormActivation) and id(child) in placed:
                if runs[-1] and not _joins(runs[-1][-1][2], child):
                    runs.append([])
                runs[-1].append((parent, attr, child))
            elif not (isinstance(child, nn.Identity) and id(child) in placed):
                runs.append([])
        for members in (r for r in runs if len(r) > 1):
            for parent, attr, _ in members[1:]:
                setattr(parent, attr, nn.Identity())
            parent, attr, _ = members[0]
            setattr(parent, attr, Conv2dRun(*(child for _, _, child in members)))
            grouped.append([placed[id(child)] for _, _, child in members])
    return grouped


def _joins(before: Conv2dNormActivation, after: Conv2dNormActivation) -> bool:
    return before.layout == after.layout and before._spec.out_channels == after._spec.in_channels


def swap(model: nn.Module, report: bool = False, runs: bool = True) -> nn.Module | tuple[nn.Module, SwapReport]:
    """Replace each conv [-> norm] [-> activation] chain the model's forward runs by a
    Conv2dNormActivation sharing its tensors, and (with `runs`) each run of them that
    follow one another in an nn.Sequential by one Conv2dRun (see the module docstring);
    returns `model`, or (model, SwapReport) with `report=True`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    for name, flag in (("report", report), ("runs", runs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    modules = dict(model.named_modules())
    try:
        chains, reason = _traced_chains(model, modules), None
    except Exception as e:  # noqa: BLE001 - any failure to trace: fall back, and say why
        chains, reason = _sequential_chains(modules), f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    order = list(model.state_dict(keep_vars=True))
    placed: dict[int, str] = {}  # id of each new module and each Identity swap put in -> the conv it is for
    for conv_name, norm_name, act_name in chains:
        conv, norm, act = (modules[n] if n else None for n in (conv_name, norm_name, act_name))
        ours = _make(conv, norm, act)
        object.__setattr__(ours, _RECORD, ((conv_name, norm_name, act_name), (conv, norm, act)))
        for name, new in ((conv_name, ours), (norm_name, nn.Identity()), (act_name, nn.Identity())):
            if name:
                parent, attr = _parent(model, name)
                setattr(parent, attr, new)
                placed[id(new)] = conv_name
    grouped = _group_runs(model, placed) if runs else []
    where = {members[j]: f"{members[0]}.{j}" for members in grouped for j in range(len(members))}
    # A run's keys are renamed by one holder, the innermost holding the run and every
    # member's conv and norm: hooks of nested holders would rename each other's keys.
    parts = {c: [n for n in (c, norm) if n] for c, norm, _ in chains}
    run_holder = {c: _common_prefix(*(n for m in members for n in parts[m]))
                  for members in grouped for c in members}
    renames: dict[str, dict[str, str]] = {}
    for conv_name, norm_name, _ in chains:
        holder = run_holder[conv_name] if conv_name in run_holder else _common_prefix(*parts[conv_name])
        now = _relative(where.get(conv_name, conv_name), holder)
        found = renames.setdefault(holder, {})
        found[now + ".0."] = _relative(conv_name, holder) + "."
        if norm_name:
            found[now + ".1."] = _relative(norm_name, holder) + "."
    for holder, table in renames.items():
        prefix = holder + "." if holder else ""
        _hook(model.get_submodule(holder) if holder else model, table,
              [k[len(prefix):] for k in order if k.startswith(prefix)])
    if not report:
        return model
    done = {c for c, _, _ in chains}
    left: dict[str, list[str]] = {}
    for name, m in modules.items():
        if isinstance(m, nn.Conv2d) and name not in done:
            why = SUBCLASS if type(m) is not nn.Conv2d else UNTRACED
            left.setdefault(why, []).append(name)
    return model, SwapReport(reason is None, reason, chains, left, grouped)


def unswap(model: nn.Module) -> nn.Module:
    """Put back the modules `swap` replaced (the original objects, with the swapped
    module's current parameters and buffers); returns `model`."""
    holders = [m for m in model.modules() if hasattr(m, _HANDLES)]
    swapped = [m for m in model.modules() if hasattr(m, _RECORD)]
    for ours in swapped:
        (conv_name, norm_name, act_name), (conv, norm, act) = getattr(ours, _RECORD)
        for source, target in ((ours.conv, conv), (ours.norm, norm)):
            if target is None:
                continue
            for key, value in _own_tensors(source):
                if key in target._parameters or key in target._buffers:
                    _share(target, key, value)
        for original, qualified in ((conv, conv_name), (norm, norm_name), (act, act_name)):
            if qualified:
                original.train(ours.training)
                parent, attr = _parent(model, qualified)
                setattr(parent, attr, original)
    for holder in holders:
        for handle in getattr(holder, _HANDLES):
            handle.remove()
        object.__delattr__(holder, _HANDLES)
    return model
