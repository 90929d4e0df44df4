"""A Hugging Face model folder as one more checkpoint layout: ``model.init_from``.

A folder (a path or ``s3://bucket/prefix``) holds ``config.json`` and either ``model.safetensors`` or
shards ``model-0000X-of-0000N.safetensors`` named by ``model.safetensors.index.json``. Every
safetensors file starts with a JSON header giving each tensor's dtype, shape and byte offsets, so
the folder's **piece table** comes from its headers alone (``open_folder``: a few KB per file, read
by rank 0 and broadcast), and a rank reads exactly the byte ranges it needs, as a resume does
(``podtrain.ckpt.load``):

* under fsdp/hsdp each rank reads the flat range its own shard holds of each tensor
  (``statedict.dtensor_range``; under HSDP one replica group per tensor, the others receive it);
* the tensors every rank holds whole (ddp) are split ~1/N per rank (``statedict.plain_plan``) and
  exchanged by the same broadcasts a resume uses (``load.finish``).

Reads are merged per file (``coalesce``) and copied into the live targets as they arrive, the
folder's bf16/fp16 converted to the model's fp32 on the way: a rank holds its share plus a few
read buffers, never the whole model (on a GPU each read's bytes go to the device in the folder's
dtype and are converted there; no value is read back to the host and nothing is collective per
tensor: one agreement after the reads, then ``finish``'s broadcasts). Tied embeddings stay
tied: a tied head is an alias of the embedding (``statedict.tied_aliases``), read once. The
folder has no block checksums (it is not podtrain's); a short or missing file, an unknown dtype
or a header that contradicts the file's size is a one-line ``UserError``, as is a tensor whose
name or shape the config's model lacks.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from podtrain.ckpt.coalesce import Chunk, Read, coalesce
from podtrain.ckpt.load import LoadPlan, finish
from podtrain.ckpt.statedict import dtensor_range, flat_local, is_dtensor, named_state, plain_plan, replica_groups
from podtrain.ckpt.store import StorageError, open_store, read_json
from podtrain.ckpt.tensorio import DTYPES, ELEMENT_SIZE
from podtrain.errors import UserError
from podtrain.storage.errors import Transient

log = logging.getLogger("podtrain.checkpoint")

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit on a header: a larger length prefix means the file is not safetensors."""
READ_BYTES = 32 << 20
"""Most bytes of one read (one buffer per reading thread)."""
READ_THREADS = 4
"""Reads in flight per rank (object storage: a request's latency overlaps the others')."""


@dataclass(frozen=True)
class HFTensor:
    """Where one tensor of the folder lies: ``nbytes`` bytes of ``file`` from byte ``offset``."""

    file: str
    dtype: str
    """safetensors' dtype code (``BF16``, ``F32``...)."""
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class HFFolder:
    """A folder's piece table (from its headers) and identity."""

    url: str
    tensors: dict[str, HFTensor] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    sha256: str = ""
    """SHA-256 of config.json, the index and every file's name, size and header: it changes when
    the architecture, the tensors' layout or a file's size changes (not a re-hash of the weights)."""

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the folder."""
        return sum(t.nbytes for t in self.tensors.values())

    def record(self) -> dict[str, Any]:
        """What the run's lineage records of where it started."""
        return {"init_from": self.url, "sha256": self.sha256, "step": 0}


def _fail(url: str, what: str) -> UserError:
    return UserError(f"model.init_from {url}: {what}")


def convert_command(url: str) -> str:
    """The one-liner that turns a pickle (``.bin``) checkpoint folder into safetensors."""
    return (f"python -c \"from transformers import AutoModelForCausalLM as A; A.from_pretrained('{url}')"
            f".save_pretrained('{url.rstrip('/')}-safetensors', safe_serialization=True)\"")


