"""podtrain.storage: the same behaviour on a POSIX directory and on a real S3 server (moto, loopback).

The S3 half talks HTTP to moto's ThreadedMotoServer through s3torchconnector's CRT client, exactly as
it would talk to AWS; boto3 only looks behind the store's back (incomplete multipart uploads).
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import sys

import numpy as np
import pytest
import torch

from podtrain.errors import UserError
from podtrain.storage import (AccessDenied, NoSpace, NoSuchBucket, NotFound, ReadOnly, RetryPolicy, StorageError,
                              Transient, open_store)
from podtrain.storage import s3 as s3_mod
from podtrain.storage import s3_config
from podtrain.storage.errors import from_os_error, scrub

PART = 8 << 20  # s3torchconnector's default part size: writing more sends an UploadPart before commit


@pytest.fixture(params=["posix", "s3"])
def backend(request, tmp_path):
    """(store, leftovers) per backend; ``leftovers()`` lists what a failed write may have left behind:
    hidden temporary files on POSIX, incomplete multipart uploads on S3 (must always be empty)."""
    if request.param == "posix":
        store = open_store(tmp_path / "root")
        return store, lambda: sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/root"), lambda: server.incomplete_uploads(bucket)


def one_line(exc: BaseException) -> str:
    """The message, asserted to be one line and a UserError (exit 2)."""
    assert isinstance(exc, UserError) and exc.exit_code == 2
    msg = str(exc)
    assert "\n" not in msg and msg
    return msg


def test_write_is_visible_only_after_commit(backend):
    store, _ = backend
    store.write_bytes("a/x.bin", b"old")
    old_version = store.stat("a/x.bin").version
    with store.open_write("a/x.bin") as fh:
        fh.write(b"new ")
        fh.write(memoryview(b"content"))
        assert fh.tell() == 11
        with store.open_write("a/y.bin") as other:
            other.write(b"y")
            assert not store.exists("a/y.bin")
        assert store.read_bytes("a/x.bin") == b"old"  # the old file until the new one commits
        assert [e.name for e in store.list()] == ["a/x.bin", "a/y.bin"]
    assert store.read_bytes("a/x.bin") == b"new content" and store.stat("a/x.bin").version != old_version
    assert store.size("a/x.bin") == 11 and store.exists("a/x.bin")
    store.write_bytes("empty", b"")
    assert store.read_bytes("empty") == b"" and store.size("empty") == 0


def test_exception_mid_write_leaves_nothing(backend):
    store, leftovers = backend
    store.write_bytes("keep.bin", b"previous version")
    payload = os.urandom(PART + 4096)  # on S3, past one part: the upload has a part on the server
    with pytest.raises(RuntimeError, match="simulated"):
        with store.open_write("keep.bin") as fh:
            fh.write(payload)
            with store.open_write("new.bin") as fh2:
                fh2.write(b"small: on S3 still only in the client's buffer")
                raise RuntimeError("simulated failure mid-write")
    assert store.read_bytes("keep.bin") == b"previous version"
    assert not store.exists("new.bin")
    assert [e.name for e in store.list()] == ["keep.bin"]
    assert leftovers() in ([], ["keep.bin"])  # POSIX lists real files; S3 lists incomplete uploads


def test_dropped_writer_publishes_nothing(backend):
    """A writer abandoned without commit (a dead thread, a forgotten close) is aborted, not completed:
    s3torchconnector's own S3Writer would complete it with the truncated content on garbage collection."""
    store, leftovers = backend
    fh = store.open_write("dropped.bin")
    fh.write(b"partial" * 1000)
    del fh  # the last reference: CPython finalises it here
    assert not store.exists("dropped.bin") and store.list() == []
    assert leftovers() == []


def test_range_reads_into_caller_buffers(backend):
    store, _ = backend
    data = bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8))
    store.write_bytes("d/blob", np.frombuffer(data, np.uint8))
    assert store.read_range("d/blob", 1000, 17) == data[1000:1017]
    assert store.read_bytes("d/blob") == data
    ba = bytearray(100)
    store.read_into("d/blob", 5, memoryview(ba)[10:60])
    assert bytes(ba[10:60]) == data[5:55] and ba[:10] == bytes(10)
    arr = np.zeros(64, np.uint8)
    store.read_into("d/blob", 2936, arr)
    assert arr.tobytes() == data[2936:]
    t = torch.zeros(32, dtype=torch.uint8)
    store.read_into("d/blob", 7, t)
    assert bytes(t.numpy()) == data[7:39]
    chunks = list(store.iter_chunks("d/blob", 1024))
    assert [len(c) for c in chunks] == [1024, 1024, 952] and b"".join(chunks) == data
    with store.open_read("d/blob") as fh:
        fh.seek(2990)
        assert fh.read() == data[2990:]
        fh.seek(-3000, io.SEEK_END)
        assert fh.read(4) == data[:4]
    with pytest.raises(StorageError) as exc:
        store.read_range("d/blob", 2990, 20)
    assert "short read" in one_line(exc.value) and "d/blob" in str(exc.value)
    with pytest.raises(StorageError, match="short read"):
        store.read_range("d/blob", 5000, 1)
    with pytest.raises(TypeError, match="writable"):
        store.read_into("d/blob", 0, b"read-only")


