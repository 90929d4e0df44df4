"""Pre-flight checks of a run that one process can make alone, before any collective.

``check_run`` is called by every rank at start and by ``launch local`` before it starts torchrun,
so a mistake in the config or the data is one line (``UserError``, exit 2) rather than a worker
failure inside torchrun.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from podtrain.config import RunConfig, accumulation_steps
from podtrain.data.loader import SampleIndex
from podtrain.data.manifest import check_vocab, read_manifest
from podtrain.model import check_fits, estimate_params, preset_config, round_up
from podtrain.observe.hardware import device_memory_bytes


@dataclass
class CheckedRun:
    """What ``check_run`` found valid: the data's manifest, the model config, the accumulation."""

    manifest: Any
    model_config: Any
    accum: int
    val_index: SampleIndex | None


def check_run(cfg: RunConfig, world_size: int, local_world_size: int,
              device: torch.device) -> CheckedRun:
    """The checks one process can make alone, raising a one-line UserError on a mistake: the
    batch arithmetic, the data (manifest, vocabulary, enough tokens per split), the model preset
    and whether its training state fits one device. Every rank runs it at start, and
    ``launch local`` runs it before starting torchrun, so a mistake is one line, not a worker
    failure."""
    accum = accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    manifest = read_manifest(cfg.data.path)
    vocab = cfg.model.vocab_size or round_up(manifest.vocab_size, 64)
    check_vocab(manifest, vocab)
    SampleIndex(manifest, "train", cfg.data.seq_len)  # enough tokens, shards present and whole
    val_index = (SampleIndex(manifest, "val", cfg.data.seq_len)
                 if cfg.eval.every and "val" in manifest.splits() else None)
    model_config = preset_config(cfg.model.preset, vocab)
    where = "one GPU" if device.type != "cpu" else "this rank's share of host memory"
    check_fits(estimate_params(model_config), device_memory_bytes(device, local_world_size), where,
               cfg.model.memory_check)
    return CheckedRun(manifest, model_config, accum, val_index)
