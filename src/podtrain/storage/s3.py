"""The S3 backend: ``s3://bucket/prefix`` through ``s3torchconnector`` (AWS's CRT-based S3 client).

Writes stream into a multipart upload that is completed when the writer commits and aborted on an
exception or when a writer is dropped, so a partial object is never visible (a process killed with
SIGKILL, or an upload cut by an outage that also fails its abort, leaves an incomplete upload:
invisible, but billed until a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` removes it).
Reads are ranged GETs straight into the caller's buffer. Every request is retried on transient
failures (throttling, 5xx, dropped connections, timeouts) under the store's ``RetryPolicy``
(``podtrain.storage.retry``), on top of the CRT's own short per-request retries
(``s3_client.CRT_MAX_ATTEMPTS``): HEAD, DELETE, every LIST page, every ranged GET (resumed where
it stopped), and uploads as a whole (``write_replayable``: the CRT retries each part; a part that
still fails fails the upload, which is then aborted and sent again from the start). Every failure
becomes a one-line ``StorageError`` naming the object's url and the cause; credentials never
appear in it.
"""

from __future__ import annotations

import re
from typing import Callable, TypeVar

from podtrain.storage import s3_client, s3_config
from podtrain.storage.base import Entry, Store, Writer
from podtrain.storage.buffers import byte_view, writable_view
from podtrain.storage.errors import AccessDenied, NoSuchBucket, NotFound, StorageError, Transient
from podtrain.storage.retry import RetryPolicy
from podtrain.storage.s3_config import parse_s3_url

T = TypeVar("T")
DELETE_BATCH_KEYS = 1000
"""Keys per DeleteObjects request (S3's maximum): deleting a checkpoint of N ranks takes
ceil((2N + 5) / 1000) requests, not one DELETE per object."""
LIST_PAGE_KEYS = 1000
"""Keys per ListObjectsV2 page (S3's maximum); each page is retried on its own."""
SINGLE_PUT_BYTES = 8 << 20
"""``write_bytes`` of at most this many bytes is one PutObject (one request), larger a multipart upload."""

_CODE = re.compile(r"<Code>([^<]+)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]+)</Message>")
_STATUS = re.compile(r"response_status:\s*(\d+)")
_CRT_ERROR = re.compile(r"\b(AWS_(?:ERROR|IO)_[A-Z0-9_]+)")
_TRANSIENT_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed", "TooManyRequests"}
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}
# What s3torchconnector 1.5 says for each transient failure, observed through tests/s3_fault_proxy.py:
# 503 SlowDown or ServiceUnavailable: "Client error: Request throttled" (no status, no body); 500:
# "Unknown CRT error: ... AWS_ERROR_S3_INTERNAL_ERROR, Response code indicates internal server
# error"; RequestTimeout: "... AWS_ERROR_S3_REQUEST_TIMEOUT ..."; a reset connection: "...
# AWS_IO_SOCKET_CLOSED, socket is closed."; 502/504: "MetaRequestResult { response_status: 502 ...".
_TRANSIENT_CRT = ("AWS_ERROR_S3_INTERNAL_ERROR", "AWS_ERROR_S3_SLOW_DOWN", "AWS_ERROR_S3_REQUEST_TIMEOUT",
                  "AWS_IO_SOCKET_", "AWS_ERROR_HTTP_CONNECTION_CLOSED", "AWS_ERROR_HTTP_SERVER_CLOSED",
                  "AWS_ERROR_HTTP_RESPONSE_FIRST_BYTE_TIMEOUT", "AWS_IO_RETRY_PERMISSION_DENIED")
_TRANSIENT_WORDS = ("throttl", "timeout", "timed out", "connection", "socket", "broken pipe", "reset by peer",
                    "service unavailable", "slow down", "internal error", "internal server error")


def classify(url: str, message: str) -> StorageError:
    """The ``StorageError`` for an ``S3Exception`` message at ``url``: one line, the S3 error code and
    message instead of the CRT's dump of headers and XML; ``Transient`` for what is worth retrying."""
    code = (_CODE.search(message) or [None, ""])[1]
    text = (_MESSAGE.search(message) or [None, ""])[1]
    status = int((_STATUS.search(message) or [None, "0"])[1])
    crt = (_CRT_ERROR.search(message) or [None, ""])[1]
    if code or status:
        cause = f"{code or 'HTTP ' + str(status)}: {text or 'S3 request failed'}" + (f" (HTTP {status})" if status else "")
    else:
        cause = message.split(": ", 1)[1] if message.startswith(("Service error: ", "Client error: ")) else message
        cause = cause.removeprefix("Unknown CRT error: ")
    return _classified(url, code, status, crt, message.lower(), cause)


