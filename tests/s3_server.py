"""A real S3 server on loopback for the tests: moto's ``ThreadedMotoServer`` (HTTP, in a thread).

Not a mock of the client: podtrain's store talks to it through s3torchconnector's CRT client over
HTTP, exactly as it talks to AWS, selected by ``AWS_ENDPOINT_URL``. boto3 is used only by the tests
to look behind the store's back (incomplete multipart uploads, raw objects).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
import uuid

TEST_ACCESS_KEY = "AKIAPODTRAINTEST0001"
TEST_SECRET = "podtrain-test-secret-must-never-appear-anywhere"
"""Dummy credentials; tests grep a run's files and messages for the secret."""


class S3Server:
    """A started moto S3 server: ``endpoint``, the ``env`` that selects it, a boto3 client for checks."""

    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        atomic_conditional_writes()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY,
                    "AWS_SECRET_ACCESS_KEY": TEST_SECRET, "AWS_REGION": "us-east-1"}
        self._names = itertools.count()
        self._boto = None

    @property
    def boto(self):
        """A boto3 S3 client on this server (for assertions, not for the code under test)."""
        if self._boto is None:
            import boto3

            self._boto = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                      aws_access_key_id=TEST_ACCESS_KEY, aws_secret_access_key=TEST_SECRET)
        return self._boto

    def new_bucket(self) -> str:
        """Create a fresh, empty bucket and return its name."""
        name = f"podtrain-{next(self._names)}-{uuid.uuid4().hex[:8]}"
        self.boto.create_bucket(Bucket=name)
        return name

    def incomplete_uploads(self, bucket: str, settle_s: float = 5.0) -> list[str]:
        """Keys of the multipart uploads started and neither completed nor aborted in ``bucket``.

        Waits up to ``settle_s`` for the list to empty: dropping a native upload stream cancels the
        CRT's meta request, and the CRT sends AbortMultipartUpload from its own event loop, usually
        before the drop returns but, on a loaded machine, a moment after (seen once in CI).
        """
        deadline = time.monotonic() + settle_s
        while True:
            keys = [u["Key"] for u in self.boto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
            if not keys or time.monotonic() >= deadline:
                return keys
            time.sleep(0.05)

    def keys(self, bucket: str) -> list[str]:
        """Every object key in ``bucket``."""
        pages = self.boto.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def stop(self) -> None:
        """Stop the server thread."""
        self._server.stop()


def atomic_conditional_writes() -> None:
    """Make moto's conditional writes one step, as S3's are. moto checks ``If-Match`` /
    ``If-None-Match`` and then writes, with nothing held between the two, and its server answers
    each request on a thread of its own: two conditional PUTs of one key that arrive together can
    both pass the check (seen in CI: both racers of ``test_lease_cas`` took over one stale lease,
    A=True B=True). Every conditional PUT and DELETE takes one lock for its check and its write;
    unconditional requests do not (no test races one against a conditional write), so part uploads
    stay parallel. Patched once per process, on the class every request's handler is made from."""
    from moto.s3.responses import S3Response

    if getattr(S3Response, "podtrain_atomic_conditional_writes", False):
        return
    lock = threading.Lock()

    def one_step(method):
        @functools.wraps(method)
        def checked_and_written_under_the_lock(self):
            if self.headers.get("If-Match") or self.headers.get("If-None-Match"):
                with lock:
                    return method(self)
            return method(self)
        return checked_and_written_under_the_lock

    S3Response.put_object = one_step(S3Response.put_object)
    S3Response.delete_object = one_step(S3Response.delete_object)
    S3Response.podtrain_atomic_conditional_writes = True


def start_with_env() -> tuple[S3Server, dict]:
    """Start a server and point this process's environment at it; returns it and the previous values."""
    server = S3Server()
    saved = {k: os.environ.get(k) for k in [*server.env, "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    os.environ.update(server.env)
    return server, saved


def restore_env(saved: dict) -> None:
    """Put back the environment ``start_with_env`` replaced."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
