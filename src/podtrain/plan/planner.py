"""``podtrain plan CONFIG``: does it fit, how fast, how long, how much, and where scaling stops.

Offline and on one process: the model is counted on the meta device, the machine comes from the
instance-type table (or this host measured with ``--instance-type local``), and everything else is
the arithmetic of ``plan.memory`` and ``plan.steptime``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, replace
from typing import Any

from podtrain.config import RunConfig, load_config
from podtrain.errors import UserError
from podtrain.plan.machine import Machine, instance_machine, local_machine, resolve_precision, with_busbw_json
from podtrain.plan.memory import (STRATEGIES, MemoryItems, ModelShape, largest_micro_batch, memory_items,
                                  shard_factor)
from podtrain.plan.steptime import StepTime, Workload, step_time

TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal ratio (Hoffmann et al. 2022)
MAX_NODES = 1024
LOCAL_RANKS = 2  # `make demo`'s NPROC


@dataclass
class StrategyFit:
    """One strategy's memory per device at the config's micro-batch, and the largest that fits."""

    strategy: str
    shards: int
    memory: MemoryItems
    memory_ac: MemoryItems
    max_micro_batch: int
    max_micro_batch_ac: int

    def as_dict(self) -> dict[str, Any]:
        """For JSON."""
        return {"strategy": self.strategy, "shards": self.shards, "memory": self.memory.as_dict(),
                "memory_checkpointing": self.memory_ac.as_dict(),
                "max_micro_batch": self.max_micro_batch,
                "max_micro_batch_checkpointing": self.max_micro_batch_ac}


@dataclass
class Plan:
    """Everything ``podtrain plan`` prints."""

    machine: Machine
    shape: ModelShape
    nodes: int
    world: int
    precision: str
    fits: list[StrategyFit]
    strategy: str
    checkpointing: bool
    time: StepTime
    tokens_per_step: int
    tokens: int
    scaling: list[dict[str, Any]] = field(default_factory=list)
    note: str | None = None
    """Set when the plan's strategy is not the config's (which does not fit)."""

    @property
    def tokens_per_s(self) -> float:
        """Global training tokens per second of wall time (saves and evaluation included)."""
        return self.tokens_per_step / self.time.wall_s

    @property
    def seconds_to_tokens(self) -> float:
        """Wall seconds to train ``tokens``."""
        return self.tokens / self.tokens_per_s

    @property
    def cost_usd(self) -> float | None:
        """On-demand cost of ``seconds_to_tokens`` on ``nodes`` nodes, or None without a price."""
        price = self.machine.price_per_node_hour
        return None if price is None else price * self.nodes * self.seconds_to_tokens / 3600

    def as_dict(self) -> dict[str, Any]:
        """For ``--json``."""
        m = self.machine
        return {
            "machine": {"name": m.name, "devices_per_node": m.devices_per_node,
                        "device_memory_bytes": m.device_memory_bytes, "peak_flops": m.peak_flops,
                        "efficiency": m.efficiency, "busbw_source": m.busbw_source,
                        "price_per_node_hour": m.price_per_node_hour},
            "model": {"params": self.shape.params, "flops_per_token": self.shape.flops_per_token},
            "nodes": self.nodes, "world_size": self.world, "precision": self.precision,
            "strategies": [f.as_dict() for f in self.fits], "strategy": self.strategy,
            "activation_checkpointing": self.checkpointing, "step": self.time.as_dict(),
            "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
            "tokens": self.tokens, "seconds_to_tokens": self.seconds_to_tokens,
            "cost_usd": self.cost_usd, "scaling": self.scaling, "note": self.note,
        }


def workload(cfg: RunConfig, world: int, dtype_bytes: int, checkpointing: bool) -> Workload:
    """Per-rank work of one step; when the world outgrows the global batch each rank still runs
    one micro-batch (the global batch grows to micro x world)."""
    accum = max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * world))
    return Workload(micro_batch=cfg.train.micro_batch_size, accum=accum, seq_len=cfg.data.seq_len,
                    bucket_bytes=int(cfg.dist.bucket_cap_mb * 2**20), dtype_bytes=dtype_bytes,
                    checkpointing=checkpointing, ckpt_every=cfg.ckpt.every or cfg.train.steps,
                    async_save=cfg.ckpt.async_save, eval_every=cfg.eval.every,
                    eval_batches=cfg.eval.max_batches)


def strategy_fits(cfg: RunConfig, shape: ModelShape, machine: Machine, world: int,
                  dtype_bytes: int) -> list[StrategyFit]:
    """Memory per device of every strategy at this world size, with and without checkpointing."""
    out = []
    eager = cfg.model.attn_implementation == "eager"
    for strategy in STRATEGIES:
        shards = shard_factor(strategy, world, machine.devices_per_node)
        common = dict(shards=shards, seq_len=cfg.data.seq_len, dtype_bytes=dtype_bytes,
                      gpu=machine.is_gpu, bucket_view=cfg.dist.gradient_as_bucket_view,
                      eager_attention=eager)
        items = {ac: memory_items(shape, strategy, micro_batch=cfg.train.micro_batch_size,
                                  checkpointing=ac, **common) for ac in (False, True)}
        largest = {}
        for ac in (False, True):
            one = memory_items(shape, strategy, micro_batch=1, checkpointing=ac, **common)
            largest[ac] = largest_micro_batch(one, one.activations, machine.device_memory_bytes)
        out.append(StrategyFit(strategy, shards, items[False], items[True], largest[False], largest[True]))
    return out


def configured_strategy(cfg: RunConfig, fits: list[StrategyFit]) -> str:
    """The config's dist.strategy, named as the plan names it: on one node HSDP is FSDP."""
    shards = {f.strategy: f.shards for f in fits}
    return "fsdp" if cfg.dist.strategy == "hsdp" and shards["hsdp"] == shards["fsdp"] else cfg.dist.strategy


