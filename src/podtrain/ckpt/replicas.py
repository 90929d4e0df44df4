"""Peer replicas of the node-local tier (``ckpt.local_replicas: K``) and restoring a local step from
whoever holds its pieces.

Placement: by host name, never by rank arithmetic. Every rank's host name is gathered once at
start (``Ring.over_hosts``); a node is a host, the nodes in the order of their lowest rank, and a
rank's position on its node is its index among that host's ranks (in rank order). The rank at
position ``l`` of node ``n`` sends its files of a local step to the rank at position ``l`` of each
of the next ``K`` nodes that have one (a ring over those nodes), so any ``K`` lost nodes leave a
copy of every piece, whatever the launcher's distribution (block, or srun's cyclic one, where
rank ``r + 1`` is on the next node). With uneven processes per node, a position that only one
node has (a 9th rank on one node of 8-rank nodes) has no peer: its pieces are not replicated (said
once at start). One node means no replicas (nothing survives the node's loss there anyway).

A replica lives beside the holder's own files, under a name that says whose it is::

    LOCAL_DIR/<lineage>/step_000120/replica_of_rank_00003/rank_00003.safetensors
    LOCAL_DIR/<lineage>/step_000120/replica_of_rank_00003/rank_00003.json     (the marker, last)

(rank 0's replicas also hold its manifest and small files). A replica is of one save: its marker
and sidecar name the save id, and a replica folder of an earlier save of the same step is removed
before the new one's files arrive (and at the new save's start). Files travel point to point over the
local writer's gloo group in ``CHUNK_BYTES`` pieces (isend + irecv posted together, so a ring
never deadlocks and a rank holds at most two chunks in memory), in the background thread after
the local save committed: the step loop never waits for them.

Restore (``plan_sources``, ``repair``): every rank reports the (step, owner, save id) pieces it
holds, own or replica, or another owner's when ranks moved between hosts; the newest save whose
pieces the ranks hold together wins (pieces of another save of the same step count as missing); each rank missing its own pieces receives them from a holder and
commits them as its own files in its local directory, after which the ordinary local restore
reads each rank's share from its own disk.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from podtrain.ckpt import layout, local_tier
from podtrain.ckpt.store import read_json
from podtrain.ckpt.tensorio import CorruptCheckpoint

log = logging.getLogger("podtrain.checkpoint")

CHUNK_BYTES = 8 << 20
"""Bytes per point-to-point message: a rank holds at most one outgoing and one incoming chunk."""
REPLICA_PREFIX = "replica_of_rank_"


class CopyFailed(Exception):
    """A file could not be read or written while copying, after the protocol ran to its end (the
    peer got every message it expected): the copy failed, the group is fine."""


def replica_dir(owner: int) -> str:
    """The folder of a step directory that holds rank ``owner``'s replica."""
    return f"{REPLICA_PREFIX}{owner:05d}"


@dataclass(frozen=True)
class Ring:
    """Where this rank's local pieces go and whose it receives (global ranks, one per replica)."""

    targets: tuple[int, ...]
    sources: tuple[int, ...]

    @classmethod
    def over_hosts(cls, hosts: list[str], rank: int, k: int) -> "Ring":
        """Rank ``rank``'s ring (pure; ``hosts[r]`` is rank r's host name, the same list on every
        rank): ``k`` replicas on the next nodes that have a rank at its position, capped at their count."""
        peers = same_position(hosts, rank)
        here = peers.index(rank)
        k = max(0, min(k, len(peers) - 1))
        return cls(tuple(peers[(here + j) % len(peers)] for j in range(1, k + 1)),
                   tuple(peers[(here - j) % len(peers)] for j in range(1, k + 1)))


def nodes_of(hosts: list[str]) -> list[list[int]]:
    """The ranks of each node (a host), nodes in the order of their lowest rank (pure)."""
    nodes: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        nodes.setdefault(host, []).append(r)
    return list(nodes.values())


def same_position(hosts: list[str], rank: int) -> list[int]:
    """The ranks at rank ``rank``'s position (index among its host's ranks) on every node that has
    one, in node order: its ring (pure)."""
    nodes = nodes_of(hosts)
    position = next(ranks.index(rank) for ranks in nodes if rank in ranks)
    return [ranks[position] for ranks in nodes if len(ranks) > position]


