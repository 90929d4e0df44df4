"""A stop signal ends the job within ``ckpt.grace_s`` whatever the storage does, and the newest state
wins (issue 34, defects 6 and 7). Real parts: the real S3 server (moto) behind the tests' fault proxy
(tests/s3_fault_proxy.py), ``podtrain train`` as a process or on two forked gloo ranks, real signals.

1. A storage that accepts connections and never answers (``fail_with(HANG)``) while saves are due:
   SIGTERM ends the process with 143 within the grace period (plus ``EXIT_SLACK_S``), and the
   checkpoint committed before the hang is intact.
2. A 503 outage while a save is in flight (tests/outage_recovery.py): training goes on; after it,
   the stale save is cancelled and a save commits within ``ckpt.every`` steps; SIGTERM a few steps
   later exits 143 on every rank with that step saved.
3. The retry policy's per-job cancellation (``storage.retry.Cancel``), without processes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from outage_recovery import committed, last_step, run_once
from s3_fault_proxy import HANG, s3_proxy  # noqa: F401 (fixture)
from synthetic_data import make_data_dir

GRACE_S = 12.0
EXIT_SLACK_S = 3.0
"""Past the grace period, what the test allows for the process to end (interpreter exit under a
loaded machine); podtrain's own stop path ends ``min(5, grace/10)`` s before the grace period does."""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("stop_data"), shard_tokens=(6000,), val_tokens=300)


def _until(what: str, ready, limit_s: float, proc: subprocess.Popen | None = None):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        value = ready()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"not within {limit_s:.0f} s: {what}")


@pytest.mark.slow
def test_sigterm_with_a_storage_that_never_answers_exits_143_within_the_grace_period(
        s3_proxy, s3_server, s3_bucket, data, tmp_path, repo):
    url, run_dir = f"s3://{s3_bucket}/ckpt", tmp_path / "run"
    log_path = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "podtrain.cli", "train", "configs/demo.yaml", f"data.path={data}",
           f"run.dir={run_dir}", f"ckpt.dir={url}", "data.seq_len=32", "train.micro_batch_size=2",
           "train.global_batch_size=4", "train.steps=1000000", "log.every=1", "eval.every=0", "ckpt.every=2",
           "ckpt.keep_last=0", f"ckpt.grace_s={GRACE_S:g}", "ckpt.save_wait_s=0.3",
           "ckpt.lease_timeout_s=8",  # renewals every 2 s: one hangs too, and the release must not wait for it
           "monitor.watchdog=false", "log.progress=off", "log.trackers=none", "data.verify=false"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=repo, stdout=log, stderr=subprocess.STDOUT)
    try:
        _until("a committed checkpoint", lambda: committed(s3_server, s3_bucket), 120, proc)
        s3_proxy.fail_with(HANG)
        s3_proxy.outage(True)  # from now on every request is read and never answered
        hung_at = last_step(run_dir)
        _until("training going on past a save due in the hang", lambda: last_step(run_dir) >= hung_at + 5, 60, proc)
        before = committed(s3_server, s3_bucket)  # whatever was in flight as the hang began has landed
        assert s3_proxy.stats()["failed"] > 0  # requests are hanging
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=GRACE_S + EXIT_SLACK_S + 30)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        s3_proxy.outage(False)
    out = log_path.read_text()
    assert code == 143 and took <= GRACE_S + EXIT_SLACK_S, (code, took, out[-3000:])
    assert "could not be saved within the grace period" in out  # it said so, and did not hang on it
    after = committed(s3_server, s3_bucket)
    assert after == before and before, (before, after)  # nothing committed in the hang, nothing lost
    from podtrain.ckpt.reader import load_step

    newest = load_step(run_dir, before[-1])  # the previous checkpoint reads back whole (CRCs checked)
    assert newest.step == before[-1] and newest.model_state


@pytest.mark.slow
def test_after_an_outage_a_save_commits_within_ckpt_every_and_sigterm_saves_the_current_step(
        s3_proxy, s3_server, s3_bucket, data, tmp_path, repo):
    every = 3
    out = run_once(repo, data, tmp_path / "run", s3_server, s3_bucket, s3_proxy, outage_s=4.0, every=every,
                   after_steps=3, grace_s=30.0, deadline_s=90.0)
    assert out.problem is None, out
    assert out.outage_steps >= 3, out  # the step loop went on through the outage
    # The first save committed after the outage is the newest state (within one interval of its
    # end), not the stale one that retried through it and held every later save back.
    assert out.newest_state_won(every), out
    assert [code for _, code in out.results] == [143, 143], out
    stopped = {step for step, _ in out.results}
    assert len(stopped) == 1 and out.newest == stopped.pop() >= out.first_commit + 3, out  # the SIGTERM step saved


def test_cancelling_one_job_ends_its_retries_and_leaves_the_policy_usable():
    from podtrain.storage.errors import Transient
    from podtrain.storage.retry import Cancel, RetryPolicy, cancellation

    policy = RetryPolicy(base_s=5.0, cap_s=5.0, budget_s=60.0, seed=1)  # each wait: up to 5 s
    token, tries, outcome = Cancel(), [], {}

    def failing():
        tries.append(time.monotonic())
        raise Transient("s3://b/k", "503 SlowDown")

    def job():
        with cancellation(token):
            try:
                policy.run("s3://b/k", failing)
            except Transient as exc:
                outcome["error"], outcome["at"] = str(exc), time.monotonic()

    worker = threading.Thread(target=job, daemon=True)
    worker.start()
    _until("a first failed try", lambda: tries, 10)
    time.sleep(0.1)  # asleep between tries now
    cancelled_at = time.monotonic()
    token.cancel("step 9 is due")
    worker.join(10)
    assert not worker.is_alive()
    assert outcome["at"] - cancelled_at < 1.0, outcome  # woke at once, not after its backoff
    assert "cancelled after 1 tries: step 9 is due" in outcome["error"]
    assert not policy.abandoned and policy.run("s3://b/k", lambda: 7) == 7  # the next job runs
    with cancellation(token), pytest.raises(Transient, match="cancelled"):
        policy.check("s3://b/k")  # a long write stops at its next slice
    policy.check("s3://b/k")  # outside the job: nothing cancelled
