"""An HTTP proxy of the tests' own between podtrain and the S3 server, that fails requests on demand.

Storage faults are tested against the real client over real HTTP: s3torchconnector's CRT client
talks to this proxy (``AWS_ENDPOINT_URL`` names it), which forwards each request verbatim (method,
path and query, headers, the body with its Content-Length or chunked framing) to moto's
``ThreadedMotoServer`` and streams the answer back, unless told to fail it:

    proxy.outage(True)              # every request: 503 with an S3 <Code>SlowDown</Code> body
    proxy.outage(True, for_s=150)   # ... ending by itself after 150 s
    proxy.fail_fraction(0.3, seed=1)  # that fraction of requests (a seeded draw per request)
    proxy.fail_with(403, "AccessDenied", "Access Denied")  # the error every failed request gets
    proxy.fail_with(RESET)          # ... or a reset connection, without an answer
    proxy.fail_with(HANG)           # ... or no answer at all while the fault lasts (a storage that hangs)
    proxy.fail_only("/train_")      # faults hit only requests whose path contains this (None: all)
    proxy.stats()                   # {"requests": N, "failed": M, "forwarded": K}
    proxy.history()                 # the last requests: (method, path and query, failed?)

A failed request's body is read before the answer (as S3 does), so the client's connection stays
usable and its retry is a real new request. Stdlib only. Bounded: ``stop()`` (or the end of a
``with`` block, or ``lifetime_s`` after the start) shuts the listener and every open connection
and joins every thread it started; idle keep-alive connections close after ``IDLE_S``.

Fixtures (import them into a test module: ``from s3_fault_proxy import s3_proxy  # noqa: F401``):
``s3_proxy`` points ``AWS_ENDPOINT_URL`` at the session's proxy for one test and puts it back
after, with the faults off and the counters at zero at the start. The proxy lives as long as the
session's S3 server, so its endpoint (and with it s3_client's one CRT client per endpoint) is the
same in every test. Subprocesses started by the test inherit the variable.
"""

from __future__ import annotations

import collections
import http.client
import os
import random
import socket
import struct
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

try:
    import pytest
except ImportError:  # the benches (bench/soak.py's S3 round, bench/outage_recovery.py) use the proxy without pytest
    pytest = None

IDLE_S = 10.0
"""An idle client connection is closed after this long (its thread ends)."""
UPSTREAM_TIMEOUT_S = 60.0
"""Longest wait for the S3 server's answer to one forwarded request."""
COPY_BYTES = 256 << 10
HISTORY = 10_000
"""Requests remembered by ``history()``."""
RESET = 0
"""``fail_with(RESET)``: a failed request's connection is reset instead of answered."""
HANG = -1
"""``fail_with(HANG)``: a failed request is read and never answered while the fault lasts (a storage
that accepts connections and never answers); when it ends, the connection is closed unanswered."""
# Hop-by-hop headers (RFC 9110 7.6.1) are this hop's business; Expect is answered here (the body is
# read before forwarding). Everything else, Host and the signature included, goes through as sent.
_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "upgrade", "expect"}


