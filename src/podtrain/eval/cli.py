"""``podtrain eval RUN_DIR|HF_DIR --tasks NAME[,NAME] [--include DIR] [--limit N] [--out FILE]``.

lm-eval tasks on a run's newest checkpoint (or ``--step N``), or on an exported folder, with
podtrain's own model and tokenizer and no export written. Under torchrun (``podtrain launch
local``'s torchrun, or ``torchrun ... -m podtrain.cli eval ...``) every rank loads the model and
scores its share of the requests; rank 0 logs its progress every 30 s (``eval/progress.py``),
prints lm-eval's table (then each multiple-choice task's chance level beside its accuracies:
``harness.chance_lines``) and writes its JSON (``--out``, else ``RUN_DIR/eval/step_NNNNNN.json``, or
``HF_DIR/eval_results.json`` beside an exported model: never into the current directory; a
folder it cannot write to is one line before any scoring), plus a ``podtrain`` entry: what was
evaluated, the data its tokenizer came from, the ranks, the requests per second. A file already
there from an evaluation of the same step is merged by task (``merge_results``): another task's
results stay, the same task's are replaced; read, merged and replaced atomically under a lock.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from podtrain.errors import UserError
from podtrain.fsutil import atomic_write_text, flock_within, writable_dir

log = logging.getLogger("podtrain")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain eval``."""
    parser.add_argument("source", help="run directory (holds ckpt/) or an exported model folder")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm-eval task names (podtrain-next-line, hellaswag, ...)")
    parser.add_argument("--include", action="append", default=[], metavar="DIR",
                        help="a folder of lm-eval task YAML files (repeatable)")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--out", default=None, help="JSON results file (default: RUN_DIR/eval/step_N.json, "
                        "or HF_DIR/eval_results.json)")
    parser.add_argument("--step", type=int, default=None, help="a run's checkpoint of this step (default: newest)")
    parser.add_argument("--data", default=None, help="data directory (a folder or s3://...) of the tokenizer "
                        "and of the shipped tasks' validation text (default: the run's data.path, or the "
                        "first source of its data.mix)")
    parser.add_argument("--batch-size", type=int, default=32, help="requests per forward (default 32)")
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                        help="process-group backend under torchrun (default: auto)")


def run(args: argparse.Namespace) -> int:
    """Evaluate on this rank; rank 0 prints the table and writes the JSON."""
    from podtrain.eval.harness import parse_tasks, require_lm_eval

    require_lm_eval()  # before anything slow: without the extra, one line
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be at least 1, got {args.limit}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import process_group
    from podtrain.observe.console import setup_logging

    env = ClusterEnv.detect()
    setup_logging(env.rank)
    with process_group(env, args.backend) as ctx:
        source = Path(args.source)  # (a missing one: load_source's one line, no folder made for it)
        ctx.agree_on(lambda: writable_dir(out_folder(source, args.out)) if ctx.is_main and source.exists() else None)
        results, summary = evaluate(source, parse_tasks(args.tasks), ctx,
                                    [Path(d) for d in args.include], args.limit, args.step,
                                    args.data, args.batch_size)
        if ctx.is_main:
            from podtrain.eval.harness import chance_lines, table

            out = Path(args.out) if args.out else default_out(source, summary.get("step"))
            kept = write_results(out, results, summary)
            print(table(results))
            for line in chance_lines(results, summary.get("chance") or {}):
                print(line)
            print(f"{summary['requests']} requests in {summary['seconds']:.1f} s on {ctx.world_size} "
                  f"rank(s): {summary['requests_per_s']:.1f} requests/s | wrote {out}"
                  + (f" (kept the earlier results of {', '.join(kept)})" if kept else ""))
    return 0


def evaluate(source: Path, names: list[str], ctx, include: list[Path], limit: int | None,
             step: int | None, data: str | None, batch_size: int) -> tuple[dict, dict]:
    """Load ``source`` and run the tasks on every rank; rank 0 gets (results, summary)."""
    from podtrain.eval.evaluator import TaskEvaluator
    from podtrain.eval.harness import chance_levels
    from podtrain.eval.source import load_source
    from podtrain.train.precision import resolve_precision

    loaded = load_source(source, step, data, ctx)
    evaluator = ctx.agree_on(lambda: TaskEvaluator(names, include, limit, loaded.manifest,
                                                   loaded.tokenizer, batch_size, max_length=loaded.max_length))
    model = loaded.model.to(ctx.device)
    precision = resolve_precision("auto", ctx.device)
    results, mine = evaluator.run(model, ctx, precision.autocast)
    every = ctx.gather_object(mine)  # rank 0 alone writes the summary
    if every is None:
        return results or {}, {}
    seconds = max(m["seconds"] for m in every)
    requests = sum(m["requests"] for m in every)
    summary = {"source": str(source), "label": loaded.label, "step": loaded.step, "tasks": names,
               "data": str(loaded.manifest.root) if loaded.manifest is not None else None,
               "world_size": ctx.world_size, "requests": requests, "seconds": round(seconds, 3),
               "requests_per_s": requests / seconds if seconds > 0 else 0.0, "precision": precision.name,
               "chance": chance_levels(results, evaluator.tasks, limit)}
    return results or {}, summary


