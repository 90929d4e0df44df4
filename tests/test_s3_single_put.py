"""A checkpoint's small files on S3 cost one request each: ``S3Store.write_bytes`` is one PutObject
(S3 shows it whole or not at all) once the run's botocore client exists, instead of a multipart
upload's three round trips (create, part, complete) that a save waits for one after another.

Real parts: moto's server on loopback behind the counting proxy (``tests/s3_fault_proxy.py``).
"""

from __future__ import annotations

import random

from s3_fault_proxy import s3_proxy  # noqa: F401 - s3_proxy is a fixture
from podtrain.storage import RetryPolicy, open_store, shared_s3_clients
from podtrain.storage import s3 as s3_mod

MiB = 1 << 20


def _policy() -> RetryPolicy:
    return RetryPolicy(base_s=0.05, cap_s=0.5, budget_s=30.0, seed=0)


def _body(s3_server, bucket: str, key: str) -> bytes:
    return s3_server.boto.get_object(Bucket=bucket, Key=key)["Body"].read()


def test_a_small_write_is_one_put_and_a_large_one_a_multipart_upload(s3_proxy, s3_server, s3_bucket):
    with shared_s3_clients():
        store = open_store(f"s3://{s3_bucket}/ckpt", _policy())
        assert store.create_exclusive("owner.json", b'{"pid": 1}') is not None  # the run's control client
        s3_proxy.reset()
        small = b'{"manifest": ' + b"1" * 3000 + b"}"
        store.write_bytes("step_1/manifest.json", small)
        sent = [(m, p) for m, p, _ in s3_proxy.history()]
        assert sent == [("PUT", f"/{s3_bucket}/ckpt/step_1/manifest.json")], sent
        assert _body(s3_server, s3_bucket, "ckpt/step_1/manifest.json") == small

        s3_proxy.reset()
        large = random.Random(3).randbytes(s3_mod.SINGLE_PUT_BYTES + 1)
        store.write_bytes("step_1/big.bin", memoryview(large))
        methods = [m for m, _, _ in s3_proxy.history()]
        assert methods.count("POST") == 2 and methods.count("PUT") >= 2, methods  # create, parts, complete
        assert _body(s3_server, s3_bucket, "ckpt/step_1/big.bin") == large
    assert s3_server.incomplete_uploads(s3_bucket) == []


def test_a_small_put_goes_through_with_a_third_of_requests_failing(s3_proxy, s3_server, s3_bucket):
    """Each refused PutObject is sent again whole: the object is byte-identical, and no upload is left."""
    with shared_s3_clients():
        store = open_store(f"s3://{s3_bucket}/ckpt", _policy())
        store.create_exclusive("owner.json", b'{"pid": 2}')
        s3_proxy.fail_fraction(0.3, seed=11)
        blobs = {f"step_{i}/meta_00000.json": random.Random(i).randbytes(1000 + i) for i in range(12)}
        for name, blob in blobs.items():
            store.write_bytes(name, blob)
        history = s3_proxy.history()
        assert any(f for m, _, f in history if m == "PUT"), "no PUT failed: change the seed"
        assert not [p for m, p, _ in history if m == "POST"], "a small file went through a multipart upload"
        s3_proxy.reset()
    for name, blob in blobs.items():
        assert _body(s3_server, s3_bucket, f"ckpt/{name}") == blob
    assert s3_server.incomplete_uploads(s3_bucket) == []
