"""``podtrain plan`` under ``model.init_from``: the bytes each rank reads from the folder, and about
how long the load takes.

The same arithmetic as the load itself (``podtrain.ckpt.hf_source.load_folder``), on the folder's
safetensors headers (a few KB per file, no tensor data) and the model built on the meta device:

* **ddp**: the tensors, in the model's state order, are cut into ``world`` ranges of ~equal size
  (``ckpt.plan.split_even``); each rank reads its range, then the ranks exchange them by broadcasts,
  so every rank receives the rest of the fp32 model over the network.
* **fsdp**: each rank reads the flat range of each tensor its ``Shard(0)`` shard holds
  (``ckpt.plan.shard_range``): ~1/N of the folder, nothing exchanged.
* **hsdp** (replicas x ``shard`` ranks): each tensor is read by one replica group
  (``ckpt.plan.assign_replicas``), each of its ranks its shard; the other groups receive those
  shards, so each rank reads ~1/N of the folder and receives ~(R-1)/R of its fp32 shard.

Bytes read are the folder's (bf16: 2 per parameter). The time is an estimate at a stated read
bandwidth per node (``READ_BYTES_PER_S_PER_NODE``: the node's share of shared storage or S3, not
measured) plus the exchange at the machine's busbw; converting to fp32 and copying to the device
are left out (memory-bandwidth bound, small beside both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from podtrain.ckpt.plan import assign_replicas, shard_range, split_even

READ_BYTES_PER_S_PER_NODE = 2e9
"""The read bandwidth the estimate assumes per node (2 GB/s: a conservative share of a parallel
file system or S3 for one node; a node's local NVMe or page cache is faster). Stated on the line."""
TARGET_BYTES = 4
"""The load's targets are fp32 master weights (what the ranks exchange)."""


@dataclass(frozen=True)
class FolderTensor:
    """One of the model's tensors as the folder stores it."""

    name: str
    """The model's name of it (the state order's), e.g. ``model.layers.0.mlp.up_proj.weight``."""
    shape: tuple[int, ...]
    element_size: int
    """Bytes per element in the folder (2 for bf16/fp16, 4 for fp32)."""

    @property
    def numel(self) -> int:
        """Elements."""
        return math.prod(self.shape)


def rank_read_bytes(tensors: Sequence[FolderTensor], strategy: str, world: int, shard: int | None = None) -> list[int]:
    """Bytes of the folder each rank reads (rank order) when ``world`` ranks load ``tensors`` (the
    model's tensors in its state order, tied ones once) under ``strategy``; ``shard``: hsdp's shard
    size (ranks ``r // shard`` form replica group ``r // shard``). Exactly what the load reads:
    touching ranges are merged into one read, never widened."""
    world = max(1, world)
    out = [0] * world
    size = {t.name: t.element_size for t in tensors}
    if strategy == "ddp":
        items = [(t.name, t.numel, TARGET_BYTES) for t in tensors]
        for rank, ranges in enumerate(split_even(items, world)):
            out[rank] = sum(count * size[name] for name, _, count in ranges)
        return out
    shard = world if strategy == "fsdp" or not shard else shard
    if world % shard:
        raise ValueError(f"shard size {shard} does not divide the world size {world}")
    replicas = world // shard
    # The load's names are ``model/<name>`` (``statedict.named_state``): ties in size are broken by
    # name, so the same spelling gives the same groups.
    group = assign_replicas([(f"model/{t.name}", t.numel * TARGET_BYTES) for t in tensors], replicas)
    for rank in range(world):
        mine, index = rank // shard, rank % shard
        out[rank] = sum(shard_range(t.shape, index, shard)[1] * t.element_size
                        for t in tensors if group[f"model/{t.name}"] == mine)
    return out


def folder_tensors(url: str, config: Any) -> tuple[list[FolderTensor], int]:
    """The model's tensors as folder ``url`` stores them, in the model's state order (the model
    built from ``config`` on the meta device, its names matched to the folder's as the load does),
    and the folder's tensor bytes. The same one-line ``UserError`` as training for a folder whose
    weights do not fit its config."""
    import torch
    from transformers import AutoModelForCausalLM

    from podtrain.ckpt.hf_source import match, open_folder
    from podtrain.ckpt.statedict import tied_aliases
    from podtrain.ckpt.tensorio import DTYPES, ELEMENT_SIZE

    folder = open_folder(url)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    aliases = tied_aliases(net)
    wanted = {n: tuple(t.shape) for n, t in net.state_dict(keep_vars=True).items() if n not in aliases}
    names = match(folder, wanted, aliases, net)
    tensors = [FolderTensor(n, shape, ELEMENT_SIZE[DTYPES[folder.tensors[names[n]].dtype]])
               for n, shape in wanted.items()]
    return tensors, folder.nbytes


@dataclass(frozen=True)
class InitLoad:
    """What loading ``model.init_from`` costs each rank under the plan's strategy."""

    url: str
    strategy: str
    world: int
    devices_per_node: int
    folder_bytes: int
    """Bytes of tensor data in the folder."""
    rank_bytes: tuple[int, ...]
    """Bytes of the folder each rank reads, rank order."""
    exchange_bytes: int
    """fp32 bytes a rank receives from the others after reading (ddp: the rest of the model;
    hsdp: the shards other replica groups read; fsdp: none)."""
    read_bytes_per_s: float
    """Per node (``READ_BYTES_PER_S_PER_NODE``)."""
    busbw_gbps: float
    """The exchange's bandwidth (the machine's AllReduce busbw at the plan's node count)."""

    @property
    def max_rank_bytes(self) -> int:
        """The most any rank reads."""
        return max(self.rank_bytes)

    @property
    def max_node_bytes(self) -> int:
        """The most the ranks of one node read together."""
        per = max(1, self.devices_per_node)
        return max(sum(self.rank_bytes[i:i + per]) for i in range(0, len(self.rank_bytes), per))

    @property
    def read_s(self) -> float:
        """Seconds the busiest node reads at ``read_bytes_per_s``."""
        return self.max_node_bytes / self.read_bytes_per_s

    @property
    def exchange_s(self) -> float:
        """Seconds of the exchange after the reads."""
        return self.exchange_bytes / (self.busbw_gbps * 1e9) if self.exchange_bytes and self.busbw_gbps else 0.0

    @property
    def seconds(self) -> float:
        """The estimated load time: the reads, then the exchange (the load does them in turn)."""
        return self.read_s + self.exchange_s

    def as_dict(self) -> dict[str, Any]:
        """For ``plan --json``."""
        return {"init_from": self.url, "strategy": self.strategy, "folder_bytes": self.folder_bytes,
                "bytes_per_rank_max": self.max_rank_bytes, "bytes_per_rank_min": min(self.rank_bytes),
                "bytes_per_node_max": self.max_node_bytes, "exchange_bytes_per_rank": self.exchange_bytes,
                "read_bytes_per_s_per_node": self.read_bytes_per_s, "read_s": self.read_s,
                "exchange_s": self.exchange_s, "seconds": self.seconds}

    def line(self) -> str:
        """The plan's line: bytes each rank reads under the strategy, and the estimated time."""
        how = {"ddp": "~1/N of the tensors, then broadcast to the others",
               "fsdp": "its shard of every tensor", "hsdp": "its shard of its replica group's tensors"}
        share = self.max_rank_bytes / self.folder_bytes if self.folder_bytes else 0.0
        exchange = (f" + {_seconds(self.exchange_s)} receiving {_mb(self.exchange_bytes)} fp32 from the other "
                    f"ranks at {self.busbw_gbps:g} GB/s busbw" if self.exchange_bytes else "")
        return (f"load: model.init_from {self.url} holds {_mb(self.folder_bytes)}; each rank reads at most "
                f"{_mb(self.max_rank_bytes)} ({share:.1%}, {self.strategy}: {how.get(self.strategy, '')}), "
                f"a node {_mb(self.max_node_bytes)}; about {_seconds(self.seconds)}: "
                f"{_seconds(self.read_s)} reading at {self.read_bytes_per_s / 1e9:g} GB/s per node (assumed)"
                f"{exchange}")


def _mb(nbytes: float) -> str:
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:,.1f} GB"
    return f"{nbytes / 1e6:,.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:,.1f} kB"


