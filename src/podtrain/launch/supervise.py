"""The end of a job whose torchrun agents are our children: relay stop signals, then one verdict.

``launch local`` (agents on this machine) and ``launch.agent`` (a container's entry point around
torchrun or hyperpodrun) end the same way, so the code is here once:

* ``wait_forwarding_signals``: SIGTERM, SIGINT, SIGUSR1 and SIGHUP that reach us go to the agents
  (which run in their own sessions, so a terminal's Ctrl-C or a group kill reaches only us), and
  torchrun relays them to its workers; SIGHUP goes on as SIGTERM (torchrun would pass SIGHUP on
  as it is, and the workers checkpoint on ``ckpt.signals``, SIGTERM by default), but the job's
  end still names SIGHUP (exit 129: its terminal closed).
* ``job_verdict``: the workers' reports (``exit_report``) and torchrun's failure summary become
  the job's exit code, 0, 2 (with the rank's one-line reason), 124 (a hang), 128+N (stopped by
  a signal after its checkpoint, or a rank killed by signal N: it is named, not the ranks that
  failed after it) or a crash's code, and one line that says so.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from podtrain.ckpt.layout import list_checkpoints, run_ckpt_url, step_name
from podtrain.errors import HANG_EXIT_CODE, STORAGE_OUTAGE_EXIT_CODE, USER_ERROR_EXIT_CODE, UserError
from podtrain.launch.exit_report import ExitReport, job_exit, torchrun_exit_codes

RELAYED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
"""Signals passed on to the agents (HyperPod asks for a graceful stop with SIGUSR1)."""


def wait_forwarding_signals(agents: list[subprocess.Popen]) -> tuple[list[int], int | None]:
    """Wait for every agent while relaying ``RELAYED_SIGNALS`` to them (SIGHUP as SIGTERM). Returns
    the agents' exit codes and the first signal we received, as received (SIGHUP too), or None."""
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    previous = {s: signal.signal(s, forward) for s in RELAYED_SIGNALS}
    try:
        codes = [agent.wait() for agent in agents]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return codes, (received[0] if received else None)


def job_verdict(run_dir: Path, agent_codes: list[int], received: int | None,
                reports: dict[int, ExitReport], torchrun_text: str, torchrun_log: Path) -> int:
    """Print the one line that says how the job ended and return its exit code (a user mistake
    raises ``UserError`` with the rank's own message, which the caller prints as its one line).

    ``torchrun_text`` is the agents' own output (their failure summary names ranks that could not
    write a report); ``torchrun_log`` is where it was kept, named when nothing else explains the
    end. With ``received``, a stop we relayed ends as ``128 + received`` (130, 143).
    """
    torchrun_codes = torchrun_exit_codes(torchrun_text)
    code, report = job_exit(reports, torchrun_codes)
    if received is not None and (code == 0 or code >= 128):
        code = 128 + received
    where = torchrun_log.parent
    killed = killed_first(reports, torchrun_codes, torchrun_text) if received is None else None
    if killed is not None and code != USER_ERROR_EXIT_CODE:
        rank, sig = killed
        hint = " (out of memory, or a kill -9 from outside)" if sig == signal.SIGKILL else ""
        print(f"podtrain: error: rank {rank} was killed by {sig.name}{hint}; the other ranks stopped "
              f"after it; its output is in {where}", file=sys.stderr)
        return 128 + sig
    if code == 0 and any(agent_codes):
        code = next(c for c in agent_codes if c)
        if code < 0:  # torchrun itself was killed (its ranks die with it: torchrun.die_with_agent)
            how, code = f"was killed by {signal.Signals(-code).name}", 128 - code
        else:
            how = f"exited with {code}"
        print(f"podtrain: error: torchrun {how} before any rank reported; its output is "
              f"in {torchrun_log}", file=sys.stderr)
    elif code == USER_ERROR_EXIT_CODE:
        raise UserError(report.message if report is not None and report.message else
                        f"a rank stopped with a user error; see {where}")
    elif code == STORAGE_OUTAGE_EXIT_CODE:
        reason = report.message if report is not None and report.message else "the storage was unreachable"
        print(f"podtrain: error: {reason} (exit {code}: retryable; run the same command again, or let the "
              "scheduler requeue it, to resume)", file=sys.stderr)
    elif code >= 128:
        print(f"podtrain: {stop_line(run_dir, code, reports)}", file=sys.stderr)
    elif code == HANG_EXIT_CODE:
        print(f"podtrain: error: rank {report.rank} hung (no step within dist.timeout_s); stacks and "
              f"last collectives are in {run_dir / 'debug'}", file=sys.stderr)
    elif code != 0:
        reason = f": {report.message}" if report.message else ""
        print(f"podtrain: error: rank {report.rank} failed with exit code {code}{reason}; its output "
              f"is in {where}", file=sys.stderr)
    return code


_FAILURE_TIME = re.compile(r"time\s*:\s*(\S+)\s*\n\s*host\s*:[^\n]*\n\s*rank\s*:\s*(\d+)")
"""``time : 2026-12-01_00:19:34`` / ``host : ...`` / ``rank : 1 (local_rank: 1)`` in torchrun's
failure summary: when torchrun saw each rank's end (to the second)."""


def killed_first(reports: dict[int, ExitReport], torchrun_codes: dict[int, int],
                 torchrun_text: str) -> tuple[int, signal.Signals] | None:
    """The rank a signal killed first, and the signal, or None.

    A rank killed by a signal (SIGKILL from the OOM killer or a ``kill -9``, SIGSEGV) writes no
    report, and torchrun's summary gives it a negative exit code. When torchrun saw that death
    first (the summary's earliest time), the other ranks' errors ("Connection reset by peer")
    are its consequences. SIGTERM is left out: it is how torchrun itself stops the group after
    a failure, and ranks it SIGKILLs after its shutdown timeout are seen later."""
    times = {int(rank): when for when, rank in _FAILURE_TIME.findall(torchrun_text)}
    if not times:
        return None
    first = min(times.values())  # YYYY-MM-DD_HH:MM:SS sorts as text
    killed = {rank: signal.Signals(-code) for rank, code in torchrun_codes.items()
              if code < 0 and rank not in reports and -code in signal.valid_signals()
              and -code != signal.SIGTERM and times.get(rank) == first}
    if not killed:
        return None
    rank = min(killed)
    return rank, killed[rank]


def stop_line(run_dir: Path, code: int, reports: dict[int, ExitReport]) -> str:
    """``stopped by SIGINT at step N, checkpoint step_N saved; ...``: the step the ranks report,
    else the run directory's newest complete checkpoint. SIGHUP (relayed to the ranks as
    SIGTERM) is named as such, with its usual cause."""
    name = signal.Signals(code - 128).name if code - 128 in signal.valid_signals() else f"exit {code}"
    if code - 128 == signal.SIGHUP:
        name += " (its terminal closed)"
    steps = [r.step for r in reports.values() if r.code >= 128 and r.step is not None]
    try:
        saved = list_checkpoints(run_ckpt_url(run_dir))
    except UserError:  # S3 unreachable from the launcher: the ranks' reports still name the step
        saved = []
    if steps and any(step == max(steps) for step, _ in saved):
        step = max(steps)
    elif saved:
        step = saved[-1][0]
    else:
        return f"stopped by {name} before any checkpoint was saved"
    return (f"stopped by {name} at step {step}, checkpoint {step_name(step)} saved; run the same "
            f"command to resume")
