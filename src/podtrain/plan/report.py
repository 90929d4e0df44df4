"""``podtrain report RUN_DIR``: the run's measured step split against the plan for the same config
on this machine, naming the component furthest from its prediction.

Measured, from ``RUN_DIR/metrics.jsonl`` (rank 0's lines): ``step_time_s``, ``data_wait_s`` and
``sync_wait_s`` per step (compute = step - data wait - sync wait, optimizer included), ``save_s``
of every ``kind=save`` line and ``eval_s`` of every ``kind=eval`` line amortised over the steps.
Where the straggler reports give every rank's data wait, the slowest rank's is the run's (the
others wait for it in the sync). The first log interval holds start-up (allocations, first collectives) and is left out when there
are later ones. A large sync wait on rank 0 means another rank was slower: the straggler fields
(``straggler_rank``, ``busy_by_rank``) name it. Goodput is the newest record's, over every attempt
(``train/goodput.py``: idle time between attempts is not counted), as the run's closing line said.
Each restart's recovery budget (``recovery`` of its first train line) follows, one line each.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from podtrain.config import load_config
from podtrain.errors import UserError
from podtrain.plan.machine import local_machine
from podtrain.plan.planner import make_plan
from podtrain.plan.render import duration, table
from podtrain.train.goodput import goodput_line, recovery_line

COMPONENTS = ("compute", "sync wait", "data wait", "saves", "evaluation")


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records (a torn last line from a killed run is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist: RUN_DIR must be a podtrain run directory")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def measured_split(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per step by component, the step count and the world size, from the records."""
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise UserError("metrics.jsonl has no training lines yet (kind=train): nothing to report")
    steady = train[1:] if len(train) > 1 else train
    mean = lambda key: sum(float(r.get(key) or 0.0) for r in steady) / len(steady)  # noqa: E731
    steps = max(int(r["step"]) for r in train)
    step, data = mean("step_time_s"), mean("data_wait_s")
    sync = mean("sync_wait_s") if all("sync_wait_s" in r for r in steady) else None
    slowest_data = _slowest_data_wait(steady)
    if slowest_data is not None and slowest_data > data:
        # Another rank waited longer for its batch and rank 0 waited for that rank in the sync:
        # that part of rank 0's sync wait is data wait.
        if sync is not None:
            sync = max(0.0, sync - (slowest_data - data))
        data = slowest_data
    saves = sum(float(r.get("save_s") or 0.0) for r in records if r.get("kind") == "save")
    evals = sum(float(r.get("eval_s") or 0.0) for r in records if r.get("kind") == "eval")
    last = train[-1]
    # The newest goodput figures: the closing line of the last attempt when it wrote one (its
    # last evaluation and save included), else its last train line.
    goodput = next((r for r in reversed(records) if isinstance(r.get("goodput_s"), dict)), None)
    return {
        "step_s": step, "compute": step - data - (sync or 0.0), "sync wait": sync, "data wait": data,
        "saves": saves / steps, "evaluation": evals / steps, "steps": steps,
        "world_size": int(last.get("world_size") or 1),
        "goodput": None if goodput is None else {"goodput_s": goodput["goodput_s"], "step": goodput.get("step")},
        "straggler": _straggler(train),
        "recoveries": [{"step": r.get("step"), **r["recovery"]} for r in train if isinstance(r.get("recovery"), dict)],
    }


def _slowest_data_wait(steady: list[dict[str, Any]]) -> float | None:
    """The largest per-rank data wait of the straggler reports (``data_wait_by_rank``), or None."""
    reports = [r["data_wait_by_rank"] for r in steady if r.get("data_wait_by_rank")]
    if not reports:
        return None
    return max(sum(r[i] for r in reports) / len(reports) for i in range(len(reports[0])))


