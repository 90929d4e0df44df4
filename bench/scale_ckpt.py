"""bench/scale.py's checkpoint half: what one save and one resume cost each rank, measured from outside.

Each rank (forked, gloo, ``tests/multirank.run_ranks``) builds a Llama whose tensor list has
llama-3-70B's names and count (80 layers x 9 + embeddings, norm, LM head = 723 tensors) at
1/``SHRINK`` of its widths, shards it with podtrain's FSDP strategy, gives AdamW its state, then
calls the public ``Checkpointer`` API: one ``save`` (+ ``wait``) and, with a fresh Checkpointer,
one ``restore``. Nothing in podtrain is changed; around each call this process counts:

* bytes received in collectives: every ``torch.distributed`` collective is wrapped (in this
  process only) and the bytes that arrive from other ranks are added up (a broadcast from
  another rank, all-gather output minus this rank's own input, a gather's list at the
  destination ...), whatever the checkpoint code sends, objects or tensors;
* metadata parsed: bytes given to ``json.loads``/``json.load`` and bytes unpickled by the object
  collectives, and the CPU seconds of the parsing thread in both (not wall time: with more ranks
  than cores a rank waits for a core, which says nothing of the parse);
* small-file bytes read from the store (``read_bytes``: manifest, state, sidecars).

The files are then measured on disk: shared metadata (every file of the step directory that
names no rank) and per-rank metadata (a rank's files minus their tensor payload: a safetensors
file counts its header).
"""

from __future__ import annotations

import json
import re
import struct
import threading
import time
from pathlib import Path

import torch

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
"""llama-3-70B's architecture numbers (its public config.json)."""
SHRINK = 128
"""The bench model's widths are llama-3-70B's divided by this (same layer and tensor count)."""
_RANK_RE = re.compile(r"(?:rank|meta)[_-]?0*(\d+)")  # piece files rank_N, sidecars meta_N


def llama_config(scale: int = 1) -> dict:
    """A llama config.json dict: 70B's 80 layers (723 tensors), widths / SHRINK x ``scale`` (each
    matrix scale^2 x larger; 70B's 8 query heads per KV head, head_dim 8)."""
    def w(n: int) -> int:
        return max(1, n * scale // SHRINK)

    heads = 8 * scale  # head_dim 8 at every scale: q/k/v/o grow as the other matrices do
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": w(8192),
            "intermediate_size": w(28672), "num_hidden_layers": 80, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 8), "vocab_size": w(128256), "tie_word_embeddings": False,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}


def llama_shapes(cfg: dict) -> list[tuple[int, int, int]]:
    """``(rows, cols, how many)`` of a llama config's tensors (untied): per layer q, k, v, o, gate,
    up, down and two norms; then the embeddings and the LM head, and the final norm."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or h // cfg["num_attention_heads"])
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h, 1), (h, 1)]
    return [(r, c, cfg["num_hidden_layers"]) for r, c in layer] + [(v, h, 2), (h, 1, 1)]


def llama_params(cfg: dict) -> int:
    """Parameters of a llama config: what the checkpoint's bytes scale with."""
    return sum(r * c * n for r, c, n in llama_shapes(cfg))