def _classified(url: str, code: str, status: int, crt: str, low: str, cause: str) -> StorageError:
    """The ``StorageError`` for an S3 error code, HTTP status, CRT error name and message text
    (lower-cased), whichever client reported them; ``cause`` is its one-line description."""
    if code == "NoSuchBucket" or "bucket does not exist" in low:
        return NoSuchBucket(url, "no such bucket" + (f" ({cause})" if code else ""))
    if code in ("NoSuchKey", "NotFound") or "key does not exist" in low or "object was not found" in low:
        return NotFound(url, "not found")
    if code == "InvalidRange" or status == 416:
        return StorageError(url, f"short read: the requested range is past the end of the object ({cause})")
    if "no signing credentials" in low or "credentials" in low and "provider" in low:
        return AccessDenied(url, "no AWS credentials found (environment, AWS_PROFILE, IRSA/EKS Pod Identity, "
                                 "instance role)")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken") or status == 403 \
            or "forbidden" in low:
        return AccessDenied(url, f"access denied ({cause})")
    if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS or crt.startswith(_TRANSIENT_CRT) \
            or any(w in low for w in _TRANSIENT_WORDS):
        return Transient(url, cause)
    return StorageError(url, cause)


def classify_botocore(url: str, exc: Exception) -> StorageError | None:
    """The ``StorageError`` for a botocore failure at ``url`` (the control files' client), by the
    same rules as ``classify``; None for what is not a storage failure (a bug: re-raised as is)."""
    try:
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConnectionError,
                                         HTTPClientError, NoCredentialsError, PartialCredentialsError)
    except ImportError:
        return None
    if isinstance(exc, ClientError):
        error, meta = exc.response.get("Error", {}), exc.response.get("ResponseMetadata", {})
        code, text = str(error.get("Code", "")), str(error.get("Message", ""))
        status = int(meta.get("HTTPStatusCode") or 0)
        if code.isdigit():  # a HEAD-like answer without a body: botocore names the status as the code
            code = {"404": "NotFound"}.get(code, "")
        cause = f"{code or 'HTTP ' + str(status)}: {text or 'S3 request failed'}" + (f" (HTTP {status})" if status else "")
        return _classified(url, code, status, "", f"{code} {text}".lower(), cause)
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return _classified(url, "", 0, "", "no signing credentials", str(exc))
    if isinstance(exc, (BotoConnectionError, HTTPClientError)):  # refused, reset, timed out, cut mid-body
        return Transient(url, str(exc))
    if isinstance(exc, BotoCoreError):
        return StorageError(url, str(exc))
    if isinstance(exc, OSError):  # a socket error while the body streams
        return Transient(url, str(exc) or type(exc).__name__)
    return None


_LOST = object()
"""A conditional request refused because the object is not as the caller saw it (412, or gone)."""
_CONFLICT_CODES = ("ConditionalRequestConflict",)
"""409: another conditional write of the object is in flight; S3 says to try again (then one of
them has won, and the answer is a success or a 412)."""


