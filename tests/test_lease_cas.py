"""The owner claim and the lease are compare-and-swap writes, on S3 (the real S3 server on loopback,
conditional requests) and on POSIX: exactly one of two racing processes wins, however late a
throttled request lands; a renewal after a takeover fails and tells the holder; a release never
removes another holder's lease; an endpoint without conditional writes is refused in one line.

The late request is made real by a proxy in front of the S3 server that refuses the writes
(PUT, POST, DELETE) of one process for as long as the test says, while reads pass: the process
has read, decided and sent its write, and the write lands only after another job acted.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from podtrain.ckpt.lease import LEASE_FILE, Lease, claim_once
from podtrain.errors import UserError
from podtrain.storage import RetryPolicy, StorageError, open_store, shared_s3_clients
from s3_fault_proxy import S3FaultProxy

ROUNDS = 15
WAIT_S = 60.0
"""Deadline of every wait of these tests on another process (they take well under a second)."""


def _wait_for(cond, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.02)


class WritesRefused(S3FaultProxy):
    """The tests' fault proxy with its faults on the requests that change objects only (PUT, POST,
    DELETE): GET and HEAD always pass, and ``stats()`` counts only the writes."""

    def _verdict(self, method: str, path: str):
        if method in ("GET", "HEAD"):
            return None
        return super()._verdict(method, path)


def _lease_store(url: str):
    # as the checkpointer opens them: short retries (a renewal is tried again at the next one)
    return open_store(url, retry=RetryPolicy(budget_s=10.0, cap_s=1.0))


def _plant(store, job: str, heartbeat: float) -> None:
    """A lease of another job (``heartbeat`` 0: long dead), written behind the lease code's back."""
    store.write_bytes(LEASE_FILE, json.dumps({"lineage": "old", "job": job, "host": "host-old", "pid": 1,
                                              "started": 0.0, "heartbeat": heartbeat}).encode())


