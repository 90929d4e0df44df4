"""Each rank's own metadata of a checkpoint, and finding the few a resume needs (``podtrain-ckpt/3``).

Every rank writes, after its piece file, ``meta_00003.json`` (its *sidecar*): its file's size,
its pieces (range, offset, block CRC-32s: ``plan.Piece.to_json``) and its RNG states. The shared
files stay O(tensors) whatever the world size: the manifest says, per tensor, by which rule it was
cut (``statedict.split_rule``: FSDP's dim-0 shards on the recorded mesh and the replica group that
wrote them, or ``plan.split_even`` over the saved ranks), so a resuming rank computes from the
manifest alone which saved ranks hold the ranges it needs (``SavedSplit.holders``: at the same
world size and strategy, usually only its own) and reads only their sidecars.

Every sidecar names its save (``save_id``, as the manifest does): a resume reads only sidecars of
the save its manifest names (``check_save``). A sidecar checks itself: ``{"crc32": N, "body": {...}}`` where N is the CRC-32 of the body's bytes
exactly as written, so a damaged sidecar is a ``CorruptCheckpoint`` (the previous checkpoint is
then used), as strong as the manifest's record of the small files.
"""

from __future__ import annotations

import base64
import json
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable

from podtrain.ckpt.plan import Piece, shard_range, shards_overlapping, split_even
from podtrain.ckpt.state import from_plain, to_plain
from podtrain.ckpt.store import read_json
from podtrain.ckpt.tensorio import DTYPES, CorruptCheckpoint, decode_small, encode_small

_HEAD = re.compile(rb'^\{"crc32":(\d+),"body":')


def sidecar(rank: int) -> str:
    """The name of rank ``rank``'s sidecar in a step directory."""
    return f"meta_{rank:05d}.json"


def encode(file: str | None, nbytes: int, pieces: list, rng: dict[str, Any] | None,
           save_id: str | None = None) -> bytes:
    """A sidecar's bytes: this rank's piece file (name, bytes), its pieces (``Piece.to_json``
    without the file), its RNG states (JSON, their tensors as one small safetensors blob) and the
    id of the save that wrote it (the manifest names the same: ``index`` checks)."""
    small: dict = {}
    body = {"save_id": save_id, "file": file, "bytes": nbytes, "pieces": pieces,
            "rng": None if rng is None else to_plain(rng, small.__setitem__, "rng")}
    if small:
        body["rng_tensors"] = base64.b64encode(encode_small(small)).decode()
    text = json.dumps(body, separators=(",", ":")).encode()
    return b'{"crc32":%d,"body":%s}' % (zlib.crc32(text), text)


def decode(data: bytes, where: str) -> dict[str, Any]:
    """A sidecar's body; ``CorruptCheckpoint`` when it fails its own CRC-32 or is not one."""
    head = _HEAD.match(data)
    text = data[head.end():-1] if head and data.endswith(b"}") else b""
    if not head or zlib.crc32(text) != int(head.group(1)):
        raise CorruptCheckpoint(f"{where} fails its CRC-32 check (a damaged or foreign rank sidecar)")
    body = read_json(None, where, text, error=CorruptCheckpoint)
    if not isinstance(body.get("pieces"), list):
        raise CorruptCheckpoint(f"{where} holds no piece table")
    return body


def check_save(body: dict[str, Any], manifest: dict[str, Any], where: str) -> None:
    """A sidecar of another save than the manifest's (a step saved again: a rollback, a stale
    replica) is as good as missing: ``CorruptCheckpoint``, so the resume falls back rather than
    combine two saves' pieces (CRCs alone cannot tell: each save's blocks check against its own
    sidecar). Checkpoints written before save ids existed name none and are not checked."""
    expected = manifest.get("save_id")
    if expected and body.get("save_id") != expected:
        raise CorruptCheckpoint(f"{where} belongs to save {body.get('save_id')}, not to save {expected} "
                                "that the manifest names (a step saved twice)")


def rng_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """The RNG states a sidecar holds, decoded (tensors back as tensors)."""
    if body.get("rng") is None:
        return None
    tensors = decode_small(base64.b64decode(body["rng_tensors"])) if body.get("rng_tensors") else {}
    return from_plain(body["rng"], tensors)


def pieces_of(body: dict[str, Any], tensors: set[str] | None = None) -> Iterable[Piece]:
    """The pieces of a sidecar (only those of ``tensors`` when given)."""
    file = body.get("file")
    for item in body["pieces"]:
        if tensors is None or item[0] in tensors:
            yield Piece.from_json(file, item)


def is_sidecar_format(manifest: dict[str, Any]) -> bool:
    """Whether a manifest keeps its pieces in the ranks' sidecars (else inline, ``podtrain-ckpt/2``)."""
    return "ranks" in manifest


