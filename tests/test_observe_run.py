"""Observability of a real run: 2 forked gloo ranks train, a second attempt resumes from the
step-3 checkpoint after the first logged steps 4-6 (a kill after logging, before saving), with
profile.steps on. Then: TensorBoard's own reader returns metrics.jsonl's losses (and none of the
replaced steps), readers see each step once, each rank wrote a trace of its profiled steps, and
``podtrain plot`` draws the run."""

import base64
import json
import re

import numpy as np
import pytest

from multirank import run_ranks
from synthetic_data import make_data_dir

pytest.importorskip("tensorboard", reason="tensorboard is in the test extra: pip install -e '.[test]'")


def _train(rank, world, overrides):
    from podtrain.config import load_config
    from podtrain.train.loop import train

    return train(load_config("configs/demo.yaml", overrides)).step


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    from conftest import REPO

    root = tmp_path_factory.mktemp("observe")
    data = make_data_dir(root / "data", shard_tokens=(6000,), val_tokens=600)
    run_dir = root / "run"
    common = [f"data.path={data}", f"run.dir={run_dir}", "data.seq_len=32", "train.micro_batch_size=2",
              "train.global_batch_size=4", "train.steps=6", "log.every=1", "eval.every=3",
              "eval.max_batches=2", "ckpt.every=3", "ckpt.keep_last=0", "monitor.watchdog=false",
              "log.progress=off", "log.trackers=tensorboard", "optim.warmup_steps=2"]
    import os

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert run_ranks(_train, 2, common + ["profile.steps=2:3"], timeout=120) == [6, 6]
        first = (run_dir / "metrics.jsonl").read_text().splitlines()
        # The second attempt restarts from step 3 and logs 4-6 again, as after a kill at step 6.
        resume = [f"ckpt.resume={run_dir / 'ckpt' / 'step_000003'}"]
        assert run_ranks(_train, 2, common + resume, timeout=120) == [6, 6]
    finally:
        os.chdir(cwd)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, lines, len(first)


@pytest.mark.slow
def test_records_keep_the_resumed_attempts_steps_once(resumed_run):
    from podtrain.observe.records import read_records

    run_dir, lines, first_count = resumed_run
    train_lines = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4, 5, 6, 4, 5, 6]  # the file: duplicates
    segments = [r for r in lines if r["kind"] == "segment"]
    assert [(s["step"], s["resumed"], s["tokens_seen"]) for s in segments] == [(0, False, 0), (3, True, 3 * 4 * 32)]
    records = read_records(run_dir)
    assert [r["step"] for r in records.train] == [1, 2, 3, 4, 5, 6]
    second = lines[first_count:]
    assert records.train[3:] == [r for r in second if r["kind"] == "train"]  # the last attempt wins
    assert records.train[:3] == train_lines[:3]
    assert [(r["step"], r["tokens_seen"]) for r in records.eval] == [(3, 384), (6, 768)]
    assert records.eval[-1] == [r for r in second if r["kind"] == "eval"][-1]
    assert [r["step"] for r in records.restarts] == [3]


@pytest.mark.slow
def test_tensorboard_reader_returns_the_losses_of_metrics_jsonl(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from podtrain.observe.records import read_records

    run_dir, _, _ = resumed_run
    assert len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 2  # rank 0, two attempts only
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    records = read_records(run_dir)
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    # Event files hold float32; the killed attempt's steps 4-6 are purged by the resumed writer.
    assert loss == [(r["step"], float(np.float32(r["loss"]))) for r in records.train]
    val = [(e.step, e.value) for e in events.Scalars("eval/val_loss")]
    assert val == [(r["step"], float(np.float32(r["val_loss"]))) for r in records.eval]
    lr = [e.value for e in events.Scalars("train/lr")]
    assert lr == [float(np.float32(r["lr"])) for r in records.train]


@pytest.mark.slow
def test_profile_traces_the_chosen_steps_on_each_rank(resumed_run):
    run_dir, _, _ = resumed_run
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == [
        "rank0_steps2-3.trace.json", "rank1_steps2-3.trace.json"]
    for rank in (0, 1):
        trace = json.loads((run_dir / "profile" / f"rank{rank}_steps2-3.trace.json").read_text())
        names = [e.get("name", "") for e in trace["traceEvents"]]
        assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
        # The training work is inside: matmuls of forward/backward, the AdamW step, DDP's AllReduce.
        assert sum(n == "aten::mm" for n in names) > 20
        assert "Optimizer.step#AdamW.step" in names
        assert any("allreduce" in n.lower() for n in names)


@pytest.mark.slow
def test_plot_writes_png_and_html(resumed_run, tmp_path, capsys):
    from podtrain.cli import main

    run_dir, _, _ = resumed_run
    other = tmp_path / "other"  # a second run to overlay: the same records, another directory
    other.mkdir()
    (other / "metrics.jsonl").write_bytes((run_dir / "metrics.jsonl").read_bytes())
    png = tmp_path / "curves.png"
    assert main(["plot", str(run_dir), str(other), "--out", str(png)]) == 0
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    assert (width, height) == (1600, 1250)  # three rows: the training panels and bits per byte
    page = tmp_path / "curves.html"
    assert main(["plot", str(run_dir), "--out", str(page)]) == 0
    text = page.read_text()
    image = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text).group(1)
    assert base64.b64decode(image)[:8] == b"\x89PNG\r\n\x1a\n"
    from podtrain.observe.records import read_records

    last = read_records(run_dir).train[-1]
    assert f"<td>{last['loss']:.4f}</td>" in text and "<td>1</td></tr>" in text  # loss, 1 restart
    assert f"<td>{read_records(run_dir).eval[-1]['val_bpb']:.4f}</td>" in text  # bits per byte
    assert capsys.readouterr().out.splitlines() == [f"wrote {png}", f"wrote {page}"]


def test_plot_user_errors_are_one_line(tmp_path, capsys):
    from podtrain.cli import main

    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"podtrain: error: {tmp_path} has no metrics.jsonl (is it a run directory?)"
    (tmp_path / "metrics.jsonl").write_text('{"kind":"train","step":1,"loss":1.0}\n')
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "x.pdf")]) == 2
    assert "must end in .png or .html" in capsys.readouterr().err
