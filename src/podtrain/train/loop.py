"""``podtrain train CONFIG [k=v ...]``: the readable DDP loop every rank runs.

``Trainer.run`` is the textbook loop on one screen: batch -> step -> log -> eval -> checkpoint,
with the stop signal agreed by all ranks at each step boundary. The work lives in ``setup`` (model,
its dist.strategy: DDP, FSDP2 or HSDP, optimizer, data, resume) and in the modules it calls.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch

from podtrain import __version__
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.interval import SaveSchedule
from podtrain.config import RunConfig, dump_config, ignored_data_path, load_config, to_dict
from podtrain.data.doc_mask import mask_kind
from podtrain.data.loader import ShardedLoader
from podtrain.data.manifest import tokenizer_identity
from podtrain.data.mixture import entropy_clause, ledger_fields, ledger_line
from podtrain.data.sources import shared_manifests
from podtrain.distributed import fd_limit
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext, cap_cpu_threads, collective_timeout, process_group
from podtrain.distributed.health import write_verdict
from podtrain.distributed.placement import placement_line
from podtrain.distributed.timing import step_clock
from podtrain.distributed.watchdog import Watchdog
from podtrain.errors import UserError
from podtrain.fsutil import writable_dir
from podtrain.storage import shared_s3_clients
from podtrain.launch import exit_report
from podtrain.model import model_size
from podtrain.observe.console import Progress, setup_logging
from podtrain.observe.hardware import max_memory_bytes, peak_flops
from podtrain.observe.metrics import MetricsWriter, open_run_metrics
from podtrain.observe.profile import StepProfiler, parse_steps
from podtrain.train.stragglers import StragglerMonitor
from podtrain.train.evaluations import Evaluations, describe
from podtrain.train.gc_schedule import GcSchedule
from podtrain.train.goodput import GoodputClock
from podtrain.train.interval import LogInterval
from podtrain.train.gpu_defaults import apply_gpu_defaults, set_allocator_default
from podtrain.train.guard import Guard, StepJudge
from podtrain.train.hf_init import initialise_from_folder
from podtrain.train.optim import build_optimizer, schedule_lr, set_lr
from podtrain.train.precision import resolve_precision
from podtrain.train.preflight import check_run
from podtrain.train.recovery import restore_checkpoint, review_skipped_steps, skipped_steps
from podtrain.train.replicas import check_all_parameters_used, check_replicas
from podtrain.train import saving
from podtrain.train.signals import StopSignal
from podtrain.train.state import Learner, RunProgress, TrainResult, TrainState
from podtrain.train.step import Stepper
from podtrain.train.strategy import Strategy, build_for_strategy, build_strategy, checkpoint_activations

log = logging.getLogger("podtrain")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``podtrain train CONFIG [section.key=value ...]``."""
    parser.add_argument("config", help="YAML config file (see configs/demo.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")


def run(args: argparse.Namespace) -> int:
    """CLI entry: load and validate the config, then train on this rank (telling ``launch local``
    how it ended: ``launch/exit_report.py``)."""
    env = ClusterEnv.detect()
    with exit_report.recording(env.rank) as report:
        cfg = load_config(args.config, args.overrides)
        result = train(cfg, env)
        report.code, report.step = result.exit_code, result.step
    if result.left_running:
        # The stop's deadline left a request to a storage that does not answer in a daemon thread:
        # the interpreter's teardown (the S3 client's native threads) can wait on it for seconds
        # past the grace period (measured: 4-6 s), so this process ends here, its output flushed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(result.exit_code)
    return result.exit_code


def train(cfg: RunConfig, env: ClusterEnv | None = None) -> TrainResult:
    """Train with ``cfg`` on this rank; every rank of the job calls this."""
    env = env or ClusterEnv.detect()
    setup_logging(env.rank)
    cap_cpu_threads(env.local_world_size, cfg.dist.threads_per_rank)
    set_allocator_default()  # expandable segments, before CUDA starts (the user's own setting wins)
    # The run's stores (data, checkpoints) share one S3 client per endpoint, released at its end.
    with shared_s3_clients(), process_group(env, cfg.dist.backend, collective_timeout(cfg.dist.init_timeout_s),
                                            collective_timeout(cfg.dist.timeout_s)) as ctx:
        trainer = Trainer(cfg, ctx)
        try:
            trainer.setup()
            return trainer.run()
        except BaseException as exc:
            # The traceback's frames hold the Stepper and so DDP's reducer; freeing them lets the
            # reducer go before destroy_process_group (a gloo reducer left to interpreter exit can deadlock
            # joining its thread while holding the GIL).
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            trainer.close()


