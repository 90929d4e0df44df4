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
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from podtrain.ckpt.host_buffers import StagingPool, byte_array

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = _code
DTYPES: dict[str, torch.dtype] = {code: dtype for dtype, code in DTYPE_NAMES.items()}
_ELEMENT_SIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPE_NAMES}

# Hash and write in slices of this size so a huge tensor never needs a second buffer.
_CHUNK = 64 << 20


@dataclass(frozen=True)
class FileRecord:
    """What the manifest records about one written file."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class TensorSpec:
    """What a file's header needs to know of one tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return math.prod(self.shape) * _ELEMENT_SIZE[self.dtype]


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    """The ``TensorSpec`` of tensor ``t`` stored under ``name``."""
    return TensorSpec(name, t.dtype, tuple(t.shape))


def _header(specs: list[TensorSpec], metadata: dict[str, str] | None) -> bytes:
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


def write_safetensors_stream(path: Path, specs: list[TensorSpec], chunks: Iterable[memoryview],
                             metadata: dict[str, str] | None = None) -> FileRecord:
    """Write a safetensors file whose data arrives as ``chunks`` (the tensors' bytes in ``specs``
    order, cut anywhere), fsync it, return size and SHA-256.

    Each chunk is written and hashed before the next is asked for, so a producer may reuse its
    memory as soon as the iterator advances (``podtrain.ckpt.staging``).
    """
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("safetensors stores little-endian data; this host is big-endian")
    digest = hashlib.sha256()
    expected = sum(s.nbytes for s in specs)
    with open(path, "wb") as fh:
        head = _header(specs, metadata)
        fh.write(head)
        digest.update(head)
        data = 0
        for chunk in chunks:
            for start in range(0, len(chunk), _CHUNK):
                piece = chunk[start:start + _CHUNK]
                fh.write(piece)
                digest.update(piece)  # hashlib releases the GIL on large buffers
            data += len(chunk)
        if data != expected:
            raise RuntimeError(f"{path.name}: {data} bytes of tensor data arrived, the header promises {expected}")
        fh.flush()
        os.fsync(fh.fileno())
    return FileRecord(bytes=len(head) + data, sha256=digest.hexdigest())


def tensor_chunks(tensors: Iterable[torch.Tensor]) -> Iterator[memoryview]:
    """The bytes of contiguous CPU tensors, one memoryview each (no copy)."""
    for t in tensors:
        if t.numel():
            yield memoryview(byte_array(t)).cast("B")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> FileRecord:
    """Write ``tensors`` (contiguous CPU tensors) to ``path``, fsync it, return size and SHA-256."""
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"tensor {name!r} must be a contiguous CPU tensor (copy it to host first)")
    return write_safetensors_stream(path, [spec_of(n, t) for n, t in tensors.items()],
                                    tensor_chunks(tensors.values()), metadata)


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


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    spec: TensorSpec
    start: int
    """Absolute file offset of the first byte."""


class SafetensorsIndex:
    """A safetensors file's tensors and their byte ranges, read from its header alone.

    The official library validates the file first (header, dtypes, offsets inside the file); then
    the header's offsets let ``read_into`` copy any tensor's bytes straight to its destination,
    without materializing the file or the tensor a second time.
    """

    def __init__(self, path: Path) -> None:
        """Validate ``path`` with ``safetensors.safe_open`` and index its tensors."""
        from safetensors import safe_open

        self.path = Path(path)
        with safe_open(str(path), framework="pt") as f:  # raises on a malformed file
            self.metadata: dict[str, str] = f.metadata() or {}
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        self.tensors: dict[str, StoredTensor] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, _ = info["data_offsets"]
            spec = TensorSpec(name, DTYPES[info["dtype"]], tuple(info["shape"]))
            self.tensors[name] = StoredTensor(spec, 8 + length + begin)

    def read_into(self, name: str, dst: torch.Tensor, pool: StagingPool, stage: bool | None = None) -> None:
        """Fill ``dst`` (same number of elements; any device and dtype) with tensor ``name``.

        A contiguous CPU destination of the stored dtype is read into directly (no staging). Any
        other (a GPU, another dtype; or ``stage=True``) goes through ``pool`` slabs, element-
        aligned: read a slab, copy it to its slice of ``dst`` (asynchronously from pinned slabs on
        a GPU, an event per slab before it is reused), so host memory stays within the pool.
        """
        stored = self.tensors[name]
        spec = stored.spec
        if dst.numel() != math.prod(spec.shape):
            raise ValueError(f"{self.path.name}: {name} has shape {list(spec.shape)}, the destination "
                             f"{list(dst.shape)}")
        if spec.nbytes == 0:
            return
        direct = dst.device.type == "cpu" and dst.dtype == spec.dtype and dst.is_contiguous()
        with open(self.path, "rb", buffering=0) as fh:
            if direct and not stage:
                _read_exact(fh, stored.start, memoryview(byte_array(dst)).cast("B"))
                return
            target = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
            _read_staged(fh, stored, target.view(-1), pool)
            if target is not dst:
                dst.copy_(target)


def _read_exact(fh, offset: int, into: memoryview) -> None:
    fh.seek(offset)
    while len(into):
        n = fh.readinto(into)
        if not n:
            raise EOFError(f"{fh.name}: file ends before the tensor does")
        into = into[n:]


def _read_staged(fh, stored: StoredTensor, flat: torch.Tensor, pool: StagingPool) -> None:
    import collections

    element = _ELEMENT_SIZE[stored.spec.dtype]
    per_slab = pool.slab_bytes // element * element
    if per_slab == 0:
        raise ValueError(f"staging slabs of {pool.slab_bytes} bytes cannot hold one {stored.spec.dtype} element")
    in_flight: collections.deque = collections.deque()  # (slab, event) of copies still running
    try:
        for offset in range(0, stored.spec.nbytes, per_slab):
            size = min(per_slab, stored.spec.nbytes - offset)
            if len(in_flight) >= pool.max_slabs:
                slab, event = in_flight.popleft()
                event.synchronize()
                pool.release(slab)
            slab = pool.acquire()
            _read_exact(fh, stored.start + offset, memoryview(byte_array(slab[:size])).cast("B"))
            values = slab[:size].view(stored.spec.dtype)
            part = flat[offset // element:(offset + size) // element]
            if flat.device.type == "cuda":
                part.copy_(values, non_blocking=pool.pin)
                event = torch.cuda.Event()
                event.record()
                in_flight.append((slab, event))
            else:
                part.copy_(values)
                pool.release(slab)
    finally:
        while in_flight:
            slab, event = in_flight.popleft()
            event.synchronize()
            pool.release(slab)


def read_dcp_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Whole tensors from a folder of DCP safetensors shards (each file holds pieces of tensors,
    their offsets in its header, as ``HuggingFaceStorageWriter`` writes them), put together in
    this one process: no process group, safetensors only, nothing unpickled."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    metadata = HuggingFaceStorageReader(str(folder)).read_metadata()
    tensors = {name: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for name, md in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():  # DCP warns that it loads without a process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    return tensors
