"""The machine a plan is for: an instance type from the preset table, or this host measured.

A ``Machine`` holds what the step-time model needs per device (memory, peak FLOP/s, the share of it
a training step achieves, memory bandwidth for the optimizer) and per job (collective bandwidth
inside a node and across nodes, price per node-hour). ``--busbw-json`` replaces the bandwidths
with a ``podtrain bench collectives --json`` measurement.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from podtrain.distributed.env import omp_num_threads, threads_per_rank
from podtrain.errors import UserError
from podtrain.launch import instances
from podtrain.plan.calibrate import calibrate
from podtrain.plan.fit import Devices
from podtrain.plan.layertime import measurable, time_step_pieces
from podtrain.plan.steptime import LayerTiming
from podtrain.plan.memory import ModelShape
from podtrain.plan.published import FP8_GPU_MODELS, FP8_MIN_CAPABILITY
from podtrain.observe.hardware import PEAK_FLOPS, best_matmul_seconds, device_memory_bytes

# Share of the dense peak a well-tuned dense-transformer training step sustains on a GPU in
# bf16/fp16 (its MFU): torchtitan reports 33-39% for Llama 3.1 8B with FSDP on 8 x H100, Megatron-LM
# 40-47% on H100, llm.c up to ~60% on A100. 0.40 is the middle of published figures; --efficiency
# overrides it. In fp32 (no tensor-core bf16) GPUs reach a larger share of their smaller fp32 peak.
GPU_EFFICIENCY = {"bf16": 0.40, "fp16": 0.40, "fp32": 0.60}
# On a CPU the peak is this host's own fp32 matmul rate (the loop's MFU peak); a transformer step
# adds norms, softmax, elementwise ops and small matmuls around it. podtrain's demo (tiny Llama,
# 2 ranks) sustains 0.46-0.52 of that rate on a 2-core host: 0.5.
CPU_EFFICIENCY = 0.5
# Matmul size of the CPU measurement: the one the training loop's MFU peak uses.
CPU_MATMUL_SIZE = 768
# HBM bandwidth per GPU (bytes/s, datasheets): the optimizer step and clipping are memory-bound.
GPU_MEMORY_BANDWIDTH = {
    "B200": 8.0e12, "H200": 4.8e12, "H200 NVL": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12, "A100 80GB": 2.04e12, "A100 40GB": 1.56e12, "L40S": 0.864e12,
    "L4": 0.3e12, "A10G": 0.6e12,
}
# gloo over loopback between ranks of one host when no --busbw-json is given (AllReduce busbw of
# `podtrain bench collectives` at >= 4 MiB on a 2-core CI host; measure yours with --busbw-json).
LOCAL_BUSBW_GBPS = 1.0


@dataclass(frozen=True)
class Machine:
    """Per-device and per-job capabilities the plan uses.

    Attributes:
        name: instance type, or ``local``.
        devices_per_node: GPUs (or ranks, for local) per node.
        device_memory_bytes: memory one rank may use.
        peak_flops: dense peak FLOP/s of one device at the plan's precision.
        efficiency: share of the peak a training step sustains.
        memory_bandwidth: bytes/s of one device's memory (optimizer step, host copies).
        intra_busbw_gbps: AllReduce busbw among the ranks of one node (GB/s).
        inter_busbw_gbps: AllReduce busbw across nodes (GB/s).
        price_per_node_hour: USD, or None when unknown.
        is_gpu: whether activations are in the 16-bit compute dtype and CUDA reserves memory.
        busbw_source: where the bandwidths come from, for the output.
        busbw_table: (bytes, busbw) pairs measured by ``bench collectives`` (empty: a constant).
        compute_source: where peak and efficiency come from, for the output.
        timing: this host's step pieces timed at the run's shapes (``plan.layertime``): the plan's
            compute and optimizer are these instead of FLOPs / sustained rate; None: FLOP path.
        fp8_capable: the device has FP8 tensor cores (compute capability >= 8.9).
    """

    name: str
    devices_per_node: int
    device_memory_bytes: int
    peak_flops: float
    efficiency: float
    memory_bandwidth: float
    intra_busbw_gbps: float
    inter_busbw_gbps: float
    price_per_node_hour: float | None
    is_gpu: bool
    busbw_source: str
    busbw_table: tuple[tuple[int, float], ...] = ()
    compute_source: str = "datasheet peak x published efficiency"
    timing: LayerTiming | None = None
    fp8_capable: bool = False

    @property
    def devices(self) -> "Devices":
        """The memory side of these devices, as the memory check takes it (``plan.fit``)."""
        what = f"each {self.name} GPU" if self.is_gpu else "each local rank's share of host memory"
        return Devices(what, self.devices_per_node, self.device_memory_bytes, self.is_gpu)

    @property
    def sustained_flops(self) -> float:
        """FLOP/s one device sustains in a training step: peak x efficiency."""
        return self.peak_flops * self.efficiency

    def busbw_gbps(self, nodes: int, nbytes: int) -> float:
        """AllReduce busbw for a message of ``nbytes`` among ``nodes`` nodes' ranks: the measured
        table at the nearest size not above it when given, else the preset's figure."""
        if self.busbw_table:
            fitting = [bw for size, bw in self.busbw_table if size <= nbytes]
            return fitting[-1] if fitting else self.busbw_table[0][1]
        return self.intra_busbw_gbps if nodes <= 1 else self.inter_busbw_gbps