def _take_over(taker: Lease) -> None:
    """``taker.acquire()``, again while it loses a race: a renewal of the holder sent just before
    the proxy began refusing may still land after the taker's read (and then rightly wins)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            taker.acquire()
            return
        except UserError as exc:
            if "at the same moment" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _holder(store) -> str | None:
    """The job named by ``store``'s lease; None when there is none. Read up to 10 times over ~1 s
    while it reads as absent or torn: the test S3 server (moto) disposes of an object's old body
    when a PUT replaces it, so a read overlapping a renewal of the live holder (every 0.075 s here)
    can fail or return a torn body. A lease truly removed or overwritten reads so every time."""
    for _ in range(10):
        try:
            return json.loads(store.read_bytes(LEASE_FILE))["job"]
        except (StorageError, ValueError, KeyError):
            time.sleep(0.1)
    return None


# -- two processes racing, many rounds -------------------------------------------------------------
def _racer(base: str, who: str, rounds: int, barrier, out) -> None:
    """Each round: claim ``owner.json``, take a free lease, take over a stale one (planted by the
    test); all at the same instant as the other racer (a barrier before each)."""
    with shared_s3_clients():  # one client per process, as in training (a store alone makes its own)
        _race_rounds(base, who, rounds, barrier, out)


def _race_rounds(base: str, who: str, rounds: int, barrier, out) -> None:
    results = []
    for i in range(rounds):
        store = _lease_store(f"{base}/r{i:02d}")
        stale = _lease_store(f"{base}/r{i:02d}/stale")
        barrier.wait(WAIT_S)
        owner = claim_once(store, "owner.json", {"lineage": who, "created": time.time()})["lineage"]
        got = {}
        for kind, where in (("free", store), ("stale", stale)):
            lease = Lease([where], who, f"job-{who}", f"host-{who}", timeout_s=60)
            barrier.wait(WAIT_S)
            try:
                lease.acquire()
                got[kind] = True
            except UserError:
                got[kind] = False
            barrier.wait(WAIT_S)  # the other racer has tried too: only now may the winner let go
            if got[kind]:
                lease.release(deadline_s=WAIT_S)
        results.append((owner, got["free"], got["stale"]))
    out.put((who, results))


def _race(base: str, plant) -> dict[str, list]:
    with shared_s3_clients():
        for i in range(ROUNDS):
            plant(f"{base}/r{i:02d}/stale")
    ctx = mp.get_context("spawn")  # a fresh interpreter: no CRT client or server thread forked
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(base, who, ROUNDS, barrier, out)) for who in ("A", "B")]
    for p in procs:
        p.start()
    try:
        found = dict(out.get(timeout=WAIT_S * 2) for _ in procs)
    finally:
        for p in procs:
            p.join(WAIT_S)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return found


def _check_race(found: dict[str, list], base: str) -> None:
    for i, (a, b) in enumerate(zip(found["A"], found["B"])):
        assert a[0] == b[0] in ("A", "B"), f"round {i}: A says {a[0]} owns it, B says {b[0]}"
        stored = json.loads(open_store(f"{base}/r{i:02d}").read_bytes("owner.json"))["lineage"]
        assert stored == a[0], f"round {i}: owner.json names {stored}, both racers {a[0]}"
        assert a[1] + b[1] == 1, f"round {i}: free lease taken by A={a[1]} B={b[1]}"
        assert a[2] + b[2] == 1, f"round {i}: stale lease taken over by A={a[2]} B={b[2]}"
    assert len(found["A"]) == len(found["B"]) == ROUNDS


@pytest.mark.slow  # processes of their own (spawned: an interpreter each)
def test_two_processes_racing_on_s3_have_exactly_one_winner_every_round(s3_server, s3_bucket):
    base = f"s3://{s3_bucket}/race"
    found = _race(base, lambda url: _plant(open_store(url), "job-old", 0.0))
    with shared_s3_clients():  # one client for the checks' many stores
        _check_race(found, base)
        for i in range(ROUNDS):  # every lease taken in the race was released
            assert not open_store(f"{base}/r{i:02d}").exists(LEASE_FILE)
            assert not open_store(f"{base}/r{i:02d}/stale").exists(LEASE_FILE)


def test_the_test_s3_servers_conditional_writes_are_one_step_as_on_s3(s3_server, s3_bucket, monkeypatch):
    """The race above is only as good as its server: moto checks a precondition and then writes,
    and two conditional PUTs arriving together both passed once (s3_server.atomic_conditional_writes
    closes that). The window between the check and the write is widened to 0.3 s here: of two
    If-Match PUTs on the same ETag exactly one may succeed, and of two If-None-Match PUTs too. The
    widened step runs once per condition: the loser was refused at its check, before it; were it
    ever before the check (another moto), it would run twice and the test would say so rather than
    pass without testing anything."""
    import threading

    import botocore.exceptions
    from moto.s3.responses import S3Response

    real = S3Response._get_checksum  # called by put_object after its precondition check
    widened = []

    def slow_checksum(self, *args, **kwargs):
        precondition = self.headers.get("If-Match") or self.headers.get("If-None-Match")
        if precondition:  # not the setup's plain PUT
            widened.append(precondition)
        time.sleep(0.3)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(S3Response, "_get_checksum", slow_checksum)
    boto = s3_server.boto
    etag = boto.put_object(Bucket=s3_bucket, Key="k", Body=b"old")["ETag"]
    for condition, key in (({"IfMatch": etag}, "k"), ({"IfNoneMatch": "*"}, "new")):
        won, gate = [], threading.Barrier(2)

        def put(who: str) -> None:
            gate.wait(WAIT_S)
            try:
                boto.put_object(Bucket=s3_bucket, Key=key, Body=who.encode(), **condition)
                won.append(who)
            except botocore.exceptions.ClientError as exc:
                assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 412, exc

        threads = [threading.Thread(target=put, args=(who,)) for who in ("A", "B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert len(won) == 1, f"{condition}: {won} both succeeded"
        assert boto.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == won[0].encode()
        assert len(widened) == 1, f"{condition}: the widened step ran {len(widened)} times, not once after the check"
        widened.clear()


@pytest.mark.slow  # processes of their own (spawned: an interpreter each)
def test_two_processes_racing_on_posix_have_exactly_one_winner_every_round(tmp_path):
    base = str(tmp_path / "race")
    found = _race(base, lambda url: _plant(open_store(url), "job-old", 0.0))
    _check_race(found, base)
    for i in range(ROUNDS):
        assert not (tmp_path / "race" / f"r{i:02d}" / LEASE_FILE).exists()
        assert not (tmp_path / "race" / f"r{i:02d}" / "stale" / LEASE_FILE).exists()


# -- a request that lands late (S3, through the proxy) ---------------------------------------------
def _through(endpoint: str, task: str, url: str, events, out) -> None:
    """In a process of its own whose requests go through ``endpoint`` (the proxy): run ``task``."""
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    store = _lease_store(url)
    if task == "claim":
        out.put(claim_once(store, "owner.json", {"lineage": "late", "created": time.time()})["lineage"])
    elif task == "acquire":
        try:
            Lease([store], "late", "job-late", "host-late", timeout_s=60).acquire()
            out.put("held")
        except UserError as exc:
            out.put(f"refused: {exc}")
    elif task == "renew":  # hold the lease, renewing every 0.25 s, until told it was lost (or not)
        lease = Lease([store], "late", "job-late", "host-late", timeout_s=1.0)
        lease.acquire()
        events["held"].set()
        deadline = time.monotonic() + 15
        while lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        out.put(lease.lost)
        lease.release(deadline_s=WAIT_S)
    elif task == "release":  # hold the lease (no renewal in the test's time), release when told
        lease = Lease([store], "late", "job-late", "host-late", timeout_s=60)
        lease.acquire()
        events["held"].set()
        events["release"].wait(WAIT_S)
        lease.release(deadline_s=WAIT_S)
        out.put("released")


class _Late:
    """One process doing ``task`` through a ``WritesRefused`` proxy, its writes refused while
    ``refuse(True)``; the test's own requests go to the S3 server directly."""

    def __init__(self, s3_server, task: str, url: str, key: str):
        self.proxy = WritesRefused(s3_server.endpoint, lifetime_s=300)
        self.proxy.fail_only(key)
        ctx = mp.get_context("spawn")
        self.events = {"held": ctx.Event(), "release": ctx.Event()}
        self.out = ctx.Queue()
        self.proc = ctx.Process(target=_through, args=(self.proxy.endpoint, task, url, self.events, self.out))
        self.proc.start()

    def refuse(self, on: bool) -> None:
        self.proxy.outage(on)

    def refused(self) -> int:
        return self.proxy.stats()["failed"]

    def result(self):
        return self.out.get(timeout=WAIT_S)

    def close(self) -> None:
        self.proc.join(WAIT_S)
        if self.proc.is_alive():
            self.proc.kill()
        self.proxy.stop()


