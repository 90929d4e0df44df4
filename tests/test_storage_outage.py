"""A storage outage never idles the GPUs or kills a job: real S3 (moto's server) behind the tests'
fault proxy (tests/s3_fault_proxy.py, 503 SlowDown), real 2-rank training in forked processes over
gloo, through podtrain's CLI entry point (so the exit codes are the ones a scheduler sees).

1. An outage in the middle of a run (and throttling of a fraction of requests around it): the
   step loop keeps going (saves due meanwhile are skipped), saves again after it, and the losses and
   final weights equal those of a run without faults.
2. An outage longer than ckpt.max_outage_s: the run stops with the retryable exit code 203; a rerun
   once the storage is back resumes from the last good checkpoint and ends as the reference does.

The in-suite outage lasts seconds (OUTAGE_S); ``bench/soak.py --kinds s3`` runs the 150 s one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from multirank import run_ranks
from s3_fault_proxy import OutageDirector, s3_proxy  # noqa: F401 (fixture)
from synthetic_data import make_data_dir

STEPS = 60
OUTAGE_FROM, OUTAGE_UNTIL, OUTAGE_S = 4, 24, 1.5
"""The outage starts when step 4 is logged and ends once step 24 is logged and 1.5 s have passed
(by steps, not seconds: a quiet machine runs the 60 steps in a few seconds)."""


def _common(data: Path) -> list[str]:
    return [f"data.path={data}", "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
            f"train.steps={STEPS}", "log.every=1", "eval.every=0", "ckpt.every=3", "ckpt.keep_last=0",
            "ckpt.save_wait_s=0.3", "monitor.watchdog=false", "monitor.straggler_every=0",
            "log.progress=off", "log.trackers=none", "optim.warmup_steps=2"]


def _cli(rank, world, overrides):
    from podtrain.cli import main

    return main(["train", "configs/demo.yaml", *overrides])


def _train(repo: Path, overrides: list[str], world: int = 2) -> list[int]:
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        return run_ranks(_cli, world, overrides, timeout=240)
    finally:
        os.chdir(cwd)


def _records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record.get("kind") == kind:
            out.append(record)
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run_dir, "train")}  # the last record of a step wins


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from podtrain.ckpt.reader import load_latest_weights

    _, state, step = load_latest_weights(run_dir)
    assert step == STEPS
    return state


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run without faults, checkpoints on local disk."""
    from podtrain.model import preset_config

    preset_config("tiny", 320)  # transformers' model code imported once, before the ranks fork
    root = tmp_path_factory.mktemp("outage")
    data = make_data_dir(root / "data", shard_tokens=(6000,), val_tokens=300)
    run_dir = root / "reference"
    assert _train(REPO, _common(data) + [f"run.dir={run_dir}"]) == [0, 0]
    return {"data": data, "losses": _losses(run_dir), "weights": _final_weights(run_dir)}


def _assert_same_as(reference: dict, run_dir: Path) -> None:
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses == reference["losses"]
    weights = _final_weights(run_dir)
    assert all(torch.equal(weights[k], reference["weights"][k]) for k in reference["weights"])


@pytest.mark.slow
def test_training_goes_on_through_an_s3_outage_and_ends_as_without_it_and_local_saves_go_on(reference, s3_proxy, s3_bucket,
                                                                      tmp_path, repo):
    url, run_dir = f"s3://{s3_bucket}/ckpt", tmp_path / "run"
    s3_proxy.fail_fraction(0.05, seed=3)  # throttling around the outage too
    director = OutageDirector(s3_proxy, run_dir, OUTAGE_FROM, until_step=OUTAGE_UNTIL, min_s=OUTAGE_S)
    director.start()
    try:
        codes = _train(repo, _common(reference["data"]) + [f"run.dir={run_dir}", f"ckpt.dir={url}",
                                                            f"ckpt.local_dir={tmp_path}/local", "ckpt.local_every=2"])
    finally:
        director.finish()
    assert codes == [0, 0]
    assert director.began is not None and director.ended is not None
    train = _records(run_dir, "train")
    during = [r["step"] for r in train if director.began <= r["time"] <= director.ended]
    assert len(during) >= OUTAGE_UNTIL - OUTAGE_FROM - 2, during  # the step loop did not wait for S3
    saves = _records(run_dir, "save")
    assert any(s["skipped"] for s in saves)  # saves due during the outage were skipped, not waited for
    assert max(s["save_s"] for s in saves) < 5.0  # no save stalled the loop for the outage
    local = [s for s in saves if s.get("tier") == "local" and director.began <= s["time"] <= director.ended]
    assert len(local) >= 3 and not any(s["skipped"] for s in local), local  # the local tier never waits for S3
    from podtrain.ckpt import layout

    committed = [s for s, _ in layout.list_checkpoints(url)]
    after = max(r["step"] for r in train if r["time"] <= director.ended)
    timeline = (committed, after, director.began, director.ended, [(r["step"], r["time"]) for r in train][::4],
                [(s["step"], s["skipped"], s["time"]) for s in saves])
    assert any(s > after for s in committed) and STEPS in committed, timeline  # saved again after the outage
    assert s3_proxy.stats()["failed"] > 0
    _assert_same_as(reference, run_dir)


@pytest.mark.slow
def test_an_outage_past_max_outage_s_stops_with_the_retryable_code_and_a_rerun_resumes(
        reference, s3_proxy, s3_server, s3_bucket, tmp_path, repo):
    from podtrain.errors import STORAGE_OUTAGE_EXIT_CODE

    url, run_dir = f"s3://{s3_bucket}/ckpt", tmp_path / "run"
    overrides = _common(reference["data"]) + [f"run.dir={run_dir}", f"ckpt.dir={url}", "ckpt.max_outage_s=3"]
    def committed() -> bool:  # asked of the server itself, not through the proxy
        return any(key.endswith("/manifest.json") for key in s3_server.keys(s3_bucket))

    director = OutageDirector(s3_proxy, run_dir, OUTAGE_FROM, committed=committed)  # never ends by itself
    director.start()
    try:
        codes = _train(repo, overrides)
    finally:
        director.finish()  # the storage is back
    assert codes == [STORAGE_OUTAGE_EXIT_CODE] * 2 == [203, 203]
    from podtrain.ckpt import layout

    stopped_at = max(r["step"] for r in _records(run_dir, "train"))
    newest = max(s for s, _ in layout.list_checkpoints(url))
    assert newest < stopped_at <= STEPS  # it trained on (a fast machine reaches the last step) unsaved
    assert _train(repo, overrides) == [0, 0]  # the scheduler's retry
    segments = _records(run_dir, "segment")
    assert segments[-1]["step"] == newest  # resumed from the last good checkpoint
    _assert_same_as(reference, run_dir)
