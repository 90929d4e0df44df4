"""The fast node-local tier (``ckpt.local_dir``): what each rank holds there, and how a restart
learns which local step every rank can restore.

A node-local directory (NVMe, ``/dev/shm``) holds only the pieces of that node's ranks, so no
single rank can see a local checkpoint whole and rank 0's manifest alone cannot commit it. The
layout is the durable one (``podtrain.ckpt.layout``), plus one marker per rank::

    LOCAL_DIR/<lineage>/step_000120/rank_00003.safetensors   rank 3's pieces (as in the durable tier)
    LOCAL_DIR/<lineage>/step_000120/meta_00003.json          rank 3's sidecar (pieces, RNG states)
    LOCAL_DIR/<lineage>/step_000120/rank_00003.json          rank 3's commit, after its piece file and sidecar
    LOCAL_DIR/<lineage>/step_000120/manifest.json, state.*   rank 0's node only: manifest, small state

Each run keeps its own folder (``podtrain.ckpt.lineage``): runs that share one ``ckpt.local_dir``
(one base YAML) never see, restore or prune each other's steps.

Every save has an id (``SaveJob.save_id``), in every marker, sidecar and manifest, and so in
every replica: a step saved twice (a rollback, then the same step again) is two saves, and a
restore never combines their pieces.

A step is complete when EVERY rank holds its marker and rank 0 holds the manifest, all of one
save: at start every rank lists the ``(step, save id)`` it holds (``held_steps``), the ranks
intersect them (``restore.newest_held_by_all``), and rank 0 restores the newest common step (its
manifest naming that save) when it is at least as new as the newest durable checkpoint
(broadcasting the manifest and the small files, which only its node has: ``WithSmallFiles``).
Each rank then reads its own pieces from its own disk, which works when the world size and the
strategy are the saved ones (a rank needing another node's file finds it missing: every rank
then falls back to the durable tier together). Every rank clears and prunes only its own files,
so ranks sharing a node's directory never delete each other's.
"""

from __future__ import annotations

import json
import logging

from podtrain.ckpt import layout
from podtrain.ckpt.sidecar import sidecar
from podtrain.ckpt.store import NotFound, StorageError, read_json

log = logging.getLogger("podtrain.checkpoint")

_RANK0_FILES = (layout.MANIFEST, layout.STATE_FILE, layout.STATE_JSON, layout.CONFIG_JSON)
SMALL_FILES = (layout.STATE_FILE, layout.STATE_JSON)
"""The files a restore reads besides the pieces (rank 0 broadcasts them)."""


def marker(rank: int) -> str:
    """The name of rank ``rank``'s commit marker in a local step directory."""
    return f"rank_{rank:05d}.json"


def own_files(rank: int) -> list[str]:
    """The files of one step that rank ``rank`` writes in the local tier (its marker first)."""
    return [marker(rank), layout.rank_file(rank), sidecar(rank), *(_RANK0_FILES if rank == 0 else ())]


def write_marker(store, name: str, rank: int, world: int, record: tuple | None,
                 lineage: str | None = None, save_id: str | None = None) -> None:
    """Commit this rank's part of local step ``name`` (after its piece file is in place); the
    marker names the run's lineage and the save."""
    body = {"world_size": world, "lineage": lineage, "save_id": save_id, "file": record[0] if record else None,
            "bytes": record[1]["bytes"] if record else 0}
    store.write_bytes(f"{name}/{marker(rank)}", json.dumps(body).encode())


def clear(store, name: str, rank: int) -> None:
    """Remove this rank's files of step ``name`` (marker first, temporaries of killed writes too;
    the folder once the node's last rank left it); raises what the store raises."""
    own = own_files(rank)  # a killed writer's temporary: '.NAME.XXXX.tmp'
    layout.Housekeeping(strict=True).remove(store, name, own, [f".{rel}." for rel in own])


def held_steps(store, rank: int, world: int) -> list[tuple[int, str | None]]:
    """``(step, save id)`` of the local steps whose part this rank holds for a run of ``world``
    ranks: its marker, its piece file at the marked size, and on rank 0 the manifest of the same
    save. Unfinished parts are removed first."""
    for name in store.list_dirs(""):
        if layout.parse_step(name) is not None and not store.exists(f"{name}/{marker(rank)}"):
            clear(store, name, rank)
    own = sorted((s, n) for n in store.list_dirs("") if (s := layout.parse_step(n)) is not None
                 and store.exists(f"{n}/{marker(rank)}"))
    return [(step, body.get("save_id")) for step, name in own if (body := part(store, name, rank, world)) is not None]


def part(store, prefix: str, owner: int, world: int) -> dict | None:
    """Rank ``owner``'s marker under ``prefix`` (a step folder or a replica folder in it) when its
    committed part belongs to a run of ``world`` ranks and is whole: the marker, its piece file at
    the marked size, and for rank 0 the manifest, of the save the marker names; else None."""
    try:
        body = read_json(store, f"{prefix}/{marker(owner)}", missing={})  # absent or damaged: not whole
        ok = body.get("world_size") == world and (
            body.get("file") is None or store.size(f"{prefix}/{body['file']}") == body.get("bytes"))
        if ok and owner == 0:
            manifest = layout.read_manifest(store, prefix)
            ok = manifest.get("world_size") == world and manifest.get("save_id") == body.get("save_id")
    except (ValueError, NotFound, StorageError, AttributeError) as exc:
        log.warning("local checkpoint %s/%s is not usable for rank %d: %s", store.url, prefix, owner, exc)
        ok = False
    return body if ok else None


def prune(store, rank: int, current: int, keep: int, others=(), drop=None, protected=()) -> None:
    """After local step ``current``: this rank keeps the newest ``keep`` steps of this node's
    directory at or below it and drops its files of the rest (steps above it belong to a timeline
    this run left: the local tier is a cache, nothing to move aside), with the files it looks after
    for ``others`` (peer replicas, a moved host's files: ``drop``, ``podtrain.ckpt.replicas.drop``).
    Steps in ``protected`` stay whatever ``keep`` says (the peer replicas' round in flight: at most
    the steps it may still copy, so retention never stops: ``Replicator.protected``).
    A failure is a warning: the save itself succeeded."""
    try:
        steps = [s for n in store.list_dirs("") if (s := layout.parse_step(n)) is not None]
        delete, abandon = layout.retention_plan(steps, current, keep, 0)
        for step in delete + abandon:
            if step in protected and step <= current:
                continue
            clear(store, layout.step_name(step), rank)
            if drop is not None:
                drop(store, layout.step_name(step), others)
    except (OSError, StorageError) as exc:
        log.warning("pruning the local checkpoints under %s failed on rank %d: %s", store.url, rank, exc)


class WithSmallFiles:
    """A local store whose small files are served from bytes rank 0 broadcast (they exist only
    on rank 0's node); everything else, this rank's pieces above all, from its own disk."""

    def __init__(self, store, files: dict[str, bytes]) -> None:
        self._store = store
        self._files = files
        self.url = store.url

    def read_bytes(self, name: str) -> bytes:
        """A broadcast file, else the file on this node."""
        return self._files[name] if name in self._files else self._store.read_bytes(name)

    def __getattr__(self, attr):
        return getattr(self._store, attr)
