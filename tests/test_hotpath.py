"""The hot path's bookkeeping, on real gloo ranks: lazy step timing, a watchdog that sees a queued
collective that never finishes, constant buffers checked before DDP skips their broadcast, and a
process group at world size 1 under torchrun."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import transformers.models.llama.modeling_llama  # noqa: F401  (imported before the ranks fork)

from multirank import run_ranks
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import needs_process_group, process_group
from podtrain.distributed.recorder import CollectiveRecorder
from podtrain.distributed.timing import CudaStepClock, HostStepClock, step_clock
from podtrain.distributed.watchdog import HANG_EXIT_CODE, Watchdog


# -- timing ---------------------------------------------------------------------------------------
def test_host_clock_sync_wait_runs_from_the_last_gradient_to_the_synced_point():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    clock = HostStepClock()
    assert clock.watch_backward(model) is not None
    for _ in range(3):
        clock.start_step()
        model(torch.arange(8)).sum().backward()  # the hook marks the embedding's gradient
        time.sleep(0.05)  # stands for waiting in the gradient sync
        assert clock.synced() is None  # host work is complete: no probe needed
        clock.end_step()
    times = clock.take()
    assert times.steps == 3
    assert 3 * 0.045 <= times.sync_wait_s <= times.step_s
    assert times.compute_s == pytest.approx(times.step_s - times.sync_wait_s)
    assert times.compute_s < 0.5 * times.sync_wait_s  # the tiny backward is far shorter
    assert clock.take().steps == 0  # taken: new sums start


class _FakeCudaEvent:
    """Stands in for torch.cuda.Event (no GPU here): a timestamp at record, completed when the
    test says so, elapsed_time in milliseconds like CUDA's; synchronize must never be called."""

    done_before = 0.0  # events recorded at or before this (fake) time count as completed
    now = 0.0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = _FakeCudaEvent.now

    def query(self):
        return self.t is not None and self.t <= _FakeCudaEvent.done_before

    def elapsed_time(self, other):
        assert self.query() and other.query(), "read before completion"
        return (other.t - self.t) * 1000.0

    def synchronize(self):
        raise AssertionError("the clock must not block the host")


def test_cuda_clock_folds_steps_lazily_without_sync_fake_cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    clock = CudaStepClock()
    for step in range(3):  # device times: start 10s*k, backward +1, synced +3, end +4
        for offset, mark in ((0, clock.start_step), (1, clock.backward_done)):
            _FakeCudaEvent.now = 10 * step + offset
            mark()
        _FakeCudaEvent.now = 10 * step + 3
        probe = clock.synced()
        assert probe is not None and not probe.query()  # the record's probe: still in flight
        _FakeCudaEvent.now = 10 * step + 4
        clock.end_step()
        if step == 1:
            _FakeCudaEvent.done_before = 14  # the device finished the first two steps
    first = clock.take()
    assert (first.steps, first.step_s, first.sync_wait_s) == (2, 8.0, 4.0)
    assert clock.take().steps == 0  # step 3 is still running: counted later, never waited for
    _FakeCudaEvent.done_before = 100
    assert (clock.take().steps, step_clock(torch.device("cpu")).__class__) == (1, HostStepClock)


# -- the watchdog on asynchronous collectives ----------------------------------------------------------
def _queued_but_unfinished(rank, world, debug_dir):
    """Rank 0 queues an all_reduce that rank 1 joins only 4 s later; rank 0's host keeps
    beating, as a host that queued NCCL work does. Its watchdog must fire on the work object."""
    import torch.distributed as dist

    fired = []
    if rank == 1:
        time.sleep(4.0)
        dist.all_reduce(torch.ones(2))
        return fired, None
    recorder = CollectiveRecorder()
    dog = Watchdog(debug_dir, rank, startup_timeout_s=30, step_timeout_s=0.6, recorder=recorder,
                   exit_grace_s=0, exit_fn=fired.append)
    dog.beat(0)
    dog.start()
    pending = recorder.begin("all_reduce", torch.ones(2), caller="stop agreement")
    work = dist.all_reduce(torch.ones(2), async_op=True)
    pending.track(work)
    start = time.monotonic()
    while not fired and time.monotonic() - start < 3.5:
        dog.beat(1)  # the host still completes "steps"
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    dog.stop()
    work.wait()
    done_after = recorder.snapshot()[-1]["state"]
    return fired, (elapsed, done_after)


