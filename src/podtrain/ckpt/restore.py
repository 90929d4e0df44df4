"""Resuming a run: choosing the checkpoint (this run's newest, else ``ckpt.resume_from``; the
node-local tier and its peer replicas first), loading every rank's share and agreeing on the
outcome. ``Restorer`` is given what it works on (the context, the section, the run's identity,
the tiers' stores, the staging pool, the writers' gloo groups) and returns what it did
(``Restored``); the ``Checkpointer`` owns one. ``rank0_decides`` and ``agreed`` are the rank-0
decisions and all-rank agreements both halves use."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from podtrain.ckpt import layout, lineage, local_tier, replicas
from podtrain.ckpt.host_buffers import StagingPool
from podtrain.ckpt.load import finish, prepare, read, read_small, saved_world_size
from podtrain.ckpt.reader import peek_train_state
from podtrain.ckpt.store import StorageError, open_store
from podtrain.ckpt.tensorio import CorruptCheckpoint
from podtrain.config_sections import CkptSection
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError
from podtrain.model import unwrap
from podtrain.storage.errors import AccessDenied, NoSpace, ReadOnly, Transient

log = logging.getLogger("podtrain.checkpoint")


def _read_failure_kind(exc: BaseException) -> str:
    """How a rank's failure to read its share is handled: "corrupt" (this checkpoint's bytes or
    files: damaged, missing or short; fall back to the previous one), "transient" (the storage:
    exit 203, retried later), "user" (one line, exit 2) or "bug". A storage that refuses the read
    (access denied, a read-only or full volume) is the user's to fix, never a reason to fall back:
    a fall-back could end in a fresh start whose first save replaces the run's newest checkpoint."""
    if isinstance(exc, Transient):
        return "transient"
    if isinstance(exc, (AccessDenied, NoSpace, ReadOnly)):
        return "user"
    if isinstance(exc, (CorruptCheckpoint, OSError, EOFError, StorageError)):
        return "corrupt"
    return "user" if isinstance(exc, UserError) else "bug"


@dataclass
class ResumeState:
    """What a restore hands back for the loop to apply (the checkpointer mutates only the model,
    the optimizer and the scaler, which it was given)."""

    path: str
    step: int
    tokens_seen: int = 0
    run_id: str | None = None
    loader: dict[str, Any] | None = None
    """The data position (``ShardedLoader.load_state_dict``)."""
    rng: dict[str, Any] | None = None
    """This rank's RNG states (``state.restore_rng``); None when the world size changed."""
    saved_world_size: int = 0
    train_state: dict[str, Any] = field(default_factory=dict)
    """Everything the loop saved (config, tokenizer, ...)."""
    branch: bool = False
    """The checkpoint is another lineage's: this run starts from it (``ckpt.resume_from``)."""


@dataclass
class Restored:
    """What one restore did (every rank; ``Checkpointer.restored``)."""

    state: ResumeState | None = None
    """What it loaded, for the loop; None: a fresh start."""
    tier: str | None = None
    """Where from: "local" or "durable" (None: nothing loaded)."""
    saved_step: int | None = None
    """The loaded step when the durable tier holds it for this lineage (saving it again is skipped)."""
    newest: int | None = None
    """The loaded step when it is this run's own newest durable checkpoint (said in messages)."""
    bytes_read: int = 0
    """Tensor bytes this rank read (its share, whole blocks)."""
    peer_bytes: int = 0
    """Bytes of local pieces this rank received from peers."""
    last_load: dict[str, Any] = field(default_factory=dict)
    """This rank's last load: metadata bytes parsed and seconds, saved ranks whose sidecars it read."""
    budget: dict[str, Any] | None = None
    """Seconds, the tier, bytes by source summed over the ranks."""


