"""`swap(model)`: every `Conv2d [+ BatchNorm2d or GroupNorm(1, C)] [+ activation]` run of an
`nn.Sequential` in a model becomes one `Conv2dNormActivation`, in place; `unswap(model)`
puts PyTorch's modules back. Checkpoints load either way: a swapped model's `state_dict`
has the original model's keys, and its `load_state_dict` takes them.

Runs are found in `nn.Sequential` containers only (torchvision's Conv2dNormActivation is
one), where the order of the children is the order they run in; a custom module's
attributes (ResNet's conv1, bn1, relu) say nothing about what its forward does between
them, and are left alone. The module takes the Conv2d's place and the norm and the
activation become `nn.Identity`, so every index and name stays. Every nn.Conv2d converts,
with its groups, dilation, padding strings and modes, on either device, and so do
nn.BatchNorm2d and nn.GroupNorm(1, C) with any of their options; an activation it has no
name for ends the run (it stays after the module).
Hooks registered on the replaced modules do not move to the new one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conv2d.torch.module import Conv2dNormActivation

_ACTIVATIONS = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.Identity: "identity", nn.SiLU: "silu",
                nn.ReLU6: "relu6", nn.Hardswish: "hardswish", nn.LeakyReLU: "leaky_relu", nn.ELU: "elu"}
_HANDLES = "_conv2d_swap_handles"  # on each container that holds swapped modules: its hooks


def _activation(module: nn.Module) -> str | None:
    if isinstance(module, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}[module.approximate]
    return _ACTIVATIONS.get(type(module))


def _convertible_conv(conv: nn.Module) -> bool:
    """An nn.Conv2d (not a subclass, whose forward may do something else)."""
    return type(conv) is nn.Conv2d


def _norm_kind(norm: nn.Module, channels: int) -> str | None:
    if type(norm) is nn.BatchNorm2d and norm.num_features == channels:
        return "batch_norm"
    if type(norm) is nn.GroupNorm and norm.num_groups == 1 and norm.num_channels == channels:
        return "layer_norm"
    return None


def _runs(seq: nn.Sequential) -> list[tuple[str, str | None, str | None]]:
    """(conv name, norm name or None, activation name or None) of every run in `seq`."""
    names = list(seq._modules)
    runs, i = [], 0
    while i < len(names):
        conv = seq._modules[names[i]]
        if conv is None or not _convertible_conv(conv):
            i += 1
            continue
        norm = act = None
        j = i + 1
        if j < len(names) and _norm_kind(seq._modules[names[j]], conv.out_channels):
            norm, j = names[j], j + 1
        if j < len(names) and _activation(seq._modules[names[j]]) is not None:
            act, j = names[j], j + 1
        runs.append((names[i], norm, act))
        i = j
    return runs


def _renamer(renames: dict[str, str]) -> Any:
    """A function that renames the keys of a state dict under `prefix` by `renames`
    (relative name prefixes, longest first)."""
    order = sorted(renames, key=len, reverse=True)

    def rename(state: dict[str, Any], prefix: str) -> None:
        for key in [k for k in state if k.startswith(prefix)]:
            rest = key[len(prefix):]
            for old in order:
                if rest.startswith(old):
                    state[prefix + renames[old] + rest[len(old):]] = state.pop(key)
                    break
    return rename


def _hook(seq: nn.Sequential, renames: dict[str, str]) -> None:
    """State-dict hooks on `seq`: what it saves is renamed by `renames` (module keys to the
    original model's), what it loads by the inverse."""
    to_original = _renamer(renames)
    from_original = _renamer({v: k for k, v in renames.items()})

    def saving(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        to_original(state, prefix)

    def loading(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        from_original(state, prefix)

    post = getattr(seq, "register_state_dict_post_hook", None) or seq._register_state_dict_hook
    handles = getattr(seq, _HANDLES, [])
    handles += [post(saving), seq.register_load_state_dict_pre_hook(loading)]
    object.__setattr__(seq, _HANDLES, handles)


def swap(model: nn.Module) -> nn.Module:
    """Replace every run in the model's Sequentials by a Conv2dNormActivation with the same
    parameters and buffers (see the module docstring); returns `model`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        renames: dict[str, str] = {}
        for conv_name, norm_name, act_name in _runs(seq):
            conv = seq._modules[conv_name]
            norm = seq._modules[norm_name] if norm_name else None
            act = seq._modules[act_name] if act_name else None
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
            ours = Conv2dNormActivation(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                                        conv.padding, conv.dilation, conv.groups, bias=conv.bias is not None,
                                        padding_mode=conv.padding_mode, norm=kind,
                                        activation=_activation(act) if act is not None else "identity",
                                        device=conv.weight.device, dtype=conv.weight.dtype, **options)
            with torch.no_grad():
                ours.conv.weight.copy_(conv.weight)
                if conv.bias is not None:
                    ours.conv.bias.copy_(conv.bias)
                if norm is not None:
                    for name, value in [*norm.named_parameters(recurse=False), *norm.named_buffers(recurse=False)]:
                        getattr(ours.norm, name).copy_(value)
            ours.train(conv.training)
            seq._modules[conv_name] = ours
            renames[f"{conv_name}.0."] = f"{conv_name}."
            if norm_name:
                seq._modules[norm_name] = nn.Identity()
                renames[f"{conv_name}.1."] = f"{norm_name}."
            if act_name:
                seq._modules[act_name] = nn.Identity()
            ours._conv2d_swapped = (conv_name, norm_name, act_name)
        if renames:
            _hook(seq, renames)
    return model


def unswap(model: nn.Module) -> nn.Module:
    """Put PyTorch's Conv2d, norm and activation back where `swap` put a
    Conv2dNormActivation, with its current parameters and buffers; returns `model`."""
    from conv2d.torch.module import reference_sequential

    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        for handle in getattr(seq, _HANDLES, []):
            handle.remove()
        if hasattr(seq, _HANDLES):
            object.__delattr__(seq, _HANDLES)
        for name, module in list(seq._modules.items()):
            record = getattr(module, "_conv2d_swapped", None)
            if not isinstance(module, Conv2dNormActivation) or record is None:
                continue
            conv_name, norm_name, act_name = record
            plain = reference_sequential(module)
            seq._modules[conv_name] = plain[0]
            if norm_name:
                seq._modules[norm_name] = plain[1]
            if act_name:
                seq._modules[act_name] = plain[-1]  # the activation PyTorch has, with its parameter
            for m in plain:
                m.train(module.training)
    return model