class S3ObjectWriter(Writer):
    """Streams into a multipart upload; ``commit`` completes it, ``abort`` (or an exception) aborts it.

    Not retried by itself: the CRT retries each part (``s3_client.CRT_MAX_ATTEMPTS``), and a part
    that still fails fails the upload, which the CRT aborts (S3 keeps nothing of it to read back or
    complete). ``Store.write_replayable`` then sends the whole object again from its first byte (a
    checkpoint's piece file: ``CheckpointWriter._write_own``, its bytes from ``SaveStream``).
    ``store.retry.abandon()`` stops it at the next slice of ``s3_client.WRITE_SLICE`` bytes.
    """

    def __init__(self, store: "S3Store", name: str):
        self.name, self._store, self._url = name, store, store.where(name)
        self._upload = None
        self.error: StorageError | None = None
        """Why this upload failed (None: it did not), for a caller that cannot send it again."""
        key = store.loc.key(name)
        self._upload = store.call(self._url, lambda: s3_client.Upload(store.client, store.loc.bucket, key))
        self._written = 0

    def write(self, data) -> int:
        """Append ``data`` (any bytes-like object); returns its length."""
        if self._upload is None:
            raise ValueError(f"{self._url}: write to a closed writer")
        view = byte_view(data)
        try:
            for i in range(0, len(view), s3_client.WRITE_SLICE):
                self._store.retry.check(self._url)
                self._upload.write(view[i:i + s3_client.WRITE_SLICE])
        except self._store.s3_exception as exc:
            self.abort()
            self.error = self._failure(str(exc))
            raise self.error from None
        except Transient as exc:
            self.abort()
            self.error = exc
            raise
        self._written += len(view)
        return len(view)

    def tell(self) -> int:
        """Bytes written so far."""
        return self._written

    def commit(self) -> None:
        """Complete the multipart upload: the object appears whole, or (on failure) not at all."""
        if self._upload is None:
            raise ValueError(f"{self._url}: commit of a closed writer")
        upload, self._upload = self._upload, None
        try:
            upload.complete()
        except self._store.s3_exception as exc:
            self.error = self._failure(str(exc))
            raise self.error from None

    def _failure(self, message: str) -> StorageError:
        """The ``StorageError`` of a failed write or commit. A part that failed all of the CRT's
        attempts ends the upload, and the CRT then answers the next write (or the completion) with
        "request has already completed" instead of the part's error: the upload failed before we
        ended it, which is worth sending again (transient), not a user's mistake to stop the run for."""
        if "AWS_ERROR_S3_REQUEST_HAS_COMPLETED" in message:
            return Transient(self._url, "the upload failed: a part was refused past the S3 client's retries")
        return classify(self._url, message)

    def abort(self) -> None:
        """Abort the multipart upload; nothing becomes visible."""
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.abort()


