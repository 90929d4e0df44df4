"""How a rank tells ``launch local`` why it ended: one small JSON file per rank.

torchrun reports a worker's failure as a 30-line ``ChildFailedError`` traceback and exits 1 whatever
the worker's status, and after a signal-driven save it exits 1 with a ``SignalException``
traceback. ``launch local`` wants the workers' own verdict instead: exit 2 and the one-line reason
after a user mistake, 203 and its one line after a storage outage, 130/143 and the saved step after
a stop signal. So it names a directory in ``EXIT_REPORT_DIR`` and each rank's ``podtrain train``
writes ``rank_<R>.json`` there as it ends (``recording``): ``{"rank", "code", "message", "step"}``.
Nothing is written when the variable is unset (a bare torchrun). The Slurm batch script sets it
too, and asks ``python3 -m podtrain.launch.exit_report DIR`` for the job's code after srun (it
requeues on 203).

A rank that cannot write one (SIGKILL, the hang watchdog's ``os._exit(124)``) is still known from
torchrun's own failure summary (``torchrun_exit_codes``).

``recording`` is where a rank starts under a launcher, so it is also where a rank of ``launch
local`` ties its life to its torchrun agent's (``torchrun.die_with_agent``: a SIGKILLed agent
leaves no worker training behind).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from podtrain.errors import STORAGE_OUTAGE_EXIT_CODE, USER_ERROR_EXIT_CODE, UserError, storage_error
from podtrain.launch.torchrun import die_with_agent

EXIT_REPORT_DIR = "PODTRAIN_EXIT_REPORT_DIR"
"""Environment variable naming the directory where each rank writes ``rank_<R>.json``."""


@dataclass
class ExitReport:
    """Why one rank ended: its exit code, a one-line message and the step it reached."""

    rank: int
    code: int = 1
    message: str = ""
    step: int | None = None


@contextlib.contextmanager
def recording(rank: int) -> Iterator[ExitReport]:
    """Around a rank's whole ``train`` command: the body sets ``code``/``step`` on success; a
    ``UserError`` or a storage failure (``errors.storage_error``) records its exit code (2; 203 for
    a storage outage, however it was wrapped) and its one line, ``KeyboardInterrupt`` 130, any
    other exception 1 with its type and message (the traceback still goes to stderr). Exceptions
    propagate. Under ``launch local`` the rank first arranges to die with its torchrun agent
    (``torchrun.die_with_agent``)."""
    die_with_agent()
    report = ExitReport(rank=rank)
    try:
        yield report
    except UserError as exc:
        report.code, report.message = exc.exit_code, str(exc)
        raise
    except KeyboardInterrupt:
        report.code, report.message = 130, "interrupted"
        raise
    except BaseException as exc:
        storage = storage_error(exc)  # a full or read-only disk is the user's to fix: 2, one line
        report.code, report.message = ((storage.exit_code, str(storage)) if storage is not None else
                                       (1, f"{type(exc).__name__}: {exc}".splitlines()[0]))
        raise
    finally:
        _write(report)


def _write(report: ExitReport) -> None:
    """Write ``report`` atomically into ``$EXIT_REPORT_DIR`` (nothing when the variable is unset)."""
    folder = os.environ.get(EXIT_REPORT_DIR)
    if not folder:
        return
    path = Path(folder) / f"rank_{report.rank}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(report.__dict__))
        os.replace(tmp, path)
    except OSError:  # the report is a courtesy: it never turns an exit into a different failure
        pass


def read_reports(folder: str | os.PathLike) -> dict[int, ExitReport]:
    """Every rank's report in ``folder``, by rank (unreadable files are skipped)."""
    reports = {}
    for path in Path(folder).glob("rank_*.json"):
        try:
            data = json.loads(path.read_text())
            reports[int(data["rank"])] = ExitReport(**data)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return reports


_FAILURE_RE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_exit_codes(output: str) -> dict[int, int]:
    """Ranks and exit codes from torchrun's ``ChildFailedError`` summary (``rank : 1 (local_rank:
    1)`` followed by ``exitcode : 124 (pid: ...)``), for ranks that wrote no report."""
    return {int(rank): int(code) for rank, code in _FAILURE_RE.findall(output)}


SEVERITY = (USER_ERROR_EXIT_CODE, STORAGE_OUTAGE_EXIT_CODE, 124)
"""Exit codes that explain a job's end over any other rank's (a user mistake, then a storage outage,
then a hang): the other ranks' codes are consequences (torchrun stops them, and a stopped rank may
save and exit 143; a rank that waited for the one stuck in its storage retries may hang or crash)."""


def job_exit(reports: dict[int, ExitReport], torchrun_codes: dict[int, int]) -> tuple[int, ExitReport | None]:
    """The job's exit code and the report that explains it.

    A user mistake (2) wins over a storage outage (203), which wins over a hang (124), which wins
    over a crash (any other non-signal code), which wins over a signal stop (128+N); all zero is
    0. Ranks without a report count with torchrun's code for them.
    """
    codes = {rank: r.code for rank, r in reports.items()}
    for rank, code in torchrun_codes.items():
        codes.setdefault(rank, code)
    if not codes:
        return 0, None

    def rank_order(code: int) -> int:
        if code in SEVERITY:
            return SEVERITY.index(code)
        if code == 0:
            return len(SEVERITY) + 2
        return len(SEVERITY) + (1 if code >= 128 or code < 0 else 0)

    rank, code = min(sorted(codes.items()), key=lambda item: rank_order(item[1]))
    return code, reports.get(rank, ExitReport(rank=rank, code=code))


def main(argv: list[str] | None = None) -> int:
    """``python3 -m podtrain.launch.exit_report DIR``: print the job's exit code from the ranks'
    reports in DIR (nothing when there are none). The Slurm batch script asks it after srun:
    torchrun's own code is 1 whatever its workers' were."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python3 -m podtrain.launch.exit_report REPORT_DIR", file=sys.stderr)
        return 2
    reports = read_reports(args[0])
    if reports:
        print(job_exit(reports, {})[0])
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
