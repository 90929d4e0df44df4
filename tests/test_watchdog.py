"""Hang watchdog: a skipped collective ends every rank, with stacks and last collectives dumped."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import time

import pytest

from multirank import free_port
from podtrain.distributed.recorder import CollectiveRecorder
from podtrain.distributed.watchdog import HANG_EXIT_CODE, Watchdog
from podtrain.launch.torchrun import flight_recorder_env

STEP_TIMEOUT_S = 3.0


def test_flight_recorder_env_points_into_debug_dir(tmp_path):
    env = flight_recorder_env(tmp_path / "debug", buffer_size=500)
    assert env["TORCH_FR_BUFFER_SIZE"] == "500"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # deprecated alias: a warning on every rank
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "debug" / "nccl_trace_rank_")


def test_recorder_names_the_caller_and_the_op_in_flight():
    import torch

    rec = CollectiveRecorder(capacity=3)

    def evaluate():
        with rec.begin("all_reduce", torch.zeros(4, 2), skip=0):
            return rec.snapshot()

    inside = evaluate()[-1]
    assert inside["state"] == "in_flight" and inside["op"] == "all_reduce"
    assert inside["shape"] == [4, 2] and inside["dtype"] == "float32" and inside["bytes"] == 32
    assert inside["caller"].endswith("in evaluate")
    for _ in range(5):
        rec.begin("barrier", skip=0)
    snap = rec.snapshot()
    assert [e["seq"] for e in snap] == [4, 5, 6]  # a ring: only the last 3 kept


def _watch(tmp_path, startup, step, beats, beat_every):
    fired = []
    dog = Watchdog(tmp_path, rank=3, startup_timeout_s=startup, step_timeout_s=step,
                   recorder=CollectiveRecorder(), exit_grace_s=0, exit_fn=fired.append).start()
    for i in range(beats):
        time.sleep(beat_every)
        dog.beat(i)
    deadline = time.monotonic() + 3
    while not fired and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.stop()
    return fired


def test_beats_keep_it_quiet_and_silence_fires(tmp_path):
    # 12 beats 0.05 s apart: 0.6 s of training with a 0.3 s step timeout, then silence.
    start = time.monotonic()
    assert _watch(tmp_path, 5.0, 0.3, 12, 0.05) == [HANG_EXIT_CODE]
    assert time.monotonic() - start > 0.6 + 0.3 - 0.05
    text = (tmp_path / "stacks_rank3.txt").read_text()
    assert "step timeout of 0.3 s" in text and "last completed step: 11" in text
    assert "_watch" in text  # the training thread's stack is in the dump
    assert json.loads((tmp_path / "collectives_rank3.json").read_text())["last_step"] == 11


def test_startup_timeout_applies_before_the_first_beat(tmp_path):
    start = time.monotonic()
    assert _watch(tmp_path, 0.4, 60.0, 0, 0) == [HANG_EXIT_CODE]
    assert 0.35 < time.monotonic() - start < 2.5
    assert "start-up timeout of 0.4 s" in (tmp_path / "stacks_rank3.txt").read_text()


# --- real hang: 2 processes, rank 1 skips one collective -------------------------------------

def _train_step(ctx, t):
    ctx.all_reduce_sum(t)  # stands for the gradient AllReduce


def _evaluate(ctx, t):
    ctx.all_reduce_sum(t)  # the validation loss, all-reduced


def _checkpoint(ctx):
    ctx.barrier()


def _hang_rank(rank, world, port, debug_dir):
    """A loop whose rank 1 skips the evaluation all_reduce at step 3 and goes to the barrier."""
    code = 1
    try:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        import torch
        import torch.distributed as dist

        from podtrain.distributed.env import ClusterEnv
        from podtrain.distributed.group import process_group

        torch.set_num_threads(1)
        # A collective timeout far beyond the watchdog's, so only the watchdog can end the wait.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=300))
        with process_group(ClusterEnv.detect(), "gloo") as ctx:
            dog = Watchdog(debug_dir, rank, startup_timeout_s=30, step_timeout_s=STEP_TIMEOUT_S,
                           recorder=ctx.recorder).start()
            t = torch.ones(16)
            for step in range(1, 6):
                _train_step(ctx, t)
                if step == 3 and not rank == 1:
                    _evaluate(ctx, t)
                if step == 3:
                    _checkpoint(ctx)
                dog.beat(step)
        code = 0  # reached only if nothing hung
    finally:
        os._exit(code)


@pytest.mark.slow
def test_skipped_collective_ends_every_rank_with_dumps(tmp_path):
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_hang_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    start = time.monotonic()
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=max(0.1, STEP_TIMEOUT_S + 30 - (time.monotonic() - start)))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    assert time.monotonic() - start < STEP_TIMEOUT_S + 30
    # Both hang and both watchdogs fire; the one that exits second may instead see its collective
    # fail on the closed connection during its grace period (exit 1), its dump already written.
    assert HANG_EXIT_CODE in codes and all(code in (HANG_EXIT_CODE, 1) for code in codes)
    waits = {0: ("_evaluate", "all_reduce"), 1: ("_checkpoint", "barrier")}
    for rank, (function, op) in waits.items():
        stacks = (tmp_path / f"stacks_rank{rank}.txt").read_text()
        assert f"rank {rank} on host" in stacks and "last completed step: 2" in stacks
        assert f"in {function}" in stacks and f"in {op}" in stacks
        record = json.loads((tmp_path / f"collectives_rank{rank}.json").read_text())
        last = record["collectives"][-1]
        assert last["op"] == op and last["state"] == "in_flight"
        assert last["caller"].endswith(f"in {function}")
        assert record["last_step"] == 2

