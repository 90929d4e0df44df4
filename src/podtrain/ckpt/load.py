"""Resuming: each rank reads (and verifies) only its share, then the ranks exchange the rest.

Three phases, so that the caller can agree between them (``Checkpointer.restore``):

1. ``prepare`` (each rank alone, no collective): state.json, this run's targets from
   ``get_state_dict`` (DTensor shards under FSDP/HSDP, whole tensors under DDP), names and shapes
   checked against the checkpoint (a one-line ``UserError``), the ranges this rank reads, and
   the piece tables of just the saved ranks that hold them (``podtrain.ckpt.sidecar``: at the
   saved world size and strategy, its own; a ``podtrain-ckpt/2`` manifest has them inline);
2. ``read`` (each rank alone): a DTensor target is filled with the flat range its local shard
   holds (under HSDP by one replica group per tensor, ``statedict.replica_groups``); the tensors
   every rank holds whole are split over the ranks (``plan.split_even`` over THIS run's ranks)
   and each rank reads only its ranges. Bytes go through the rank's bounded staging pool in
   whole checksum blocks, each block's CRC-32 checked as it arrives (``CorruptCheckpoint`` on a
   mismatch). No rank reads the whole checkpoint, and under HSDP no shard is read twice;
3. ``finish`` (collective): every whole tensor's ranges are broadcast from the rank that read
   them, every HSDP shard over its replicate group from the replica that read it, then
   ``set_state_dict`` applies everything.

Why broadcast instead of every DDP rank reading everything: a shared file system (FSx for
Lustre, S3) serves the whole job from the same targets, so N ranks each reading the full state
move N times the checkpoint through the storage network (an 8-node job: 64x); reading 1/N each
moves it once and spreads it over N clients, and the exchange runs over the GPU fabric (NVLink /
EFA, tens to hundreds of GB/s per node, versus a few GB/s per client from storage). It wins at
every N > 1, and more the larger N is.
"""

from __future__ import annotations

import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from podtrain.ckpt import layout, sidecar
from podtrain.ckpt.coalesce import Chunk, Read, coalesce, split
from podtrain.ckpt.host_buffers import StagingPool, byte_array
from podtrain.ckpt.plan import BLOCK_BYTES, Piece, spans
from podtrain.ckpt.state import from_plain
from podtrain.ckpt.statedict import (NamedState, apply_state, dtensor_range, flat_local, is_dtensor, named_state,
                                     plain_plan, replica_groups, replicate_broadcasts)
from podtrain.ckpt.store import read_json
from podtrain.ckpt.tensorio import DTYPES, CorruptCheckpoint, decode_small, verify_blocks
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
    wanted: list[tuple[str, int, int, int]] = field(default_factory=list)
    """What this rank reads: ``(tensor, first element, elements, first element of its target)``."""
    readers: dict[str, int] = field(default_factory=dict)
    """The replica group that reads each DTensor (HSDP: the others receive it in ``finish``)."""
    rng: dict[str, Any] | None = None
    """This rank's saved RNG states (None when the world size changed)."""
    saved_ranks_read: list[int] = field(default_factory=list)
    """The saved ranks whose sidecars this rank parsed (its own, at the saved world size)."""
    metadata_bytes_parsed: int = 0
    """Bytes of checkpoint metadata this rank parsed: state.json and the sidecars it read, plus
    the manifest (JSON, as rank 0 read it); a bench's measure of the resume's metadata cost."""
    metadata_s: float = 0.0
    """Seconds this rank spent reading and indexing its metadata (``prepare``)."""


def read_small(store, name: str, manifest: dict, rel: str) -> bytes:
    """A small file of the checkpoint, checked against its manifest record (``CorruptCheckpoint``
    unless its size and CRC-32 are the recorded ones)."""
    data, record = store.read_bytes(f"{name}/{rel}"), manifest["files"].get(rel, {})
    if len(data) != record.get("bytes") or zlib.crc32(data) != record.get("crc32"):
        raise CorruptCheckpoint(f"{store.url}/{name}/{rel} does not match the manifest (size or CRC-32)")
    return data


def read_small_json(store, name: str, manifest: dict, rel: str, data: bytes | None = None) -> dict[str, Any]:
    """A small JSON file of the checkpoint (``data``: its bytes, already read by ``read_small``),
    checked against its manifest record; one that is not a JSON object is a ``CorruptCheckpoint``."""
    if data is None:
        data = read_small(store, name, manifest, rel)
    return read_json(store, f"{name}/{rel}", data, error=CorruptCheckpoint)


