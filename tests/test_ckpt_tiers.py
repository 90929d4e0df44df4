"""Checkpoint tiers: the node-local tier on real ranks (forked, gloo; each rank's "node" its own
directory, so no rank can read another's pieces), and S3 checkpoints against the local S3 server:
through the store, and a real ``podtrain train`` killed with SIGKILL, rerun, compared with an
uninterrupted run (forked children, no torchrun)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from multirank import gloo_context, run_ranks
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
    return gloo_context()


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
    bytes_read = ck.restored.bytes_read
    ck.close()
    return state.step, state.path, _weights(net), bytes_read


@pytest.mark.slow
def test_local_tier_resumes_the_newest_step_every_rank_holds_else_the_durable_one(tmp_path):
    base = str(tmp_path)
    saved = run_ranks(_save_rank, 2, base)[0]
    # each run keeps its own folder of the local tier, named by its lineage
    lineage = json.loads((tmp_path / "run" / "lineage.json").read_text())["lineage"]
    assert [p.name for p in (tmp_path / "node0").iterdir()] == [lineage]
    node0, node1 = tmp_path / "node0" / lineage, tmp_path / "node1" / lineage
    # local_keep=2: each rank pruned its own parts; the durable tier has only step 2
    assert sorted(p.name for p in node0.iterdir()) == ["step_000004", "step_000005"]
    assert sorted(p.name for p in (node1 / "step_000005").iterdir()) == [
        "meta_00001.json", "rank_00001.json", "rank_00001.safetensors"]
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
    (step, path, _, _), = run_ranks(_resume_rank, 1, base)  # 1 rank: the local parts are for 2
    assert step == 2 and "/run/ckpt/" in path

    shutil.rmtree(node1 / "step_000005")  # rank 1's copy of step 5 is gone: step 4 is common
    assert [r[0] for r in run_ranks(_resume_rank, 2, base)] == [4, 4]

    shutil.rmtree(node1)  # rank 1's node lost its local disk: the durable step 2
    results = run_ranks(_resume_rank, 2, base)
    for step, path, weights, _ in results:
        assert step == 2 and "/run/ckpt/step_000002" in path
        assert all(torch.equal(weights[k], saved[2][k]) for k in saved[2])


def test_newest_common_local_step_and_tier_config_errors():
    from podtrain.ckpt.restore import newest_held_by_all  # (several ranks: tests/test_collective_bytes.py)

    one = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    assert newest_held_by_all(one, [(3, "a"), (5, "c"), (4, "b")]) == (5, "c")
    assert newest_held_by_all(one, []) is None
    for bad, message in ((["ckpt.local_dir=/dev/shm/x"], "go together"),
                         (["ckpt.local_dir=s3://b/x", "ckpt.local_every=5"], "node-local path"),
                         (["ckpt.local_dir=/x", "ckpt.local_every=5", "ckpt.local_keep=0"], "at least 1"),
                         (["ckpt.dir=s3://AKIA:secret@bucket/x"], "must not carry credentials")):
        with pytest.raises(UserError, match=message):
            load_config(None, bad)


# -- S3 through the store ----------------------------------------------------------------------------
@pytest.mark.slow
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


# -- kill -9 mid-run with ckpt.dir on S3: the same losses as an uninterrupted run ----------------------
TRAIN = ["data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2", "log.progress=plain",
         "monitor.watchdog=false", "eval.every=0", "log.every=1", "optim.warmup_steps=2",
         "monitor.straggler_every=0", "train.steps=6", "log.peak_flops=1e12", "log.trackers=none"]


def _train_child(args: list[str], fault: str | None) -> None:
    from fault_plugin.podtrain_faults import install

    from podtrain.cli import main

    if fault:
        install(fault)
    os._exit(main(["train", "configs/demo.yaml", *args]))


def _forked_train(*args: str, fault: str | None = None) -> int:
    """One real ``podtrain train`` (one rank) in a forked child, which a fault may kill -9."""
    proc = mp.get_context("fork").Process(target=_train_child, args=(list(args), fault))
    proc.start()
    proc.join(120)
    return proc.exitcode


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_s3_kill9_mid_run_then_rerun_gives_the_losses_and_weights_of_an_uninterrupted_run(
        tmp_path, s3_bucket, s3_server, repo, monkeypatch):
    from s3_server import TEST_SECRET
    from synthetic_data import make_data_dir

    from podtrain.ckpt.reader import load_latest_weights

    monkeypatch.chdir(repo)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    golden, run, url = tmp_path / "golden", tmp_path / "run", f"s3://{s3_bucket}/team/ckpt"
    assert _forked_train(f"data.path={data}", f"run.dir={golden}", *TRAIN, "ckpt.every=0") == 0
    # step 3 is on S3 when step 4 starts (a foreground save); killed 50 ms into step 5
    on_s3 = (f"data.path={data}", f"run.dir={run}", f"ckpt.dir={url}", *TRAIN, "ckpt.every=3", "ckpt.async_save=false")
    assert _forked_train(*on_s3, fault="kill:rank=0,step=4,delay=0.05") == -9
    assert _forked_train(*on_s3) == 0
    resumed = [r["step"] for r in _records(run) if r.get("kind") == "segment" and r.get("resumed")]
    assert resumed == [3], resumed
    expected = {r["step"]: r["loss"] for r in _records(golden) if r.get("kind") == "train"}
    got = {r["step"]: r["loss"] for r in _records(run) if r.get("kind") == "train"}  # the last of each
    assert got == expected
    _, weights, step = load_latest_weights(run)  # through config.yaml's ckpt.dir: from S3
    _, golden_weights, _ = load_latest_weights(golden)
    assert step == 6 and all(torch.equal(weights[k], golden_weights[k]) for k in golden_weights)
    assert not (run / "ckpt").exists() and any(k.startswith("team/ckpt/step_000006/") for k in s3_server.keys(s3_bucket))
    for path in run.rglob("*"):  # the environment holds the secret; no file of the run does
        assert not path.is_file() or TEST_SECRET.encode() not in path.read_bytes(), path
