"""One optimizer step: micro-batches under ``no_sync``, loss normalised globally, clip, AdamW.

Gradient arithmetic: every target token of the global batch weighs the same. Rank ``r`` backprops
``loss_sum_r * world_size / global_target_tokens``; DDP averages gradients over ranks (divides by
``world_size``), so the synchronised gradient is ``sum_r loss_sum_r / global_target_tokens``: the
gradient of the mean loss over the whole global batch, exactly what one process would compute on
the concatenated batch.

Communication is the strategy's (``podtrain.train.strategy``): under DDP all micro-batches but the
last run under ``no_sync()`` (gradients accumulate locally) and the last one's backward all-reduces
the buckets, overlapped with the backward itself; under FSDP/HSDP the last one's backward
reduce-scatters layer by layer (and, with room to spare, the ones before neither reduce nor
reshard). Every strategy divides the summed gradient by the world size, so the arithmetic below
holds for all of them.

Host syncs: none. Loss and gradient norm accumulate in device tensors that the loop reads only at
log intervals (``StepStats.read``). Step and sync-wait times go to a ``StepClock`` (host clocks on
the CPU, CUDA events on a GPU, read lazily), and each step's gradient sync is one entry of the
collective record, tracked until the device finished it (``distributed/timing.py``,
``distributed/recorder.py``),
with the guard's per-step verdicts (``podtrain.train.guard``: a skipped step's loss and norm are
left out of the interval's means).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from podtrain.data.doc_mask import DocumentRows, document_loss_sum
from podtrain.distributed.recorder import CollectiveRecorder
from podtrain.distributed.timing import HostStepClock
from podtrain.model import unwrap
from podtrain.train.guard import StepJudge
from podtrain.train.loss import micro_batch_loss_sum
from podtrain.train.precision import Precision
from podtrain.train.skip import fused_step, poison_gradients, require_found_inf_skip
from podtrain.train.strategy import Strategy


@dataclass
class StepStats:
    """Device-side running sums since the last read (no host sync until ``read``)."""

    device: torch.device
    loss_sum: torch.Tensor = field(init=False)
    grad_norm_sum: torch.Tensor = field(init=False)
    tokens: int = 0
    steps: int = 0
    verdicts: list = field(default_factory=list)
    """One device bool per step since the last read: the guard skipped it."""
    skipped: list = field(default_factory=list)
    """The last ``read``'s verdicts as host booleans."""

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new interval."""
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.grad_norm_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.tokens = 0
        self.steps = 0
        self.verdicts = []

    def read(self, all_reduce_sum) -> tuple[float, float]:
        """(token-weighted mean loss over all ranks, mean grad norm) for the interval; resets.

        ``all_reduce_sum`` is the context's collective: every rank must call ``read`` together.
        """
        tokens = torch.tensor(float(self.tokens), dtype=torch.float64, device=self.device)
        packed = torch.stack([self.loss_sum, tokens])
        all_reduce_sum(packed)
        # The gradient norm is the same on every rank after the AllReduce: no need to reduce it,
        # and reading it (and the guard's verdicts) with the losses keeps this to one host sync
        # per interval.
        verdicts = [v.double().view(1) for v in self.verdicts]
        loss_sum, tokens_all, grad_norm_sum, *flags = torch.cat(
            [packed, self.grad_norm_sum.view(1), *verdicts]).tolist()
        self.skipped = [bool(f) for f in flags]
        good = self.steps - sum(self.skipped)
        tokens_all *= good / max(1, self.steps)  # every step has the same number of tokens
        grad_norm = grad_norm_sum / good if good else float("nan")
        self.reset()
        return (loss_sum / tokens_all if tokens_all else float("nan")), grad_norm


class Stepper:
    """Runs optimizer steps for a wrapped (DDP, FSDP/HSDP; optionally compiled) model.

    Args:
        model: the module to call forward on (``strategy.wrap``'s; train.compile compiled its blocks).
        strategy: what synchronises the gradients and measures their norm
            (``podtrain.train.strategy``; ``Strategy()`` for one process).
        optimizer: AdamW over the model's (for FSDP: sharded) parameters.
        precision: autocast policy; fp16 brings a GradScaler.
        grad_clip: max global gradient norm; 0 disables clipping (the norm is still reported).
        world_size: number of ranks (every strategy divides gradients by it).
        global_target_tokens: target tokens per optimizer step over all ranks.
        clock: times each step and its sync wait (``distributed.timing.step_clock``); default
            host clocks.
        recorder: the collective record that gets one entry per gradient sync (None: none).
    """

    def __init__(self, model: nn.Module, strategy: Strategy, optimizer: torch.optim.Optimizer,
                 precision: Precision, grad_clip: float, world_size: int,
                 global_target_tokens: int, device: torch.device,
                 clock: HostStepClock | None = None, recorder: CollectiveRecorder | None = None,
                 judge: StepJudge | None = None):
        self.model, self.strategy, self.optimizer = model, strategy, optimizer
        self.precision = precision
        self.scaler = precision.grad_scaler()
        self.grad_clip = grad_clip if grad_clip > 0 else float("inf")
        self.loss_scale = world_size / global_target_tokens
        self.device = device
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.stats = StepStats(device)
        # DDP's gradient_as_bucket_view: gradients are zeroed in place rather than set to None,
        # so they stay views of the buckets (no reallocation and copy into them every step).
        self.grads_to_none = strategy.grads_to_none
        self.clock = clock or HostStepClock()
        if not strategy.sharded:
            # FSDP interleaves the reduce-scatters with backward: there is no moment when this
            # rank's own backward is done and the sync not begun, so its sync wait reads 0.
            self.clock.watch_backward(unwrap(model))
        self.recorder = recorder if strategy.sync_op is not None else None
        self._grad_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.judge = judge
        self.fused = bool(optimizer.defaults.get("fused"))
        if judge is not None and self.fused and self.scaler is None:
            require_found_inf_skip(optimizer, device)  # fails in one line if torch dropped it
        self._one = torch.ones((), device=device)
        self._by_size = sorted(self.params, key=lambda p: p.numel())  # the cheapest to poison first
        self._step_loss = torch.zeros((), dtype=torch.float64, device=device)

    def step(self, micro_batches: list[torch.Tensor]) -> None:
        """Forward/backward every micro-batch, then one optimizer step (learning rate preset)."""
        self.clock.start_step()
        self.accumulate(micro_batches)
        self.apply()
        self.clock.end_step()

    def accumulate(self, micro_batches: list[torch.Tensor]) -> None:
        """Forward/backward of every micro-batch; gradients are synchronised after the last."""
        last = len(micro_batches) - 1
        step_loss = self._step_loss.zero_()
        for i, rows in enumerate(micro_batches):
            rows = rows.to(self.device, non_blocking=True)
            sync = None
            if i == last and self.recorder is not None:
                # One record per step, not a Python comm hook per bucket: DDP's C++ AllReduce runs.
                sync = self.recorder.begin(self.strategy.sync_op, nbytes=self._grad_bytes,
                                           caller=f"{self.strategy.name.upper()} gradient sync "
                                           f"({'every layer' if self.strategy.sharded else 'all buckets'})")
            with self.strategy.micro_batch(i == last):
                if isinstance(rows, DocumentRows):  # data.document_masking: the loader's positions and mask
                    loss_sum = document_loss_sum(self.model, rows, self.precision)
                else:
                    loss_sum = micro_batch_loss_sum(self.model, rows, self.precision)
                scaled = loss_sum * self.loss_scale
                if i == last and self.judge is not None:
                    # A non-finite loss here makes this rank's gradients NaN, so the AllReduce
                    # carries the verdict to every rank's gradient norm (no extra collective).
                    scaled = scaled * self.judge.poison(step_loss + loss_sum.detach())
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            if i == last:
                if self.strategy.sharded:
                    self.clock.backward_done()
                probe = self.clock.synced()
                if sync is not None:
                    sync.track(probe) if probe is not None else sync.done()
            step_loss += loss_sum.detach()
            self.stats.tokens += rows.shape[0] * (rows.shape[1] - 1)

    def apply(self) -> None:
        """Clip (fp16: on the scaled gradients, with the unscaled norm), optimizer step (skipped
        on the device when the guard says so: ``podtrain.train.skip``), clear gradients."""
        # fp16: the scale as a device tensor through the public API (no host read), so the guard
        # judges the unscaled norm and scaler.step does the unscaling (and its non-finite check).
        scale = self.scaler.scale(self._one) if self.scaler else None
        norm = self.strategy.clip(self.params, self.grad_clip, scale)  # inf: measure, touch no gradient
        bad = self.judge.judge(norm) if self.judge is not None else None
        if self.scaler:
            if bad is not None:
                poison_gradients(self._by_size, bad)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif bad is None:
            self.optimizer.step()
        elif self.fused:
            fused_step(self.optimizer, bad)  # skipped on the device (contract checked in __init__)
        elif not bool(bad):  # foreach AdamW cannot skip on the device: one host read per step
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.grads_to_none)
        self.strategy.after_optimizer_step()  # train.fp8 under fsdp: the weights' FP8 scales
        if bad is None:
            self.stats.loss_sum += self._step_loss
            self.stats.grad_norm_sum += norm.detach().double()
        else:
            self.stats.loss_sum += torch.where(bad, 0.0, self._step_loss)
            self.stats.grad_norm_sum += torch.where(bad, 0.0, norm.detach().double())
            self.stats.verdicts.append(bad)
        self.stats.steps += 1