class Restorer:
    """Resume for one run (see the module docstring)."""

    def __init__(self, ctx: DistContext, cfg: CkptSection, run_dir: Path, identity: lineage.RunIdentity, store,
                 local, pool: StagingPool, group, local_group, tidy: layout.Housekeeping) -> None:
        """``cfg``: the ``ckpt`` section (resume, resume_from, resume_from_reset); ``identity``: this
        run's (a branch records its parent there and in RUN_DIR/lineage.json); ``store``/``local``:
        the durable and node-local tiers (or None); ``pool``: the staging pool reads go through;
        ``group``: the durable writer's ``side_group`` (called where a load needs the group: it is
        made there, collectively); ``local_group``: the local writer's group; both must be idle
        (``Checkpointer.quiesce``); ``tidy``: the clean-up of unfinished saves (best effort)."""
        self.ctx, self.cfg, self.run_dir, self.identity = ctx, cfg, Path(run_dir), identity
        self.store, self.local, self.pool, self.tidy = store, local, pool, tidy
        self.group, self.local_group = group, local_group
        self.last = Restored()

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler | None, check: Callable[[dict, int, str], None] | None = None,
                resume: str | None = None, fresh: Callable[[], None] | None = None) -> Restored:
        """See ``_restore``; the outcome also holds the bytes read by source and the seconds."""
        t0 = time.perf_counter()
        out = self.last = Restored()
        out.state = state = self._restore(model, optimizer, scaler, check, resume, fresh)
        local = state is not None and out.tier == "local"
        total = torch.tensor([0 if state is None else out.bytes_read, out.peer_bytes], dtype=torch.int64)
        group = self.group() if state is not None else None  # None on every rank alike: nothing to sum
        if group is not None:  # one small sum over the gloo group, once per start
            dist.all_reduce(total, group=group)
        disk, peers = (int(v) for v in total)
        out.budget = {
            "restore_s": time.perf_counter() - t0, "tier": out.tier,
            "bytes": {"local_disk": disk if local else 0, "peers": peers, "durable": 0 if local else disk}}
        if state is not None and self.ctx.is_main:
            log.info("restore took %.2f s: %.1f MB read from local disks (the pieces from peers included, "
                     "after their transfer), %.1f MB received from peers, %.1f MB read from the durable tier",
                     out.budget["restore_s"], out.budget["bytes"]["local_disk"] / 1e6,
                     peers / 1e6, out.budget["bytes"]["durable"] / 1e6)
        return out

    def _restore(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None, check: Callable[[dict, int, str], None] | None = None,
                 resume: str | None = None, fresh: Callable[[], None] | None = None) -> ResumeState | None:
        """Load the checkpoint ``cfg.resume`` designates into the model, optimizer and scaler on
        every rank and return the rest as a ``ResumeState``; None: start fresh.

        Rank 0 chooses and broadcasts; ``check(saved train_state, step, path)`` runs on every
        rank before anything is loaded (it may refuse); each rank reads and verifies its share;
        when any rank's bytes fail their checks, every rank falls back to the previous checkpoint
        (under ``auto``; an explicit ``ckpt.resume`` path is refused instead). ``resume``
        overrides ``cfg.resume`` (a rollback).

        A failed load has already written part of the checkpoint into the live tensors (each rank
        reads straight into them: a scratch copy would double the memory), so a fall-back clears
        the optimizer state, and a fall-back to nothing calls ``fresh()`` on every rank, which
        must put the model's weights back to a fresh start's (``podtrain.train.recovery``).
        """
        resume = resume or self.cfg.resume
        state, dirty = None, False
        if self.local is not None and resume == "auto":
            state, dirty = self._restore_local(model, optimizer, scaler, check)
            if state is not None:
                self.last.tier = "local"
                return state
        failed: set[str] = set()
        while True:
            if dirty:
                optimizer.state.clear()  # partly loaded: as a fresh optimizer (or the next load) wants it
            choice = rank0_decides(self.ctx, lambda: self._choose(resume, failed))
            if choice is None:
                log.info("no checkpoint to resume from (ckpt.resume=%s): starting fresh", resume)
                if dirty:
                    self._start_over(fresh)
                return None
            state = self._load(choice, model, optimizer, scaler, check)
            if state is not None:
                self.last.tier = "durable"
                return self._adopt(choice, state, optimizer)
            dirty = True
            if resume != "auto" or choice["key"] != "ckpt.resume":
                raise UserError(f"{choice['key']}={choice['given']}: checkpoint {choice['where']} is "
                                "corrupted (see above)")
            failed.add(choice["name"])

    def _adopt(self, choice: dict, state: ResumeState, optimizer: torch.optim.Optimizer) -> ResumeState:
        """Every rank, after a load: a checkpoint of another lineage makes this run its branch
        (recorded as the parent in RUN_DIR/lineage.json; ``ckpt.resume_from_reset`` applied)."""
        if choice["lineage"] in (None, self.identity.lineage):
            return state
        state.branch = True
        self.identity.parent = {"lineage": choice["lineage"], "step": state.step, "path": choice["where"]}
        if self.ctx.is_main:
            lineage.write(self.run_dir, self.identity)
            log.info("this run (lineage %s) starts from %s (step %d of lineage %s)%s", self.identity.lineage,
                     choice["where"], state.step, choice["lineage"],
                     f", resetting {' and '.join(self.cfg.resume_from_reset)}" if self.cfg.resume_from_reset else "")
        if "optimizer" in self.cfg.resume_from_reset:
            optimizer.state.clear()  # AdamW starts its moments anew at the next step
        if "data" in self.cfg.resume_from_reset:
            state.loader, state.step, state.tokens_seen = None, 0, 0
            state.train_state.pop("guard", None)  # its window names the parent's steps and data
        self.last.saved_step = None  # nothing of this lineage is saved yet
        return state

    def _start_over(self, fresh: Callable[[], None] | None) -> None:
        """Every rank: undo a failed load's partial writes into the weights (``fresh``)."""
        if fresh is None:  # a caller that cannot re-initialise must not train on a half-loaded model
            raise RuntimeError("every checkpoint failed its checks after part of one was loaded, and "
                               "restore() was given no fresh() to re-initialise the model")
        log.info("re-initialising the weights: the failed load left part of a checkpoint in them")
        fresh()

    def _restore_local(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                       scaler: torch.amp.GradScaler | None, check: Callable | None) -> tuple[ResumeState | None, bool]:
        """Every rank: restore the newest local save every rank holds (its own pieces, or a peer's
        replica of the same save: pieces of another save of the step count as missing), when it is
        at least as new as the newest durable checkpoint; None: use the durable tier (all ranks
        agree). The flag: a load failed (the live state holds part of it)."""
        world = self.ctx.world_size
        held, holding = agreed(self.ctx, self.local.url, lambda: (
            local_tier.held_steps(self.local, self.ctx.rank, world), replicas.holdings(self.local, world)))
        # rank 0 alone receives every rank's holdings (small: steps kept x owners on the node) and
        # plans; the plan every rank needs names one holder per rank: O(world) bytes per rank once
        # per start (~10 bytes a rank), where all-gathering the holdings was world x holdings
        reports = self.ctx.gather_object(holding)
        plan = rank0_decides(self.ctx, lambda: replicas.plan_sources(reports, world))
        if plan is None:
            if self.ctx.is_main and any(layout.parse_step(n) is not None for n in self.local.list_dirs("")):
                log.info("no local checkpoint is held whole by the ranks for %d rank(s) (own pieces or peer "
                         "replicas; another world size never is): resuming from the durable tier", world)
            return None, False
        step, save_id, source = plan
        if any(h != o for o, h in source.items()):
            if not self._repair_from_peers(step, save_id, source):
                return None, False
        else:  # nothing moves between ranks; a rank may still hold its own part as a replica here
            _, problem = self._attempt(lambda: replicas.repair(self.local, step, save_id, source, self.ctx.rank, None),
                                       (StorageError, OSError, CorruptCheckpoint))
            if problem:
                log.warning("local step %d could not be used (%s): resuming from the durable tier", step, problem)
                return None, False
        held = local_tier.held_steps(self.local, self.ctx.rank, world)
        common = newest_held_by_all(self.ctx, held)  # (step, save id) every rank holds
        if common is None:
            return None, False
        step, save_id = common
        choice = rank0_decides(self.ctx, lambda: self._local_choice(step, save_id))
        if choice is None:
            return None, False
        store = local_tier.WithSmallFiles(self.local, choice.pop("files"))
        state = self._load(choice, model, optimizer, scaler, check, store)
        if state is None:
            log.warning("the local checkpoint of step %d could not be restored: trying the durable tier", step)
        self.last.saved_step = None  # the durable tier may lack this step: a stop signal now must save it
        return state, state is None

    def _repair_from_peers(self, step: int, save_id: str | None, source: dict[int, int]) -> bool:
        """Every rank: the ranks missing their own pieces of local step ``step`` (save ``save_id``) receive them from
        the peers that hold them (``replicas.repair``, rounds of simultaneous transfers), unless a durable checkpoint is newer.
        False: use the durable tier (every rank alike)."""
        if rank0_decides(self.ctx, lambda: self._durable_newer(step, "local step %d (held by peers)")):
            return False
        t0 = time.perf_counter()
        got, problem = self._attempt(
            lambda: replicas.repair(self.local, step, save_id, source, self.ctx.rank, self.local_group))
        if problem:
            log.warning("local step %d could not be gathered from the peers (%s): resuming from the durable "
                        "tier", step, problem)
            return False
        self.last.peer_bytes = got
        if self.ctx.is_main:  # (the bytes received over the ranks: in ``restore``'s summary, one sum for both)
            moved = sorted(o for o, h in source.items() if h != o)
            log.info("local step %d: the pieces of rank(s) %s came from peers (%s, in %.2f s); "
                     "0 bytes from the durable tier", step, ", ".join(map(str, moved)),
                     ", ".join(f"rank {o} from rank {source[o]}" for o in moved), time.perf_counter() - t0)
        return True

    def _local_choice(self, step: int, save_id: str | None) -> dict | None:
        """Rank 0: the local step (save ``save_id``, the one every rank's marker names) unless a
        durable checkpoint is newer; its small files, to broadcast."""
        if self._durable_newer(step, "local step %d"):
            return None
        name = layout.step_name(step)
        try:
            manifest = layout.read_manifest(self.local, name)
            if manifest.get("save_id") != save_id:  # the ranks' pieces are of another save of this step
                raise ValueError(f"its manifest is of save {manifest.get('save_id')}, the ranks' markers name {save_id}")
            files = {f"{name}/{rel}": read_small(self.local, name, manifest, rel) for rel in local_tier.SMALL_FILES}
        except Transient:  # an outage is not a bad checkpoint: never skip one for it
            raise
        except (ValueError, StorageError) as exc:
            log.warning("local checkpoint %s/%s is not usable: %s", self.local.url, name, exc)
            return None
        return {**self._choice(local_tier.WithSmallFiles(self.local, files), None, name, manifest),
                "files": files}

    def _load(self, choice: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler | None, check: Callable | None, store=None) -> ResumeState | None:
        """Every rank: load one checkpoint (from ``store``, default the choice's); None when some
        rank found it corrupted or missing (all agree)."""
        store = store if store is not None else self.store if choice["root"] is None else open_store(choice["root"])
        name, manifest, where = choice["name"], choice["manifest"], choice["where"]
        step = int(manifest["step"])
        if check is not None:
            check(choice["train_state"], step, where)
        t0 = time.perf_counter()
        net = unwrap(model)
        problem = None
        try:  # the metadata (state files, sidecars) and the data fail alike: a damaged file falls back
            plan = prepare(store, name, manifest, net, optimizer, self.ctx.rank, self.ctx.world_size)
            self.last.bytes_read = read(plan, store, name, self.ctx.rank, self.pool)
        except Exception as exc:  # every failure is agreed below: no rank may wait for one that raised
            problem = (_read_failure_kind(exc), f"{type(exc).__name__}: {exc}")
        bad = [(r, p) for r, p in enumerate(reports_if_any(self.ctx, problem)) if p]
        fatal = next(((r, p) for r, p in bad if p[0] != "corrupt"), None)
        if fatal is not None:  # not the checkpoint's bytes: falling back would not help
            rank, (kind, why) = fatal
            message = f"resuming from {where} failed on rank {rank}: {why}"
            raise {"transient": lambda m: Transient(where, m), "user": UserError}.get(kind, RuntimeError)(message)
        if bad:
            rank, (_, why) = bad[0]
            log.warning("checkpoint %s failed its checks on %d rank(s) (rank %d: %s): every rank falls "
                        "back to the previous checkpoint", where, len(bad), rank, why)
            return None
        group = self.group()  # every rank is here: the checks above are agreed
        raw = agreed(self.ctx, where, lambda: finish(plan, net, optimizer, group))
        if scaler is not None and raw.get("scaler"):
            scaler.load_state_dict(raw["scaler"])
        self.last.saved_step = step
        if choice["root"] is None and store is self.store:
            self.last.newest = step
        saved_world = saved_world_size(manifest)
        if saved_world != self.ctx.world_size and self.ctx.is_main:
            log.warning("checkpoint %s was saved by %d rank(s), this run has %d: RNG states not "
                        "restored (data order depends only on the seed and the loader position)",
                        where, saved_world, self.ctx.world_size)
        self.last.last_load = {"metadata_bytes_parsed": plan.metadata_bytes_parsed, "metadata_s": plan.metadata_s,
                               "saved_ranks_read": plan.saved_ranks_read, "bytes_read": self.last.bytes_read}
        ts = raw.get("train_state") or {}
        log.info("resumed from %s (step %d) in %.1f s, %.1f MB read by this rank", where, step,
                 time.perf_counter() - t0, self.last.bytes_read / 1e6)
        return ResumeState(path=where, step=int(ts.get("step", step)), tokens_seen=int(ts.get("tokens_seen", 0)),
                           run_id=ts.get("run_id"), loader=ts.get("loader"),
                           rng=raw.get("rng"), saved_world_size=saved_world, train_state=ts)

    def _choose(self, resume: str, failed: set[str]) -> dict | None:
        """Rank 0: clean up unfinished saves of this lineage's location (its lease makes them
        ours), then pick the checkpoint (manifest + sizes only): this lineage's newest, else the
        ``ckpt.resume_from`` one; an explicit ``ckpt.resume`` path wins."""
        listing = layout.scan(self.store)  # one listing for the clean-up and the choice (S3: one LIST)
        removed = [name for name in listing.unfinished if self.tidy.attempt(
            self.store, f"remove the unfinished save {name}", self.store.delete_prefix, name + "/")]
        if removed:
            log.info("removed %d unfinished save(s) under %s: %s", len(removed), self.store.url, ", ".join(removed))
        if resume == "never":
            log.info("ckpt.resume=never: lineage %s starts fresh in %s (earlier checkpoints are left "
                     "untouched)", self.identity.lineage, self.store.url)
            return None
        if resume != "auto":
            return self._explicit("ckpt.resume", resume, failed)
        while True:  # a checkpoint whose train state cannot be read is passed over like a damaged one
            choice = layout.find_latest(self.store, failed, lineage=self.identity.lineage, skip_unsafe=True,
                                        listing=listing)
            if choice.name is None:
                break
            try:
                return self._choice(self.store, None, choice.name, choice.manifest)
            except (CorruptCheckpoint, ValueError) as exc:
                log.warning("skipping checkpoint %s/%s: %s", self.store.url, choice.name, exc)
                failed.add(choice.name)
        if self.cfg.resume_from:
            return self._explicit("ckpt.resume_from", self.cfg.resume_from, failed)
        return None

    def _explicit(self, key: str, given: str, failed: set[str]) -> dict:
        """Rank 0: the checkpoint a path names (a step directory, or the newest in a run or
        checkpoint location, whatever its lineage); a one-line error when there is none."""
        store, name = layout.resolve_resume(given, key)
        if name is not None:
            manifest, reason = layout.check(store, name)
            if manifest is None:
                raise UserError(f"{key}={given}: checkpoint is not usable: {reason}")
            return self._choice(store, store.url, name, manifest, key, given)
        choice = layout.find_latest(store, failed)
        if choice.name is None:
            raise UserError(f"{key}={given}: no valid checkpoint in {store.url}")
        return self._choice(store, store.url, choice.name, choice.manifest, key, given)

    def _durable_newer(self, step: int, what: str) -> bool:
        """Rank 0: whether a durable step is newer than local ``step`` (said, ``what`` naming it)."""
        durable = layout.committed_steps(self.store)
        if durable and durable[-1][0] > step:
            log.info(f"{what} is older than durable step %d: resuming from the durable tier", step, durable[-1][0])
            return True
        return False

    def _attempt(self, fn: Callable[[], Any], catch: tuple[type[BaseException], ...] = (Exception,)) -> tuple:
        """Every rank: ``(fn(), None)``, else the first failed rank's problem (agreed: all fall back)."""
        result, problem = None, None
        try:
            result = fn()
        except catch as exc:  # agreed below: no rank goes on alone
            problem = f"rank {self.ctx.rank} on {self.ctx.env.hostname}: {type(exc).__name__}: {exc}"
        return result, next((p for p in reports_if_any(self.ctx, problem) if p), None)

    @staticmethod
    def _choice(store, root: str | None, name: str, manifest: dict, key: str = "ckpt.resume",
                given: str = "auto") -> dict:
        return {"root": root, "name": name, "manifest": manifest, "where": f"{store.url}/{name}",
                "train_state": peek_train_state(store, name, manifest), "key": key, "given": given,
                "lineage": layout.checkpoint_lineage(store, name, manifest)}