class Trainer:
    """One rank's training: ``setup`` builds the components (and ``close`` releases them on every
    exit path); ``run`` is the loop over the ``TrainState`` they make up (``train/state.py``)."""

    def __init__(self, cfg: RunConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.run_dir = Path(cfg.run.dir)
        self.progress = RunProgress()
        self.run_id = uuid.uuid4().hex[:12]
        # Built by setup(), in this order; None until then (close() runs on any exit path).
        self.loader: ShardedLoader | None = None
        self.evals: Evaluations | None = None
        self.accum = 1
        self.accumulate_unsharded = True
        self.precision = None
        self.gpu_defaults = ""
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.size = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.strategy: Strategy | None = None
        self.stepper_model: torch.nn.Module | None = None
        self.stepper: Stepper | None = None
        self.peak: float | None = None
        self.checkpointer: Checkpointer | None = None
        self.watchdog: Watchdog | None = None
        self.stop_signal: StopSignal | None = None
        self.straggler: StragglerMonitor | None = None
        self._straggler_report: dict[str, Any] | None = None
        self.metrics: MetricsWriter | None = None
        self.console: Progress | None = None
        self.profiler: StepProfiler | None = None
        self.result = TrainResult(step=0)
        self.goodput = GoodputClock(time.time())
        self.gc = GcSchedule(cfg.train.gc_every)
        """The garbage collector at agreed step boundaries (``train.gc_every``), from the first step on."""
        self.guard: Guard | None = None
        self.saves: SaveSchedule | None = None
        self.state: TrainState | None = None
        """What the loop, saving and recovery share; the end of ``setup`` makes it."""
        self.stop_deadline = None
        """After a stop signal: the one deadline of the stop path (``saving.stop_deadline``)."""

    # -- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """Model, strategy, optimizer, data, checkpoint restore: everything before the first step.

        First what each rank can check alone (config against data and model, memory, shards),
        then one agreement, so a mistake seen by one rank stops every rank at once instead of
        leaving the others in a collective until the timeout.
        """
        cfg, ctx = self.cfg, self.ctx
        self._start_watchdog()
        manifests = shared_manifests(cfg.data, ctx)  # S3 data: rank 0 lists and reads, all receive
        ctx.agree_on(lambda: self._setup_local(manifests))
        if cfg.data.verify:  # each rank hashes every world_size-th shard: the read is shared out
            ctx.agree_on(lambda: self.loader.sources.verify(part=(ctx.rank, ctx.world_size)))
        if cfg.dist.strategy == "ddp":  # fsdp/hsdp: every rank's shards come from rank 0's model
            check_replicas(self.model, ctx, before_ddp=True)
        # Every rank must accumulate the same way (FSDP's collectives differ): unsharded only
        # where it fits on every rank's device.
        self.accumulate_unsharded = all(ctx.all_gather_object(self.accumulate_unsharded))
        self.stepper_model = self._wrap(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optim, ctx.device)  # FSDP: over the shards
        self.stepper = Stepper(self.stepper_model, self.strategy, self.optimizer,
                               self.strategy.forward_precision(self.precision), cfg.train.grad_clip,
                               ctx.world_size, cfg.train.global_batch_size * cfg.data.seq_len, ctx.device,
                               clock=step_clock(ctx.device), recorder=ctx.recorder,
                               judge=StepJudge(cfg.guard, ctx.device) if cfg.guard.enabled else None)
        learner = Learner(self.model, self.optimizer, self.stepper)
        self.peak = peak_flops(ctx.device, self.precision.name, cfg.log.peak_flops)
        self._setup_checkpoints(learner)
        self._setup_straggler_monitor()
        if ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.run_dir / "config.yaml")
            self.goodput.load_history(self.run_dir / "metrics.jsonl")
        self.metrics = open_run_metrics(self.run_dir, ctx.is_main, cfg.log.trackers, self.run_id,
                                        to_dict(cfg), self.progress.step, self.progress.tokens_seen)
        self.profiler = StepProfiler(parse_steps(cfg.profile.steps), self.run_dir / "profile", ctx.rank,
                                     ctx.device, cfg.profile.cuda_memory)
        self.state = TrainState(cfg, ctx, self.run_id, self.progress, learner, self.loader, self.checkpointer,
                                self.saves, self.guard, self.goodput, self.stop_signal, self.metrics)
        self._log_start()

    def _setup_local(self, manifests: list | None = None) -> None:
        """Everything without a collective: data, model, optimizer; raises on a user mistake.
        ``manifests``: the S3 sources' as rank 0 read them (``shared_manifests``)."""
        cfg, ctx = self.cfg, self.ctx
        writable_dir(self.run_dir)  # a read-only or full disk fails now, not at the first save
        fd_limit.ensure(fd_limit.sockets_needed(
            ctx.world_size, ctx.rank, fd_limit.side_groups(bool(cfg.ckpt.local_dir), ctx.backend),
            main_gloo=ctx.backend == "gloo"), ctx.env.hostname)
        checked = check_run(cfg, ctx.world_size, ctx.env.local_world_size, ctx.device, manifests=manifests)
        self.accum = checked.accum
        self.accumulate_unsharded = checked.accumulate_unsharded
        self.loader = ShardedLoader(
            None, cfg.data.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size,
            ctx.rank, ctx.world_size, cfg.run.seed, prefetch=cfg.data.prefetch,
            num_workers=cfg.data.num_workers, pin_memory=ctx.is_cuda, sources=checked.sources,
            document_masks=mask_kind(cfg.model.attn_implementation, ctx.device, checked.model_config)
            if cfg.data.document_masking else None)
        self.evals = Evaluations(cfg.eval, checked.val_indexes, checked.sources, cfg.train.micro_batch_size,
                                 self.loader.masker)
        self.precision = resolve_precision(cfg.train.precision, ctx.device)
        self.gpu_defaults = apply_gpu_defaults(self.precision.name, ctx.device)  # TF32 on Ampere+ under fp32
        self.model, self.reference = build_for_strategy(checked.model_config, cfg.model.attn_implementation,
                                                        cfg.run.seed, cfg.dist.strategy, ctx,
                                                        random_init=not cfg.model.init_from)
        self.size = model_size(self.model, checked.model_config, cfg.data.seq_len)
        if cfg.train.activation_checkpointing == "full":
            checkpoint_activations(self.model)
        if cfg.dist.strategy == "ddp" and not cfg.dist.find_unused_parameters:
            # DDP's reducer needs every parameter used (FSDP2 does not; a full local backward
            # there would hold whole fp32 gradients that the sharding is meant to avoid).
            check_all_parameters_used(self.model, cfg.data.seq_len, ctx.device)

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The dist.strategy's wrapping (DDP, FSDP2 or HSDP; one process: none), each decoder
        block compiled first when train.compile asks."""
        self.strategy = build_strategy(self.cfg.dist, self.ctx, self.precision, self.cfg.data.seq_len,
                                       self.accumulate_unsharded, self.cfg.train.compile, self.cfg.train.fp8)
        if self.cfg.model.init_from and hasattr(self.strategy, "fill_weights"):
            self.strategy.fill_weights = False  # every weight is loaded next: the folder's or a resume's
        wrapped = self.strategy.wrap(model, self.reference)
        self.reference = None  # rank 0's whole copy, no longer needed
        return wrapped

    def _setup_checkpoints(self, learner: Learner) -> None:
        """The checkpointer, the restore (config check, load, optimizer hyperparameters, replica
        check) and what starts from the restored step: the guard's memory, the save schedule."""
        cfg, ctx = self.cfg, self.ctx
        self.checkpointer = Checkpointer(self.run_dir, cfg.ckpt, ctx)
        self.run_id = self.checkpointer.identity.lineage  # the run's id across its restarts
        resumed = restore_checkpoint(cfg, ctx, learner, self.checkpointer,
                                     tokenizer_identity(self.loader.manifest.tokenizer))
        if resumed is None and cfg.model.init_from:  # a fresh start only: a resume never re-reads the folder
            initialise_from_folder(cfg.model.init_from, learner, self.checkpointer, ctx)
        self.goodput.note_restore(self.checkpointer.restore_budget)  # seconds and bytes by source
        self.guard = Guard(cfg.guard, self.run_dir, ctx.is_main)
        if resumed is not None:
            saving.apply_resume(resumed, self.progress, self.loader, ctx.device)
            saving.restore_guard(learner.judge, self.guard, resumed.train_state.get("guard"))
        self.saves = SaveSchedule(cfg.ckpt, self.progress.step)
        self.stop_signal = StopSignal(cfg.ckpt.signals)

    def _start_watchdog(self) -> None:
        """Watch start-up too (dist.init_timeout_s until the first step, then dist.timeout_s)."""
        if self.cfg.monitor.watchdog:
            self.watchdog = Watchdog(self.run_dir / "debug", self.ctx.rank, self.cfg.dist.init_timeout_s,
                                     self.cfg.dist.timeout_s, recorder=self.ctx.recorder,
                                     host=self.ctx.env.hostname, run_dir=self.run_dir).start()

    def _setup_straggler_monitor(self) -> None:
        mcfg = self.cfg.monitor
        if mcfg.straggler_every and self.ctx.world_size > 1 and self.strategy.sharded:
            log.info("straggler reports are off under dist.strategy=%s: its per-layer collectives make "
                     "every rank's step equally long (`podtrain doctor` finds a slow rank)", self.strategy.name)
        elif mcfg.straggler_every and self.ctx.world_size > 1:
            self.straggler = StragglerMonitor(self.ctx, mcfg.straggler_every, mcfg.straggler_threshold,
                                              clock=self.stepper.clock)

    def _log_start(self) -> None:
        cfg, ctx, size = self.cfg, self.ctx, self.size
        if ctx.env.local_rank == 0:
            # One line per node, printed even where ranks log warnings only: the topology users got.
            print(placement_line(ctx), flush=True)
        log.info("podtrain %s | %d rank(s), backend %s, device %s, precision %s, strategy %s%s", __version__,
                 ctx.world_size, ctx.backend, ctx.device.type, self.precision.name, self.strategy.describe(),
                 f" | {self.gpu_defaults}" if self.gpu_defaults else "")
        log.info("model %s: %.2fM parameters, %.1f MFLOPs/token | global batch %d x %d tokens = "
                 "%d micro-batch%s of %d on each rank", cfg.model.init_from or cfg.model.preset, size.params / 1e6,
                 size.flops_per_token / 1e6, cfg.train.global_batch_size, cfg.data.seq_len,
                 self.accum, "" if self.accum == 1 else "es", cfg.train.micro_batch_size)
        log.info("data %s: %d samples per epoch | run dir %s", self.loader.sources.describe(),
                 self.loader.samples_per_epoch, self.run_dir)
        if ctx.is_main and (ignored := ignored_data_path(cfg.data)):
            log.warning(ignored)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train to ``train.steps``: batch -> step -> log -> eval -> checkpoint."""
        cfg, ctx, state = self.cfg, self.ctx, self.state
        progress, loader, stepper = state.progress, state.loader, state.learner.stepper
        total, tokens_per_step = cfg.train.steps, cfg.train.global_batch_size * cfg.data.seq_len
        self.console = Progress(cfg.log.progress, total, progress.step, enabled=ctx.is_main)
        self.gc.start()  # set-up's objects frozen, automatic collection off (train/gc_schedule.py)
        if progress.step >= total:
            log.info("nothing to do: the run is at step %d of train.steps=%d (raise train.steps to "
                     "continue, or use a new run.dir)", progress.step, total)
            state.goodput.nothing_done()  # a no-op attempt is no lost time: the run's goodput stays
        else:
            state.goodput.start_steps()
        interval = LogInterval(time.perf_counter(), sync_start=stepper.clock.total_sync_wait_s)
        while progress.step < total:
            if self._should_stop():
                return self._stop_for_signal()
            state.guard.skip_data(loader)
            start = loader.consumed
            with self.profiler.around(progress.step + 1):  # a no-op outside profile.steps
                batch = loader.next()
                set_lr(state.learner.optimizer, schedule_lr(cfg.optim, progress.step, total))
                stepper.step(batch.micro_batches)
            progress.advance(tokens_per_step)
            interval.add(batch.wait_s)
            interval.exclude(self.profiler.take_write_s())
            state.guard.note(progress.step, start, batch.consumed)
            state.goodput.step_done(progress.step)
            if self.watchdog is not None:
                self.watchdog.beat(progress.step)
            if self.straggler is not None:
                self._observe_straggler(batch.wait_s)
            ctx.startup_done()  # this process's first step (resumed or not): the steady-state timeout
            last = progress.step == total
            if progress.step % cfg.log.every == 0 or last:
                self._log_interval(interval)
                interval = LogInterval(time.perf_counter(), sync_start=stepper.clock.total_sync_wait_s)
            # The checkpoint before the evaluation: an evaluation that fails (memory, a task's
            # bug) must not cost the steps since the last save, at every restart again.
            if tier := saving.due(state, total):
                interval.exclude(saving.save(state, tier, must=last) or 0.0)
            # At this boundary on every rank alike: a save is a point they all wait at anyway.
            self.gc.after_step(progress.step, agreed_point=bool(tier))
            if self.evals.due(progress.step, last):
                interval.exclude(state.goodput.add("eval", self._evaluate(last)))
        state.stop_signal.drain()
        self._summary()
        return self.result

    def _should_stop(self) -> bool:
        """At a step boundary, on every rank: did any rank get a stop signal (or did a background
        save fail: raised here)? (The seam where tests inject faults, see tests/fault_plugin.)"""
        return saving.should_stop(self.state)

    def _summary(self) -> None:
        """Rank 0's closing lines: goodput, final losses against the corpus's unigram entropy."""
        if not self.ctx.is_main:
            return
        state, result = self.state, self.result
        state.metrics.write(state.goodput.closing_record(state.progress.step, "finished"))
        self.console.note(state.goodput.summary_line())
        self.console.note(ledger_line(state.loader.ledger()))
        if result.final_loss is None:
            return
        sources = state.loader.sources
        entropy = entropy_clause(sources.manifests, [spec.weight for spec in sources.specs])  # reads no shard
        of = "the training data" if len(sources.specs) == 1 else "the training blend (data.mix, by weight)"
        val = (f"{result.val_loss:.4f} nats ({result.val_bpb:.4f} bits/byte)"
               if result.val_loss is not None else "n/a")
        self.console.note(
            f"done: {state.progress.step} steps, {state.progress.tokens_seen:,} tokens | train loss "
            f"{result.final_loss:.4f} nats, validation loss {val} | unigram entropy of "
            f"{of} {entropy}")

    # -- the loop's parts ----------------------------------------------------------------------
    def _log_interval(self, interval: LogInterval) -> None:
        state, cfg, ctx = self.state, self.cfg, self.ctx
        step, stepper = state.progress.step, state.learner.stepper
        loss, grad_norm = stepper.stats.read(ctx.all_reduce_sum)
        if not math.isfinite(loss) and not cfg.guard.enabled:
            raise UserError(f"training loss is {loss} at step {step}: lower optim.lr or check the data")
        skipped = skipped_steps(state)
        record = interval.record(
            step=step, loss=loss, grad_norm=grad_norm, lr=state.learner.optimizer.param_groups[0]["lr"],
            tokens_per_step=cfg.train.global_batch_size * cfg.data.seq_len,
            flops_per_token=self.size.flops_per_token, world_size=ctx.world_size, peak=self.peak,
            sync_total_s=stepper.clock.total_sync_wait_s, max_mem_bytes=max_memory_bytes(ctx.device),
            tokens_seen=state.progress.tokens_seen, epoch=state.loader.epoch, run_id=state.run_id)
        if self._straggler_report:
            record.update(self._straggler_report)
            self._straggler_report = None
        record.update(state.goodput.record(), **ledger_fields(state.loader.ledger()), skipped_steps=len(skipped),
                      skipped_total=state.guard.skipped_total + len(skipped))  # review() adds them
        state.metrics.write(record)
        self.console.update(record)
        self.result.final_loss = loss if math.isfinite(loss) else self.result.final_loss
        self.result.step = step
        state.saves.check_grace(state.checkpointer.last_save)
        review_skipped_steps(state, skipped)

    def _observe_straggler(self, wait_s: float) -> None:
        """Feed this step's data wait to the straggler monitor (the step clock has the rest);
        every N steps it compares ranks (one small all_gather on every rank) and its report joins
        the next metrics line."""
        step = self.state.progress.step
        self.straggler.observe_wait(wait_s)
        report = self.straggler.maybe_report(step)
        if report:
            self._straggler_report = report
            if report["straggler_rank"] is not None and self.ctx.is_main:  # for the scheduler
                write_verdict(self.run_dir, "straggler", report["straggler_host"], report["straggler_rank"],
                              {"step": step, "excess": report["straggler_excess"],
                               "busy_by_rank": report["busy_by_rank"]})

    def _evaluate(self, last: bool) -> float:
        """Validation and lm-eval tasks (``train/evaluations.py``); their batches beat the watchdog."""
        state = self.state
        step = state.progress.step
        record = self.evals.run(step, last, state.learner.model, self.ctx, state.learner.stepper.precision,
                                self.watchdog)
        if "val_loss" in record:
            self.result.val_loss, self.result.val_bpb = record["val_loss"], record["val_bpb"]
        state.metrics.write({"kind": "eval", "step": step, **record, "tokens_seen": state.progress.tokens_seen,
                             "run_id": state.run_id, "time": time.time()})
        self.console.note(f"step {step}: {describe(record)}")
        return record["eval_s"]

    def _stop_for_signal(self) -> TrainResult:
        """Checkpoint this step on every rank (within the grace period), then end the job with
        the requeue status."""
        state = self.state
        self._stop_watchdog()  # the final write may take longer than a step may
        self.stop_deadline = saving.stop_deadline(state)  # close() shares it: one bound for the whole stop
        saving.save_for_stop(state, self.stop_deadline)
        state.metrics.write(state.goodput.closing_record(state.progress.step, state.stop_signal.ending))
        self.ctx.barrier()  # every rank has its part on disk
        if self.ctx.env.launcher == "torchrun" and self.ctx.env.local_rank == 0:
            # torchrun would take our non-zero exit for a crash and restart the workers (with
            # --max-restarts left); a SIGTERM tells its agent to stop this node instead.
            os.kill(os.getppid(), signal.SIGTERM)
        self.result.exit_code = state.stop_signal.exit_code
        self.result.step = state.progress.step
        return self.result

    def close(self) -> None:
        """Release everything on every exit path: saves finish, threads stop, DDP goes first.

        A failed background save surfaces here (on every rank alike); the rest is released anyway.
        """
        self._stop_watchdog()  # the last save's write and teardown are not steps
        if self.stop_deadline is None and self.state is not None and self.stop_signal is not None \
                and self.stop_signal.requested:  # a signal, then an error before the stop's own save
            self.stop_deadline = saving.stop_deadline(self.state)
        try:
            if self.checkpointer is not None:
                self.result.left_running = not self.checkpointer.close(deadline=self.stop_deadline)
        finally:
            self._release()

    def _stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def _release(self) -> None:
        self.gc.close()  # Python's collector as it was before this training
        if self.profiler is not None:
            self.profiler.finish()  # a run stopped inside profile.steps keeps the steps it traced
        if self.loader is not None:
            self.loader.close()
        if self.console is not None:
            self.console.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.stop_signal is not None:
            self.stop_signal.restore()
        # Drop DDP (and its reducer) before the process group is destroyed (the exit deadlock above).
        if self.strategy is not None:
            self.strategy.release()
        self.stepper_model = None
        self.stepper = None
        self.state = None  # its learner holds the stepper too
