"""Offline lm-eval tasks made from data podtrain already has, as task YAML + JSONL.

``podtrain-next-line``: given up to ``CONTEXT_LINES`` lines of a held-out document (the data
directory's validation split: for ``prepare builtin``, standard-library sources no training step
saw), choose its true next line among ``CHOICES`` lines. The distractors are lines of *other*
documents of nearly the same length, so a model that only prefers short (or long) lines scores
chance (1 / CHOICES); one that has learnt the language's structure scores above it.

Everything is derived deterministically from the split's tokens (fixed seed, sorted pools), and
written content-addressed under a cache directory (temporary name, then rename), so every rank
of a job, and every run on the same data, reads the same files and lm-eval's dataset cache holds
one entry per content. Any JSONL becomes a task the same way: see ``task_yaml`` and the README's
"Evaluating on your own data".
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from podtrain.data.manifest import Manifest
from podtrain.errors import UserError

NEXT_LINE = "podtrain-next-line"
SHIPPED = (NEXT_LINE,)
"""Task names podtrain makes itself (no download)."""
CONTEXT_LINES = 4
CHOICES = 4
MIN_LINE_CHARS = 12
"""Shorter lines (``else:``, ``)``, blank) are too easy to guess from the indentation alone."""
MAX_DOCS = 500
MAX_TOKENS = 4_000_000
"""Validation tokens read at most (the split may be large; 500 questions need far fewer)."""
LENGTH_WINDOW = 24
"""Distractors come from the lines nearest in length to the true one: this many on each side."""
SEED = 20240601


def cache_dir() -> Path:
    """Where generated tasks are kept: ``$PODTRAIN_CACHE``, else ``$XDG_CACHE_HOME/podtrain``,
    else ``~/.cache/podtrain``; ``tasks/`` below it."""
    root = os.environ.get("PODTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "podtrain")
    return Path(root) / "tasks"


def validation_texts(manifest: Manifest, tokenizer: Any, max_tokens: int = MAX_TOKENS) -> list[str]:
    """The validation split's documents as text (split at EOS; the first ``max_tokens`` tokens)."""
    if "val" not in manifest.splits():
        raise UserError(f"{manifest.root / 'manifest.json'} has no validation split: {NEXT_LINE} is "
                        "made from it (prepare with --val-fraction above 0)")
    tokens = manifest.head_tokens("val", max_tokens)
    bounds = np.flatnonzero(tokens == manifest.eos_id)
    texts, start = [], 0
    for end in [*bounds.tolist(), len(tokens)]:
        if end > start:
            texts.append(tokenizer.decode(tokens[start:end].tolist()))
        start = end + 1
    return texts


def next_line_docs(texts: list[str], max_docs: int = MAX_DOCS, seed: int = SEED) -> list[dict[str, Any]]:
    """The task's questions: ``{"context", "choices", "label"}``, at most ``max_docs``, chosen
    evenly at random (``seed``) among the lines that have a line of context and are long enough."""
    lines = [t.split("\n") for t in texts]
    candidates = [(d, i) for d, doc in enumerate(lines) for i in range(1, len(doc))
                  if len(doc[i].strip()) >= MIN_LINE_CHARS and doc[i - 1].strip()]
    pool = sorted({(len(lines[d][i]), lines[d][i], d) for d, i in candidates})
    if len({d for d, _ in candidates}) < 2 or len(pool) < 4 * CHOICES:
        raise UserError(f"the validation split is too small for {NEXT_LINE}: {len(pool)} usable lines "
                        f"in {len({d for d, _ in candidates})} documents (need {4 * CHOICES} in 2 or more)")
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(len(candidates), size=min(max_docs, len(candidates)), replace=False))
    docs = []
    for k in picked.tolist():
        d, i = candidates[k]
        true = lines[d][i]
        centre = bisect.bisect_left(pool, (len(true), true, d))
        window = pool[max(0, centre - LENGTH_WINDOW):centre + LENGTH_WINDOW + 1]
        options = sorted({text for _, text, doc in window if doc != d and text != true})
        if len(options) < CHOICES - 1:
            continue
        distractors = [options[j] for j in rng.choice(len(options), size=CHOICES - 1, replace=False)]
        label = int(rng.integers(CHOICES))
        choices = distractors[:label] + [true] + distractors[label:]
        context = "\n".join(lines[d][max(0, i - CONTEXT_LINES):i]) + "\n"
        docs.append({"context": context, "choices": [c + "\n" for c in choices], "label": label})
    return docs


def task_yaml(name: str, jsonl: Path, text: str = "{{context}}", choices: str = "{{choices}}",
              target: str = "{{label}}", delimiter: str = "") -> str:
    """lm-eval task YAML for a multiple-choice JSONL file (one ``{"context", "choices", "label"}``
    object per line by default): scored by the log-likelihood of each choice after the context
    (``acc``, and ``acc_norm`` per byte of choice)."""
    return "\n".join([
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(jsonl))}",
        "test_split: test",
        "output_type: multiple_choice",
        f"doc_to_text: {json.dumps(text)}",
        f"doc_to_choice: {json.dumps(choices)}",
        f"doc_to_target: {json.dumps(target)}",
        f"target_delimiter: {json.dumps(delimiter)}",
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "  - metric: acc_norm",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 1.0",
        "",
    ])


def write_task(docs: list[dict[str, Any]], name: str = NEXT_LINE, root: Path | None = None) -> Path:
    """Write ``name``'s JSONL and YAML into a folder named by their content under ``root``
    (default ``cache_dir()``); returns the folder, for lm-eval's ``include_path``. A folder
    that already exists is complete (it appears by rename only), so it is reused as it is."""
    body = "".join(json.dumps(doc, ensure_ascii=False, sort_keys=True) + "\n" for doc in docs)
    digest = hashlib.sha256(f"{name}\n{body}".encode()).hexdigest()[:16]
    folder = (root or cache_dir()) / f"{name}-{digest}"
    if folder.is_dir():
        return folder
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    (tmp / f"{name}.jsonl").write_text(body, encoding="utf-8")
    (tmp / f"{name}.yaml").write_text(task_yaml(name, folder / f"{name}.jsonl"), encoding="utf-8")
    try:
        tmp.rename(folder)
    except OSError:  # another rank renamed the same content first
        if not folder.is_dir():
            raise
        for path in tmp.iterdir():
            path.unlink()
        tmp.rmdir()
    return folder


def shipped_task_dirs(names: list[str], manifest: Manifest | None, tokenizer: Any) -> list[Path]:
    """The include folders of the shipped tasks among ``names`` (made from ``manifest``'s data)."""
    if NEXT_LINE not in names:
        return []
    if manifest is None:
        raise UserError(f"{NEXT_LINE} is made from the run's validation data: pass --data DATA_DIR")
    return [write_task(next_line_docs(validation_texts(manifest, tokenizer)))]