def resolve_precision(precision: str, is_gpu: bool) -> str:
    """The run's precision without a device: ``auto`` is bf16 on GPU, fp32 on CPU (as training)."""
    if precision == "auto":
        return "bf16" if is_gpu else "fp32"
    return precision


def instance_machine(name: str, precision: str, efficiency: float | None,
                     price: float | None) -> Machine:
    """A ``Machine`` from the instance-type table; UserError names an unknown type."""
    inst = instances.lookup(name)
    prec = resolve_precision(precision, True)
    peak = PEAK_FLOPS.get((inst.gpu_model, prec))
    if peak is None:  # the table and PEAK_FLOPS are kept in step by a test
        raise UserError(f"--instance-type {name}: no peak FLOP/s for {inst.gpu_model} in {prec}")
    intra = inst.intra_busbw_gbps or inst.inter_busbw_gbps
    return Machine(
        name=inst.name, devices_per_node=inst.gpus,
        device_memory_bytes=int(inst.gpu_memory_gib * 2**30), peak_flops=peak,
        efficiency=efficiency or GPU_EFFICIENCY[prec],
        memory_bandwidth=GPU_MEMORY_BANDWIDTH[inst.gpu_model],
        intra_busbw_gbps=intra, inter_busbw_gbps=inst.inter_busbw_gbps,
        price_per_node_hour=price if price is not None else instances.ON_DEMAND_USD_PER_HOUR.get(inst.name),
        is_gpu=True, fp8_capable=inst.gpu_model in FP8_GPU_MODELS,
        busbw_source=f"{inst.name} preset (NVLink/PCIe inside, {inst.network_gbps:g} Gbps network across nodes)")


