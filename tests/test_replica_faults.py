"""Faults of the node-local tier and its peer replicas, on real ranks (forked, gloo; each rank a node
of its own host name and local directory): a step saved twice (a rollback) never restores as a mix
of the two saves; a failed replication round does not stop the replicator; every wait on it has a
deadline; and replicas are placed by host name, whatever the launcher's rank order or the number
of processes per node."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from multirank import gloo_context, run_ranks
from podtrain.ckpt import layout, local_tier, replicas, sidecar
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.replicator import Replicator
from podtrain.ckpt.store import open_store
from podtrain.config_sections import CkptSection
from test_ckpt_tiers import _model, _train, _warm_imports, _weights  # noqa: F401 (a fixture)


def _host_ctx(rank: int, hosts: list[str]):
    """This forked rank placed as a launcher would place it on ``hosts[rank]`` (its local rank and
    count on that host, the node's index), with that host name."""
    here = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    nodes = list(dict.fromkeys(hosts))
    os.environ.update({"PODTRAIN_HOSTNAME": hosts[rank], "LOCAL_RANK": str(here.index(rank)),
                       "LOCAL_WORLD_SIZE": str(len(here)), "GROUP_RANK": str(nodes.index(hosts[rank]))})
    return gloo_context()


def _cfg(base: str, host: str, **kw) -> CkptSection:
    return CkptSection(keep_last=0, local_dir=f"{base}/{host}", local_every=1, local_keep=2, local_replicas=1, **kw)


def _optimizer_state(opt) -> dict:
    return {(i, k): v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()
            if torch.is_tensor(v)}


# -- a step saved twice: never a mix of the two saves ------------------------------------------------
def _timeline_a(rank, world, base):
    """Durable step 2, then local step 3 (replicated to the other node). Step 2's state, as saved."""
    hosts = ["node0", "node1"]
    net, opt = _model()
    ck = Checkpointer(Path(base) / "run", _cfg(base, hosts[rank]), _host_ctx(rank, hosts))
    at2 = None
    for step in (1, 2, 3):
        _train(net, opt, step)
        ck.save(step, net, opt, None, {"step": step}, local=step == 3)
        ck.wait()
        if step == 2:
            at2 = (_weights(net), _optimizer_state(opt))
    ck.close()
    return at2


def _timeline_b(rank, world, base):
    """The rollback: ``ckpt.resume`` names durable step 2; step 3 is trained on other data and
    saved again, to the local tier."""
    hosts = ["node0", "node1"]
    net, opt = _model()
    cfg = _cfg(base, hosts[rank], resume=str(Path(base) / "run" / "ckpt" / "step_000002"))
    ck = Checkpointer(Path(base) / "run", cfg, _host_ctx(rank, hosts))
    assert ck.restore(net, opt, None).step == 2
    _train(net, opt, 300)
    ck.save(3, net, opt, None, {"step": 3}, local=True)
    ck.wait()
    ck.close()
    return _weights(net)


def _resume(rank, world, base):
    hosts = ["node0", "node1"]
    net, opt = _model()
    _train(net, opt, 99)  # anything but a saved state
    ck = Checkpointer(Path(base) / "run", _cfg(base, hosts[rank]), _host_ctx(rank, hosts))
    state = ck.restore(net, opt, None)
    ck.close()
    return state.step, state.path, _weights(net), _optimizer_state(opt)


def _ids(folder: Path, owner: int) -> tuple:
    """The save ids of rank ``owner``'s marker and sidecar in ``folder`` (None: none named)."""
    marker = json.loads((folder / local_tier.marker(owner)).read_text()).get("save_id")
    data = (folder / sidecar.sidecar(owner)).read_bytes()
    return marker, sidecar.decode(data, str(folder)).get("save_id")


@pytest.mark.slow
def test_a_step_saved_again_after_a_rollback_never_restores_as_a_mix_of_two_saves(tmp_path):
    """The issue's reproduction: 2 nodes, K=1; timeline A saves local step 3 (replicated); a
    rollback to durable step 2 (``ckpt.resume``) saves step 3 again (timeline B); the disk is as a
    kill right after B's local commit left it before (B's own files, A's replica of rank 1 on node
    0), and node 1 is lost with its disk. The pieces on hand are B's for rank 0 and A's for rank 1,
    each file whole and every CRC good: restore must take neither, and resume from step 2."""
    base = str(tmp_path)
    at2 = run_ranks(_timeline_a, 2, base)
    node0 = next((tmp_path / "node0").iterdir())
    step3 = node0 / "step_000003"
    a_replica = tmp_path / "a_replica_of_rank_1"
    shutil.copytree(step3 / replicas.replica_dir(1), a_replica)
    run_ranks(_timeline_b, 2, base)
    durable_id = json.loads((tmp_path / "run" / "ckpt" / "step_000002" / layout.MANIFEST).read_text()).get("save_id")
    b_id = json.loads((step3 / layout.MANIFEST).read_text()).get("save_id")
    node1 = next((tmp_path / "node1").iterdir())
    ids = [_ids(step3, 0), _ids(node1 / "step_000003", 1), _ids(node1 / "step_000003" / replicas.replica_dir(0), 0)]
    a_ids = _ids(a_replica, 1)
    # B's replication had not run: node 0 still holds A's replica of rank 1; node 1 is lost
    shutil.rmtree(step3 / replicas.replica_dir(1))
    shutil.copytree(a_replica, step3 / replicas.replica_dir(1))
    shutil.rmtree(tmp_path / "node1")

    results = run_ranks(_resume, 2, base)
    weights2, moments2 = at2[0]
    for step, path, weights, moments in results:
        assert step == 2 and path.endswith("/run/ckpt/step_000002"), (step, path)
        assert all(torch.equal(weights[k], weights2[k]) for k in weights2)
        assert moments.keys() == moments2.keys() and all(torch.equal(moments[k], moments2[k]) for k in moments2)
    # every file of a save names it: the durable manifest, the local ones, the sidecars and markers,
    # and the replicas (B's replica of rank 0 on node 1 is B's: A's was gone before B's arrived)
    assert b_id and durable_id and a_ids[0] and len({durable_id, a_ids[0], b_id}) == 3
    assert ids == [(b_id, b_id)] * 3 and a_ids == (a_ids[0], a_ids[0])


def test_a_sidecar_of_another_save_is_refused_like_a_damaged_one(tmp_path):
    manifest = {"save_id": "b"}
    for body in ({"save_id": "a", "pieces": []}, {"pieces": []}):
        data = json.dumps(body).encode()
        try:
            sidecar.check_save(body, manifest, "meta_00000.json")
        except Exception as exc:
            assert type(exc).__name__ == "CorruptCheckpoint" and "not to save b" in str(exc), exc
        else:
            raise AssertionError(f"{data!r} was accepted for save b")
    sidecar.check_save({"save_id": "b"}, manifest, "x")
    sidecar.check_save({"pieces": []}, {}, "x")  # written before save ids: not checked
    encoded = sidecar.encode(None, 0, [], None, "b")
    assert sidecar.decode(encoded, "x")["save_id"] == "b"


# -- a failed round does not stop the replicator; its waits have deadlines ---------------------------
def _write_step(store, step: int, rank: int, nbytes: int) -> bytes:
    """Rank ``rank``'s committed files of local ``step`` (a piece file of ``nbytes``, its marker)."""
    name, rel = layout.step_name(step), layout.rank_file(rank)
    data = os.urandom(nbytes)
    store.write_bytes(f"{name}/{rel}", data)
    local_tier.write_marker(store, name, rank, 2, (rel, {"bytes": nbytes}), "lineage")
    return data


def _failed_round(rank, world, base):
    import torch.distributed as dist

    store = open_store(f"{base}/node{rank}")
    ring = replicas.Ring((1 - rank,), (1 - rank,))  # two nodes, one replica
    # rank 0's collectives time out after 2 s; rank 1's copies wait up to 15 s (half its timeout)
    # for a save that holds them: a peer stalled past rank 0's timeout, as a slow disk makes one
    rep = Replicator(store, ring, rank, f"node{rank}", rank == 0, 2.0 if rank == 0 else 30.0,
                     lambda name: replicas.drop_incomplete(store, name, ring.sources))
    _write_step(store, 1, rank, 300_000)
    if rank == 1:  # a save holds rank 1's copies: rank 0 waits for its message past its timeout
        rep.pause()
    rep.committed(1)
    out = {}
    if rank == 1:
        assert rep.held.wait(30)
        t0 = time.monotonic()
        out["idle_in_0.5s"] = rep.wait_idle(timeout=0.5)  # a deadline, not the group's timeout
        out["waited_s"] = time.monotonic() - t0
        dist.barrier()  # rank 0 gave step 1 up
        rep.resume()  # its own messages now meet a group rank 0 destroyed: it fails too
    else:
        out["idle"] = rep.wait_idle(30)
        out["protected_after_failure"] = list(rep.protected())
        dist.barrier()
    assert rep.wait_idle(30)
    dist.barrier()
    assert rep.mend()  # the local save's gate (main thread, every rank): the broken group made anew
    sent = _write_step(store, 2, rank, 300_000)  # the next round runs, on a new group
    rep.committed(2)
    out["idle2"] = rep.wait_idle(30)
    dist.barrier()
    copy = Path(base) / f"node{1 - rank}" / "step_000002" / replicas.replica_dir(rank) / layout.rank_file(rank)
    out["copied"] = copy.read_bytes() == sent
    out["step1_replica"] = (Path(base) / f"node{rank}" / "step_000001" / replicas.replica_dir(1 - rank)
                            / local_tier.marker(1 - rank)).exists()
    out.update(replicated=rep.replicated, last=rep.last.get("step"), failed=rep.failed_rounds,
               groups=rep.groups_made, protected=list(rep.protected()))
    t0 = time.monotonic()
    out["closed"] = rep.close(timeout=10)
    out["close_s"] = time.monotonic() - t0
    return out


def test_a_failed_round_is_logged_and_the_next_round_runs_on_a_new_group(tmp_path):
    r0, r1 = run_ranks(_failed_round, 2, str(tmp_path), timeout=90)
    assert r0["idle"] and r0["protected_after_failure"] == []  # retention is not held by a failed round
    assert r1["idle_in_0.5s"] is False and r1["waited_s"] < 2
    for r in (r0, r1):
        assert r["failed"] == 1 and r["groups"] == 2  # step 1 given up, the group made anew once
        assert r["idle2"] and r["copied"] and r["replicated"] == 1 and r["last"] == 2
        assert not r["step1_replica"]  # nothing of the failed round is held as a replica
        assert r["protected"] == [] and r["closed"] and r["close_s"] < 5


# -- placement by host name ---------------------------------------------------------------------------
def _placed(rank, world, base, hosts, last):
    """Local steps 1..``last`` (replicated) on ranks placed on ``hosts`` (each host a directory);
    the weights at ``last`` and rank 0's log."""
    import logging

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("podtrain.checkpoint").addHandler(handler)
    logging.getLogger("podtrain.checkpoint").setLevel(logging.INFO)
    net, opt = _model()
    ck = Checkpointer(Path(base) / "run", _cfg(base, hosts[rank]), _host_ctx(rank, hosts))
    for step in range(1, last + 1):
        _train(net, opt, step)
        ck.save(step, net, opt, None, {"step": step}, local=True)
        ck.wait()
    ck.close()
    return _weights(net), "\n".join(lines)


def _placed_resume(rank, world, base, hosts):
    net, opt = _model()
    _train(net, opt, 99)
    ck = Checkpointer(Path(base) / "run", _cfg(base, hosts[rank]), _host_ctx(rank, hosts))
    state = ck.restore(net, opt, None)
    ck.close()
    return state.step, _weights(net), ck.restored.peer_bytes


def _replicas_in(base: Path, host: str, step: int) -> list[str]:
    folder = next((base / host).iterdir()) / layout.step_name(step)
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(replicas.REPLICA_PREFIX))


