"""Writing checkpoints in the background: the writer thread and the collectives and files of a save.

The step loop hands a ``SaveJob`` to ``CheckpointWriter.submit``; one background thread per rank
then runs the save's phases (``PHASES``), their collectives in a fixed order on a gloo group of its
own, so they never interleave with the main thread's. The durable tier's group is made at its first
use (``side_group``: the first save, or a restore that loads a checkpoint), by every rank at that
agreed point on the main thread: a gloo group runs a thread that wakes every 10 ms, which on a
CPU host preempts the ranks' compute (measured ~3% of a step, ``bench/train_throughput.py``), so a
job that never saves or restores never pays for it. The local tier's group is made in ``__init__``
(its hosts are gathered there).

1. prepare: rank 0 re-reads the run's lease (a job that lost the run writes nothing) and clears
   the step's directory (an earlier timeline's, or a killed save's; an empty one costs one
   listing), and says so: no rank writes before this outcome is broadcast;
2. write: every rank holding pieces writes its own file (``layout.rank_file``) in parallel,
   streaming the bytes from the step loop's host copies (``podtrain.ckpt.staging``) and computing
   the block CRC-32s in the same pass; the file appears only complete (the store's atomic
   ``open_write``); then every rank writes its sidecar (``podtrain.ckpt.sidecar``: its pieces'
   table, its file's size, its RNG states), which only it (or a resume needing its pieces) reads;
3. commit: rank 0 alone gathers each rank's outcome and byte counts (``_gather``: O(1) per rank,
   nothing per rank goes to every rank), re-reads the lease, writes the small files, then
   ``manifest.json`` (the commit: O(tensors), a count and a total of the ranks' files);
4. publish: ``latest``; 5. retain: retention, only after ``latest`` names the new checkpoint.
   Once the manifest is written nothing can fail the save: a refused ``latest`` or delete is a
   warning (``layout.Housekeeping``). Rank 0 broadcasts the result. A failure before the commit
   removes the step's directory (best effort: never the lease-lost case, where the step may be
   the new holder's), and every rank's job carries the same error.

``SaveJob.received_bytes`` counts the pickled bytes this rank received in the save's object
collectives (``CheckpointWriter.last_save["received_bytes"]`` after a save, for benches): O(1) on
every rank but rank 0, which receives O(world) records of a few bytes. (The peer replicas agree
with one-element all_reduces on a group of their own: nothing per rank is gathered there either.)

The node-local tier (``local=True``, ``podtrain.ckpt.local_tier``) runs the same protocol into a
directory that no single rank sees whole: every rank clears and later prunes only its own files,
and commits its part with its own marker (``local_tier.marker``) after its piece file and sidecar;
rank 0's manifest is the durable tier's. No ``latest``: a step is complete when every
rank's marker and rank 0's manifest exist. Then (``ckpt.local_replicas``) the step is handed to
the ``Replicator`` (``podtrain.ckpt.replicator``), which copies every rank's files to its peers on
other nodes on a thread and group of its own, while the next saves go on.
"""

from __future__ import annotations

import json
import logging
import pickle
import queue
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from podtrain import __version__
from podtrain.ckpt import layout, local_tier, replicas, sidecar
from podtrain.ckpt.plan import Piece
from podtrain.ckpt.replicator import Replicator
from podtrain.ckpt.staging import NotReplayable, SaveStream, StagingTimedOut
from podtrain.ckpt.tensorio import encode_small, write_pieces
from podtrain.config_sections import CkptSection
from podtrain.distributed.group import DistContext
from podtrain.distributed.side_group import new_side_group, release_side_group
from podtrain.errors import UserError
from podtrain.storage.errors import Transient
from podtrain.storage.retry import Cancel, Deadline, cancellation

log = logging.getLogger("podtrain.checkpoint")

# The background group waits while others write; a multi-GB share on a slow shared file system
# can take many minutes, far longer than a training collective should.
CKPT_GROUP_TIMEOUT_S = 3600.0
PHASES = ("prepare", "write", "commit", "publish", "retain")
"""A save's phases, in order (``CheckpointWriter._write``): nothing is visible before the commit,
and nothing after it undoes it."""


class SaveFailed(UserError):
    """A checkpoint could not be written (no space, read-only storage...): every rank raises it."""


class RunTakenOver(UserError):
    """Rank 0 found, before writing or before committing, that another job holds the run's lease:
    nothing more is written or deleted in the step (it may be the new holder's)."""


