"""Pre-flight checks of a run that one process can make alone, before any collective.

``check_run`` is called by every rank at start and by ``launch local`` before it starts torchrun,
so a mistake in the config or the data is one line (``UserError``, exit 2) rather than a worker
failure inside torchrun.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from podtrain.config import RunConfig, accumulation_steps
from podtrain.data.samples import SampleIndex
from podtrain.data.sources import DataSources
from podtrain.errors import UserError
from podtrain.model import init_config, preset_config, preset_numbers, round_up
from podtrain.observe.hardware import device_memory_bytes
from podtrain.observe.trackers import resolve_trackers
from podtrain.plan.fit import Devices, check_memory
from podtrain.plan.memory import WEIGHT_BYTES
from podtrain.plan.shape import config_shape
from podtrain.train.strategy import shard_group_size

log = logging.getLogger("podtrain")
# What one host may hold of rank 0's whole fp32 model copy (the rest: the interpreter, the data).
STATE_SHARE = 0.9


@dataclass
class CheckedRun:
    """What ``check_run`` found valid: the data's manifest, the model config, the accumulation."""

    manifest: Any
    model_config: Any
    accum: int
    val_indexes: dict[str, SampleIndex]
    """Each source's validation samples (sources without a val split, or eval.every=0: none)."""
    accumulate_unsharded: bool = True
    """fsdp/hsdp: gradients accumulate unsharded between micro-batches (``plan.fit.accumulates_unsharded``)."""
    sources: DataSources | None = None
    """The run's data sources (``data.path`` or ``data.mix``), opened."""


def check_run(cfg: RunConfig, world_size: int, local_world_size: int,
              device: torch.device, device_bytes: int | None = None,
              manifests: list | None = None, shape_only: bool = False) -> CheckedRun:
    """The checks one process can make alone, raising a one-line UserError on a mistake: the
    batch arithmetic, the data (manifest, vocabulary, enough tokens per split), the model preset
    and whether the job fits one device's memory (``device_bytes``, else the device's own): the
    check ``podtrain plan`` and the cluster launchers make (``plan.fit.check_memory``), which also
    decides FSDP's accumulation mode. Every rank runs it at start, and ``launch local`` runs it
    before starting torchrun, so a mistake is one line, not a worker failure. ``manifests``: the
    S3 sources' manifests rank 0 read for every rank (``data.sources.shared_manifests``).
    ``shape_only``: a caller that builds no model (``launch local``) gets a built-in preset's
    numbers (``model.preset_numbers``) as ``model_config``, not a transformers config: the same
    checks without importing transformers."""
    accum = accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    if cfg.train.gc_every < 0:
        raise UserError(f"config key 'train.gc_every' must not be negative, got {cfg.train.gc_every} "
                        "(0: Python's automatic garbage collector)")
    for line in config_warnings(cfg):
        # INFO: what every rank finds alike is said once, by rank 0 (the others log WARNING up).
        log.info("warning: %s", line)
    resolve_trackers(cfg.log.trackers)  # a tracker named but not installed
    sources = DataSources.from_config(cfg.data, manifests=manifests)  # enough tokens, shards present and whole
    manifest = sources.manifest
    if cfg.model.init_from:  # the folder's architecture and vocabulary; the data's tokenizer must be its own
        model_config = init_config(cfg.model.init_from, cfg.model.vocab_size, manifest.tokenizer, str(manifest.root))
        vocab = int(model_config.vocab_size)
    else:
        vocab = cfg.model.vocab_size or round_up(manifest.vocab_size, 64)
        numbers = preset_numbers(cfg.model.preset, vocab) if shape_only else None
        model_config = numbers if numbers is not None else preset_config(cfg.model.preset, vocab)
    sources.check_vocab(vocab)
    val_indexes = sources.val_indexes() if cfg.eval.every else {}
    shape = config_shape(model_config, cfg.data.seq_len)
    if device_bytes is None:
        device_bytes = device_memory_bytes(device, local_world_size)
    where = "one GPU" if device.type != "cpu" else "this rank's share of host memory"
    if cfg.dist.strategy == "hsdp":
        shard_group_size(cfg.dist, world_size, local_world_size)  # it must divide the world
    devices = Devices(where, local_world_size, device_bytes or 0, gpu=device.type != "cpu")
    decision = check_memory(cfg, shape, devices, world_size, cfg.model.memory_check)
    if cfg.dist.strategy != "ddp" and world_size > 1 and not cfg.model.init_from:  # init_from: no whole copy
        check_host_copy(shape.params, device_memory_bytes(torch.device("cpu"), 1), cfg.dist.strategy,
                        cfg.model.memory_check)
    unsharded = decision.accumulate_unsharded
    return CheckedRun(manifest, model_config, accum, val_indexes, unsharded, sources)


def config_warnings(cfg: RunConfig) -> list[str]:
    """Settings that run but are rarely meant, one line each: a warmup as long as the run
    (``optim.warmup_steps >= train.steps``: the learning rate never reaches its schedule's end)."""
    warmup, steps = cfg.optim.warmup_steps, cfg.train.steps
    if warmup < steps:
        return []
    return [f"optim.warmup_steps={warmup} >= train.steps={steps}: the run ends inside its warmup, the "
            f"learning rate reaching {min(1.0, steps / warmup):.0%} of optim.lr={cfg.optim.lr:g} at its last "
            f"step and never decaying; lower optim.warmup_steps (a few % of train.steps is usual)"]


def check_host_copy(params: int, host_bytes: int | None, strategy: str, policy: str = "error") -> str | None:
    """fsdp/hsdp: global rank 0 initialises the whole fp32 model in host memory before the shards
    are filled from it (``build_for_strategy``); refuse (or warn) when that cannot fit this host."""
    need = params * WEIGHT_BYTES
    if policy == "off" or not host_bytes or need <= STATE_SHARE * host_bytes:
        return None
    msg = (f"model has {params / 1e9:.2f}B parameters: dist.strategy={strategy} initialises the whole fp32 "
           f"model (~{need / 2**30:.1f} GiB) in global rank 0's host memory before sharding it, more than "
           f"this host holds ({host_bytes / 2**30:.1f} GiB): use nodes with more memory or a smaller model.preset")
    return _refuse(msg, policy)


def _refuse(msg: str, policy: str) -> str:
    """model.memory_check: ``error`` raises the one-line UserError, ``warn`` logs it; returns it."""
    if policy == "error":
        raise UserError(msg + " (model.memory_check=warn to try anyway)")
    log.warning(msg)
    return msg