@pytest.mark.slow
def test_srun_cyclic_ranks_send_each_copy_to_another_node(tmp_path):
    """srun's cyclic distribution: ranks 0 and 2 on host a, 1 and 3 on host b (rank arithmetic
    took rank 2 for rank 0's peer: the same host). Each copy lands on the other host, and a lost
    host is restored from the copies."""
    hosts = ["a", "b", "a", "b"]
    saved = run_ranks(_placed, 4, str(tmp_path), hosts, 2, timeout=90)[0][0]
    assert _replicas_in(tmp_path, "a", 2) == [replicas.replica_dir(1), replicas.replica_dir(3)]
    assert _replicas_in(tmp_path, "b", 2) == [replicas.replica_dir(0), replicas.replica_dir(2)]
    shutil.rmtree(tmp_path / "b")
    results = run_ranks(_placed_resume, 4, str(tmp_path), hosts, timeout=90)
    for rank, (step, weights, peer_bytes) in enumerate(results):
        assert step == 2 and all(torch.equal(weights[k], saved[k]) for k in saved)
        assert (peer_bytes > 0) == (rank in (1, 3))


@pytest.mark.slow
def test_uneven_processes_per_node_start_replicate_and_restore(tmp_path):
    """Two ranks on host a, one on host b: every rank agrees on the placement (no rank makes a
    group the others do not), the ranks at the same position pair up across the hosts, and the
    one rank without a peer is named in one line."""
    hosts = ["a", "a", "b"]
    (saved, log0), *_ = run_ranks(_placed, 3, str(tmp_path), hosts, 2, timeout=60)
    assert _replicas_in(tmp_path, "a", 2) == [replicas.replica_dir(2)]
    assert _replicas_in(tmp_path, "b", 2) == [replicas.replica_dir(0)]
    assert "rank(s) 1 have no rank at their position on another node" in log0
    shutil.rmtree(tmp_path / "b")  # rank 2's part survives as rank 0's replica on host a
    for step, weights, _ in run_ranks(_placed_resume, 3, str(tmp_path), hosts, timeout=60):
        assert step == 2 and all(torch.equal(weights[k], saved[k]) for k in saved)
