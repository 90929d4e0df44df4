"""Resuming: each rank reads (and verifies) only its share, then the ranks exchange the rest.

Three phases, so that the caller can agree between them (``Checkpointer.restore``):

1. ``prepare`` (each rank alone, no collective): state.json and the manifest's piece tables,
   this run's targets from ``get_state_dict`` (DTensor shards under FSDP/HSDP, whole tensors
   under DDP), names and shapes checked against the checkpoint (a one-line ``UserError``);
2. ``read`` (each rank alone): a DTensor target is filled with the flat range its local shard
   holds; the tensors every rank holds whole are split over the ranks (``plan.split_even`` over
   THIS run's ranks) and each rank reads only its ranges. Bytes go through the rank's bounded
   staging pool in whole checksum blocks, each block's CRC-32 checked as it arrives
   (``CorruptCheckpoint`` on a mismatch). No rank reads the whole checkpoint;
3. ``finish`` (collective): every whole tensor's ranges are broadcast from the rank that read
   them, then ``set_state_dict`` applies everything.

Why broadcast instead of every DDP rank reading everything: a shared file system (FSx for
Lustre, S3) serves the whole job from the same targets, so N ranks each reading the full state
move N times the checkpoint through the storage network (an 8-node job: 64x); reading 1/N each
moves it once and spreads it over N clients, and the exchange runs over the GPU fabric (NVLink /
EFA, tens to hundreds of GB/s per node, versus a few GB/s per client from storage). It wins at
every N > 1, and more the larger N is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from podtrain.ckpt import layout
from podtrain.ckpt.host_buffers import StagingPool, byte_array
from podtrain.ckpt.plan import BLOCK_BYTES, Piece, spans
from podtrain.ckpt.state import from_plain
from podtrain.ckpt.statedict import NamedState, apply_state, dtensor_range, flat_local, is_dtensor, named_state, plain_plan
from podtrain.ckpt.tensorio import DTYPES, check_json_record, decode_small, verify_blocks
from podtrain.errors import UserError


@dataclass
class LoadPlan:
    """One rank's load of one checkpoint (``prepare`` -> ``read`` -> ``finish``)."""

    where: str
    manifest: dict
    raw: dict
    """Decoded state.json (tensors still referenced by name)."""
    small: dict[str, torch.Tensor]
    targets: NamedState
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    plain: list[list[tuple[str, int, int]]] = field(default_factory=list)
    """Each rank's ranges of the whole tensors (read by it, broadcast from it)."""


def read_small(store, name: str, manifest: dict, rel: str) -> bytes:
    """A small file of the checkpoint, checked against its manifest record."""
    data = store.read_bytes(f"{name}/{rel}")
    check_json_record(data, manifest["files"].get(rel, {}), f"{store.url}/{name}/{rel}")
    return data


def piece_index(manifest: dict) -> dict[str, list[Piece]]:
    """Every stored piece, by tensor name, from the manifest."""
    out: dict[str, list[Piece]] = {}
    for rel, rec in manifest["files"].items():
        for item in rec.get("pieces", []):
            piece = Piece.from_json(rel, item)
            out.setdefault(piece.tensor, []).append(piece)
    return out


def prepare(store, name: str, manifest: dict, net: nn.Module, optimizer: torch.optim.Optimizer,
            rank: int, world: int) -> LoadPlan:
    """Phase 1 (no collective): the plan; a checkpoint of another model is a one-line UserError."""
    where = f"{store.url}/{name}"
    raw = json.loads(read_small(store, name, manifest, layout.STATE_JSON))
    small = decode_small(read_small(store, name, manifest, layout.STATE_FILE))
    stored = manifest.get("tensors", {})
    has_optimizer = any(k.startswith("optim/") for k in stored)
    targets = named_state(net, optimizer, with_optimizer=has_optimizer, stored=stored)
    _check_fit(where, stored, targets.tensors)
    plan = LoadPlan(where, manifest, raw, small, targets, piece_index(manifest))
    plan.plain = plain_plan(targets.tensors, world)
    return plan