@pytest.mark.slow  # processes of their own (spawned: an interpreter each)
def test_a_claim_whose_write_lands_late_loses_to_the_claim_made_meanwhile(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/late-claim"
    late = _Late(s3_server, "claim", url, "/late-claim/owner.json")
    try:
        late.refuse(True)  # its claim has read "no owner" and is sending its write: refused for now
        _wait_for(lambda: late.refused() >= 1, "the late claimant's write")
        mine = claim_once(open_store(url), "owner.json", {"lineage": "prompt", "created": time.time()})
        late.refuse(False)  # the throttled write lands now
        theirs = late.result()
    finally:
        late.close()
    stored = json.loads(open_store(url).read_bytes("owner.json"))["lineage"]
    assert (mine["lineage"], theirs, stored) == ("prompt", "prompt", "prompt")


@pytest.mark.slow  # processes of their own (spawned: an interpreter each)
def test_a_lease_whose_write_lands_late_is_not_taken(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/late-lease"
    late = _Late(s3_server, "acquire", url, f"/late-lease/{LEASE_FILE}")
    holder = Lease([_lease_store(url)], "prompt", "job-prompt", "host-prompt", timeout_s=60)
    try:
        late.refuse(True)
        _wait_for(lambda: late.refused() >= 1, "the late job's lease write")
        holder.acquire()
        late.refuse(False)
        theirs = late.result()
        assert theirs.startswith("refused: ") and "was claimed at the same moment by job job-prompt" in theirs
        assert _holder(open_store(url)) == "job-prompt"
        assert holder.still_held() is None
    finally:
        holder.release(deadline_s=WAIT_S)
        late.close()
    assert not open_store(url).exists(LEASE_FILE)


@pytest.mark.slow  # processes of their own (spawned: an interpreter each)
def test_a_renewal_landing_after_a_takeover_fails_and_the_holder_learns_it_lost(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/late-renew"
    late = _Late(s3_server, "renew", url, f"/late-renew/{LEASE_FILE}")
    taker = Lease([_lease_store(url)], "taker", "job-taker", "host-taker", timeout_s=0.3)
    try:
        assert late.events["held"].wait(WAIT_S)
        late.refuse(True)  # its next renewal has read its own lease and is writing: refused for now
        _wait_for(lambda: late.refused() >= 1, "a renewal of the holder")
        time.sleep(0.4)  # its last heartbeat is now older than the taker's timeout
        _take_over(taker)  # a takeover of a lease that stopped heartbeating (a partition)
        late.refuse(False)  # the renewal lands now
        lost = late.result()
        assert lost is not None and lost.startswith(f"{url}: the lease was ")
        # (the holder names the taker when its read after the refusal is whole; once, under a
        # heavy load, the test S3 server answered that read with a body that did not parse)
        assert "taken over by job job-taker on host host-taker" in lost or "replaced by another job" in lost
        assert _holder(open_store(url)) == "job-taker"  # the late renewal did not overwrite it
        assert taker.still_held() is None
    finally:
        taker.release(deadline_s=WAIT_S)  # never left renewing in the background of later tests
        late.close()


@pytest.mark.slow  # processes of their own (spawned: an interpreter each)
def test_a_release_landing_after_a_takeover_leaves_the_new_holders_lease(s3_server, s3_bucket):
    # Versioned, so that a delete leaves a trace: the new holder's renewals would re-create a lease
    # deleted under it (and a takeover's own renewal cannot tell who deleted it).
    s3_server.boto.put_bucket_versioning(Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    url = f"s3://{s3_bucket}/late-release"
    late = _Late(s3_server, "release", url, f"/late-release/{LEASE_FILE}")
    taker = Lease([_lease_store(url)], "taker", "job-taker", "host-taker", timeout_s=0.3)
    try:
        assert late.events["held"].wait(WAIT_S)
        late.refuse(True)
        late.events["release"].set()  # it reads its own lease and sends the delete: refused for now
        _wait_for(lambda: late.refused() >= 1, "the holder's delete")
        time.sleep(0.4)
        _take_over(taker)
        late.refuse(False)  # the delete lands now
        assert late.result() == "released"
        versions = s3_server.boto.list_object_versions(Bucket=s3_bucket, Prefix=f"late-release/{LEASE_FILE}")
        assert versions.get("DeleteMarkers", []) == []  # the late delete removed nothing
        assert _holder(open_store(url)) == "job-taker"
        assert taker.still_held() is None and taker.lost is None
    finally:
        taker.release(deadline_s=WAIT_S)  # never left renewing in the background of later tests
        late.close()
    assert not open_store(url).exists(LEASE_FILE)  # the taker's own release removed it


def test_an_endpoint_without_conditional_writes_is_refused_in_one_line(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/no-cas"
    proxy = WritesRefused(s3_server.endpoint, lifetime_s=120)
    saved = os.environ["AWS_ENDPOINT_URL"]
    try:
        proxy.fail_with(501, "NotImplemented", "A header you provided implies functionality that is not implemented")
        proxy.outage(True)
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        store = open_store(url)
        with pytest.raises(StorageError) as caught:
            claim_once(store, "owner.json", {"lineage": "x"})
    finally:
        os.environ["AWS_ENDPOINT_URL"] = saved
        proxy.stop()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{url}/owner.json: the S3 endpoint {proxy.endpoint} ")
    assert "does not support conditional writes (NotImplemented to If-None-Match/If-Match)" in message
    assert "put run.dir and ckpt.dir on a file system" in message
    assert proxy.stats()["failed"] == 1  # refused at once, not retried


# -- the Store's compare-and-swap methods, and POSIX renewal and release ---------------------------
@pytest.fixture(params=["posix", "s3"])
def cas_store(request, tmp_path):
    if request.param == "posix":
        return open_store(str(tmp_path / "cas"))
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/cas")


def test_the_store_compare_and_swap_methods(cas_store):
    first = cas_store.create_exclusive("c/x.json", b"one")
    assert first and cas_store.create_exclusive("c/x.json", b"two") is None
    assert cas_store.read_versioned("c/x.json") == (b"one", first)
    second = cas_store.replace_if("c/x.json", b"three", first)
    assert second and second != first
    assert cas_store.replace_if("c/x.json", b"four", first) is None  # a stale tag changes nothing
    assert cas_store.delete_if("c/x.json", first) is False
    assert cas_store.read_versioned("c/x.json") == (b"three", second)
    assert cas_store.delete_if("c/x.json", second) is True and not cas_store.exists("c/x.json")
    assert cas_store.delete_if("c/x.json", second) is True  # already gone
    assert cas_store.replace_if("c/x.json", b"five", second) is None  # gone: nothing to replace
    assert not cas_store.exists("c/x.json")
    assert [e.name for e in cas_store.list("c/")] == []  # no temporary or lock file is listed


def test_a_posix_renewal_after_a_takeover_fails_and_the_release_leaves_the_new_lease(tmp_path):
    store = open_store(str(tmp_path))
    holder = Lease([store], "a", "job-a", "host-a", timeout_s=60)  # renews every 15 s: not in this test
    holder.acquire()
    try:
        time.sleep(0.05)
        taker = Lease([open_store(str(tmp_path))], "b", "job-b", "host-b", timeout_s=0.01)
        taker.acquire()  # takes over: the holder's heartbeat is older than the taker's timeout
        holder._renew(store)  # the renewal the holder's thread would run next
        assert holder.lost is not None and "taken over by job job-b on host host-b" in holder.lost
        assert _holder(store) == "job-b"
    finally:
        holder.release(deadline_s=WAIT_S)
    assert _holder(store) == "job-b"  # the release left the new holder's lease
    taker.release(deadline_s=WAIT_S)
    assert not store.exists(LEASE_FILE)


def test_a_damaged_owner_record_is_claimed_anew_once(cas_store):
    cas_store.write_bytes("owner.json", b"{not json")
    assert claim_once(cas_store, "owner.json", {"lineage": "first"}) == {"lineage": "first"}
    assert claim_once(cas_store, "owner.json", {"lineage": "second"}) == {"lineage": "first"}
