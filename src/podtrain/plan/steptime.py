"""Step time from first principles: compute, gradient communication, optimizer, data, saves, eval.

* compute: training FLOPs of the rank's tokens / (peak x efficiency); activation checkpointing
  recomputes the forward (x 4/3).
* gradient communication, ring model (nccl-tests' bus bandwidth): an AllReduce of B bytes on n
  ranks takes 2(n-1)/n x B / busbw; an AllGather or ReduceScatter (n-1)/n x B / busbw. DDP
  all-reduces fp32 gradients bucket by bucket while the last micro-batch's backward continues, so
  only what does not fit behind that backward is exposed: max(one bucket, total - backward x
  (buckets-1)/buckets). FSDP gathers each block's 16-bit weights in forward and backward and
  reduce-scatters fp32 gradients, overlapped block by block with compute; HSDP does that inside a
  node and all-reduces the node's shard across nodes.
* latency: every collective also pays ~2 x log2(n) network hops of COLLECTIVE_HOP_S (NCCL
  switches from rings to trees and pipelines at scale, so the hop count grows like a tree's
  depth); at hundreds of nodes this, not bandwidth, is what outgrows the compute of small models.
* optimizer: AdamW and clipping are memory-bound, ~32 bytes moved per local parameter.
* measured (``timing``, ``plan --instance-type local``): compute and optimizer are what
  ``plan/layertime.py`` timed on this host (a decoder layer x layers + embedding/LM head/loss per
  micro-batch; AdamW over a layer's parameters x layers + the ends'), not FLOPs / rate.
* compute is split into the decoder matmuls, attention and the rest (LM head, loss), by FLOPs on
  the FLOP path and as timed on the measured one, so that FP8 and document masking
  (``plan/published.py``) scale the term they change.
* data: the loader builds batches ahead; only a build slower than the step is waited for.
* saves and evaluation: amortised over the steps between them (the loop's step_time_s excludes
  them; they are shown apart).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from typing import TYPE_CHECKING, Any

from podtrain.diagnostics.busbw import bus_factor
from podtrain.plan.memory import GRAD_BYTES, ModelShape, checkpoint_bytes

if TYPE_CHECKING:
    from podtrain.plan.published import Adjustment

OPTIMIZER_BYTES_PER_PARAM = 32
# Seconds per network hop of a collective (EFA/InfiniBand message latency is ~10-20 us).
COLLECTIVE_HOP_S = 15e-6
# Pinned device-to-host copy rate of a checkpoint's host staging on a GPU (PCIe Gen4/5 x16).
GPU_HOST_COPY_BYTES_PER_S = 25e9
# Disk write rate for synchronous checkpoints (bytes/s): a shared file system such as FSx for
# Lustre per client; async saves only pay the host copy.
DISK_WRITE_BYTES_PER_S = 1e9
# Bytes per token in the shards (uint16 for vocabularies up to 65,536).
TOKEN_BYTES = 2


@dataclass(frozen=True)
class Workload:
    """What one optimizer step asks of each rank (from the run config and the job size)."""

    micro_batch: int
    accum: int
    seq_len: int
    bucket_bytes: int
    dtype_bytes: int
    checkpointing: bool
    ckpt_every: int
    async_save: bool
    eval_every: int
    eval_batches: int

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank trains on per optimizer step."""
        return self.micro_batch * self.accum * self.seq_len


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by component."""

    compute_s: float
    """Forward + backward of every micro-batch (with recomputation when checkpointing)."""
    optimizer_s: float
    """AdamW step and gradient clipping."""
    comm_s: float
    """All gradient/weight communication of the step."""
    sync_wait_s: float
    """The part of ``comm_s`` not hidden behind compute (what the loop measures as sync wait)."""
    data_wait_s: float
    """Waiting for the next batch."""
    save_s: float
    """Checkpoint stall amortised per step."""
    eval_s: float
    """Evaluation amortised per step."""
    matmul_s: float = 0.0
    """The decoder layers' matmul share of ``compute_s`` (timed: the layers less their attention)."""
    attention_s: float = 0.0
    """The attention share of ``compute_s``."""
    other_s: float = 0.0
    """The rest of ``compute_s``: embedding, LM head, loss."""
    compute_path: str = "flops"
    """``measured`` (a decoder layer, the ends and the optimizer timed on this host) or ``flops``
    (FLOPs / the machine's sustained rate)."""
    timed: dict[str, Any] | None = None
    """The measured path's pieces (``LayerTiming.as_dict``), else None."""
    notes: tuple[str, ...] = ()
    """What came from published figures or estimates (FP8, document masking), one sentence each."""

    @property
    def step_s(self) -> float:
        """What the loop's ``step_time_s`` measures: all but saves and evaluation."""
        return self.compute_s + self.optimizer_s + self.sync_wait_s + self.data_wait_s

    @property
    def wall_s(self) -> float:
        """Wall time per step including amortised saves and evaluation."""
        return self.step_s + self.save_s + self.eval_s

    def as_dict(self) -> dict[str, float]:
        """The components and both totals, for JSON."""
        return {**asdict(self), "step_s": self.step_s, "wall_s": self.wall_s}


