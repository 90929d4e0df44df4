"""Safetensors files written in one streaming pass that also computes the file's SHA-256.

``safetensors.torch.save_file`` first turns every tensor into a Python ``bytes`` object (one extra
copy of the whole checkpoint) and the manifest would then need a second read of the file to hash
it. Writing the (simple, documented) format ourselves streams each host tensor's memory straight
to the file and into the hash, so a save costs one pass over the data. Reading goes through the
official ``safetensors`` library, which validates the header and the offsets.

Format: 8-byte little-endian header length, a JSON header
``{"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}}``
padded with spaces to a multiple of 8, then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from podtrain.ckpt.host_buffers import byte_array

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = _code

# Hash and write in slices of this size so a huge tensor never needs a second buffer.
_CHUNK = 64 << 20


@dataclass(frozen=True)
class FileRecord:
    """What the manifest records about one written file."""

    bytes: int
    sha256: str


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> FileRecord:
    """Write ``tensors`` (contiguous CPU tensors) to ``path``, fsync it, return size and SHA-256."""
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("safetensors stores little-endian data; this host is big-endian")
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"tensor {name!r} must be a contiguous CPU tensor (copy it to host first)")
    digest = hashlib.sha256()
    total = 0
    with open(path, "wb") as fh:
        head = _header(tensors, metadata)
        fh.write(head)
        digest.update(head)
        total += len(head)
        for t in tensors.values():
            if t.numel() == 0:
                continue
            data = memoryview(byte_array(t)).cast("B")  # no copy
            for start in range(0, len(data), _CHUNK):
                piece = data[start:start + _CHUNK]
                fh.write(piece)
                digest.update(piece)  # hashlib releases the GIL on large buffers
            total += len(data)
        fh.flush()
        os.fsync(fh.fileno())
    return FileRecord(bytes=total, sha256=digest.hexdigest())


def write_json(path: Path, obj: object) -> FileRecord:
    """Write ``obj`` as JSON to ``path``, fsync it, return size and SHA-256."""
    data = json.dumps(obj, indent=1, sort_keys=False).encode("utf-8")
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return FileRecord(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, on the CPU (the library validates header and offsets)."""
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")
