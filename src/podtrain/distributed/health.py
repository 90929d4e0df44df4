"""Blame goes back to the scheduler: health verdicts in ``RUN_DIR/health/``, one JSON each.

Who writes: the hang watchdog (kind ``hang``, every rank that fires, with its last completed
step), the straggler monitor (``straggler``, rank 0 naming the slow rank) and ``podtrain doctor
--run-dir`` (``doctor``, one per culprit of a failed check). Each file holds ``node`` (the host
name: under Slurm the node name, which the batch script exports as ``PODTRAIN_HOSTNAME``),
``rank``, ``kind``, ``time`` and ``evidence``.

Who reads: ``blamed_nodes`` decides which nodes to avoid, and ``python -m
podtrain.distributed.health exclude RUN_DIR`` prints them comma-separated for the Slurm batch
script, which passes them to ``scontrol update jobid=... ExcNodeList=...`` before it requeues.
Rules: a doctor verdict blames its node; a node needs ``STRAGGLER_REPORTS`` straggler verdicts
(one slow window is often noise); hang verdicts blame only the nodes whose last completed step is
behind the others' (when every rank waits at the same step, the culprit wrote nothing: it died).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from podtrain.fsutil import atomic_write_text

HEALTH_SUBDIR = "health"
STRAGGLER_REPORTS = 2
"""Straggler verdicts that blame a node."""


def write_verdict(run_dir: str | Path, kind: str, node: str, rank: int | None,
                  evidence: dict[str, Any]) -> Path:
    """Write one verdict atomically under ``RUN_DIR/health/``; returns its path."""
    folder = Path(run_dir) / HEALTH_SUBDIR
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    path = folder / f"{int(now * 1000)}-{kind}-{node}-r{rank}-{uuid.uuid4().hex[:6]}.json"
    atomic_write_text(path, json.dumps({"node": node, "rank": rank, "kind": kind, "time": now,
                                        "evidence": evidence}, indent=1))
    return path


def read_verdicts(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every readable verdict of a run, oldest first."""
    folder = Path(run_dir) / HEALTH_SUBDIR
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a half-visible file on shared storage: the next requeue reads it
    return out


def blamed_nodes(verdicts: list[dict[str, Any]]) -> list[str]:
    """The nodes the verdicts blame (see the module docstring for the rules), sorted."""
    blamed = {v["node"] for v in verdicts if v.get("kind") == "doctor"}
    slow = Counter(v["node"] for v in verdicts if v.get("kind") == "straggler")
    blamed |= {node for node, count in slow.items() if count >= STRAGGLER_REPORTS}
    hangs = [v for v in verdicts if v.get("kind") == "hang"]
    steps = [v["evidence"].get("last_step") or 0 for v in hangs]
    if steps and min(steps) < max(steps):
        blamed |= {v["node"] for v, s in zip(hangs, steps) if s < max(steps)}
    return sorted(blamed)


def main(argv: list[str] | None = None) -> int:
    """``exclude RUN_DIR``: print the blamed nodes, comma-separated (nothing when none)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "exclude":
        print("usage: python -m podtrain.distributed.health exclude RUN_DIR", file=sys.stderr)
        return 2
    print(",".join(blamed_nodes(read_verdicts(args[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
