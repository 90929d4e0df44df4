"""observe/ without a training run: W&B (offline) and MLflow (local SQLite) receive MetricsWriter's
records, the reader's de-duplication rules, the console's step/ETA line and rich fallback, and
one-line errors for a bad profile range or a tracker that is not installed."""

import glob
import json
import logging
import struct

import pytest

from podtrain.cli import main
from podtrain.observe.metrics import MetricsWriter
from podtrain.observe.records import dedupe, read_records, segment_record

RECORDS = [segment_record(0, 0, False, "abc123", 1000.0)] + [
    {"kind": "train", "step": s, "loss": 6.0 / s, "lr": 1e-3 * s, "grad_norm": 0.5 + s,
     "tokens_per_s": 1000.0 + s, "mfu": 0.01 * s, "tokens_seen": 64 * s, "run_id": "abc123",
     "time": 1000.0 + s, "straggler_host": "node-1"} for s in (1, 2, 3)] + [
    {"kind": "eval", "step": 3, "val_loss": 2.5, "tokens_seen": 192, "run_id": "abc123", "time": 1004.0}]


def _write(run_dir, names):
    from podtrain.observe.trackers import open_trackers

    writer = MetricsWriter(run_dir / "metrics.jsonl", True,
                           open_trackers(names, run_dir, "abc123", {"optim": {"lr": 1e-3}}))
    for record in RECORDS:
        writer.write(record)
    writer.close()


def _wandb_history(path):
    """History rows of a W&B offline run file (a LevelDB-style log of protobuf records; wandb
    0.31 ships no Python reader for it)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block = open(path, "rb").read(), 32768
    assert raw[:4] == b":W&B"
    pos, parts, rows = 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block
            continue
        parts += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.nested_key[0] if i.nested_key else i.key): json.loads(i.value_json)
                             for i in record.history.item})
    return rows


@pytest.mark.slow
def test_wandb_offline_run_holds_the_records(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is in the test extra: pip install -e '.[test]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _write(tmp_path, ["wandb"])
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-abc123.wandb"))
    rows = [r for r in _wandb_history(run_file) if "train/loss" in r]
    assert [(r["_step"], r["train/loss"], r["train/mfu"]) for r in rows] == [(s, 6.0 / s, 0.01 * s) for s in (1, 2, 3)]
    assert rows[2]["eval/val_loss"] == 2.5  # W&B joins what is logged at one step into one row
    assert not any("straggler_host" in k or "segment" in k for r in rows for k in r)


def test_mlflow_local_store_holds_the_records(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="optional extra, not in `test` (~450 MB, ~25 s to install): "
                                         "pip install 'podtrain[mlflow]' to run this test")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _write(tmp_path, ["mlflow"])
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("podtrain").experiment_id])
    assert run.data.tags["podtrain_run_id"] == "abc123" and run.data.params["optim.lr"] == "0.001"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 6.0 / s) for s in (1, 2, 3)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/val_loss")] == [(3, 2.5)]
    assert run.info.status == "FINISHED"


def test_dedupe_drops_a_killed_attempts_steps_past_the_resume_point():
    first = [{"kind": "train", "step": s, "a": 1} for s in (5, 10, 15)]  # killed after 15, saved at 10
    second = [segment_record(10, 0, True, "r", 0.0), {"kind": "train", "step": 20, "a": 2}]
    train, evals, restarts = dedupe(first + second)
    assert [(r["step"], r["a"]) for r in train] == [(5, 1), (10, 1), (20, 2)]  # 15 is gone
    assert evals == [] and [r["step"] for r in restarts] == [10]
    # A fresh start (ckpt.resume=never) in the same directory replaces everything before it.
    train, _, restarts = dedupe(first + [segment_record(0, 0, False, "r", 0.0), {"kind": "train", "step": 5, "a": 3}])
    assert [(r["step"], r["a"]) for r in train] == [(5, 3)] and restarts == []


def test_reader_ignores_a_torn_last_line_and_names_a_bad_middle_one(tmp_path):
    lines = [json.dumps(r) for r in RECORDS]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind":"tra')
    assert [r["step"] for r in read_records(tmp_path).train] == [1, 2, 3]
    (tmp_path / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    from podtrain.errors import UserError

    with pytest.raises(UserError, match=r"metrics.jsonl line 2: not a metrics record"):
        read_records(tmp_path)


class _Lines(logging.Handler):
    """The podtrain logger's messages while installed (its own handlers print, not propagate)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logger = logging.getLogger("podtrain")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("podtrain").removeHandler(self)
        logging.getLogger("podtrain").setLevel(self._level)


def test_plain_lines_show_step_total_tokens_and_eta():
    from podtrain.observe.console import Progress

    progress = Progress("plain", 100, 0, enabled=True)
    progress._recent[0] = (1000.0, 0)  # the start, pinned: ETA from 10 steps per 20 s below
    record = dict(RECORDS[1], step=10, time=1020.0, tokens_seen=40960, step_time_s=0.5, data_wait_s=0.001)
    with _Lines() as lines:
        progress.update(record)
    (line,) = lines.messages
    assert line.startswith("step 10/100 loss 6.0000 | lr 1.00e-03 | grad 1.500 | ")
    assert line.endswith("| tokens 40,960 | ETA 3m00s")  # 90 steps at 2 s each


def test_rich_off_a_terminal_falls_back_to_plain_with_one_note():
    from podtrain.observe.console import Progress

    with _Lines() as lines:
        progress = Progress("rich", 10, 0, enabled=True)  # pytest's stdout is not a terminal
    assert progress.mode == "plain" and len(lines.messages) == 1
    assert lines.messages[0].startswith("log.progress=rich needs a terminal")


