"""``podtrain plan CONFIG``: does it fit, how fast, how long, how much, and where scaling stops.

Offline and on one process: the model is counted on the meta device, the machine comes from the
instance-type table (or this host measured with ``--instance-type local``), and everything else is
the arithmetic of ``plan.memory`` and ``plan.steptime``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podtrain.config import RunConfig, accumulation_steps, explicit_keys, ignored_data_path, load_config
from podtrain.errors import UserError
from podtrain.plan.fit import (MAX_NODES, StrategyFit, accumulates_unsharded, accumulation_phrase, choose, configured, dtype_bytes_of,
                               no_fit_advice, strategy_fits)
from podtrain.plan.machine import Machine, instance_machine, local_machine, resolve_precision, with_busbw_json
from podtrain.plan.memory import STRATEGIES, ModelShape, shard_factor
from podtrain.plan.published import Adjustment, fp8_adjustment, fp8_mode, masking_adjustment, masking_on
from podtrain.plan.steptime import StepTime, Workload, step_time

if TYPE_CHECKING:  # plan.shape imports the model code (transformers): only when counting
    from podtrain.plan.shape import VocabChoice

TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal ratio (Hoffmann et al. 2022)
LOCAL_RANKS = 2  # `make demo`'s NPROC


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
    accum: int = 1
    """Micro-batches per rank per step (``config.accumulation_steps``, as the launchers check)."""
    accumulate_unsharded: bool = True
    """fsdp/hsdp: weights kept gathered between micro-batches (``plan.fit.accumulates_unsharded``)."""
    unsharded_bytes: int = 0
    """Bytes per device keeping them gathered needs."""
    micro_batch: int = 1
    """train.micro_batch_size."""
    seq_len: int = 1
    """data.seq_len."""
    preset: str = ""
    """model.preset."""
    vocab_source: str = "the preset's own vocabulary"
    """Where the vocabulary comes from, short (``plan.shape.plan_vocab``)."""
    vocab_reason: str = ""
    """Why that vocabulary, and the override that plans another."""
    data_note: str | None = None
    """``config.ignored_data_path``'s warning (data.path beside data.mix), for the text."""
    tokens_source: str = f"{TOKENS_PER_PARAM} per parameter"
    """Where ``tokens`` comes from: ``--tokens``, the config's train.steps, or the default ratio."""
    init_load: Any = None
    """model.init_from: the load's bytes per rank and time (``plan.init_load.InitLoad``), else None."""
    mean_document: float | None = None
    """Tokens per document of the prepared data here (document masking's model), else None."""

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
                        "efficiency": m.efficiency, "compute_source": m.compute_source,
                        "busbw_source": m.busbw_source,
                        "price_per_node_hour": m.price_per_node_hour},
            "model": {"preset": self.preset, "params": self.shape.params, "flops_per_token": self.shape.flops_per_token},
            "nodes": self.nodes, "world_size": self.world, "precision": self.precision,
            "strategies": [f.as_dict() for f in self.fits], "strategy": self.strategy,
            "activation_checkpointing": self.checkpointing, "step": self.time.as_dict(),
            "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
            "tokens": self.tokens, "tokens_source": self.tokens_source, "seconds_to_tokens": self.seconds_to_tokens,
            "cost_usd": self.cost_usd, "scaling": self.scaling, "note": self.note,
            "vocab": {"size": self.shape.vocab, "source": self.vocab_source, "reason": self.vocab_reason},
            "accumulation_steps": self.accum, "accumulation": self.accumulation,
            "init_load": self.init_load.as_dict() if self.init_load else None,
        }

    @property
    def accumulation(self) -> str:
        """The gradient-accumulation mode as training's start-up line names it (``describe``)."""
        return "local (ddp's no_sync)" if self.strategy == "ddp" else accumulation_phrase(self.accumulate_unsharded)


def workload(cfg: RunConfig, world: int, dtype_bytes: int, checkpointing: bool) -> Workload:
    """Per-rank work of one step; when the world outgrows the global batch each rank still runs
    one micro-batch (the global batch grows to micro x world)."""
    accum = max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * world))
    return Workload(micro_batch=cfg.train.micro_batch_size, accum=accum, seq_len=cfg.data.seq_len,
                    bucket_bytes=int(cfg.dist.bucket_cap_mb * 2**20), dtype_bytes=dtype_bytes,
                    checkpointing=checkpointing, ckpt_every=cfg.ckpt.every or cfg.train.steps,
                    async_save=cfg.ckpt.async_save, eval_every=cfg.eval.every,
                    eval_batches=cfg.eval.max_batches)


