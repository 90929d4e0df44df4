"""The only module that touches ``s3torchconnector``: its CRT clients, shared within a scope.

Sharing: each CRT client owns thread pools and connection pools, so the stores of a process share
one per endpoint, region and profile (``S3Clients``), not one per store, shard or file. The clients
belong to a scope, not to the module: ``shared_s3_clients()`` (entered by ``podtrain.cli.main``
and ``train()``) makes the stores opened inside its ``with`` block share its clients and closes them
when the block ends; a store opened outside any scope, or given no clients, owns its own.

Why the native stream for uploads, not the public ``S3Writer``: ``S3Writer.__exit__`` does not close
the upload when the block raised, but ``S3Writer`` is an ``io.BufferedIOBase``, whose finaliser calls
``close()``, and ``close()`` COMPLETES the multipart upload. So a writer dropped after an exception
publishes whatever it had written so far under the final key: a truncated checkpoint shard that looks
valid (measured on s3torchconnector 1.5.0: a 1000-byte object appears). The public API has no abort.
Dropping the native ``PutObjectStream`` without ``close()`` instead cancels the CRT meta request,
which sends AbortMultipartUpload from the CRT's event loop (measured: no upload is left, nothing is
visible; usually before the drop returns, on a loaded machine a moment after). ``Upload`` below
holds the only reference to that stream and drops it to abort.

Ranged reads also use the native ``get_object(bucket, key, start, end)`` (what ``RangedS3Reader``
calls inside), so a read fills the caller's buffer without a HEAD request or a second buffer.

Control files (a run's owner, its lease) go through botocore instead: s3torchconnector 1.5 cannot
send conditional headers (its native ``put_object`` takes a bucket, a key and a storage class, its
``delete_object`` a bucket and a key), and those files change only by compare-and-swap
(``If-None-Match: *`` to create, ``If-Match: ETag`` to replace or delete). ``S3Clients.control``
gives a botocore client for the same endpoint, region and profile as the CRT client; botocore
retries nothing itself (one attempt): the store's ``RetryPolicy`` owns the retries, so a retried
conditional write can be recognised as the caller's own (``S3Store.create_exclusive``).

Retries happen at two levels, and the inner one is kept short on purpose (``CRT_MAX_ATTEMPTS``).
The CRT retries each HTTP request itself (each part of an upload, each ranged GET) on 503
SlowDown/ServiceUnavailable, 500, RequestTimeout and dropped connections, with exponential backoff
(500 ms scale, 20 s cap, full jitter), but not on 502/504 or 403. Measured through a proxy that
answers 503 SlowDown (tests/s3_fault_proxy.py): with the connector's default of 10 attempts one
HEAD took 38 s to fail, and podtrain's 4 tries on top of it 155 s, during which nothing could stop
it. Its retries also draw from a token bucket shared by the whole client (500 tokens, 5 per retry,
1 back per success): after ~100 failed requests it stops retrying at all until successes refill
it. So the CRT gets 5 attempts, and podtrain's ``RetryPolicy`` owns the long wait, with a time
budget that the CRT's retries are counted in, and ``abandon()``. Why 5: the parts of a streamed
upload cannot be sent again by podtrain (their bytes are gone), so the CRT's retries are all a
part gets, and a failed part fails the upload: with 5% of requests throttled, a 10 GB piece (1250
parts) fails with 3 attempts 15% of the time, with 5 attempts 0.04%. And a stop signal waits for
a part's retries (at most ~7.5 s of backoff with 5 attempts; ~90 s with 10).
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from podtrain.storage import s3_config
from podtrain.storage.errors import StorageError

EXTRA_HINT = "needs the optional dependency s3torchconnector: pip install 'podtrain[s3]'"
CONTROL_HINT = "needs the optional dependency botocore (conditional writes of control files): pip install 'podtrain[s3]'"
CONTROL_CONNECT_S = 10.0
CONTROL_READ_S = 20.0
"""Timeouts of one control-file request (a few hundred bytes): a silent endpoint fails the try
within these, and the store's ``RetryPolicy`` decides whether to try again."""
WRITE_SLICE = 8 << 20
"""Bytes handed to the native stream per call: the stream takes only ``bytes`` (a copy), so large
buffers go in slices to bound the extra memory (and a stop is noticed between slices)."""
CRT_MAX_ATTEMPTS = 5
"""Tries of each HTTP request inside the CRT client (its default is 10: see the module doc)."""