def rank0_decides(ctx, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only and broadcast its result (or its error) to every rank."""
    outcome: tuple[str, Any] | None = None
    if ctx.is_main:
        try:
            outcome = ("ok", fn())
        except UserError as exc:
            outcome = ("user", exc)  # the exception itself: a storage outage keeps its exit code
        except Exception as exc:
            outcome = ("bug", f"{type(exc).__name__}: {exc}")
            if not ctx.initialized:
                raise
            log.exception("checkpoint decision failed on rank 0")
    kind, value = ctx.broadcast_object(outcome)
    if kind == "user":
        raise value
    if kind == "bug":
        raise RuntimeError(f"rank 0 could not choose a checkpoint: {value}")
    return value


def any_rank(ctx, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (every rank calls): one all_reduce MAX of one number,
    8 bytes per rank whatever the world size. The agreements of a restore ask this first and
    gather every rank's report (O(world) per rank) only when some rank has one to give."""
    return bool(ctx.all_reduce_max([float(flag)])[0])


def reports_if_any(ctx, report: Any) -> list[Any]:
    """Every rank's ``report`` in rank order when some rank's is not None, else [] (every rank
    calls; ``any_rank`` first, so the usual case moves one number per rank)."""
    return ctx.all_gather_object(report) if any_rank(ctx, report is not None) else []


def newest_held_by_all(ctx, held: list) -> Any:
    """The newest item (a ``(step, save id)``) every rank's ``held`` has (every rank calls), without gathering
    them: rank 0's list is broadcast (its local steps: bounded by ``ckpt.local_keep`` and the
    replicas it keeps, not by the world size), each rank marks those it lacks, and one all_reduce
    MAX of the marks leaves the items every rank holds: O(local_keep) bytes per rank."""
    if not ctx.initialized:
        return max(held, default=None)
    ref = ctx.broadcast_object(sorted(set(held), key=repr) if ctx.is_main else None)
    if not ref:
        return None
    mine = set(held)
    lacking = ctx.all_reduce_max([0.0 if item in mine else 1.0 for item in ref])
    common = [item for item, lack in zip(ref, lacking) if not lack]
    return max(common) if common else None


def agreed(ctx, where: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank, then agreement: all go on, or all raise (naming the rank that failed)."""
    failure, result = None, None
    try:
        result = fn()
    except Exception as exc:  # agreed below, so no rank waits on one that failed
        failure = exc
    if any_rank(ctx, failure is not None):  # one number per rank; the reports only when one failed
        ctx.agree(failure)  # ranks that loaded fine raise, naming the rank that did not
    if isinstance(failure, Transient):
        raise failure  # retryable: exit 203, not 2
    if isinstance(failure, UserError):
        raise UserError(f"resuming from {where} failed: {failure}") from None
    if failure is not None:
        raise failure
    return result