def _straggler(train: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The slowest rank by its own work (busy = step - sync wait) in the last straggler report."""
    reports = [r for r in train if r.get("busy_by_rank")]
    if not reports:
        return None
    last = reports[-1]
    busy = last["busy_by_rank"]
    rank = last.get("straggler_rank")
    rank = rank if rank is not None else max(range(len(busy)), key=busy.__getitem__)
    return {"rank": rank, "host": last.get("straggler_host"), "busy_s": busy[rank],
            "median_busy_s": statistics.median(busy), "flagged": last.get("straggler_rank") is not None}


def compare(measured: dict[str, Any], predicted: dict[str, float]) -> list[dict[str, Any]]:
    """One row per component: measured, predicted, difference (s/step); sorted as COMPONENTS."""
    rows = []
    for name in COMPONENTS:
        got = measured[name]
        rows.append({"component": name, "measured_s": got, "predicted_s": predicted[name],
                     "diff_s": None if got is None else got - predicted[name]})
    return rows


def furthest(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row whose measurement is furthest (in seconds per step) from its prediction."""
    return max((r for r in rows if r["diff_s"] is not None), key=lambda r: abs(r["diff_s"]))


def predicted_split(run_dir: Path, world: int, efficiency: float | None) -> tuple[dict[str, float], Any]:
    """The plan's split for the run's config on this machine with the run's number of ranks."""
    from podtrain.plan.shape import model_shape

    config = run_dir / "config.yaml"
    if not config.is_file():
        raise UserError(f"{config} does not exist: RUN_DIR must be a podtrain run directory")
    cfg = load_config(str(config), [])
    plan = make_plan(cfg, model_shape(cfg), local_machine(world, efficiency, None), 1, None)
    t = plan.time
    return {"compute": t.compute_s + t.optimizer_s, "sync wait": t.sync_wait_s,
            "data wait": t.data_wait_s, "saves": t.save_s, "evaluation": t.eval_s,
            "step_s": t.step_s}, plan


def build_report(run_dir: Path, efficiency: float | None = None) -> dict[str, Any]:
    """Measured against predicted, the furthest component and what explains it."""
    measured = measured_split(read_records(run_dir))
    predicted, _ = predicted_split(run_dir, measured["world_size"], efficiency)
    rows = compare(measured, predicted)
    worst = furthest(rows)
    verdict = (f"furthest from the plan: {worst['component']} ({worst['measured_s']:.4f} s/step "
               f"measured, {worst['predicted_s']:.4f} s predicted)")
    straggler = measured["straggler"]
    if worst["component"] == "sync wait" and worst["diff_s"] > 0 and straggler:
        verdict += (f": rank 0 waits for rank {straggler['rank']}"
                    + (f" on {straggler['host']}" if straggler["host"] else "")
                    + f", whose own work takes {straggler['busy_s']:.4f} s/step against a median of "
                      f"{straggler['median_busy_s']:.4f} s (slow rank {straggler['rank']})")
    return {"run_dir": str(run_dir), "steps": measured["steps"], "world_size": measured["world_size"],
            "step_s": {"measured": measured["step_s"], "predicted": predicted["step_s"],
                       "ratio": measured["step_s"] / predicted["step_s"]},
            "components": rows, "furthest": worst["component"], "verdict": verdict,
            "straggler": straggler, "goodput": measured["goodput"], "recoveries": measured["recoveries"]}


def render_report(report: dict[str, Any]) -> str:
    """The text of ``podtrain report``."""
    fmt = lambda v: "n/a" if v is None else duration(v)  # noqa: E731
    rows = [[r["component"], fmt(r["measured_s"]), fmt(r["predicted_s"]),
             "n/a" if r["diff_s"] is None else f"{r['diff_s'] * 1e3:+.1f} ms"] for r in report["components"]]
    s = report["step_s"]
    goodput = report["goodput"]
    return "\n".join([
        f"{report['run_dir']}: {report['steps']} steps on {report['world_size']} rank(s); per step, "
        "against `podtrain plan --instance-type local` for its config.yaml:",
        table(["component", "measured", "predicted", "difference"], rows),
        f"step time {duration(s['measured'])} measured, {duration(s['predicted'])} predicted "
        f"(ratio {s['ratio']:.2f})",
        goodput_line(goodput["goodput_s"]) if goodput else "goodput: n/a (not recorded)",
        *(f"restart (first step {r['step']}): {recovery_line(r)}" for r in report.get("recoveries", [])),
        report["verdict"],
    ])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``podtrain report RUN_DIR [--json] [--efficiency E]``."""
    parser.add_argument("run_dir", help="a run directory (config.yaml + metrics.jsonl)")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="share of this host's matmul rate a step sustains (default: the plan's)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """CLI entry: print the report."""
    report = build_report(Path(args.run_dir), args.efficiency)
    print(json.dumps(report, indent=1) if args.json else render_report(report))
    return 0
