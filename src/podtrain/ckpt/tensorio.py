"""A rank's piece file: safetensors written in one streaming pass that also checksums every block,
and verified reads of block spans.

The file is a valid safetensors file (``safetensors.safe_open`` reads it: each piece is a 1-D
tensor named ``<tensor>[<start>:<end>]``), but podtrain never parses its header on resume: the
manifest says where every piece lies and what its blocks' CRC-32s are, so a reader seeks straight
to the bytes it needs and checks them as they arrive (``read_verified``).

Format: 8-byte little-endian header length, a JSON header
``{"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}}``
padded with spaces to a multiple of 8, then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterable

import torch

from podtrain.ckpt.plan import BLOCK_BYTES

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",  # (all in torch >= 2.3; the floor is 2.8)
}
DTYPES: dict[str, torch.dtype] = {code: dtype for dtype, code in DTYPE_NAMES.items()}
ELEMENT_SIZE = {dtype: dtype.itemsize for dtype in DTYPE_NAMES}

# Write in slices of this size so a huge slab never needs a second buffer.
_CHUNK = 16 << 20


class CorruptCheckpoint(Exception):
    """Bytes read from a checkpoint do not match the manifest (size or CRC-32)."""


@dataclass(frozen=True)
class TensorSpec:
    """What a file's header needs to know of one stored (1-D) piece."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the piece's data."""
        return math.prod(self.shape) * ELEMENT_SIZE[self.dtype]


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    """The ``TensorSpec`` of tensor ``t`` stored under ``name``."""
    return TensorSpec(name, t.dtype, tuple(t.shape))


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header (length prefix included) of a file holding ``specs`` in order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {spec.name!r}: dtype {spec.dtype} cannot be stored in safetensors")
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class BlockHasher:
    """CRC-32 per ``block`` bytes of each piece of a byte stream cut anywhere into chunks."""

    def __init__(self, sizes: list[int], block: int = BLOCK_BYTES) -> None:
        """``sizes``: the pieces' byte sizes, in stream order."""
        self.sizes, self.block = sizes, block
        self.crcs: list[list[int]] = [[] for _ in sizes]
        self._piece, self._in_piece, self._crc = 0, 0, 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._piece < len(self.sizes) and self.sizes[self._piece] == 0:
            self.crcs[self._piece].append(zlib.crc32(b""))
            self._piece += 1

    def update(self, chunk: memoryview) -> None:
        """Feed the next bytes of the stream."""
        pos = 0
        while pos < len(chunk):
            if self._piece >= len(self.sizes):
                raise ValueError("more bytes than the pieces hold")
            in_block = self._in_piece % self.block
            take = min(len(chunk) - pos, self.block - in_block, self.sizes[self._piece] - self._in_piece)
            self._crc = zlib.crc32(chunk[pos:pos + take], self._crc)  # releases the GIL on large buffers
            pos += take
            self._in_piece += take
            if self._in_piece % self.block == 0 or self._in_piece == self.sizes[self._piece]:
                self.crcs[self._piece].append(self._crc)
                self._crc = 0
            if self._in_piece == self.sizes[self._piece]:
                self._piece, self._in_piece = self._piece + 1, 0
                self._skip_empty()


def write_pieces(fh: BinaryIO, specs: list[TensorSpec], chunks: Iterable[memoryview],
                 metadata: dict[str, str] | None = None) -> tuple[int, list[list[int]], int]:
    """Write a safetensors file whose data arrives as ``chunks`` (the pieces' bytes in ``specs``
    order, cut anywhere). Returns ``(header length, block CRCs of each piece, file bytes)``.

    Each chunk is written and hashed before the next is asked for, so a producer may reuse its
    memory as soon as the iterator advances (``podtrain.ckpt.staging``).
    """
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("safetensors stores little-endian data; this host is big-endian")
    from concurrent.futures import ThreadPoolExecutor

    head = header_bytes(specs, metadata)
    fh.write(head)
    hasher = BlockHasher([s.nbytes for s in specs])
    data = 0
    # The write (a system call) and the CRC (zlib) both release the GIL: each slice is written by a
    # helper thread while this one checksums it, so a save costs max(write, hash), not their sum.
    with ThreadPoolExecutor(1, thread_name_prefix="podtrain-ckpt-io") as io:
        for chunk in chunks:  # the chunk's memory is reused once the next one is asked for
            pending = io.submit(fh.write, chunk)
            for start in range(0, len(chunk), _CHUNK):
                hasher.update(chunk[start:start + _CHUNK])
            pending.result()
            data += len(chunk)
    expected = sum(s.nbytes for s in specs)
    if data != expected:
        raise RuntimeError(f"{data} bytes of tensor data arrived, the header promises {expected}")
    return len(head), hasher.crcs, len(head) + data


def encode_small(tensors: dict[str, torch.Tensor]) -> bytes:
    """A whole safetensors file of small contiguous CPU tensors (RNG states, scaler), in memory."""
    import io

    buf = io.BytesIO()
    specs = [spec_of(n, t) for n, t in tensors.items()]
    chunks = [memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B") for t in tensors.values() if t.numel()]
    write_pieces(buf, specs, chunks)
    return buf.getvalue()


def decode_small(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a small safetensors file (``encode_small``), parsed by the safetensors library."""
    from safetensors.torch import load

    return load(data)


def verify_blocks(data: memoryview, crcs: tuple[int, ...], first_block: int, where: str,
                  block: int = BLOCK_BYTES) -> None:
    """Raise ``CorruptCheckpoint`` unless ``data`` (blocks ``first_block``.. of a piece) matches."""
    for i in range(0, len(data), block):
        index = first_block + i // block
        if index >= len(crcs) or zlib.crc32(data[i:i + block]) != crcs[index]:
            raise CorruptCheckpoint(f"{where}: block {index} fails its CRC-32 check")
