"""`launch local` ends with the workers' verdict: one line on the terminal, their exit code.

Real torchrun, real gloo ranks. A Ctrl-C is simulated as a terminal delivers it: SIGINT to the
whole foreground process group of a `launch local` started in its own session.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fault_plugin.podtrain_faults import fault_env
from podtrain.ckpt import layout
from podtrain.errors import UserError
from podtrain.launch.exit_report import ExitReport
from podtrain.launch.supervise import job_verdict

pytestmark = pytest.mark.e2e

FAST = ["data.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8", "log.every=1",
        "eval.every=0", "ckpt.every=1000", "log.progress=plain", "monitor.straggler_every=0",
        "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, builtin_corpus):
    """The built-in corpus tokenised twice: bytes (vocab 257: conftest's, shared) and BPE (vocab 512)."""
    from podtrain.cli import main

    root = tmp_path_factory.mktemp("data")
    (root / "byte").symlink_to(builtin_corpus, target_is_directory=True)
    assert main(["prepare", "builtin", "--out", str(root / "bpe"), "--tokenizer", "bpe:512", "--no-progress"]) == 0
    return root


def start(repo: Path, run_dir: Path, data: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "podtrain.cli", "launch", "local", str(repo / "configs/demo.yaml"),
           "--nproc", "2", f"run.dir={run_dir}", f"data.path={data}", *FAST, *extra]
    return subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {steps} (exit {proc.poll()})")


def finish(proc: subprocess.Popen, timeout: float = 150) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def latest_step(run_dir: Path) -> int:
    return layout.parse_step((run_dir / "ckpt" / "latest").read_text().strip())


def test_ctrl_c_saves_says_one_line_and_exits_130_then_a_user_error_is_one_line_and_resume_works(
        repo, tmp_path, datasets):
    """Four `launch local` runs of one run directory: Ctrl-C (130, saved); another tokenizer's
    data (2, one line); the resume, SIGKILLed at its launcher once it saved again (nothing of the
    job survives it); the same command again (the dead holder's lease taken over, resumed, done).
    The launcher-death case was a test of its own (test_launcher_death), its two runs now these."""
    run_dir = tmp_path / "run"
    proc = start(repo, run_dir, datasets / "byte", "train.steps=2000")
    wait_for_steps(proc, run_dir, 3)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process in the group
    code, out, err = finish(proc)
    assert code == 130, err[-3000:]
    step = latest_step(run_dir)
    assert 3 <= step < 2000
    assert (run_dir / "ckpt" / layout.step_name(step) / layout.MANIFEST).is_file()
    state = json.loads((run_dir / "ckpt" / layout.step_name(step) / layout.STATE_JSON).read_text())
    manifest = json.loads((datasets / "byte" / "manifest.json").read_text())
    assert state["train_state"]["tokenizer_sha256"] == manifest["tokenizer"]["sha256"]
    assert "Traceback" not in out + err and "ChildFailedError" not in out + err, err[-3000:]
    own = [line for line in err.splitlines() if line.startswith("podtrain:")]
    assert own == [f"podtrain: stopped by SIGINT at step {step}, checkpoint {layout.step_name(step)} "
                   "saved; run the same command to resume"], err[-3000:]

    # The same run directory with data of another tokenizer: every rank refuses; one line, exit 2.
    code, out, err = finish(start(repo, run_dir, datasets / "bpe", "train.steps=2000"))
    assert code == 2, err[-3000:]
    errors = [line for line in (out + err).splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("podtrain: error: "), out + err
    assert "Traceback" not in out + err and len(err.splitlines()) <= 3, err

    # The same command as before resumes from the saved step. (One run serves two tests: the
    # resumed job is then SIGKILLed at its launcher, test_launcher_death's case; see below.)
    from test_launcher_death import GONE_WITHIN_S, descendants, still_running

    proc = start(repo, run_dir, datasets / "byte", "train.steps=2000", "ckpt.every=2")
    job: dict[int, tuple[int, str]] = {}
    try:
        deadline = time.monotonic() + 150
        while proc.poll() is None and time.monotonic() < deadline and latest_step(run_dir) == step:
            time.sleep(0.05)
        saved = latest_step(run_dir)
        assert saved > step and proc.poll() is None, f"no checkpoint after the resume (exit {proc.poll()})"
        job = descendants(proc.pid)
        torchruns = [cmd for _, cmd in job.values() if "torch.distributed.run" in cmd]
        ranks = [cmd for _, cmd in job.values() if "podtrain.cli train" in cmd and cmd not in torchruns]
        assert len(torchruns) == 1 and len(ranks) == 2, job
        # Nothing of a `launch local` job outlives its launcher: kill -9 (no handler runs in the
        # launcher) takes torchrun and its ranks with it.
        proc.kill()
        out, err = proc.communicate(timeout=30)
        deadline = time.monotonic() + GONE_WITHIN_S
        while still_running(job) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = still_running(job)
        assert not left, f"{len(left)} process(es) of the job outlived its launcher by {GONE_WITHIN_S:g} s: {left}"
    finally:
        for pid in still_running(job):  # never leave a training behind, whatever failed above
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert f"resumed from {run_dir / 'ckpt' / layout.step_name(step)}" in out + err, (out + err)[-3000:]

    # The same command again: the lease's holder (the killed rank 0) is gone, so it is taken over
    # at once (a live holder would refuse the run for ckpt.lease_timeout_s), and the run resumes
    # from the newest checkpoint the killed job committed, and finishes.
    last = latest_step(run_dir)
    assert last >= saved
    code, out, err = finish(start(repo, run_dir, datasets / "byte", "ckpt.every=2", f"train.steps={last + 2}"))
    assert code == 0, err[-3000:]
    assert "is in use by" not in out + err
    assert f"resumed from {run_dir / 'ckpt' / layout.step_name(last)}" in out + err, (out + err)[-3000:]
    assert latest_step(run_dir) == last + 2


# A save longer than torchrun's 30 s shutdown timeout after SIGTERM (ckpt.grace_s=90, exit 143):
# test_resume.py::test_golden_resume_after_sigterm_to_the_launcher, whose SIGTERMed run it slows.


def test_a_rank_killed_by_sigkill_is_named_not_the_rank_that_failed_after_it(repo, tmp_path, datasets):
    """kill -9 of rank 1 mid-step (the fault plugin's kill fault): rank 0 then fails in its next
    collective ("Connection closed by peer") and reports it; the one line still names rank 1
    and SIGKILL, and the exit code is a SIGKILL's (137), not the survivor's crash (1)."""
    run_dir = tmp_path / "run"
    proc = start(repo, run_dir, datasets / "byte", "train.steps=2000",
                 env=fault_env("kill:rank=1,step=2,delay=0.05"))
    code, out, err = finish(proc)
    assert "fault injection: kill on rank 1 at step 2" in out + err, err[-3000:]
    assert code == 128 + signal.SIGKILL, err[-3000:]
    own = [line for line in err.splitlines() if line.startswith("podtrain:")]
    assert own == [f"podtrain: error: rank 1 was killed by SIGKILL (out of memory, or a kill -9 from "
                   f"outside); the other ranks stopped after it; its output is in {run_dir / 'logs'}"], err[-3000:]


def torchrun_summary(*failures: tuple[int, int, int]) -> str:
    """torchrun's failure summary for (rank, exitcode, second the agent saw it end)."""
    return "".join(f"[{i}]:\n  time      : 2026-12-01_00:19:{second:02d}\n  host      : localhost\n"
                   f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {100 + rank})\n"
                   "  error_file: <N/A>\n" for i, (rank, code, second) in enumerate(failures))


def verdict(tmp_path, capsys, summary: str, reports: dict[int, ExitReport]) -> tuple[int, str]:
    code = job_verdict(tmp_path, [1], None, reports, summary, tmp_path / "logs" / "torchrun.log")
    return code, capsys.readouterr().err


def test_the_rank_killed_first_is_named_not_the_ranks_that_failed_or_were_stopped_after_it(tmp_path, capsys):
    """Rank 1 dies of SIGKILL (no report), rank 0 then fails in its collective and reports it:
    torchrun may see both ends in one poll (the same second) or rank 0's later. But the ranks
    torchrun stops after a crash (SIGTERM at once, SIGKILL after its shutdown timeout) take no
    blame, and a user mistake always explains the end."""
    reset = {0: ExitReport(0, 1, "RuntimeError: Connection reset by peer")}
    for survivor_seen in (34, 36):
        code, err = verdict(tmp_path, capsys, torchrun_summary((0, 1, survivor_seen), (1, -9, 34)), reset)
        assert code == 137 and err.startswith("podtrain: error: rank 1 was killed by SIGKILL"), err
    crash = {0: ExitReport(0, 1, "RuntimeError: boom")}
    for later in (torchrun_summary((0, 1, 34), (1, -9, 70)), torchrun_summary((0, 1, 34), (1, -15, 34))):
        code, err = verdict(tmp_path, capsys, later, crash)
        assert code == 1 and "rank 0 failed with exit code 1: RuntimeError: boom" in err, err
    with pytest.raises(UserError, match="data.path"):
        verdict(tmp_path, capsys, torchrun_summary((1, -9, 34)), {0: ExitReport(0, 2, "data.path /x is missing")})


def test_a_storage_outage_ends_the_job_with_203_and_its_own_line(tmp_path, capsys):
    """Every rank exited 203 (podtrain's retryable code): the job's code is 203 and the line names
    the outage and how to resume, not "stopped by exit 203" as for a signal."""
    message = "s3://b/ckpt: no checkpoint could be saved for 1900 s (ckpt.max_outage_s=1800)"
    reports = {r: ExitReport(rank=r, code=203, message=message, step=40) for r in (0, 1)}
    code, err = verdict(tmp_path, capsys, torchrun_summary((0, 203, 1), (1, 203, 1)), reports)
    assert code == 203
    assert err.strip() == (f"podtrain: error: {message} (exit 203: retryable; run the same command again, "
                           "or let the scheduler requeue it, to resume)")
