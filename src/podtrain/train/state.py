"""The training state that saving, recovery and the guard read and change: typed, in three parts.

* ``RunProgress``: where the run stands (optimizer steps done, tokens trained on). The loop
  advances it, a checkpoint saves it, a resume or a guard rollback sets it back. The data
  position is the loader's own (``ShardedLoader.state_dict``: epoch, samples consumed).
* ``Learner``: what trains: the model, its optimizer and the ``Stepper`` that steps them (with
  the strategy, the fp16 grad scaler, the guard's judge and the interval's statistics).
* ``TrainState``: those two and the components the training path shares: the config, the process
  group, the loader, the checkpointer and its save schedule, the guard, the goodput ledger, the
  stop signal and the metrics file.

``TrainResult`` is what a finished (or stopped) run reports back to its caller.

``Trainer.setup`` (``podtrain.train.loop``) builds each component, owns its lifetime (``close``
on every exit path) and hands the finished set to the loop as one ``TrainState``;
``train/saving.py`` and ``train/recovery.py`` take it (or, during set-up, the few parts that
exist by then) instead of the trainer itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.interval import SaveSchedule
from podtrain.config import RunConfig
from podtrain.data.loader import ShardedLoader
from podtrain.distributed.group import DistContext
from podtrain.observe.metrics import MetricsWriter
from podtrain.train.goodput import GoodputClock
from podtrain.train.guard import Guard, StepJudge
from podtrain.train.signals import StopSignal
from podtrain.train.step import Stepper
from podtrain.train.strategy import Strategy


@dataclass
class RunProgress:
    """Where the run stands; the same on every rank.

    Attributes:
        step: optimizer steps completed (a resumed run starts at its checkpoint's).
        tokens_seen: tokens trained on over all ranks (global batch x sequence length per step).
    """

    step: int = 0
    tokens_seen: int = 0

    def advance(self, tokens: int) -> None:
        """One optimizer step over ``tokens`` tokens is done."""
        self.step += 1
        self.tokens_seen += tokens


@dataclass
class Learner:
    """What trains: a checkpoint holds the model's and the optimizer's state (and the scaler's).

    Attributes:
        model: the model checkpoints save and restore (the strategy's sharded one under fsdp/hsdp;
            the unwrapped one under ddp: DDP's wrapper shares its parameters).
        optimizer: AdamW over the model's parameters (under fsdp/hsdp: its shards).
        stepper: runs the optimizer steps (``podtrain.train.step``).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    stepper: Stepper

    @property
    def strategy(self) -> Strategy:
        """How the model is spread over the ranks (ddp, fsdp, hsdp)."""
        return self.stepper.strategy

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """fp16's grad scaler (checkpointed), else None."""
        return self.stepper.scaler

    @property
    def judge(self) -> StepJudge | None:
        """The guard's device half (its history is checkpointed), None when ``guard.enabled`` is off."""
        return self.stepper.judge


@dataclass
class TrainState:
    """Everything the training path shares after set-up; see the module docstring.

    Attributes:
        cfg: the run's config (a checkpoint records it; a resume compares against it).
        ctx: this rank's process-group context.
        run_id: the run's id across its restarts (its checkpoints' lineage).
        progress: where the run stands.
        learner: model, optimizer, stepper.
        loader: the training batches and their position in the data.
        checkpointer: saves and restores (``podtrain.ckpt.checkpointer``).
        saves: which steps save to the durable tier (``ckpt.every``).
        guard: the host half of the spike guard (bad steps, rollbacks, data to skip).
        goodput: where the attempt's wall time went.
        stop_signal: the scheduler's stop signals, agreed by all ranks at step boundaries.
        metrics: ``RUN_DIR/metrics.jsonl`` (rank 0 writes; elsewhere a no-op).
    """

    cfg: RunConfig
    ctx: DistContext
    run_id: str
    progress: RunProgress
    learner: Learner
    loader: ShardedLoader
    checkpointer: Checkpointer
    saves: SaveSchedule
    guard: Guard
    goodput: GoodputClock
    stop_signal: StopSignal
    metrics: MetricsWriter


@dataclass
class TrainResult:
    """What a finished (or stopped) run reports back to its caller.

    Attributes:
        step: optimizer steps completed.
        exit_code: 0 when finished, the requeue code when stopped by a signal.
        final_loss: last logged training loss (token-weighted over ranks), or None.
        val_loss: last validation loss, or None.
        val_bpb: last validation bits per byte, or None.
        left_running: the stop's deadline passed with storage work still running in daemon
            threads (a storage that never answers): the CLI then exits at once (``loop.run``).
    """

    step: int
    exit_code: int = 0
    final_loss: float | None = None
    val_loss: float | None = None
    val_bpb: float | None = None
    left_running: bool = False