_scope: ContextVar["S3Clients | None"] = ContextVar("podtrain_s3_clients", default=None)
"""The clients of the innermost ``shared_s3_clients()`` block of this thread's context (None:
outside any). A ContextVar, not a module global: set on entering the block, reset on leaving it."""


def _import(url: str):
    """The s3torchconnector pieces, or a one-line error naming the extra."""
    try:
        from s3torchconnector import S3ClientConfig, S3Exception
        from s3torchconnector._s3client import S3Client
    except ImportError:
        raise StorageError(url, EXTRA_HINT) from None
    return S3Client, S3ClientConfig, S3Exception


def s3_exception_type(url: str) -> type:
    """``s3torchconnector.S3Exception`` (what every failed request raises)."""
    return _import(url)[2]


class S3Clients:
    """CRT clients, one per endpoint, region and profile the environment names when one is asked
    for; ``close`` drops them (a store that still holds one keeps it alive until the store goes).

    Picklable as an empty pool: a DataLoader worker process makes its own clients (a CRT client
    does not survive a fork).
    """

    def __init__(self) -> None:
        self._clients: dict[tuple, object] = {}
        self._control: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def client(self, url: str):
        """The ``S3Client`` for the endpoint, region and profile the environment names now (made
        on first use; ``url`` names the culprit when the extra is missing). A custom endpoint
        (``AWS_ENDPOINT_URL[_S3]``) is addressed path-style."""
        S3Client, S3ClientConfig, _ = _import(url)
        endpoint, region, profile = s3_config.endpoint_url(), s3_config.region(), s3_config.profile()
        key = (endpoint, region, profile)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                config = S3ClientConfig(force_path_style=endpoint is not None, profile=profile,
                                        max_attempts=CRT_MAX_ATTEMPTS)
                client = self._clients[key] = S3Client(region, endpoint=endpoint, s3client_config=config)
            return client

    def has_control(self) -> bool:
        """Whether the botocore client ``control`` would return is made already (a run's lease and
        owner file make it at the start; making one costs ~0.5 s: botocore's import and model)."""
        key = (s3_config.endpoint_url(), s3_config.region(), s3_config.profile())
        with self._lock:
            return key in self._control

    def control(self, url: str):
        """The botocore S3 client for control files (conditional requests) at the endpoint, region
        and profile the environment names now, as ``client`` chooses them (a custom endpoint
        path-style); made on first use. One attempt per call: the store's ``RetryPolicy`` retries."""
        endpoint, region, profile = s3_config.endpoint_url(), s3_config.region(), s3_config.profile()
        key = (endpoint, region, profile)
        with self._lock:
            client = self._control.get(key)
            if client is None:
                try:
                    import botocore.session
                    from botocore.config import Config
                except ImportError:
                    raise StorageError(url, CONTROL_HINT) from None
                config = Config(
                    s3={"addressing_style": "path" if endpoint is not None else "auto"},
                    retries={"total_max_attempts": 1}, connect_timeout=CONTROL_CONNECT_S,
                    read_timeout=CONTROL_READ_S,
                    # a checksum only where S3 demands one: S3-compatible stores that predate the
                    # flexible checksums refuse requests that carry them by default
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
                session = botocore.session.Session(profile=profile)
                client = self._control[key] = session.create_client("s3", region_name=region, endpoint_url=endpoint,
                                                                    config=config)
            return client

    def close(self) -> None:
        """Release the pool's clients (the end of its scope, or of the store that owns it).

        Their native threads are joined now, as s3torchconnector's own fork handler does for live
        clients: a client merely dropped leaves threads shutting down that a fork soon after would
        copy mid-way (the forked child then hangs at its first request)."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            control, self._control = list(self._control.values()), {}
        for client in control:  # their connection pools (botocore threads nothing of its own)
            client.close()
        live = [c for c in clients if getattr(c, "_native_client", None) is not None]
        if live:
            from s3torchconnectorclient._mountpoint_s3_client import join_all_managed_threads

            for client in live:
                client._native_client = None
            del live, clients
            gc.collect()
            try:
                join_all_managed_threads(0.5)
            except RuntimeError:  # still shutting down after 0.5 s: as s3torchconnector's handler, go on
                pass

    def __del__(self) -> None:
        if getattr(self, "_clients", None) or getattr(self, "_control", None):
            try:
                self.close()
            except Exception:  # interpreter shutdown: modules are being torn down, nothing to join
                pass

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def active_clients() -> S3Clients | None:
    """The clients of the ``shared_s3_clients()`` block this code runs in, or None."""
    return _scope.get()


@contextmanager
def shared_s3_clients() -> Iterator[S3Clients]:
    """Within the block, stores opened without clients of their own share these (one per
    endpoint, region and profile); they are closed when the block ends. Inside another such block
    this one is that block's (the outermost owns them).

    A thread started inside the block does not see it (Python gives a new thread an empty
    context): what reads S3 in threads takes its clients when it is made (``BlockCache``)."""
    outer = _scope.get()
    if outer is not None:
        yield outer
        return
    clients = S3Clients()
    token = _scope.set(clients)
    try:
        yield clients
    finally:
        _scope.reset(token)
        clients.close()



def sharing_s3_clients(fn):
    """Run ``fn`` inside ``shared_s3_clients()``: for library entry points that open many S3
    stores (prepare, its tokenizer training, merge), so that a caller outside any scope does not
    make, and tear down, one CRT client per object."""
    import functools

    @functools.wraps(fn)
    def within_scope(*args, **kwargs):
        with shared_s3_clients():
            return fn(*args, **kwargs)
    return within_scope

def get_range(client, bucket: str, key: str, start: int, end: int) -> Iterator[bytes]:
    """The bytes ``[start, end)`` of an object as the chunks the CRT delivers (parallel ranged GETs)."""
    return iter(client._client.get_object(bucket, key, start, end))


class Listing:
    """A ListObjectsV2 listing read one page at a time, each page retryable on its own: ``next_page()``
    either returns the next page (None after the last) or raises and leaves the listing where it was,
    so calling it again asks for the same page (from the same continuation token) again."""

    def __init__(self, client, bucket: str, prefix: str, delimiter: str, max_keys: int):
        self._client, self._args = client, (bucket, prefix, delimiter, max_keys)
        self._token: str | None = None
        self.complete = False

    def next_page(self):
        """The next ``ListObjectResult``, or None when the listing is complete."""
        if self.complete:
            return None
        from s3torchconnectorclient._mountpoint_s3_client import ListObjectStream

        # A fresh stream from the last good state for every page: a stream whose request failed
        # is not reused (its internal state after the error is the connector's business).
        stream = ListObjectStream._from_state(self._client._client, *self._args, self._token, False)
        try:
            page = next(stream)
        except StopIteration:
            self.complete = True
            return None
        self._token, self.complete = stream.continuation_token, stream.complete
        return page


class Upload:
    """A streaming multipart upload that is either completed (``complete``) or aborted, never half-published."""

    def __init__(self, client, bucket: str, key: str):
        # put_object waits for CreateMultipartUpload, so a missing bucket or a denied key fails here
        self._stream = client._client.put_object(bucket, key)

    def write(self, view: memoryview) -> None:
        """Upload ``view``'s bytes (at most ``WRITE_SLICE`` of them: the native stream copies them)."""
        self._stream.write(bytes(view))

    def complete(self) -> None:
        """Send the last part and CompleteMultipartUpload: the object becomes visible, whole."""
        stream, self._stream = self._stream, None
        stream.close()

    def abort(self) -> None:
        """Drop the stream without completing it: the CRT aborts the multipart upload (see the module doc)."""
        self._stream = None