def choose(cfg: RunConfig, fits: list[StrategyFit]) -> tuple[str, bool] | None:
    """The config's dist.strategy (and train.activation_checkpointing) when its memory fits at the
    config's micro-batch, else the first of ddp, hsdp, fsdp that fits, preferring no activation
    checkpointing; None if none fits. The report says when this is not the config's choice."""
    wanted = configured_strategy(cfg, fits)
    fsdp_shards = next(f.shards for f in fits if f.strategy == "fsdp")
    candidates = [f for f in fits if not (f.strategy == "hsdp" and f.shards == fsdp_shards)]
    order = sorted(candidates, key=lambda f: (f.strategy != wanted, ("ddp", "hsdp", "fsdp").index(f.strategy)))
    micro = cfg.train.micro_batch_size
    wanted_ac = cfg.train.activation_checkpointing == "full"
    if order[0].strategy == wanted and \
            (order[0].max_micro_batch_ac if wanted_ac else order[0].max_micro_batch) >= micro:
        return wanted, wanted_ac
    for ac in (False, True):
        for f in order:
            if (f.max_micro_batch_ac if ac else f.max_micro_batch) >= micro:
                return f.strategy, ac
    return None


def make_plan(cfg: RunConfig, shape: ModelShape, machine: Machine, nodes: int,
              tokens: int | None) -> Plan:
    """The plan for ``cfg`` on ``nodes`` nodes of ``machine``; UserError when it fits nowhere."""
    if nodes < 1:
        raise UserError(f"--nodes must be 1 or more, got {nodes}")
    precision = resolve_precision(cfg.train.precision, machine.is_gpu)
    dtype_bytes = 4 if precision == "fp32" else 2
    world = nodes * machine.devices_per_node
    fits = strategy_fits(cfg, shape, machine, world, dtype_bytes)
    chosen = choose(cfg, fits)
    if chosen is None:
        raise UserError(_no_fit_message(cfg, shape, machine, nodes, dtype_bytes))
    strategy, ac = chosen
    note = None
    if (strategy, ac) != (configured_strategy(cfg, fits), cfg.train.activation_checkpointing == "full"):
        note = (f"the config's dist.strategy={cfg.dist.strategy} with train.activation_checkpointing="
                f"{cfg.train.activation_checkpointing} does not fit at train.micro_batch_size="
                f"{cfg.train.micro_batch_size}: set dist.strategy={strategy} "
                f"train.activation_checkpointing={'full' if ac else 'none'}")
    time = _time(cfg, shape, machine, strategy, nodes, dtype_bytes, ac)
    plan = Plan(machine=machine, shape=shape, nodes=nodes, world=world, precision=precision,
                fits=fits, strategy=strategy, checkpointing=ac, time=time,
                tokens_per_step=_tokens_per_step(cfg, world), tokens=tokens or TOKENS_PER_PARAM * shape.params,
                note=note)
    plan.scaling = scaling_table(cfg, shape, machine, strategy, dtype_bytes, ac, plan.tokens)
    return plan


def _tokens_per_step(cfg: RunConfig, world: int) -> int:
    w = workload(cfg, world, 2, False)
    return w.tokens_per_rank * world


def _time(cfg, shape, machine, strategy, nodes, dtype_bytes, ac) -> StepTime:
    world = nodes * machine.devices_per_node
    return step_time(shape, workload(cfg, world, dtype_bytes, ac), strategy,
                     shard_factor(strategy, world, machine.devices_per_node), world, nodes,
                     machine.devices_per_node, machine.sustained_flops, machine.memory_bandwidth,
                     machine.busbw_gbps, machine.is_gpu)