def make_plan(cfg: RunConfig, shape: ModelShape, machine: Machine, nodes: int,
              tokens: int | None, vocab: VocabChoice | None = None, steps: int | None = None,
              mean_document: float | None = None) -> Plan:
    """The plan for ``cfg`` on ``nodes`` nodes of ``machine``; UserError when it fits nowhere, or
    when the global batch does not divide over the job (what the launchers refuse). ``vocab``:
    how ``shape``'s vocabulary was chosen, for the text (default: the preset's own). The tokens
    planned: ``tokens`` when given, else ``steps`` steps of this job, else 20 per parameter.
    ``mean_document``: tokens per document of the data (document masking's model)."""
    if nodes < 1:
        raise UserError(f"--nodes must be 1 or more, got {nodes}")
    precision = resolve_precision(cfg.train.precision, machine.is_gpu)
    dtype_bytes = dtype_bytes_of(precision, machine.is_gpu)
    world = nodes * machine.devices_per_node
    accum = accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, world)
    devices = machine.devices
    fits = strategy_fits(cfg, shape, devices, world, dtype_bytes)
    chosen = choose(cfg, fits)
    if chosen is None:
        raise UserError(
            f"{cfg.model.preset} ({shape.params / 1e9:.2f}B parameters) with micro-batch "
            f"{cfg.train.micro_batch_size} x seq_len {cfg.data.seq_len} does not fit {machine.name}'s "
            f"{machine.device_memory_bytes / 2**30:.1f} GiB per device on {nodes} node(s) with any of "
            f"{', '.join(STRATEGIES)}, even with activation checkpointing; "
            + no_fit_advice(cfg, shape, devices, dtype_bytes))
    strategy, ac = chosen
    unsharded, unsharded_bytes = accumulates_unsharded(next(f for f in fits if f.strategy == strategy), ac,
                                                       shape, dtype_bytes, machine.device_memory_bytes)
    note = None
    if (strategy, ac) != configured(cfg, fits):
        note = (f"the config's dist.strategy={cfg.dist.strategy} with train.activation_checkpointing="
                f"{cfg.train.activation_checkpointing} does not fit at train.micro_batch_size="
                f"{cfg.train.micro_batch_size}: set dist.strategy={strategy} "
                f"train.activation_checkpointing={'full' if ac else 'none'}")
    time = _time(cfg, shape, machine, strategy, nodes, dtype_bytes, ac, unsharded, mean_document)
    tokens_per_step = _tokens_per_step(cfg, world)
    if tokens:
        source = "--tokens"
    elif steps:
        tokens, source = steps * tokens_per_step, f"train.steps={steps} x {tokens_per_step:,} tokens per step"
    else:
        tokens = TOKENS_PER_PARAM * shape.params
        source = f"{TOKENS_PER_PARAM} per parameter: the config sets no train.steps; --tokens N plans another"
    plan = Plan(machine=machine, shape=shape, nodes=nodes, world=world, precision=precision,
                fits=fits, strategy=strategy, checkpointing=ac, time=time,
                tokens_per_step=tokens_per_step, tokens=tokens, tokens_source=source,
                note=note, accum=accum, micro_batch=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len, accumulate_unsharded=unsharded, unsharded_bytes=unsharded_bytes,
                preset=cfg.model.preset, vocab_source=vocab.source if vocab else "the preset's own vocabulary",
                vocab_reason=vocab.reason if vocab else "", mean_document=mean_document)
    if cfg.model.init_from:
        from podtrain.plan.init_load import init_load

        plan.init_load = init_load(cfg, strategy, world, machine, nodes)
    plan.scaling = scaling_table(cfg, shape, machine, strategy, dtype_bytes, ac, plan.tokens, unsharded,
                                 mean_document)
    return plan


def _tokens_per_step(cfg: RunConfig, world: int) -> int:
    w = workload(cfg, world, 2, False)
    return w.tokens_per_rank * world


def adjustments(cfg: RunConfig, machine: Machine, mean_document: float | None) -> tuple[Adjustment, ...]:
    """The published-figure factors ``cfg`` asks for on ``machine`` (``plan.published``): FP8's
    on the decoder matmuls, document masking's on attention."""
    out = []
    fp8 = fp8_adjustment(fp8_mode(cfg), machine.name, machine.fp8_capable)
    if fp8 is not None:
        out.append(fp8)
    if masking_on(cfg):
        timed = machine.timing is not None and machine.timing.masked
        out.append(masking_adjustment(cfg.data.seq_len, mean_document, machine.is_gpu, timed))
    return tuple(out)


def _time(cfg, shape, machine, strategy, nodes, dtype_bytes, ac, unsharded=True,
          mean_document: float | None = None) -> StepTime:
    world = nodes * machine.devices_per_node
    adjust = adjustments(cfg, machine, mean_document)
    fp8_gather = (strategy != "ddp" and fp8_mode(cfg) == "tensorwise" and machine.fp8_capable)
    return step_time(shape, workload(cfg, world, dtype_bytes, ac), strategy,
                     shard_factor(strategy, world, machine.devices_per_node), world, nodes,
                     machine.devices_per_node, machine.sustained_flops, machine.memory_bandwidth,
                     machine.busbw_gbps, machine.is_gpu, gathered=unsharded, timing=machine.timing,
                     adjustments=adjust, fp8_gather=fp8_gather)