def ring_allreduce_s(nbytes: float, ranks: int, busbw_gbps: float) -> float:
    """Seconds of an AllReduce of ``nbytes`` over ``ranks`` at bus bandwidth ``busbw_gbps``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return bus_factor("all_reduce", ranks) * nbytes / (busbw_gbps * 1e9)


def ring_gather_s(nbytes: float, ranks: int, busbw_gbps: float) -> float:
    """Seconds of an AllGather (or ReduceScatter) whose full result is ``nbytes``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return bus_factor("all_gather", ranks) * nbytes / (busbw_gbps * 1e9)


def latency_s(collectives: float, ranks: int) -> float:
    """Hop latency of ``collectives`` collectives among ``ranks`` ranks: 2 x log2(ranks) hops each."""
    return 0.0 if ranks <= 1 else collectives * 2 * math.log2(ranks) * COLLECTIVE_HOP_S


def exposed_s(comm_s: float, hiding_s: float, pieces: int) -> float:
    """Communication left after overlapping ``pieces`` equal pieces with ``hiding_s`` of compute:
    the last piece always waits; the rest hide behind the compute that produces later pieces."""
    if comm_s <= 0:
        return 0.0
    pieces = max(1, pieces)
    return max(comm_s / pieces, comm_s - hiding_s * (pieces - 1) / pieces)


RECOMPUTE_SHARE = 1 / 3
"""Activation checkpointing runs each layer's forward again in the backward: a third more of a
layer's forward + backward (the backward costs twice the forward)."""