def test_listing_and_deletion(backend):
    store, _ = backend
    for name in ["a/1", "a/2", "a/b/3", "ab/4", "c"]:
        store.write_bytes(name, name.encode())
    entries = store.list()
    assert [(e.name, e.size) for e in entries] == [("a/1", 3), ("a/2", 3), ("a/b/3", 5), ("ab/4", 4), ("c", 1)]
    assert all(e.version for e in entries) and store.stat("a/b/3") == entries[2]
    assert [e.name for e in store.list("a/")] == ["a/1", "a/2", "a/b/3"]
    assert [e.name for e in store.list("a")] == ["a/1", "a/2", "a/b/3", "ab/4"]
    assert store.list("zzz/") == []
    assert store.list_dirs() == ["a", "ab"] and store.list_dirs("a") == ["a/b"] == store.list_dirs("a/")
    assert store.list_dirs("nothing") == []
    store.delete("c")
    store.delete("c")  # a missing file is not an error
    assert not store.exists("c")
    store.delete_prefix("a/")
    assert [e.name for e in store.list()] == ["ab/4"] and store.list_dirs() == ["ab"]
    with pytest.raises(ValueError):
        store.delete_prefix("")
    if store.is_local:
        assert store.local_path("ab/4").read_bytes() == b"ab/4"
    else:
        assert store.local_path("ab/4") is None


def test_s3_listing_follows_pages(s3_bucket, monkeypatch):
    store = open_store(f"s3://{s3_bucket}/p")
    for i in range(5):
        store.write_bytes(f"k/{i}", b"x")
    store.write_bytes("j/0", b"x")
    monkeypatch.setattr(s3_mod, "LIST_PAGE_KEYS", 2)  # 5 keys come back in 3 pages
    assert [e.name for e in store.list("k/")] == [f"k/{i}" for i in range(5)]
    assert store.list_dirs() == ["j", "k"]


def test_missing_files_and_buckets_are_one_line(backend, s3_server):
    store, _ = backend
    with pytest.raises(NotFound) as exc:
        store.read_bytes("no/such")
    msg = one_line(exc.value)
    assert msg.startswith(store.where("no/such")) and "not found" in msg
    assert not store.exists("no/such")
    with pytest.raises(StorageError, match="not a relative file name"):
        store.read_bytes("../escape")
    missing = open_store("s3://podtrain-no-such-bucket/x")
    for op in (lambda: missing.read_bytes("f"), lambda: missing.write_bytes("f", b"1"), missing.list):
        with pytest.raises(NoSuchBucket) as exc:
            op()
        assert "podtrain-no-such-bucket" in one_line(exc.value) and "no such bucket" in str(exc.value)


def test_os_errors_name_the_cause():
    """read-only file system and no space cannot be produced without root; the mapping is pure."""
    cases = {errno.EROFS: (ReadOnly, "read-only file system"), errno.ENOSPC: (NoSpace, "no space left"),
             errno.EDQUOT: (NoSpace, "quota"), errno.EACCES: (AccessDenied, "permission denied"),
             errno.ENOENT: (NotFound, "not found")}
    for code, (cls, words) in cases.items():
        err = from_os_error("/fsx/ckpt/x", OSError(code, os.strerror(code)))
        assert type(err) is cls and one_line(err) == f"/fsx/ckpt/x: {err.cause}" and words in err.cause
        again = pickle.loads(pickle.dumps(err))  # errors cross process boundaries between ranks
        assert type(again) is cls and str(again) == str(err)


