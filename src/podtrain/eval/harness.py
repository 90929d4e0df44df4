"""lm-evaluation-harness, driven the same way by ``podtrain eval`` and by the loop's ``eval.tasks``.

* ``require_lm_eval``: the extra is installed, else one line naming it (exit 2). Before lm-eval
  (and so ``datasets``) is imported, ``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` default to 1:
  podtrain evaluates offline unless the user sets them to 0 (no retries against an unreachable
  hub; a missing dataset is one line naming it and how to pre-download it).
* ``TaskSet``: the task folders (podtrain's shipped tasks, the user's ``--include`` folders) and
  lm-eval's index over them. lm-eval's own ~15,000 task configs are indexed only when a requested
  name is not among the local ones (indexing them takes ten seconds and more).
* ``run_tasks``: lm-eval's ``simple_evaluate`` on every rank (the requests shared out by the
  evaluator through ``PodtrainLM``), the process's RNGs left as they were (lm-eval reseeds them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from podtrain.errors import UserError

log = logging.getLogger("podtrain")

EXTRA_HINT = "pip install 'podtrain[eval]'"
OFFLINE_VARS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def require_lm_eval(what: str = "podtrain eval") -> None:
    """Import lm-eval (offline by default, see the module docstring); a UserError without it."""
    for var in OFFLINE_VARS:
        os.environ.setdefault(var, "1")
    try:
        import lm_eval  # noqa: F401
        import lm_eval.evaluator  # noqa: F401
    except ImportError:
        raise UserError(f"{what} needs lm-evaluation-harness, which is not installed: {EXTRA_HINT}") from None


def parse_tasks(text: str | list[str]) -> list[str]:
    """``a,b`` (or a list) -> task names, in order, without blanks or repeats."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names = []
    for item in items:
        name = str(item).strip()
        if name and name not in names:
            names.append(name)
    return names


class TaskSet:
    """Which task folders lm-eval reads, checked against the requested names."""

    def __init__(self, names: list[str], folders: list[Path]):
        """``folders``: shipped task folders first, then the user's (a missing one is an error)."""
        from lm_eval.tasks import TaskManager

        for folder in folders:
            if not Path(folder).is_dir():
                raise UserError(f"--include {folder}: no such directory (it should hold task YAML files)")
        if not names:
            raise UserError("no task named: pass --tasks NAME[,NAME] (e.g. podtrain-next-line)")
        self.names = names
        paths = [str(f) for f in folders]
        manager = TaskManager(include_path=paths or None, include_defaults=False) if paths else None
        if manager is None or any(n not in manager.all_tasks for n in names):
            manager = TaskManager(include_path=paths or None)
        unknown = [n for n in names if n not in manager.all_tasks and not _is_pattern(n)]
        if unknown:
            raise UserError(f"unknown task {unknown[0]!r}: neither podtrain's, lm-eval's, nor in "
                            f"--include {', '.join(paths) or '(none given)'}")
        self.manager = manager


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


@contextlib.contextmanager
def rng_kept(device: torch.device) -> Iterator[None]:
    """Restore Python's, numpy's and torch's (this device's too) RNG states on exit: lm-eval
    seeds them, and a training run must continue as if it had not evaluated."""
    py, np_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(np_state)


def run_tasks(lm: Any, tasks: TaskSet, limit: int | None) -> dict[str, Any] | None:
    """lm-eval on every rank; rank 0 gets lm-eval's results dict, the others None. A dataset that
    cannot be loaded is a UserError naming it (``missing_dataset_message``)."""
    from lm_eval.evaluator import simple_evaluate

    try:
        with rng_kept(lm.device):
            return simple_evaluate(model=lm, tasks=list(tasks.names), limit=limit or None,
                                   task_manager=tasks.manager, log_samples=False, verbosity=None)
    except Exception as exc:
        message = missing_dataset_message(exc)
        if message is None:
            raise
        raise UserError(message) from None


