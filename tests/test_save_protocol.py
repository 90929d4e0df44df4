"""The durable save's phases (prepare, write, commit, publish, retain) keep what is committed.

- After the manifest (the commit), nothing fails the save: a refused ``latest`` or retention delete
  is a warning, and the checkpoint just committed is never deleted (it used to be, with
  ``keep_last=1`` leaving nothing at all).
- A bucket that refuses DeleteObject (object lock, a policy without ``s3:DeleteObject``): every save
  commits, retention says once that it cannot delete, and the run resumes from its newest step.
- A job whose lease another job took over writes and deletes nothing in the step directory, checked
  on every rank's behalf before any rank writes (prepare) and again before the manifest (commit).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from multirank import run_ranks
from s3_fault_proxy import s3_proxy  # noqa: F401 (fixture)
from podtrain.ckpt import layout
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.writer import CheckpointWriter, SaveFailed
from podtrain.config_sections import CkptSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext, process_group
from podtrain.model import build_model, preset_config
from podtrain.storage import open_store
from podtrain.storage.errors import AccessDenied, Transient

VOCAB = 320


def single_ctx() -> DistContext:
    return DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)


def tiny():
    model = build_model(preset_config("tiny", VOCAB), seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def state(step: int) -> dict:
    return {"step": step, "tokens_seen": 8 * step, "loader": {"epoch": 0, "consumed": step}}


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("podtrain.checkpoint").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("podtrain.checkpoint").removeHandler(self)


def _fail_calls(monkeypatch, method: str, match: str, exc: Exception, times: int = 1) -> list[str]:
    """Make ``PosixStore.method`` raise ``exc`` on its first ``times`` calls whose name contains ``match``."""
    from podtrain.storage.posix import PosixStore

    original, seen = getattr(PosixStore, method), []

    def failing(self, name, *args, **kwargs):
        if match in name and len(seen) < times:
            seen.append(name)
            raise exc
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(PosixStore, method, failing)
    return seen


@pytest.mark.parametrize("method,match,exc", [
    ("delete_prefix", "step_000001/", Transient("x", "SlowDown (injected), the retry budget is spent")),
    ("delete", "step_000001/manifest.json", AccessDenied("x", "AccessDenied (injected)")),
    ("write_bytes", "latest", Transient("x", "SlowDown (injected), the retry budget is spent")),
], ids=["retention-delete-transient", "retention-manifest-denied", "latest-transient"])
def test_a_failure_after_the_commit_never_deletes_the_checkpoint(tmp_path, monkeypatch, method, match, exc):
    model, opt = tiny()
    ck = Checkpointer(tmp_path, CkptSection(keep_last=1, async_save=False), single_ctx())
    ck.save(1, model, opt, None, state(1))
    seen = _fail_calls(monkeypatch, method, match, exc)
    with Messages() as said:
        ck.save(2, model, opt, None, state(2))  # no exception: the commit stands
    ck.close()
    assert seen, "the fault was not reached"
    store = open_store(str(tmp_path / "ckpt"))
    assert [s for s, _ in layout.committed_steps(store)][-1] == 2
    assert layout.find_latest(store).step == 2
    assert any("could not" in line and "training goes on" in line for line in said.lines), said.lines
    again = Checkpointer(tmp_path, CkptSection(keep_last=1), single_ctx())
    try:
        assert again.restore(*tiny(), None).step == 2
    finally:
        again.close()


@pytest.mark.parametrize("match,phase", [("meta_00000.json", "write"), ("step_000001/manifest.json", "commit")],
                         ids=["sidecar", "manifest"])
def test_a_failed_save_names_its_phase_and_leaves_no_step(tmp_path, monkeypatch, match, phase):
    seen = _fail_calls(monkeypatch, "write_bytes", match, OSError(28, "No space left on device (injected)"))
    model, opt = tiny()
    ck = Checkpointer(tmp_path, CkptSection(async_save=False), single_ctx())
    try:
        with pytest.raises(SaveFailed, match=rf"step 1 failed at its {phase} \(rank 0 on .*No space left on device"):
            ck.save(1, model, opt, None, state(1))
    finally:
        ck.close()
    assert seen == [match if "/" in match else f"step_000001/{match}"]
    assert not (tmp_path / "ckpt" / "step_000001").exists()  # a failure before the commit leaves nothing


def test_a_bucket_that_denies_deletes_commits_every_save_and_says_it_once(tmp_path, s3_proxy, s3_bucket):
    s3_proxy.fail_with(403, "AccessDenied", "Access Denied")
    s3_proxy.fail_only(None, methods=("DELETE",))
    s3_proxy.outage(True)  # every DELETE, nothing else
    url = f"s3://{s3_bucket}/ckpt"
    cfg = CkptSection(dir=url, keep_last=1, async_save=False)
    model, opt = tiny()
    with Messages() as said:
        ck = Checkpointer(tmp_path / "run", cfg, single_ctx())
        for step in (1, 2, 3):
            assert ck.save(step, model, opt, None, state(step))
        ck.close()
    store = open_store(url)
    assert [s for s, _ in layout.committed_steps(store)] == [1, 2, 3]  # none could be deleted; all committed
    assert s3_proxy.stats()["failed"] >= 2  # retention did try (and was refused)
    refusals = [line for line in said.lines if "could not delete" in line]
    assert len(refusals) == 1 and "access denied" in refusals[0].lower(), said.lines
    again = Checkpointer(tmp_path / "run", cfg, single_ctx())
    try:
        assert again.restore(*tiny(), None).step == 3
    finally:
        again.close()


def _take_over(run_dir: Path) -> None:
    """Another job takes the run's lease (as after a partition longer than the lease timeout)."""
    lease = run_dir / "lease"
    body = json.loads(lease.read_text())
    body.update(job="other-job", host="other-host", pid=1, started=time.time(), heartbeat=time.time())
    tmp = lease.with_name(".lease.takeover")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, lease)


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _taken_before_the_save(rank, world, run_dir):
    run_dir = Path(run_dir)
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, opt = tiny()
        ck = Checkpointer(run_dir, CkptSection(async_save=False), ctx)
        theirs = run_dir / "ckpt" / "step_000005"
        if rank == 0:
            _take_over(run_dir)
            theirs.mkdir(parents=True)  # the new holder's save of the same step, in progress
            (theirs / "rank_00000.safetensors").write_bytes(b"their bytes")
        ctx.barrier()
        before = _files(theirs)
        try:
            ck.save(5, model, opt, None, state(5))
            error = None
        except SaveFailed as exc:
            error = str(exc)
        finally:
            ck.discard()
            ck.close()
        return error, _files(theirs) == before


