"""`podtrain eval` talks while it scores (a progress line every 30 s) and writes its results only
where --out or the evaluated folder says, never into the current directory (issue 30 point 5)."""

import json
import logging

import pytest

from podtrain.cli import main
from test_eval_source import task_dir  # noqa: F401 (a fixture)
from test_export_sample import bpe_data, make_run

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_progress_lines_come_every_30_s_with_the_rate_and_the_time_left():
    from podtrain.eval.progress import Progress

    now = [0.0]
    lines, logger = Lines(), logging.getLogger("podtrain")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)  # as setup_logging sets it on the main rank
    try:
        progress = Progress(enabled=True, clock=lambda: now[0])
        progress.start("loglikelihood", 1000)
        for _ in range(100):  # 10 units every 2 s: 200 s in all
            now[0] += 2.0
            progress.advance(10)
        quiet = Progress(enabled=False, clock=lambda: now[0])  # another rank
        quiet.start("loglikelihood", 10)
        now[0] += 60
        quiet.advance(1)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert len(lines.lines) == 6  # at 30, 60, ... 180 s
    assert lines.lines[0] == "eval: loglikelihood 150/1000 on this rank, 5.0/s, about 2 min 50 s left"
    assert lines.lines[-1] == "eval: loglikelihood 900/1000 on this rank, 5.0/s, about 20 s left"


@pytest.mark.slow
def test_eval_of_an_exported_folder_writes_beside_it_not_into_the_current_directory(
        tmp_path, task_dir, monkeypatch, capsys):  # noqa: F811
    data = bpe_data(tmp_path / "data")
    make_run(tmp_path / "run", data, vocab=320)
    hf = tmp_path / "hf"
    assert main(["export", str(tmp_path / "run"), str(hf)]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    argv = ["eval", str(hf), "--tasks", "code-choice", "--include", str(task_dir), "--data", str(data)]
    assert main(argv) == 0
    assert list(elsewhere.iterdir()) == []
    assert json.loads((hf / "eval_results.json").read_text())["podtrain"]["requests"] == 6
    # an --out that cannot be written is one line before any scoring, and nothing is written
    (tmp_path / "a-file").write_text("")
    capsys.readouterr()
    assert main(argv + ["--out", str(tmp_path / "a-file" / "results.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "a-file") in err[0]