# -- counting from outside ---------------------------------------------------------------------
class Tally:
    """Thread-safe counters of one measured window (the writer runs in a background thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = {"recv_bytes": 0, "collectives": 0, "json_bytes": 0, "unpickled_bytes": 0,
                       "parse_s": 0.0, "small_read_bytes": 0}

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                self.values[k] += v


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _received(name: str, args: tuple, kw: dict) -> int:
    """Bytes that reach this rank from others in collective ``name`` called with ``args``/``kw``."""
    import torch.distributed as dist

    def arg(i, key, default=None):
        return kw[key] if key in kw else args[i] if len(args) > i else default

    group = kw.get("group")
    me = dist.get_rank()
    if name == "broadcast":
        src, gsrc = arg(1, "src"), kw.get("group_src")
        from_me = (gsrc == dist.get_rank(group)) if gsrc is not None else src == me
        return 0 if from_me else _nbytes(arg(0, "tensor"))
    if name == "all_gather":
        return sum(map(_nbytes, arg(0, "tensor_list", []))) - _nbytes(arg(1, "tensor"))
    if name == "all_gather_into_tensor":
        return _nbytes(arg(0, "output_tensor")) - _nbytes(arg(1, "input_tensor"))
    if name == "gather":
        gl = arg(1, "gather_list")
        return sum(map(_nbytes, gl)) - _nbytes(arg(0, "tensor")) if gl else 0
    if name == "scatter":
        return 0 if arg(1, "scatter_list") else _nbytes(arg(0, "tensor"))
    if name in ("all_reduce", "reduce", "recv", "irecv"):
        return _nbytes(arg(0, "tensor"))
    if name == "all_to_all_single":
        n = dist.get_world_size(group)
        return _nbytes(arg(0, "output")) * (n - 1) // max(n, 1)
    if name == "all_to_all":
        return sum(map(_nbytes, arg(0, "output_tensor_list", [])))
    return 0


COLLECTIVES = ("broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter", "all_reduce",
               "reduce", "recv", "irecv", "all_to_all_single", "all_to_all")


def install_counters(tally_of) -> None:
    """Wrap torch.distributed's collectives, ``json.loads``/``load``, the object collectives'
    unpickling and ``Store.read_bytes`` in this (forked, bench-only) process; each call adds to
    ``tally_of()`` (the window being measured, or None)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from podtrain.storage.base import Store

    for name in COLLECTIVES:
        real = getattr(c10d, name)

        def wrapped(*args, _real=real, _name=name, **kw):
            tally = tally_of()
            if tally is not None:
                tally.add(recv_bytes=max(0, _received(_name, args, kw)), collectives=1)
            return _real(*args, **kw)

        setattr(c10d, name, wrapped)  # the *_object collectives call these module globals
        setattr(dist, name, wrapped)  # podtrain calls dist.NAME

    def timed(kind: str, real, size):
        def call(*args, **kw):
            tally = tally_of()
            t0 = time.thread_time()  # CPU seconds of this thread: 32 ranks on 2 cores wait for a core
            out = real(*args, **kw)
            if tally is not None:
                tally.add(**{kind: size(args)}, parse_s=time.thread_time() - t0)
            return out
        return call

    json.loads = timed("json_bytes", json.loads, lambda a: len(a[0]))  # json.load calls it too
    if hasattr(c10d, "_tensor_to_object"):  # torch's private helper (2.13): the objects' bytes
        c10d._tensor_to_object = timed("unpickled_bytes", c10d._tensor_to_object, lambda a: int(a[1]))
    real_read = Store.read_bytes

    def read_bytes(self, name):
        data = real_read(self, name)
        tally = tally_of()
        if tally is not None:
            tally.add(small_read_bytes=len(data))
        return data

    Store.read_bytes = read_bytes


# -- the files ---------------------------------------------------------------------------------
def _metadata_bytes(path: Path) -> int:
    """A rank file's metadata: a safetensors file's 8-byte length and header; any other file whole."""
    if path.suffix == ".safetensors":
        with open(path, "rb") as fh:
            return 8 + struct.unpack("<Q", fh.read(8))[0]
    return path.stat().st_size


def file_metadata(step_dir: Path, world: int) -> dict:
    """Shared metadata bytes by file (files naming no rank) and each rank's metadata bytes."""
    shared: dict[str, int] = {}
    per_rank = [0] * world
    for p in sorted(step_dir.rglob("*")):
        if not p.is_file():
            continue
        rel = str(p.relative_to(step_dir))
        m = _RANK_RE.search(rel)
        if m and int(m.group(1)) < world:
            per_rank[int(m.group(1))] += _metadata_bytes(p)
        else:
            shared[rel] = p.stat().st_size
    return {"shared": shared, "per_rank": per_rank}


# -- the checksum-block probe ---------------------------------------------------------------------
PROBE_TENSORS, PROBE_COLS = 4, 1024
"""The probe model: PROBE_TENSORS fp32 matrices of ``rows x PROBE_COLS``, sharded on dim 0."""


