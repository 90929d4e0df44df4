"""Restoring a local step from a peer (``replicas.repair``) when the holder cannot read what it
must send: both ranks of the pair still run the round to its end, so the receiver is never left
waiting for a header until the group's timeout (found by ``bench/faultspace.py --quick``'s peer
scenario: rank 0's read of the replica marker denied left rank 1 in a 30 s gloo wait, a bug exit)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from multirank import run_ranks
from podtrain.ckpt import layout, local_tier, replicas
from podtrain.ckpt.store import open_store
from podtrain.storage.errors import AccessDenied

NAME = layout.step_name(2)
PIECES = bytes(range(256)) * 40


class _DenyingStore:
    """A real POSIX store whose reads of one file are refused: the fault this test injects (a
    volume that denies the holder's read of the peer's replica marker)."""

    def __init__(self, store, denied: str) -> None:
        self._store, self._denied, self.url = store, denied, store.url

    def read_bytes(self, name: str) -> bytes:
        if name == self._denied:
            raise AccessDenied(self._store.where(name), "injected: access denied")
        return self._store.read_bytes(name)

    def __getattr__(self, attr):
        return getattr(self._store, attr)


def _repair_rank(rank: int, world: int, base: str, deny: bool):
    import torch.distributed as dist

    # a group of its own with a short timeout: a rank left waiting fails in 10 s, not the default 60
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=10))
    store = open_store(f"{base}/node{rank}")
    if rank == 0 and deny:
        store = _DenyingStore(store, f"{NAME}/{replicas.replica_dir(1)}/{local_tier.marker(1)}")
    try:  # rank 0 holds its own files and rank 1's replica; rank 1 (a new node) holds nothing
        outcome = ("ok", replicas.repair(store, 2, "s1", {0: 0, 1: 0}, rank, group))
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    here = Path(base) / f"node{rank}" / NAME
    return outcome, sorted(p.name for p in here.iterdir() if p.is_file()) if here.is_dir() else []


@pytest.mark.parametrize("deny", [False, True])
def test_a_holder_that_cannot_read_the_replica_still_ends_the_round(tmp_path, deny):
    step = tmp_path / "node0" / NAME
    (step / replicas.replica_dir(1)).mkdir(parents=True)
    (tmp_path / "node1").mkdir()
    (step / local_tier.marker(0)).write_text(json.dumps({"world_size": 2, "save_id": "s1", "file": None}))
    replica = step / replicas.replica_dir(1)
    (replica / layout.rank_file(1)).write_bytes(PIECES)
    (replica / local_tier.marker(1)).write_text(json.dumps({"world_size": 2, "save_id": "s1",
                                                           "file": layout.rank_file(1), "bytes": len(PIECES)}))
    (holder, _), (receiver, received) = run_ranks(_repair_rank, 2, str(tmp_path), deny, timeout=90)
    if not deny:  # the round as it runs without the fault: rank 1 receives its files as its own
        assert holder == ("ok", 0)
        assert receiver[0] == "ok" and receiver[1] > len(PIECES)
        assert received == sorted([layout.rank_file(1), local_tier.marker(1)])
        assert (tmp_path / "node1" / NAME / layout.rank_file(1)).read_bytes() == PIECES
        return
    # the holder says what failed, after the round; the receiver got a header of no files at once
    assert holder[0] == "CopyFailed" and "AccessDenied" in holder[1] and "injected" in holder[1], holder
    assert f"{replicas.replica_dir(1)}/{local_tier.marker(1)}" in holder[1], holder
    assert receiver == ("ok", 0), receiver
    assert received == []  # nothing committed as rank 1's files