def scaling_table(cfg: RunConfig, shape: ModelShape, machine: Machine, strategy: str,
                  dtype_bytes: int, ac: bool, tokens: int, unsharded: bool = True,
                  mean_document: float | None = None) -> list[dict[str, Any]]:
    """Step time, throughput, time and cost to ``tokens`` for 1, 2, 4 ... 1024 nodes."""
    rows, nodes = [], 1
    while nodes <= MAX_NODES:
        world = nodes * machine.devices_per_node
        t = _time(cfg, shape, machine, strategy, nodes, dtype_bytes, ac, unsharded, mean_document)
        tps = _tokens_per_step(cfg, world) / t.wall_s
        hours = tokens / tps / 3600
        price = machine.price_per_node_hour
        rows.append({"nodes": nodes, "world_size": world, "step_s": t.step_s, "compute_s": t.compute_s,
                     "comm_s": t.comm_s, "sync_wait_s": t.sync_wait_s, "tokens_per_s": tps,
                     "hours": hours, "cost_usd": None if price is None else price * nodes * hours,
                     "comm_exceeds_compute": t.comm_s > t.compute_s})
        nodes *= 2
    return rows


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
                        help=f"training tokens (default: train.steps x tokens per step when the config "
                        f"or an override sets train.steps, else {TOKENS_PER_PARAM} per parameter)")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="share of peak FLOP/s a step sustains (default: documented per device)")
    parser.add_argument("--busbw-json", default=None,
                        help="AllReduce busbw from a `podtrain bench collectives --json` file")
    parser.add_argument("--price-per-hour", type=float, default=None, help="USD per node-hour")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def build_machine(args: argparse.Namespace, cfg: RunConfig | None = None,
                  shape: ModelShape | None = None, model_config: Any = None,
                  mean_document: float | None = None) -> Machine:
    """The machine named by the flags (a preset, or this host measured at ``cfg``'s shapes:
    ``plan.machine.local_machine``)."""
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc must be 1 or more, got {args.nproc}")
    if args.instance_type == "local":
        machine = local_machine(args.nproc or LOCAL_RANKS, args.efficiency, args.price_per_hour, shape,
                                cfg.train.micro_batch_size if cfg else 1, cfg.data.seq_len if cfg else 1,
                                cfg=cfg, model_config=model_config,
                                mean_document=mean_document if cfg is not None and masking_on(cfg) else None)
    else:
        machine = instance_machine(args.instance_type, args.precision, args.efficiency, args.price_per_hour)
        if args.nproc:
            if args.nproc > machine.devices_per_node:
                raise UserError(f"--nproc {args.nproc}: {machine.name} has {machine.devices_per_node} GPUs")
            machine = replace(machine, devices_per_node=args.nproc)
    return with_busbw_json(machine, args.busbw_json) if args.busbw_json else machine


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Load the config, count the model, build the machine, plan."""
    from podtrain.plan.shape import mean_document_tokens, model_config, plan_vocab, vocab_shape

    if args.nodes < 1:
        raise UserError(f"--nodes must be 1 or more, got {args.nodes}")
    cfg = load_config(args.config, args.overrides)
    args.precision = cfg.train.precision
    check_data_sources(cfg)
    vocab = plan_vocab(cfg)
    shape = vocab_shape(cfg, vocab.size)
    mean_document = mean_document_tokens(cfg) if masking_on(cfg) else None
    machine = build_machine(args, cfg, shape, model_config(cfg, vocab.size), mean_document)
    tokens = int(args.tokens) if args.tokens else None
    steps = cfg.train.steps if "train.steps" in explicit_keys(args.config, args.overrides) else None
    plan = make_plan(cfg, shape, machine, args.nodes, tokens, vocab, steps, mean_document)
    plan.data_note = ignored_data_path(cfg.data)
    return plan


def check_data_sources(cfg: RunConfig) -> None:
    """Every local ``data.mix`` source, as training checks it (``read_manifest``: a missing or
    unprepared one is one line naming it; the sources must share one tokenizer), when the data is
    on this machine, i.e. when any local source is prepared here. A plan made away from the data
    (none here, or ``s3://`` sources, which plan never reads) is not refused: it plans the
    preset's own vocabulary, as for a ``data.path`` not prepared here."""
    from podtrain.data.manifest import MANIFEST_NAME, read_manifest
    from podtrain.data.mixture import parse_mix
    from podtrain.data.sources import check_one_tokenizer
    from podtrain.storage import is_s3_url

    if not cfg.data.mix:
        return
    local = [spec for spec in parse_mix(cfg.data.mix, cfg.data.path) if not is_s3_url(spec.path)]
    if not any((Path(spec.path) / MANIFEST_NAME).is_file() for spec in local):
        return
    check_one_tokenizer(local, [read_manifest(spec.path) for spec in local])


def run(args: argparse.Namespace) -> int:
    """CLI entry: print the plan (text or JSON)."""
    from podtrain.plan.render import render_plan

    plan = plan_from_args(args)
    print(json.dumps(plan.as_dict(), indent=1) if args.json else render_plan(plan))
    return 0