def unreplicated(hosts: list[str], k: int) -> list[int]:
    """The ranks whose pieces get no peer replica: no other node has a rank at their position
    (uneven processes per node), or ``k`` is 0 (pure)."""
    nodes = nodes_of(hosts)
    having = [sum(1 for ranks in nodes if len(ranks) > position) for position in range(max(map(len, nodes)))]
    return sorted(r for ranks in nodes for position, r in enumerate(ranks) if k <= 0 or having[position] < 2)


def looked_after(hosts: list[str], rank: int, k: int) -> list[int]:
    """The ranks whose files rank ``rank`` looks after in its node's directory (pure): its own, its
    ring sources' (their replicas land here), and its share of the other nodes' remaining ranks (a
    host that served another rank before leaves its files here). Each rank is looked after by
    exactly one rank of a node, so ranks sharing a directory never race on a file."""
    mine = next(ranks for ranks in nodes_of(hosts) if rank in ranks)
    sources = {m: set(Ring.over_hosts(hosts, m, k).sources) for m in mine}
    taken = set(mine).union(*sources.values())
    rest = [o for o in range(len(hosts)) if o not in taken]
    index = mine.index(rank)
    return sorted({rank, *sources[rank], *(o for i, o in enumerate(rest) if i % len(mine) == index)})


def files_of(store, prefix: str, owner: int) -> list[str]:
    """Rank ``owner``'s files of one step under ``prefix`` that exist, its marker last (the commit)."""
    rest = [rel for rel in local_tier.own_files(owner)[1:] if store.exists(f"{prefix}/{rel}")]
    return [*rest, local_tier.marker(owner)]


def _chunks(store, prefix: str, rels: list[str]):
    for rel in rels:
        with store.open_read(f"{prefix}/{rel}") as fh:
            while data := fh.read(CHUNK_BYTES):
                yield torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _chunk_plan(files: list) -> list[tuple[int, int]]:
    """``(file index, bytes)`` of every message that sends ``files`` (``[[name, size], ...]``)."""
    return [(i, min(CHUNK_BYTES, size - off)) for i, (_, size) in enumerate(files)
            for off in range(0, size, CHUNK_BYTES)]


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