class SaveAbandoned(Exception):
    """A save given up on a transient storage fault (throttling, 5xx, a dropped connection) once
    the store's retries were spent, or cancelled (a newer save replaced it, a stop's deadline):
    nothing of it is committed, and the run goes on (the next save tries again;
    ``ckpt.max_outage_s`` bounds how long). Neither a ``SaveFailed`` nor a ``UserError``: never a
    reason to stop (``Checkpointer`` logs it, or past the bound raises ``StorageOutage``)."""


@dataclass
class SaveJob:
    """One save, as handed from the step loop to the background thread."""

    step: int
    rng: dict[str, Any]
    stream: SaveStream | None = None
    """This rank's pieces (None: it writes none)."""
    pieces: list[tuple[str, int, int]] = field(default_factory=list)
    """``(tensor, start, count)`` of each piece in the stream, in file order."""
    tensors: dict[str, dict] = field(default_factory=dict)
    """Every tensor of the checkpoint: ``{name: {"shape", "dtype", "rule"[, "replica"]}}``
    (``tensor_table``; rank 0 records it)."""
    mesh: dict[str, Any] | None = None
    """The DTensors' device mesh (``statedict.mesh_record``; rank 0 records it), or None."""
    state_plain: dict[str, Any] = field(default_factory=dict)
    small: dict[str, torch.Tensor] = field(default_factory=dict)
    """Small tensors referenced by ``state_plain`` (rank 0 writes them)."""
    model_config: str | None = None
    lineage: dict[str, Any] = field(default_factory=dict)
    """The run identity every manifest and local marker carries: ``{"lineage", "parent"}``."""
    strategy: str = ""
    stall_s: float = 0.0
    local: bool = False
    """Written to the node-local tier."""
    submitted: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    write_s: float = 0.0
    nbytes: int = 0
    received_bytes: int = 0
    """Pickled bytes this rank received in the save's object collectives."""
    cancel: Cancel = field(default_factory=Cancel)
    """This save's own stop: ``cancel.cancel()`` ends its storage retries (a newer save replaces
    it, or a stop signal's grace period is spent); the store's policy stays usable for the next."""
    resume_replicas: Callable[[], None] | None = None
    """Called when the write ends: the peer replicas' copies paused for this save (from its host
    copy on) go on (``Replicator.pause``)."""
    files_written: int = 0
    """Storage operations of this save that completed (a step cleared, a sidecar, a small file...)."""
    wrote_at: float = 0.0
    """When (monotonic) the last of them completed (0: none yet)."""
    progress_seen: int = -1
    """``progress`` when the step loop last asked about this save (``Checkpointer._settle``; -1: never)."""
    save_id: str = ""
    """This save's identity (``new_save_id``, made by rank 0 in the writer thread and broadcast at
    the save's opening): in the manifest, every sidecar, every local marker and so every replica."""


def progress(job: SaveJob) -> int:
    """How far ``job`` has got with the storage: its completed operations plus the bytes of its
    piece file the writer took beyond any earlier try's. ``Checkpointer._settle`` cancels a save
    that is retrying only when this stood still on every rank (a slow storage that is working
    finishes its save)."""
    return job.files_written + (job.stream.taken_bytes if job.stream is not None else 0)


def wrote_one(job: SaveJob) -> None:
    """Count one completed storage operation of ``job`` (its progress, and when)."""
    job.files_written += 1
    job.wrote_at = time.monotonic()


def progressed_at(job: SaveJob) -> float:
    """When (monotonic) ``job`` last made progress: an operation completed or piece bytes taken
    (its creation until either)."""
    taken = job.stream.taken_at if job.stream is not None else 0.0
    return max(job.submitted, job.wrote_at, taken)


