"""Writing checkpoints in the background: the writer thread and the collectives and files of a save.

The step loop hands a ``SaveJob`` (host copies of what this rank contributes) to
``CheckpointWriter.submit``; one background thread per rank then runs the save's collectives, in a
fixed order, on a gloo group of its own (created collectively by every rank in ``__init__``), so
they never interleave with the main thread's collectives on the default group.

* ``format=safetensors``: every rank sends its RNG states to global rank 0, which alone writes
  ``model.safetensors`` and ``state.safetensors`` and tells the others whether it succeeded.
* ``format=dcp``: the tensors are dealt out to the ranks (``plan_files``: largest first, to the
  rank with the fewest bytes so far); each rank stages and writes only its share, as one shard in
  the layout of ``torch.distributed.checkpoint``'s ``HuggingFaceStorageWriter`` (so ``dcp.load``
  with ``HuggingFaceStorageReader`` reads it too; no pickled metadata), and sends rank 0 the
  shard's size and SHA-256, computed while writing.
* FSDP/HSDP runs (``SaveJob.layout`` = ``sharded``): the same, but each rank's shard holds its own
  pieces of the DTensors, their offsets in the header (``podtrain.ckpt.sharded``).

The tensor bytes arrive through the job's ``SaveStream`` (``podtrain.ckpt.staging``), slab by
slab, while the step loop is still copying: host memory for a save stays within
``ckpt.host_staging_mb``.

Either way rank 0 finishes: it writes the JSON files into a temporary directory, ``manifest.json``
(size and SHA-256 of every file) last, fsyncs, renames the directory into place, then updates
``latest`` and applies retention (``layout.apply_retention``).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from podtrain import __version__
from podtrain.ckpt import layout
from podtrain.ckpt.staging import SaveStream
from podtrain.ckpt.state import to_plain
from podtrain.ckpt.tensorio import (FileRecord, TensorSpec, spec_of, tensor_chunks, write_json,
                                    write_safetensors, write_safetensors_stream)
from podtrain.config_sections import CkptSection
from podtrain.distributed.group import DistContext
from podtrain.fsutil import atomic_write_text, fsync_dir

# The package's one logger name, whichever module logs (users filter on it).
log = logging.getLogger("podtrain.checkpoint")

# The background group waits while rank 0 writes; a multi-GB checkpoint on a slow shared file
# system can take many minutes, far longer than a training collective should.
CKPT_GROUP_TIMEOUT_S = 3600.0
# What torch's HuggingFaceStorageWriter writes into each shard's header (torch/distributed/
# checkpoint/_hf_utils.py), so that HuggingFaceStorageReader can read podtrain's shards.
DCP_SHARDING_INFO, DCP_VERSION = "DCP_SHARDING_INFO", "1.0"

TensorItems = list[tuple[str, torch.Tensor]]


@dataclass
class SaveJob:
    """One save, as handed from the step loop to the background thread."""

    step: int
    rng: dict[str, Any]
    stream: SaveStream | None = None
    """The tensors this rank writes, by file (None: it writes none)."""
    aliases: dict[str, str] = field(default_factory=dict)
    state_plain: dict[str, Any] = field(default_factory=dict)
    model_config: str | None = None
    layout: str | None = None
    """``layout.SHARDED`` for an FSDP/HSDP run's pieces (written like format=dcp); None: ckpt.format."""
    offsets: dict[str, list[int]] = field(default_factory=dict)
    """Each piece's offset in its whole tensor (sharded layout; whole tensors: none)."""
    stall_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    write_s: float = 0.0
    nbytes: int = 0


def dcp_shard_name(rank: int) -> str:
    """The file (under ``dcp/``) holding ``rank``'s share: HuggingFaceStorageWriter's name for it."""
    return f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"


