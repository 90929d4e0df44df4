"""Writing checkpoints in the background: the writer thread and the collectives and files of a save.

The step loop hands a ``SaveJob`` to ``CheckpointWriter.submit``; one background thread per rank
then runs the save's collectives, in a fixed order, on a gloo group of its own (created by every
rank in ``__init__``), so they never interleave with the main thread's collectives:

1. rank 0 clears the step's directory (an earlier timeline's, or a killed save's) and says so;
2. every rank holding pieces writes its own file (``layout.rank_file``) in parallel, streaming
   the bytes from the step loop's host copies (``podtrain.ckpt.staging``) and computing the block
   CRC-32s in the same pass; the file appears only complete (the store's atomic ``open_write``);
   then every rank writes its sidecar (``podtrain.ckpt.sidecar``: its pieces' table, its file's
   size, its RNG states), which only it (or a resume needing its pieces) ever reads;
3. rank 0 alone gathers each rank's outcome and byte counts (``_gather``: sizes, then bytes point to point; O(1) per rank,
   nothing per rank goes to every rank);
4. rank 0 writes the small files, then ``manifest.json`` (the commit: O(tensors), one rule per
   tensor, a count and a total of the ranks' files), then ``latest``, applies retention, and
   broadcasts the result. On any failure it removes the step's directory, so the last good
   checkpoint stays the newest, and every rank's job carries the same error.

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
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from podtrain import __version__
from podtrain.ckpt import layout, local_tier, replicas, sidecar
from podtrain.ckpt.plan import Piece
from podtrain.ckpt.replicator import Replicator
from podtrain.ckpt.staging import SaveStream
from podtrain.ckpt.statedict import replica_groups, split_rule
from podtrain.ckpt.tensorio import DTYPE_NAMES, encode_small, write_pieces
from podtrain.config_sections import CkptSection
from podtrain.distributed.group import DistContext
from podtrain.distributed.side_group import new_side_group, release_side_group
from podtrain.errors import UserError
from podtrain.storage.errors import Transient

log = logging.getLogger("podtrain.checkpoint")

# The background group waits while others write; a multi-GB share on a slow shared file system
# can take many minutes, far longer than a training collective should.
CKPT_GROUP_TIMEOUT_S = 3600.0


class SaveFailed(UserError):
    """A checkpoint could not be written (no space, read-only storage...): every rank raises it."""


class SaveAbandoned(SaveFailed):
    """A save failed on a transient storage fault (throttling, 5xx, a dropped connection) once
    the store's retries were spent, or was abandoned: nothing of it is committed, and the run goes
    on (the next save tries again; ``ckpt.max_outage_s`` bounds how long)."""


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
    resume_replicas: Callable[[], None] | None = None
    """Called when the write ends: the peer replicas' copies paused for this save (from its host
    copy on) go on (``Replicator.pause``)."""


class CheckpointWriter:
    """One rank's background writer: its gloo group, its thread, and the write protocol."""

    def __init__(self, store, cfg: CkptSection, ctx: DistContext, local: bool = False,
                 still_owned: Callable[[], str | None] = lambda: None, lineage: str | None = None) -> None:
        """Every rank constructs one (it creates the background gloo group collectively);
        ``local``: the node-local tier (see the module docstring). ``still_owned`` (rank 0): None
        while this job still holds the run, else why not: asked just before the commit, so a job
        that lost its run never commits or prunes in it. ``lineage``: retention keeps its hands
        off other runs' checkpoints."""
        self.still_owned = still_owned
        self.lineage = lineage
        self.store = store
        self.local = local
        self.tier = "local" if local else "durable"
        self.cfg = cfg
        self.ctx = ctx
        self.group = None
        if ctx.initialized and ctx.world_size > 1 and dist.is_initialized():
            self.group = new_side_group(CKPT_GROUP_TIMEOUT_S)
        self.ring = replicas.Ring((), ())
        """Where this rank's local pieces are replicated (``podtrain.ckpt.replicas``)."""
        self.replicator: Replicator | None = None
        if local and self.group is not None:
            self.ring = self._ring()
            if self.ring.targets:  # the same on every rank (_ring): the group is made collectively
                self.replicator = Replicator(store, self.ring, ctx.rank, ctx.env.hostname, ctx.is_main,
                                             CKPT_GROUP_TIMEOUT_S, lambda step_name: replicas.drop_incomplete(
                                                 store, step_name, self.ring.sources))
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.last_save: dict[str, float] = {}
        """Timings of the last finished save: step, stall_s, write_s, bytes."""

    def _ring(self) -> replicas.Ring:
        """The replica ring of ``ckpt.local_replicas`` over this job's nodes (said once, on rank 0)."""
        env, k = self.ctx.env, self.cfg.local_replicas
        nodes, per_node = env.num_nodes, env.local_world_size
        if k > 0 and nodes * per_node != self.ctx.world_size:
            if self.ctx.is_main:
                log.warning("ckpt.local_replicas=%d: the nodes run different numbers of ranks (%d ranks, "
                            "%d per node on this one): no peer replicas", k, self.ctx.world_size, per_node)
            return replicas.Ring((), ())
        ring = replicas.Ring.of(env.node_rank, nodes, env.local_rank, per_node, k)
        if self.ctx.is_main and k > 0:
            if ring.targets:
                log.info("local checkpoints are replicated to %d other node(s) (ckpt.local_replicas=%d, "
                         "a ring over %d nodes)", len(ring.targets), k, nodes)
            else:
                log.info("ckpt.local_replicas=%d: one node, no peer replicas (a lost node loses its "
                         "local checkpoints; restarts read ckpt.dir)", k)
        return ring

    def submit(self, job: SaveJob) -> None:
        """Queue ``job`` for the background thread (started on first use); ``job.done`` tells."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="podtrain-ckpt", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def close(self) -> None:
        """Stop the thread after the queued jobs, release the group (never raises for the group)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self.replicator is not None:
            self.replicator.close()
        release_side_group(self.group, "checkpoint")
        self.group = None

    # -- background thread ---------------------------------------------------------------------
    def _worker(self) -> None:
        while (job := self._queue.get()) is not None:
            t0 = time.perf_counter()
            try:
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
        try:
            self._write_collectively(job)
        finally:
            if job.stream is not None:  # a step loop still staging must not wait for us any more
                job.stream.close("the checkpoint writer stopped before taking every tensor")

    def _write_collectively(self, job: SaveJob) -> None:
        name = layout.step_name(job.step)
        if self.local:  # nobody sees the whole tier: each rank clears its own files
            error = self._first_error(job, self._outcome(local_tier.clear, self.store, name, self.ctx.rank))
        else:
            error = self._broadcast(self._outcome(self._prepare, name) if self.ctx.is_main else None, job)
        out: dict[str, Any] = {}
        if error is None:
            error = self._outcome(self._write_own, job, name, out)
        if error is None and self.local:
            error = self._outcome(local_tier.write_marker, self.store, name, self.ctx.rank,
                                  self.ctx.world_size, out.get("record"), job.lineage.get("lineage"))
        reports = self._gather((error, out.get("sizes")), job)
        if self.ctx.is_main:
            error = next((e for e, _ in reports if e), None)
            if error is None:
                error = self._outcome(self._commit, job, name, [r for _, r in reports])
            if error is not None and not self.local:
                self._outcome(layout.remove, self.store, name)  # no half-written checkpoint stays
        error = self._broadcast(error, job)
        if self.local:
            if error is not None:
                self._outcome(local_tier.clear, self.store, name, self.ctx.rank)
            else:
                if self.replicator is not None:
                    self.replicator.committed(job.step)
                env = self.ctx.env
                local_tier.prune(self.store, self.ctx.rank, job.step, self.cfg.local_keep, replicas.slot_owners(
                    env.local_rank, env.local_world_size, self.ctx.world_size), replicas.drop,
                    protect_from=self.replicator.protect_from if self.replicator is not None else None)
        if error is not None:
            kind, message = error
            cls = {"transient": SaveAbandoned, "user": SaveFailed}.get(kind, RuntimeError)
            raise cls(f"{self.tier} checkpoint of step {job.step} failed: {message}")

    def _outcome(self, fn, *args) -> tuple[str, str] | None:
        """None when ``fn(*args)`` succeeds, else ``(kind, one line naming the rank)``: kind is
        "transient" (a storage fault worth trying again later), "user" (no space, permissions:
        the user's to fix) or "bug"."""
        try:
            fn(*args)
            return None
        except Exception as exc:
            kind = ("transient" if isinstance(exc, Transient) else
                    "user" if isinstance(exc, (OSError, UserError)) else "bug")  # storage errors are UserErrors
            if kind == "bug":
                log.exception("checkpoint writer on rank %d failed", self.ctx.rank)
            return kind, f"rank {self.ctx.rank} on {self.ctx.env.hostname}: {type(exc).__name__}: {exc}"

    def _prepare(self, name: str) -> None:
        # The same step saved by an earlier timeline, or a killed save: gone before anyone writes.
        layout.remove(self.store, name)

    def _write_own(self, job: SaveJob, name: str, out: dict) -> None:
        """This rank's piece file (when it holds pieces), streamed from the staging slabs, block
        CRCs in the same pass; then its sidecar (always: it carries the rank's RNG states)."""
        rel, nbytes, pieces = None, 0, []
        if job.stream is not None:
            rel = layout.rank_file(self.ctx.rank)
            with self.store.open_write(f"{name}/{rel}") as fh:
                head, crcs, nbytes = write_pieces(fh, job.stream.specs[rel], job.stream.chunks(rel),
                                                  {"format": "pt", "podtrain": __version__})
            offset = head
            for (tensor, start, count), spec, piece_crcs in zip(job.pieces, job.stream.specs[rel], crcs):
                pieces.append(Piece(tensor, start, count, rel, offset, tuple(piece_crcs)).to_json())
                offset += spec.nbytes
        meta = sidecar.encode(rel, nbytes, pieces, job.rng)
        self.store.write_bytes(f"{name}/{sidecar.sidecar(self.ctx.rank)}", meta)
        out["record"] = (rel, {"bytes": nbytes}) if rel else None
        out["sizes"] = (nbytes if rel else None, len(meta))

    def _commit(self, job: SaveJob, name: str, sizes: list) -> None:
        """Rank 0: the small files, the manifest (the commit), ``latest``, retention."""
        small = dict(job.small)
        state = {"step": job.step, **job.state_plain}
        blobs = {layout.STATE_FILE: encode_small({k: v.detach().cpu().contiguous() for k, v in small.items()}),
                 layout.STATE_JSON: json.dumps(state, indent=1).encode()}
        if job.model_config is not None:
            blobs[layout.CONFIG_JSON] = job.model_config.encode()
        lost = self.still_owned()
        if lost is not None:
            raise UserError(f"not committed: {lost} (another job owns this run now)")
        files: dict[str, dict] = {}
        for rel, data in blobs.items():
            self.store.write_bytes(f"{name}/{rel}", data)
            files[rel] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        piece_files = [b for b, _ in sizes if b is not None]
        ranks = {"sidecars": len(sizes), "sidecar_bytes": sum(m for _, m in sizes),
                 "piece_files": len(piece_files), "piece_bytes": sum(piece_files)}
        manifest = {"format": layout.FORMAT, "step": job.step, "version": __version__, **job.lineage,
                    "world_size": self.ctx.world_size, "strategy": job.strategy, "created": time.time(),
                    "mesh": job.mesh, "tensors": job.tensors, "files": files, "ranks": ranks}
        self.store.write_bytes(f"{name}/{layout.MANIFEST}", json.dumps(manifest, separators=(",", ":")).encode())
        job.nbytes = sum(r["bytes"] for r in files.values()) + ranks["piece_bytes"] + ranks["sidecar_bytes"]
        if not self.local:  # the local tier: every rank prunes its own files (above)
            layout.write_latest(self.store, name)
            layout.apply_retention(self.store, job.step, self.cfg.keep_last, self.cfg.keep_every, self.lineage)

    def _first_error(self, job: SaveJob, error: tuple[str, str] | None) -> tuple[str, str] | None:
        """Every rank: the first rank's error of a step every rank ran (rank 0 gathers, broadcasts)."""
        errors = self._gather(error, job)
        return self._broadcast(next((e for e in errors if e), None) if self.ctx.is_main else None, job)

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


def tensor_table(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """``{name: {"shape": [...], "dtype": "F32", "rule": ...}}`` of the whole tensors (DTensors:
    global shape), with how each is split over the ranks that write it (``statedict.split_rule``)."""
    groups = replica_groups(tensors)
    return {n: {"shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype], **split_rule(t, groups.get(n, 0))}
            for n, t in tensors.items()}
