"""How `launch local` decides its exit code and what reaches the terminal (pure parts; the
end-to-end proofs with real torchrun are in test_launch_local_exit.py)."""

import io
import subprocess
import sys

from podtrain.launch import exit_report as X
from podtrain.launch.agent_output import AgentOutput

TORCHRUN_SUMMARY = """Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_00:19:34
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 124 (pid: 26760)
  error_file: <N/A>
"""


def test_worker_reports_round_trip_and_a_user_error_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv(X.EXIT_REPORT_DIR, str(tmp_path))
    try:
        with X.recording(1):
            raise X.UserError("data.path /x does not exist")
    except X.UserError:
        pass
    with X.recording(0) as report:
        report.code, report.step = 143, 7
    got = X.read_reports(tmp_path)
    assert got == {0: X.ExitReport(0, 143, "", 7), 1: X.ExitReport(1, 2, "data.path /x does not exist")}
    assert X.job_exit(got, {}) == (2, got[1])  # the mistake explains the stop of the other rank


def test_job_exit_orders_mistake_hang_crash_signal_success():
    assert X.torchrun_exit_codes(TORCHRUN_SUMMARY) == {1: 124}
    saved = {0: X.ExitReport(0, 143, "", 5)}
    assert X.job_exit(saved, {1: 124}) == (124, X.ExitReport(1, 124))  # rank 1 wrote no report
    assert X.job_exit(saved, {}) == (143, saved[0])
    assert X.job_exit({0: X.ExitReport(0, 1, "RuntimeError: boom"), **{1: X.ExitReport(1, 143)}}, {})[0] == 1
    assert X.job_exit({0: X.ExitReport(0, 0), 1: X.ExitReport(1, 0)}, {}) == (0, X.ExitReport(0, 0))
    assert X.job_exit({}, {}) == (0, None)


def test_agent_output_passes_worker_lines_and_keeps_torchrun_lines_aside(tmp_path, monkeypatch):
    lines = ["[default0]:[podtrain] step 1 loss 5.0", "[default1]:podtrain: error: bad data",
             "W1201 00:19:34 api.py:1028] Sending process 1 closing signal SIGTERM",
             "[1]:", TORCHRUN_SUMMARY.rstrip("\n")]
    agent = subprocess.Popen([sys.executable, "-c", f"print({chr(10).join(lines)!r})"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    console = io.StringIO()
    monkeypatch.setattr(sys, "stdout", console)
    with AgentOutput([agent], tmp_path / "torchrun.log") as output:
        agent.wait()
    assert console.getvalue() == "[default0]:[podtrain] step 1 loss 5.0\n"
    kept = (tmp_path / "torchrun.log").read_text()
    assert "closing signal" in kept and "exitcode  : 124" in kept and "podtrain: error" not in kept
    assert X.torchrun_exit_codes(output.torchrun_text) == {1: 124}