@dataclass(frozen=True)
class LayerTiming:
    """One micro-batch's pieces and one optimizer step's, measured on this host (seconds):
    ``plan/layertime.py`` measures them, the step-time model here scales them by layers."""

    layer_s: float
    """One decoder layer's forward + backward for one micro-batch (attention included)."""
    attention_s: float
    """The attention inside ``layer_s`` (SDPA forward + backward, as the run computes it)."""
    ends_s: float
    """Embedding, final norm, LM head and cross-entropy, forward + backward, one micro-batch."""
    optimizer_layer_s: float
    """Clipping and AdamW over one layer's parameters."""
    optimizer_ends_s: float
    """Clipping and AdamW over the embedding, final norm and (untied) LM head."""
    layers: int
    """Decoder layers of the run's model (what ``layer_s`` is scaled by)."""
    timed_sequences: int
    """Sequences actually timed (``micro_batch`` when the micro-batch was timed whole)."""
    micro_batch: int
    device: str
    """Where it was timed: ``cpu`` or ``cuda``."""
    dtype: str
    """The run's precision it was timed in."""
    masked: bool = False
    """Attention timed with the run's document mask (``data.document_masking``)."""

    def micro_batch_s(self, checkpointing: bool) -> float:
        """One micro-batch's forward + backward through the whole model."""
        layer = self.layer_s * (1 + RECOMPUTE_SHARE if checkpointing else 1)
        return self.layers * layer + self.ends_s

    def optimizer_s(self, shards: int) -> float:
        """One optimizer step over this rank's share (``shards``: FSDP/HSDP divide the state)."""
        return (self.layers * self.optimizer_layer_s + self.optimizer_ends_s) / max(1, shards)

    def as_dict(self) -> dict[str, Any]:
        """For the plan's JSON: what was timed."""
        return {"timed": ["decoder_layer", "attention", "embedding_head_loss", "optimizer"],
                "layer_s": self.layer_s, "attention_s": self.attention_s, "ends_s": self.ends_s,
                "optimizer_layer_s": self.optimizer_layer_s, "optimizer_ends_s": self.optimizer_ends_s,
                "layers": self.layers, "timed_sequences": self.timed_sequences,
                "micro_batch": self.micro_batch, "device": self.device, "dtype": self.dtype,
                "masked_attention": self.masked}

    def describe(self) -> str:
        """The plan's compute line."""
        scaled = (f", {self.timed_sequences} of {self.micro_batch} sequences timed and scaled"
                  if self.timed_sequences != self.micro_batch else "")
        masked = ", document-masked" if self.masked else ""
        return (f"timed on this host's {self.device} in {self.dtype} at the run's shapes: decoder layer "
                f"{self.layer_s * 1e3:.1f} ms (attention {self.attention_s * 1e3:.1f} ms{masked}) "
                f"x {self.layers} + embedding/LM head/loss {self.ends_s * 1e3:.1f} ms per micro-batch{scaled}; "
                f"optimizer {self.optimizer_layer_s * 1e3:.2f} ms per layer + "
                f"{self.optimizer_ends_s * 1e3:.2f} ms")


def decoder_matmul_params(shape: ModelShape) -> int:
    """Weights of one decoder layer's linear layers (q, k, v, output; the MLP's two or three)."""
    h, a, kv, inter = shape.hidden, shape.attn_width, shape.kv_width, shape.intermediate
    return h * (a + 2 * kv) + a * h + (3 if shape.gated_mlp else 2) * h * inter


def compute_split(shape: ModelShape, work: Workload, sustained_flops: float,
                  timing: LayerTiming | None) -> tuple[float, float, float]:
    """Seconds per step of the decoder matmuls, attention and the rest: measured per micro-batch
    x micro-batches when ``timing`` is given, else the FLOPs of each / ``sustained_flops``."""
    recompute = 1 + RECOMPUTE_SHARE if work.checkpointing else 1
    if timing is not None:
        scale = work.accum * (1 + RECOMPUTE_SHARE if work.checkpointing else 1)
        attention = timing.layers * timing.attention_s * scale
        matmul = timing.layers * max(0.0, timing.layer_s - timing.attention_s) * scale
        return matmul, attention, work.accum * timing.ends_s
    tokens = work.tokens_per_rank
    attention_flops = 12.0 * shape.layers * shape.attn_width * work.seq_len
    matmul_flops = 6.0 * shape.layers * decoder_matmul_params(shape)
    other_flops = max(0.0, shape.flops_per_token - attention_flops - matmul_flops)
    per = tokens * recompute / sustained_flops
    return matmul_flops * per, attention_flops * per, other_flops * per