def plan_files(fmt: str, rank: int, world_size: int, model: TensorItems, state: TensorItems) -> dict[str, TensorItems]:
    """Which files this rank writes, and the ``(name, tensor)``s of each, in file order.

    safetensors: rank 0 writes the model and the state file, the others nothing. dcp: every
    tensor goes to one rank (largest first, to the rank with the fewest bytes so far; every rank
    computes the same deal from the same names and sizes), so each rank stages only its share.
    """
    if fmt != "dcp":
        return {layout.MODEL_FILE: model, layout.STATE_FILE: state} if rank == 0 else {}
    items = [(f"model/{k}", t) for k, t in model] + [(f"state/{k}", t) for k, t in state]
    load = [0] * world_size
    owner: dict[str, int] = {}
    for name, t in sorted(items, key=lambda it: -it[1].numel() * it[1].element_size()):
        owner[name] = min(range(world_size), key=lambda r: (load[r], r))
        load[owner[name]] += t.numel() * t.element_size()
    mine = [(name, t) for name, t in items if owner[name] == rank]
    return {f"{layout.DCP_SUBDIR}/{dcp_shard_name(rank)}": mine} if mine else {}


def dcp_shard_metadata(specs: list[TensorSpec], offsets: dict[str, list[int]] | None = None) -> dict[str, str]:
    """A shard's safetensors metadata as HuggingFaceStorageWriter writes it: where each stored
    piece starts in its whole tensor (``offsets``; whole tensors start at 0)."""
    offsets = offsets or {}
    sharding = {s.name: {"saved_offsets": offsets.get(s.name, [0] * len(s.shape))} for s in specs}
    return {DCP_SHARDING_INFO: json.dumps(sharding), "DCP_VERSION": DCP_VERSION, "format": "pt"}


