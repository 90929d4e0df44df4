"""``podtrain eval RUN_DIR|HF_DIR --tasks NAME[,NAME] [--include DIR] [--limit N] [--out FILE]``.

lm-eval tasks on a run's newest checkpoint (or ``--step N``), or on an exported folder, with
podtrain's own model and tokenizer and no export written. Under torchrun (``podtrain launch
local``'s torchrun, or ``torchrun ... -m podtrain.cli eval ...``) every rank loads the model and
scores its share of the requests; rank 0 logs its progress every 30 s (``eval/progress.py``),
prints lm-eval's table and writes its JSON (``--out``, else ``RUN_DIR/eval/step_NNNNNN.json``, or
``HF_DIR/eval_results.json`` beside an exported model: never into the current directory; a
folder it cannot write to is one line before any scoring), plus a ``podtrain`` entry: what was
evaluated, the data its tokenizer came from, the ranks, the requests per second.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import uuid
from pathlib import Path

from podtrain.errors import UserError
from podtrain.fsutil import writable_dir

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
            from podtrain.eval.harness import table

            out = Path(args.out) if args.out else default_out(source, summary.get("step"))
            write_json(out, {**results, "podtrain": summary})
            print(table(results))
            print(f"{summary['requests']} requests in {summary['seconds']:.1f} s on {ctx.world_size} "
                  f"rank(s): {summary['requests_per_s']:.1f} requests/s | wrote {out}")
    return 0


def evaluate(source: Path, names: list[str], ctx, include: list[Path], limit: int | None,
             step: int | None, data: str | None, batch_size: int) -> tuple[dict, dict]:
    """Load ``source`` and run the tasks on every rank; rank 0 gets (results, summary)."""
    from podtrain.eval.evaluator import TaskEvaluator
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
               "requests_per_s": requests / seconds if seconds > 0 else 0.0, "precision": precision.name}
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


def write_json(path: Path, results: dict) -> None:
    """lm-eval's results as JSON (what it cannot serialise as text), atomically."""
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(results, indent=1, default=handle_non_serializable))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