@pytest.mark.slow
def test_watchdog_fires_on_a_queued_collective_that_never_finishes(tmp_path):
    (fired, (elapsed, done_after)), _ = run_ranks(_queued_but_unfinished, 2, str(tmp_path))
    assert fired == [HANG_EXIT_CODE]
    assert 0.55 < elapsed < 2.5  # the 0.6 s timeout plus a poll, though the host kept beating
    stacks = (tmp_path / "stacks_rank0.txt").read_text()
    assert "all_reduce (stop agreement) unfinished" in stacks
    record = json.loads((tmp_path / "collectives_rank0.json").read_text())
    assert record["collectives"][-1]["state"] == "in_flight"
    assert record["last_step"] == 1
    assert done_after == "done"  # once the peer joined, the work object says so


# -- constant buffers -------------------------------------------------------------------------------
def _buffer_verdicts(rank, world):
    from podtrain.model import build_model
    from podtrain.train.replicas import buffers_need_forward_sync
    from test_ddp_step import small_config

    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        llama = build_model(small_config(), "eager", seed=0)
        names = [n for n, _ in llama.named_buffers()]
        constant = buffers_need_forward_sync(llama, ctx, seq_len=16)
        # The same model whose rotary buffer one rank built differently: not from the config.
        if rank == 1:
            for _, b in llama.named_buffers():
                b.mul_(1.5)
        differing = buffers_need_forward_sync(llama, ctx, seq_len=16)
    return names, constant, differing


@pytest.mark.slow
def test_ddp_skips_the_buffer_broadcast_only_for_constant_identical_buffers():
    (names, constant, differing), (_, constant1, differing1) = run_ranks(_buffer_verdicts, 2)
    assert any("inv_freq" in n for n in names)  # the rotary buffer exists and is checked
    assert (constant, constant1) == (False, False)  # same on every rank, unchanged by a forward
    assert (differing, differing1) == (True, True)  # every rank agrees to keep syncing


def test_a_forward_that_changes_a_buffer_is_named():
    from podtrain.train.replicas import buffers_changed_by_forward

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, input_ids):
            self.calls += 1
            return type("Out", (), {"logits": self.emb(input_ids)})()

    assert buffers_changed_by_forward(Counting(), 4, torch.device("cpu")) == ["calls"]


# -- a process group at world size 1 under torchrun --------------------------------------------------
def test_only_a_launcher_brings_a_group_at_world_size_one():
    single = ClusterEnv.detect({})
    torchrun_one = ClusterEnv.detect({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert (single.launcher, needs_process_group(single)) == ("single", False)
    assert (torchrun_one.launcher, needs_process_group(torchrun_one)) == ("torchrun", True)


def _one_rank_ddp(rank, world):
    """multirank sets torchrun's variables for 1 rank and creates no group: process_group must."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from test_ddp_step import GLOBAL, SEQ, make
    from podtrain.train.precision import resolve_precision
    from podtrain.train.step import Stepper
    from podtrain.train.strategy import DDPStrategy

    assert not dist.is_initialized()
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        size = dist.get_world_size()
        model, _, _ = make(1, False)
        ddp = DDP(model)
        stepper = Stepper(ddp, DDPStrategy.of(ddp), torch.optim.SGD(model.parameters(), lr=0.1),
                          resolve_precision("fp32", torch.device("cpu")), 1.0, 1, GLOBAL * SEQ,
                          torch.device("cpu"), clock=HostStepClock(), recorder=ctx.recorder)
        rows = torch.randint(0, 64, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(0))
        stepper.step(list(rows.split(2)))  # 4 micro-batches: 3 under no_sync, then the reducer
        syncs = [e for e in ctx.recorder.snapshot() if e["caller"].startswith("DDP gradient")]
        del ddp, stepper
    return ctx.initialized, size, dist.is_initialized(), len(syncs), ctx.env.launcher


def test_torchrun_at_world_size_one_gets_a_group_and_ddp():
    assert run_ranks(_one_rank_ddp, 1) == [(True, 1, False, 1, "torchrun")]


def test_plain_train_without_a_launcher_has_no_group(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        assert (ctx.initialized, ctx.env.launcher) == (False, "single")
    assert os.environ.get("RANK") is None
