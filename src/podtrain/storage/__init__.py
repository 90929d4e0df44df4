"""One way to read, list and atomically commit files on a POSIX path or under ``s3://bucket/prefix``.

    store = open_store("/fsx/run/ckpt")       # or "s3://bucket/prefix"
    with store.open_write("step_10/rank_0.safetensors") as f:
        f.write(data)                          # visible only once the block exits cleanly
    store.read_into("step_10/rank_0.safetensors", offset, buf)

S3 goes through ``s3torchconnector`` (the pip extra ``s3``); ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` select an S3-compatible endpoint (path-style addressing). Every failure is a
one-line ``StorageError`` (a ``UserError``: exit 2) naming the url and the cause.
"""

from __future__ import annotations

from podtrain.storage.base import Entry, Store, Writer
from podtrain.storage.errors import (AccessDenied, NoSpace, NoSuchBucket, NotFound, ReadOnly, StorageError,
                                     Transient)

__all__ = ["open_store", "is_s3_url", "Store", "Writer", "Entry", "StorageError", "NotFound", "AccessDenied",
           "NoSuchBucket", "NoSpace", "ReadOnly", "Transient"]


def is_s3_url(url) -> bool:
    """Whether ``url`` names an S3 location (``s3://...``)."""
    return str(url).startswith("s3://")


def open_store(url) -> Store:
    """The ``Store`` rooted at ``url``: a POSIX path (str or Path) or ``s3://bucket[/prefix]``.

    Opening touches nothing (no request, no directory created): the first operation does.
    """
    if is_s3_url(url):
        from podtrain.storage.s3 import S3Store

        return S3Store(str(url))
    if "://" in str(url):
        raise StorageError(str(url), "unsupported url scheme (a POSIX path or s3://bucket/prefix)")
    from podtrain.storage.posix import PosixStore

    return PosixStore(str(url))
