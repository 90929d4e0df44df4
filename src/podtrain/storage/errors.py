"""Storage errors: one line naming the url and the cause, exit 2 (a ``UserError``), secrets scrubbed;
a ``Transient`` one (the retries were spent or abandoned) exits 203 instead, a code schedulers retry.

Every backend turns its own failures (``OSError``, ``S3Exception``) into these, so callers catch one
family whatever the store. The message never holds a credential: ``scrub`` removes the values of the
AWS secret variables, URL user-info and signed-request fields from any text before it is raised.
"""

from __future__ import annotations

import errno
import os
import re

from podtrain.errors import STORAGE_OUTAGE_EXIT_CODE, UserError


class StorageError(UserError):
    """A storage operation failed; the message is one line: ``<url>: <cause>``."""

    def __init__(self, url: str, cause: str):
        self.url = url
        self.cause = scrub(" ".join(str(cause).split()))
        super().__init__(f"{scrub(url)}: {self.cause}")

    def __reduce__(self):
        # rebuilt from (url, cause), not from the message: ranks pass exceptions through pickle
        return type(self), (self.url, self.cause)


class NotFound(StorageError):
    """The file, object or bucket does not exist."""


class AccessDenied(StorageError):
    """The credentials (or file permissions) do not allow the operation."""


class NoSuchBucket(NotFound):
    """The S3 bucket named in the url does not exist."""


class NoSpace(StorageError):
    """The file system is full (ENOSPC) or the quota is exhausted (EDQUOT)."""


class ReadOnly(StorageError):
    """The file system is mounted read-only (EROFS)."""


class Transient(StorageError):
    """A failure worth retrying (throttling, a 5xx, a dropped connection, a timeout): what the store's
    ``RetryPolicy`` retries, and raises once its budget is spent or it was abandoned. Still a
    ``StorageError`` (code that catches those keeps working), but the process exits with
    ``STORAGE_OUTAGE_EXIT_CODE`` (203): the storage, not the user, failed, and a later attempt of
    the job can succeed."""

    exit_code = STORAGE_OUTAGE_EXIT_CODE


_SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN")
# user:password@ in a URL, and the fields of a presigned or signed request
_PATTERNS = (
    (re.compile(r"(?<=://)[^/@\s]+@"), "***@"),
    (re.compile(r"(?i)(X-Amz-(?:Credential|Signature|Security-Token)=)[^&\s]+"), r"\1***"),
    (re.compile(r"(?i)(Signature=|Credential=)[^,\s&]+"), r"\1***"),
    (re.compile(r"(?i)(aws_secret_access_key|aws_session_token)(\s*[=:]\s*)\S+"), r"\1\2***"),
)


def scrub(text: str) -> str:
    """``text`` with every AWS secret this process knows, URL user-info and signature fields masked."""
    for var in _SECRET_VARS:
        value = os.environ.get(var)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


_OS_CAUSES = {
    errno.EROFS: (ReadOnly, "read-only file system"),
    errno.ENOSPC: (NoSpace, "no space left on device"),
    errno.EDQUOT: (NoSpace, "disk quota exceeded"),
    errno.EACCES: (AccessDenied, "permission denied"),
    errno.EPERM: (AccessDenied, "operation not permitted"),
    errno.ENOENT: (NotFound, "not found"),
    errno.ENOTDIR: (NotFound, "a parent is not a directory"),
    errno.EISDIR: (StorageError, "is a directory"),
    # A network file system (NFS, Lustre/FSx) whose server or link is briefly gone: worth retrying.
    # EIO is not among them: on a local disk it is a failing device, not a passing outage.
    errno.ETIMEDOUT: (Transient, "timed out"),
    errno.ESTALE: (Transient, "stale file handle (the file server restarted or failed over)"),
    errno.ECONNRESET: (Transient, "connection reset"),
    errno.ECONNABORTED: (Transient, "connection aborted"),
    errno.ENETUNREACH: (Transient, "network unreachable"),
    errno.EHOSTUNREACH: (Transient, "host unreachable"),
}


def from_os_error(url: str, exc: OSError) -> StorageError:
    """The ``StorageError`` subclass for an ``OSError`` at ``url`` (read-only, no space, ...)."""
    cls, cause = _OS_CAUSES.get(exc.errno, (StorageError, exc.strerror or str(exc)))
    return cls(url, cause)