class S3Store(Store):
    """A ``Store`` under ``s3://bucket/prefix``."""

    is_local = False

    def __init__(self, url: str, retry: RetryPolicy | None = None, clients: s3_client.S3Clients | None = None):
        self.url = url
        self.loc = parse_s3_url(url)
        self.retry = retry if retry is not None else RetryPolicy()
        # Whose CRT client: the caller's, else the enclosing shared_s3_clients() block's, else its own.
        if clients is None:
            clients = s3_client.active_clients()
        self.clients = clients if clients is not None else s3_client.S3Clients()
        self._client = None
        self.s3_exception = s3_client.s3_exception_type(url)  # fails now, in one line, without the extra
        self._bucket_checked = False

    @property
    def client(self):
        """The CRT client of ``self.clients`` (taken on first use)."""
        if self._client is None:
            self._client = self.clients.client(self.url)
        return self._client

    def call(self, url: str, op: Callable[[], T]) -> T:
        """``op()`` under the store's retry policy, with one-line errors naming ``url``."""
        return self.retry.run(url, op, self._classify(url))

    def _classify(self, url: str) -> Callable[[Exception], StorageError | None]:
        return lambda exc: classify(url, str(exc)) if isinstance(exc, self.s3_exception) else None

    # control files: compare-and-swap with conditional requests (see ``Store``) -----------------
    def _conditional(self, name: str, request: Callable[[object], object], data=None):
        """``request(client)`` (a botocore call) under the retry policy: its answer, or ``_LOST``
        when S3 refused its precondition (412 PreconditionFailed; 404: the object is gone). A 409
        ConditionalRequestConflict is tried again. After a retry, a refusal may be this writer's
        own earlier try that landed unseen: with ``data``, the object holding exactly it counts
        as this writer's (its ETag is returned instead of ``_LOST``)."""
        url = self.where(name)
        tries = 0

        def once():
            nonlocal tries
            tries += 1
            try:
                return request(self.clients.control(url))
            except Exception as exc:  # noqa: BLE001 - sorted out below, the rest re-raised
                answer = getattr(exc, "response", None)  # a botocore ClientError's parsed answer
                if not isinstance(answer, dict):
                    raise
                code = str(answer.get("Error", {}).get("Code", ""))
                status = int(answer.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                if code == "PreconditionFailed" or status == 412 or code in ("NoSuchKey", "NotFound"):
                    return _LOST
                if code in _CONFLICT_CODES or status == 409:
                    raise Transient(url, f"{code or 'HTTP 409'}: another conditional write of it is in flight") from None
                if code == "NotImplemented" or status == 501:
                    raise self._unsupported(url, code or "HTTP 501") from None
                raise

        answer = self.retry.run(url, once, lambda exc: classify_botocore(url, exc))
        if answer is _LOST and tries > 1 and data is not None:
            try:
                held, tag = self.read_versioned(name)
            except NotFound:
                return _LOST
            if held == bytes(byte_view(data)):
                return {"ETag": tag}
        return answer

    @staticmethod
    def _unsupported(url: str, code: str) -> StorageError:
        endpoint = s3_config.endpoint_url() or "AWS S3"
        return StorageError(url, f"the S3 endpoint {endpoint} does not support conditional writes ({code} to "
                                 "If-None-Match/If-Match), which podtrain's owner and lease files need: use a "
                                 "bucket that supports them (AWS S3, or an S3-compatible store with conditional "
                                 "writes), or put run.dir and ckpt.dir on a file system")

    def read_versioned(self, name: str) -> tuple[bytes, str]:
        """The object and its ETag from one GET (so the two belong together)."""
        key, url = self.loc.key(self.check_name(name)), self.where(name)

        def get():
            answer = self.clients.control(url).get_object(Bucket=self.loc.bucket, Key=key)
            with answer["Body"] as body:
                return body.read(), answer["ETag"]

        # a GET (unlike a HEAD) names a missing bucket itself (NoSuchBucket): no listing needed
        return self.retry.run(url, get, lambda exc: classify_botocore(url, exc))

    def create_exclusive(self, name: str, data) -> str | None:
        """PutObject with ``If-None-Match: *``: S3 creates it only if no object has the key."""
        key, body = self.loc.key(self.check_name(name)), bytes(byte_view(data))
        answer = self._conditional(name, lambda c: c.put_object(Bucket=self.loc.bucket, Key=key, Body=body,
                                                                 IfNoneMatch="*"), body)
        return None if answer is _LOST else answer["ETag"]

    def replace_if(self, name: str, data, tag: str) -> str | None:
        """PutObject with ``If-Match: tag``: S3 replaces it only if its ETag is still ``tag``."""
        key, body = self.loc.key(self.check_name(name)), bytes(byte_view(data))
        answer = self._conditional(name, lambda c: c.put_object(Bucket=self.loc.bucket, Key=key, Body=body,
                                                                 IfMatch=tag), body)
        return None if answer is _LOST else answer["ETag"]

    def delete_if(self, name: str, tag: str) -> bool:
        """DeleteObject with ``If-Match: tag``: S3 deletes it only if its ETag is still ``tag``."""
        key = self.loc.key(self.check_name(name))
        try:
            answer = self._conditional(name, lambda c: c.delete_object(Bucket=self.loc.bucket, Key=key, IfMatch=tag))
        except NotFound:
            return True
        if answer is not _LOST:
            return True
        try:  # 412: another version stands; 404: it is gone already
            self.read_versioned(name)
        except NotFound:
            return True
        return False

    def _not_found(self, name: str, err: NotFound) -> NotFound:
        """``err``, or ``NoSuchBucket`` when the bucket itself is missing (HEAD cannot tell them apart)."""
        if not self._bucket_checked:
            listing = s3_client.Listing(self.client, self.loc.bucket, self.loc.prefix, "/", 1)
            self.call(self.url, listing.next_page)
            self._bucket_checked = True
        return err

    def stat(self, name: str) -> Entry:
        """Size and ETag of ``name`` (a HEAD request)."""
        key = self.loc.key(self.check_name(name))
        try:
            head = self.call(self.where(name), lambda: self.client.head_object(self.loc.bucket, key))
            return Entry(name, head.size, head.etag)
        except NotFound as err:
            raise self._not_found(name, err) from None

    def read_into(self, name: str, offset: int, buf) -> None:
        """Fill ``buf`` from ``offset`` with ranged GETs; a transient failure resumes where it stopped."""
        view = writable_view(buf)
        key, url = self.loc.key(self.check_name(name)), self.where(name)
        got = 0

        def fetch() -> None:
            nonlocal got
            start = offset + got
            for chunk in s3_client.get_range(self.client, self.loc.bucket, key, start, offset + len(view)):
                n = min(len(chunk), len(view) - got)
                view[got:got + n] = chunk[:n]
                got += n

        if len(view):
            try:
                self.call(url, fetch)
            except NotFound as err:
                raise self._not_found(name, err) from None
        if got != len(view):
            raise StorageError(url, f"short read: wanted {len(view)} bytes at offset {offset}, "
                                    f"the object ends after {offset + got}")

    def read_bytes(self, name: str) -> bytes:
        """The whole of ``name`` in one GET, without a HEAD for its size first (a restore reads a
        checkpoint's manifest, state and sidecars one after another: half the round trips); a
        transient failure reads it again whole."""
        key, url = self.loc.key(self.check_name(name)), self.where(name)
        try:
            return self.call(url, lambda: b"".join(self.client._client.get_object(self.loc.bucket, key)))
        except NotFound as err:
            raise self._not_found(name, err) from None

    def open_write(self, name: str) -> S3ObjectWriter:
        """A writer streaming into a multipart upload of ``name``."""
        return S3ObjectWriter(self, self.check_name(name))

    def write_bytes(self, name: str, data) -> None:
        """Write ``data`` to ``name`` atomically. Up to ``SINGLE_PUT_BYTES``, once the clients'
        botocore client is made (a training run's lease made it): one PutObject, which S3 makes
        visible whole or not at all as it does a completed multipart upload, in one request instead
        of three (create, part, complete), each a round trip a save waits for in turn: a
        checkpoint's sidecars, small state, config, manifest and ``latest``. Otherwise a multipart
        upload through the CRT (``Store.write_bytes``: no botocore client made for one small
        write). Either is sent again whole after a transient failure."""
        view = byte_view(data)
        if len(view) > SINGLE_PUT_BYTES or not self.clients.has_control():
            return super().write_bytes(name, view)
        key, url, body = self.loc.key(self.check_name(name)), self.where(name), bytes(view)
        self.retry.run(url, lambda: self.clients.control(url).put_object(Bucket=self.loc.bucket, Key=key, Body=body),
                       lambda exc: classify_botocore(url, exc))

    def _pages(self, key_prefix: str, delimiter: str) -> list:
        """All pages of a listing, each page retried on its own (from its continuation token)."""
        listing = s3_client.Listing(self.client, self.loc.bucket, key_prefix, delimiter, LIST_PAGE_KEYS)
        pages = []
        while (page := self.call(self.url, listing.next_page)) is not None:
            pages.append(page)
        return pages

    def list(self, prefix: str = "") -> list[Entry]:
        """Every object whose name starts with ``prefix``, sorted by name."""
        cut = len(self.loc.prefix)
        out = [Entry(info.key[cut:], info.size, info.etag)
               for page in self._pages(self.loc.prefix + prefix, "") for info in page.object_info
               if not info.key.endswith("/")]  # "folder" markers made by consoles are not files
        return sorted(out, key=lambda e: e.name)

    def list_dirs(self, prefix: str = "") -> list[str]:
        """The immediate "subdirectories" (common prefixes) of the directory ``prefix``."""
        prefix = prefix.strip("/")
        key_prefix = self.loc.prefix + (prefix + "/" if prefix else "")
        cut = len(self.loc.prefix)
        return sorted(p[cut:].rstrip("/") for page in self._pages(key_prefix, "/") for p in page.common_prefixes)

    def delete(self, name: str) -> None:
        """Delete ``name`` (a missing object is not an error)."""
        key = self.loc.key(self.check_name(name))
        self.call(self.where(name), lambda: self.client.delete_object(self.loc.bucket, key))

    def delete_many(self, names: list[str]) -> None:
        """Delete ``names`` with DeleteObjects, ``DELETE_BATCH_KEYS`` keys per request (missing
        keys are not an error), through the botocore client (the CRT client has no batch delete).
        Each batch is retried on its own, only its keys S3 could not delete yet; a key S3 refused
        (AccessDenied under object lock or without ``s3:DeleteObject``) is raised as one line."""
        for start in range(0, len(names), DELETE_BATCH_KEYS):
            self._delete_batch([self.check_name(n) for n in names[start:start + DELETE_BATCH_KEYS]])

    def _delete_batch(self, batch: list[str]) -> None:
        url, left = self.where(batch[0]), {self.loc.key(n): n for n in batch}

        def once() -> None:
            answer = self.clients.control(url).delete_objects(Bucket=self.loc.bucket, Delete={
                "Objects": [{"Key": key} for key in left], "Quiet": True})
            failed = {e.get("Key"): e for e in answer.get("Errors") or ()}
            for key in [k for k in left if k not in failed]:
                del left[key]
            if failed:  # the first refusal, classified like a single request's (transient: again)
                key, error = next(iter(failed.items()))
                code, text = str(error.get("Code", "")), str(error.get("Message", ""))
                raise _classified(self.where(left.get(key, key)), code, 0, "", f"{code} {text}".lower(),
                                  f"{code}: {text or 'S3 refused the delete'}"
                                  + (f" (and {len(failed) - 1} more key(s))" if len(failed) > 1 else ""))

        self.retry.run(url, once, lambda exc: classify_botocore(url, exc))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object whose name starts with ``prefix``: its listing (a page per 1,000
        keys), then DeleteObjects batches (``delete_many``)."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix (it would empty the whole store)")
        self.delete_many([e.name for e in self.list(prefix)])