def piece_index(manifest: dict, store=None, name: str | None = None) -> dict[str, list[Piece]]:
    """Every stored piece, by tensor name: from the manifest (``podtrain-ckpt/2``), else from
    every rank's sidecar in ``store`` (a whole-checkpoint operation: ``verify``, tools). A sidecar
    of another save than the manifest's is a ``CorruptCheckpoint``, as a damaged one is."""
    if sidecar.is_sidecar_format(manifest):
        if store is None:
            raise ValueError("a podtrain-ckpt/3 manifest keeps its pieces in the ranks' sidecars: pass the store")
        return sidecar.read_sidecars(store, name, manifest, range(int(manifest["world_size"]))).pieces
    out: dict[str, list[Piece]] = {}
    for rel, rec in manifest["files"].items():
        for item in rec.get("pieces", []):
            piece = Piece.from_json(rel, item)
            out.setdefault(piece.tensor, []).append(piece)
    return out


def prepare(store, name: str, manifest: dict, net: nn.Module, optimizer: torch.optim.Optimizer,
            rank: int, world: int) -> LoadPlan:
    """Phase 1 (no collective): the plan; a checkpoint of another model is a one-line UserError."""
    t0 = time.perf_counter()
    where = f"{store.url}/{name}"
    state_json = read_small(store, name, manifest, layout.STATE_JSON)
    raw = read_small_json(store, name, manifest, layout.STATE_JSON, state_json)
    small = decode_small(read_small(store, name, manifest, layout.STATE_FILE))
    stored = manifest.get("tensors", {})
    has_optimizer = any(k.startswith("optim/") for k in stored)
    targets = named_state(net, optimizer, with_optimizer=has_optimizer, stored=stored)
    check_fit(where, {k: v["shape"] for k, v in stored.items()}, targets.tensors, "this model and optimizer")
    plan = LoadPlan(where, manifest, raw, small, targets)
    plan.plain = plain_plan(targets.tensors, world)
    plan.readers = replica_groups(targets.tensors)
    for tname, t in targets.tensors.items():
        if is_dtensor(t):
            start, count, reads = dtensor_range(tname, t, plan.readers.get(tname, 0))
            if count and reads:
                plan.wanted.append((tname, start, count, start))
    plan.wanted += [(tname, start, count, 0) for tname, start, count in plan.plain[rank]]
    plan.metadata_bytes_parsed = len(state_json) + len(layout.encode_manifest(manifest))
    if sidecar.is_sidecar_format(manifest):
        found = sidecar.index(store, name, manifest, [w[:3] for w in plan.wanted], rank, world)
        plan.pieces, plan.rng, plan.saved_ranks_read = found.pieces, found.rng, found.ranks_read
        plan.metadata_bytes_parsed += found.bytes_parsed
    else:  # podtrain-ckpt/2: every piece in the manifest, every rank's RNG states in state.json
        plan.pieces = piece_index(manifest)
        rngs = raw.get("rng") or []
        plan.rng = from_plain(rngs[rank], small) if len(rngs) == world else None
    plan.metadata_s = time.perf_counter() - t0
    return plan


def saved_world_size(manifest: dict) -> int:
    """How many ranks wrote the checkpoint."""
    return int(manifest.get("world_size") or 0)


def check_fit(where: Any, stored: dict[str, Any], own: dict[str, torch.Tensor], what: str = "this model") -> None:
    """The one fit check (a resume's and the offline readers'): a one-line ``UserError`` naming
    checkpoint ``where`` unless ``stored`` (name -> shape) has exactly ``own``'s names and shapes
    (``what`` says what ``own`` is; names are shown without their ``model/`` or ``optim/``)."""
    missing, unexpected = sorted(set(own) - set(stored)), sorted(set(stored) - set(own))
    shapes = [k for k in own if k in stored and tuple(own[k].shape) != tuple(stored[k])]
    if missing or unexpected or shapes:
        parts = [f"{label}: {', '.join(n.split('/', 1)[-1] for n in names[:3])}{' ...' if len(names) > 3 else ''}"
                 for label, names in (("missing", missing), ("unexpected", unexpected), ("shape differs", shapes))
                 if names]
        raise UserError(f"checkpoint {where} does not fit {what} ({'; '.join(parts)}): "
                        "was it saved with another model.preset or vocabulary?")


