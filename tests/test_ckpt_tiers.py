"""Checkpoint tiers: the node-local tier on real ranks (forked, gloo; each rank's "node" its own
directory, so no rank can read another's pieces), and S3 checkpoints through the store against
the local S3 server (the kill -9 golden resume on S3 is in test_resume.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from multirank import run_ranks
from podtrain.ckpt import layout, local_tier
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.config import load_config
from podtrain.config_sections import CkptSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """AdamW and the state-dict API imported once here, not in every forked rank."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    net, opt = _model()
    _train(net, opt, 0)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _train(net, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    net(torch.randn(4, 256, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _ctx() -> DistContext:
    env = ClusterEnv.detect()
    return DistContext(env=env, backend="gloo", device=torch.device("cpu"), initialized=env.world_size > 1)


def _cfg(base: str, rank: int) -> CkptSection:
    # Every rank's "node" has its own local disk: a rank that needed another's file would fail.
    return CkptSection(keep_last=0, local_dir=f"{base}/node{rank}", local_every=1, local_keep=2)


def _weights(net) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


def _save_rank(rank, world, base):
    """Durable step 2, then local-only steps 3, 4, 5; the process then ends (as a kill after a
    local-only save would leave it: nothing is written at exit)."""
    net, opt = _model()
    ck = Checkpointer(Path(base) / "run", _cfg(base, rank), _ctx())
    weights = {}
    for step in range(1, 6):
        _train(net, opt, step)
        if step == 2:
            ck.save(step, net, opt, None, {"step": step})
        elif step >= 3:
            assert ck.local_due(step)
            ck.save(step, net, opt, None, {"step": step}, local=True)
        ck.wait()
        weights[step] = _weights(net)
    ck.close()
    return weights


def _resume_rank(rank, world, base):
    net, opt = _model()
    _train(net, opt, 99)  # anything but the saved state
    ck = Checkpointer(Path(base) / "run", _cfg(base, rank), _ctx())
    state = ck.restore(net, opt, None)
    bytes_read = ck.bytes_read
    ck.close()
    return state.step, state.path, _weights(net), bytes_read


def test_local_tier_resumes_the_newest_step_every_rank_holds_else_the_durable_one(tmp_path):
    base = str(tmp_path)
    saved = run_ranks(_save_rank, 2, base)[0]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    # local_keep=2: each rank pruned its own parts; the durable tier has only step 2
    assert sorted(p.name for p in node0.iterdir()) == ["step_000004", "step_000005"]
    assert sorted(p.name for p in (node1 / "step_000005").iterdir()) == ["rank_00001.json", "rank_00001.safetensors"]
    assert [s for s, _ in layout.committed_steps(layout.open_store(str(tmp_path / "run" / "ckpt")))] == [2]
    # rank 0 was killed in the middle of local step 6: a part without its marker is never used
    (node0 / "step_000006").mkdir()
    (node0 / "step_000006" / "rank_00000.safetensors").write_bytes(b"partial")

    results = run_ranks(_resume_rank, 2, base)  # the local step, not the older durable one
    for rank, (step, path, weights, nbytes) in enumerate(results):
        assert step == 5 and path.startswith(str(node0))  # rank 0's local tier names it
        assert all(torch.equal(weights[k], saved[5][k]) for k in saved[5])
        assert 0 < nbytes <= 0.6 * sum(v.numel() * 4 for v in saved[5].values()) * 3  # its own share
    assert not (node0 / "step_000006").exists()

    shutil.rmtree(node1 / "step_000005")  # rank 1's copy of step 5 is gone: step 4 is common
    assert [r[0] for r in run_ranks(_resume_rank, 2, base)] == [4, 4]

    shutil.rmtree(node1)  # rank 1's node lost its local disk: the durable step 2
    results = run_ranks(_resume_rank, 2, base)
    for step, path, weights, _ in results:
        assert step == 2 and "/run/ckpt/step_000002" in path
        assert all(torch.equal(weights[k], saved[2][k]) for k in saved[2])


def test_local_tier_needs_the_saved_world_size_and_valid_config(tmp_path):
    base = str(tmp_path)
    run_ranks(_save_rank, 2, base)
    (step, path, _, _), = run_ranks(_resume_rank, 1, base)  # 1 rank: local parts are for 2
    assert step == 2 and "/run/ckpt/" in path
    assert local_tier.newest_common([[3, 4, 5], [4, 5], [5, 4]]) == 5
    assert local_tier.newest_common([[3, 4], [5]]) is None
    for bad, message in ((["ckpt.local_dir=/dev/shm/x"], "go together"),
                         (["ckpt.local_dir=s3://b/x", "ckpt.local_every=5"], "node-local path"),
                         (["ckpt.local_dir=/x", "ckpt.local_every=5", "ckpt.local_keep=0"], "at least 1"),
                         (["ckpt.dir=s3://AKIA:secret@bucket/x"], "must not carry credentials")):
        with pytest.raises(UserError, match=message):
            load_config(None, bad)


# -- S3 through the store ----------------------------------------------------------------------------
def test_s3_checkpoints_explicit_resume_listing_and_superseded_timeline(tmp_path, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/exp/ckpt"
    net, opt = _model()
    ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    ck = Checkpointer(tmp_path / "run", CkptSection(dir=url, keep_last=3), ctx)
    assert ck.store.url == url
    weights = {}
    for step in (1, 2, 3, 4):
        _train(net, opt, step)
        ck.save(step, net, opt, None, {"step": step})
        ck.wait()
        weights[step] = _weights(net)
    ck.close()
    assert [s for s, _ in layout.list_checkpoints(url)] == [2, 3, 4]  # keep_last=3, on S3
    assert layout.list_checkpoints(url)[-1][1] == f"{url}/step_000004"
    assert not s3_server.incomplete_uploads(s3_bucket)
    # ckpt.resume=s3://.../step_000002; the save of step 3 from there supersedes steps 3 and 4 of
    # the old timeline (deleted on S3, which has no rename) and auto-resume finds the new step 3
    fresh, opt2 = _model()
    ck = Checkpointer(tmp_path / "run", CkptSection(dir=url, keep_last=3, resume=f"{url}/step_000002"), ctx)
    state = ck.restore(fresh, opt2, None)
    assert state.step == 2 and all(torch.equal(fresh.state_dict()[k], weights[2][k]) for k in weights[2])
    _train(fresh, opt2, 30)
    ck.save(3, fresh, opt2, None, {"step": 3})
    ck.close()
    assert [s for s, _ in layout.list_checkpoints(url)] == [2, 3]
    again, opt3 = _model()
    ck = Checkpointer(tmp_path / "run", CkptSection(dir=url), ctx)
    assert ck.restore(again, opt3, None).step == 3
    ck.close()
    assert all(torch.equal(again.state_dict()[k], fresh.state_dict()[k]) for k in weights[2])
    with pytest.raises(UserError, match="neither a checkpoint"):
        layout.resolve_resume(f"s3://{s3_bucket}/nothing-here")