def _exchange_header(header: bytes | None, dst: int | None, src: int | None, group) -> list | None:
    """Send ``header`` to ``dst`` and receive one from ``src`` (either may be None)."""
    out_len, in_len = torch.tensor([len(header or b"")], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    reqs = ([dist.isend(out_len, dst, group=group)] if dst is not None else []) + (
        [dist.irecv(in_len, src, group=group)] if src is not None else [])
    _wait(reqs)
    body = torch.empty(int(in_len[0]), dtype=torch.uint8)
    reqs = ([dist.isend(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=group)]
            if dst is not None else []) + ([dist.irecv(body, src, group=group)] if src is not None else [])
    _wait(reqs)
    return json.loads(body.numpy().tobytes()) if src is not None else None


def exchange(store, out_prefix: str | None, rels: list[str], dst: int | None,
             in_prefix: str | None, src: int | None, group, pace=None, failure: Exception | None = None) -> int:
    """Send files ``rels`` under ``out_prefix`` to rank ``dst`` while receiving another rank's
    files from ``src`` into ``in_prefix`` (each side optional; both ranks of a pair call it).
    Each received file is committed atomically in the sent order (the marker last). Returns the
    bytes received; raises after the protocol ran to its end when a file could not be read or
    written (``CopyFailed``: the peer still got every chunk it expects, so no rank is left waiting).
    ``failure``: the files to send could not even be listed: the peer gets a header of no files
    and this side still receives, then raises ``CopyFailed``."""
    header = None
    if dst is not None and failure is not None:
        header = b"[]"
    elif dst is not None:
        try:
            header = json.dumps([[rel, store.size(f"{out_prefix}/{rel}")] for rel in rels]).encode()
        except Exception as exc:  # nothing to send (retention took the step): the peer still gets
            header, failure = b"[]", exc  # a header, of no files, and is not left waiting
    incoming = _exchange_header(header, dst, src, group) or []
    plan_in = _chunk_plan(incoming)
    plan_out = _chunk_plan(json.loads(header)) if header else []
    out_iter = _chunks(store, out_prefix, rels) if dst is not None else iter(())
    writer, current, received, writing = None, -1, 0, True
    for j in range(max(len(plan_in), len(plan_out))):
        if pace is not None:  # the replicator yields the disk to a local save in progress here
            pace()
        reqs = []
        if j < len(plan_out):
            try:
                chunk = next(out_iter)
                if chunk.numel() != plan_out[j][1]:
                    raise OSError(f"{out_prefix}/{rels[plan_out[j][0]]} changed while it was being sent")
            except Exception as exc:  # keep the peer's count of chunks: it is told below
                failure = failure or exc
                chunk = torch.zeros(plan_out[j][1], dtype=torch.uint8)
            reqs.append(dist.isend(chunk, dst, group=group))
        buf = None
        if j < len(plan_in):
            buf = torch.empty(plan_in[j][1], dtype=torch.uint8)
            reqs.append(dist.irecv(buf, src, group=group))
        _wait(reqs)
        if buf is None or not writing:
            continue
        index = plan_in[j][0]
        try:
            if index != current:
                writer, current = store.open_write(f"{in_prefix}/{incoming[index][0]}"), index
            writer.write(buf.numpy())
            received += buf.numel()
            if writer.tell() == incoming[index][1]:
                writer.commit()
                writer = None
            else:  # to the disk chunk by chunk: a replica file does not pile up as dirty pages in
                writer.sync()  # the node's shared host memory, for the next local save's fsync to flush
        except Exception as exc:  # no space: receive the rest, commit nothing more
            failure, writing = failure or exc, False
            if writer is not None:
                writer.abort()
    if failure is not None:
        raise CopyFailed(f"{type(failure).__name__}: {failure}") from failure
    return received


def replicate(store, name: str, rank: int, ring: Ring, group, pace=None) -> int:
    """After local step ``name`` committed on every rank: send this rank's files to its ring
    targets and hold its sources' (every rank, from the replicator's thread). Bytes received.
    ``pace()`` is called before each chunk (it may block: the peer just waits)."""
    received = 0
    for dst, src in zip(ring.targets, ring.sources):
        where = f"{name}/{replica_dir(src)}"
        # An earlier save's replica of this step (a rollback saved it again): gone, its marker
        # first, before any file of this save arrives, so the folder never mixes the two.
        try:
            layout.Housekeeping(strict=True).remove(store, where, first=(local_tier.marker(src),))
        except Exception as exc:  # still run the protocol (the peer waits for it); a file left over
            log.warning("could not clear %s/%s before receiving its replica: %s", store.url, where, exc)
        try:
            rels, failure = files_of(store, name, rank), None
        except Exception as exc:  # still run the protocol (the peer waits for it): a failed copy, not a broken group
            rels, failure = [], exc
        received += exchange(store, name, rels, dst, where, src, group, pace, failure)
    return received


def drop(store, name: str, owners, own_files_too: bool = True) -> None:
    """Remove what step ``name`` holds here of ``owners``: their replicas, and (``own_files_too``)
    their files left in the step folder by a host that served another rank before (retention)."""
    for owner in owners:
        if own_files_too:
            local_tier.clear(store, name, owner)
        layout.Housekeeping(strict=True).remove(store, f"{name}/{replica_dir(owner)}", first=())


def drop_incomplete(store, name: str, owners) -> None:
    """After a failed replication of step ``name``: remove the replicas held here that did not
    arrive whole. One whose marker is here is complete (each file is committed atomically, the
    marker last) and stays: a peer lost while this rank was still sending its own files must not
    take the copy this rank already holds of the peer's (it is what a replacement restores from)."""
    partial = [o for o in owners if not store.exists(f"{name}/{replica_dir(o)}/{local_tier.marker(o)}")]
    if partial:
        drop(store, name, partial, own_files_too=False)


# -- restore -----------------------------------------------------------------------------------------
def where_held(store, name: str, owner: int, save_id: str | None) -> str | None:
    """Where in this node's directory rank ``owner``'s committed files of step ``name`` of save
    ``save_id`` are: the step folder itself (its own, or a moved host's), a replica folder, or None."""
    for prefix in (name, f"{name}/{replica_dir(owner)}"):
        # no marker here (or not one): not held here; a storage that fails the read is raised
        # ("not held" would clear the rank's files)
        body = read_json(store, f"{prefix}/{local_tier.marker(owner)}", error=None, missing=None)
        if body is not None and body.get("save_id") == save_id:
            return prefix
    return None


def holdings(store, world: int) -> list[list]:
    """``[[step, [[owner, save id], ...]], ...]``: every usable (step, owner, save) piece this
    node's directory holds for a run of ``world`` ranks, own or replica (small: steps kept x
    owners on the node)."""
    out = []
    for name in store.list_dirs(""):
        step = layout.parse_step(name)
        if step is None:
            continue
        owners: set[tuple[int, str | None]] = set()
        for entry in store.list(f"{name}/"):
            rel = entry.name[len(name) + 1:]
            parts = rel.split("/")
            base = parts[-1]
            if not (base.startswith("rank_") and base.endswith(".json")):
                continue
            owner = int(base[5:-5])
            if len(parts) == 2 and parts[0] != replica_dir(owner) or len(parts) > 2:
                continue
            body = local_tier.part(store, "/".join([name, *parts[:-1]]), owner, world)
            if body is not None:
                owners.add((owner, body.get("save_id")))
        if owners:
            out.append([step, [list(o) for o in sorted(owners, key=lambda o: (o[0], o[1] or ""))]])
    return out


def plan_sources(reports: list[list[list]], world: int) -> tuple[int, str | None, dict[int, int]] | None:
    """The newest save whose pieces the ranks hold together (its step, its save id), and who gives
    each owner's pieces: the owner itself when it holds them, else the holder with the fewest
    sends so far (pure). ``reports[r]`` is rank r's ``holdings``. Pieces of another save of the
    same step count as missing; when two saves of one step are both held whole (a failed delete),
    the later one wins (save ids sort by time: ``writer.new_save_id``)."""
    by_save: dict[tuple[int, str], dict[int, list[int]]] = {}
    for holder, held in enumerate(reports):
        for step, owners in held:
            for owner, save_id in owners:
                by_save.setdefault((step, save_id or ""), {}).setdefault(owner, []).append(holder)
    for step, save_id in sorted(by_save, reverse=True):
        owners = by_save[(step, save_id)]
        if len(owners) < world or any(o not in owners for o in range(world)):
            continue
        load: dict[int, int] = {}
        source = {}
        for owner in range(world):
            holders = owners[owner]
            holder = owner if owner in holders else min(holders, key=lambda h: (load.get(h, 0), h))
            if holder != owner:
                load[holder] = load.get(holder, 0) + 1
            source[owner] = holder
        return step, save_id or None, source
    return None


def repair(store, step: int, save_id: str | None, source: dict[int, int], rank: int, group) -> int:
    """Every rank: give each rank its own files of ``step`` (save ``save_id``) as its own local
    files (received from their holder, or linked from a replica folder here). The transfers run in rounds in which
    every rank sends at most one owner's files and receives at most its own, all pairs of a round
    at once (``exchange``: nonblocking, in lockstep, so they cannot deadlock). Bytes this rank
    received from peers. What this rank cannot read, link or clear is raised after every round ran
    (a round it left would leave its peer waiting until the group's timeout)."""
    name = layout.step_name(step)
    failure: Exception | None = None  # raised after the rounds: a peer waits for each round of this rank
    if source.get(rank) == rank:
        try:
            prefix = where_held(store, name, rank, save_id)
            if prefix is None:  # gone since the holdings were reported: nothing here may be cleared for it
                raise CorruptCheckpoint(f"{store.url}/{name}: rank {rank}'s files of save {save_id} are no longer here")
            if prefix != name:
                _link_own(store, prefix, name, rank)
        except Exception as exc:
            failure = exc
    sends: dict[int, list[int]] = {}
    for owner in sorted(source):
        if source[owner] != owner:
            sends.setdefault(source[owner], []).append(owner)
    received = 0
    for r in range(max((len(v) for v in sends.values()), default=0)):
        mine = sends.get(rank, [])
        dst = mine[r] if r < len(mine) else None
        holder = source.get(rank, rank)
        src = holder if holder != rank and sends[holder].index(rank) == r else None
        if dst is None and src is None:
            continue
        out_prefix, rels, cannot = None, [], None
        try:
            if dst is not None:
                out_prefix = where_held(store, name, dst, save_id)
                rels = files_of(store, out_prefix, dst)
            if src is not None:
                local_tier.clear(store, name, rank)
        except Exception as exc:  # still run the round (the peer waits for it): a failed copy, not a broken group
            cannot = exc
        try:
            received += exchange(store, out_prefix, rels, dst, name if src is not None else None, src, group,
                                 failure=cannot)
        except CopyFailed as exc:  # the round ran to its end: the next rounds still run, then it is raised
            failure = failure or exc
    if failure is not None:
        raise failure
    return received


def _link_own(store, prefix: str, name: str, owner: int) -> None:
    """This rank's files held as a replica here become its own files (hard links: no copy)."""
    local_tier.clear(store, name, owner)
    for rel in files_of(store, prefix, owner):
        src, dst = store.local_path(f"{prefix}/{rel}"), store.local_path(f"{name}/{rel}")
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
