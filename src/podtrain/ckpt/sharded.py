"""Checkpoints of FSDP/HSDP runs, and resuming across strategies and world sizes.

Saving (``shard_items``): ``get_state_dict`` gives the model and the (flattened) optimizer state
as DTensor shards under their unwrapped names (``state.<param>.exp_avg``,
``param_groups.<param>.lr``). Each rank writes only its own pieces, and of HSDP's identical
replicas only the first group: every piece is one tensor of this rank's ``dcp/`` shard file, in
the layout of ``torch.distributed.checkpoint``'s ``HuggingFaceStorageWriter`` (the piece's offset
in the whole tensor in the file's header, no pickled ``.metadata``). The writer streams them
through the rank's bounded staging pool and seals the directory like any other checkpoint
(atomic rename, SHA-256 of every file, manifest layout ``sharded``).

Loading (``load``), whatever saved the checkpoint:

* a sharded checkpoint, into any strategy at any world size: ``dcp.load`` reads, into this run's
  own ``get_state_dict`` targets (DTensor shards under FSDP/HSDP, whole tensors under DDP), only
  the stored pieces that overlap them; ``set_state_dict`` applies them;
* a whole-tensor (DDP) checkpoint into an FSDP/HSDP run: tensor by tensor, each one read whole
  into host memory and this rank's slice copied into its shard (at most one whole tensor in
  memory at a time); the optimizer state, saved by parameter index, is matched by parameter name.

``export`` and ``sample`` put the pieces together offline (``podtrain.ckpt.tensorio.read_dcp_folder``).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from podtrain.ckpt import layout
from podtrain.ckpt.host_buffers import StagingPool
from podtrain.ckpt.reader import check_fit
from podtrain.ckpt.state import from_plain, to_plain
from podtrain.ckpt.streamed_load import index_checkpoint
from podtrain.ckpt.tensorio import read_safetensors
from podtrain.errors import UserError
from podtrain.model import is_sharded

TensorItems = list[tuple[str, torch.Tensor]]


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: name}`` of parameters shared under two names (a tied LM head), read from the
    module tree, so every rank agrees (pointers of empty shards would not)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


@dataclass
class ShardedSnapshot:
    """What this rank writes of a sharded save, and what rank 0 puts into state.json."""

    items: TensorItems = field(default_factory=list)
    """``(name in the shard file, local tensor)``: this rank's pieces, in file order."""
    offsets: dict[str, list[int]] = field(default_factory=dict)
    """Each piece's offset in its whole tensor (HuggingFaceStorageWriter's ``saved_offsets``)."""
    aliases: dict[str, str] = field(default_factory=dict)
    optimizer: Any = None
    """The flattened optimizer state as plain data (tensors referenced by name)."""

    def add(self, name: str, tensor: torch.Tensor, rank: int) -> None:
        """Add this rank's piece of ``tensor``: a DTensor's local shard (the first replica only,
        not an empty one), a plain tensor on rank 0 only."""
        from torch.distributed.tensor import DTensor

        if not isinstance(tensor, DTensor):
            if rank == 0:
                self.items.append((name, tensor.detach()))
            return
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh, placements = tensor.device_mesh, tensor.placements
        coordinate = mesh.get_coordinate() or []
        if any(p.is_replicate() and c != 0 for p, c in zip(placements, coordinate)):
            return  # HSDP: another replica group's first rank writes the same piece
        local = tensor.to_local()
        if local.numel() == 0:
            return  # FSDP pads uneven shards: the last ranks may hold nothing
        _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        self.items.append((name, local.detach()))
        self.offsets[name] = list(offset)