class S3FaultProxy:
    """A started proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``); see the module doc."""

    def __init__(self, upstream: str, lifetime_s: float | None = 3600.0):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port or 80)
        self._stopped = False
        self._lock = threading.Lock()
        self._outage_until: float | None = None  # None: no outage; inf: until outage(False)
        self._fraction, self._rng = 0.0, random.Random(0)
        self._error = (503, "SlowDown", "Please reduce your request rate.")
        self._counts = {"requests": 0, "failed": 0, "forwarded": 0}
        self._only: str | None = None
        self._methods: tuple[str, ...] | None = None
        self._history: collections.deque = collections.deque(maxlen=HISTORY)
        self._open: set[socket.socket] = set()
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="s3-fault-proxy", daemon=True)
        self._thread.start()
        # Stops by itself however the test ends (a forgotten stop, an interrupted session).
        self._timer = threading.Timer(lifetime_s, self.stop) if lifetime_s else None
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()

    # -- controls ------------------------------------------------------------------------------
    def outage(self, on: bool = True, for_s: float | None = None) -> None:
        """Fail every request (``on``), for ``for_s`` seconds if given (then it ends by itself), or
        stop failing them (``on=False``)."""
        with self._lock:
            self._outage_until = None if not on else time.monotonic() + (for_s if for_s else float("inf"))

    def fail_fraction(self, p: float, seed: int = 0) -> None:
        """Fail each request with probability ``p`` (a draw from ``random.Random(seed)`` per request)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"fail_fraction needs 0 <= p <= 1, not {p}")
        with self._lock:
            self._fraction, self._rng = p, random.Random(seed)

    def fail_with(self, status: int = 503, code: str = "SlowDown",
                  message: str = "Please reduce your request rate.") -> None:
        """The error a failed request gets: HTTP ``status`` with an S3 XML body naming ``code``
        (``status=RESET``: the connection is reset without an answer)."""
        with self._lock:
            self._error = (status, code, message)

    def fail_only(self, path_part: str | None, methods: tuple[str, ...] | None = None) -> None:
        """Let faults hit only requests whose path (query included) contains ``path_part`` (None: all)
        and, with ``methods``, only those HTTP methods (``("DELETE",)``: a bucket that denies deletes)."""
        with self._lock:
            self._only = path_part
            self._methods = methods

    def reset(self) -> None:
        """No faults, on every path, 503 SlowDown as the error, every counter and the history empty."""
        with self._lock:
            self._outage_until, self._fraction, self._only, self._methods = None, 0.0, None, None
            self._error = (503, "SlowDown", "Please reduce your request rate.")
            self._counts = dict.fromkeys(self._counts, 0)
            self._history.clear()

    def _hangs(self) -> bool:
        """Whether a hung request must go on waiting: HANG is the error and a fault is on."""
        with self._lock:
            on = (self._outage_until is not None and time.monotonic() < self._outage_until) or self._fraction > 0
            return not self._stopped and self._error[0] == HANG and on

    @property
    def in_outage(self) -> bool:
        """Whether an outage is on now."""
        with self._lock:
            return self._outage_until is not None and time.monotonic() < self._outage_until

    @property
    def stopped(self) -> bool:
        """Whether ``stop()`` ran (by a call, a ``with`` block's end, or ``lifetime_s``)."""
        return self._stopped

    def stats(self) -> dict[str, int]:
        """Requests seen, failed (answered with the error) and forwarded, since the last ``reset``."""
        with self._lock:
            return dict(self._counts)

    def history(self) -> list[tuple[str, str, bool]]:
        """(method, path with query, failed?) of the last ``HISTORY`` requests, oldest first."""
        with self._lock:
            return list(self._history)

    # -- lifecycle -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Close the listener and every connection, and join every thread (safe to call twice)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            conns = list(self._open)
        if self._timer is not None and threading.current_thread() is not self._timer:
            self._timer.cancel()
        self._server.shutdown()
        for conn in conns:  # wakes handlers waiting on a keep-alive connection or a slow client
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server.server_close()  # joins the handler threads (block_on_close)
        self._thread.join(timeout=10)

    def __enter__(self) -> "S3FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- used by the handlers ------------------------------------------------------------------
    def _verdict(self, method: str, path: str) -> tuple[int, str, str] | None:
        """The error to answer this request with, or None to forward it (counts it either way)."""
        with self._lock:
            self._counts["requests"] += 1
            if self._outage_until is not None and time.monotonic() >= self._outage_until:
                self._outage_until = None
            fail = False
            if (self._only is None or self._only in path) and (self._methods is None or method in self._methods):
                fail = self._outage_until is not None or (self._fraction > 0 and self._rng.random() < self._fraction)
            self._counts["failed" if fail else "forwarded"] += 1
            self._history.append((method, path, fail))
            return self._error if fail else None

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._open.add if add else self._open.discard)(conn)


class _Server(ThreadingHTTPServer):
    # Handler threads are not daemons, so that server_close() joins them (it skips daemons); each ends
    # when its client goes, after IDLE_S idle, or when stop() shuts its sockets.
    daemon_threads = False
    block_on_close = True

    def __init__(self, address, handler, proxy: S3FaultProxy):
        self.proxy = proxy
        super().__init__(address, handler)