def missing_dataset_message(exc: BaseException) -> str | None:
    """One line for an exception raised while a task loaded its dataset, else None: the task, the
    dataset, and how to pre-download it on a machine with a network."""
    task = path = name = None
    tb = exc.__traceback__
    while tb is not None:
        config = getattr(tb.tb_frame.f_locals.get("self"), "config", None)
        if getattr(config, "dataset_path", None):
            task, path, name = getattr(config, "task", None), config.dataset_path, config.dataset_name
        tb = tb.tb_next
    if path is None:
        return None
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    args = f"{path!r}" + (f", {name!r}" if name else "")
    return (f"task {task}: dataset {path}{'/' + name if name else ''} is not on this machine ({first}); "
            f"pre-download it where there is a network: HF_HOME=/shared/hf python -c \"import datasets; "
            f"datasets.load_dataset({args})\", then run with HF_HOME=/shared/hf (podtrain evaluates "
            "offline: HF_DATASETS_OFFLINE=1 unless you set it to 0)")


def flat_metrics(results: dict[str, Any] | None) -> dict[str, float]:
    """``{"TASK/METRIC": value}`` of lm-eval's results (``acc``, ``acc_stderr``...; the filter
    suffix ``,none`` dropped), for metrics.jsonl and the trackers."""
    flat: dict[str, float] = {}
    for task, metrics in ((results or {}).get("results") or {}).items():
        for key, value in metrics.items():
            if key == "alias" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, filt = key.partition(",")
            flat[f"{task}/{metric}" + (f"/{filt}" if filt and filt != "none" else "")] = float(value)
    return flat


def table(results: dict[str, Any]) -> str:
    """lm-eval's own Markdown table of the results."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def chance_levels(results: dict[str, Any] | None, tasks: TaskSet, limit: int | None) -> dict[str, dict[str, Any]]:
    """``{task: {"chance": p, "choices": [fewest, most]}}`` for each multiple-choice task of
    lm-eval's ``results``: the accuracy of a uniform guess, the mean of 1/choices over the
    documents scored (the first ``limit``, as lm-eval takes them). The choices are counted from
    the task's documents (``doc_to_choice``), which lm-eval's results do not keep: the task is
    loaded again, from the local dataset cache. A task that cannot be counted is left out."""
    configs = (results or {}).get("configs") or {}
    scored = (results or {}).get("results") or {}
    names = [n for n, c in configs.items() if n in scored and (c or {}).get("output_type") == "multiple_choice"]
    if not names:
        return {}
    try:
        loaded = tasks.manager.load(names)["tasks"]
    except Exception as exc:  # a hint only: never fail an evaluation that has finished
        log.debug("eval: chance levels not counted (%s)", exc)
        return {}
    out = {}
    for name in names:
        task = loaded.get(name)
        try:
            counts = [len(task.doc_to_choice(doc)) for _, doc in task.doc_iterator(limit=limit)]
        except Exception as exc:  # as above: a task whose choices cannot be listed gets no hint
            log.debug("eval: %s: choices not counted (%s)", name, exc)
            continue
        if counts and min(counts) > 0:
            out[name] = {"chance": sum(1 / n for n in counts) / len(counts), "choices": [min(counts), max(counts)]}
    return out


def chance_lines(results: dict[str, Any] | None, chance: dict[str, dict[str, Any]]) -> list[str]:
    """One line per multiple-choice task: its chance level beside its accuracies (``acc``,
    ``acc_norm``), each with lm-eval's standard error and how many of them it lies from chance
    (with a small ``--limit`` the error is wide: an accuracy within 2 of chance says nothing)."""
    lines = []
    for name, level in chance.items():
        metrics = ((results or {}).get("results") or {}).get(name) or {}
        low, high = level["choices"]
        parts = []
        for metric in ("acc", "acc_norm"):
            value, err = metrics.get(f"{metric},none"), metrics.get(f"{metric}_stderr,none")
            if not isinstance(value, (int, float)):
                continue
            text = f"{metric} {value:.4f}"
            if isinstance(err, (int, float)) and err > 0:
                gap = (value - level["chance"]) / err
                where = ("within 2 standard errors of chance" if abs(gap) < 2
                         else f"{abs(gap):.1f} standard errors {'above' if gap > 0 else 'below'} chance")
                text += f" ± {err:.4f} ({where})"
            parts.append(text)
        choices = f"{low} choices" if low == high else f"{low}-{high} choices per question"
        lines.append(f"{name}: chance {level['chance']:.4f} ({choices})" + (" | " + ", ".join(parts) if parts else ""))
    return lines