def probe_blocks(rows: int, world: int, block: int) -> int:
    """Checksum blocks of the probe's checkpoint: every rank's piece of every weight and both AdamW
    moments (the scalar ``step`` pieces are the same at every size)."""
    piece = -(-rows // world) * PROBE_COLS * 4
    return PROBE_TENSORS * 3 * world * -(-piece // block)


def llama_blocks(cfg: dict, world: int, block: int) -> int:
    """Checksum blocks of a llama checkpoint (fp32 weights + two AdamW moments) under FSDP on
    ``world`` ranks: each rank's dim-0 shard of each tensor is a piece."""
    total = 0
    for rows, cols, count in llama_shapes(cfg):
        piece = -(-rows // world) * cols * 4
        total += count * 3 * world * -(-piece // block)
    return total


def _probe_model(rows: int, ctx):
    """A module of PROBE_TENSORS matrices under FSDP2 (its own ``fully_shard`` on the root)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from podtrain.train.strategy import device_mesh

    torch.manual_seed(0)
    net = nn.Module()
    for k in range(PROBE_TENSORS):
        net.register_parameter(f"w{k}", nn.Parameter(torch.randn(rows, PROBE_COLS)))
    fully_shard(net, mesh=device_mesh(ctx, (ctx.world_size,)))
    return net


# -- one rank ----------------------------------------------------------------------------------
def ckpt_rank(rank: int, world: int, run_dir: str, config_json: str, probe_rows: int = 0,
              phases: str = "save,restore", strategy_name: str = "fsdp", local_dir: str = "") -> dict:
    """On a forked rank: a model under FSDP with AdamW state, one counted save, one counted
    restore (``phases``: either alone; a restore alone reads what a run at another world size
    saved under ``run_dir``). The llama of ``config_json`` through podtrain's ``strategy_name``
    (fsdp, or hsdp: groups of 2 ranks), or with ``probe_rows`` the checksum-block probe
    (``_probe_model``). With ``local_dir`` the save goes to the node-local tier (``ckpt.local_dir``,
    peer replicas at their default) and the restore reads it from there."""
    import sys

    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection, DistSection
    from podtrain.model import preset_config
    from podtrain.train.precision import resolve_precision
    from podtrain.train.strategy import build_for_strategy, build_strategy

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from multirank import gloo_context

    box: dict[str, Tally | None] = {"t": None}
    install_counters(lambda: box["t"])
    ctx = gloo_context()
    strategy = None
    if probe_rows:
        model = _probe_model(probe_rows, ctx)
    else:
        dist_cfg = DistSection(strategy=strategy_name, shard_size=2 if strategy_name == "hsdp" else None)
        model, reference = build_for_strategy(preset_config(config_json), "sdpa", 1234, strategy_name, ctx)
        strategy = build_strategy(dist_cfg, ctx, resolve_precision("fp32", ctx.device), 16)
        model = strategy.wrap(model, reference)
        del reference
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():  # AdamW state exists: weights + two moments, as in training
        p.grad = torch.zeros_like(p)
    opt.step()
    out: dict = {"rank": rank, "tensors": sum(1 for _ in model.parameters())}
    cfg = CkptSection(keep_last=0, save_wait_s=600.0, local_dir=local_dir)
    for phase in phases.split(","):
        ck = Checkpointer(Path(run_dir), cfg, ctx)
        try:
            box["t"] = tally = Tally()
            t0, cpu0 = time.perf_counter(), time.thread_time()
            if phase == "save":
                ck.save(1, model, opt, None, {"step": 1, "tokens_seen": 0}, local=bool(local_dir))
                ck.wait()
            else:
                state = ck.restore(model, opt, None)
                assert state is not None and state.step == 1, f"rank {rank}: restore found no step 1"
            out[f"{phase}_s"] = time.perf_counter() - t0
            out[f"{phase}_cpu_s"] = time.thread_time() - cpu0  # this (main) thread's CPU seconds
            box["t"] = None
            out[phase] = dict(tally.values)
        finally:
            ck.close()
    if strategy is not None:
        strategy.release()
    return out