def local_machine(ranks: int, efficiency: float | None, price: float | None,
                  shape: ModelShape | None = None, micro_batch: int = 1, seq_len: int = 1,
                  cfg: Any = None, model_config: Any = None, mean_document: float | None = None) -> Machine:
    """This host measured, as ``ranks`` ranks would see it (each with its share of the cores, or
    its GPU); a memory copy gives the bandwidth. Three paths, the first that applies:

    * measured: with the run's ``cfg``, its transformers ``model_config`` and ``shape``, no
      ``efficiency`` given, and a shape this host can time (``plan.layertime.measurable``), a
      decoder layer, the embedding/LM head/loss and the optimizer are timed as the step runs them
      (``plan.layertime``; on the GPU when there is one), with the run's document mask when
      ``mean_document`` is given;
    * FLOP path at the run's shapes: with ``shape``, one micro-batch's matmuls, attention and
      elementwise work are timed piece by piece (``plan.calibrate``): the peak is the matmul rate
      there, the efficiency what the rest leaves of it;
    * without: the square fp32 matmul of the training loop's MFU peak and ``CPU_EFFICIENCY``."""
    threads = omp_num_threads() or threads_per_rank(ranks)  # what each training rank will use
    why_not = None
    if cfg is not None and model_config is not None and shape is not None:
        why_not = ("--efficiency was given" if efficiency is not None
                   else measurable(shape, cfg.data.seq_len))
        if why_not is None:
            return _measured_machine(ranks, price, shape, cfg, model_config, threads, mean_document)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = _copy_bandwidth()
        if shape is None:
            size = CPU_MATMUL_SIZE
            peak = 2.0 * size**3 / best_matmul_seconds(torch.device("cpu"), size, torch.float32)
    finally:
        torch.set_num_threads(previous)
    source = f"square {CPU_MATMUL_SIZE} fp32 matmul x a constant efficiency"
    if shape is not None:
        cal = calibrate(shape, micro_batch, seq_len, threads, bandwidth)
        peak = cal.matmul_flops_per_s
        measured = shape.flops_per_token * micro_batch * seq_len / peak / cal.micro_batch_s
        efficiency = efficiency or measured
        source = ("FLOP path" + (f" ({why_not})" if why_not else "") + ": "
                  f"FLOPs / the rate measured at the run's shapes: matmuls {cal.matmul_s * 1e3:.1f} ms (LM head "
                  f"{cal.head_s * 1e3:.1f} ms) + attention "
                  f"{cal.attention_s * 1e3:.1f} ms + elementwise {cal.elementwise_s * 1e3:.1f} ms per micro-batch")
    memory = device_memory_bytes(torch.device("cpu"), ranks) or 0
    return Machine(name="local", devices_per_node=ranks, device_memory_bytes=memory, peak_flops=peak,
                   efficiency=efficiency or CPU_EFFICIENCY, memory_bandwidth=bandwidth,
                   intra_busbw_gbps=LOCAL_BUSBW_GBPS, inter_busbw_gbps=LOCAL_BUSBW_GBPS,
                   price_per_node_hour=price, is_gpu=False,
                   busbw_source=f"assumed gloo loopback {LOCAL_BUSBW_GBPS:g} GB/s (--busbw-json to measure)",
                   compute_source=source)


def _measured_machine(ranks: int, price: float | None, shape: ModelShape, cfg: Any, model_config: Any,
                      threads: int, mean_document: float | None) -> Machine:
    """The measured path of ``local_machine``: the step's pieces timed on this host's device."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = _copy_bandwidth(device=device)
    finally:
        torch.set_num_threads(previous)
    timing = time_step_pieces(model_config, shape, cfg, device, threads, mean_document)
    rate = shape.flops_per_token * cfg.train.micro_batch_size * cfg.data.seq_len / timing.micro_batch_s(False)
    fp8 = gpu and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY
    memory = device_memory_bytes(device, ranks) or 0
    return Machine(name="local", devices_per_node=ranks, device_memory_bytes=memory, peak_flops=rate,
                   efficiency=1.0, memory_bandwidth=bandwidth, intra_busbw_gbps=LOCAL_BUSBW_GBPS,
                   inter_busbw_gbps=LOCAL_BUSBW_GBPS, price_per_node_hour=price, is_gpu=gpu,
                   busbw_source=f"assumed gloo loopback {LOCAL_BUSBW_GBPS:g} GB/s (--busbw-json to measure)",
                   compute_source="measured path: " + timing.describe() + " (peak = the FLOPs per "
                   "micro-batch over its measured time)", timing=timing, fp8_capable=fp8)


def _copy_bandwidth(nbytes: int = 64 << 20, device: torch.device | None = None) -> float:
    """Bytes/s of a large tensor copy (read + write counted) on this process's threads (or GPU)."""
    device = device or torch.device("cpu")
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def with_busbw_json(machine: Machine, path: str) -> Machine:
    """``machine`` with AllReduce busbw by message size from a ``bench collectives --json`` file."""
    file = Path(path)
    try:
        lines = file.read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as exc:
        raise UserError(f"--busbw-json {path}: cannot read it ({exc})") from None
    table = sorted((int(r["bytes"]), float(r["busbw_gbps"])) for r in records
                   if isinstance(r, dict) and r.get("op") == "all_reduce" and r.get("busbw_gbps"))
    if not table:
        raise UserError(f"--busbw-json {path}: no all_reduce records with busbw_gbps (write it with "
                        "`podtrain bench collectives --ops all_reduce --json FILE`)")
    return replace(machine, busbw_table=tuple(table),
                   busbw_source=f"measured: {file.name}, all_reduce {table[0][1]:.2f}-{table[-1][1]:.2f} GB/s")