def read(plan: LoadPlan, store, name: str, rank: int, pool: StagingPool) -> int:
    """Phase 2 (no collective): fill this rank's share of the targets. Returns bytes of tensor
    data read. Raises ``CorruptCheckpoint`` when a block fails its check.

    The chunks needed are merged into few large reads per file (``podtrain.ckpt.coalesce``), run
    on ``pool.threads`` threads (a request's latency overlaps the others'; CRC-32 and copies
    release the GIL), each through one pool slab: blocks verified, then copied out."""
    cap = max(BLOCK_BYTES, pool.slab_bytes // BLOCK_BYTES * BLOCK_BYTES)
    chunks: list[Chunk] = []
    for tname, start, count, dst_start in plan.wanted:
        chunks += _chunks(plan, name, tname, flat_local(plan.targets.tensors[tname]), start, count, dst_start, cap)
    reads = coalesce(chunks, cap)
    failed = threading.Event()

    def fetch(r: Read) -> int:
        if failed.is_set():  # another read failed: the load is abandoned, stop fetching
            return 0
        slab = pool.acquire()
        try:
            buf = slab[:r.length]
            store.read_into(f"{name}/{r.file}", r.offset, byte_array(buf))
            for c in r.chunks:
                _place(plan, buf[c.offset - r.offset:c.offset - r.offset + c.length], c.payload)
        except BaseException:
            failed.set()
            raise
        finally:
            pool.release(slab)
        return r.length

    if len(reads) < 2 or pool.threads < 2:
        return sum(fetch(r) for r in reads)
    with ThreadPoolExecutor(min(pool.threads, len(reads)), thread_name_prefix="podtrain-ckpt-read") as ex:
        return sum(ex.map(fetch, reads))


@dataclass(frozen=True)
class _Dest:
    """Where a chunk's bytes go: blocks ``first_block``.. of ``piece`` (to verify), elements
    ``[lo, hi)`` of the tensor into ``dst[lo - dst_start ...]``; ``first_elem``: the chunk's first."""

    tname: str
    piece: Piece
    first_block: int
    first_elem: int
    lo: int
    hi: int
    dst: torch.Tensor
    dst_start: int
    dtype: torch.dtype
    esize: int


def _chunks(plan: LoadPlan, name: str, tname: str, dst: torch.Tensor, start: int, count: int,
            dst_start: int, cap: int) -> list[Chunk]:
    """The whole-block chunks (at most ``cap`` bytes) that hold elements ``[start, start + count)``
    of ``tname``, each with where its wanted elements go."""
    dtype = DTYPES[plan.manifest["tensors"][tname]["dtype"]]
    esize = dtype.itemsize
    try:
        found = spans(plan.pieces.get(tname, []), start, count, esize)
    except ValueError as exc:
        raise UserError(f"checkpoint {plan.where}: tensor {tname}: {exc}") from None
    out: list[Chunk] = []
    for span in found:
        offset, length = span.byte_range(esize)
        first_elem = span.piece.start + span.first_block * BLOCK_BYTES // esize

        def dest(pos: int, n: int, span=span, first_elem=first_elem) -> _Dest:
            lo = max(span.want_start, first_elem + pos // esize)
            hi = min(span.want_start + span.want_count, first_elem + (pos + n) // esize)
            return _Dest(tname, span.piece, span.first_block + pos // BLOCK_BYTES, first_elem + pos // esize,
                         lo, hi, dst, dst_start, dtype, esize)

        out += split(span.piece.file, offset, length, cap, dest)
    return out


def _place(plan: LoadPlan, buf: torch.Tensor, d: _Dest) -> None:
    """Verify a chunk's blocks, then copy its wanted elements into the target."""
    verify_blocks(memoryview(byte_array(buf)), d.piece.crcs, d.first_block,
                  f"{plan.where}/{d.piece.file} ({d.tname})")
    if d.hi > d.lo:
        raw = buf[(d.lo - d.first_elem) * d.esize:(d.hi - d.first_elem) * d.esize]
        if raw.storage_offset() % d.esize:  # merged after a piece of an odd size: view needs alignment
            raw = raw.clone()
        values = raw.view(d.dtype)
        d.dst[d.lo - d.dst_start:d.hi - d.dst_start].copy_(values)


def finish(plan: LoadPlan, net: nn.Module, optimizer: torch.optim.Optimizer, cpu_group=None) -> dict[str, Any]:
    """Phase 3 (collective, every rank): broadcast the whole tensors' ranges from their readers
    and the HSDP shards over their replicate groups, apply the state. Returns the rest of
    state.json decoded (train state, scaler) and ``rng``: this rank's saved RNG states or None."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for src, ranges in enumerate(plan.plain):
            for tname, start, count in ranges:
                t = flat_local(plan.targets.tensors[tname])
                group = cpu_group if t.device.type == "cpu" else None  # a CPU tensor under NCCL
                dist.broadcast(t[start:start + count], src=src, group=group)
        for flat, src, group in replicate_broadcasts(plan.targets.tensors, plan.readers):
            dist.broadcast(flat, src=src, group=group)
    groups = from_plain(plan.raw.get("optimizer_values") or {}, {})
    if plan.targets.optim_sd is not None:
        plan.targets.optim_sd.update(groups)
        plan.targets.values.update(groups)
    apply_state(net, optimizer, plan.targets)
    out = {k: from_plain(v, plan.small) for k, v in plan.raw.items() if k not in ("optimizer_values", "aliases", "rng")}
    out["rng"] = plan.rng
    return out