def _check_fit(where: str, stored: dict, targets: dict[str, torch.Tensor]) -> None:
    missing, unexpected = sorted(set(targets) - set(stored)), sorted(set(stored) - set(targets))
    shapes = [k for k in targets if k in stored and list(targets[k].shape) != stored[k]["shape"]]
    if missing or unexpected or shapes:
        parts = [f"{label}: {', '.join(n.split('/', 1)[-1] for n in names[:3])}{' ...' if len(names) > 3 else ''}"
                 for label, names in (("missing", missing), ("unexpected", unexpected), ("shape differs", shapes))
                 if names]
        raise UserError(f"checkpoint {where} does not fit this model and optimizer ({'; '.join(parts)}): "
                        "was it saved with another model.preset or vocabulary?")


def read(plan: LoadPlan, store, name: str, rank: int, pool: StagingPool) -> int:
    """Phase 2 (no collective): fill this rank's share of the targets. Returns bytes of tensor
    data read. Raises ``CorruptCheckpoint`` when a block fails its check."""
    total = 0
    for tname, t in plan.targets.tensors.items():
        if is_dtensor(t):
            start, count, _ = dtensor_range(tname, t)
            if count:
                total += _read_range(plan, store, name, tname, flat_local(t), start, count, start, pool)
    for tname, start, count in plan.plain[rank]:
        total += _read_range(plan, store, name, tname, flat_local(plan.targets.tensors[tname]),
                             start, count, 0, pool)
    return total


def _read_range(plan: LoadPlan, store, name: str, tname: str, dst: torch.Tensor, start: int, count: int,
                dst_start: int, pool: StagingPool) -> int:
    """Elements ``[start, start + count)`` of tensor ``tname`` into ``dst[start - dst_start ...]``,
    whole checksum blocks at a time through pool slabs."""
    dtype = DTYPES[plan.manifest["tensors"][tname]["dtype"]]
    esize = torch.empty((), dtype=dtype).element_size()
    per_slab = max(BLOCK_BYTES, pool.slab_bytes // BLOCK_BYTES * BLOCK_BYTES)
    done = 0
    try:
        found = spans(plan.pieces.get(tname, []), start, count, esize)
    except ValueError as exc:
        raise UserError(f"checkpoint {plan.where}: tensor {tname}: {exc}") from None
    for span in found:
        offset, length = span.byte_range(esize)
        first_elem = span.piece.start + span.first_block * BLOCK_BYTES // esize
        for pos in range(0, length, per_slab):
            n = min(per_slab, length - pos)
            slab = pool.acquire()
            try:
                buf = slab[:n]
                store.read_into(f"{name}/{span.piece.file}", offset + pos, byte_array(buf))
                done += n
                verify_blocks(memoryview(byte_array(buf)), span.piece.crcs, span.first_block + pos // BLOCK_BYTES,
                              f"{plan.where}/{span.piece.file} ({tname})")
                lo = max(span.want_start, first_elem + pos // esize)
                hi = min(span.want_start + span.want_count, first_elem + (pos + n) // esize)
                if hi > lo:
                    values = buf[(lo - first_elem) * esize - pos:(hi - first_elem) * esize - pos].view(dtype)
                    dst[lo - dst_start:hi - dst_start].copy_(values)
            finally:
                pool.release(slab)
    return done


def finish(plan: LoadPlan, net: nn.Module, optimizer: torch.optim.Optimizer, cpu_group=None) -> dict[str, Any]:
    """Phase 3 (collective, every rank): broadcast the whole tensors' ranges from their readers,
    apply the state. Returns the rest of state.json decoded (train state, scaler, rng)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for src, ranges in enumerate(plan.plain):
            for tname, start, count in ranges:
                t = flat_local(plan.targets.tensors[tname])
                group = cpu_group if t.device.type == "cpu" else None  # a CPU tensor under NCCL
                dist.broadcast(t[start:start + count], src=src, group=group)
    groups = from_plain(plan.raw.get("optimizer_values") or {}, {})
    if plan.targets.optim_sd is not None:
        plan.targets.optim_sd.update(groups)
        plan.targets.values.update(groups)
    apply_state(net, optimizer, plan.targets)
    return {k: from_plain(v, plan.small) for k, v in plan.raw.items() if k not in ("optimizer_values", "aliases")}


def shape_of(manifest: dict, tname: str) -> tuple[int, ...]:
    """The stored whole shape of ``tname``."""
    return tuple(manifest["tensors"][tname]["shape"])


def numel_of(manifest: dict, tname: str) -> int:
    """Elements of stored tensor ``tname``."""
    return math.prod(shape_of(manifest, tname))
