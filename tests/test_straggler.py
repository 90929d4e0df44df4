"""Straggler reports: a slow rank 1 is named, with its host, on real gloo ranks."""

from __future__ import annotations

import logging
import time

import pytest

from multirank import run_ranks
from podtrain.train.precision import resolve_precision
from podtrain.train.step import Stepper
from podtrain.train.strategy import DDPStrategy
from podtrain.train.stragglers import StragglerMonitor, find_straggler


def test_find_straggler_against_the_median():
    assert find_straggler([1.0, 1.0, 1.05, 1.0], 0.10) == (None, pytest.approx(0.05))
    assert find_straggler([1.0, 1.0, 1.5, 1.0], 0.10) == (2, pytest.approx(0.5))
    assert find_straggler([0.0, 0.0], 0.1) == (None, 0.0)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _ctx():
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import process_group

    return process_group(ClusterEnv.detect(), "gloo")


# Sleeps large against a busy 2-core machine's scheduling delays (tens of ms at worst): the
# straggler's steps take several times the other rank's, so the checks below hold under load.
BASE_S, SLOW_S = 0.02, 0.25


def _sleepy_rank(rank, world, data_slow):
    """Rank 1 sleeps SLOW_S more per step, in its data loading or in its compute; no sync in a
    step."""
    capture = _Capture()
    logging.getLogger("podtrain.train.stragglers").addHandler(capture)
    with _ctx() as ctx:
        monitor = StragglerMonitor(ctx, every=3, threshold=0.10)
        reports = []
        for step in range(1, 7):
            t0 = time.perf_counter()
            if rank == 1 and data_slow:
                time.sleep(SLOW_S)
            wait = time.perf_counter() - t0
            time.sleep(BASE_S + (SLOW_S if rank == 1 and not data_slow else 0.0))
            monitor.observe(time.perf_counter() - t0, wait)
            reports.append(monitor.maybe_report(step))
    return reports, capture.messages, ctx.env.hostname


@pytest.mark.parametrize("data_slow", [False, True])
def test_sleep_on_rank_1_is_named(data_slow):
    (reports, warnings, host), (reports1, warnings1, _) = run_ranks(_sleepy_rank, 2, data_slow)
    assert [i + 1 for i, r in enumerate(reports) if r is not None] == [3, 6]
    for report in (reports[2], reports[5]):
        assert report["straggler_rank"] == 1 and report["straggler_host"] == host
        steps = report["step_time_by_rank"]
        assert steps[1] > 2 * steps[0]  # nominally 270 ms against 20 ms
        assert steps[1] >= 0.9 * SLOW_S
        # Two ranks: the excess over the median is (slow - fast) / (slow + fast), > 1/3 above.
        assert report["straggler_excess"] == pytest.approx(
            (steps[1] - steps[0]) / (steps[1] + steps[0]), abs=1e-3)
        waits = report["data_wait_by_rank"]
        assert len(waits) == 2
        if data_slow:
            assert waits[1] >= 0.9 * SLOW_S and waits[1] > 2 * waits[0]
        else:
            assert waits[1] < 0.5 * SLOW_S
    assert reports1[2] == reports[2] and reports1[5] == reports[5]  # every rank gets the same
    assert len(warnings) == 2 and "rank 1 on host " + host in warnings[0]
    assert ("waiting for data" if data_slow else "likely compute") in warnings[0]
    assert warnings1 == []  # only rank 0 logs


def _ddp_rank(rank, world):
    """Real DDP through the real Stepper and its host step clock (the CPU side of the timing;
    on a GPU the same points are CUDA events): the slow rank's whole-step time equals the
    others' (the sync waits for it); the clock's sync wait is what tells them apart."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from podtrain.distributed.timing import HostStepClock
    from test_ddp_step import GLOBAL, SEQ, make

    with _ctx() as ctx:
        model, _, _ = make(world, False)
        ddp = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        seen = []  # the synchronised gradients, captured just before the optimizer applies them
        opt.register_step_pre_hook(lambda *_: seen.append(
            torch.cat([p.grad.flatten() for p in model.parameters()])))
        stepper = Stepper(ddp, DDPStrategy.of(ddp), opt,
                          resolve_precision("fp32", torch.device("cpu")), grad_clip=0.0,
                          world_size=world, global_target_tokens=GLOBAL * SEQ,
                          device=torch.device("cpu"), clock=HostStepClock(), recorder=ctx.recorder)
        if rank == 1:  # slow compute before the gradient sync
            model.register_forward_pre_hook(lambda *_: time.sleep(SLOW_S))
        monitor = StragglerMonitor(ctx, every=6, threshold=0.10, clock=stepper.clock)
        rows = torch.randint(0, 64, (GLOBAL // world, SEQ + 1), generator=torch.Generator().manual_seed(rank))
        report = None
        for step in range(1, 7):
            stepper.step([rows])
            monitor.observe_wait(0.0)
            report = monitor.maybe_report(step) or report
        grad = seen[-1]
        syncs = [e for e in ctx.recorder.snapshot() if e["caller"].startswith("DDP gradient")]
        del ddp, stepper
    return report, grad, syncs


def test_ddp_straggler_is_found_through_the_sync_wait():
    import torch

    (report, grad0, syncs), (_, grad1, _) = run_ranks(_ddp_rank, 2)
    assert report["straggler_rank"] == 1
    steps = report["step_time_by_rank"]
    assert min(steps) >= 0.9 * SLOW_S and abs(steps[0] - steps[1]) < 0.5 * min(steps)  # alike...
    sync, busy = report["sync_wait_by_rank"], report["busy_by_rank"]
    assert sync[0] > 0.5 * steps[0] and sync[0] > 2 * sync[1]  # ...as rank 0 waits for rank 1
    assert busy[1] >= 0.9 * SLOW_S and busy[1] > 2 * busy[0]
    # DDP's own AllReduce (no comm hook): the gradients are averaged alike on both ranks.
    torch.testing.assert_close(grad0, grad1)
    # One record per step's gradient sync (not one per bucket), each finished.
    assert len(syncs) == 6 and all(e["op"] == "all_reduce" and e["state"] == "done" for e in syncs)
    assert syncs[0]["bytes"] == grad0.numel() * 4