def shard_items(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                extra_state: TensorItems) -> ShardedSnapshot:
    """This rank's pieces of the model (``model/<name>``) and optimizer (``state/optimizer/<key>``),
    plus the small ``extra_state`` tensors (train state, scaler: ``state/<name>``) on rank 0.

    An optimizer without state yet (a save before the first step) is saved as none:
    ``get_state_dict`` would first create its state with a fake step, which the resumed run
    would then carry (AdamW's step count 1 and zero moments) where an uninterrupted one has none.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    snap = ShardedSnapshot(aliases=tied_aliases(model))
    if optimizer.state:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    else:
        model_sd, optim_sd = get_model_state_dict(model, options=_options()), None
    for name, tensor in model_sd.items():
        if name not in snap.aliases:
            snap.add(f"model/{name}", tensor, rank)
    state: TensorItems = []
    if optim_sd is not None:
        snap.optimizer = to_plain(optim_sd, lambda n, t: state.append((n, t)), "optimizer")
    for name, tensor in [*state, *extra_state]:
        snap.add(f"state/{name}", tensor, rank)
    return snap


def applies(model: nn.Module, manifest: dict) -> bool:
    """Loading goes through this module: the run is sharded, or the checkpoint is."""
    return is_sharded(model) or manifest.get("layout") == layout.SHARDED


@dataclass
class ShardedLoad:
    """A load planned by ``prepare`` (each rank alone), applied by ``load`` (every rank together)."""

    raw: dict
    """The decoded state.json, tensors still referenced by name."""
    model_sd: dict[str, torch.Tensor]
    """This run's model state targets (DTensor shards under FSDP/HSDP, whole tensors else)."""
    optim_sd: dict[str, Any] | None
    """This run's flattened optimizer state targets; None: the checkpoint has no optimizer state."""
    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sharded checkpoints: every stored name this rank reads, to the tensor it fills."""
    rest: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sharded checkpoints: the small state tensors (train state, scaler), read whole."""
    whole: Any = None
    """Whole-tensor checkpoints: ``(weights, state)`` indexes of the files (``index_checkpoint``)."""