def _seconds(s: float) -> str:
    if s < 0.01:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def exchange_bytes(tensors: Sequence[FolderTensor], strategy: str, world: int, shard: int | None = None) -> int:
    """fp32 bytes one rank receives from the others after the reads (the most any rank does)."""
    total = sum(t.numel for t in tensors) * TARGET_BYTES
    if world <= 1 or strategy == "fsdp":
        return 0
    if strategy == "ddp":  # every rank receives all but its own ~1/N
        return total - total // world
    shard = shard or world
    replicas = world // shard
    return 0 if replicas <= 1 else (total // shard) * (replicas - 1) // replicas


def init_load(cfg: Any, strategy: str, world: int, machine: Any, nodes: int) -> InitLoad:
    """The load of ``cfg.model.init_from`` by ``world`` ranks (``nodes`` nodes of ``machine``) under
    ``strategy`` (hsdp's shard: ``dist.shard_size``, else a node's ranks, as training)."""
    from podtrain.model import hf_folder_config
    from podtrain.plan.memory import shard_factor

    url = cfg.model.init_from
    tensors, folder_bytes = folder_tensors(url, hf_folder_config(url))
    shard = (cfg.dist.shard_size or shard_factor(strategy, world, machine.devices_per_node)) \
        if strategy == "hsdp" else None
    exchanged = exchange_bytes(tensors, strategy, world, shard)
    return InitLoad(url, strategy, world, machine.devices_per_node, folder_bytes,
                    tuple(rank_read_bytes(tensors, strategy, world, shard)), exchanged,
                    READ_BYTES_PER_S_PER_NODE, machine.busbw_gbps(nodes, exchanged) if exchanged else 0.0)
