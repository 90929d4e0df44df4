"""Nothing of a `launch local` job outlives its launcher, and the launcher's last line names the
signal that ended it.

Real processes throughout: a real `podtrain launch local` (2 gloo ranks under a real torchrun)
SIGKILLed mid-training (a phase of test_launch_local_exit's Ctrl-C test), found by its own process tree (other tests run beside this one, so never
by name across the machine); the supervisor's signal relay with real child processes; the lease
record's one-line description.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from podtrain.ckpt.lease import LeaseRecord
from podtrain.launch.exit_report import ExitReport
from podtrain.launch.supervise import job_verdict, wait_forwarding_signals

GONE_WITHIN_S = 5.0


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state letter, start time in clock ticks) of ``pid``, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """Every live process under ``root`` (by parent pid, however many sessions it spans): pid ->
    (start time, command line). The start time tells a pid reused later from the process itself."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry.name))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            stat = _stat(child)
            if stat is not None and child not in found:
                found[child] = (stat[2], _cmdline(child))
                todo.append(child)
    return found


def still_running(procs: dict[int, tuple[int, str]]) -> dict[int, str]:
    """Those of ``procs`` still alive (the same process: same start time; a zombie is dead)."""
    alive = {}
    for pid, (started, cmd) in procs.items():
        stat = _stat(pid)
        if stat is not None and stat[2] == started and stat[1] not in ("Z", "X"):
            alive[pid] = cmd
    return alive


# The SIGKILLed-launcher case (a real `launch local` killed mid-training, every process of its job
# gone within GONE_WITHIN_S, the rerun resuming) runs as phases of
# test_launch_local_exit.py::test_ctrl_c_saves_..._and_resume_works: its resumed run is the job
# killed, with descendants() and still_running() from here (one run fewer: ~15 s of CPU).


def test_a_worker_whose_agent_died_before_it_could_ask_to_die_with_it_ends_at_once(tmp_path):
    """The race a parent-death signal leaves: the agent is gone before the worker's ``prctl`` (it
    is then re-parented and no signal will ever come). The worker sees that its parent is no
    longer a child of the launcher (this test process) and ends itself with SIGKILL."""
    from podtrain.launch.torchrun import DIE_WITH_AGENT

    rank = ("import os, sys, time\n"
            "from pathlib import Path\n"
            "from podtrain.launch.torchrun import die_with_agent\n"
            "agent, out = int(sys.argv[1]), Path(sys.argv[2])\n"
            "(out / 'pid').write_text(str(os.getpid()))\n"
            "deadline = time.monotonic() + 30\n"
            "while os.getppid() == agent and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "(out / 'asking').write_text('')\n"
            "die_with_agent()\n"
            "(out / 'survived').write_text('')\n")
    agent = ("import os, subprocess, sys\n"  # starts the worker and is gone at once
             "subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid()), sys.argv[2]],\n"
             "                 start_new_session=True)\n")
    env = {**os.environ, DIE_WITH_AGENT: str(os.getpid())}
    assert subprocess.run([sys.executable, "-c", agent, rank, str(tmp_path)], env=env, timeout=60).returncode == 0
    deadline = time.monotonic() + 60
    while not (tmp_path / "asking").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (tmp_path / "asking").exists(), "the worker never saw its agent go"
    worker = int((tmp_path / "pid").read_text())
    while time.monotonic() < deadline and (stat := _stat(worker)) is not None and stat[1] not in ("Z", "X"):
        time.sleep(0.02)
    assert not (tmp_path / "survived").exists()
    stat = _stat(worker)
    assert stat is None or stat[1] in ("Z", "X"), f"the worker {worker} still runs"


def hangup_once_relaying(timeout: float = 30) -> None:
    """SIGHUP to this process once ``wait_forwarding_signals`` handles it (never before: the
    default action would end the test run)."""
    default = signal.getsignal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if signal.getsignal(signal.SIGHUP) is not default:
            os.kill(os.getpid(), signal.SIGHUP)
            return
        time.sleep(0.01)


def test_sighup_is_relayed_as_sigterm_and_the_end_names_sighup(tmp_path, capsys):
    """A closed terminal sends SIGHUP: the agents get SIGTERM (what the ranks checkpoint on), and
    the job's line and exit code (129) name SIGHUP, not SIGTERM."""
    got = tmp_path / "got"
    agent = ("import signal, sys, time\n"
             "def stop(signum, _):\n"
             f"    open({str(got)!r}, 'w').write(signal.Signals(signum).name); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop); signal.signal(signal.SIGHUP, stop)\n"
             f"open({str(tmp_path / 'ready')!r}, 'w').close()\n"
             "time.sleep(60); sys.exit(3)\n")
    child = subprocess.Popen([sys.executable, "-c", agent], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and child.poll() is None, "the agent did not start"
            time.sleep(0.02)
        threading.Thread(target=hangup_once_relaying, daemon=True).start()
        codes, received = wait_forwarding_signals([child])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert got.read_text() == "SIGTERM" and codes == [0]
    assert received == signal.SIGHUP

    # The ranks stopped on SIGTERM (143) before any save: the job's end still names SIGHUP.
    reports = {r: ExitReport(rank=r, code=143) for r in (0, 1)}
    code = job_verdict(tmp_path, codes, received, reports, "", tmp_path / "logs" / "torchrun.log")
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGHUP
    assert err.strip() == "podtrain: stopped by SIGHUP (its terminal closed) before any checkpoint was saved", err


def test_a_torchrun_killed_by_a_signal_is_named_with_its_128_plus_n_code(tmp_path, capsys):
    """torchrun alone SIGKILLed (its ranks die with it and report nothing): exit 137 and a line
    naming the signal, not "torchrun exited with -9" and an exit status of 247."""
    log = tmp_path / "logs" / "torchrun.log"
    assert job_verdict(tmp_path, [-signal.SIGKILL], None, {}, "", log) == 137
    assert capsys.readouterr().err.strip() == (f"podtrain: error: torchrun was killed by SIGKILL before any rank "
                                               f"reported; its output is in {log}")


@pytest.mark.parametrize("lineage, shown", [("", "(pid 42), last"), ("run-abc", "(pid 42, lineage run-abc), last")])
def test_a_lease_holder_is_described_without_an_empty_lineage(lineage, shown):
    record = LeaseRecord(lineage=lineage, job="j1", host="h1", pid=42, started=100.0, heartbeat=100.0)
    text = record.describe(now=130.0)
    assert text == f"job j1 on host h1 {shown} heartbeat 30 s ago"
    assert "lineage )" not in text and "lineage ," not in text
