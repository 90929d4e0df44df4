"""One way to read, list and atomically commit files on a POSIX path or under ``s3://bucket/prefix``.

    store = open_store("/fsx/run/ckpt")       # or "s3://bucket/prefix"
    with store.open_write("step_10/rank_0.safetensors") as f:
        f.write(data)                          # visible only once the block exits cleanly
    store.read_into("step_10/rank_0.safetensors", offset, buf)

S3 goes through ``s3torchconnector`` (the pip extra ``s3``); ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` select an S3-compatible endpoint (path-style addressing). Transient failures
(throttling, 5xx, resets, timeouts) are retried under the store's ``RetryPolicy`` (``store.retry``,
``podtrain.storage.retry``). Every failure is a one-line ``StorageError`` (a ``UserError``: exit 2)
naming the url and the cause; one still transient after the retries is a ``Transient`` (exit 203,
``errors.STORAGE_OUTAGE_EXIT_CODE``: schedulers retry it). The stores opened in one
``shared_s3_clients()`` block share its CRT clients (``podtrain.storage.s3_client``).
"""

from __future__ import annotations

from podtrain.storage.base import Entry, Store, Writer
from podtrain.storage.errors import (AccessDenied, NoSpace, NoSuchBucket, NotFound, ReadOnly, StorageError,
                                     Transient)
from podtrain.storage.retry import RetryPolicy
from podtrain.storage.s3_client import S3Clients, shared_s3_clients

__all__ = ["open_store", "is_s3_url", "Store", "Writer", "Entry", "StorageError", "NotFound", "AccessDenied",
           "NoSuchBucket", "NoSpace", "ReadOnly", "Transient", "RetryPolicy", "S3Clients", "shared_s3_clients"]


def is_s3_url(url) -> bool:
    """Whether ``url`` names an S3 location (``s3://...``)."""
    return str(url).startswith("s3://")


def open_store(url, retry: RetryPolicy | None = None, clients: "S3Clients | None" = None) -> Store:
    """The ``Store`` rooted at ``url``: a POSIX path (str or Path) or ``s3://bucket[/prefix]``.

    ``retry``: how it retries transient failures (``store.retry``); None gives it a new default
    ``RetryPolicy`` of its own. Pass one policy to several stores to stop them all with one
    ``abandon()``. ``clients`` (S3 only): the CRT clients it shares (``S3Clients``); None: those of
    the enclosing ``shared_s3_clients()`` block, else its own. Opening touches nothing (no request,
    no directory created): the first operation does.
    """
    if is_s3_url(url):
        from podtrain.storage.s3 import S3Store

        return S3Store(str(url), retry, clients)
    if "://" in str(url):
        raise StorageError(str(url), "unsupported url scheme (a POSIX path or s3://bucket/prefix)")
    from podtrain.storage.posix import PosixStore

    return PosixStore(str(url), retry)
