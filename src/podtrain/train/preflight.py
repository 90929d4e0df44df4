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
from podtrain.model import estimate_params, preset_config, round_up
from podtrain.observe.hardware import device_memory_bytes
from podtrain.observe.trackers import resolve_trackers
from podtrain.plan.memory import GRAD_BYTES, OPTIM_BYTES, WEIGHT_BYTES
from podtrain.train.precision import resolve_precision
from podtrain.train.strategy import shard_group_size

log = logging.getLogger("podtrain")
# What one device may hold of the training state before activations (the rest: activations,
# the CUDA context, allocator slack).
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
    """fsdp/hsdp: gradients accumulate unsharded between micro-batches (``accumulates_unsharded``)."""
    sources: DataSources | None = None
    """The run's data sources (``data.path`` or ``data.mix``), opened."""


def check_run(cfg: RunConfig, world_size: int, local_world_size: int,
              device: torch.device) -> CheckedRun:
    """The checks one process can make alone, raising a one-line UserError on a mistake: the
    batch arithmetic, the data (manifest, vocabulary, enough tokens per split), the model preset
    and whether its training state fits one device. Every rank runs it at start, and
    ``launch local`` runs it before starting torchrun, so a mistake is one line, not a worker
    failure."""
    accum = accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    resolve_trackers(cfg.log.trackers)  # a tracker named but not installed
    sources = DataSources.from_config(cfg.data)  # enough tokens, shards present and whole
    manifest = sources.manifest
    vocab = cfg.model.vocab_size or round_up(manifest.vocab_size, 64)
    sources.check_vocab(vocab)
    val_indexes = sources.val_indexes() if cfg.eval.every else {}
    model_config = preset_config(cfg.model.preset, vocab)
    where = "one GPU" if device.type != "cpu" else "this rank's share of host memory"
    params = estimate_params(model_config)
    device_bytes = device_memory_bytes(device, local_world_size)
    strategy = cfg.dist.strategy
    if strategy == "hsdp":
        shard = shard_group_size(cfg.dist, world_size, local_world_size)
    else:  # what hsdp would shard over, for the advice of a refusal (world_size: no hsdp advice)
        shard = cfg.dist.shard_size or local_world_size
        shard = shard if world_size % shard == 0 else world_size
    check_fits(params, device_bytes, where, cfg.model.memory_check, strategy, world_size, shard)
    if strategy != "ddp" and world_size > 1:
        check_host_copy(params, device_memory_bytes(torch.device("cpu"), 1), strategy, cfg.model.memory_check)
    unsharded = accumulates_unsharded(params, device_bytes, strategy, world_size, shard,
                                      resolve_precision(cfg.train.precision, device).name)
    return CheckedRun(manifest, model_config, accum, val_indexes, unsharded, sources)


def state_bytes_per_rank(params: int, strategy: str, world_size: int, shard_size: int) -> int:
    """Weights + gradients + AdamW state one rank holds (fp32 master weights, also under bf16):
    all of it under ddp, 1/world_size under fsdp, 1/shard_size under hsdp."""
    total = params * (WEIGHT_BYTES + GRAD_BYTES + OPTIM_BYTES)
    divisor = {"ddp": 1, "fsdp": world_size, "hsdp": shard_size}[strategy]
    return -(-total // max(1, divisor))


def check_fits(params: int, device_bytes: int | None, where: str, policy: str = "error",
               strategy: str = "ddp", world_size: int = 1, shard_size: int | None = None) -> str | None:
    """Refuse (or warn) when this strategy's share of weights + gradients + AdamW state cannot fit
    one device before any activation (``state_bytes_per_rank``; fsdp/hsdp never build the whole
    model on a device: ``build_for_strategy``); a refusal names the sharded strategies that would
    fit on the job's ranks. Returns the warning text, or None when it fits.
    """
    if policy == "off" or not device_bytes:
        return None
    shard_size = shard_size or world_size
    budget = STATE_SHARE * device_bytes
    need = state_bytes_per_rank(params, strategy, world_size, shard_size)
    if need <= budget:
        return None
    msg = (f"model has {params / 1e9:.2f}B parameters: under dist.strategy={strategy} weights + "
           f"gradients + AdamW state need ~{need / 2**30:.1f} GiB per rank, more than {where} holds "
           f"({device_bytes / 2**30:.1f} GiB). {_what_fits(params, budget, world_size, shard_size)}")
    return _refuse(msg, policy)


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


def _what_fits(params: int, budget: float, world_size: int, shard_size: int) -> str:
    """The advice of a refusal: the sharded strategies that fit, or that none does."""
    fits = []
    for strategy in ("fsdp", "hsdp"):
        if strategy == "hsdp" and shard_size in (1, world_size):
            continue  # hsdp with one group is fsdp; with groups of one it is ddp
        need = state_bytes_per_rank(params, strategy, world_size, shard_size)
        if need <= budget:
            fits.append(f"dist.strategy={strategy} ({need / 2**30:.1f} GiB per rank)")
    if fits:
        return f"Use FSDP to shard it over the {world_size} ranks: {' or '.join(fits)}"
    need = state_bytes_per_rank(params, "fsdp", world_size, shard_size)
    return (f"Even dist.strategy=fsdp would need {need / 2**30:.1f} GiB per rank on {world_size} "
            "rank(s): use FSDP over more GPUs, or a smaller model.preset")


def accumulates_unsharded(params: int, device_bytes: int | None, strategy: str, world_size: int,
                          shard_size: int, precision: str) -> bool:
    """fsdp/hsdp accumulate micro-batches unsharded (no reduce-scatter or re-gather in between:
    faster) when the gathered weights (compute dtype) and full fp32 gradients fit beside the
    sharded state; else they reduce-scatter after every micro-batch."""
    if strategy == "ddp" or not device_bytes:
        return True
    param_bytes = 4 if precision == "fp32" else 2
    need = state_bytes_per_rank(params, strategy, world_size, shard_size) + params * (param_bytes + GRAD_BYTES)
    return need <= STATE_SHARE * device_bytes
