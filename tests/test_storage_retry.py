"""Storage faults are retried, then survived: the store's RetryPolicy against real failures.

Every S3 test talks to moto's real S3 server through tests/s3_fault_proxy.py, which answers 503
SlowDown (or another error) to every request during an outage and to a seeded fraction of them
otherwise; the client is s3torchconnector's CRT client over HTTP, as against AWS. Budgets are
small so the whole file takes seconds.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
from pathlib import Path

import pytest

from s3_fault_proxy import RESET, s3_proxy  # noqa: F401 - s3_proxy is a fixture
from podtrain import errors
from podtrain.launch.exit_report import ExitReport, job_exit
from podtrain.storage import (AccessDenied, NoSuchBucket, NotFound, RetryPolicy, StorageError, Transient,
                              open_store)
from podtrain.storage import retry as retry_mod
from podtrain.storage import s3 as s3_mod

MiB = 1 << 20


def fast(budget_s: float = 30.0, **kw) -> RetryPolicy:
    """A policy with the default's shape but test-sized waits."""
    return RetryPolicy(base_s=0.05, cap_s=0.5, budget_s=budget_s, seed=kw.pop("seed", 0), **kw)


def body(s3_server, bucket: str, key: str) -> bytes:
    """The object as the server holds it (boto3, straight to moto)."""
    return s3_server.boto.get_object(Bucket=bucket, Key=key)["Body"].read()


def absent(s3_server, bucket: str, key: str) -> bool:
    """Whether ``key`` is not in ``bucket``."""
    return key not in s3_server.keys(bucket)


def test_the_fault_proxy_is_transparent_and_stops_without_leaving_a_thread(s3_server, s3_bucket):
    """What the proxy forwards arrives as sent (bodies, Range, HEAD, chunked uploads), its faults are
    S3 errors, and ``stop()`` ends every thread it started, keep-alive connections included."""
    import boto3
    from botocore.config import Config

    from s3_fault_proxy import S3FaultProxy
    from s3_server import TEST_ACCESS_KEY, TEST_SECRET

    before = set(threading.enumerate())
    with S3FaultProxy(s3_server.endpoint, lifetime_s=60) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint, region_name="us-east-1",
                              aws_access_key_id=TEST_ACCESS_KEY, aws_secret_access_key=TEST_SECRET,
                              config=Config(retries={"total_max_attempts": 1}))
        blob = random.Random(9).randbytes(300_000)
        client.put_object(Bucket=s3_bucket, Key="p/blob", Body=blob)
        put = http.client.HTTPConnection(*proxy.endpoint.removeprefix("http://").split(":"))
        put.request("PUT", f"/{s3_bucket}/p/chunked", body=iter([blob[:100_000], blob[100_000:]]),
                    encode_chunked=True)  # Transfer-Encoding: chunked
        assert put.getresponse().status == 200
        put.close()
        assert client.get_object(Bucket=s3_bucket, Key="p/blob", Range="bytes=1000-1999")["Body"].read() == \
            blob[1000:2000]
        assert client.head_object(Bucket=s3_bucket, Key="p/chunked")["ContentLength"] == len(blob)
        assert body(s3_server, s3_bucket, "p/chunked") == blob
        proxy.outage(True)
        with pytest.raises(client.exceptions.ClientError, match="SlowDown"):
            client.get_object(Bucket=s3_bucket, Key="p/blob")
        assert proxy.stats() == {"requests": 5, "failed": 1, "forwarded": 4}
    assert proxy.stopped and set(threading.enumerate()) <= before