def test_a_job_that_lost_its_lease_writes_and_deletes_nothing_in_the_step(tmp_path):
    results = run_ranks(_taken_before_the_save, 2, str(tmp_path), timeout=90)
    for error, untouched in results:
        assert untouched  # no rank wrote into, nor deleted, the new holder's step
        assert error is not None and "another job owns this run now" in error and "other-job" in error


def test_a_lease_taken_while_the_ranks_write_stops_the_commit(tmp_path, monkeypatch):
    original = CheckpointWriter._write_own

    def write_then_lose(self, job, name, out):
        original(self, job, name, out)
        _take_over(tmp_path)  # the partition happens while the ranks write

    monkeypatch.setattr(CheckpointWriter, "_write_own", write_then_lose)
    model, opt = tiny()
    ck = Checkpointer(tmp_path, CkptSection(async_save=False), single_ctx())
    with pytest.raises(SaveFailed, match="not committed: .*other-job"):
        ck.save(5, model, opt, None, state(5))
    ck.discard()
    ck.close()
    step_dir = tmp_path / "ckpt" / "step_000005"
    assert not (step_dir / "manifest.json").exists()
    assert (step_dir / "rank_00000.safetensors").exists()  # left for the new holder to clear: not ours to delete


def test_retention_that_cannot_read_an_older_checkpoint_never_fails_the_save(tmp_path):
    # an older step whose manifest names a pickle file: retention asks its lineage and is refused
    # (UnsafeCheckpoint, not a storage error); rank 0 must still reach the save's last broadcast
    model, opt = tiny()
    ck = Checkpointer(tmp_path, CkptSection(keep_last=0, async_save=False), single_ctx())
    for step in (1, 2):
        ck.save(step, model, opt, None, state(step))
    ck.close()
    step2 = tmp_path / "ckpt" / "step_000002"
    manifest = layout.read_manifest(open_store(str(tmp_path / "ckpt")), "step_000002")
    manifest["files"]["weights.pt"] = {"bytes": 1, "crc32": 0}
    (step2 / "manifest.json").write_bytes(layout.sealed_manifest(manifest))
    with Messages() as said:
        ck = Checkpointer(tmp_path, CkptSection(keep_last=1, async_save=False), single_ctx())
        assert ck.save(3, model, opt, None, state(3))
        ck.close()
    store = open_store(ck.identity.ckpt_url)
    assert 3 in [s for s, _ in layout.committed_steps(store)]
    assert any("retention after step_000003 failed" in line for line in said.lines), said.lines