def test_s3_messages_are_classified_and_scrubbed(monkeypatch):
    """The messages s3torchconnector 1.5 raises (captured from moto), reduced to one line."""
    url = "s3://b/k"
    dump = ('Client error: Unknown response error: MetaRequestResult { response_status: {s}, crt_error: Error(14343,'
            ' "aws-c-s3: AWS_ERROR_S3_INVALID_RESPONSE_STATUS"), error_response_body: Some("<?xml version=\\"1.0\\"?>'
            '\\n<Error><Code>{c}</Code><Message>{m}</Message><RequestId>r</RequestId></Error>") }')

    def crt(status, code, message):
        return dump.replace("{s}", str(status)).replace("{c}", code).replace("{m}", message)

    assert type(s3_mod.classify(url, "Service error: The object was not found")) is NotFound
    assert type(s3_mod.classify(url, "Service error: The bucket does not exist")) is NoSuchBucket
    err = s3_mod.classify(url, crt(404, "NoSuchBucket", "The specified bucket does not exist"))
    assert type(err) is NoSuchBucket and one_line(err).startswith("s3://b/k: no such bucket")
    err = s3_mod.classify(url, crt(403, "AccessDenied", "Access Denied"))
    assert type(err) is AccessDenied and one_line(err) == "s3://b/k: access denied (AccessDenied: Access Denied (HTTP 403))"
    assert type(s3_mod.classify(url, "Client error: Forbidden: Access denied")) is AccessDenied
    assert "no AWS credentials" in str(s3_mod.classify(url, "Client error: No signing credentials available"))
    assert type(s3_mod.classify(url, crt(503, "SlowDown", "Please reduce your request rate"))) is Transient
    assert type(s3_mod.classify(url, "Client error: Request throttled")) is Transient
    assert type(s3_mod.classify(url, crt(400, "InvalidArgument", "bad"))) is StorageError
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-xyz")
    err = s3_mod.classify("s3://b/k", crt(400, "Bad", "key s3cr3t-value-xyz X-Amz-Signature=abc123 http://u:pw@h/"))
    assert "s3cr3t-value-xyz" not in str(err) and "abc123" not in str(err) and "pw@" not in str(err)
    assert scrub("aws_secret_access_key = abc") == "aws_secret_access_key = ***"


def test_the_retry_policy_retries_transient_failures_only():
    """RetryPolicy: full-jitter waits under a doubling, capped ceiling; Transient retried until the
    tries are spent (then exit 203), anything else raised at once."""
    class FakeS3Exception(Exception):
        pass

    calls = []

    def flaky(fail_times, message):
        def op():
            calls.append(1)
            if len(calls) <= fail_times:
                raise FakeS3Exception(message)
            return "ok"
        return op

    def classify(exc):
        return s3_mod.classify("s3://b/k", str(exc)) if isinstance(exc, FakeS3Exception) else None

    policy = RetryPolicy(base_s=0.001, cap_s=0.004, max_attempts=4, seed=1)
    ceilings = [min(0.004, 0.001 * 2 ** n) for n in range(8)]
    waits = [policy.delay(n + 1) for n in range(8)]
    assert all(0 <= w <= c for w, c in zip(waits, ceilings)) and len(set(waits)) == 8
    slow = "Client error: Request throttled"
    assert policy.run("s3://b/k", flaky(2, slow), classify) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(Transient, match="Request throttled .gave up after 4 tries") as err:
        policy.run("s3://b/k", flaky(99, slow), classify)
    assert len(calls) == 4 and err.value.exit_code == 203
    calls.clear()
    with pytest.raises(NotFound):
        policy.run("s3://b/k", flaky(99, "Service error: The key does not exist"), classify)
    assert len(calls) == 1
    with pytest.raises(ZeroDivisionError):  # not a storage failure: raised as it is, never retried
        policy.run("s3://b/k", lambda: 1 / 0, classify)
    assert RetryPolicy().budget_s == 240.0 and RetryPolicy().max_attempts is None


def test_s3_endpoint_and_region_as_the_sdks_read_them(tmp_path):
    assert s3_config.endpoint_url({"AWS_ENDPOINT_URL": "http://a", "AWS_ENDPOINT_URL_S3": "http://s3"}) == "http://s3"
    assert s3_config.endpoint_url({"AWS_ENDPOINT_URL": "http://a"}) == "http://a"
    assert s3_config.endpoint_url({"AWS_ENDPOINT_URL": "http://a", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}) is None
    cfg = tmp_path / "config"
    cfg.write_text("[default]\nregion = eu-west-1\n[profile train]\nregion = us-west-2\n")
    env = {"AWS_CONFIG_FILE": str(cfg)}
    assert s3_config.region(env) == "eu-west-1"
    assert s3_config.region({**env, "AWS_PROFILE": "train"}) == "us-west-2"
    assert s3_config.region({**env, "AWS_DEFAULT_REGION": "ap-south-1"}) == "ap-south-1"
    assert s3_config.region({**env, "AWS_DEFAULT_REGION": "x", "AWS_REGION": "y"}) == "y"
    assert s3_config.region({"AWS_CONFIG_FILE": str(tmp_path / "none")}) == "us-east-1"
    loc = s3_config.parse_s3_url("s3://bucket/a/b/")
    assert (loc.bucket, loc.key("c")) == ("bucket", "a/b/c")
    assert s3_config.parse_s3_url("s3://bucket").key("c") == "c"
    with pytest.raises(StorageError, match="not an S3 url"):
        open_store("s3://")


def test_s3_without_the_extra_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3torchconnector", None)  # what an environment without the extra sees
    with pytest.raises(StorageError) as exc:
        open_store("s3://bucket/ckpt")
    assert one_line(exc.value) == "s3://bucket/ckpt: needs the optional dependency s3torchconnector: " \
                                  "pip install 'podtrain[s3]'"
    with pytest.raises(StorageError, match="unsupported url scheme"):
        open_store("gs://bucket/x")
