"""Checkpoints: atomic, checksummed, pickle-free, written in the background; auto-resume.

``Checkpointer`` is what the training loop uses::

    ckpt = Checkpointer(run_dir, cfg.ckpt, ctx)          # every rank
    state = ckpt.restore(model, optimizer, scaler)        # every rank; None: start fresh
    ...
    if ckpt.should_save(step, total):
        ckpt.save(step, model, optimizer, scaler, train_state)   # every rank, same step
    ...
    ckpt.close()                                           # every exit path

What a checkpoint holds (``podtrain.ckpt.layout`` shows the files): the unwrapped model weights;
the optimizer state (tensors in safetensors, structure in JSON); the GradScaler state (fp16);
every rank's RNG states (Python, numpy, torch CPU, the rank's GPU); the loop's ``train_state``
(step, tokens seen, loader position, metrics run id, resolved config) plus podtrain's version and
the world size; the transformers model config. Nothing is pickled: a directory holding a pickle
file is refused with a ``UserError`` before any of it is read.

Saving: ``save`` hands the job to the background writer (``podtrain.ckpt.writer``: who writes
which file, with which collectives), then copies what this rank writes into the reused host slabs
of a ``StagingPool`` (``podtrain.ckpt.host_buffers``, at most ``ckpt.host_staging_mb``), which the
writer drains as they fill (``podtrain.ckpt.staging``); the copies are the step loop's stall, plus
writing time when this rank's share exceeds the budget. A second ``save`` first waits for the
first. After a save, rank 0 applies retention (``ckpt.keep_last``, ``ckpt.keep_every``).

Resuming: rank 0 alone looks at the file system (ranks on a shared file system can disagree about
what exists), picks the newest complete checkpoint whose checksums hold (warning with the name of
each one it skips) and broadcasts the choice; every rank then loads it (``podtrain.ckpt.reader``)
and the ranks agree on success before anyone continues. Loading goes tensor by tensor
(``podtrain.ckpt.streamed_load``): each tensor's bytes go straight from the file into its
parameter or optimizer state tensor, so no rank holds a second copy of the checkpoint.

FSDP/HSDP runs (``podtrain.ckpt.sharded``): every rank writes its own shards (manifest layout
``sharded``), and a resume at any world size or under any strategy reads only the pieces each
rank holds; a DDP checkpoint continues under FSDP and a sharded one under DDP.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from podtrain import __version__
from podtrain.ckpt import layout, sharded
from podtrain.ckpt.host_buffers import StagingPool, staging_budget_bytes
from podtrain.ckpt.staging import SaveStream
from podtrain.ckpt.reader import peek_train_state
from podtrain.ckpt.state import capture_rng, restore_rng, to_plain
from podtrain.ckpt.streamed_load import load_into
from podtrain.ckpt.writer import CheckpointWriter, SaveJob, dcp_shard_name, plan_files
from podtrain.config_sections import CkptSection
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError
from podtrain.model import is_sharded, unwrap

# The package's one logger name, whichever module logs (users filter on it).
log = logging.getLogger("podtrain.checkpoint")


class Checkpointer:
    """Save, resume and retention for one run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, cfg: CkptSection, ctx: DistContext) -> None:
        """Every rank constructs one (it creates the background gloo group collectively)."""
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / layout.CKPT_SUBDIR
        self.cfg = cfg
        self.ctx = ctx
        budget = staging_budget_bytes(cfg.host_staging_mb, ctx.env.local_world_size, ctx.env.hostname)
        self._pool = StagingPool(budget, pin=ctx.is_cuda)
        self._writer = CheckpointWriter(self.root, cfg, ctx)
        self._pending: SaveJob | None = None
        self._last_step: int | None = None
        self.skipped: list[tuple[str, str]] = []
        """Checkpoints the last ``restore`` passed over (path, reason), on rank 0."""

    @property
    def last_save(self) -> dict[str, float]:
        """Timings of the last finished save: step, stall_s, write_s, bytes."""
        return self._writer.last_save

    # -- resume --------------------------------------------------------------------------------
    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler | None, check: Callable[[dict, int, str], None] | None = None,
                resume: str | None = None) -> dict | None:
        """Load the checkpoint ``cfg.resume`` designates into every rank; None: start fresh.

        Every rank calls. Rank 0 chooses (and cleans temporary directories of killed saves) and
        broadcasts; every rank loads weights into the unwrapped model, the optimizer state, the
        scaler, and its own RNG states when the world size is the one that saved; then the ranks
        agree that all of them succeeded. Returns the saved ``train_state`` (with ``version`` and
        ``world_size`` added). ``check(saved train_state, step, path)`` runs on every rank before
        anything is loaded (it may refuse); ``resume`` overrides ``cfg.resume`` (a rollback).
        """
        choice = self._rank0_decides(lambda: self._choose(resume or self.cfg.resume))
        if choice is None:
            log.info("no checkpoint to resume from (ckpt.resume=%s): starting fresh", self.cfg.resume)
            return None
        path, manifest = Path(choice["path"]), choice["manifest"]
        if check is not None:
            check(choice["train_state"], int(manifest["step"]), str(path))
        t0 = time.perf_counter()
        # Two phases, each agreed: what a rank checks alone (its files, the checkpoint's names
        # against this model), then the load, which is collective for sharded checkpoints
        # (dcp.load): no rank enters it while another has already failed.
        loaded = self._agreed(path, lambda: self._prepare(path, manifest, model, optimizer))
        train_state = self._agreed(path, lambda: self._load(path, manifest, loaded, model, optimizer, scaler))
        self._last_step = int(manifest["step"])
        log.info("resumed from %s (step %d) in %.1f s", path, self._last_step, time.perf_counter() - t0)
        return train_state

    def _choose(self, resume: str) -> dict | None:
        """Rank 0: clean up killed saves, then pick the checkpoint to resume from."""
        removed = layout.clean_stale(self.root)
        if removed:
            log.info("removed %d unfinished save(s) under %s: %s", len(removed), self.root, ", ".join(removed))
        choice = layout.resolve_resume(self.run_dir, resume)
        self.skipped = choice.skipped
        if choice.path is None:
            return None
        return {"path": str(choice.path), "manifest": choice.manifest,
                "train_state": peek_train_state(choice.path)}

    def _rank0_decides(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only and broadcast its result (or its error) to every rank."""
        outcome: tuple[str, Any] | None = None
        if self.ctx.is_main:
            try:
                outcome = ("ok", fn())
            except UserError as exc:
                outcome = ("user", str(exc))
            except Exception as exc:
                outcome = ("bug", f"{type(exc).__name__}: {exc}")
                if not self.ctx.initialized:
                    raise
                log.exception("checkpoint decision failed on rank 0")
        outcome = self.ctx.broadcast_object(outcome)
        kind, value = outcome
        if kind == "user":
            raise UserError(value)
        if kind == "bug":
            raise RuntimeError(f"rank 0 could not choose a checkpoint: {value}")
        return value

    def _agreed(self, path: Path, fn: Callable[[], Any]) -> Any:
        """``fn()`` on every rank, then agreement: all go on, or all raise (naming the rank that failed)."""
        failure, result = None, None
        try:
            result = fn()
        except Exception as exc:  # agreed below, so no rank waits on one that failed
            failure = exc
        self.ctx.agree(failure)  # ranks that loaded fine raise, naming the rank that did not
        if isinstance(failure, UserError):
            raise UserError(f"resuming from {path} failed: {failure}") from None
        if failure is not None:
            raise failure
        return result

    def _prepare(self, path: Path, manifest: dict, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> sharded.ShardedLoad | None:
        """Every rank alone, no collective: check what it will read.

        Rank 0 verified every file's SHA-256 when it chose; the others check their own view of
        shared storage against rank 0's manifest (a stale cache would train another model). A
        sharded load is planned here (names checked, targets allocated); None: a whole-tensor load."""
        if not self.ctx.is_main:
            layout.check_files(path, manifest)
        if sharded.applies(unwrap(model), manifest):  # an FSDP/HSDP run, or a checkpoint of one
            return sharded.prepare(path, manifest, unwrap(model), optimizer)
        return None

    def _load(self, path: Path, manifest: dict, loaded: sharded.ShardedLoad | None, model: nn.Module,
              optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> dict:
        """Every rank: read the chosen checkpoint (files named by rank 0's manifest) and apply it."""
        if loaded is not None:
            state = sharded.load(loaded, path, manifest, unwrap(model), optimizer, self._pool)
        else:
            state = load_into(path, manifest, unwrap(model), optimizer, self._pool)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        rngs = state.get("rng") or []
        if len(rngs) == self.ctx.world_size:
            restore_rng(rngs[self.ctx.rank], self.ctx.device)
        elif self.ctx.is_main:
            log.warning("checkpoint %s was saved by %d rank(s), this run has %d: RNG states not "
                        "restored (data order depends only on the seed and the loader position)",
                        path, len(rngs), self.ctx.world_size)
        return state["train_state"]

    # -- save ----------------------------------------------------------------------------------
    def should_save(self, step: int, last_step: int) -> bool:
        """True every ``ckpt.every`` steps (0: never in between) and always at ``last_step``."""
        return step == last_step or (self.cfg.every > 0 and step % self.cfg.every == 0)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler | None, train_state: dict) -> None:
        """Snapshot to host memory now, write in the background (every rank calls, same step).

        Saving the step that was just saved (a stop signal right after a scheduled save) does
        nothing: nothing changed in between.
        """
        if step == self._last_step:
            log.info("step %d is already checkpointed", step)
            return
        waited = self.wait()  # at most one save in flight: its buffers are about to be reused
        t0 = time.perf_counter()
        job = self._snapshot(step, model, optimizer, scaler, train_state)
        self._last_step = step
        self._pending = job
        self._writer.submit(job)  # first: the writer drains slabs while the copies fill them
        if job.stream is not None:
            job.stream.produce(self.ctx.device)
        job.stall_s = time.perf_counter() - t0
        log.info("checkpoint step %d: step loop stalled %.3f s (host copy)%s, writing in the %s",
                 step, job.stall_s, f" + {waited:.2f} s for the previous save" if waited > 0.01 else "",
                 "background" if self.cfg.async_save else "foreground")
        if not self.cfg.async_save:
            self.wait()

    def _snapshot(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                  scaler: torch.amp.GradScaler | None, train_state: dict) -> SaveJob:
        """The job of this save: small state captured, the tensors this rank writes in a stream."""
        job = SaveJob(step=step, rng=capture_rng(self.ctx.device))
        net = unwrap(model)
        shards = is_sharded(net)  # FSDP/HSDP: every rank writes its own pieces
        if not (self.ctx.is_main or self.cfg.format == "dcp" or shards):
            return job
        state_items: list[tuple[str, torch.Tensor]] = []
        sink = lambda name, t: state_items.append((name, t))  # noqa: E731
        optim = None if shards else to_plain(optimizer.state_dict(), sink, "optimizer")
        job.state_plain = {
            "optimizer": optim,
            "scaler": (to_plain(scaler.state_dict(), sink, "scaler")
                       if scaler is not None and scaler.is_enabled() else None),
            "train_state": to_plain({**train_state, "version": __version__,
                                     "world_size": self.ctx.world_size}, sink, "train_state"),
        }
        config = getattr(net, "config", None)
        job.model_config = config.to_json_string() if hasattr(config, "to_json_string") else None
        if shards:
            snap = sharded.shard_items(net, optimizer, self.ctx.rank, state_items)
            job.layout, job.aliases, job.offsets = layout.SHARDED, snap.aliases, snap.offsets
            job.state_plain["optimizer"] = snap.optimizer
            files = {f"{layout.DCP_SUBDIR}/{dcp_shard_name(self.ctx.rank)}": snap.items} if snap.items else {}
        else:
            model_items, job.aliases = self._model_tensors(net)
            files = plan_files(self.cfg.format, self.ctx.rank, self.ctx.world_size, model_items, state_items)
        job.stream = SaveStream(self._pool, files) if files else None
        return job

    def _model_tensors(self, net: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
        """The weights to write; tied tensors (embeddings = LM head) stored once, aliased."""
        tensors: list[tuple[str, torch.Tensor]] = []
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name, t in net.state_dict().items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
            tensors.append((name, t))
        return tensors, aliases

    def wait(self) -> float:
        """Block until the in-flight save is durable on rank 0; seconds waited.

        Raises when that save failed (on every rank: the ranks learn rank 0's outcome).
        """
        job = self._pending
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        job.done.wait()
        self._pending = None
        if job.error is not None:
            self._last_step = None  # that step is not on disk: saving it again must not be skipped
            raise RuntimeError(f"checkpoint of step {job.step} failed: {job.error}") from job.error
        return time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the in-flight save, stop the thread, release the group (every exit path)."""
        try:
            self.wait()
        finally:
            self._writer.close()
            self._pool.close()