def open_folder(url: str) -> HFFolder:
    """Read the folder's config, index and safetensors headers (no tensor data): its piece table
    and content hash. One-line ``UserError`` for a folder without weights, a shard the index names
    but the folder lacks, a pickle checkpoint, or a file that is not safetensors; a transient
    storage failure keeps its own (retryable) class."""
    try:
        return _open_folder(url)
    except Transient:
        raise
    except StorageError as exc:
        raise _fail(url, str(exc)) from None


def _open_folder(url: str) -> HFFolder:
    store = open_store(url)
    try:
        entries = {e.name: e.size for e in store.list("") if "/" not in e.name}
    except StorageError as exc:
        raise _fail(url, str(exc)) from None
    if not entries:
        raise _fail(url, "no such folder, or it is empty")
    if CONFIG not in entries:
        raise _fail(url, f"no {CONFIG} (a Hugging Face model folder holds config.json and its weights)")
    digest = hashlib.sha256()
    digest.update(store.read_bytes(CONFIG))
    if INDEX in entries:
        raw_index = store.read_bytes(INDEX)
        digest.update(raw_index)
        try:
            weight_map = read_json(store, INDEX, raw_index)["weight_map"]  # not a JSON object: ValueError
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _fail(url, f"{INDEX} is not a safetensors index ({type(exc).__name__}: {exc})") from None
        missing = [f for f in files if f not in entries]
        if missing:
            raise _fail(url, f"{missing[0]}, named by {INDEX}, is missing ({len(missing)} of {len(files)} "
                             "shards missing: copy the whole folder)")
    elif SINGLE in entries:
        weight_map, files = None, [SINGLE]
    else:
        pickles = sorted(n for n in entries if n.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise _fail(url, f"holds {pickles[0]}, a pickle checkpoint: podtrain reads safetensors only (loading "
                             f"a pickle can run code). Convert it once: {convert_command(url)} and set "
                             "model.init_from to the new folder")
        others = sorted(n for n in entries if n.endswith(".safetensors"))
        raise _fail(url, "no weights: neither model.safetensors nor model.safetensors.index.json"
                         + (f" (it holds {', '.join(others[:3])}: not a full model's weights)" if others else ""))
    folder = HFFolder(url, files=files)
    for name in files:
        digest.update(f"{name}:{entries[name]}:".encode())
        digest.update(_read_header(store, url, name, entries[name], folder.tensors))
    if weight_map is not None:
        absent = [t for t, f in weight_map.items() if t not in folder.tensors or folder.tensors[t].file != f]
        if absent:
            raise _fail(url, f"{INDEX} puts tensor {absent[0]} in {weight_map[absent[0]]}, whose header "
                             "does not hold it")
    folder.sha256 = digest.hexdigest()
    return folder


def _read_header(store, url: str, name: str, size: int, out: dict[str, HFTensor]) -> bytes:
    """Parse one safetensors file's header into ``out``; returns the header's bytes (for the hash)."""
    bad = f"{name} is not a safetensors file"
    if size < 8:
        raise _fail(url, f"{bad} ({size} bytes)")
    (length,) = struct.unpack("<Q", store.read_range(name, 0, 8))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise _fail(url, f"{bad} (header length {length} in a file of {size} bytes)")
    raw = store.read_range(name, 8, length)
    header = read_json(store, name, raw, error=lambda _: _fail(url, f"{bad} (its header is not JSON)"))
    base = 8 + length
    for tname, rec in header.items():
        if tname == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = rec["dtype"], tuple(int(d) for d in rec["shape"]), rec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise _fail(url, f"{name}: tensor {tname}: malformed header entry") from None
        if code not in DTYPES:
            raise _fail(url, f"{name}: tensor {tname} has dtype {code}, which podtrain cannot read")
        nbytes = math.prod(shape) * ELEMENT_SIZE[DTYPES[code]]
        if end - begin != nbytes or base + end > size:
            raise _fail(url, f"{name}: tensor {tname} ({code} {list(shape)}) lies past the end of the file or "
                             "its byte range does not match its shape (a truncated or damaged file)")
        out[tname] = HFTensor(name, code, shape, base + begin, nbytes)
    return raw


def match(folder: HFFolder, wanted: dict[str, tuple[int, ...]], aliases: dict[str, str],
          net: nn.Module | None = None) -> dict[str, str]:
    """``{model name: folder tensor name}`` for every tensor ``wanted`` (unwrapped name -> shape).

    A name is found as itself, as a tied alias of it (a folder that saved the tied head and not
    the embedding), or without the model's ``base_model_prefix`` (GPT-2's older files). A tied
    alias the folder also stores is ignored, as are the names transformers itself ignores
    (``_keys_to_ignore_on_load_unexpected``). Raises one ``UserError`` naming what is missing,
    unexpected, or of another shape than the config's model has."""
    prefix = getattr(net, "base_model_prefix", "") or ""
    ignore = [re.compile(p) for p in (getattr(net, "_keys_to_ignore_on_load_unexpected", None) or [])]
    others: dict[str, list[str]] = {}
    for alias, name in aliases.items():
        others.setdefault(name, []).append(alias)
    out: dict[str, str] = {}
    missing, shapes = [], []
    for name, shape in wanted.items():
        candidates = [name, *others.get(name, [])]
        candidates += [c[len(prefix) + 1:] for c in candidates if prefix and c.startswith(prefix + ".")]
        src = next((c for c in candidates if c in folder.tensors), None)
        if src is None:
            missing.append(name)
            continue
        stored = folder.tensors[src].shape
        if tuple(stored) != tuple(shape):
            shapes.append(f"{src} is {list(stored)} in {folder.tensors[src].file}, {list(shape)} in the model "
                          f"its {CONFIG} describes")
        out[name] = src
    used = set(out.values())
    aliased = set(aliases) | {a[len(prefix) + 1:] for a in aliases if prefix and a.startswith(prefix + ".")}
    unexpected = sorted(n for n in folder.tensors
                        if n not in used and n not in aliased and not any(p.search(n) for p in ignore))
    if shapes:
        raise _fail(folder.url, f"tensor {shapes[0]}{f' (and {len(shapes) - 1} more)' if len(shapes) > 1 else ''}: "
                                f"the weights do not match {CONFIG}")
    if missing or unexpected:
        parts = [f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                 for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise _fail(folder.url, f"the weights do not fit the model its {CONFIG} describes ({'; '.join(parts)})")
    return out


@dataclass(frozen=True)
class _Dest:
    """Where a chunk's elements go: ``dst[dst_lo:dst_lo + count]`` as ``dtype`` values."""

    dst: torch.Tensor
    dst_lo: int
    count: int
    dtype: torch.dtype


def _chunks(folder: HFFolder, src: str, start: int, count: int, dst: torch.Tensor, dst_start: int,
            cap: int) -> list[Chunk]:
    """Elements ``[start, start + count)`` of folder tensor ``src`` as whole-element chunks of at
    most ``cap`` bytes, each naming where its elements go in ``dst`` (whose element 0 is the
    tensor's element ``dst_start``)."""
    info = folder.tensors[src]
    dtype = DTYPES[info.dtype]
    esize = ELEMENT_SIZE[dtype]
    per = max(1, cap // esize)
    out = []
    for first in range(start, start + count, per):
        n = min(per, start + count - first)
        out.append(Chunk(info.file, info.offset + first * esize, n * esize, _Dest(dst, first - dst_start, n, dtype)))
    return out


def read_share(store, folder: HFFolder, wanted: list[tuple[str, int, int, torch.Tensor, int]],
               cap: int = READ_BYTES, threads: int = READ_THREADS) -> int:
    """Fill this rank's share: ``wanted`` holds ``(folder tensor, first element, elements, flat
    target, the target's first element)``. Reads are merged per file, each read's bytes copied
    (converted to the target's dtype) as soon as it arrives. Returns bytes read."""
    chunks = [c for src, start, count, dst, dst_start in wanted
              for c in _chunks(folder, src, start, count, dst, dst_start, cap)]
    # Only touching ranges are merged (gap 0): the holes between a rank's ranges are other ranks'
    # shares, and reading them too would make every rank read most of a small model's folder.
    reads = coalesce(chunks, cap, gap=0)

    def fetch(r: Read) -> int:
        buf = torch.empty(r.length, dtype=torch.uint8)
        try:
            store.read_into(r.file, r.offset, buf.numpy())
        except Transient:
            raise
        except StorageError as exc:
            raise _fail(folder.url, f"{r.file}: {exc}") from None
        for c in r.chunks:
            d: _Dest = c.payload
            raw = buf[c.offset - r.offset:c.offset - r.offset + c.length]
            if raw.storage_offset() % ELEMENT_SIZE[d.dtype]:  # merged after an odd-sized tensor
                raw = raw.clone()
            values = raw.view(d.dtype)
            if d.dst.device.type != "cpu":
                # To the device in the folder's dtype, converted there: a CPU tensor copied into a
                # GPU one of another dtype is first converted on the host (an fp32 temporary twice
                # a bf16 read's size) and then sends twice the bytes over PCIe. The copy from this
                # pageable buffer is synchronous, so the buffer may be dropped right after; no
                # collective and no host read of a value per tensor.
                values = values.to(d.dst.device)
            with torch.no_grad():
                d.dst[d.dst_lo:d.dst_lo + d.count].copy_(values)
        return r.length

    if len(reads) < 2 or threads < 2:
        return sum(fetch(r) for r in reads)
    with ThreadPoolExecutor(min(threads, len(reads)), thread_name_prefix="podtrain-hf-read") as ex:
        return sum(ex.map(fetch, reads))


@dataclass
class InitStats:
    """One rank's load from a folder."""

    folder: HFFolder
    bytes_read: int
    seconds: float


def load_folder(url: str, net: nn.Module, optimizer: torch.optim.Optimizer, ctx) -> InitStats:
    """Every rank (collective): the weights of folder ``url`` into ``net`` (unwrapped; whole
    tensors under ddp, FSDP2/HSDP shards otherwise), each rank reading only its share; the
    optimizer is left empty (a fresh start at step 0). Rank 0 reads the headers and broadcasts
    the piece table; a mistake found by any rank stops every rank with its one line."""
    t0 = time.perf_counter()
    folder = ctx.agree_on(lambda: open_folder(url) if ctx.is_main else None)
    folder = ctx.broadcast_object(folder)
    state = named_state(net, optimizer, with_optimizer=False)
    targets = state.tensors
    names = ctx.agree_on(lambda: match(folder, {n.split("/", 1)[1]: tuple(t.shape) for n, t in targets.items()},
                                       state.aliases, net))
    rank, world = ctx.rank, ctx.world_size
    plan = LoadPlan(folder.url, {}, {}, {}, state)
    plan.plain = plain_plan(targets, world)
    plan.readers = replica_groups(targets)
    wanted = []
    for tname, t in targets.items():
        if is_dtensor(t):
            start, count, primary = dtensor_range(tname, t, plan.readers.get(tname, 0))
            if count and primary:
                wanted.append((names[tname.split("/", 1)[1]], start, count, flat_local(t), start))
    for tname, start, count in plan.plain[rank]:
        wanted.append((names[tname.split("/", 1)[1]], start, count, flat_local(targets[tname]), 0))
    got = ctx.agree_on(lambda: read_share(open_store(folder.url), folder, wanted))
    finish(plan, net, optimizer)  # broadcasts the whole tensors' ranges, HSDP's replicas; applies the state
    return InitStats(folder, got, time.perf_counter() - t0)
