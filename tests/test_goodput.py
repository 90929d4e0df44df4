"""Goodput: honest resumes, the spike guard, checkpoint intervals and the goodput line.

Runs are real `podtrain train` calls in this process (one rank) or forked gloo ranks; the data is
hand-made (tests/synthetic_data.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from podtrain.ckpt import layout
from podtrain.storage.posix import PosixStore
from podtrain.ckpt.interval import SaveSchedule, young_daly_seconds
from podtrain.ckpt.reader import read_checkpoint
from podtrain.cli import main
from podtrain.config import load_config
from podtrain.config_sections import CkptSection
from podtrain.errors import UserError
from synthetic_data import make_data_dir

BASE = ["data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2", "log.progress=plain",
        "monitor.watchdog=false", "eval.every=0", "log.every=1", "optim.warmup_steps=2",
        "monitor.straggler_every=0"]


@pytest.fixture
def data(tmp_path):
    return make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)


def train(capsys, data, run_dir, *overrides):
    code = main(["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={run_dir}", *BASE, *overrides])
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


# -- 1. resume honesty -------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_applies_a_new_weight_decay_and_refuses_a_new_preset(capsys, data, tmp_path, repo,
                                                                     monkeypatch):
    from podtrain.config import load_config as load
    from podtrain.train import loop

    monkeypatch.chdir(repo)
    run = tmp_path / "run"
    code, _, _ = train(capsys, data, run, "train.steps=2", "ckpt.every=1")
    assert code == 0
    # The golden part: the optimizer the resumed run steps with has the new weight decay.
    seen = {}
    real_run = loop.Trainer.run

    def run_and_look(self):
        seen["groups"] = [(g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in self.optimizer.param_groups]
        return real_run(self)

    monkeypatch.setattr(loop.Trainer, "run", run_and_look)
    cfg = load("configs/demo.yaml", [f"data.path={data}", f"run.dir={run}", *BASE, "train.steps=3",
                                     "optim.weight_decay=0.01", "optim.beta2=0.99"])
    assert loop.train(cfg).step == 3
    assert seen["groups"] == [(0.01, (0.9, 0.99), 1e-8), (0.0, (0.9, 0.99), 1e-8)]
    lines = [x for x in capsys.readouterr().out.splitlines() if "optimizer hyperparameters" in x]
    assert len(lines) == 1 and "optim.weight_decay 0.1 -> 0.01" in lines[0], lines
    # A changed model is refused in one line naming the key and both values (another small
    # model, given as a config.json: a big preset would cost seconds to build before the check).
    from podtrain.model import preset_config

    other = preset_config("tiny", 320)
    other.intermediate_size *= 2
    other.save_pretrained(tmp_path / "wider")
    code, err, _ = train(capsys, data, run, "train.steps=4", f"model.preset={tmp_path / 'wider'}")
    assert code == 2 and len(err) == 1, err
    assert f"model.preset was 'tiny', now '{tmp_path / 'wider'}'" in err[0] and "ckpt.allow_changes" in err[0]


def test_math_changes_are_named_and_can_be_allowed(capsys, data, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    run = tmp_path / "run"
    assert train(capsys, data, run, "train.steps=2", "ckpt.every=1")[0] == 0
    code, err, _ = train(capsys, data, run, "train.steps=3", "run.seed=7", "data.seq_len=16")
    assert code == 2 and len(err) == 1
    assert "data.seq_len was 32, now 16" in err[0] and "run.seed was 1234, now 7" in err[0]
    code, err, _ = train(capsys, data, run, "train.steps=3", "run.seed=7", "ckpt.allow_changes=[run.seed]")
    assert code == 2 and "run.seed" in err[0]  # allowed here, but the loader refuses another order
    with pytest.raises(UserError, match="not a key that alters the math"):
        load_config(None, ["ckpt.allow_changes=[optim.lr]"])


def _replica_check_after_restore(rank, world, run_dir, data, repo):
    import os

    from podtrain.ckpt import restore as checkpointer  # the resume half of Checkpointer
    from podtrain.train.loop import train as train_run

    os.chdir(repo)
    if rank == 1:  # this rank's view of the storage serves other weights (a stale cache)
        real = checkpointer.finish

        def stale(plan, net, *a, **kw):
            state = real(plan, net, *a, **kw)
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1e-3)
            return state
        checkpointer.finish = stale
    cfg = load_config("configs/demo.yaml", [f"data.path={data}", f"run.dir={run_dir}", *BASE,
                                            "train.global_batch_size=4", "train.steps=3"])
    try:
        train_run(cfg)
    except Exception as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_replicas_are_checked_after_the_restore(capsys, data, tmp_path, repo, monkeypatch):
    from multirank import run_ranks

    monkeypatch.chdir(repo)
    run = tmp_path / "run"
    assert train(capsys, data, run, "train.steps=2", "train.global_batch_size=4", "ckpt.every=1")[0] == 0
    errors = run_ranks(_replica_check_after_restore, 2, str(run), str(data), str(repo), timeout=90)
    assert all(e is not None and "replicas differ from rank 0's" in e and "rank 1 on" in e for e in errors), errors


# -- 2. cosine warning on a changed train.steps -------------------------------------------------------
@pytest.mark.slow
def test_extending_a_cosine_run_warns(capsys, data, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    run = tmp_path / "run"
    assert train(capsys, data, run, "train.steps=3", "ckpt.every=1")[0] == 0
    code, _, out = train(capsys, data, run, "train.steps=5")
    assert code == 0 and "train.steps changed from 3 to 5 under optim.schedule=cosine" in out


# -- 3. the spike and non-finite guard ----------------------------------------------------------------
def test_absurd_lr_never_writes_a_non_finite_checkpoint(capsys, data, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    run = tmp_path / "run"
    code, err, _ = train(capsys, data, run, "train.steps=40", "optim.lr=1e6", "ckpt.every=1",
                         "ckpt.keep_last=0", "ckpt.async_save=false", "optim.warmup_steps=0",
                         "guard.max_skips=2", "guard.window=10")
    assert code == 2 and len(err) == 1, err
    assert "non-finite or spiking gradients" in err[0] and "their samples:" in err[0], err
    checkpoints = layout.list_checkpoints(run / "ckpt")
    assert checkpoints, "the run should have saved before its weights went bad"
    store = PosixStore(str(run / "ckpt"))
    for _, path in checkpoints:
        data = read_checkpoint(store, path.name, layout.read_manifest(store, path.name))
        for name, t in data.model_state.items():
            assert torch.isfinite(t).all(), f"{path.name}/{name} holds non-finite weights"
    skips = [json.loads(line) for line in (run / "skipped.jsonl").read_text().splitlines()]
    assert len(skips) == 1 and skips[0]["sample_ids"] and skips[0]["end"] > skips[0]["start"]
    assert "after 1 rollback(s)" in err[0]
    lines = records(run)
    assert sum(r["skipped_steps"] for r in lines) >= 4  # two before the rollback, two after
    assert any(r["loss"] is None or not math.isfinite(r["loss"]) or r["skipped_steps"] for r in lines)


def test_a_nan_loss_on_one_rank_is_skipped_by_every_rank():
    """The device half of the guard on 2 forked gloo ranks: rank 1's loss is NaN at step 2 only."""
    from multirank import run_ranks

    results = run_ranks(_poisoned_step, 2, timeout=60)
    assert results[0] == results[1]
    skipped, changed = results[0]
    assert skipped == [False, True, False] and changed == [True, False, True]