def _error_body(code: str, message: str) -> bytes:
    """An S3 error document, as S3 answers (moto too)."""
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>{uuid.uuid4().hex[:16]}</RequestId></Error>").encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the CRT expects
    timeout = IDLE_S

    def setup(self) -> None:
        super().setup()
        self.server.proxy._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.proxy._track(self.connection, False)

    def log_message(self, format, *args) -> None:  # noqa: A002 - one line per request otherwise
        pass

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (OSError, http.client.HTTPException):  # a side went away, or stop() closed the sockets
            self.close_connection = True

    def _body_chunks(self):
        """The request body as it arrives: (chunked framing?, iterator of decoded pieces)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            def chunks():
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                            pass
                        return
                    yield self.rfile.read(size)
                    self.rfile.readline()  # the CRLF after each chunk
            return True, chunks()
        left = int(self.headers.get("Content-Length") or 0)

        def pieces():
            nonlocal left
            while left > 0:
                piece = self.rfile.read(min(left, COPY_BYTES))
                if not piece:
                    raise ConnectionError("the client closed the connection mid-body")
                left -= len(piece)
                yield piece
        return False, pieces()

    def _answer_error(self, error: tuple[int, str, str]) -> None:
        status, code, message = error
        if status == HANG:  # no answer while the fault lasts (stop() ends it too: every thread is joined)
            while self.server.proxy._hangs():
                time.sleep(0.05)
            self.close_connection = True
            return
        if status == RESET:  # a dropped connection: no answer at all, an RST instead of a FIN
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        body = _error_body(code, message)
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amz-request-id", uuid.uuid4().hex[:16])
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _proxy(self) -> None:
        chunked, body = self._body_chunks()
        error = self.server.proxy._verdict(self.command, self.path)
        if error is not None:
            for _ in body:  # read it all: the connection stays in step for the client's next request
                pass
            self._answer_error(error)
            return
        proxy = self.server.proxy
        upstream = http.client.HTTPConnection(*proxy.upstream, timeout=UPSTREAM_TIMEOUT_S)
        sock = None
        try:
            upstream.connect()
            sock = upstream.sock  # (http.client forgets it once a "Connection: close" answer is read)
            proxy._track(sock, True)  # stop() closes it too: no thread waits on the server
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP:
                    upstream.putheader(name, value)
            upstream.putheader("Connection", "close")
            upstream.endheaders()
            for piece in body:
                upstream.send(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                upstream.send(b"0\r\n\r\n")
            response = upstream.getresponse()
            self._relay(response)
        finally:
            if sock is not None:
                proxy._track(sock, False)
            upstream.close()

    def _relay(self, response: http.client.HTTPResponse) -> None:
        """Stream the S3 server's answer to the client (re-chunked where it came chunked)."""
        self.send_response_only(response.status, response.reason)
        chunked = response.chunked
        for name, value in response.getheaders():
            low = name.lower()
            if low in _HOP or low == "transfer-encoding":
                continue
            self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif response.length is None and self.command != "HEAD" and response.status not in (204, 304):
            self.close_connection = True  # the body ends when the connection does
        self.end_headers()
        if self.command == "HEAD":
            return
        while True:
            piece = response.read(COPY_BYTES)
            if not piece:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _proxy


# -- fixtures ------------------------------------------------------------------------------------
_proxies: dict[int, S3FaultProxy] = {}


def s3_proxy(s3_server, request):
    """The session's ``S3FaultProxy`` in front of ``s3_server``, reset (no faults, counters zero),
    with ``AWS_ENDPOINT_URL`` naming it for this test (put back afterwards). Stores opened and
    used inside the test go through it; ``s3_server.boto`` still talks to the server directly."""
    proxy = _proxies.get(id(s3_server))
    if proxy is None or proxy.stopped:
        proxy = _proxies[id(s3_server)] = S3FaultProxy(s3_server.endpoint, lifetime_s=6 * 3600.0)
        request.session.config.add_cleanup(proxy.stop)
    proxy.reset()
    saved = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
    try:
        yield proxy
    finally:
        proxy.reset()
        if saved is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = saved


if pytest is not None:
    s3_proxy = pytest.fixture(s3_proxy)


class OutageDirector(threading.Thread):
    """Drives ``proxy`` from a run's ``metrics.jsonl``: the outage starts once step ``start_step``
    is logged (and ``committed()`` says a checkpoint is committed, when given) and ends once
    ``min_s`` seconds have passed and, with ``until_step``, that step is logged; ``min_s=None``:
    it never ends by itself. ``began``/``ended`` are wall-clock times; ``finish()`` ends it."""

    def __init__(self, proxy: S3FaultProxy, run_dir, start_step: int, until_step: int | None = None,
                 min_s: float | None = None, committed=None):
        super().__init__(daemon=True, name="s3-outage-director")
        self.proxy, self.run_dir, self.start_step = proxy, run_dir, start_step
        self.until_step, self.min_s = until_step, min_s
        self.committed = committed or (lambda: True)
        self.began: float | None = None
        self.ended: float | None = None
        self._halt = threading.Event()

    def last_step(self) -> int:
        """The newest step the run has logged (0: none yet)."""
        import json

        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return 0
        steps = [0]
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a line being written
                continue
            if record.get("kind") == "train":
                steps.append(record["step"])
        return max(steps)

    def run(self) -> None:
        while not self._halt.wait(0.05):
            if self.began is None:
                if self.last_step() >= self.start_step and self.committed():
                    self.proxy.outage(True)
                    self.began = time.time()
            elif (self.min_s is not None and time.time() - self.began >= self.min_s
                  and (self.until_step is None or self.last_step() >= self.until_step)):
                self.proxy.outage(False)
                self.ended = time.time()
                return

    def finish(self) -> None:
        """Stop directing and end any outage (the storage is back)."""
        self._halt.set()
        self.join(5)
        self.proxy.outage(False)
        if self.began is not None and self.ended is None:
            self.ended = time.time()
