"""Review findings of issue 34's checkpoint layer, each on real parts (real threads, files, forked
gloo ranks, the real S3 server behind the tests' fault proxy):

a. the step loop's waits while it stages a save (a free slab, the hold for a replay of a file larger
   than the pool) all have deadlines: the replay hold is one bound from the first pass, and a stop's
   grace deadline bounds both, even when the storage never answers;
b. a save that is retrying but making progress (a slow storage that works) is not cancelled when the
   next save is due; one that makes none is;
c. a broken replica group is made anew on the main thread (``Replicator.mend``, at the local save's
   gate), never by the replicator's own thread;
d. ``Checkpointer.close`` releases the lease only after the writers stopped; a writer left writing
   at the deadline leaves the lease to expire (never released while a write may still land);
e. ``load.piece_index`` refuses a sidecar of another save of the same step.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from multirank import run_ranks
from s3_fault_proxy import HANG, s3_proxy  # noqa: F401 (fixture)
from podtrain.ckpt import layout, sidecar
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.host_buffers import StagingPool
from podtrain.ckpt.lease import LEASE_FILE
from podtrain.ckpt.load import piece_index
from podtrain.ckpt.staging import RESTAGE, NotReplayable, SaveStream
from podtrain.ckpt.tensorio import CorruptCheckpoint
from podtrain.ckpt.writer import SaveJob
from podtrain.config_sections import CkptSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext
from podtrain.storage.errors import Transient
from podtrain.storage.retry import Deadline

SLAB = 1 << 16  # a 128 KiB pool: two 64 KiB slabs


def single_ctx() -> DistContext:
    return DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)


def _big_stream(hold_s: float, deadline: Deadline | None = None) -> SaveStream:
    """A file four times the pool: RESTAGE (the step loop stages it again for a replay)."""
    pool = StagingPool(2 * SLAB, pin=False, threads=1)
    data = torch.arange(8 * SLAB // 4, dtype=torch.int32)
    kwargs = {} if deadline is None else {"deadline": deadline}
    stream = SaveStream(pool, {"f": [("t", data)]}, replay=True, hold_s=hold_s, **kwargs)
    assert stream.replay == RESTAGE
    return stream


def _read_all(stream: SaveStream) -> int:
    return sum(len(chunk) for chunk in stream.chunks("f"))


# -- a. every wait of the step loop in staging has a deadline -----------------------------------------
def test_the_replay_hold_is_one_bound_from_the_first_pass_not_one_per_pass():
    """A writer whose every try fails after reading the whole file (0.4 s after each pass) used to
    hold the step loop ``hold_s`` after each pass, for as long as it kept failing; now the hold ends
    ``hold_s`` after the first pass, and a replay asked for later is refused (``NotReplayable``)."""
    stream = _big_stream(hold_s=1.0)
    outcome: dict = {"passes": 0}

    def writer():
        try:
            for _ in range(8):  # up to 8 tries, each failing 0.4 s after its whole pass
                assert _read_all(stream) == 8 * SLAB
                outcome["passes"] += 1
                time.sleep(0.4)
        except NotReplayable as exc:
            outcome["refused"] = str(exc)
        finally:
            stream.done_with("f")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    t0 = time.monotonic()
    stream.produce(torch.device("cpu"))
    held = time.monotonic() - t0
    thread.join(10)
    assert not thread.is_alive()
    # the first pass + 1 s of hold (+ a pass in flight at its end); per pass it would be 8 x 0.4 s
    assert held < 2.2, held
    assert "refused" in outcome and "cannot be sent again" in outcome["refused"], outcome
    assert 2 <= outcome["passes"] <= 4, outcome


def test_a_stop_deadline_bounds_the_replay_hold():
    """At a stop (``deadline``: the grace period's), the step loop holds a staged file no longer
    than the deadline, whatever ``hold_s`` says, even when the writer never finishes with it."""
    stream = _big_stream(hold_s=30.0, deadline=Deadline.after(0.8))
    reader = threading.Thread(target=_read_all, args=(stream,), daemon=True)  # reads, never commits
    reader.start()
    t0 = time.monotonic()
    stream.produce(torch.device("cpu"))
    held = time.monotonic() - t0
    assert held < 2.0, held  # the deadline plus the wake-up granularity, not hold_s
    stream.close("test over")
    reader.join(5)


def test_a_stop_deadline_bounds_the_wait_for_a_free_slab_when_the_storage_never_answers(
        s3_proxy, s3_bucket, tmp_path):
    """The stop's save of a share larger than the staging pool on a storage that accepts
    connections and never answers: the writer takes no slab, and the step loop used to wait for
    one for ever; now ``save`` returns by the stop's deadline (the save abandoned, not failed),
    ``close`` returns by its deadline and the run goes on to exit."""
    net = torch.nn.Linear(512, 512)  # 1 MB of weights + 2 MB of Adam moments: RESTAGE in 1 MB
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.ones(1, 512)).sum().backward()
    opt.step()
    ck = Checkpointer(tmp_path / "run", CkptSection(dir=f"s3://{s3_bucket}/ckpt", host_staging_mb=1,
                                                    keep_last=0), single_ctx())
    s3_proxy.fail_with(HANG)
    s3_proxy.outage(True)
    try:
        deadline = Deadline.after(2.0)
        done: dict = {}

        def stop_save():
            done["saved"] = ck.save(7, net, opt, None, {"step": 7}, deadline=deadline)

        saver = threading.Thread(target=stop_save, daemon=True)
        t0 = time.monotonic()
        saver.start()
        saver.join(8.0)
        took = time.monotonic() - t0
        assert not saver.is_alive(), "the stop's save still waits for a slab 8 s after a 2 s deadline"
        assert took < 4.0 and done["saved"] is True, (took, done)
        stopped = ck.close(Deadline.after(2.0))
        assert stopped is False  # the writer is left waiting on the storage
        job = ck._pending
        assert job is None or not job.done.is_set() or "staging stopped" in str(job.error)
    finally:
        s3_proxy.reset()


# -- b. a slow save that progresses is not cancelled ---------------------------------------------------
class _SlowWriter(threading.Thread):
    """Plays the writer of ``job`` on a real ``SaveStream``: takes one slab every ``every_s`` (each
    taken beyond any earlier try's point is progress), then holds still when ``stall`` is set."""

    def __init__(self, job: SaveJob, every_s: float) -> None:
        super().__init__(daemon=True)
        self.job, self.every_s, self.stall, self.stalled = job, every_s, threading.Event(), threading.Event()

    def run(self) -> None:
        try:
            for _ in self.job.stream.chunks("f"):
                if self.stall.is_set():  # a storage that stopped answering
                    self.stalled.set()
                    while self.stall.is_set():
                        time.sleep(0.05)
                time.sleep(self.every_s)
        except Exception as exc:  # the stream closed under it at the test's end
            self.job.error = exc
        finally:
            self.job.done.set()


def test_a_save_retrying_but_making_progress_is_not_cancelled_one_making_none_is(tmp_path):
    """A durable save in flight whose store has a failed operation being retried (``failing_since``
    set by the store's real retry policy) while its piece file streams on (slowly): the next due
    save used to cancel it; now it is skipped instead and the slow save goes on. Once the save
    stops progressing, the next due save cancels it (the newest state wins)."""
    ck = Checkpointer(tmp_path / "run", CkptSection(save_wait_s=0.6), single_ctx())
    try:
        stream = _big_stream(hold_s=0.0)
        stream.replay = "once"  # no replay: a plain stream (the step loop need not hold it)
        job = SaveJob(step=1, rng={}, stream=stream)
        ck._pending, ck._last_step = job, 1
        stager = threading.Thread(target=stream.produce, args=(torch.device("cpu"),), daemon=True)
        stager.start()
        writer = _SlowWriter(job, every_s=0.25)  # 8 slabs: 2 s in all
        writer.start()
        # a storage operation of this store failed once and its retry is in flight (a slow try)
        release = threading.Event()
        tries = {"n": 0}

        def op():
            tries["n"] += 1
            if tries["n"] == 1:
                raise Transient("test", "503 SlowDown")
            release.wait(30)

        retrier = threading.Thread(target=lambda: ck.store.retry.run("test", op), daemon=True)
        retrier.start()
        end = time.monotonic() + 5
        while ck.store.retry.failing_since is None or tries["n"] < 2:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert ck._settle(must=False, step=2) is False  # skipped: the save in flight goes on
        assert not job.cancel.cancelled, job.cancel.reason
        writer.stall.set()  # now it progresses no more, still retrying
        assert writer.stalled.wait(5)
        # the slab it took since it was last asked about still counts: skipped once more
        assert ck._settle(must=False, step=3) is False and not job.cancel.cancelled
        assert ck._settle(must=False, step=4) is False  # nothing since: cancelled
        assert job.cancel.cancelled, "a retrying save without progress must give way to the newest state"
    finally:
        release.set()
        writer.stall.clear()
        stream.close("test over")
        writer.join(5)
        stager.join(5)
        retrier.join(5)
        ck._pending = None
        ck.close()


def test_after_an_outage_a_healthy_save_asked_about_at_once_is_not_cancelled(tmp_path):
    """Seen in CI (an outage from step 6 to 9, saves every 3 steps): the save of step 12, begun
    after the outage and writing, was cancelled at step 15 as "still retrying with no progress",
    so the first commit after the outage was step 15. Two misreadings, each enough: "retrying" was
    the store's ``failing_since``, which the outage's last (cancelled) operation had left set; and
    a save first asked about at once (an agreed outage makes the step loop wait 0 s) had its
    progress counted over no time at all. Now "retrying" is an operation failing now, and a first
    ask without a pause counts progress within ``ckpt.save_wait_s``. A save that is retrying and
    stood still is still cancelled: asked at once, or over the pause of a first ask (an outage
    beginning mid-save, not yet agreed)."""
    from podtrain.ckpt.writer import wrote_one

    ck = Checkpointer(tmp_path / "run", CkptSection(save_wait_s=0.6), single_ctx())
    policy = ck.store.retry
    release, tries = threading.Event(), {"n": 0}
    retrier = None
    try:
        with pytest.raises(Transient, match="cancelled after 1 tries"):
            _cancelled_after_a_failed_try(policy)  # the outage's last operation; nothing ran since
        assert policy.failing_since is not None and not policy.retrying
        ck._failing_agreed = True  # the last round saw the outage: due saves are asked about at once
        job = SaveJob(step=12, rng={})
        ck._pending, ck._last_step = job, 12
        for _ in range(3):  # the healthy save: the step cleared, a sidecar, a small file written
            wrote_one(job)
        assert ck._settle(must=False, step=15) is False  # still being written: this due save skipped
        assert not job.cancel.cancelled, job.cancel.reason

        def flaky():  # an operation failing now: refused once, its retry in flight
            tries["n"] += 1
            if tries["n"] == 1:
                raise Transient("test", "503 SlowDown")
            release.wait(30)

        retrier = threading.Thread(target=lambda: policy.run("test", flaky), daemon=True)
        retrier.start()
        end = time.monotonic() + 5
        while not (policy.retrying and tries["n"] >= 2):
            assert time.monotonic() < end
            time.sleep(0.01)

        def due(job, step, agreed):
            ck._pending, ck._failing_agreed = job, agreed
            assert ck._settle(must=False, step=step) is False
            return job.cancel.cancelled

        # asked at once: progress just now keeps it, then nothing since gives way
        fresh = SaveJob(step=15, rng={})
        wrote_one(fresh)
        assert not due(fresh, 18, agreed=True), fresh.cancel.reason
        assert due(fresh, 21, agreed=True), "a retrying save without progress must give way"
        # asked at once, its last progress older than save_wait_s: gives way at once
        begun = time.monotonic() - 5.0  # begun and last written 5 s ago
        stale = SaveJob(step=21, rng={}, files_written=2, submitted=begun, wrote_at=begun)
        assert due(stale, 24, agreed=True)
        # an outage beginning mid-save (not agreed yet): progress before the first ask does not
        # count, none over its pause (save_wait_s) does: gives way at its first ask
        midway = SaveJob(step=24, rng={})
        wrote_one(midway)
        assert due(midway, 27, agreed=False)
        release.set()
        retrier.join(5)
        assert not policy.retrying  # the operation ended: nothing retries any more
    finally:
        release.set()
        if retrier is not None:
            retrier.join(5)
        ck._pending = None
        ck.close()


def _cancelled_after_a_failed_try(policy):
    """One ``policy.run`` refused once, then cancelled during its back-off (as the newest state's
    save ends an outage's stale one)."""
    from podtrain.storage.retry import Cancel, cancellation

    token = Cancel()

    def refused():
        token.cancel("a newer save")
        raise Transient("test", "503 SlowDown")

    with cancellation(token):
        policy.run("test", refused)


# -- c. a broken replica group is made anew on the main thread -----------------------------------------
def _mended_on_main(rank, world, base):
    import torch.distributed as dist

    from podtrain.ckpt import replicator as replicator_module
    from test_replica_faults import _write_step

    from podtrain.ckpt import replicas
    from podtrain.ckpt.replicator import Replicator
    from podtrain.ckpt.store import open_store

    made_on: list[str] = []
    real = replicator_module.new_side_group

    def recorded(*args, **kwargs):  # the real group; which thread asked for it is recorded
        made_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    replicator_module.new_side_group = recorded
    store = open_store(f"{base}/node{rank}")
    ring = replicas.Ring((1 - rank,), (1 - rank,))
    rep = Replicator(store, ring, rank, f"node{rank}", rank == 0, 2.0 if rank == 0 else 30.0,
                     lambda name: replicas.drop_incomplete(store, name, ring.sources))
    _write_step(store, 1, rank, 300_000)
    if rank == 1:  # a save holds rank 1's copies past rank 0's 2 s timeout: the round breaks
        rep.pause()
    rep.committed(1)
    if rank == 1:
        assert rep.held.wait(30)
        dist.barrier()
        rep.resume()
    else:
        assert rep.wait_idle(30)
        dist.barrier()
    assert rep.wait_idle(30)
    time.sleep(0.5)  # a replicator thread that would make its own group has had time to
    out = {"made_by_thread": list(made_on)}
    dist.barrier()
    out["mended"] = rep.mend() if hasattr(rep, "mend") else None  # the local save's gate: the main thread
    sent = _write_step(store, 2, rank, 300_000)
    rep.committed(2)
    assert rep.wait_idle(30)
    dist.barrier()
    copy = Path(base) / f"node{1 - rank}" / "step_000002" / replicas.replica_dir(rank) / layout.rank_file(rank)
    out.update(copied=copy.exists() and copy.read_bytes() == sent, made_on=list(made_on),
               groups=rep.groups_made, failed=rep.failed_rounds, closed=rep.close(timeout=10))
    return out


def test_a_broken_replica_group_is_made_anew_by_the_main_thread_at_the_gate(tmp_path):
    for r in run_ranks(_mended_on_main, 2, str(tmp_path), timeout=90):
        assert r["made_by_thread"] == ["MainThread"], r  # the first group only: none from the copies' thread
        assert r["mended"] is True and r["made_on"] == ["MainThread", "MainThread"], r
        assert r["failed"] == 1 and r["groups"] == 2 and r["copied"] and r["closed"], r


# -- d. the lease outlives every writer that may still write ------------------------------------------
def test_close_leaves_the_lease_to_expire_while_a_writer_may_still_write(s3_proxy, s3_bucket, tmp_path):
    """A save in flight on a storage that never answers, then ``close(deadline)``: the writer is
    left writing at the deadline, so the lease must not be released (it used to be, first of
    all): the run directory's lease file is still there, no longer renewed."""
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    run = tmp_path / "run"
    ck = Checkpointer(run, CkptSection(dir=f"s3://{s3_bucket}/ckpt", keep_last=0), single_ctx())
    assert (run / LEASE_FILE).exists()
    s3_proxy.fail_with(HANG)
    s3_proxy.outage(True)
    try:
        assert ck.save(3, net, opt, None, {"step": 3}) is True  # fits the pool: returns at once
        t0 = time.monotonic()
        stopped = ck.close(Deadline.after(2.0))
        assert time.monotonic() - t0 < 4.0
        assert stopped is False
        assert (run / LEASE_FILE).exists(), "the lease was released while a writer may still write"
        assert ck._lease._thread is None  # no longer renewed: it expires by itself
    finally:
        s3_proxy.reset()


def test_close_releases_the_lease_after_the_writers_stopped(tmp_path):
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    run = tmp_path / "run"
    ck = Checkpointer(run, CkptSection(), single_ctx())
    assert ck.save(3, net, opt, None, {"step": 3}) is True
    assert ck.close(Deadline.after(10.0)) is True
    assert not (run / LEASE_FILE).exists()
    assert [s for s, _ in layout.committed_steps(ck.store)] == [3]


# -- e. piece_index takes sidecars of the manifest's save only -----------------------------------------
def test_piece_index_refuses_a_sidecar_of_another_save_of_the_step(tmp_path):
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ck = Checkpointer(tmp_path / "run", CkptSection(), single_ctx())
    try:
        assert ck.save(2, net, opt, None, {"step": 2}) is True
        ck.wait()
    finally:
        ck.close()
    name = layout.step_name(2)
    manifest = layout.read_manifest(ck.store, name)
    assert len(piece_index(manifest, ck.store, name)) > 0  # the save's own sidecars: fine
    path = ck.store.local_path(f"{name}/{sidecar.sidecar(0)}")
    body = sidecar.decode(path.read_bytes(), str(path))
    assert body["save_id"] == manifest["save_id"]
    other = sidecar.encode(body["file"], body["bytes"], body["pieces"], None, "0" * 32)  # another save's
    path.write_bytes(other)
    with pytest.raises(CorruptCheckpoint, match=f"belongs to save {'0' * 32}, not to save {manifest['save_id']}"):
        piece_index(manifest, ck.store, name)
