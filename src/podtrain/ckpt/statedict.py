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

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from podtrain.ckpt.plan import assign_replicas, shard_range, split_even
from podtrain.ckpt.tensorio import DTYPE_NAMES


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


def named_state(net: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool | None = None,
                stored: dict[str, dict] | None = None) -> NamedState:
    """The state of ``net`` (unwrapped) and ``optimizer`` as live tensors (every rank calls).

    ``with_optimizer`` None: include the optimizer when it has state. An optimizer without state
    (a save before the first step) is saved as none: ``get_state_dict`` would first create its
    state with a fake step, which a resumed run would carry where an uninterrupted one has none.
    When loading, True creates that state to be overwritten: from ``stored`` (the checkpoint's
    tensor table) when the model is not sharded, else by torch's fake step.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    include = bool(optimizer.state) if with_optimizer is None else with_optimizer
    if include and stored and not optimizer.state and not any(is_dtensor(p) for p in net.parameters()):
        _allocate_optimizer_state(net, optimizer, stored)
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


def _allocate_optimizer_state(net: nn.Module, optimizer: torch.optim.Optimizer, stored: dict[str, dict]) -> None:
    """Empty optimizer state tensors where ``Optimizer.load_state_dict`` would put them (the
    parameter's device; a scalar ``step`` on the CPU unless fused/capturable), so that
    ``get_state_dict`` need not run its fake step (zero gradients and the step's temporaries:
    up to 2 x the weights of transient memory)."""
    from podtrain.ckpt.tensorio import DTYPES

    params = dict(net.named_parameters())
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for name, info in stored.items():
        if not name.startswith("optim/state."):
            continue
        fqn, key = name[len("optim/state."):].rsplit(".", 1)
        param = params.get(fqn)
        if param is None or id(param) not in group_of:
            continue
        group = group_of[id(param)]
        on_device = bool(info["shape"]) or group.get("fused") or group.get("capturable")
        optimizer.state[param][key] = torch.empty(tuple(info["shape"]), dtype=DTYPES[info["dtype"]],
                                                  device=param.device if on_device else "cpu")


def apply_state(net: nn.Module, optimizer: torch.optim.Optimizer, state: NamedState) -> None:
    """Make the filled targets the model's and optimizer's state (every rank calls).

    Whole tensors were read into the live parameters and optimizer state themselves (what
    ``get_state_dict`` returns for a module that is not sharded shares their memory), so only the
    optimizer's per-parameter values are set; ``set_state_dict`` would copy every tensor once
    more. Sharded (DTensor) state goes through ``set_state_dict``, which owns FSDP2's conventions.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if any(is_dtensor(t) for t in state.tensors.values()):
        for alias, name in state.aliases.items():
            if alias in state.model_sd and name in state.model_sd:
                state.model_sd[alias] = state.model_sd[name]
        if state.optim_sd is None:
            set_model_state_dict(net, state.model_sd, options=_options())
        else:
            set_state_dict(net, optimizer, model_state_dict=state.model_sd,
                           optim_state_dict=state.optim_sd, options=_options())
    elif state.optim_sd is not None:
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        params = dict(net.named_parameters())
        for key, value in state.values.items():
            _, rest = key.split(".", 1)  # param_groups.<param name>.<key>
            fqn, leaf = rest.rsplit(".", 1)
            if key.startswith("param_groups.") and fqn in params and leaf != "params":
                group_of[id(params[fqn])][leaf] = tuple(value) if isinstance(value, list) else value
    if state.optim_sd is None:
        optimizer.state.clear()  # saved before the first step: it restarts empty, as it did then


_DTENSOR: type | None = None


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2/HSDP shard)."""
    global _DTENSOR
    if _DTENSOR is None:  # imported once: a save asks this of every tensor
        from torch.distributed.tensor import DTensor

        _DTENSOR = DTensor
    return isinstance(t, _DTENSOR)


def _replicate_dims(t: Any) -> list[int]:
    from torch.distributed.tensor import Replicate

    return [d for d, p in enumerate(t.placements) if isinstance(p, Replicate)]


def replica_groups(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """``{name: replica group}`` of the DTensors: which group along the mesh's first replicate
    dimension writes a tensor's shards and, at resume, reads them for the others (HSDP: each group
    ~1/R of the bytes, ``plan.assign_replicas``; FSDP: one group). The same on every rank."""
    items, replicas = [], 1
    for name, t in tensors.items():
        if is_dtensor(t):
            items.append((name, t.numel() * t.element_size()))
            dims = _replicate_dims(t)
            if dims:
                replicas = max(replicas, t.device_mesh.size(dims[0]))
    return assign_replicas(items, replicas)


def dtensor_range(name: str, t: Any, replica: int = 0) -> tuple[int, int, bool]:
    """``(start, count, primary)`` of the flat range of ``t``'s whole tensor this rank's local shard
    holds; ``primary``: this rank writes (and reads) it, i.e. it lies in replica group ``replica``
    along the first replicate dimension (``replica_groups``) and at 0 along any other. Only
    FSDP2's placements are supported: ``Shard(0)`` and ``Replicate``."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, coordinate = t.device_mesh, t.device_mesh.get_coordinate() or []
    start, count, primary, sharded = 0, t.numel(), True, False
    first_replicate = True
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            want = replica % mesh.size(dim) if first_replicate else 0
            primary = primary and coordinate[dim] == want
            first_replicate = False
        elif isinstance(placement, Shard) and placement.dim == 0 and not sharded:
            start, count = shard_range(tuple(t.shape), coordinate[dim], mesh.size(dim))
            sharded = True
        else:
            raise ValueError(f"{name}: placement {placement} cannot be checkpointed (FSDP2's Shard(0) only)")
    if t.to_local().numel() != count:
        raise ValueError(f"{name}: local shard has {t.to_local().numel()} elements, expected {count}")
    return start, count, primary