def step_time(shape: ModelShape, work: Workload, strategy: str, shards: int, world: int, nodes: int,
              devices_per_node: int, sustained_flops: float, memory_bandwidth: float,
              busbw, gpu: bool, gathered: bool = True, timing: LayerTiming | None = None,
              adjustments: tuple[Adjustment, ...] = (), fp8_gather: bool = False) -> StepTime:
    """Seconds per step of ``work`` under ``strategy``; ``busbw(nodes, nbytes)`` gives GB/s.
    fsdp/hsdp with ``gathered`` (weights kept gathered between micro-batches) gather each block
    once per step and reduce-scatter once; without, they gather in every forward and backward and
    reduce-scatter after every micro-batch. ``timing``: this host's measured pieces (the measured
    path); ``adjustments``: published factors on the matmul or attention term (FP8, masking);
    ``fp8_gather``: FSDP gathers the weights in FP8 (one byte each)."""
    matmul, attention, other = compute_split(shape, work, sustained_flops, timing)
    for adjust in adjustments:
        if adjust.term == "matmul":
            matmul *= adjust.factor
        elif adjust.term == "attention":
            attention *= adjust.factor
    compute = matmul + attention + other
    micro_compute = compute / work.accum
    backward = micro_compute * 2 / 3
    grad_bytes = GRAD_BYTES * shape.params
    if strategy == "ddp":
        message = min(work.bucket_bytes, grad_bytes)
        buckets = -(-grad_bytes // max(1, work.bucket_bytes))
        comm = ring_allreduce_s(grad_bytes, world, busbw(nodes, message)) + latency_s(buckets, world)
        wait = exposed_s(comm, backward, buckets)
    else:
        group = world if strategy == "fsdp" else min(world, devices_per_node)
        group_nodes = nodes if strategy == "fsdp" else 1
        layer_bytes = shape.layer_params * (1 if fp8_gather else work.dtype_bytes)
        gather = (2 * ring_gather_s(layer_bytes, group, busbw(group_nodes, layer_bytes)) * shape.layers
                  + latency_s(2 * shape.layers, group))
        scatter = (ring_gather_s(grad_bytes, group, busbw(group_nodes, GRAD_BYTES * shape.layer_params))
                   + latency_s(shape.layers, group))
        across = 0.0
        if strategy == "hsdp" and nodes > 1:
            shard_bytes = grad_bytes / group
            across = ring_allreduce_s(shard_bytes, nodes, busbw(nodes, shard_bytes)) + latency_s(1, nodes)
        if gathered:
            gathers, scatters = 0.5, 1  # one all-gather per block per step; one reduce-scatter
        else:
            gathers, scatters = work.accum, work.accum
        comm = gather * gathers + scatter * scatters + across
        per_micro = exposed_s(gather, micro_compute, shape.layers)
        wait = (per_micro * gathers + exposed_s(scatter + across, backward, shape.layers)
                + exposed_s(scatter, backward, shape.layers) * (scatters - 1))
    if timing is not None:
        optimizer = timing.optimizer_s(shards)
    else:
        optimizer = OPTIMIZER_BYTES_PER_PARAM * shape.params / shards / memory_bandwidth
    build = work.tokens_per_rank * TOKEN_BYTES / memory_bandwidth
    data = max(0.0, build - (compute + optimizer))
    state = checkpoint_bytes(shape.params) / shards
    copy = state / (GPU_HOST_COPY_BYTES_PER_S if gpu else memory_bandwidth)
    save = copy if work.async_save else copy + state / DISK_WRITE_BYTES_PER_S
    # An evaluation micro-batch is a forward: a third of a training one's forward + backward.
    micro_plain = compute / work.accum / (4 / 3 if work.checkpointing else 1)
    eval_total = work.eval_batches * micro_plain / 3
    return StepTime(
        compute_s=compute, optimizer_s=optimizer, comm_s=comm, sync_wait_s=wait, data_wait_s=data,
        save_s=save / work.ckpt_every if work.ckpt_every else 0.0,
        eval_s=eval_total / work.eval_every if work.eval_every else 0.0,
        matmul_s=matmul, attention_s=attention, other_s=other,
        compute_path="measured" if timing is not None else "flops",
        timed=timing.as_dict() if timing is not None else None,
        notes=tuple(a.note for a in adjustments))