def new_save_id() -> str:
    """A new save's id: rank 0's clock (ns, 16 hex digits) then 16 random hex digits, so ids are
    unique and a later save of the same step sorts after an earlier one (a replica restore that
    finds two saves of one step whole takes the later: ``replicas.plan_sources``)."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


class CheckpointWriter:
    """One rank's background writer: its gloo group, its thread, and the write protocol."""

    def __init__(self, store, cfg: CkptSection, ctx: DistContext, local: bool = False,
                 still_owned: Callable[[], str | None] = lambda: None, lineage: str | None = None) -> None:
        """Every rank constructs one, at the same point (the local tier creates its gloo group
        collectively here; the durable tier's is made by ``side_group``); ``local``: the node-local tier (see the module docstring). ``still_owned`` (rank 0): None
        while this job still holds the run, else why not: asked just before the commit, so a job
        that lost its run never commits or prunes in it. ``lineage``: retention keeps its hands
        off other runs' checkpoints."""
        self.still_owned = still_owned
        self.lineage = lineage
        self.store = store
        self.tidy = layout.Housekeeping()
        """This writer's best-effort deletes and pointer writes (each refusal said once)."""
        self.local = local
        self.tier = "local" if local else "durable"
        self.cfg = cfg
        self.ctx = ctx
        self.group = None
        """The save's gloo group (None: one rank, or not made yet: ``side_group``)."""
        self._group_due = ctx.initialized and ctx.world_size > 1 and dist.is_initialized()
        if local:
            self.side_group()
        self.ring = replicas.Ring((), ())
        """Where this rank's local pieces are replicated (``podtrain.ckpt.replicas``)."""
        self.looked_after = [ctx.rank]
        """The ranks whose files of a local step this rank clears and prunes on its node."""
        self.replicator: Replicator | None = None
        if local and self.group is not None:
            # Every rank's host name, gathered once: the placement is by host, and the same list on
            # every rank makes every rank decide alike whether the replicator's group exists.
            hosts = ctx.all_gather_object(ctx.env.hostname)
            self.ring = self._ring(hosts)
            self.looked_after = replicas.looked_after(hosts, ctx.rank, cfg.local_replicas)
            if len(replicas.unreplicated(hosts, cfg.local_replicas)) < len(hosts):  # agreed: one list
                self.replicator = Replicator(store, self.ring, ctx.rank, ctx.env.hostname, ctx.is_main,
                                             CKPT_GROUP_TIMEOUT_S, lambda step_name: replicas.drop_incomplete(
                                                 store, step_name, self.ring.sources))
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.last_save: dict[str, float] = {}
        """Timings of the last finished save: step, stall_s, write_s, bytes."""

    def _ring(self, hosts: list[str]) -> replicas.Ring:
        """This rank's replica ring of ``ckpt.local_replicas`` over the job's nodes, by host name
        (``hosts``: every rank's; said once, on rank 0)."""
        k = self.cfg.local_replicas
        ring = replicas.Ring.over_hosts(hosts, self.ctx.rank, k)
        if self.ctx.is_main and k > 0:
            nodes, alone = len(replicas.nodes_of(hosts)), replicas.unreplicated(hosts, k)
            if nodes == 1:
                log.info("ckpt.local_replicas=%d: one node, no peer replicas (a lost node loses its "
                         "local checkpoints; restarts read ckpt.dir)", k)
            elif len(alone) < len(hosts):
                log.info("local checkpoints are replicated to up to %d other node(s) (ckpt.local_replicas=%d, "
                         "a ring over %d nodes by host name)", min(k, nodes - 1), k, nodes)
            if alone and nodes > 1:
                log.warning("ckpt.local_replicas=%d: the nodes run different numbers of ranks; rank(s) %s "
                            "have no rank at their position on another node: their local pieces are not "
                            "replicated (a loss of their node restores from ckpt.dir)", k,
                            ", ".join(map(str, alone)))
        return ring

    def side_group(self):
        """This writer's gloo group, made at its first call (None with one rank). Collective: every
        rank calls it at the same point of the main thread (a save's submit, a restore's load),
        never the writer thread, so group creations keep one order on every rank."""
        if self._group_due:
            self._group_due = False
            self.group = new_side_group(CKPT_GROUP_TIMEOUT_S)
        return self.group

    def submit(self, job: SaveJob) -> None:
        """Queue ``job`` for the background thread (started on first use); ``job.done`` tells.
        Every rank submits the same saves in the same order (its group is made at the first)."""
        self.side_group()
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="podtrain-ckpt", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread after the queued jobs, release the group (never raises for the group).

        ``timeout`` (a stop signal's grace period): the most seconds to wait, replicas included. A
        thread still writing then (a storage that never answers) is left to finish alone: it is a
        daemon, so it ends with the process, and its group is not released under it (a collective
        in flight on a destroyed group can crash). False then, True when everything stopped."""
        deadline = None if timeout is None else Deadline.after(timeout)
        stopped = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(None if deadline is None else deadline.remaining())
            if self._thread.is_alive():
                log.warning("the %s checkpoint writer on rank %d is still writing after %.1f s: left to "
                            "finish alone (nothing of its save commits after the job ends)", self.tier,
                            self.ctx.rank, timeout)
                stopped = False
            else:
                self._thread = None
        if stopped:
            release_side_group(self.group, "checkpoint")
            self.group, self._group_due = None, False
        if self.replicator is not None:  # its copies' thread: stopped, or left to end alone (False)
            stopped = self.replicator.close(timeout=None if deadline is None else deadline.remaining()) and stopped
        return stopped

    # -- background thread ---------------------------------------------------------------------
    def _worker(self) -> None:
        while (job := self._queue.get()) is not None:
            t0 = time.perf_counter()
            try:
                with cancellation(job.cancel):  # this save's storage retries end when it is cancelled
                    self._write(job)
            except BaseException as exc:  # surfaced to the step loop by Checkpointer.failed/wait
                job.error = exc
            finally:
                if job.resume_replicas is not None:  # the replicas' copies gave way to this save
                    job.resume_replicas()
            job.write_s = time.perf_counter() - t0
            if job.error is None:
                self.last_save = {"step": job.step, "stall_s": job.stall_s, "write_s": job.write_s,
                                  "bytes": job.nbytes, "received_bytes": job.received_bytes}
                if self.ctx.is_main:
                    mb = job.nbytes / 1e6
                    log.info("checkpoint step %d %s: %.1f MB written by %d rank(s) in %.2f s "
                             "(%.0f MB/s); the step loop stalled %.3f s", job.step, self.tier, mb,
                             self.ctx.world_size, job.write_s, mb / max(job.write_s, 1e-9), job.stall_s)
            job.done.set()

    def _write(self, job: SaveJob) -> None:
        """The save's phases in order (``PHASES``; the module docstring says who runs each)."""
        name = layout.step_name(job.step)
        try:
            # prepare
            if self.local:  # nobody sees the whole tier: each rank clears its own files
                # (and the replicas it holds of it: an earlier save's, gone before this save's files appear)
                errors = self._gather(self._outcome("prepare", replicas.drop, self.store, name, self.looked_after), job)
                error = self._opening(job, next((e for e in errors if e), None) if self.ctx.is_main else None)
            else:
                error = self._opening(job, self._outcome("prepare", self._prepare, name) if self.ctx.is_main else None)
            # write
            out: dict[str, Any] = {}
            if error is None:
                wrote_one(job)  # the step is cleared: the storage answered
                error = self._outcome("write", self._write_own, job, name, out)
            if error is None and self.local:
                error = self._outcome("commit", local_tier.write_marker, self.store, name, self.ctx.rank,
                                      self.ctx.world_size, out.get("record"), job.lineage.get("lineage"), job.save_id)
            # commit, then publish and retain (rank 0; the durable tier), or undo
            reports = self._gather((error, out.get("sizes")), job)
            if self.ctx.is_main:
                error = next((e for e, _ in reports if e), None)
                if error is None:
                    error = self._outcome("commit", self._commit, job, name, [r for _, r in reports])
                if not self.local and error is None:
                    try:  # rank 0 must reach the broadcast that follows whatever happens here, or every rank waits
                        if self._publish(name):  # retention waits for a published checkpoint
                            self._retain(job.step)
                    except Exception:  # a checkpoint retention cannot read (an unsafe or old-format one)
                        log.exception("retention after %s failed; the checkpoint is committed and training goes on",
                                      name)
                elif not self.local and error[0] != "lease":  # another job's run now: its step, not ours
                    with cancellation(None):  # a cancelled save's files go too (its own retries ended)
                        self.tidy.remove(self.store, name)  # no half-written checkpoint stays (best effort)
            error = self._broadcast(error, job)
            if self.local and error is not None:
                with cancellation(None):  # as above: a cancelled save's local files go too
                    self._outcome("undo", local_tier.clear, self.store, name, self.ctx.rank)  # best effort
            elif self.local:  # the local tier's publish (its replicas) and retain
                if self.replicator is not None:
                    self.replicator.committed(job.step)
                local_tier.prune(self.store, self.ctx.rank, job.step, self.cfg.local_keep, self.looked_after,
                                 replicas.drop, self.replicator.protected() if self.replicator is not None else ())
            if error is not None:
                kind, message = error
                cls = {"transient": SaveAbandoned, "user": SaveFailed, "lease": SaveFailed}.get(kind, RuntimeError)
                raise cls(f"{self.tier} checkpoint of step {job.step} failed at its {message}")
        finally:
            if job.stream is not None:  # a step loop still staging must not wait for us any more
                job.stream.close("the checkpoint writer stopped before taking every tensor")

    def _outcome(self, phase: str, fn, *args) -> tuple[str, str] | None:
        """None when ``fn(*args)`` succeeds, else ``(kind, one line naming the phase and the rank)``:
        kind is "transient" (a storage fault worth trying again later), "user" (no space,
        permissions: the user's to fix), "lease" or "bug"."""
        try:
            fn(*args)
            return None
        except Exception as exc:
            kind = ("transient" if isinstance(exc, Transient) else "lease" if isinstance(exc, RunTakenOver) else
                    "user" if isinstance(exc, (OSError, UserError)) else "bug")  # storage errors are UserErrors
            if kind == "bug":
                log.exception("checkpoint writer on rank %d failed", self.ctx.rank)
            return kind, f"{phase} (rank {self.ctx.rank} on {self.ctx.env.hostname}): {type(exc).__name__}: {exc}"

    def _prepare(self, name: str) -> None:
        """Rank 0, before any rank writes (its outcome is broadcast; no rank writes after an
        error): this job still holds the run, and the step's directory holds no earlier save.

        The lease is re-read here and not only at the commit: a job whose lease was taken over (a
        partition longer than ``ckpt.lease_timeout_s``) must not delete or overwrite the new
        holder's step. An earlier timeline's save of this step (a rollback) or a killed save is
        removed, its manifest first; when the storage refuses to delete that manifest (a bucket
        without ``s3:DeleteObject``), the step cannot be written in place without a moment where
        an old manifest names new files, so this save is skipped (a transient outcome: training
        goes on, the next due step is another directory). A step directory that is empty costs one
        listing and no delete at all."""
        lost = self.still_owned()
        if lost is not None:
            raise RunTakenOver(f"not written: {lost} (another job owns this run now)")
        if not self.store.list(name + "/"):
            return
        if not self.tidy.remove(self.store, name):
            raise Transient(self.store.where(name), "an earlier save of this step is there and its manifest "
                            "cannot be deleted (see the warning above): this step is not saved")

    def _write_own(self, job: SaveJob, name: str, out: dict) -> None:
        """This rank's piece file (when it holds pieces), streamed from the staging slabs, block
        CRCs in the same pass, sent again whole after a transient failure within the store's retry
        budget (``SaveStream.replay`` says where its bytes come from again); then its sidecar
        (always: it carries the rank's RNG states)."""
        rel, nbytes, pieces = None, 0, []
        if job.stream is not None:
            rel, stream = layout.rank_file(self.ctx.rank), job.stream
            path, writers = f"{name}/{rel}", []

            def fill(fh):
                # Every try from the file's first byte: a multipart upload that lost a part is
                # aborted, and one rank's failed part must not abandon the whole save (the chance
                # of one grows with the world size). ``chunks`` replays the kept slabs, or has the
                # step loop stage them again (staging: the rule, within the staging budget).
                writers.append(fh)
                return write_pieces(fh, stream.specs[rel], stream.chunks(rel),
                                    {"format": "pt", "podtrain": __version__})

            try:
                if stream.replayable:
                    head, crcs, nbytes = self.store.write_replayable(path, fill)
                else:
                    with self.store.open_write(path) as fh:
                        head, crcs, nbytes = fill(fh)
            except StagingTimedOut as exc:  # the step loop stopped waiting for the storage to take them
                raise Transient(self.store.where(path), str(exc)) from None
            except NotReplayable as exc:  # the bytes did not outlive the failure: a transient fault still
                failed = getattr(writers[-2], "error", None) if len(writers) > 1 else None
                raise Transient(self.store.where(path), f"{failed.cause if failed else 'the write failed'}; "
                                                        f"{exc}") from None
            finally:
                stream.done_with(rel)  # its slabs back to the pool; a step loop holding them goes on
            wrote_one(job)
            offset = head
            for (tensor, start, count), spec, piece_crcs in zip(job.pieces, job.stream.specs[rel], crcs):
                pieces.append(Piece(tensor, start, count, rel, offset, tuple(piece_crcs)).to_json())
                offset += spec.nbytes
        meta = sidecar.encode(rel, nbytes, pieces, job.rng, job.save_id)
        self.store.write_bytes(f"{name}/{sidecar.sidecar(self.ctx.rank)}", meta)
        wrote_one(job)
        out["record"] = (rel, {"bytes": nbytes}) if rel else None
        out["sizes"] = (nbytes if rel else None, len(meta))

    def _commit(self, job: SaveJob, name: str, sizes: list) -> None:
        """Rank 0: the small files, then the manifest (the commit)."""
        small = dict(job.small)
        state = {"step": job.step, **job.state_plain}
        blobs = {layout.STATE_FILE: encode_small({k: v.detach().cpu().contiguous() for k, v in small.items()}),
                 layout.STATE_JSON: json.dumps(state, indent=1).encode()}
        if job.model_config is not None:
            blobs[layout.CONFIG_JSON] = job.model_config.encode()
        lost = self.still_owned()  # again: the writes took time, and the manifest is what counts
        if lost is not None:
            raise RunTakenOver(f"not committed: {lost} (another job owns this run now)")
        files: dict[str, dict] = {}
        for rel, data in blobs.items():
            self.store.write_bytes(f"{name}/{rel}", data)
            wrote_one(job)
            files[rel] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        piece_files = [b for b, _ in sizes if b is not None]
        ranks = {"sidecars": len(sizes), "sidecar_bytes": sum(m for _, m in sizes),
                 "piece_files": len(piece_files), "piece_bytes": sum(piece_files)}
        manifest = {"format": layout.FORMAT, "step": job.step, "save_id": job.save_id, "version": __version__, **job.lineage,
                    "world_size": self.ctx.world_size, "strategy": job.strategy, "created": time.time(),
                    "mesh": job.mesh, "tensors": job.tensors, "files": files, "ranks": ranks}
        self.store.write_bytes(f"{name}/{layout.MANIFEST}", layout.sealed_manifest(manifest))
        job.nbytes = sum(r["bytes"] for r in files.values()) + ranks["piece_bytes"] + ranks["sidecar_bytes"]

    def _publish(self, name: str) -> bool:
        """Rank 0, after the commit: point ``latest`` at it; False when the storage refused (a
        warning, ``layout.Housekeeping``; the next save tries again). Never fails the save: it is
        committed, and failing it now would delete the only copy."""
        return self.tidy.attempt(self.store, f"point {layout.LATEST} at {name}", layout.write_latest, self.store, name)

    def _retain(self, step: int) -> None:
        """Rank 0, once ``latest`` names checkpoint ``step``: retention (``layout.apply_retention``),
        so an older checkpoint is never deleted before a newer one is committed and published. It
        cannot fail the save (a refused delete is a warning)."""
        self.tidy.attempt(self.store, f"apply retention after {layout.step_name(step)}", layout.apply_retention,
                          self.store, step, self.cfg.keep_last, self.cfg.keep_every, self.lineage, self.tidy)

    def _opening(self, job: SaveJob, error: tuple[str, str] | None) -> tuple[str, str] | None:
        """Every rank: rank 0's verdict on the save's first phase (``error``, rank 0's), broadcast
        with the save's id, which rank 0 makes: no collective of its own for it."""
        error, job.save_id = self._broadcast((error, new_save_id()) if self.ctx.is_main else None, job)
        return error

    def _gather(self, obj: Any, job: SaveJob) -> list[Any]:
        """Every rank sends ``obj`` to rank 0 alone; rank 0 gets the list (others: []).

        Not ``dist.gather_object``: torch's all_gathers every rank's object size to every rank
        first (8 bytes x world per rank per save). Here the sizes go to rank 0 alone (a tensor
        gather), then each rank sends its pickled bytes to rank 0 point to point: O(1) per rank."""
        if self.group is None:
            return [obj]
        data = pickle.dumps(obj)
        world, is_main = self.ctx.world_size, self.ctx.is_main
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)] if is_main else None
        dist.gather(size, sizes, dst=0, group=self.group)
        if not is_main:
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=self.group)
            return []
        bufs = {r: torch.empty(int(sizes[r][0]), dtype=torch.uint8) for r in range(1, world)}
        for req in [dist.irecv(buf, src=r, group=self.group) for r, buf in bufs.items()]:
            req.wait()
        job.received_bytes += sum(buf.numel() for buf in bufs.values())
        return [obj] + [pickle.loads(bufs[r].numpy().tobytes()) for r in range(1, world)]

    def _broadcast(self, obj: Any, job: SaveJob | None = None) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        if job is not None and not self.ctx.is_main:
            job.received_bytes += len(pickle.dumps(box[0]))
        return box[0]