class SavedSplit:
    """Which saved ranks hold which elements of each tensor, from the manifest's rules alone."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        """Index the manifest's tensors (``split_even`` over the saved ranks, once)."""
        self.world = int(manifest["world_size"])
        self.tensors = manifest["tensors"]
        mesh = manifest.get("mesh") or {}
        self.mesh_shape: list[int] = list(mesh.get("shape") or [])
        self.mesh_ranks: list[int] | None = mesh.get("ranks")
        items = [(n, math.prod(info["shape"]), DTYPES[info["dtype"]].itemsize)
                 for n, info in self.tensors.items() if info.get("rule", "even") == "even"]
        self.even: dict[str, list[tuple[int, int, int]]] = {}
        for rank, ranges in enumerate(split_even(items, self.world)):
            for name, start, count in ranges:
                self.even.setdefault(name, []).append((rank, start, count))

    def holders(self, tname: str, start: int, count: int) -> set[int]:
        """The saved ranks whose files hold any of elements ``[start, start + count)`` of ``tname``."""
        info = self.tensors[tname]
        if info.get("rule", "even") == "even":
            return {r for r, s, c in self.even.get(tname, []) if s < start + count and start < s + c}
        coords, shard_dim = self._writers(info)
        if shard_dim is None:
            return {self._rank(coords)}
        out = set()
        for index in shards_overlapping(info["shape"], self.mesh_shape[shard_dim], start, count):
            coords[shard_dim] = index
            out.add(self._rank(coords))
        return out

    def ranges_of(self, rank: int) -> list[tuple[str, int, int]]:
        """The ``(tensor, start, count)`` ranges saved rank ``rank`` wrote: what a rank of a resume
        at the saved world size and strategy reads (a bench can time ``index`` over them)."""
        out = [(name, s, c) for name, held in self.even.items() for r, s, c in held if r == rank]
        flat = self.mesh_ranks.index(rank) if self.mesh_ranks else rank
        coords = []
        for size in reversed(self.mesh_shape):
            flat, c = divmod(flat, size)
            coords.insert(0, c)
        for name, info in self.tensors.items():
            if info.get("rule", "even") == "even":
                continue
            want, shard_dim = self._writers(info)
            if any(coords[d] != want[d] for d, kind in enumerate(info["rule"]) if kind == "R"):
                continue
            start, count = (shard_range(info["shape"], coords[shard_dim], self.mesh_shape[shard_dim])
                            if shard_dim is not None else (0, math.prod(info["shape"])))
            if count:
                out.append((name, start, count))
        return out

    def _writers(self, info: dict[str, Any]) -> tuple[list[int], int | None]:
        """The mesh coordinates of the ranks that wrote a sharded tensor (``info``: its manifest
        entry) along its replicate dimensions (the replica group that wrote it along the first, 0
        along any other), and its shard dimension (None: not sharded; its coordinate is left 0)."""
        coords, shard_dim, first_replicate = [0] * len(info["rule"]), None, True
        for dim, kind in enumerate(info["rule"]):
            if kind == "R":
                coords[dim] = int(info.get("replica", 0)) % self.mesh_shape[dim] if first_replicate else 0
                first_replicate = False
            else:
                shard_dim = dim
        return coords, shard_dim

    def _rank(self, coords: list[int]) -> int:
        flat = 0
        for c, size in zip(coords, self.mesh_shape):
            flat = flat * size + c
        return self.mesh_ranks[flat] if self.mesh_ranks else flat


@dataclass
class SidecarIndex:
    """What a resuming rank took from the sidecars it read."""

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    """Its own saved rank's RNG states (None when the world size changed)."""
    ranks_read: list[int] = field(default_factory=list)
    bytes_parsed: int = 0


def index(store, name: str, manifest: dict[str, Any], wanted: Iterable[tuple[str, int, int]],
          rank: int, world: int) -> SidecarIndex:
    """Read the sidecars of the saved ranks holding the ``(tensor, start, count)`` ranges
    ``wanted`` (and, at the saved world size, this rank's own, for its RNG states) and keep the
    pieces of the wanted tensors."""
    split = SavedSplit(manifest)
    wanted = list(wanted)
    ranks: set[int] = set()
    for tname, start, count in wanted:
        ranks |= split.holders(tname, start, count)
    same_world = world == split.world
    if same_world:
        ranks.add(rank)
    return read_sidecars(store, name, manifest, sorted(ranks), {t for t, _, _ in wanted},
                         rank if same_world else None)


def read_sidecars(store, name: str, manifest: dict[str, Any], ranks: Iterable[int],
                  tensors: set[str] | None = None, rng_rank: int | None = None) -> SidecarIndex:
    """The pieces (of ``tensors`` when given) that saved ranks ``ranks``' sidecars hold, by tensor
    and in element order, each sidecar checked (its CRC-32, its save: ``check_save``); and saved rank
    ``rng_rank``'s RNG states. ``index`` reads a resuming rank's few; tools read every rank's."""
    out = SidecarIndex(ranks_read=list(ranks))
    for saved in out.ranks_read:
        where = f"{store.url}/{name}/{sidecar(saved)}"
        data = store.read_bytes(f"{name}/{sidecar(saved)}")
        out.bytes_parsed += len(data)
        body = decode(data, where)
        check_save(body, manifest, where)
        for piece in pieces_of(body, tensors):
            out.pieces.setdefault(piece.tensor, []).append(piece)
        if saved == rng_rank:
            out.rng = rng_of(body)
    for pieces in out.pieces.values():
        pieces.sort(key=lambda p: p.start)
    return out
