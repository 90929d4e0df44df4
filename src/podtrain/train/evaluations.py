"""What the loop evaluates, and when: one ``kind=eval`` record per evaluation step.

* validation loss every ``eval.every`` steps (``train/evaluate.py``), with bits per byte: the loss
  in bits divided by the validation text's bytes per token, which does not depend on the
  tokenizer, so runs with different tokenizers compare; a ``data.mix`` run validates each source
  on its own split (``val_loss_by_source``, ``val_bpb_by_source``) and the mixture's figures are
  the sources' weighted as the training mix;
* lm-eval tasks (``eval.tasks``) every ``eval.tasks_every`` steps, each rank scoring its share
  with the model itself (under FSDP/HSDP the sharded model, its forwards in step over the ranks:
  ``podtrain.eval.lockstep``), in windows of ``data.seq_len`` tokens and forwards of at most a
  training micro-batch's tokens (``train.micro_batch_size`` x ``data.seq_len``), so it needs no
  more memory than ``plan`` counts for it (``plan.memory.task_eval_bytes``): the record gains
  ``TASK/METRIC`` fields (``podtrain-next-line/acc``).

Both also run at the last step. ``eval.tasks`` is checked when the run starts (lm-eval
installed, task names known, the shipped tasks written), not after hours of training. This is
the one place training reaches ``podtrain.eval`` (imported only when ``eval.tasks`` is set;
nothing in ``podtrain.eval`` imports training code).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from torch import nn

from podtrain.config_sections import EvalSection
from podtrain.data.doc_mask import DocumentMasker
from podtrain.data.manifest import Manifest
from podtrain.data.samples import SampleIndex
from podtrain.data.sources import DataSources
from podtrain.distributed.group import DistContext
from podtrain.distributed.watchdog import Watchdog
from podtrain.train.evaluate import evaluate_sources
from podtrain.train.precision import Precision

TASK_BATCH_SIZE = 32
BYTES_SAMPLE_TOKENS = 2_000_000
"""Validation tokens decoded to measure bytes per token (a sample large enough for 4 digits)."""


def bytes_per_token(manifest: Manifest, split: str = "val", max_tokens: int = BYTES_SAMPLE_TOKENS) -> float:
    """UTF-8 bytes of text per token of ``split`` (its first ``max_tokens`` tokens, EOS counted
    as a token of no bytes), decoded with the data's own tokenizer."""
    from podtrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(manifest)
    tokens = manifest.head_tokens(split, max_tokens)
    total_tokens, total_bytes = len(tokens), 0
    bounds = [-1, *np.flatnonzero(tokens == manifest.eos_id).tolist(), len(tokens)]
    for a, b in zip(bounds, bounds[1:]):
        if b > a + 1:
            total_bytes += len(tokenizer.decode(tokens[a + 1:b].tolist()).encode("utf-8"))
    return total_bytes / total_tokens if total_tokens else float("nan")


def bits_per_byte(loss_nats: float, bytes_per_tok: float) -> float:
    """Validation loss (nats per token) as bits per byte of text."""
    return loss_nats / math.log(2) / bytes_per_tok if bytes_per_tok > 0 else float("nan")


class Evaluations:
    """The loop's evaluations (see the module docstring); built in setup, on every rank."""

    def __init__(self, cfg: EvalSection, val_indexes: dict[str, SampleIndex], sources: DataSources,
                 micro_batch_size: int, masker: DocumentMasker | None = None):
        """Raises a ``UserError`` for an ``eval.tasks`` that cannot run (every rank alike).
        ``val_indexes``: each source's validation samples (``DataSources.val_indexes``);
        ``masker``: the training loader's under data.document_masking (validation masks alike)."""
        self.cfg, self.val_indexes, self.micro_batch_size = cfg, val_indexes, micro_batch_size
        self.masker = masker
        self.sources, manifest = sources, sources.manifest
        self.validating = bool(cfg.every) and bool(val_indexes)
        manifests = dict(zip(sources.names, sources.manifests))
        self.bytes_per_token = {name: bytes_per_token(manifests[name]) for name in val_indexes} \
            if self.validating else {}
        self.tasks = None
        if cfg.tasks:
            from podtrain.data.tokenizer import load_tokenizer
            from podtrain.eval.evaluator import TaskEvaluator
            from podtrain.eval.harness import parse_tasks

            seq_len = sources.seq_len
            self.tasks = TaskEvaluator(parse_tasks(cfg.tasks), [], cfg.tasks_limit or None, manifest,
                                       load_tokenizer(manifest), TASK_BATCH_SIZE, what="eval.tasks",
                                       max_length=seq_len, max_tokens=micro_batch_size * seq_len)

    def due(self, step: int, last: bool) -> bool:
        """Is anything evaluated after ``step``?"""
        return self._validate_now(step, last) or self._tasks_now(step, last)

    def _validate_now(self, step: int, last: bool) -> bool:
        return self.validating and (step % self.cfg.every == 0 or last)

    def _tasks_now(self, step: int, last: bool) -> bool:
        every = self.cfg.tasks_every
        return self.tasks is not None and (last or (every > 0 and step % every == 0))

    def run(self, step: int, last: bool, model: nn.Module, ctx: DistContext, precision: Precision,
            watchdog: Watchdog | None = None) -> dict[str, Any]:
        """Evaluate on every rank; the record's fields (``val_loss``, ``val_bpb``, task metrics,
        ``eval_s``) are complete on rank 0. Each task batch beats ``watchdog`` (with ``step``, the
        last completed step): a long evaluation is progress, not a hang."""
        t0 = time.perf_counter()
        record: dict[str, Any] = {}
        if self._validate_now(step, last):
            weights = self.sources.weights
            val, losses = evaluate_sources(model, self.val_indexes, weights, ctx, self.micro_batch_size,
                                           self.cfg.max_batches, precision, self.masker)
            bpbs = {name: bits_per_byte(loss, self.bytes_per_token[name]) for name, loss in losses.items()}
            record.update(val_loss=val, val_bpb=sum(weights[n] * b for n, b in bpbs.items())
                          / sum(weights[n] for n in bpbs), **self.sources.by_source("val_loss", losses),
                          **self.sources.by_source("val_bpb", bpbs))
            if len(bpbs) == 1:
                record["bytes_per_token"] = next(iter(self.bytes_per_token.values()))
        if self._tasks_now(step, last):
            from podtrain.eval.harness import flat_metrics

            beat = (lambda: watchdog.beat(step)) if watchdog is not None else None
            results, _ = self.tasks.run(model, ctx, precision.autocast, beat)
            record.update(flat_metrics(results))
        record["eval_s"] = time.perf_counter() - t0
        return record


def describe(record: dict[str, Any]) -> str:
    """The progress line's text for an evaluation record."""
    parts = []
    if "val_loss" in record:
        parts.append(f"validation loss {record['val_loss']:.4f} ({record['val_bpb']:.4f} bits/byte)")
        by_source = record.get("val_loss_by_source", {})
        if by_source:
            parts.append("by source " + ", ".join(f"{name} {loss:.4f}" for name, loss in by_source.items()))
    parts += [f"{key} {value:.4f}" for key, value in record.items()
              if "/" in key and key.rsplit("/", 1)[-1] in ("acc", "acc_norm", "word_perplexity", "exact_match")]
    return ", ".join(parts)
