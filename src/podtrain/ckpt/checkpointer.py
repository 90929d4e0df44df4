"""Checkpoints: one layout for every strategy and world size, written by every rank in the
background, verified as they are read; auto-resume with a collective fallback.

``Checkpointer`` is what the training loop uses::

    ckpt = Checkpointer(run_dir, cfg.ckpt, ctx)            # every rank
    state = ckpt.restore(model, optimizer, scaler)          # every rank; a ResumeState, or None
    ...                                                     # the loop applies state (step, data, rng)
    if saves.should_save(step, total):                      # interval.SaveSchedule
        ckpt.save(step, model, optimizer, scaler, train_state)   # every rank, same step
    if ckpt.failed: ckpt.wait()                             # raises SaveFailed (agreed at a step boundary)
    ckpt.close()                                            # every exit path

What a checkpoint holds: ``podtrain.ckpt.layout``. A save copies this rank's share (``plan``) into
its ``StagingPool``'s host slabs (on a GPU on a side stream that only the next optimizer step waits
for: ``staging.CopyFence``), and the background writer runs the save's phases
(``podtrain.ckpt.writer``). ``ckpt.dir`` (a shared directory or ``s3://``) is the durable tier;
``ckpt.local_dir`` adds a node-local one, saved every ``ckpt.local_every`` steps
(``podtrain.ckpt.local_tier``). Resuming is the ``Restorer``'s (``podtrain.ckpt.restore``), which
this class owns and gives its stores, identity and writers' groups.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from podtrain import __version__
from podtrain.ckpt import layout, lineage
from podtrain.ckpt.lease import Lease
from podtrain.ckpt.lineage import RunIdentity
from podtrain.ckpt.restore import Restored, Restorer, ResumeState, agreed, rank0_decides
from podtrain.ckpt.host_buffers import StagingPool, staging_budget_bytes
from podtrain.ckpt.staging import CopyFence, SaveStream
from podtrain.ckpt.state import capture_rng, to_plain
from podtrain.ckpt.statedict import SaveCache, named_state
from podtrain.ckpt.store import open_store
from podtrain.ckpt.writer import CheckpointWriter, SaveAbandoned, SaveFailed, SaveJob, progress, progressed_at
from podtrain.config_sections import CkptSection
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError
from podtrain.model import unwrap
from podtrain.storage.errors import Transient
from podtrain.storage.retry import Deadline, RetryPolicy

LEASE_RETRY_S = 10.0
"""The storage retry budget of one lease operation (a renewal, the release)."""
ABANDON_WAIT_S = 30.0
"""How long an abandoned save may take to notice (its current request's own timeout)."""
LEASE_RESERVE_S = 1.0
"""At a stop, the part of what is left after the saves that the writers' ends leave to the lease's
release (at most this, at most a quarter of it)."""
CLOSE_RESERVE_S = 3.0
"""At a stop, the part of the deadline the saves leave to the lease's release and the threads'
ends (at most this, at most a fifth of what is left)."""


class StorageOutage(Transient):
    """Saves kept failing on transient storage faults for longer than ``ckpt.max_outage_s``:
    the run stops with the retryable exit code (``podtrain.errors``) and a rerun resumes."""

# The package's one logger name, whichever module logs (users filter on it).
log = logging.getLogger("podtrain.checkpoint")


def expand_local_dir(local_dir: str, ctx: DistContext) -> str:
    """``ckpt.local_dir`` with environment variables expanded on this rank (``/nvme/${SLURM_NODEID}``);
    a variable left unset is a one-line error naming it, the rank and the host."""
    expanded = os.path.expandvars(local_dir)
    if "$" in expanded:
        raise UserError(f"ckpt.local_dir={local_dir!r} names an environment variable that is not set on "
                        f"rank {ctx.rank} (host {ctx.env.hostname}): {expanded!r}")
    return expanded


class Checkpointer:
    """Save, resume and retention for one run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, cfg: CkptSection, ctx: DistContext) -> None:
        """Every rank constructs one (it creates the background gloo groups collectively). Rank 0
        establishes the run's identity (``podtrain.ckpt.lineage``: which lineage, where its
        checkpoints live) and takes the run's lease (``podtrain.ckpt.lease``), then tells everyone."""
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.ctx = ctx
        self._lease: Lease | None = None
        self._save_cache = SaveCache()  # the layout and config JSON later saves of this run reuse
        self.identity: RunIdentity = rank0_decides(self.ctx, self._establish)
        """This run's lineage and checkpoint location (the same on every rank)."""
        try:
            self._build()
        except BaseException:
            if self._lease is not None:  # a run that could not start holds nothing
                self._lease.release()
            raise

    def _build(self) -> None:
        """Stores, staging pool, writers (every rank; the writers' groups are collective)."""
        cfg, ctx = self.cfg, self.ctx
        self.store = open_store(self.identity.ckpt_url)
        budget = staging_budget_bytes(cfg.host_staging_mb, ctx.env.local_world_size, ctx.env.hostname)
        # The tiers never wait on each other: each has its own in-flight save and its own half of
        # the staging budget, so a durable save stuck in a storage outage holds no slab a local
        # save needs (slabs are allocated on use: an unused half costs nothing).
        share = budget // 2 if cfg.local_dir else budget
        self._pool = StagingPool(share, pin=ctx.is_cuda)
        self._local_pool = StagingPool(share, pin=ctx.is_cuda) if cfg.local_dir else None
        self._fence = CopyFence(ctx.device)
        owned = self._lease.still_held if self._lease is not None else (lambda: None)
        self._writer = CheckpointWriter(self.store, cfg, ctx, still_owned=owned, lineage=self.identity.lineage)
        self.local = (open_store(agreed(ctx, "ckpt.local_dir", lambda: lineage.local_url(
            expand_local_dir(cfg.local_dir, ctx), self.identity.lineage))) if cfg.local_dir else None)
        """The node-local tier's store (this lineage's folder of ``ckpt.local_dir``), or None."""
        self._local_writer = CheckpointWriter(self.local, cfg, ctx, local=True) if self.local else None
        self._pending: SaveJob | None = None
        """The durable save in flight."""
        self._pending_local: SaveJob | None = None
        """The local save in flight (the tiers never wait on each other)."""
        self._discarded = False
        self._last_step: int | None = None
        self._newest: int | None = None
        """The newest durable step committed or restored by this run (said in messages)."""
        self._failing_agreed = False
        """The last vote saw the storage failing (every rank then skips a due save at once)."""
        self._outage_since: float | None = None
        """When saves started failing for a transient storage fault (monotonic), or None."""
        self.restorer = Restorer(ctx, cfg, self.run_dir, self.identity, self.store, self.local, self._pool,
                                 self._writer.side_group, self._local_writer.group if self._local_writer else None,
                                 self._writer.tidy)
        self.restored = Restored()
        """What the last ``restore`` did (``podtrain.ckpt.restore.Restored``)."""

    def _establish(self) -> RunIdentity:
        """Rank 0: the run directory's lease first (nothing is written into a run another job
        holds), then the run's identity, then the lease of its checkpoint location."""
        # The lease is best effort during an outage (a renewal that fails is tried again at the
        # next one): short retries, so that neither a renewal nor the release at exit waits long.
        def lease_store(url: str):
            return open_store(url, retry=RetryPolicy(budget_s=LEASE_RETRY_S))

        self._lease = Lease([lease_store(str(self.run_dir))], "", self.ctx.env.job_id, self.ctx.env.hostname,
                            self.cfg.lease_timeout_s)
        self._lease.acquire()
        try:
            configured = layout.ckpt_url(self.run_dir, self.cfg.dir)
            identity = lineage.establish(self.run_dir, configured, fresh_start=self.cfg.resume == "never")
            self._lease.record.lineage = identity.lineage  # the lease names the run from the next renewal on
            url = identity.ckpt_url  # outside the run directory, the checkpoints need a lease of their own
            if "://" in url or not Path(url).resolve().is_relative_to(self.run_dir.resolve()):
                self._lease.extend(lease_store(identity.ckpt_url))
        except BaseException:
            self._lease.release()
            self._lease = None
            raise
        log.info("run lineage %s%s: checkpoints in %s", identity.lineage,
                 " (new)" if identity.fresh else "", identity.ckpt_url)
        return identity

    @property
    def lease_lost(self) -> str | None:
        """Rank 0: why this job no longer holds the run's lease (another job took it), or None."""
        return self._lease.lost if self._lease is not None else None

    @property
    def last_save(self) -> dict[str, float]:
        """Timings of the last finished save: step, stall_s, write_s, bytes."""
        return self._writer.last_save

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                check=None, resume: str | None = None, fresh=None) -> ResumeState | None:
        """Every rank: load the checkpoint to resume from (``Restorer.restore``; quiesce first inside
        a running job); None: start fresh. What it did is ``restored``."""
        self.restored = self.restorer.restore(model, optimizer, scaler, check, resume, fresh)
        self._last_step = self.restored.saved_step
        self._newest = self.restored.newest if self.restored.newest is not None else self._newest
        return self.restored.state

    @property
    def restore_budget(self) -> dict[str, Any] | None:
        """The last ``restore``: seconds, the tier, bytes by source summed over the ranks."""
        return self.restored.budget

    # -- save ----------------------------------------------------------------------------------
    def local_due(self, step: int) -> bool:
        """True every ``ckpt.local_every`` steps when there is a local tier."""
        return self.local is not None and self.cfg.local_every > 0 and step % self.cfg.local_every == 0

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler | None, train_state: dict, local: bool = False,
             must: bool = False, deadline: Deadline | None = None) -> bool:
        """Copy this rank's share to host memory now, write it in the background (every rank, same
        step) to the durable tier, or to the node-local one (``local``); False when skipped.

        At most one save per tier is in flight (its host buffers are reused). The newest state
        wins: when the tier's previous save is still retrying (its storage failing) as this one is
        due, it is cancelled (nothing of it commits) and this one saved once it has ended. A
        previous save that is merely slow gets ``ckpt.save_wait_s``; if it (or a cancelled one) has
        not ended on every rank by then, this save is skipped on every rank alike and training goes
        on, unless ``must`` (the last step), which waits for it. ``deadline`` (a stop signal): any
        previous save is cancelled at once and waited for until then at most. A tier never waits
        for the other. Saving the step that was just saved durably (a stop signal right after a
        scheduled save) does nothing."""
        if step == self._last_step:
            log.info("step %d is already checkpointed", step)
            return True
        t0 = time.perf_counter()
        if not self._settle(must, local, deadline, step):
            if self.ctx.is_main:
                job = self._pending_local if local else self._pending
                log.warning("checkpoint step %d skipped: the save of step %d is still %s after %.0f s (%s; "
                            "the storage is slow or unreachable)%s", step, job.step,
                            "ending (cancelled)" if job.cancel.cancelled else "being written",
                            time.perf_counter() - t0, "the stop's grace period" if deadline is not None
                            else "ckpt.save_wait_s", "" if deadline is not None else "; training goes on")
            return False
        waited = time.perf_counter() - t0
        t0 = time.perf_counter()
        # The peer replicas' copies give the host copy the host; a local save then hands its hold
        # to the writer, which resumes them when the write ends (a durable one resumes them here).
        replicator = self._local_writer.replicator if self._local_writer is not None else None
        handed_over = False
        if replicator is not None:
            # A replica group broken on every rank is made anew here, on the main thread, at a point
            # every rank reaches in the same order (group creation is collective): never by the
            # replicator's own thread, whose new_group could interleave with this thread's collectives.
            if local:
                replicator.mend(self.ctx.all_reduce_max)
            replicator.pause()
        try:
            job = self._snapshot(step, model, optimizer, scaler, train_state, local, deadline)
            if local:
                self._pending_local = job
                if replicator is not None:
                    job.resume_replicas, handed_over = replicator.resume, True
            else:
                self._last_step = step
                self._pending = job
            writer = self._local_writer if local else self._writer
            # A stream larger than the free slabs needs the writer draining them while the copies
            # fill them: it starts first. One that fits is staged first: the writer's start (its
            # storage requests, Python) would only contend with the copies for the GIL.
            staged_first = job.stream is not None and job.stream.fits_free()
            if not staged_first:
                writer.submit(job)
            try:
                if job.stream is not None:
                    job.stream.produce(self.ctx.device, self._fence)
            finally:
                if staged_first:
                    writer.submit(job)  # after a failed copy too: the writer ends the job with it
        finally:
            if replicator is not None and not handed_over:
                replicator.resume()
        self._fence.hold_optimizer(optimizer)  # GPU: the next optimizer step waits on the copies
        job.stall_s = time.perf_counter() - t0
        log.info("checkpoint step %d: step loop stalled %.3f s (host copy)%s, writing in the %s",
                 step, job.stall_s, f" + {waited:.2f} s for the previous save" if waited > 0.01 else "",
                 "background" if self.cfg.async_save else "foreground")
        if not self.cfg.async_save:
            self.wait()
        return True

    def _settle(self, must: bool, local: bool = False, deadline: Deadline | None = None,
                step: int | None = None) -> bool:
        """Every rank, when a save is due: whether the tier's previous save has ended on every rank,
        by the rules ``save`` states (``ckpt.save_wait_s``, ``must``, the newest state wins, a stop's
        ``deadline``). Its failure is raised or, for a transient storage fault, logged; an outage
        longer than ``ckpt.max_outage_s`` stops the run (``StorageOutage``: exit 203, retryable). A
        save retrying now (``RetryPolicy.retrying``) with no progress on any rank since it was last
        asked about (``writer.progress``: a slow storage that is working finishes its save; asked
        for the first time without a pause, within the last ``ckpt.save_wait_s``) is cancelled,
        then waited for ``ckpt.save_wait_s`` more. One MAX all_reduce of five numbers per round, at
        save steps only, so every rank decides the same (only rank 0, which commits, may see the
        storage fail; the deadline's expiry is agreed too, since the signal reached each rank at its
        own moment)."""
        job = self._pending_local if local else self._pending
        if job is None:
            return True
        store = self.local if local else self.store

        def failing() -> float | None:  # since when durable saves fail: a failed save, or the store now
            if local:  # an outage is the durable storage's (the local tier is this node's disk)
                return None
            return self._outage_since if self._outage_since is not None else self.store.retry.failing_since

        cancelled, after_cancel = False, 0.0
        first_ask = job.progress_seen < 0
        if first_ask:  # first asked about now: its progress counts from here
            job.progress_seen = progress(job)
        while True:  # every rank runs the same iterations: each ends in the same all_reduce
            # A known outage costs the step loop nothing; a merely slow save gets save_wait_s; the
            # last step's save (must) waits in 1 s rounds until done or past the outage bound; a
            # cancelled save, and any at a stop, is asked about in rounds of at most 1 s.
            if cancelled or (deadline is not None and must):
                pause = min(1.0, self.cfg.save_wait_s) if deadline is None else 1.0
            elif deadline is not None:
                pause = 0.0  # a stop: ask at once, then cancel
            else:
                pause = 1.0 if must else 0.0 if self._failing_agreed and not local else self.cfg.save_wait_s
            if deadline is not None:
                pause = min(pause, deadline.remaining())
            job.done.wait(pause)
            after_cancel += pause if cancelled else 0.0
            here = job.done.is_set()
            # An outage is time since saves began failing (only rank 0 may know: it commits),
            # never a healthy save that is merely slow.
            since = failing()
            outage_here = time.monotonic() - since if since is not None and (not here or job.error) else 0.0
            retrying_here = not here and store.retry.retrying
            now = progress(job)
            # A first ask without a pause (an agreed outage asks at once) has no window to see
            # progress in: there the save counts as moving if it progressed within save_wait_s.
            recent = first_ask and pause == 0.0 and time.monotonic() - progressed_at(job) < self.cfg.save_wait_s
            moved_here = not here and (now > job.progress_seen or recent)
            job.progress_seen, first_ask = now, False
            late_here = deadline is not None and deadline.expired
            not_done, outage, retrying, late, moved = self.ctx.all_reduce_max(
                [0.0 if here else 1.0, outage_here, float(retrying_here), float(late_here), float(moved_here)])
            done = not_done == 0.0
            if not local:
                self._failing_agreed = outage > 0
            if done or late > 0 or outage > self.cfg.max_outage_s:
                break
            if not cancelled and (deadline is not None or (retrying > 0 and moved == 0)):
                why = ("a stop signal: the current step is saved instead" if deadline is not None else
                       f"step {step} is due: the newest state is saved instead")
                job.cancel.cancel(why)
                cancelled = True
                if self.ctx.is_main:
                    log.warning("the %s save of step %d is %s: cancelled (%s)", "local" if local else "durable", job.step,
                                "still retrying with no progress (the storage is failing)" if retrying > 0 and moved == 0
                                else "still in flight", why)
                continue
            if cancelled and (must or deadline is not None or after_cancel < self.cfg.save_wait_s):
                continue  # the agreed rounds: every rank sums the same pauses
            if not must or cancelled:
                break
        if done:
            self._finish(job)
        if outage > self.cfg.max_outage_s and (not done or self._outage_since is not None):
            self.abandon()  # the save in flight gives up at its next retry: nothing of it commits
            if self._pending is not None and self._pending.done.wait(ABANDON_WAIT_S):
                self._pending = None  # accounted for here: close() must not report it again
            raise StorageOutage(self.store.url, (
                f"no checkpoint could be saved for {outage:.0f} s (ckpt.max_outage_s={self.cfg.max_outage_s:g}): "
                f"the storage is unreachable; stopping with exit code {StorageOutage.exit_code} so that the "
                f"scheduler retries the job, which resumes from {self._newest_name()}"))
        return done

    def _finish(self, job: SaveJob, final: bool = False) -> None:
        """Account for a finished save: success ends an outage; a transient storage fault is
        logged once (the save is abandoned, nothing of it committed) unless ``final``; anything
        else raises on every rank (``SaveFailed`` for a storage problem)."""
        if job.local:
            self._pending_local = None
        else:
            self._pending = None
        if job.error is None:
            if not job.local:  # only a durable save ends an outage of the durable storage
                self._outage_since = None
                self._newest = job.step
            return
        self._last_step = None  # that step is not on disk: saving it again must not be skipped
        if isinstance(job.error, SaveAbandoned) and not final:
            if self._outage_since is None and not job.local:  # the durable storage's outage only
                self._outage_since = self.store.retry.failing_since or job.submitted
            if self.ctx.is_main:
                log.warning("%s; nothing of it is committed, the next save tries again (the newest checkpoint "
                            "is still %s)", job.error, self._newest_name())
            return
        if isinstance(job.error, SaveAbandoned):
            raise StorageOutage(self.store.url, f"{job.error}; the run stops with exit code "
                                f"{StorageOutage.exit_code} (retryable) and resumes from {self._newest_name()}")
        if isinstance(job.error, SaveFailed):
            steps = layout.committed_steps(self.store)
            newest = f"{self.store.url}/{steps[-1][1]}" if steps else "none"
            raise SaveFailed(f"{job.error}; the run stops (the newest checkpoint is still {newest})") from None
        raise RuntimeError(str(job.error)) from job.error

    def _newest_name(self) -> str:
        """The newest durable checkpoint this run knows of (no listing: the storage may be down)."""
        return f"{self.store.url}/{layout.step_name(self._newest)}" if self._newest is not None else "a fresh start"

    def abandon(self) -> None:
        """Make every save in flight give up at its next storage retry, for good: the stores stop
        retrying (the run is ending: an outage past its bound, a lost lease, the end of a stop's
        grace period). To give up one save and go on saving, cancel its job (``SaveJob.cancel``)."""
        for store in (self.store, self.local):
            policy = getattr(store, "retry", None)
            if policy is not None:
                policy.abandon()

    def _snapshot(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                  scaler: torch.amp.GradScaler | None, train_state: dict, local: bool = False,
                  deadline: Deadline | None = None) -> SaveJob:
        """The job of this save: this rank's pieces in a stream (whose waits end by ``deadline``, a
        stop's, at the latest); rank 0 also the small state."""
        job = SaveJob(step=step, rng=capture_rng(self.ctx.device), lineage=self.identity.record(), local=local)
        net = unwrap(model)
        named = named_state(net, optimizer)
        # Names, shapes, dtypes and placements rarely change: their plan, table and mesh record
        # are built once and reused (``self._save_cache``), so the loop only copies bytes.
        plan = self._save_cache.layout(named.tensors, self.ctx.rank, self.ctx.world_size)
        pieces = plan.pieces(named.tensors)
        job.pieces = [(n, start, count) for n, start, count, _ in plan.ranges]
        job.strategy = plan.strategy
        if pieces:
            items = [(f"{n}[{start}:{start + t.numel()}]", t) for n, start, t in pieces]
            job.stream = SaveStream(self._local_pool if local else self._pool, {layout.rank_file(self.ctx.rank): items},
                                    deadline=deadline)
        if self.ctx.is_main:
            sink = job.small.__setitem__
            job.tensors, job.mesh = plan.table, plan.mesh
            job.state_plain = {
                "aliases": named.aliases,
                "optimizer_values": to_plain(named.values, sink, "optimizer_values"),
                "scaler": (to_plain(scaler.state_dict(), sink, "scaler")
                           if scaler is not None and scaler.is_enabled() else None),
                "train_state": to_plain({**train_state, "version": __version__,
                                         "world_size": self.ctx.world_size}, sink, "train_state"),
            }
            job.model_config = self._save_cache.config_json(getattr(net, "config", None))  # serialised once, reused
        return job

    @property
    def failed(self) -> bool:
        """True once a save in flight has failed (on every rank alike, at slightly different
        times: the loop agrees on it at a step boundary, then calls ``wait``, which raises)."""
        return any(job is not None and job.done.is_set() and job.error is not None
                   and not isinstance(job.error, SaveAbandoned)  # a storage fault: the next save retries
                   for job in (self._pending, self._pending_local))

    def device_stall_s(self) -> float:
        """Seconds the optimizer step after the last save waited (on the device) for its copies,
        once measured (CUDA events, read without blocking; 0 on the CPU and until known)."""
        return self._fence.wait_s()

    def discard(self) -> None:
        """This job no longer owns the run (its lease was taken over): the save in flight is
        abandoned, and neither it nor anything later is committed or reported."""
        self._discarded = True
        self.abandon()

    def quiesce(self, bound_s: float) -> None:
        """Every rank, before a restore inside a running job (the guard's rollback): afterwards no
        save of either tier is in flight on any rank. A restore must never run beside a writer: it
        uses the writer's gloo group and staging pool, and ranks that disagreed on which saves are
        pending would later vote in different collectives. The saves are waited for up to
        ``bound_s``, agreed every second with one MAX all_reduce; then cancelled (the newest state
        wins) and given ``ABANDON_WAIT_S`` more; one still running then stops the run with the
        retryable ``StorageOutage`` (a rerun resumes from the newest committed checkpoint)."""
        jobs = [job for job in (self._pending, self._pending_local) if job is not None]
        t0, cancelled = time.monotonic(), False
        while True:  # every rank runs the same rounds: each ends in the same all_reduce
            end = time.monotonic() + 1.0
            for job in jobs:
                job.done.wait(max(0.0, end - time.monotonic()))
            here = 0.0 if all(job.done.is_set() for job in jobs) else 1.0
            not_done, elapsed = self.ctx.all_reduce_max([here, time.monotonic() - t0])
            if not_done == 0.0:
                break
            if elapsed > bound_s and not cancelled:
                for job in jobs:
                    job.cancel.cancel("the guard rolls back to the newest committed checkpoint")
                cancelled = True
            if elapsed > bound_s + ABANDON_WAIT_S:
                self.abandon()
                raise StorageOutage(self.store.url, (
                    f"a save is still being written {elapsed:.0f} s after the guard asked to roll back "
                    f"(the storage is not answering): stopping with exit code {StorageOutage.exit_code} so "
                    f"that the scheduler retries the job, which resumes from {self._newest_name()}"))
        for job in jobs:
            self._finish(job)  # the same outcome on every rank (the writers broadcast it)

    def wait(self, timeout: float | None = None, final: bool = False, deadline: Deadline | None = None) -> float:
        """Block until the saves in flight (durable, then local) are committed (a local one: and
        its peer replicas, when it was replicated); seconds waited. Raises on every rank when one
        failed (``SaveFailed`` for a storage problem: one line naming the newest checkpoint;
        a transient fault only when ``final``: ``StorageOutage``). After ``timeout`` seconds, or
        at ``deadline`` (one for both tiers), a save still in flight is cancelled (its retries
        end, nothing of it commits) and no longer waited for: it stays the tier's save in flight
        until it has ended (the next due save settles it)."""
        if timeout is not None:
            bound = Deadline.after(timeout)
            deadline = bound if deadline is None or bound.at < deadline.at else deadline
        return sum(self._wait_for(job, final, deadline)
                   for job in (self._pending, self._pending_local) if job is not None)

    def _wait_for(self, job: SaveJob, final: bool, deadline: Deadline | None) -> float:
        t0 = time.perf_counter()
        if not job.done.wait(None if deadline is None else deadline.remaining()):
            log.warning("the save of step %d is still being written after %.1f s: cancelled, no longer waited "
                        "for (the storage is slow or unreachable; nothing of it commits)", job.step,
                        time.perf_counter() - t0)
            job.cancel.cancel("it was waited for until its deadline")
            return time.perf_counter() - t0
        self._finish(job, final=final)
        replicator = self._local_writer.replicator if job.local and self._local_writer is not None else None
        if replicator is not None:  # a caller that waits for a local save waits for its replicas too
            replicator.wait_idle(timeout=None if deadline is None else deadline.remaining())
        return time.perf_counter() - t0

    def close(self, deadline: Deadline | None = None) -> bool:
        """Wait for the saves in flight, stop the threads, release the groups, then the lease (every
        exit path); False when a thread was left waiting on the storage (only with a deadline): the
        lease is then not released but left to expire (``ckpt.lease_timeout_s``), since that
        thread could still write.

        ``deadline`` (a stop signal's: ``ckpt.grace_s`` after it, less the process's exit): the
        whole of this ends by then. The saves get it less ``CLOSE_RESERVE_S`` (the lease and the
        threads' ends get the rest); a save still in flight then is cancelled, the stores stop
        retrying for good, and its writer thread (a daemon) is left to end with the process; a
        transient failure is logged, not raised (the stop's exit code stands). A save already
        given up (a lost lease, an outage past its bound) gets ``ABANDON_WAIT_S`` to notice."""
        if deadline is None and (self._discarded or self.store.retry.abandoned):
            deadline = Deadline.after(ABANDON_WAIT_S)
        try:
            if deadline is None:
                self.wait(final=True)
            else:
                try:
                    self.wait(deadline=deadline.sooner(min(CLOSE_RESERVE_S, deadline.remaining() / 5)))
                except Exception as exc:
                    if not self._discarded:
                        raise
                    log.debug("the abandoned save ended with: %s", exc)  # the run is another job's now
                finally:
                    if any(job is not None and not job.done.is_set() for job in (self._pending, self._pending_local)):
                        self.abandon()  # the process is ending: no retry of it goes on
        finally:
            def left() -> float | None:
                return None if deadline is None else deadline.remaining()

            def writers_left() -> float | None:  # the writers first; the lease's release gets the rest
                return None if deadline is None else max(0.0, left() - min(LEASE_RESERVE_S, left() / 4))

            self._fence.release()
            stopped = self._writer.close(timeout=writers_left())
            if self._local_writer is not None:
                stopped = self._local_writer.close(timeout=writers_left()) and stopped
            if self._lease is not None:
                # Released only once no writer can write any more: a thread left writing at the
                # deadline (a storage that never answers) could land a file after the release, in
                # a run another job may hold by then. Its lease is left to expire instead.
                stopped = self._lease.release(deadline_s=left(), drop=stopped) and stopped
            self._pool.close()
            if self._local_pool is not None:
                self._local_pool.close()
        return stopped  # this checkpointer's threads only: other trainings of the process are theirs
