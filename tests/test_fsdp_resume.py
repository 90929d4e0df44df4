"""FSDP checkpoints on real gloo ranks running the real training loop: golden resume after a
SIGKILL of one rank, and resume across strategies and world sizes (ddp -> fsdp -> ddp)."""

import json
from pathlib import Path

import pytest
import torch
# Imported once here, not in each forked rank (DTensor, FSDP and DCP take seconds to import).
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401

from multirank import run_ranks
from podtrain.ckpt import layout
from podtrain.ckpt.load import piece_index
from podtrain.ckpt.reader import load_latest_weights
from podtrain.storage.posix import PosixStore
from synthetic_data import make_data_dir
from test_resume import losses

STEPS = 10
OVERRIDES = [f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=8",
             "data.seq_len=32", "optim.warmup_steps=2", "eval.every=0", "ckpt.every=3",
             "ckpt.keep_last=0", "log.every=1", "log.progress=off", "monitor.watchdog=false",
             "monitor.straggler_every=0", "data.verify=false", "run.seed=5"]


def _train(rank, world, repo, run_dir, data, overrides, kill_at=None, stop_at=None):
    """The real ``podtrain train`` on this forked rank; optionally SIGKILL rank 1 mid-step
    (tests/fault_plugin's kill fault) or stop every rank after ``stop_at`` steps (the loop's
    stop seam, as a signal would)."""
    import dataclasses
    import os

    from podtrain.config import load_config
    from podtrain.distributed.env import ClusterEnv
    from podtrain.train import loop

    if kill_at is not None:
        from fault_plugin import podtrain_faults

        podtrain_faults.install(f"kill:rank=1,step={kill_at},delay=0.05")
    env = ClusterEnv.detect()
    if stop_at is not None:
        loop.Trainer._should_stop = lambda self: self.progress.step == stop_at
        # Not "torchrun" (as the forked ranks' variables suggest): a stopped torchrun worker
        # SIGTERMs its parent, which is pytest here.
        env = dataclasses.replace(env, launcher="srun")
    cfg = load_config(os.path.join(repo, "configs/demo.yaml"),
                      [f"run.dir={run_dir}", f"data.path={data}", *OVERRIDES, *overrides])
    result = loop.train(cfg, env)
    return result.step, result.exit_code


def run(world, repo, run_dir, data, *overrides, kill_at=None, stop_at=None):
    """(steps, exit code) of rank 0 after a run on ``world`` forked ranks."""
    return run_ranks(_train, world, str(repo), str(run_dir), str(data), list(overrides), kill_at,
                     stop_at, timeout=90)[0]


def manifest(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "ckpt" / layout.step_name(step) / layout.MANIFEST).read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"), shard_tokens=(6000,), val_tokens=600)


@pytest.mark.slow
def test_fsdp_golden_resume_after_sigkill_of_one_rank_mid_step(data, tmp_path, repo):
    golden = tmp_path / "golden"
    assert run(2, repo, golden, data, "dist.strategy=fsdp") == (STEPS, 0)
    assert manifest(golden, STEPS)["strategy"] == "sharded"
    shards = sorted(p.name for p in (golden / "ckpt" / layout.step_name(STEPS)).glob("rank_*.safetensors"))
    assert len(shards) == 2, shards  # each rank wrote its own piece file
    assert not [p for p in (golden / "ckpt").rglob("*") if p.suffix in (".metadata", ".distcp", ".pt")]

    killed = tmp_path / "killed"
    with pytest.raises(AssertionError, match="rank"):  # rank 1 SIGKILLed after step 5
        run(2, repo, killed, data, "dist.strategy=fsdp", kill_at=5)
    assert max(losses(killed)) >= 5 and (killed / "ckpt" / layout.step_name(3)).is_dir()
    assert not (killed / "ckpt" / layout.step_name(6)).exists()
    assert run(2, repo, killed, data, "dist.strategy=fsdp") == (STEPS, 0)  # resumes from step 3

    got, want = losses(killed), losses(golden)
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want  # bitwise, every step
    # Stopped before the first step (a save of step 0, the optimizer still empty) and resumed:
    # the same run too (no AdamW state invented by the save).
    early = tmp_path / "early"
    assert run(2, repo, early, data, "dist.strategy=fsdp", stop_at=0)[0] == 0
    assert not [t for t in manifest(early, 0)["tensors"] if t.startswith("optim/")]
    assert run(2, repo, early, data, "dist.strategy=fsdp") == (STEPS, 0)
    assert losses(early) == want
    # The offline reader (export, sample) gathers the shards into whole weights.
    _, weights, step = load_latest_weights(killed)
    _, golden_weights, _ = load_latest_weights(golden)
    assert step == STEPS and weights.keys() == golden_weights.keys()
    assert all(torch.equal(weights[k], golden_weights[k]) for k in weights)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]  # tied: stored once
    # export writes the Hugging Face folder of the fsdp run, with the gathered weights.
    from transformers import AutoModelForCausalLM

    from podtrain.export import export_run

    assert export_run(killed, tmp_path / "hf")["step"] == STEPS
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(exported[k], golden_weights[k]) for k in golden_weights)


@pytest.mark.slow
def test_resume_ddp_to_fsdp_at_four_ranks_to_ddp_matches_an_uninterrupted_ddp_run(data, tmp_path, repo):
    golden = tmp_path / "ddp"
    assert run(2, repo, golden, data) == (STEPS, 0)
    assert manifest(golden, 3)["strategy"] == "replicated"

    mixed = tmp_path / "mixed"  # steps 4-6 under fsdp on 4 ranks, from ddp's step 3
    start = golden / "ckpt" / layout.step_name(3)
    assert run(4, repo, mixed, data, "dist.strategy=fsdp", f"ckpt.resume={start}", stop_at=6)[0] == 6
    assert manifest(mixed, 6)["strategy"] == "sharded" and manifest(mixed, 6)["world_size"] == 4
    assert run(2, repo, mixed, data) == (STEPS, 0)  # steps 7-10 under ddp again, from the shards

    got, want = losses(mixed), losses(golden)
    assert sorted(got) == list(range(4, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - want[step]) < 1e-5, (step, loss, want[step])
    _, weights, _ = load_latest_weights(mixed)
    _, golden_weights, _ = load_latest_weights(golden)
    for name, ref in golden_weights.items():
        assert (weights[name] - ref).abs().max().item() < 1e-5, name


@pytest.mark.slow
def test_hsdp_two_by_two_writes_from_both_replicas_and_resumes_under_fsdp_on_two_ranks(data, tmp_path, repo):
    golden = tmp_path / "hsdp"
    assert run(4, repo, golden, data, "dist.strategy=hsdp", "dist.shard_size=2") == (STEPS, 0)
    store = PosixStore(str(golden / "ckpt"))
    pieces = piece_index(manifest(golden, 3), store, layout.step_name(3))
    sharded = {p.file for name, found in pieces.items() for p in found if name.startswith("model/")}
    assert sharded == {layout.rank_file(r) for r in range(4)}, sharded  # each replica group writes
    # ~half of the shards (byte-balanced), each rank its shard of them

    moved = tmp_path / "moved"  # steps 4-10 under fsdp on 2 ranks, from hsdp's step 3
    start = golden / "ckpt" / layout.step_name(3)
    assert run(2, repo, moved, data, "dist.strategy=fsdp", f"ckpt.resume={start}") == (STEPS, 0)
    got, want = losses(moved), losses(golden)
    assert sorted(got) == list(range(4, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - want[step]) < 1e-5, (step, loss, want[step])