# -- retried, then through -----------------------------------------------------------------------
def test_a_piece_upload_goes_through_with_a_third_of_requests_failing(s3_proxy, s3_server, s3_bucket):
    """A checkpoint piece streamed in slices (17 MiB: three parts) is byte-identical, with 30% of
    requests failed; an outage in the middle of it fails the upload, which is sent again whole."""
    store = open_store(f"s3://{s3_bucket}/ckpt", fast())
    data = random.Random(1).randbytes(17 * MiB)
    tries = []

    def fill(fh, outage_at=None):
        tries.append(1)
        for i in range(0, len(data), 3 * MiB):
            if outage_at == i and len(tries) == 1:
                s3_proxy.fail_with(502, "BadGateway", "down")  # not retried by the CRT: the part fails
                s3_proxy.outage(True, for_s=1.0)
            fh.write(memoryview(data)[i:i + 3 * MiB])
        return fh.tell()

    s3_proxy.fail_fraction(0.3, seed=7)
    assert store.write_replayable("step_1/rank_0.bin", fill) == len(data)
    assert any(f for m, p, f in s3_proxy.history() if "partNumber=" in p), "no part failed: change the seed"
    assert body(s3_server, s3_bucket, "ckpt/step_1/rank_0.bin") == data
    s3_proxy.reset()
    tries.clear()
    assert store.write_replayable("step_2/rank_0.bin", lambda fh: fill(fh, outage_at=6 * MiB)) == len(data)
    assert len(tries) >= 2, "the outage did not fail the first upload"
    assert body(s3_server, s3_bucket, "ckpt/step_2/rank_0.bin") == data


@pytest.mark.slow
def test_paged_lists_and_ranged_gets_go_through_with_a_third_of_requests_failing(
        s3_proxy, s3_server, s3_bucket, monkeypatch):
    """Every LIST page is retried on its own (a failed page is asked again from its continuation
    token: each page is fetched once successfully), and ranged GETs resume where they stopped."""
    monkeypatch.setattr(s3_mod, "LIST_PAGE_KEYS", 2)  # 8 objects: 4 pages
    blob = random.Random(2).randbytes(3 * MiB)
    s3_server.boto.put_object(Bucket=s3_bucket, Key="d/blob", Body=blob)
    names = ["blob"] + [f"s{i % 3}/f{i}" for i in range(7)]
    for i in range(7):
        s3_server.boto.put_object(Bucket=s3_bucket, Key=f"d/s{i % 3}/f{i}", Body=b"%d" % i)
    store = open_store(f"s3://{s3_bucket}/d", fast())
    s3_proxy.fail_fraction(0.3, seed=3)
    assert [e.name for e in store.list()] == sorted(names)
    assert store.list_dirs() == ["s0", "s1", "s2"]
    lists = [(p, f) for m, p, f in s3_proxy.history() if "list-type=2" in p]
    assert any(f for _, f in lists), "no LIST request failed: raise the fault rate or change the seed"
    assert sum(not f for _, f in lists) == 4 + 2  # 4 pages of files, 2 of (3 dirs + 1 file): each once
    rng = random.Random(4)
    for _ in range(24):
        start = rng.randrange(len(blob) - 1)
        n = rng.randrange(1, min(400_000, len(blob) - start) + 1)
        assert store.read_range("blob", start, n) == blob[start:start + n]
    gets = [f for m, p, f in s3_proxy.history() if m == "GET" and "list-type" not in p]
    assert any(gets) and not all(gets)


@pytest.mark.parametrize("status, code", [(500, "InternalError"), (502, "BadGateway"), (504, "GatewayTimeout"),
                                          (429, "TooManyRequests"), (RESET, "")])  # 503: the tests above
def test_every_kind_of_transient_failure_is_retried(s3_proxy, s3_bucket, status, code):
    """5xx, throttling and reset connections are transient (the CRT's messages for each, observed
    through the proxy, are classified so); a short outage of any of them is ridden out."""
    store = open_store(f"s3://{s3_bucket}/t", fast())
    store.write_bytes("x", b"payload")
    s3_proxy.fail_with(status, code, "injected")
    s3_proxy.outage(True, for_s=0.8)
    assert store.read_bytes("x") == b"payload"
    assert s3_proxy.stats()["failed"] >= 1 and not s3_proxy.in_outage


