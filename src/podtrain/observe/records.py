"""Reading RUN_DIR/metrics.jsonl back: one record per step, however often the run was resumed.

metrics.jsonl only grows. A run killed at step 117 and resumed from its step-100 checkpoint logs
steps 101-117 a second time; it first writes a ``segment`` record (``{"kind": "segment", "step":
100, "resumed": true, ...}``). Readers apply two rules, in file order: a segment record at step S
drops every earlier record past S (the killed attempt's steps, even those the new attempt logs at
other steps), and of records with the same kind and step the last one wins. ``podtrain plot`` and
every other reader go through ``read_records``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from podtrain.errors import UserError

METRICS_FILE = "metrics.jsonl"


@dataclass
class RunRecords:
    """A run's de-duplicated records, each list sorted by step.

    Attributes:
        run_dir: the run directory read.
        train: ``kind=train`` records (one per logged step).
        eval: ``kind=eval`` records (validation loss).
        restarts: the ``segment`` records of resumed attempts (``resumed`` true), in file order:
            where the curves continue after a restart.
    """

    run_dir: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)


def segment_record(step: int, tokens_seen: int, resumed: bool, run_id: str, time_s: float) -> dict[str, Any]:
    """The marker an attempt writes before its first record: it continues after ``step``."""
    return {"kind": "segment", "step": step, "tokens_seen": tokens_seen, "resumed": resumed,
            "run_id": run_id, "time": time_s}


def dedupe(records: Iterable[dict[str, Any]]) -> tuple[list[dict], list[dict], list[dict]]:
    """Apply the module's two rules to records in file order; returns (train, eval, restarts)."""
    kept: dict[tuple[str, int], dict[str, Any]] = {}
    restarts: list[dict[str, Any]] = []
    for record in records:
        kind, step = record.get("kind", "train"), int(record["step"])
        if kind == "segment":
            kept = {key: r for key, r in kept.items() if key[1] <= step}
            restarts = [r for r in restarts if r["step"] <= step]
            if record.get("resumed"):
                restarts.append(record)
            continue
        kept[(kind, step)] = record
    by_step = sorted(kept.values(), key=lambda r: int(r["step"]))
    train = [r for r in by_step if r.get("kind", "train") == "train"]
    evals = [r for r in by_step if r.get("kind") == "eval"]
    return train, evals, restarts


def parse_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON records of ``path``; a torn last line (a kill mid-write) is ignored, a bad line
    elsewhere is a UserError naming the file and line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError("not a record with a step")
        except ValueError as exc:
            if number == len(lines):
                break
            raise UserError(f"{path} line {number}: not a metrics record ({exc})") from None
        records.append(record)
    return records


def read_records(run_dir: str | Path) -> RunRecords:
    """A run directory's metrics, de-duplicated (see the module docstring). Evaluation records
    written before they carried ``tokens_seen`` get it from the training record of their step."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} has no {METRICS_FILE} (is it a run directory?)")
    train, evals, restarts = dedupe(parse_lines(path))
    tokens_at = {r["step"]: r["tokens_seen"] for r in train if "tokens_seen" in r}
    for record in evals:
        if "tokens_seen" not in record and record["step"] in tokens_at:
            record["tokens_seen"] = tokens_at[record["step"]]
    return RunRecords(run_dir, train, evals, restarts)