class CheckpointWriter:
    """One rank's background writer: its gloo group, its thread, and the write paths."""

    def __init__(self, root: Path, cfg: CkptSection, ctx: DistContext) -> None:
        """Every rank constructs one (it creates the background gloo group collectively)."""
        self.root = root
        self.cfg = cfg
        self.ctx = ctx
        self.group = None
        if ctx.initialized and ctx.world_size > 1 and dist.is_initialized():
            self.group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(seconds=CKPT_GROUP_TIMEOUT_S))
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.last_save: dict[str, float] = {}
        """Timings of the last finished save: step, stall_s, write_s, bytes."""

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
        if self.group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except Exception as exc:  # never mask the error that brought us here
                log.debug("destroying the checkpoint group failed: %s", exc)
        self.group = None

    # -- background thread ---------------------------------------------------------------------
    def _worker(self) -> None:
        while (job := self._queue.get()) is not None:
            t0 = time.perf_counter()
            try:
                self._write(job)
            except BaseException as exc:  # surfaced to the step loop by Checkpointer.wait()
                job.error = exc
            job.write_s = time.perf_counter() - t0
            if job.error is None:
                self.last_save = {"step": job.step, "stall_s": job.stall_s, "write_s": job.write_s,
                                  "bytes": job.nbytes}
                if self.ctx.is_main:
                    mb = job.nbytes / 1e6
                    log.info("checkpoint step %d durable: %.1f MB written in %.2f s (%.0f MB/s) "
                             "in the background; the step loop stalled %.3f s", job.step, mb,
                             job.write_s, mb / max(job.write_s, 1e-9), job.stall_s)
            job.done.set()

    def _write(self, job: SaveJob) -> None:
        """Every rank, in the background thread: the collectives of one save, in a fixed order."""
        try:
            self._write_collectively(job)
        finally:
            if job.stream is not None:  # a step loop still staging must not wait for us any more
                job.stream.close("the checkpoint writer stopped before taking every tensor")

    def _write_collectively(self, job: SaveJob) -> None:
        rngs = self._gather(job.rng)
        if self.cfg.format == "dcp" or job.layout == layout.SHARDED:
            self._write_dcp(job, rngs)
            return
        error = None
        if self.ctx.is_main:
            try:
                self._write_rank0(job, rngs)
            except Exception as exc:
                log.exception("writing checkpoint step %d failed", job.step)
                error = f"{type(exc).__name__}: {exc}"
        error = self._broadcast(error)
        if error:
            raise RuntimeError(f"rank 0 could not write it: {error}")

    def _gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _state_json(self, job: SaveJob, rngs: list[dict]) -> tuple[dict, dict[str, torch.Tensor]]:
        """state.json's content and every rank's RNG tensors (the last tensors of the state file)."""
        rng_tensors: dict[str, torch.Tensor] = {}
        sink = rng_tensors.__setitem__
        state = {"step": job.step, "aliases": job.aliases, **job.state_plain,
                 "rng": [to_plain(r, sink, f"rng/{i}") for i, r in enumerate(rngs)]}
        return state, rng_tensors

    def _write_rank0(self, job: SaveJob, rngs: list[dict]) -> None:
        name = layout.step_name(job.step)
        tmp = self.root / f"{layout.TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        state, rng_tensors = self._state_json(job, rngs)
        stream = job.stream
        model = write_safetensors_stream(tmp / layout.MODEL_FILE, stream.specs[layout.MODEL_FILE],
                                         stream.chunks(layout.MODEL_FILE),
                                         {"format": "pt", "podtrain": __version__})
        specs = stream.specs[layout.STATE_FILE] + [spec_of(n, t) for n, t in rng_tensors.items()]
        chunks = itertools.chain(stream.chunks(layout.STATE_FILE), tensor_chunks(rng_tensors.values()))
        files = {layout.MODEL_FILE: model,
                 layout.STATE_FILE: write_safetensors_stream(tmp / layout.STATE_FILE, specs, chunks)}
        self._finish(job, tmp, state, files)

    def _write_dcp(self, job: SaveJob, rngs: list[dict]) -> None:
        """format=dcp: every rank writes its share as one shard, rank 0 finishes the directory."""
        name = layout.step_name(job.step)
        tmp = self.root / f"{layout.TMP_PREFIX}{name}-dcp"  # every rank must know the name
        shards = tmp / layout.DCP_SUBDIR
        error = None
        if self.ctx.is_main:
            try:
                if tmp.exists():
                    layout.remove_tree(tmp)
                shards.mkdir(parents=True)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = self._broadcast(error)
        state, rng_tensors = self._state_json(job, rngs)
        records: dict[str, FileRecord] = {}
        if not error and job.stream is not None:
            try:
                for rel, specs in job.stream.specs.items():
                    records[rel] = write_safetensors_stream(tmp / rel, specs, job.stream.chunks(rel),
                                                            dcp_shard_metadata(specs, job.offsets))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        # Every rank's share is on disk (or someone failed) before rank 0 seals the directory.
        reports = self._gather((error, records))
        error = next((e for e, _ in reports if e), None)
        if self.ctx.is_main and not error:
            try:
                files = {layout.STATE_FILE: write_safetensors(tmp / layout.STATE_FILE, rng_tensors)}
                for _, shard_records in reports:
                    files.update(shard_records)
                fsync_dir(shards)
                self._finish(job, tmp, state, files)
            except Exception as exc:
                log.exception("finishing checkpoint step %d failed", job.step)
                error = f"{type(exc).__name__}: {exc}"
        error = self._broadcast(error)
        if error:
            raise RuntimeError(error)

    def _finish(self, job: SaveJob, tmp: Path, state: dict, files: dict[str, FileRecord]) -> None:
        """Rank 0: JSON files, the manifest last, rename into place, ``latest``, retention."""
        files[layout.STATE_JSON] = write_json(tmp / layout.STATE_JSON, state)
        if job.model_config is not None:
            files[layout.CONFIG_JSON] = write_json(tmp / layout.CONFIG_JSON, json.loads(job.model_config))
        manifest = {"format": layout.FORMAT, "step": job.step, "version": __version__,
                    "layout": job.layout or self.cfg.format, "world_size": self.ctx.world_size,
                    "created": time.time(),
                    "files": {k: {"bytes": r.bytes, "sha256": r.sha256} for k, r in files.items()}}
        write_json(tmp / layout.MANIFEST, manifest)
        fsync_dir(tmp)
        final = self.root / layout.step_name(job.step)
        if final.exists():  # the same step saved by an earlier timeline (resume=never)
            layout.remove_tree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        atomic_write_text(self.root / layout.LATEST, final.name + "\n")
        job.nbytes = sum(r.bytes for r in files.values())
        layout.apply_retention(self.root, job.step, self.cfg.keep_last, self.cfg.keep_every)
