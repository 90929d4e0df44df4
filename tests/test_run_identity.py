"""Runs never cross: lineage (which checkpoints are a run's), ckpt.resume_from (a branch on
purpose), the lease (one job per run), and the guard's memory in the checkpoint.

Real checkpoints on disk and on a real S3 server (moto); forked gloo ranks where two ranks matter.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from multirank import run_ranks
from podtrain.ckpt import layout
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.lease import LEASE_FILE
from podtrain.config_sections import CkptSection, GuardSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext, process_group
from podtrain.errors import UserError
from podtrain.train.guard import Guard, StepJudge


def _ctx(environ: dict | None = None) -> DistContext:
    return DistContext(env=ClusterEnv.detect(environ or {}), backend="gloo", device=torch.device("cpu"),
                       initialized=False)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _train(net, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    net(torch.randn(4, 64, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _run(run_dir: Path, cfg: CkptSection, steps: range, seed: int = 0, local: set[int] = frozenset()):
    """One run's life: restore, train ``steps`` (saving each, to the local tier for ``local``), close.
    Returns (restored step or None, the run's lineage, the weights at the end)."""
    net, opt = _model(seed)
    ck = Checkpointer(run_dir, cfg, _ctx())
    try:
        state = ck.restore(net, opt, None)
        for step in steps:
            _train(net, opt, step)
            ck.save(step, net, opt, None, {"step": step}, local=step in local)
            ck.wait()
        return (state.step if state else None), ck.identity.lineage, {k: v.clone() for k, v in net.state_dict().items()}
    finally:
        ck.close()


def _snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``roots``: (size, mtime_ns), to show that nothing was touched."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns)
            for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


# -- lineage --------------------------------------------------------------------------------------
def test_a_second_run_from_the_same_base_yaml_starts_fresh_and_leaves_the_first_untouched(tmp_path):
    """Same ckpt.dir and ckpt.local_dir (one base YAML), a new run.dir: run B starts fresh; run A's
    files are byte for byte and time for time as they were; A resumes its own local step after."""
    shared, local = tmp_path / "shared", tmp_path / "nvme"
    cfg = CkptSection(dir=str(shared), local_dir=str(local), local_every=1, keep_last=1)
    _, a, weights_a = _run(tmp_path / "a", cfg, range(1, 5), local={4})  # durable 1..3 (keep 1), local 4
    before = _snapshot(shared, local)
    restored, b, _ = _run(tmp_path / "b", cfg, range(1, 4), seed=1, local={3})
    assert restored is None and b != a  # not A's step 4, not A's lineage
    after = _snapshot(shared, local)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing of A changed or went
    assert [s for s, _ in layout.list_checkpoints(shared)] == [3]  # A's, pruned by A only
    assert [s for s, _ in layout.list_checkpoints(shared / "runs" / b)] == [2]  # B's own (keep 1)
    assert (local / b / "step_000003").is_dir() and (local / a / "step_000004").is_dir()
    assert json.loads((tmp_path / "b" / "lineage.json").read_text())["ckpt_url"] == str(shared / "runs" / b)
    # A restarts: its own lineage, its own newest step (the local one)
    net, opt = _model(7)
    ck = Checkpointer(tmp_path / "a", cfg, _ctx())
    state = ck.restore(net, opt, None)
    ck.close()
    assert ck.identity.lineage == a and state.step == 4
    assert all(torch.equal(net.state_dict()[k], weights_a[k]) for k in weights_a)
    # readers (sample, export, eval, resume_from=RUN_DIR) follow each run to its own checkpoints
    assert layout.run_ckpt_url(tmp_path / "b") == str(shared / "runs" / b)
    assert layout.run_ckpt_url(tmp_path / "a") == str(shared)


def test_manifests_and_local_markers_carry_the_lineage(tmp_path):
    cfg = CkptSection(local_dir=str(tmp_path / "nvme"), local_every=1)
    _, lineage, _ = _run(tmp_path / "run", cfg, range(1, 3), local={2})
    manifest = json.loads((tmp_path / "run" / "ckpt" / "step_000001" / "manifest.json").read_text())
    marker = json.loads((tmp_path / "nvme" / lineage / "step_000002" / "rank_00000.json").read_text())
    assert manifest["lineage"] == marker["lineage"] == lineage and manifest["parent"] is None


def test_resume_from_branches_with_its_own_lineage_and_records_the_parent(tmp_path):
    """ckpt.resume_from: A's weights and optimizer state; B's own lineage with A as parent; a
    restart of B resumes B's checkpoint, not A's again; resume_from_reset=[optimizer] starts
    AdamW anew."""
    _, a, weights_a = _run(tmp_path / "a", CkptSection(), range(1, 4))
    source = str(tmp_path / "a" / "ckpt" / "step_000003")
    cfg = CkptSection(resume_from=source)
    net, opt = _model(5)
    ck = Checkpointer(tmp_path / "b", cfg, _ctx())
    state = ck.restore(net, opt, None)
    b = ck.identity.lineage
    assert state.step == 3 and state.branch and b != a and len(opt.state) == 4  # moments came along
    assert all(torch.equal(net.state_dict()[k], weights_a[k]) for k in weights_a)
    _train(net, opt, 4)
    ck.save(4, net, opt, None, {"step": 4})
    ck.close()
    parent = {"lineage": a, "step": 3, "path": source}
    assert json.loads((tmp_path / "b" / "lineage.json").read_text())["parent"] == parent
    manifest = json.loads((tmp_path / "b" / "ckpt" / "step_000004" / "manifest.json").read_text())
    assert manifest["lineage"] == b and manifest["parent"] == parent
    assert _run(tmp_path / "b", cfg, range(0))[:2] == (4, b)  # its own step 4, not A's step 3
    assert [s for s, _ in layout.list_checkpoints(tmp_path / "a" / "ckpt")] == [1, 2, 3]  # untouched

    net, opt = _model(5)
    ck = Checkpointer(tmp_path / "c", CkptSection(resume_from=str(tmp_path / "a"),
                                                  resume_from_reset=["optimizer", "data"]), _ctx())
    state = ck.restore(net, opt, None)
    ck.close()
    assert state.branch and len(opt.state) == 0 and state.step == 0 and state.loader is None


def test_resume_from_a_missing_checkpoint_is_one_line(tmp_path):
    ck = Checkpointer(tmp_path / "b", CkptSection(resume_from=str(tmp_path / "nowhere")), _ctx())
    try:
        with pytest.raises(UserError, match=r"ckpt.resume_from=.*nowhere: neither a checkpoint"):
            ck.restore(*_model(), None)
    finally:
        ck.close()


# -- lease ----------------------------------------------------------------------------------------
def test_a_second_job_on_one_run_is_refused_in_one_line_while_the_first_goes_on(tmp_path):
    net, opt = _model()
    first = Checkpointer(tmp_path / "run", CkptSection(dir=str(tmp_path / "shared")),
                         _ctx({"SLURM_JOB_ID": "101"}))
    try:
        with pytest.raises(UserError) as info:
            Checkpointer(tmp_path / "run", CkptSection(dir=str(tmp_path / "shared")), _ctx({"SLURM_JOB_ID": "102"}))
        message = str(info.value)
        assert "\n" not in message and "job slurm:101" in message and f"pid {os.getpid()}" in message
        assert "ckpt.lease_timeout_s" in message
        first.save(1, net, opt, None, {"step": 1})  # the first job goes on
        first.wait()
    finally:
        first.close()
    assert [s for s, _ in layout.list_checkpoints(tmp_path / "shared")] == [1]
    assert not (tmp_path / "run" / LEASE_FILE).exists() and not (tmp_path / "shared" / LEASE_FILE).exists()


def _plant_lease(where: Path, host: str, job: str, age_s: float) -> None:
    where.mkdir(parents=True, exist_ok=True)
    now = time.time()
    (where / LEASE_FILE).write_text(json.dumps({"lineage": "x", "job": job, "host": host, "pid": 1,
                                                "started": now - age_s, "heartbeat": now - age_s}))


def test_a_stale_lease_is_taken_over_and_a_restart_of_the_same_job_takes_it_at_once(tmp_path, caplog):
    caplog.set_level("INFO", logger="podtrain.checkpoint")
    run = tmp_path / "run"
    _plant_lease(run, "node-17", "slurm:7", age_s=30)  # another job, alive: refused
    with pytest.raises(UserError, match="in use by job slurm:7 on host node-17"):
        Checkpointer(run, CkptSection(lease_timeout_s=60), _ctx({"SLURM_JOB_ID": "8"}))
    _plant_lease(run, "node-17", "slurm:7", age_s=30)
    Checkpointer(run, CkptSection(lease_timeout_s=60), _ctx({"SLURM_JOB_ID": "7"})).close()  # a requeue of job 7
    assert "from an earlier attempt of this job" in caplog.text
    _plant_lease(run, "node-17", "slurm:7", age_s=30)
    ck = Checkpointer(run, CkptSection(lease_timeout_s=20), _ctx({"SLURM_JOB_ID": "8"}))  # heartbeat too old
    held = json.loads((run / LEASE_FILE).read_text())
    ck.close()
    assert "taking over the lease of job slurm:7 on host node-17" in caplog.text
    assert held["job"] == "slurm:8" and held["pid"] == os.getpid()


def test_the_lease_is_renewed_while_the_run_lives(tmp_path):
    ck = Checkpointer(tmp_path, CkptSection(lease_timeout_s=0.4), _ctx())
    try:
        first = json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"]
        time.sleep(0.5)
        assert json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"] > first
    finally:
        ck.close()


def test_the_lease_on_s3_refuses_a_second_job_and_is_released(tmp_path, s3_bucket):
    url = f"s3://{s3_bucket}/ckpt"
    first = Checkpointer(tmp_path / "run", CkptSection(dir=url), _ctx({"SLURM_JOB_ID": "1"}))
    try:
        assert first.store.exists(LEASE_FILE)
        with pytest.raises(UserError, match=f"{url} is in use by job slurm:1"):
            # another run.dir (so its own run-dir lease is free), the same lineage's location
            (tmp_path / "other").mkdir()
            (tmp_path / "other" / "lineage.json").write_text((tmp_path / "run" / "lineage.json").read_text())
            Checkpointer(tmp_path / "other", CkptSection(dir=url), _ctx({"SLURM_JOB_ID": "2"}))
    finally:
        first.close()
    assert not first.store.exists(LEASE_FILE)


# -- a failure while reading one rank's share is agreed by every rank ------------------------------
def _read_fails_on_rank1(rank, world, run_dir):
    import podtrain.ckpt.restore as checkpointer  # the resume half of Checkpointer

    if rank == 1:  # the fault: this rank's read raises a user error (e.g. its node's credentials)
        def refuse(*args, **kwargs):
            raise UserError("s3://bucket/x: access denied on rank 1's node")
        checkpointer.read = refuse
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        net, opt = _model()
        ck = Checkpointer(Path(run_dir), CkptSection(), ctx)
        try:
            ck.restore(net, opt, None)
        except UserError as exc:
            return str(exc)
        finally:
            ck.close()
    return None


@pytest.mark.slow
def test_a_user_error_reading_one_ranks_share_stops_every_rank_at_once(tmp_path):
    _run(tmp_path, CkptSection(), range(1, 2))
    t0 = time.monotonic()
    errors = run_ranks(_read_fails_on_rank1, 2, str(tmp_path), timeout=60)
    assert time.monotonic() - t0 < 30  # no rank waited for a collective timeout
    for err in errors:
        assert "failed on rank 1" in err and "access denied" in err


# -- the guard's memory is part of the checkpoint -------------------------------------------------
def test_a_spike_right_after_a_resume_is_skipped_as_in_the_uninterrupted_run():
    cfg = GuardSection(history=8, spike_factor=5.0, window=50, max_skips=3)
    norms = [1.0 + 0.01 * i for i in range(12)] + [50.0, 1.1, 1.2, 60.0, 1.0]
    uninterrupted = StepJudge(cfg, torch.device("cpu"))
    expected = [bool(uninterrupted.judge(torch.tensor(n))) for n in norms]
    assert expected[12] and expected[15] and sum(expected) == 2

    for cut in (5, 12, 13):  # save after step `cut`, resume in a new judge
        before = StepJudge(cfg, torch.device("cpu"))
        got = [bool(before.judge(torch.tensor(n))) for n in norms[:cut]]
        state = json.loads(json.dumps(before.state_dict()))  # through the checkpoint's JSON
        after = StepJudge(cfg, torch.device("cpu"))
        after.load_state_dict(state)
        got += [bool(after.judge(torch.tensor(n))) for n in norms[cut:]]
        assert got == expected, cut

    guard = Guard(cfg, Path("/nonexistent"), is_main=False)
    guard.note(12, 100, 104)
    guard.review([12], 12, order=None)
    resumed = Guard(cfg, Path("/nonexistent"), is_main=False)
    resumed.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert resumed.skipped_total == 1 and list(resumed._recent_bad) == [12]
    assert resumed._positions == {12: (100, 104)}


def test_a_job_whose_lease_was_taken_over_learns_it_and_every_rank_agrees_to_stop(tmp_path):
    from podtrain.train.signals import StopSignal

    ck = Checkpointer(tmp_path, CkptSection(lease_timeout_s=0.2), _ctx())
    try:
        assert ck.lease_lost is None
        _plant_lease(tmp_path, "node-3", "slurm:99", age_s=0)  # another job took the run over
        deadline = time.monotonic() + 5
        while ck.lease_lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "taken over by job slurm:99 on host node-3" in ck.lease_lost
    finally:
        ck.close()
    assert json.loads((tmp_path / LEASE_FILE).read_text())["job"] == "slurm:99"  # theirs stays
    stop = StopSignal([])
    assert stop.should_stop(_ctx(), False, lease_lost=True) and stop.lease_lost_agreed
