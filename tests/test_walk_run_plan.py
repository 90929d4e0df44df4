"""Issue 38 ("Second day"), points 6, 8, 9 and 10: a newcomer's frictions with a finished run,
`podtrain plan` and `podtrain eval`.

* Rerunning a finished run's command trains nothing and books nothing in goodput (its start-up
  was booked as lost time: 79.3% became 77.3%); raising train.steps still trains.
* `plan` plans the config's train.steps (x tokens per step) when the config or an override sets
  it, and says which token count it used; it checks every data.mix source, as training does.
* data.path beside data.mix: training and plan say in one line that data.path is ignored.
* `eval` prints each multiple-choice task's chance level beside its accuracy and standard error.

Runs are real `podtrain train` / `plan` / `eval` calls in this process, on hand-made data.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from podtrain.cli import main
from synthetic_data import make_data_dir

BASE = ["data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2", "log.progress=plain",
        "monitor.watchdog=false", "eval.every=0", "log.every=1", "optim.warmup_steps=1",
        "monitor.straggler_every=0", "ckpt.every=0"]


def _run(capsys, argv: list[str]) -> tuple[int, list[str], str]:
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


# -- 6: a finished run's rerun -------------------------------------------------------------------------
@pytest.mark.slow
def test_a_finished_runs_rerun_books_nothing_and_raising_steps_still_trains(capsys, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    run = tmp_path / "run"
    argv = ["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={run}", *BASE]
    code, err, _ = _run(capsys, argv + ["train.steps=3"])
    assert code == 0, err
    finished = _records(run, "goodput")[-1]
    assert finished["ended"] == "finished" and finished["step"] == 3
    # the same command again: nothing to do, and nothing booked (start-up included)
    code, err, out = _run(capsys, argv + ["train.steps=3"])
    assert code == 0, err
    assert "nothing to do: the run is at step 3 of train.steps=3" in out
    again = _records(run, "goodput")[-1]
    assert again["attempt"] != finished["attempt"] and again["ended"] == "finished"
    assert set(again["goodput_attempt_s"].values()) == {0.0}, again
    # the totals are what they were (to the records' rounding: the earlier attempts' seconds are read
    # back rounded to 0.1 ms and the percentage recomputed from them)
    assert again["goodput_s"] == pytest.approx(finished["goodput_s"], abs=1e-3), (again, finished)
    assert again["goodput_pct"] == pytest.approx(finished["goodput_pct"], abs=0.011), (again, finished)
    line = [x for x in out.splitlines() if "] goodput " in x]
    assert len(line) == 1, out
    said = float(line[0].split("] goodput ")[1].split("%")[0])
    assert said == pytest.approx(finished["goodput_pct"], abs=0.06), line[0]
    # a raised train.steps still trains, and the idle wait after the no-op is booked nowhere
    code, err, _ = _run(capsys, argv + ["train.steps=4"])
    assert code == 0, err
    assert [r["step"] for r in _records(run, "train")][-1] == 4
    extended = _records(run, "goodput")[-1]
    assert extended["goodput_s"]["restarts"] == 0.0
    assert extended["goodput_s"]["productive"] > finished["goodput_s"]["productive"]


# -- 9: data.path beside data.mix ----------------------------------------------------------------------
@pytest.mark.slow
def test_training_names_a_data_path_that_a_mix_makes_it_ignore(capsys, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    nowhere = tmp_path / "nowhere"
    code, err, out = _run(capsys, ["train", "configs/demo.yaml", f"run.dir={tmp_path / 'run'}", *BASE,
                                   "train.steps=1", f"data.mix=[{{path: {data}, weight: 1}}]",
                                   f"data.path={nowhere}", "optim.warmup_steps=0"])
    assert code == 0, err
    # the mix trains; the data.path it ignores is named once, at start
    assert "tokens by source: data 64 (100.0%)" in out
    ignored = [line for line in (out + "\n".join(err)).splitlines() if "is ignored" in line]
    assert ignored == [f"[podtrain] data.path={nowhere} is ignored: data.mix is set and its 1 source(s) are "
                       "the data (remove data.path, or data.mix to train from it)"], out


# -- 8: plan's tokens and data.mix sources ------------------------------------------------------------
def _config(path: Path, data: str, **train) -> Path:
    path.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "data": {"path": data, "seq_len": 256},
                                    "train": {"micro_batch_size": 8, "global_batch_size": 16, **train}}))
    return path


PLAN = ["--instance-type", "p5.48xlarge", "--nproc", "2"]


def test_plan_plans_the_configs_train_steps_and_says_which_tokens_it_used(capsys, tmp_path):
    walk = _config(tmp_path / "walk.yaml", str(tmp_path / "data"), steps=200)
    code, err, out = _run(capsys, ["plan", str(walk), *PLAN])
    assert code == 0, err
    # 200 steps x 16 sequences x 256 tokens, not 20 tokens per parameter
    assert re.search(r"\| 819,200 tokens in [0-9.]+ (ms|s|min)", out), out
    assert "tokens: train.steps=200 x 4,096 tokens per step" in out.splitlines()
    # a config that leaves train.steps to its default: 20 per parameter, said so
    bare = _config(tmp_path / "bare.yaml", str(tmp_path / "data"))
    code, err, out = _run(capsys, ["plan", str(bare), *PLAN])
    assert code == 0, err
    assert ("tokens: 20 per parameter: the config sets no train.steps; --tokens N plans another"
            in out.splitlines())
    # an override sets it too; --tokens wins over both
    code, err, out = _run(capsys, ["plan", str(bare), *PLAN, "train.steps=50", "--json"])
    assert code == 0, err
    planned = json.loads(out)
    assert planned["tokens"] == 50 * 4096 and planned["tokens_source"].startswith("train.steps=50")
    code, err, out = _run(capsys, ["plan", str(walk), *PLAN, "--tokens", "1e6", "--json"])
    assert code == 0, err
    assert json.loads(out)["tokens"] == 1_000_000 and json.loads(out)["tokens_source"] == "--tokens"


def test_plan_checks_every_mix_source_and_names_an_ignored_data_path(capsys, tmp_path):
    good = make_data_dir(tmp_path / "web", shard_tokens=(3000,), val_tokens=600)
    missing = tmp_path / "code"  # a typo'd or unprepared second source
    config = _config(tmp_path / "mix.yaml", str(tmp_path / "nowhere"), steps=10)
    mix = f"data.mix=[{{path: {good}, weight: 3}}, {{path: {missing}, weight: 1}}]"
    code, err, out = _run(capsys, ["plan", str(config), *PLAN, mix])
    assert code == 2 and out == "" and len(err) == 1, (err, out)
    assert f"data directory {missing} does not exist" in err[0]
    # every source there: it plans, and says the data.path beside the mix is not read
    code, err, out = _run(capsys, ["plan", str(config), *PLAN, f"data.mix=[{{path: {good}}}]"])
    assert code == 0, err
    assert (f"data: data.path={tmp_path / 'nowhere'} is ignored: data.mix is set and its 1 source(s) are "
            "the data (remove data.path, or data.mix to train from it)") in out.splitlines()


# -- 10: chance level beside multiple-choice accuracies ------------------------------------------------
FOUR = [{"context": "def add(a, b):\n", "label": 0,
         "choices": ["    return a + b\n", "import os\n", "class A:\n", "x = [\n"]},
        {"context": "for i in range(10):\n", "label": 1,
         "choices": ["class A:\n", "    print(i)\n", "import sys\n", "def f():\n"]}]
MIXED = [{"context": "import os\n", "label": 0, "choices": ["import sys\n", "    pass\n"]},
         {"context": "class Point:\n", "label": 0, "choices": ["    x: int = 0\n", "import os\n", ")\n"]}]


@pytest.mark.slow
def test_eval_prints_each_multiple_choice_tasks_chance_level(capsys, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")
    from podtrain.eval.tasks import task_yaml
    from test_export_sample import bpe_data, make_run

    data = bpe_data(tmp_path / "data")
    make_run(tmp_path / "run", data, vocab=320)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, docs in (("four", FOUR), ("mixed", MIXED)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"{name}.yaml").write_text(task_yaml(name, tasks / f"{name}.jsonl"))
    out_file = tmp_path / "results.json"
    code, err, out = _run(capsys, ["eval", str(tmp_path / "run"), "--tasks", "four,mixed", "--include",
                                   str(tasks), "--out", str(out_file)])
    assert code == 0, err
    saved = json.loads(out_file.read_text())
    acc = saved["results"]["four"]["acc,none"]
    line = [x for x in out.splitlines() if x.startswith("four: chance")]
    assert len(line) == 1 and line[0].startswith(f"four: chance 0.2500 (4 choices) | acc {acc:.4f}"), out
    assert any(x.startswith("mixed: chance 0.4167 (2-3 choices per question) | acc ") for x in out.splitlines())
    assert saved["podtrain"]["chance"]["four"] == {"chance": 0.25, "choices": [4, 4]}
    assert saved["podtrain"]["chance"]["mixed"]["choices"] == [2, 3]