# -- spent, abandoned, or not retried at all -----------------------------------------------------
@pytest.mark.slow
def test_an_outage_longer_than_the_budget_raises_transient_203_and_commits_nothing(s3_proxy, s3_server, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/ckpt", fast(budget_s=1.0))
    store.write_bytes("old", b"kept")
    s3_proxy.reset()
    s3_proxy.outage(True)
    data = random.Random(5).randbytes(9 * MiB)  # two parts
    for op in (lambda: store.write_bytes("step_9/rank_0.bin", data), lambda: store.read_bytes("old")):
        t0 = time.monotonic()
        with pytest.raises(Transient, match=r"gave up after \d+ tries .*budget is 1 s") as err:
            op()
        assert time.monotonic() - t0 < 12.0  # the budget, plus at most one try (the CRT's own retries)
        assert err.value.exit_code == errors.STORAGE_OUTAGE_EXIT_CODE == 203
        assert isinstance(err.value, StorageError) and "\n" not in str(err.value)
    assert s3_proxy.stats()["forwarded"] == 0
    s3_proxy.outage(False)
    assert absent(s3_server, s3_bucket, "ckpt/step_9/rank_0.bin")
    assert s3_server.incomplete_uploads(s3_bucket) == []
    assert store.read_bytes("old") == b"kept"


def test_abandon_ends_a_sleeping_retry_at_once_and_starts_no_new_one(s3_proxy, s3_server, s3_bucket):
    policy = RetryPolicy(base_s=30.0, cap_s=30.0, budget_s=600.0, seed=3)  # waits of up to 30 s
    store = open_store(f"s3://{s3_bucket}/ckpt", policy)
    store.write_bytes("a", b"a")
    s3_proxy.fail_with(502, "BadGateway", "down")  # the CRT does not retry a 502: one request per try
    s3_proxy.outage(True)
    outcome = {}

    def save():
        try:
            store.write_bytes("step_5/rank_0.bin", b"x" * 1000)
        except Transient as exc:
            outcome["error"], outcome["at"] = exc, time.monotonic()

    worker = threading.Thread(target=save)
    worker.start()
    deadline = time.monotonic() + 10
    while not s3_proxy.stats()["failed"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the first try failed: now in the policy's wait (up to 30 s)
    t0 = time.monotonic()
    policy.abandon()
    worker.join(timeout=5)
    assert not worker.is_alive() and outcome["at"] - t0 < 1.0
    assert "abandoned" in str(outcome["error"]) and outcome["error"].exit_code == 203
    seen = s3_proxy.stats()["requests"]
    s3_proxy.outage(False)
    with pytest.raises(Transient, match="abandoned"):  # no new try: not one request
        store.stat("a")
    with pytest.raises(Transient, match="abandoned"):
        store.write_bytes("b", b"b")
    assert s3_proxy.stats()["requests"] == seen
    assert s3_server.incomplete_uploads(s3_bucket) == []


def test_abandon_stops_an_upload_between_slices_and_aborts_it(s3_proxy, s3_server, s3_bucket):
    policy = fast()
    store = open_store(f"s3://{s3_bucket}/ckpt", policy)
    with pytest.raises(Transient, match="abandoned"):
        with store.open_write("step_1/rank_0.bin") as fh:
            fh.write(b"x" * 1000)
            policy.abandon()
            fh.write(b"y" * 1000)
    assert absent(s3_server, s3_bucket, "ckpt/step_1/rank_0.bin")
    assert s3_server.incomplete_uploads(s3_bucket) == []


@pytest.mark.parametrize("op", ["stat", "read", "write", "list"])
def test_access_denied_is_not_retried(s3_proxy, s3_bucket, op):
    store = open_store(f"s3://{s3_bucket}/p", fast(budget_s=60))
    s3_proxy.fail_with(403, "AccessDenied", "Access Denied")
    s3_proxy.outage(True)
    t0 = time.monotonic()
    with pytest.raises(AccessDenied, match="access denied") as err:
        {"stat": lambda: store.stat("x"), "read": lambda: store.read_range("x", 0, 4),
         "write": lambda: store.write_bytes("x", b"data"), "list": lambda: store.list()}[op]()
    assert time.monotonic() - t0 < 1.0 and s3_proxy.stats()["requests"] == 1
    assert err.value.exit_code == 2 and "\n" not in str(err.value)


def test_a_missing_bucket_is_not_retried(s3_proxy):
    store = open_store("s3://podtrain-no-such-bucket-here/p", fast(budget_s=60))
    assert store.client is not None  # the CRT client is made before the clock starts: retries are timed, not set-up
    # exact requests per call: CreateMultipartUpload; one LIST; HEAD (404 has no body) then the
    # LIST that tells a missing bucket from a missing key. A retry would add requests and set
    # failing_since (the policy's first transient failure); under load the wall time alone cannot
    # tell (1.06 s seen for one request), so it only bounds a retry loop (the budget is 60 s).
    for op, requests in ((lambda: store.write_bytes("x", b"data"), 1), (lambda: store.list(), 1),
                         (lambda: store.stat("x"), 2)):
        before, t0 = s3_proxy.stats()["requests"], time.monotonic()
        with pytest.raises(NoSuchBucket) as err:
            op()
        assert time.monotonic() - t0 < 5.0 and err.value.exit_code == 2
        assert s3_proxy.stats()["requests"] - before == requests and store.retry.failing_since is None
    assert s3_proxy.stats()["failed"] == 0


def test_posix_failures_of_a_network_file_system_are_transient_and_a_full_disk_is_not():
    import errno

    from podtrain.storage.errors import NoSpace, from_os_error

    for code in (errno.ETIMEDOUT, errno.ESTALE, errno.ECONNRESET, errno.EHOSTUNREACH):
        err = from_os_error("/fsx/ckpt/x", OSError(code, os.strerror(code)))
        assert type(err) is Transient and err.exit_code == 203
    for code in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.ENOENT):
        err = from_os_error("/fsx/ckpt/x", OSError(code, os.strerror(code)))
        assert type(err) is not Transient and err.exit_code == 2
    assert type(from_os_error("/x", OSError(errno.ENOSPC, "full"))) is NoSpace
    assert issubclass(NotFound, StorageError)


# -- the retryable code, end to end --------------------------------------------------------------
def test_the_outage_code_survives_wrapping_and_ranks_over_its_consequences():
    outage = Transient("s3://b/ckpt/x", "Request throttled (gave up after 9 tries in 239.1 s)")
    try:
        try:
            raise outage
        except Transient as exc:
            raise RuntimeError("the background save failed") from exc
    except RuntimeError as wrapped:
        assert errors.storage_error(wrapped) is outage  # cli.py and exit_report: still 203, one line
    reports = {0: ExitReport(0, 203, str(outage), 40), 1: ExitReport(1, 143, "", 40), 2: ExitReport(2, 1, "reset")}
    code, why = job_exit(reports, {3: 124})
    assert (code, why.rank, why.message) == (203, 0, str(outage))
    assert job_exit({0: ExitReport(0, 203), 1: ExitReport(1, 2, "bad key")}, {})[0] == 2


def _train_rank(rank, world, overrides):
    from podtrain.cli import main

    return main(["train", "configs/demo.yaml", *overrides])


@pytest.mark.slow
def test_a_data_read_that_outlasts_its_retries_ends_train_with_203(s3_proxy, s3_server, s3_bucket, tmp_path,
                                                                   repo, monkeypatch):
    """Data on S3, its shard reads in an outage longer than the budget: the loader's background
    read raises Transient, and `podtrain train` ends with 203 and one line in its exit report."""
    from multirank import run_ranks
    from podtrain.model import preset_config
    from synthetic_data import make_data_dir

    preset_config("tiny", 320)  # import transformers' model code once, before the rank forks
    local = make_data_dir(tmp_path / "web", shard_tokens=(3000,), val_tokens=300)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3_server.boto.upload_file(str(path), s3_bucket, f"web/{path.relative_to(local).as_posix()}")
    monkeypatch.setattr(retry_mod, "BUDGET_S", 1.0)  # the forked rank's default policy
    monkeypatch.setattr(retry_mod, "CAP_S", 0.5)
    s3_proxy.fail_only("/web/train_")  # the manifest reads; every shard read fails
    s3_proxy.outage(True)
    reports = tmp_path / "reports"
    reports.mkdir()
    overrides = [f"data.path=s3://{s3_bucket}/web", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32",
                 "train.micro_batch_size=4", "train.global_batch_size=4", "train.steps=2", "eval.every=0",
                 "monitor.watchdog=false", "log.progress=off", "log.trackers=none", "data.verify=false",
                 f"run.dir={tmp_path / 'run'}"]
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        [code] = run_ranks(_train_rank, 1, overrides, timeout=90, env={"PODTRAIN_EXIT_REPORT_DIR": str(reports)})
    finally:
        os.chdir(cwd)
    report = json.loads((reports / "rank_0.json").read_text())
    assert code == 203 and report["code"] == 203, report
    assert "/web/train_" in report["message"] and "gave up" in report["message"] and "\n" not in report["message"]
    assert any(f for m, p, f in s3_proxy.history() if "/web/train_" in p)


def _loader_rank(rank, world, url, cache_dir, workers):
    from podtrain.data.cache import CacheSpec
    from podtrain.data.loader import ShardedLoader
    from podtrain.data.mixture import parse_mix
    from podtrain.data.sources import DataSources

    sources = DataSources(parse_mix([], url), 16)
    sources.use_cache(CacheSpec(str(cache_dir), 1 << 20))
    loader = ShardedLoader(None, 16, 4, 2, rank, world, seed=3, prefetch=1, num_workers=workers, sources=sources)
    try:
        loader.next()
    except Exception as exc:  # noqa: BLE001 - the class and code are what is tested
        return type(exc).__name__, getattr(exc, "exit_code", None), str(exc)
    finally:
        loader.close()
    return None


def test_a_data_loader_worker_hands_over_the_outage_whole(s3_proxy, s3_server, s3_bucket, tmp_path, monkeypatch):
    """With num_workers > 0 the failed read happens in a DataLoader worker process: it reaches
    the step as the same Transient (torch would re-raise it as a RuntimeError of its traceback)."""
    from multirank import run_ranks
    from synthetic_data import make_data_dir

    local = make_data_dir(tmp_path / "code", shard_tokens=(2000,), val_tokens=200)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3_server.boto.upload_file(str(path), s3_bucket, f"code/{path.relative_to(local).as_posix()}")
    monkeypatch.setattr(retry_mod, "BUDGET_S", 0.5)
    monkeypatch.setattr(retry_mod, "CAP_S", 0.2)
    s3_proxy.fail_only("/code/train_")
    s3_proxy.outage(True)
    [got] = run_ranks(_loader_rank, 1, f"s3://{s3_bucket}/code", tmp_path / "cache", 1, timeout=60)
    name, code, message = got
    assert (name, code) == ("Transient", 203) and "/code/train_" in message and "\n" not in message


def test_the_slurm_batch_script_requeues_on_203(tmp_path):
    """torchrun exits 1 whatever its workers' codes; the ranks' exit reports tell the batch script
    that the job ended on a storage outage: with --requeue it requeues, without it exits 203."""
    import shutil
    import subprocess
    import sys

    from cluster_fixtures import batch_environment, fake_slurm_bin
    from podtrain.cli import main

    fake_torchrun = f"""#!/bin/bash
if [ "$1 $2" = "-m torch.distributed.run" ]; then  # rank 0 reports the outage; torchrun says 1
  echo '{{"rank": 0, "code": 203, "message": "s3://b/ckpt: Request throttled (gave up)", "step": 7}}' \\
    > "$PODTRAIN_EXIT_REPORT_DIR/rank_0.json"
  echo '{{"rank": 1, "code": 143, "message": "", "step": 7}}' > "$PODTRAIN_EXIT_REPORT_DIR/rank_1.json"
  exit 1
fi
exec {sys.executable} "$@"
"""
    for requeue in (True, False):
        case = tmp_path / str(requeue)
        script = case / "job.sbatch"
        assert main(["launch", "slurm", str(Path(__file__).parents[1] / "configs" / "demo.yaml"),
                     f"run.dir={case / 'run'}", "train.global_batch_size=32", "train.micro_batch_size=4",
                     "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1", "--output", str(script),
                     *(["--requeue"] if requeue else [])]) == 0
        bindir = case / "bin"
        fake_slurm_bin(bindir, {"n1": "10.9.0.1", "n2": "10.9.0.2"})
        (bindir / "python3").write_text(fake_torchrun)
        (bindir / "python3").chmod(0o755)
        env = batch_environment("4242", ["n1", "n2"], bindir)
        env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert "storage outage that outlasted the retries (exit 203)" in proc.stdout, proc.stdout + proc.stderr
        requeued = bindir / "scontrol-requeue.txt"
        if requeue:
            assert proc.returncode == 0 and requeued.read_text().split() == ["requeue", "4242"]
        else:
            assert proc.returncode == 203 and not requeued.exists()
        shutil.rmtree(bindir)