def default_out(source: Path, step: int | None) -> Path:
    """Where the JSON goes without ``--out``: beside what was evaluated."""
    from podtrain.eval.source import is_hf_folder

    if is_hf_folder(source):
        return source / "eval_results.json"
    return source / "eval" / f"step_{step:06d}.json"


def out_folder(source: Path, out: str | None) -> Path:
    """The folder the JSON will be written to (checked before the evaluation)."""
    if out:
        return Path(out).parent
    return default_out(source, 0).parent


TASK_KEYED = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot",
              "higher_is_better", "n-samples")
"""The sections of lm-eval's results that are keyed by task (or group) name: what a merge keeps
per task. The rest (``config``, ``date``, the environment) describes the newest evaluation."""

PER_TASK = "podtrain_tasks"
"""Top-level key: task name -> the ``podtrain`` summary of the evaluation that scored it."""

LOCK_DEADLINE_S = 60.0
"""How long a writer waits for another one's lock (held only to read, merge and write a JSON)."""


def merge_results(old: dict[str, Any] | None, new: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``new`` (lm-eval's results plus ``podtrain`` and ``PER_TASK``) merged into ``old`` (what
    the file held, or None): each task of ``new`` replaces its own entries in every task-keyed
    section, ``old``'s other tasks are kept. Only results of the same step are merged (an
    exported folder has none: None is its step); otherwise ``new`` replaces ``old`` whole.
    Returns the merged dict and the names of the tasks kept from ``old``."""
    if not isinstance(old, dict) or not isinstance(old.get("results"), dict):
        return new, []
    if (old.get("podtrain") or {}).get("step") != new["podtrain"].get("step"):
        return new, []
    mine = set().union(*(new.get(k) or {} for k in TASK_KEYED))
    kept = sorted(name for name in old["results"] if name not in mine)
    merged = dict(new)
    for key in TASK_KEYED:
        earlier = {n: v for n, v in (old.get(key) or {}).items() if n not in mine}
        if earlier or key in new:
            merged[key] = {**earlier, **(new.get(key) or {})}
    # A file written before PER_TASK existed: its tasks came from the evaluation its summary names.
    earlier_by_task = old.get(PER_TASK) or {n: old.get("podtrain") for n in old["results"]}
    merged[PER_TASK] = {**{n: s for n, s in earlier_by_task.items() if n not in mine}, **new[PER_TASK]}
    return merged, kept


def write_results(path: Path, results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """Write lm-eval's ``results`` with ``summary`` (the ``podtrain`` entry) to ``path``, merged
    with the results already there (``merge_results``); returns the tasks kept from before."""
    new = {**results, "podtrain": summary,
           PER_TASK: {name: summary for name in (results.get("results") or {})}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent):  # two evals of one step at once: neither loses the other's tasks
        old = _read_json(path)
        merged, kept = merge_results(old, new)
        if isinstance(old, dict) and merged is new and old.get("results"):
            log.warning("eval: %s held results of step %s, not %s: replaced", path,
                        (old.get("podtrain") or {}).get("step"), summary.get("step"))
        write_json(path, merged)
    return kept


def _read_json(path: Path) -> Any:
    """The JSON at ``path``; None if there is none, or it is not JSON (then it is replaced)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        log.warning("eval: %s is not valid JSON: replaced, not merged", path)
        return None


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` itself (no lock file left behind), waited for at most
    ``LOCK_DEADLINE_S``. Past the deadline (a holder stuck on its file system), or where the file
    system has no ``flock`` (some network mounts), the write goes on unlocked: still atomic, and
    an evaluation's results are never thrown away; only two evals writing at that very moment
    could then lose one's tasks."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            if not flock_within(fd, LOCK_DEADLINE_S):
                log.warning("eval: %s has been locked by another writer for %.0f s: writing unlocked",
                            folder, LOCK_DEADLINE_S)
        except OSError:  # no flock on this file system: atomic, unlocked
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def write_json(path: Path, results: dict) -> None:
    """lm-eval's results as JSON (what it cannot serialise as text), atomically."""
    from lm_eval.utils import handle_non_serializable

    atomic_write_text(path, json.dumps(results, indent=1, default=handle_non_serializable))
