"""Byte views of the buffers callers hand the stores: bytes, bytearray, memoryview, numpy arrays, and
CPU torch tensors (which have no buffer protocol of their own), without copying them."""

from __future__ import annotations


def _exporter(obj):
    """``obj``, or the numpy view of a CPU torch tensor (shares its memory)."""
    if type(obj).__module__.startswith("torch") and hasattr(obj, "numpy"):
        if not obj.is_contiguous():
            raise ValueError("a storage buffer tensor must be contiguous")
        return obj.detach().numpy()
    return obj


def byte_view(data) -> memoryview:
    """A flat unsigned-byte view of ``data`` (any contiguous buffer)."""
    view = memoryview(_exporter(data))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def writable_view(buf) -> memoryview:
    """A flat unsigned-byte view of the writable buffer ``buf``; a read-only one is a ``TypeError``."""
    view = byte_view(buf)
    if view.readonly:
        raise TypeError(f"read_into needs a writable buffer, not a read-only {type(buf).__name__}")
    return view
