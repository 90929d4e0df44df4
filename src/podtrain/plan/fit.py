"""Does a job fit its devices' memory: ONE decision, shared by ``podtrain plan``, every launcher
(``launch local``, ``slurm``, ``k8s``) and every rank at start (``train.preflight``).

* ``strategy_fits``: memory per device of ddp / fsdp / hsdp at the config's micro-batch, and the
  largest micro-batch that fits, with and without activation checkpointing (``plan.memory``;
  with ``eval.tasks``, the task evaluation's forwards too);
* ``choose``: the config's strategy when it fits, else the first that does (what ``plan`` shows);
* ``check_memory``: refuse (``model.memory_check``) a job whose configured strategy does not fit,
  in one line naming the strategy and settings that do;
* ``accumulates_unsharded``: FSDP's gradient-accumulation mode. Keeping the weights gathered
  between micro-batches (one all-gather per layer per step, no reduce-scatter until the last
  micro-batch) holds the whole model in the compute dtype plus whole fp32 gradients beside the
  shards; it is chosen only when that, the activations at the configured micro-batch (logits
  included) and the reserve fit the device, else the run reshards after every micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from podtrain.errors import UserError
from podtrain.plan.memory import (GRAD_BYTES, STRATEGIES, MemoryItems, ModelShape, largest_micro_batch,
                                  memory_items, shard_factor)

GIB = 2**30
MAX_NODES = 1024


@dataclass(frozen=True)
class Devices:
    """The memory side of a job's devices.

    Attributes:
        name: how a message names one, e.g. ``each p5.48xlarge GPU`` or ``one GPU``.
        per_node: ranks per node (hsdp shards within a node).
        memory_bytes: memory one rank may use.
        gpu: CUDA context reserve and 16-bit activations under ``precision=auto``.
    """

    name: str
    per_node: int
    memory_bytes: int
    gpu: bool


@dataclass
class StrategyFit:
    """One strategy's memory per device at the config's micro-batch, and the largest that fits."""

    strategy: str
    shards: int
    memory: MemoryItems
    memory_ac: MemoryItems
    max_micro_batch: int
    max_micro_batch_ac: int

    def items(self, checkpointing: bool) -> MemoryItems:
        """The memory with or without activation checkpointing."""
        return self.memory_ac if checkpointing else self.memory

    def as_dict(self) -> dict[str, Any]:
        """For JSON."""
        return {"strategy": self.strategy, "shards": self.shards, "memory": self.memory.as_dict(),
                "memory_checkpointing": self.memory_ac.as_dict(),
                "max_micro_batch": self.max_micro_batch,
                "max_micro_batch_checkpointing": self.max_micro_batch_ac}


def dtype_bytes_of(precision: str, gpu: bool) -> int:
    """Bytes of the compute dtype: ``auto`` is bf16 on a GPU and fp32 on a CPU, as in training."""
    name = ("bf16" if gpu else "fp32") if precision == "auto" else precision
    return 4 if name == "fp32" else 2


def strategy_fits(cfg: Any, shape: ModelShape, devices: Devices, world: int,
                  dtype_bytes: int) -> list[StrategyFit]:
    """Memory per device of every strategy at this world size, with and without checkpointing
    (hsdp shards over ``dist.shard_size`` ranks, else a node's)."""
    out = []
    eager = cfg.model.attn_implementation == "eager"
    for strategy in STRATEGIES:
        shards = shard_factor(strategy, world, cfg.dist.shard_size or devices.per_node)
        common = dict(shards=shards, seq_len=cfg.data.seq_len, dtype_bytes=dtype_bytes, gpu=devices.gpu,
                      bucket_view=cfg.dist.gradient_as_bucket_view, eager_attention=eager,
                      task_eval=bool(cfg.eval.tasks))
        items = {ac: memory_items(shape, strategy, micro_batch=cfg.train.micro_batch_size,
                                  checkpointing=ac, **common) for ac in (False, True)}
        largest = {}
        for ac in (False, True):
            one = memory_items(shape, strategy, micro_batch=1, checkpointing=ac, **common)
            largest[ac] = largest_micro_batch(one, one.activations, devices.memory_bytes)
        out.append(StrategyFit(strategy, shards, items[False], items[True], largest[False], largest[True]))
    return out


def configured(cfg: Any, fits: list[StrategyFit]) -> tuple[str, bool]:
    """The config's (dist.strategy, activation checkpointing), named as the plan names them: hsdp
    whose one shard group is the world is fsdp."""
    shards = {f.strategy: f.shards for f in fits}
    strategy = cfg.dist.strategy
    if strategy == "hsdp" and shards["hsdp"] == shards["fsdp"]:
        strategy = "fsdp"
    return strategy, cfg.train.activation_checkpointing == "full"


def _fits(f: StrategyFit, ac: bool, micro: int) -> bool:
    return (f.max_micro_batch_ac if ac else f.max_micro_batch) >= micro


def choose(cfg: Any, fits: list[StrategyFit]) -> tuple[str, bool] | None:
    """The config's dist.strategy (and train.activation_checkpointing) when its memory fits at the
    config's micro-batch, else the first of ddp, hsdp, fsdp that fits, preferring no activation
    checkpointing; None if none fits."""
    wanted, wanted_ac = configured(cfg, fits)
    fsdp_shards = next(f.shards for f in fits if f.strategy == "fsdp")
    candidates = [f for f in fits if not (f.strategy == "hsdp" and f.shards == fsdp_shards)]
    order = sorted(candidates, key=lambda f: (f.strategy != wanted, ("ddp", "hsdp", "fsdp").index(f.strategy)))
    micro = cfg.train.micro_batch_size
    if order[0].strategy == wanted and _fits(order[0], wanted_ac, micro):
        return wanted, wanted_ac
    for ac in (False, True):
        for f in order:
            if _fits(f, ac, micro):
                return f.strategy, ac
    return None


def accumulates_unsharded(fit: StrategyFit, checkpointing: bool, shape: ModelShape, dtype_bytes: int,
                          device_bytes: int | None) -> tuple[bool, int]:
    """FSDP's accumulation mode for ``fit`` (see the module docstring) and the bytes per device
    that keeping the weights gathered needs: the shards, activations and reserve of the resharding
    mode, with its two gathered blocks replaced by the whole model in the compute dtype and whole
    fp32 gradients. ddp (nothing to gather) and an unknown device size keep them gathered."""
    items = fit.items(checkpointing)
    need = items.total - items.buffers + shape.params * (dtype_bytes + GRAD_BYTES)
    if fit.strategy == "ddp" or not device_bytes:
        return True, need
    return need <= device_bytes, need


def accumulation_phrase(unsharded: bool) -> str:
    """FSDP's accumulation mode in words: the plan prints it, the run's start-up line too."""
    return "unsharded" if unsharded else "resharded per micro-batch"


@dataclass(frozen=True)
class MemoryDecision:
    """What ``check_memory`` decided for the configured strategy."""

    strategy: str
    checkpointing: bool
    fits: list[StrategyFit]
    accumulate_unsharded: bool
    unsharded_bytes: int
    """Bytes per device that keeping FSDP's weights gathered between micro-batches needs."""


def check_memory(cfg: Any, shape: ModelShape, devices: Devices, world: int,
                 policy: str = "error") -> MemoryDecision:
    """The config's strategy on ``world`` ranks of ``devices``: a one-line UserError (``policy``
    ``error``; ``warn`` prints it, ``off`` skips it) when its memory does not fit, naming the
    strategy and settings that do; else the decision, with FSDP's accumulation mode."""
    dtype_bytes = dtype_bytes_of(cfg.train.precision, devices.gpu)
    fits = strategy_fits(cfg, shape, devices, world, dtype_bytes)
    strategy, ac = configured(cfg, fits)
    if devices.memory_bytes and policy != "off" and choose(cfg, fits) != (strategy, ac):
        message = refusal(cfg, shape, devices, world, fits, dtype_bytes)
        if policy == "error":
            raise UserError(message + " (model.memory_check=warn to try anyway)")
        import logging

        logging.getLogger("podtrain").warning(message)
    fit = next(f for f in fits if f.strategy == strategy)
    unsharded, need = accumulates_unsharded(fit, ac, shape, dtype_bytes, devices.memory_bytes)
    return MemoryDecision(strategy, ac, fits, unsharded, need)


def refusal(cfg: Any, shape: ModelShape, devices: Devices, world: int, fits: list[StrategyFit],
            dtype_bytes: int) -> str:
    """Why the configured strategy does not fit, and what to set instead (or that nothing fits)."""
    strategy, ac = configured(cfg, fits)
    have = next(f for f in fits if f.strategy == strategy).items(ac)
    micro = cfg.train.micro_batch_size
    head = (f"model.preset={cfg.model.preset} ({shape.params / 1e9:.2f}B parameters) under dist.strategy="
            f"{cfg.dist.strategy}{' with activation checkpointing' if ac else ''} needs "
            f"{have.total / GIB:.1f} GiB per device at train.micro_batch_size={micro} x data.seq_len="
            f"{cfg.data.seq_len} on {world} rank(s), more than the {devices.memory_bytes / GIB:.1f} GiB of "
            f"{devices.name}")
    chosen = choose(cfg, fits)
    if chosen is None:
        return head + "; " + no_fit_advice(cfg, shape, devices, dtype_bytes)
    other, other_ac = chosen
    total = next(f for f in fits if f.strategy == other).items(other_ac).total
    return (head + f": set dist.strategy={other} train.activation_checkpointing="
            f"{'full' if other_ac else 'none'} ({total / GIB:.1f} GiB per device)")


def no_fit_advice(cfg: Any, shape: ModelShape, devices: Devices, dtype_bytes: int) -> str:
    """No strategy fits: whether fsdp over 1024 nodes at micro-batch 1 would, and what to change."""
    biggest = strategy_fits(cfg, shape, devices, MAX_NODES * devices.per_node, dtype_bytes)
    fsdp = next(f for f in biggest if f.strategy == "fsdp")
    if fsdp.max_micro_batch_ac < 1:
        return (f"not even fsdp over {MAX_NODES} nodes at micro-batch 1 fits "
                f"({fsdp.memory_ac.static / GIB:.1f} GiB per device)")
    return ("none of ddp, fsdp, hsdp fits, even with activation checkpointing: lower "
            "train.micro_batch_size or data.seq_len, or add nodes (fsdp)")