def _poisoned_step(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from podtrain.config_sections import GuardSection
    from podtrain.train.guard import StepJudge
    from podtrain.train.precision import resolve_precision
    from podtrain.train.step import Stepper
    from podtrain.train.strategy import DDPStrategy

    torch.manual_seed(0)
    emb = torch.nn.Embedding(16, 8)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = emb, torch.nn.Linear(8, 16)
            self.poison = False

        def forward(self, input_ids):
            logits = self.out(self.emb(input_ids))
            if self.poison:
                logits = logits * float("nan")
            return type("O", (), {"logits": logits})

    net = Net()
    ddp = DDP(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    stepper = Stepper(ddp, DDPStrategy.of(ddp), opt, resolve_precision("fp32", torch.device("cpu")), 1.0, world, 2 * 2 * 4,
                      torch.device("cpu"), judge=StepJudge(GuardSection(spike_factor=0), torch.device("cpu")))
    changed = []
    for step in range(3):
        net.poison = rank == 1 and step == 1
        before = net.out.weight.detach().clone()
        stepper.step([torch.randint(0, 16, (2, 5))])
        changed.append(not torch.equal(before, net.out.weight))
    stepper.stats.read(lambda t: torch.distributed.all_reduce(t))
    return stepper.stats.skipped, changed


def test_a_gradient_spike_is_judged_against_the_median():
    from podtrain.config_sections import GuardSection
    from podtrain.train.guard import StepJudge

    judge = StepJudge(GuardSection(spike_factor=5.0, history=4), torch.device("cpu"))
    verdicts = [bool(judge.judge(torch.tensor(v))) for v in (1.0, 1.2, 0.9, 1.1, 50.0, 1.0, float("inf"))]
    assert verdicts == [False, False, False, False, True, False, True]


# -- 4. ckpt.every=auto ----------------------------------------------------------------------------
def test_young_daly_interval_and_grace_warning(caplog):
    assert young_daly_seconds(2.0, 3600.0) == pytest.approx(120.0)
    plan = SaveSchedule(CkptSection(every="auto", mtbf_h=1.0, grace_s=10.0), start_step=0)
    assert [s for s in range(1, 12) if plan.should_save(s, 100)] == [10, 11]
    plan.saved(10, stall_s=2.0, step_s=0.5)  # sqrt(2 x 2 x 3600) = 120 s = 240 steps
    assert plan.every == 240 and not plan.should_save(249, 1000) and plan.should_save(250, 1000)
    with caplog.at_level("WARNING", logger="podtrain.checkpoint"):
        plan.check_grace({"stall_s": 2.0, "write_s": 9.0})
        plan.check_grace({"stall_s": 2.0, "write_s": 9.0})
    warned = [r for r in caplog.records if "ckpt.grace_s is 10 s" in r.getMessage()]
    assert len(warned) == 1


# -- 5. goodput after a kill and a resume -------------------------------------------------------------
@pytest.mark.slow
def test_goodput_line_counts_the_steps_redone_after_a_kill(capsys, data, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    run = tmp_path / "run"
    assert train(capsys, data, run, "train.steps=5", "ckpt.every=2")[0] == 0
    # "Kill" after step 5 was logged but only step 4 was checkpointed: the newest checkpoint goes,
    # and so does the closing line a killed attempt never writes.
    layout.Housekeeping(strict=True).remove(PosixStore(str(run / "ckpt")), layout.step_name(5))
    (run / "ckpt" / "latest").write_text(layout.step_name(4))
    metrics = (run / "metrics.jsonl").read_text().splitlines()
    assert json.loads(metrics[-1])["ended"] == "finished"
    (run / "metrics.jsonl").write_text("\n".join(metrics[:-1]) + "\n")
    code, _, out = train(capsys, data, run, "train.steps=7", "ckpt.every=2", "optim.schedule=wsd")
    assert code == 0
    line = [x for x in out.splitlines() if "] goodput " in x]
    assert len(line) == 1 and "redone" in line[0] and "(1 steps)" in line[0], out
    final = records(run, "goodput")[-1]
    assert final["goodput_s"]["redone"] > 0 and final["goodput_s"]["restarts"] > 0
    assert 0 < final["goodput_pct"] < 100
    assert final["goodput_s"]["productive"] > final["goodput_attempt_s"]["productive"]  # both attempts


# -- 6. health verdicts ------------------------------------------------------------------------------
def test_verdicts_blame_nodes_by_the_rules(tmp_path):
    import time

    from podtrain.distributed import health
    from podtrain.distributed.watchdog import Watchdog

    exits = []
    dog = Watchdog(tmp_path / "debug", rank=3, startup_timeout_s=0.2, step_timeout_s=0.2,
                   host="n7", exit_grace_s=0, exit_fn=exits.append, run_dir=tmp_path).start()
    dog.beat(4)
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [124]
    health.write_verdict(tmp_path, "hang", "n8", 5, {"last_step": 5})  # a peer that got further
    health.write_verdict(tmp_path, "straggler", "n2", 1, {"step": 10})
    assert health.blamed_nodes(health.read_verdicts(tmp_path)) == ["n7"]  # one straggler report: noise
    health.write_verdict(tmp_path, "straggler", "n2", 1, {"step": 20})
    health.write_verdict(tmp_path, "doctor", "n9", 0, {"check": "compute"})
    verdicts = health.read_verdicts(tmp_path)
    hang = [v for v in verdicts if v["node"] == "n7"][0]
    assert hang["kind"] == "hang" and hang["rank"] == 3 and hang["evidence"]["last_step"] == 4
    assert health.blamed_nodes(verdicts) == ["n2", "n7", "n9"]


def test_the_requeue_excludes_blamed_nodes(tmp_path, capsys):
    from podtrain.distributed import health
    from podtrain.launch.slurm import _after_preemption

    health.write_verdict(tmp_path, "doctor", "n2", 1, {"check": "compute"})
    assert health.main(["exclude", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "n2"
    script = _after_preemption(True)
    assert 'scontrol update jobid="$SLURM_JOB_ID" ExcNodeList="$BLAMED"' in script
    assert script.index("scontrol requeue") < script.index("scontrol update")  # pending jobs only


# -- 7. idle time between attempts; report's goodput ---------------------------------------------------
def _history(path: Path, *lines: dict) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _attempt(ended: str | None, t_end: float) -> list[dict]:
    seconds = {"productive": 90.0, "startup": 5.0, "restarts": 0.0, "redone": 0.0, "save_stall": 3.0,
               "eval": 2.0, "skipped": 0.0}
    train = {"kind": "train", "step": 10, "goodput_s": dict(seconds, eval=0.0), "goodput_attempt_s":
             dict(seconds, eval=0.0), "goodput_pct": 92.47, "attempt": "a1", "time": t_end - 5}
    closing = {"kind": "goodput", "step": 10, "goodput_s": seconds, "goodput_attempt_s": seconds,
               "goodput_pct": 90.0, "attempt": "a1", "ended": ended, "time": t_end}
    return [train] + ([closing] if ended else [])


@pytest.mark.parametrize("ended, restarts", [("finished", 0.0), ("interrupted", 0.0), ("stopped", 960.0),
                                             (None, 965.0)])
def test_the_wait_after_a_finished_or_interrupted_attempt_is_idle(tmp_path, ended, restarts):
    from podtrain.train.goodput import GoodputClock

    path = _history(tmp_path / "metrics.jsonl", *_attempt(ended, t_end=1000.0))
    clock = GoodputClock(started=1000.0 + 960)  # extended 16 minutes later
    clock.load_history(path)
    assert clock.seconds["restarts"] == restarts  # a kill or a requeue loses the wait; a finish does not
    assert clock.done_before == 10
    assert clock.prior["productive"] == 90.0 and clock.prior["eval"] == (2.0 if ended else 0.0)


def test_report_renders_the_newest_goodput_record(tmp_path):
    from podtrain.plan.report import measured_split
    from podtrain.train.goodput import goodput_line

    lines = _attempt("finished", t_end=1000.0)
    lines[0].update(world_size=1, step_time_s=1.0, data_wait_s=0.0)
    got = measured_split(lines)
    assert got["goodput"]["goodput_s"]["eval"] == 2.0  # the closing line, not the last train line
    line = goodput_line(got["goodput"]["goodput_s"])
    assert line == ("goodput 90.0%: productive 90.0 s, start-up 5.0 s, restarts 0.0 s, redone 0.0 s, "
                    "save stalls 3.0 s, evaluation 2.0 s, skipped 0.0 s")
