"""Done-when of data.mix (issue 21): a 2-rank run on a 3:1 mix of two prepared datasets reports
tokens_by_source within one sequence per source of 3:1 at every log line and each source's
validation loss, and resuming it on 1 rank continues with the same losses and ledger. Real ranks:
forked processes over gloo running the training loop in-process."""

import json
import os

import pytest

from multirank import run_ranks
from synthetic_data import make_data_dir

SEQ, GLOBAL = 32, 8


def _train(rank, world, overrides):
    from podtrain.config import load_config
    from podtrain.train.loop import train

    return train(load_config("configs/demo.yaml", overrides)).step


def _records(run_dir, kind):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r.get("kind") == kind}


@pytest.mark.slow
def test_two_rank_mix_keeps_its_ledger_and_resumes_on_one_rank(tmp_path, repo):
    from podtrain.ckpt.reader import load_latest
    from podtrain.model import preset_config

    preset_config("tiny", 320)  # import transformers' model code once, before the ranks fork

    web = make_data_dir(tmp_path / "web", shard_tokens=(4000,), val_tokens=300)
    code = make_data_dir(tmp_path / "code", shard_tokens=(1500,), val_tokens=300)
    mix = f"data.mix=[{{path: {web}, weight: 3}}, {{path: {code}, weight: 1}}]"
    common = [mix, "data.seq_len=32", "train.micro_batch_size=2", f"train.global_batch_size={GLOBAL}",
              "train.steps=6", "log.every=1", "eval.every=3", "eval.max_batches=5", "ckpt.every=3",
              "ckpt.keep_last=0", "monitor.watchdog=false", "log.progress=off", "log.trackers=none",
              "optim.warmup_steps=2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        assert run_ranks(_train, 2, common + [f"run.dir={full}"], timeout=120) == [6, 6]
        step3 = full / "ckpt" / "step_000003"
        assert run_ranks(_train, 1, common + [f"run.dir={resumed}", f"ckpt.resume={step3}"], timeout=120) == [6]
    finally:
        os.chdir(cwd)
    train, evals = _records(full, "train"), _records(full, "eval")
    assert sorted(train) == [1, 2, 3, 4, 5, 6]
    for step, record in train.items():
        tokens = record["tokens_by_source"]
        total = step * GLOBAL * SEQ
        assert sum(tokens.values()) == total == record["tokens_seen"]
        assert abs(tokens["web"] - 0.75 * total) <= SEQ and abs(tokens["code"] - 0.25 * total) <= SEQ
        assert record["samples_by_source"] == {k: v // SEQ for k, v in tokens.items()}
    for record in evals.values():  # each source's validation loss, and the mixture's weighted 3:1
        by_source = record["val_loss_by_source"]
        assert record["val_loss"] == pytest.approx(0.75 * by_source["web"] + 0.25 * by_source["code"])
    saved = load_latest(full).state["train_state"]["loader"]["ledger"]
    assert {k: v["tokens"] for k, v in saved.items()} == train[6]["tokens_by_source"]
    again = _records(resumed, "train")
    assert sorted(again) == [4, 5, 6]
    for step in (4, 5, 6):
        assert again[step]["tokens_by_source"] == train[step]["tokens_by_source"]
        assert again[step]["loss"] == pytest.approx(train[step]["loss"], rel=1e-4)
    # eval.max_batches covers every validation sample at both world sizes
    assert _records(resumed, "eval")[6]["val_loss_by_source"] == pytest.approx(evals[6]["val_loss_by_source"],
                                                                            rel=1e-4)