def scaling_table(cfg: RunConfig, shape: ModelShape, machine: Machine, strategy: str,
                  dtype_bytes: int, ac: bool, tokens: int) -> list[dict[str, Any]]:
    """Step time, throughput, time and cost to ``tokens`` for 1, 2, 4 ... 1024 nodes."""
    rows, nodes = [], 1
    while nodes <= MAX_NODES:
        world = nodes * machine.devices_per_node
        t = _time(cfg, shape, machine, strategy, nodes, dtype_bytes, ac)
        tps = _tokens_per_step(cfg, world) / t.wall_s
        hours = tokens / tps / 3600
        price = machine.price_per_node_hour
        rows.append({"nodes": nodes, "world_size": world, "step_s": t.step_s, "compute_s": t.compute_s,
                     "comm_s": t.comm_s, "sync_wait_s": t.sync_wait_s, "tokens_per_s": tps,
                     "hours": hours, "cost_usd": None if price is None else price * nodes * hours,
                     "comm_exceeds_compute": t.comm_s > t.compute_s})
        nodes *= 2
    return rows


def _no_fit_message(cfg, shape, machine, nodes, dtype_bytes) -> str:
    """Where the model would fit, or that it fits nowhere (fsdp over 1024 nodes, micro-batch 1)."""
    biggest = strategy_fits(cfg, shape, machine, MAX_NODES * machine.devices_per_node, dtype_bytes)
    fsdp = next(f for f in biggest if f.strategy == "fsdp")
    need = f"{fsdp.memory_ac.static / 2**30:.1f} GiB" if fsdp.max_micro_batch_ac < 1 else None
    head = (f"{cfg.model.preset} ({shape.params / 1e9:.2f}B parameters) with micro-batch "
            f"{cfg.train.micro_batch_size} x seq_len {cfg.data.seq_len} does not fit {machine.name}'s "
            f"{machine.device_memory_bytes / 2**30:.1f} GiB per device on {nodes} node(s) with any of "
            f"{', '.join(STRATEGIES)}, even with activation checkpointing")
    if need:
        return head + f"; not even fsdp over {MAX_NODES} nodes at micro-batch 1 ({need} per device)"
    return head + ": lower train.micro_batch_size or data.seq_len, or add nodes (fsdp)"


# -- the command ---------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``podtrain plan CONFIG [--nodes N] [--instance-type T|local] [--tokens N] [--json] [k=v]``."""
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--instance-type", default="p5.48xlarge",
                        help="an instance preset (default p5.48xlarge) or 'local' (this host, measured)")
    parser.add_argument("--nproc", type=int, default=None,
                        help=f"ranks per node (default: the instance's GPUs; local: {LOCAL_RANKS})")
    parser.add_argument("--tokens", type=float, default=None,
                        help=f"training tokens (default {TOKENS_PER_PARAM} per parameter)")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="share of peak FLOP/s a step sustains (default: documented per device)")
    parser.add_argument("--busbw-json", default=None,
                        help="AllReduce busbw from a `podtrain bench collectives --json` file")
    parser.add_argument("--price-per-hour", type=float, default=None, help="USD per node-hour")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def build_machine(args: argparse.Namespace) -> Machine:
    """The machine named by the flags (a preset, or this host measured)."""
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc must be 1 or more, got {args.nproc}")
    if args.instance_type == "local":
        machine = local_machine(args.nproc or LOCAL_RANKS, args.efficiency, args.price_per_hour)
    else:
        machine = instance_machine(args.instance_type, args.precision, args.efficiency, args.price_per_hour)
        if args.nproc:
            if args.nproc > machine.devices_per_node:
                raise UserError(f"--nproc {args.nproc}: {machine.name} has {machine.devices_per_node} GPUs")
            machine = replace(machine, devices_per_node=args.nproc)
    return with_busbw_json(machine, args.busbw_json) if args.busbw_json else machine


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Load the config, count the model, build the machine, plan."""
    from podtrain.plan.shape import model_shape

    if args.nodes < 1:
        raise UserError(f"--nodes must be 1 or more, got {args.nodes}")
    cfg = load_config(args.config, args.overrides)
    args.precision = cfg.train.precision
    machine = build_machine(args)
    tokens = int(args.tokens) if args.tokens else None
    return make_plan(cfg, model_shape(cfg), machine, args.nodes, tokens)


def run(args: argparse.Namespace) -> int:
    """CLI entry: print the plan (text or JSON)."""
    from podtrain.plan.render import render_plan

    plan = plan_from_args(args)
    print(json.dumps(plan.as_dict(), indent=1) if args.json else render_plan(plan))
    return 0
