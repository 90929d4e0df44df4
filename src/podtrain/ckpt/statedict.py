"""The training state as named tensors, through torch's public state-dict API, for any strategy.

``torch.distributed.checkpoint.state_dict.get_state_dict`` gives the model and the optimizer
state under the unwrapped parameter NAMES (flattened: ``state.<param>.exp_avg``,
``param_groups.<param>.lr``), as whole tensors under DDP and as DTensor shards under FSDP2/HSDP.
A checkpoint stores exactly these names (``model/<name>``, ``optim/state.<param>.<key>``), so a
DDP checkpoint resumes under FSDP and back, at any world size, with no index remapping; the
non-tensor optimizer values (learning rate, betas per parameter) go to JSON.

``local_pieces`` says which flat ranges of them this rank writes (``podtrain.ckpt.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from podtrain.ckpt.plan import shard_range, split_even


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: name}`` of parameters shared under two names (a tied LM head), from the module
    tree, so every rank agrees (pointers of empty shards would not)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


@dataclass
class NamedState:
    """A model's and optimizer's state: tensors by checkpoint name, plus JSON-able values."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """``model/<name>`` and ``optim/<flattened key>``: whole tensors or DTensors, live (no copy)."""
    values: dict[str, Any] = field(default_factory=dict)
    """Non-tensor optimizer entries (``param_groups.<param>.lr``, ...)."""
    aliases: dict[str, str] = field(default_factory=dict)
    has_optimizer: bool = False
    model_sd: dict[str, Any] = field(default_factory=dict)
    optim_sd: dict[str, Any] | None = None


def named_state(net: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool | None = None) -> NamedState:
    """The state of ``net`` (unwrapped) and ``optimizer`` as live tensors (every rank calls).

    ``with_optimizer`` None: include the optimizer when it has state. An optimizer without state
    (a save before the first step) is saved as none: ``get_state_dict`` would first create its
    state with a fake step, which a resumed run would carry where an uninterrupted one has none.
    When loading, True creates that state to be overwritten.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    include = bool(optimizer.state) if with_optimizer is None else with_optimizer
    out = NamedState(aliases=tied_aliases(net), has_optimizer=include)
    if include:
        out.model_sd, out.optim_sd = get_state_dict(net, optimizer, options=_options())
    else:
        out.model_sd = get_model_state_dict(net, options=_options())
    for name, t in out.model_sd.items():
        if name not in out.aliases:
            out.tensors[f"model/{name}"] = t
    for key, value in (out.optim_sd or {}).items():
        if isinstance(value, torch.Tensor):
            out.tensors[f"optim/{key}"] = value
        else:
            out.values[key] = value
    return out


def apply_state(net: nn.Module, optimizer: torch.optim.Optimizer, state: NamedState) -> None:
    """Hand the filled targets back to torch (``set_state_dict``; every rank calls)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    for alias, name in state.aliases.items():
        if alias in state.model_sd and name in state.model_sd:
            state.model_sd[alias] = state.model_sd[name]
    if state.optim_sd is None:
        set_model_state_dict(net, state.model_sd, options=_options())
        optimizer.state.clear()  # saved before the first step: it restarts empty, as it did then
    else:
        set_state_dict(net, optimizer, model_state_dict=state.model_sd, optim_state_dict=state.optim_sd,
                       options=_options())


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2/HSDP shard)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def dtensor_range(name: str, t: Any) -> tuple[int, int, bool]:
    """``(start, count, primary)`` of the flat range of ``t``'s whole tensor this rank's local shard
    holds; ``primary`` is False on a replica that need not write it (HSDP: the first replica group
    writes). Only FSDP2's placements are supported: ``Shard(0)`` and ``Replicate``."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, coordinate = t.device_mesh, t.device_mesh.get_coordinate() or []
    start, count, primary, sharded = 0, t.numel(), True, False
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            primary = primary and coordinate[dim] == 0
        elif isinstance(placement, Shard) and placement.dim == 0 and not sharded:
            start, count = shard_range(tuple(t.shape), coordinate[dim], mesh.size(dim))
            sharded = True
        else:
            raise ValueError(f"{name}: placement {placement} cannot be checkpointed (FSDP2's Shard(0) only)")
    if t.to_local().numel() != count:
        raise ValueError(f"{name}: local shard has {t.to_local().numel()} elements, expected {count}")
    return start, count, primary


def flat_local(t: torch.Tensor) -> torch.Tensor:
    """The rank's local data of ``t`` as a flat tensor (a view when contiguous)."""
    local = t.to_local() if is_dtensor(t) else t
    return local.detach().reshape(-1)


def plain_plan(tensors: dict[str, torch.Tensor], world: int) -> list[list[tuple[str, int, int]]]:
    """``split_even`` over the tensors every rank holds whole, in their (agreed) order."""
    items = [(n, t.numel(), t.element_size()) for n, t in tensors.items() if not is_dtensor(t)]
    return split_even(items, world)


def local_pieces(tensors: dict[str, torch.Tensor], rank: int, world: int) -> list[tuple[str, int, torch.Tensor]]:
    """What this rank writes: ``(tensor name, first element, flat tensor of the range)``, in order:
    its DTensor shards (primary replica only), then its share of the whole tensors."""
    out = []
    for name, t in tensors.items():
        if is_dtensor(t):
            start, count, primary = dtensor_range(name, t)
            if primary and count:
                out.append((name, start, flat_local(t)))
    for name, start, count in plain_plan(tensors, world)[rank]:
        out.append((name, start, flat_local(tensors[name])[start:start + count]))
    return out