def split_rule(t: torch.Tensor, replica: int) -> dict[str, Any]:
    """How a tensor is cut over the ranks that write it, as the manifest records it (one entry per
    tensor, whatever the world size): ``{"rule": "even"}`` for a tensor every rank holds whole
    (``plan.split_even`` over the saved ranks), else its placement per mesh dimension (``"RS"``:
    replicate x ``Shard(0)``) and the replica group that wrote it."""
    from torch.distributed.tensor import Replicate

    if not is_dtensor(t):
        return {"rule": "even"}
    return {"rule": "".join("R" if isinstance(p, Replicate) else "S" for p in t.placements), "replica": replica}


def mesh_record(tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The device mesh the DTensors live on, as the manifest records it once: its shape, and its
    ranks only when they are not ``arange(world)`` in row-major order (FSDP2's and podtrain's)."""
    t = next((t for t in tensors.values() if is_dtensor(t)), None)
    if t is None:
        return None
    mesh = t.device_mesh.mesh
    record: dict[str, Any] = {"shape": list(mesh.shape)}
    ranks = mesh.reshape(-1).tolist()
    if ranks != list(range(len(ranks))):
        record["ranks"] = ranks
    return record


def replicate_broadcasts(tensors: dict[str, torch.Tensor], readers: dict[str, int]):
    """``(flat local tensor, source global rank, replicate group)`` for each DTensor whose shard
    one replica group read at resume (``readers``) and the others receive: every rank lists the
    same tensors in the same order."""
    for name, t in tensors.items():
        if not is_dtensor(t):
            continue
        dims = _replicate_dims(t)
        if not dims or t.device_mesh.size(dims[0]) < 2 or not t.to_local().numel():
            continue
        mesh = t.device_mesh
        coords = list(mesh.get_coordinate())
        coords[dims[0]] = readers.get(name, 0) % mesh.size(dims[0])
        for other in dims[1:]:
            coords[other] = 0
        yield flat_local(t), int(mesh.mesh[tuple(coords)]), mesh.get_group(dims[0])


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
    its DTensor shards (those its replica group writes: ``replica_groups``), then its share of the
    whole tensors."""
    out = []
    groups = replica_groups(tensors)
    for name, t in tensors.items():
        if is_dtensor(t):
            start, count, primary = dtensor_range(name, t, groups.get(name, 0))
            if primary and count:
                out.append((name, start, flat_local(t)))
    for name, start, count in plain_plan(tensors, world)[rank]:
        out.append((name, start, flat_local(tensors[name])[start:start + count]))
    return out


def tensor_table(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """``{name: {"shape": [...], "dtype": "F32", "rule": ...}}`` of the whole tensors (DTensors:
    global shape), with how each is split over the ranks that write it (``split_rule``)."""
    groups = replica_groups(tensors)
    return {n: {"shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype], **split_rule(t, groups.get(n, 0))}
            for n, t in tensors.items()}


@dataclass(frozen=True)
class SaveLayout:
    """What a save derives from its tensors' names, shapes, dtypes, types and placements alone,
    computed once and reused by later saves while these are unchanged (``SaveCache.layout``): the
    step loop then only copies bytes. Shared between saves: never mutate its fields."""

    ranges: tuple[tuple[str, int, int, bool], ...]
    """What this rank writes, in order: ``(name, first element, count, whole local shard)``."""
    strategy: str
    """``"sharded"`` when any tensor is a DTensor, else ``"replicated"``."""
    table: dict[str, dict]
    """The manifest's tensor table (``tensor_table``)."""
    mesh: dict[str, Any] | None
    """The manifest's mesh record (``mesh_record``)."""

    def pieces(self, tensors: dict[str, torch.Tensor]) -> list[tuple[str, int, torch.Tensor]]:
        """``local_pieces`` of ``tensors`` (the tensors this layout was made for): live views."""
        out = []
        for name, start, count, whole in self.ranges:
            flat = flat_local(tensors[name])
            out.append((name, start, flat if whole else flat[start:start + count]))
        return out


def _signature(name: str, t: torch.Tensor) -> tuple:
    """Everything of ``t`` a ``SaveLayout`` depends on: a tensor whose dtype, shape, type (FP8
    and other tensor subclasses), placements or mesh change gets a new layout."""
    if is_dtensor(t):
        return name, t.dtype, t.shape, type(t), tuple(t.placements), t.device_mesh
    return name, t.dtype, t.shape, type(t)


def _build_layout(tensors: dict[str, torch.Tensor], rank: int, world: int) -> SaveLayout:
    ranges = tuple((name, start, piece.numel(), is_dtensor(tensors[name]))
                   for name, start, piece in local_pieces(tensors, rank, world))
    return SaveLayout(ranges=ranges,
                      strategy="sharded" if any(is_dtensor(t) for t in tensors.values()) else "replicated",
                      table=tensor_table(tensors), mesh=mesh_record(tensors))


class SaveCache:
    """What a save computes that the next saves of the same run reuse, owned by the run's
    ``Checkpointer`` (its lifetime): the ``SaveLayout`` of the state's tensors and the model
    config's JSON. A save loop's steady state builds neither."""

    KEPT = 4  # a durable and a local tier share one layout; a few more for tests and tools

    def __init__(self) -> None:
        self._layouts: dict[tuple, SaveLayout] = {}
        self._configs: dict[int, tuple[Any, type, dict, str]] = {}

    def layout(self, tensors: dict[str, torch.Tensor], rank: int, world: int) -> SaveLayout:
        """The ``SaveLayout`` of ``tensors`` as ``rank`` of ``world`` saves them: built on a save
        whose tensors (names, order, dtypes, shapes, types, placements) or world differ from every
        layout kept, else the one built before."""
        key = (rank, world, tuple(_signature(n, t) for n, t in tensors.items()))
        try:
            layout = self._layouts.get(key)
        except TypeError:  # an unhashable mesh or shape: build it every time
            return _build_layout(tensors, rank, world)
        if layout is None:
            layout = _build_layout(tensors, rank, world)
            while len(self._layouts) >= self.KEPT:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        return layout

    def config_json(self, config: Any) -> str | None:
        """``config.to_json_string()`` (a Hugging Face model config; None without one), serialised
        on the first save and reused while the config object and its attributes are unchanged (its
        ``to_diff_dict`` builds a default config each time: most of a millisecond per save on the
        step loop). Attributes are compared with a deep copy taken when it was serialised."""
        if not hasattr(config, "to_json_string"):
            return None
        hit = self._configs.get(id(config))
        if hit is not None and hit[0]() is config and hit[1] is type(config):
            try:
                if config.__dict__ == hit[2]:
                    return hit[3]
            except Exception:  # an attribute whose == is not a bool: serialise every time
                pass
        text = config.to_json_string()
        try:
            entry = (weakref.ref(config), type(config), copy.deepcopy(config.__dict__), text)
        except Exception:  # not weakly referable or not copyable: serialise every time
            return text
        self._configs.pop(id(config), None)
        while len(self._configs) >= self.KEPT:
            self._configs.pop(next(iter(self._configs)))
        self._configs[id(config)] = entry
        return text
