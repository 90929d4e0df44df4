"""Peer replicas of the node-local tier (``ckpt.local_replicas``) on real ranks: forked processes
over gloo, each rank a "node" of its own (its own host name, ``PODTRAIN_HOSTNAME``, which is what
places the replicas) with its own local directory; a lost node's directory is deleted, a moved
host's directory changes hands. Nodes with several ranks share a host name and a directory."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from multirank import gloo_context, run_ranks
from podtrain.ckpt import layout, replicas
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.config import load_config
from podtrain.config_sections import CkptSection
from podtrain.errors import UserError
from test_ckpt_tiers import _model, _train, _warm_imports, _weights  # noqa: F401 (a fixture)


def _node_ctx(rank: int, host: str | None = None):
    """This forked rank as the only rank of node ``rank`` (or a rank of host ``host``)."""
    os.environ.update({"GROUP_RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "PODTRAIN_HOSTNAME": host or f"node{rank}"})
    return gloo_context()


def _cfg(base: str, rank: int, k: int = 1) -> CkptSection:
    return CkptSection(keep_last=0, local_dir=f"{base}/node{rank}", local_every=1, local_keep=2, local_replicas=k)


def _save(rank, world, base, last=5):
    """Durable step 2, then local-only steps 3, 4, 5 (each replicated to the next node)."""
    net, opt = _model()
    ck = Checkpointer(Path(base) / "run", _cfg(base, rank), _node_ctx(rank))
    weights = {}
    for step in range(1, last + 1):
        _train(net, opt, step)
        ck.save(step, net, opt, None, {"step": step}, local=step >= 3)
        ck.wait()
        weights[step] = _weights(net)
    ck.close()
    return weights


def _resume(rank, world, base, train_to=0):
    """Restore; (step, where from, weights, bytes received from peers, rank 0's log lines)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("podtrain.checkpoint").addHandler(handler)
    logging.getLogger("podtrain.checkpoint").setLevel(logging.INFO)
    net, opt = _model()
    _train(net, opt, 99)  # anything but the saved state
    ck = Checkpointer(Path(base) / "run", _cfg(base, rank), _node_ctx(rank))
    state = ck.restore(net, opt, None)
    restored = _weights(net)
    for step in range(state.step + 1, train_to + 1):  # go on training, saving locally
        _train(net, opt, step)
        ck.save(step, net, opt, None, {"step": step}, local=True)
        ck.wait()
    ck.close()
    return state.step, state.path, restored, ck.restored.peer_bytes, "\n".join(lines), _weights(net), ck.restore_budget


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(replicas, "CHUNK_BYTES", 64 << 10)  # many messages per file (forked ranks inherit it)


def _lineage_dir(base: Path, node: int) -> Path:
    return next((base / f"node{node}").iterdir())


@pytest.mark.slow
def test_replicas_ring_and_restore_from_peers_in_either_rendezvous_order(tmp_path, small_chunks):
    base = str(tmp_path)
    saved = run_ranks(_save, 2, base)[0]
    node0, node1 = _lineage_dir(tmp_path, 0), _lineage_dir(tmp_path, 1)
    # each node holds its own part and the other's replica; local_keep=2 prunes replicas too
    assert sorted(p.name for p in node0.iterdir()) == ["step_000004", "step_000005"]
    held0 = sorted(p.name for p in (node1 / "step_000005" / "replica_of_rank_00000").iterdir())
    assert {"manifest.json", "meta_00000.json", "rank_00000.json", "rank_00000.safetensors"} <= set(held0)
    own1 = node1 / "step_000005" / "rank_00001.safetensors"
    own1_size = own1.stat().st_size
    copy1 = node0 / "step_000005" / "replica_of_rank_00001" / "rank_00001.safetensors"
    assert copy1.read_bytes() == own1.read_bytes() and own1.stat().st_size > 4 * (64 << 10)
    backup = tmp_path / "backup"
    shutil.copytree(tmp_path / "node0", backup / "node0")

    # node 1 is lost with its disk; a replacement joins as node 1: step 5 from rank 0's replica
    shutil.rmtree(tmp_path / "node1")
    results = run_ranks(_resume, 2, base)
    for step, path, weights, *_ in results:
        assert step == 5 and "/node0/" in path
        assert all(torch.equal(weights[k], saved[5][k]) for k in saved[5])
    assert results[0][3] == 0 and results[1][3] > own1_size  # its piece file and marker
    assert "the pieces of rank(s) 1 came from peers (rank 1 from rank 0" in results[0][4]
    assert "0 bytes from the durable tier" in results[0][4]
    budget = results[0][6]  # summed over the ranks, the same on each
    assert budget["tier"] == "local" and budget["bytes"]["peers"] == results[1][3] and budget["bytes"]["durable"] == 0
    assert budget["bytes"]["local_disk"] > 0 and budget["bytes"] == results[1][6]["bytes"]

    # the other order: the surviving host is now node 1 (rank 1), the replacement node 0 (rank 0)
    shutil.rmtree(tmp_path / "node0")
    shutil.rmtree(tmp_path / "node1")
    shutil.copytree(backup / "node0", tmp_path / "node1")
    results = run_ranks(_resume, 2, base, 8)
    for step, path, weights, *_ in results:
        assert step == 5
        assert all(torch.equal(weights[k], saved[5][k]) for k in saved[5])
    assert results[0][3] > 0 and results[1][3] == 0  # rank 1 linked its own replica, rank 0 received
    # training on from there ends where an uninterrupted run does; retention cleared the moved
    # host's old files (rank 0's, now looked after by rank 1) along with the replicas
    reference = run_ranks(_save, 2, str(tmp_path / "reference"), 8)[0][8]
    assert all(torch.equal(results[0][5][k], reference[k]) for k in reference)
    moved = _lineage_dir(tmp_path, 1)
    assert sorted(p.name for p in moved.iterdir()) == ["step_000007", "step_000008"]
    assert sorted(p.name for p in (moved / "step_000008").iterdir()) == [
        "meta_00001.json", "rank_00001.json", "rank_00001.safetensors", "replica_of_rank_00000"]


@pytest.mark.slow
def test_two_nodes_lost_with_one_replica_fall_back_to_the_durable_tier(tmp_path):
    base = str(tmp_path)
    saved = run_ranks(_save, 3, base)[0]
    shutil.rmtree(tmp_path / "node1")  # rank 1's part and its only replica (on node 2) are gone
    shutil.rmtree(tmp_path / "node2")
    results = run_ranks(_resume, 3, base)
    assert "no local checkpoint is held whole by the ranks for 3 rank(s)" in results[0][4]
    assert results[0][6]["tier"] == "durable" and results[0][6]["bytes"]["durable"] > 0
    assert results[0][6]["bytes"]["peers"] == 0 == results[0][6]["bytes"]["local_disk"]
    for step, path, weights, peer_bytes, *_ in results:
        assert step == 2 and "/run/ckpt/step_000002" in path and peer_bytes == 0
        assert all(torch.equal(weights[k], saved[2][k]) for k in saved[2])


@pytest.mark.slow
def test_every_host_moved_each_rank_sends_and_receives_at_once(tmp_path):
    """Three nodes whose hosts all moved on (rank r now runs where rank r-1 ran): every rank needs
    another's files and gives its own, all in one round of simultaneous transfers (a cycle)."""
    base = str(tmp_path)
    saved = run_ranks(_save, 3, base)[0]
    for node in range(3):
        (tmp_path / f"node{node}").rename(tmp_path / f"was{node}")
    for node in range(3):
        (tmp_path / f"was{node}").rename(tmp_path / f"node{(node + 1) % 3}")
    results = run_ranks(_resume, 3, base)
    assert "the pieces of rank(s) 0, 1, 2 came from peers" in results[0][4]
    for step, path, weights, peer_bytes, *_ in results:
        assert step == 5 and peer_bytes > 0
        assert all(torch.equal(weights[k], saved[5][k]) for k in saved[5])


def _paused(rank, world, base):
    """Rank 0 holds its replicator back (two ``pause`` calls, as two overlapping saves would) while
    a local save of step 2 commits on both ranks: nothing of step 2 is copied until both resume.
    The hold is observed, not slept on: ``held`` is set once the copying thread waits for it."""
    import torch.distributed as dist

    net, opt = _model()
    ck = Checkpointer(Path(base) / "run", _cfg(base, rank), _node_ctx(rank))
    replicator = ck._local_writer.replicator
    _train(net, opt, 1)
    ck.save(1, net, opt, None, {"step": 1}, local=True)
    ck.wait()
    seen = []
    if rank == 0:
        replicator.pause()
        replicator.pause()
    _train(net, opt, 2)
    ck.save(2, net, opt, None, {"step": 2}, local=True)  # its own pause/resume pair: still held
    ck._settle(True, True)  # step 2 committed on every rank (not ck.wait: that waits for the replicas)
    held = Path(base) / f"node{1 - rank}"
    copy2 = f"*/step_000002/replica_of_rank_{rank:05d}/rank_{rank:05d}.json"
    if rank == 0:  # the copies of step 2 began and now wait for the two holds, between two messages
        assert replicator.held.wait(30)
    dist.barrier()  # ... so both ranks look while rank 0's copies wait
    seen.append((replicator.replicated, bool(list(held.glob(copy2)))))
    dist.barrier()
    if rank == 0:
        replicator.resume()  # one hold left: still waiting
        seen.append((replicator.replicated, replicator.held.is_set()))
        replicator.resume()
    assert replicator.wait_idle(30)  # (ck.wait has nothing left to wait for: _settle took the save)
    seen.append((replicator.replicated, bool(list(held.glob(copy2)))))
    ck.close()
    return seen


@pytest.mark.slow
def test_replicas_wait_for_every_pause_to_be_resumed(tmp_path):
    seen = run_ranks(_paused, 2, str(tmp_path))
    # step 1 replicated before the pause; step 2 held back while rank 0 had a pause outstanding
    # (after one resume still one); copied once both were resumed
    assert seen[0] == [(1, False), (1, True), (2, True)]
    assert seen[1] == [(1, False), (2, True)]


def test_ring_placement_by_host_name_and_source_plan():
    block = [f"h{r // 8}" for r in range(32)]  # 4 nodes of 8, torchrun's numbering
    assert replicas.Ring.over_hosts(block, 1, 1) == replicas.Ring((9,), (25,))
    assert replicas.Ring.over_hosts([f"h{r // 2}" for r in range(8)], 6, 2) == replicas.Ring((0, 2), (4, 2))
    assert replicas.Ring.over_hosts(["a"] * 8, 0, 1) == replicas.Ring((), ())  # one node: no peers
    assert replicas.Ring.over_hosts(["a", "b"], 1, 5).targets == (0,)  # capped at the other nodes
    # srun's cyclic distribution: rank r on node r % 2; each copy goes to the other host
    cyclic = ["a", "b", "a", "b"]
    assert [replicas.Ring.over_hosts(cyclic, r, 1) for r in range(4)] == [
        replicas.Ring((1,), (1,)), replicas.Ring((0,), (0,)), replicas.Ring((3,), (3,)), replicas.Ring((2,), (2,))]
    # uneven: 2 ranks on a, 1 on b: the second rank of a has no peer, the others pair up
    uneven = ["a", "a", "b"]
    assert [replicas.Ring.over_hosts(uneven, r, 1) for r in range(3)] == [
        replicas.Ring((2,), (2,)), replicas.Ring((), ()), replicas.Ring((0,), (0,))]
    assert replicas.unreplicated(uneven, 1) == [1] and replicas.unreplicated(cyclic, 1) == []
    assert replicas.unreplicated(cyclic, 0) == [0, 1, 2, 3]
    # who looks after which files in a node's directory: its own, its sources', a share of the rest
    assert replicas.looked_after(cyclic, 0, 1) == [0, 1] and replicas.looked_after(cyclic, 2, 1) == [2, 3]
    assert replicas.looked_after(uneven, 0, 1) == [0, 2] and replicas.looked_after(uneven, 1, 1) == [1]
    # rank 1's host was replaced: it holds nothing; rank 0 holds rank 1's replica of step 5
    a, b = "0000000000000001aaaa", "0000000000000002bbbb"  # two saves, b the later
    assert replicas.plan_sources([[[4, [[0, a], [1, a]]], [5, [[0, b], [1, b]]]], []], 2) == (5, b, {0: 0, 1: 0})
    # hosts moved: rank 0 holds owner 1's part as its own files, rank 1 holds owner 0's
    assert replicas.plan_sources([[[5, [[1, a]]]], [[5, [[0, a]]]]], 2) == (5, a, {0: 1, 1: 0})
    assert replicas.plan_sources([[[5, [[0, a]]]], [[4, [[1, a]]]]], 2) is None  # no step held whole
    # two saves of step 5 (a rollback saved it again): pieces of the other save count as missing
    assert replicas.plan_sources([[[5, [[0, b], [1, a]]]], []], 2) is None
    assert replicas.plan_sources([[[4, [[0, a], [1, a]]], [5, [[0, b], [1, a]]]], []], 2) == (4, a, {0: 0, 1: 0})
    assert replicas.plan_sources([[[5, [[0, a], [1, a]]]], [[5, [[0, b], [1, b]]]]], 2) == (5, b, {0: 1, 1: 1})
    # the sends spread over the holders
    assert replicas.plan_sources([[[7, [[1, a], [2, a]]]], [[7, [[1, a], [2, a]]]], [], [[7, [[0, a], [3, a]]]]],
                                 4) == (7, a, {0: 3, 1: 1, 2: 0, 3: 3})
    with pytest.raises(UserError, match="local_replicas"):
        load_config(None, ["ckpt.local_replicas=-1"])
    assert layout.parse_step(replicas.replica_dir(3)) is None