@pytest.mark.parametrize("spec", ["13:10", "abc", "0:3", "3:x"])
def test_bad_profile_steps_is_one_line(spec, capsys, tmp_path):
    assert main(["train", "configs/demo.yaml", f"profile.steps={spec}", f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"podtrain: error: config key 'profile.steps' must be FIRST:LAST step numbers with "
                   f"1 <= FIRST <= LAST (e.g. 10:13), got {spec!r}"]


def test_unquoted_yaml_range_gets_a_hint(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  steps: 50\nprofile:\n  steps: 10:13\n")  # YAML 1.1: 613
    assert main(["train", str(config)]) == 2
    assert "quote it" in capsys.readouterr().err


def test_tracker_not_installed_names_the_extra_absence_simulated(capsys, tmp_path, monkeypatch, repo):
    # Every tracker package is installed here; its absence is simulated at the one lookup.
    import podtrain.observe.trackers as trackers

    monkeypatch.chdir(repo)
    monkeypatch.setattr(trackers, "_installed", lambda module: module != "mlflow")
    assert trackers.resolve_trackers(["auto", "none"]) == ["tensorboard"]
    code = main(["launch", "local", "configs/demo.yaml", "log.trackers=tensorboard,mlflow",
                 f"run.dir={tmp_path}", "data.path=tests"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "podtrain: error: config key 'log.trackers' names 'mlflow' but the mlflow package is not "
        "installed (pip install 'podtrain[mlflow]')"]


def _write_metrics(run_dir, evals, sources=("web",)):
    """A run directory whose metrics.jsonl holds 3 logged steps and the given evaluation records."""
    run_dir.mkdir()
    lines = [{"kind": "train", "step": s, "tokens_seen": 1024 * s, "loss": 5.0 - s, "lr": 1e-3,
              "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 0.1, "data_wait_s": 0.001,
              "tokens_by_source": {name: 1024 * s // len(sources) for name in sources}} for s in (1, 2, 3)]
    lines += [{"kind": "eval", "step": 3, "tokens_seen": 3072, "val_loss": 2.5, "val_bpb": 3.0, **e} for e in evals]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


@pytest.mark.slow
def test_plot_draws_no_empty_panel(tmp_path):
    """No `eval.tasks`: no "eval tasks" panel; one source: no "tokens by source"; the figure
    shrinks to the rows it needs (issue 30 point 10: the plot always drew an empty tasks panel)."""
    pytest.importorskip("matplotlib")
    from podtrain.observe.plot import panel_titles, render_png

    plain = read_records(_write_metrics(tmp_path / "plain", [{}]))
    core = ["loss", "learning rate", "gradient norm", "throughput", "MFU", "data wait",
            "validation bits per byte"]
    assert panel_titles([plain]) == core
    tasks = read_records(_write_metrics(tmp_path / "tasks", [{"podtrain-next-line/acc": 0.4}], ("web", "code")))
    assert panel_titles([tasks]) == core + ["eval tasks", "tokens by source"]
    assert panel_titles([plain, tasks]) == core + ["eval tasks", "tokens by source"]  # overlaid: either has it
    no_eval = read_records(_write_metrics(tmp_path / "no_eval", []))
    assert panel_titles([no_eval]) == core[:-1]
    for runs, height in (([no_eval], 833), ([plain, tasks], 1250)):  # 6 panels: two rows; 9: three
        png = render_png(runs)
        assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1600, height)


@pytest.mark.slow
@pytest.mark.parametrize("tokens_per_step", [900, 3_100_000])
def test_plot_tick_labels_of_a_long_run_do_not_overlap(tmp_path, tokens_per_step):
    """Runs of 900 thousand and 3 billion tokens: the x tick labels of every panel stand apart and
    are short (issue 38 point 10: six-digit labels on every tick ran into each other)."""
    pytest.importorskip("matplotlib")
    from podtrain.observe.plot import _pyplot, draw_figure

    run_dir = tmp_path / "long"
    run_dir.mkdir()
    lines = [{"kind": "train", "step": s, "tokens_seen": tokens_per_step * s, "loss": 5.0 - s / 1000, "lr": 1e-3,
              "grad_norm": 1.0, "tokens_per_s": 1e6, "mfu": 0.4, "data_wait_s": 0.001}
             for s in range(1, 1001, 10)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    fig = draw_figure([read_records(run_dir)])
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            labels = [t for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
            boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
            assert len(boxes) >= 3, ax.get_title()
            gaps = [b.x0 - a.x1 for a, b in zip(boxes, boxes[1:])]
            assert min(gaps) > 0, (ax.get_title(), [t.get_text() for t in labels])
            assert all(len(t.get_text()) <= 5 for t in labels), [t.get_text() for t in labels]
    finally:
        _pyplot().close(fig)


def test_the_cpu_peak_is_measured_when_not_given():
    """MFU's peak: the override when given; on a CPU in fp32, this process's one-thread matmul rate
    measured (the best of many ~1 ms trials, so a second measurement agrees); none where the CPU has
    no honest peak (bf16 is emulated: an MFU would mean nothing)."""
    import torch

    from podtrain.observe.hardware import measure_cpu_matmul_flops, peak_flops

    cpu = torch.device("cpu")
    assert peak_flops(cpu, "fp32", 3.5e12) == 3.5e12
    assert peak_flops(cpu, "bf16", None) is None
    measured = peak_flops(cpu, "fp32", None)
    again = measure_cpu_matmul_flops()
    # One thread of any CPU this runs on does 1-1000 GFLOP/s in fp32; the two trials of one process
    # agree to a factor the machine's other load cannot double.
    assert 1e9 < measured < 1e12, measured
    assert 0.5 < measured / again < 2.0, (measured, again)