def prepare(path: Path, manifest: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> ShardedLoad:
    """Plan loading ``path`` into this run's model and optimizer: no collective, nothing read but
    headers and state.json; a checkpoint of another model or optimizer is a one-line UserError."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    raw = json.loads((path / layout.STATE_JSON).read_text())
    saved = raw.get("optimizer")
    has_optimizer = bool(saved) and (manifest.get("layout") == layout.SHARDED or bool(saved.get("state")))
    if has_optimizer:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    else:  # saved before the first step: the optimizer starts empty, as it did then
        model_sd, optim_sd = get_model_state_dict(model, options=_options()), None
    plan = ShardedLoad(raw, model_sd, optim_sd)
    if manifest.get("layout") == layout.SHARDED:
        _plan_pieces(plan, path)
    else:
        _plan_whole(plan, path, manifest, model, optimizer)
    return plan


def load(plan: ShardedLoad, path: Path, manifest: dict, model: nn.Module,
         optimizer: torch.optim.Optimizer, pool: StagingPool) -> dict:
    """Apply ``plan`` (every rank calls: ``dcp.load`` is collective). Returns the rest of the
    decoded state.json (``train_state``, ``rng``, ...), as ``streamed_load.load_into`` does."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    raw = plan.raw
    if manifest.get("layout") == layout.SHARDED:
        tensors = _read_pieces(plan, path)
        optim_sd = from_plain(raw["optimizer"], tensors) if plan.optim_sd is not None else None
    else:
        tensors = _read_whole(plan, model, optimizer, pool)
        optim_sd = plan.optim_sd
    try:
        if optim_sd is None:  # saved before the first step: the optimizer restarts empty (a rollback too)
            set_model_state_dict(model, plan.model_sd, options=_options())
            optimizer.state.clear()
        else:
            set_state_dict(model, optimizer, model_state_dict=plan.model_sd, optim_state_dict=optim_sd,
                           options=_options())
    except (KeyError, ValueError, RuntimeError) as exc:
        raise UserError(f"checkpoint {path} does not fit this model and optimizer ({exc})") from None
    return {k: from_plain(v, tensors) for k, v in raw.items() if k not in ("aliases", "optimizer")}


def _plan_pieces(plan: ShardedLoad, path: Path) -> None:
    """A sharded checkpoint: the names to read into this run's targets, checked against the stored ones."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    aliases = plan.raw.get("aliases") or {}
    targets: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in plan.model_sd.items() if k not in aliases}
    if plan.optim_sd is not None:
        targets.update({f"state/optimizer/{k}": v for k, v in plan.optim_sd.items()
                        if isinstance(v, torch.Tensor)})
    stored = HuggingFaceStorageReader(str(path / layout.DCP_SUBDIR)).read_metadata().state_dict_metadata
    _check_names(path, {k for k in stored if k.startswith(("model/", "state/optimizer/"))}, set(targets))
    plan.rest = {k[len("state/"):]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
                 for k, md in stored.items() if k.startswith("state/") and k not in targets}
    plan.targets = {**targets, **{f"state/{k}": v for k, v in plan.rest.items()}}


def _read_pieces(plan: ShardedLoad, path: Path) -> dict[str, torch.Tensor]:
    """DCP reads the stored pieces overlapping this rank's targets in place (collective).
    Returns the state tensors by name (optimizer targets, and the small rest read whole)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        with warnings.catch_warnings():  # one process: DCP warns that it loads without a group
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(plan.targets, storage_reader=HuggingFaceStorageReader(str(path / layout.DCP_SUBDIR)),
                     no_dist=not dist.is_initialized())
    except Exception as exc:  # DCP's error names the mismatched keys
        raise UserError(f"checkpoint {path} does not fit this model and optimizer: "
                        f"{(str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]}") from None
    for alias, name in (plan.raw.get("aliases") or {}).items():
        if alias in plan.model_sd and name in plan.model_sd:
            plan.model_sd[alias] = plan.model_sd[name]
    optimizer = {k[len("state/"):]: v for k, v in plan.targets.items() if k.startswith("state/optimizer/")}
    return {**optimizer, **plan.rest, **read_safetensors(path / layout.STATE_FILE)}


def _check_names(path: Path, stored: set[str], wanted: set[str]) -> None:
    """A one-line UserError unless the stored weights and optimizer state are this run's."""
    missing, unexpected = sorted(wanted - stored), sorted(stored - wanted)
    if missing or unexpected:
        parts = [f"{label}: {', '.join(n.split('/', 1)[1] for n in names[:3])}{' ...' if len(names) > 3 else ''}"
                 for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise UserError(f"checkpoint {path} does not fit this model and optimizer ({'; '.join(parts)}): "
                        "was it saved with another model.preset or vocabulary?")


def _plan_whole(plan: ShardedLoad, path: Path, manifest: dict, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> None:
    """A whole-tensor checkpoint: its files indexed, its weights' names and shapes checked."""
    weights, state = index_checkpoint(path, manifest)
    aliases = plan.raw.get("aliases") or {}
    stored = {name: weights.shape(name) for name in weights}
    stored.update({a: stored[n] for a, n in aliases.items() if n in stored})
    check_fit(plan.model_sd, stored, path)
    saved = (plan.raw.get("optimizer") or {}).get("state") or {}
    params = sum(len(g["params"]) for g in optimizer.param_groups)
    if plan.optim_sd is not None and len(saved) > params:
        raise UserError(f"checkpoint {path}: optimizer state does not fit this optimizer "
                        f"({len(saved)} parameters with state, this model has {params})")
    plan.whole = (weights, state)


def _read_whole(plan: ShardedLoad, model: nn.Module, optimizer: torch.optim.Optimizer,
                pool: StagingPool) -> dict[str, torch.Tensor]:
    """A whole-tensor checkpoint into this run's targets, one whole tensor in host memory at a
    time (no collective). Returns the small state tensors (train state, rng) by name."""
    weights, state = plan.whole
    aliases = plan.raw.get("aliases") or {}
    for name, target in plan.model_sd.items():
        _fill(target, weights.load(aliases.get(name, name), pool))
    if plan.optim_sd is not None:
        _fill_optimizer(plan, model, optimizer, state, pool)
    return {k: state.load(k, pool) for k in state if not k.startswith("optimizer/")}


def _fill_optimizer(plan: ShardedLoad, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: Any, pool: StagingPool) -> None:
    """The optimizer state saved by parameter index (``Optimizer.state_dict``) into this run's
    flattened targets, matched by parameter name in the optimizer's parameter order."""
    optim_sd = plan.optim_sd
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_index = from_plain(plan.raw["optimizer"], {k: _Lazy(k) for k in state})
    for group in by_index.get("param_groups", []):  # the saved hyperparameters, as load_state_dict
        for index in group.get("params", []):
            for key, value in group.items():
                flat = f"param_groups.{order[int(index)]}.{key}"
                if key != "params" and flat in optim_sd:
                    optim_sd[flat] = value
    for index, values in by_index.get("state", {}).items():
        for key, value in values.items():
            flat = f"state.{order[int(index)]}.{key}"
            if flat not in optim_sd:
                raise UserError(f"optimizer state {key!r} of parameter {order[int(index)]} "
                                "does not fit this optimizer")
            if isinstance(value, _Lazy):
                _fill(optim_sd[flat], state.load(value.name, pool))
            else:
                optim_sd[flat] = value


class _Lazy:
    """A stored tensor's name, read only when its target is known."""

    def __init__(self, name: str) -> None:
        self.name = name


def _fill(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's slice of ``whole`` into ``target`` (a DTensor's local shard, or all of it)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if not isinstance(target, DTensor):
            target.copy_(whole.reshape(target.shape))
            return
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = target.to_local()
        if local.numel() == 0:
            return
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                              target.placements)
        piece = whole.reshape(target.shape)
        for dim, (start, size) in enumerate(zip(offset, shape)):
            piece = piece.narrow(dim, start, size)
        local.copy_(piece)
