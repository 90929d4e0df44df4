"""lm-eval on podtrain's model: the tiny preset trained 40 steps on 2 forked gloo ranks with
``eval.tasks=[podtrain-next-line]`` scores above the untrained model, in metrics.jsonl and
TensorBoard; ``podtrain eval`` on 2 ranks gives the 1-rank result and the loop's; a task defined
only by a user's YAML + JSONL runs; what cannot run is one line and exit 2."""

import json
import math
import os
import sys

import pytest

from multirank import run_ranks

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")

LIMIT = 60


def _train(rank, world, overrides):
    from podtrain.config import load_config
    from podtrain.train.loop import train

    return train(load_config("configs/demo.yaml", overrides)).step


def _eval_cli(rank, world, argv):
    from podtrain.cli import main

    return main(argv)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, builtin_corpus):
    from conftest import REPO

    root = tmp_path_factory.mktemp("evaltasks")
    os.environ["PODTRAIN_CACHE"] = str(root / "cache")  # the generated task files
    data, run_dir = builtin_corpus, root / "run"  # the built-in corpus: 12 held-out files
    overrides = [f"data.path={data}", f"run.dir={run_dir}", "data.seq_len=128", "train.micro_batch_size=8",
                 "train.global_batch_size=16", "train.steps=40", "optim.warmup_steps=3", "optim.lr=5e-3",
                 "log.every=20", "eval.every=40", "eval.max_batches=2", "eval.tasks=[podtrain-next-line]",
                 f"eval.tasks_limit={LIMIT}", "ckpt.every=0", "log.progress=off",
                 "log.trackers=tensorboard", "data.verify=false"]
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert run_ranks(_train, 2, overrides, timeout=240) == [40, 40]
    finally:
        os.chdir(cwd)
    return root, data, run_dir


def _acc(path):
    return json.loads(path.read_text())["results"]["podtrain-next-line"]["acc,none"]


@pytest.mark.slow
def test_eval_tasks_in_the_loop_beat_the_untrained_model(trained):
    import torch
    from podtrain.data.manifest import read_manifest
    from podtrain.data.tokenizer import load_tokenizer
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext
    from podtrain.eval.evaluator import TaskEvaluator
    from podtrain.model import build_model, preset_config
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, data, run_dir = trained
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in lines if r.get("kind") == "eval"]
    acc = record["podtrain-next-line/acc"]
    # bits per byte: the loss in bits over the validation text's bytes per token (byte-level:
    # every token but EOS is one byte)
    assert 0.9 < record["bytes_per_token"] < 1.0
    assert record["val_bpb"] == pytest.approx(record["val_loss"] / math.log(2) / record["bytes_per_token"])
    goodput = [r for r in lines if r.get("kind") == "goodput"][-1]["goodput_s"]
    assert goodput["eval"] >= round(record["eval_s"], 4) > 0  # booked as evaluation, not as steps
    events = EventAccumulator(str(run_dir / "tb")).Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("eval/podtrain-next-line/acc")] == [(40, round(acc, 6))]
    # the same documents scored by the untrained model (same seed and preset): chance level
    manifest = read_manifest(data)
    ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    untrained = build_model(preset_config("tiny", 320), seed=1234).eval()
    results, _ = TaskEvaluator(["podtrain-next-line"], [], LIMIT, manifest, load_tokenizer(manifest), 32).run(untrained, ctx)
    before = results["results"]["podtrain-next-line"]["acc,none"]
    assert acc > before, (acc, before)


@pytest.mark.slow
def test_podtrain_eval_two_ranks_equal_one_rank_and_the_loop(trained, capsys):
    from podtrain.cli import main

    root, data, run_dir = trained
    two, one = root / "two.json", root / "one.json"
    argv = ["eval", str(run_dir), "--tasks", "podtrain-next-line", "--limit", str(LIMIT)]
    assert run_ranks(_eval_cli, 2, argv + ["--out", str(two)], timeout=240) == [0, 0]
    assert main(argv + ["--out", str(one), "--step", "40"]) == 0
    out = capsys.readouterr().out
    assert "|podtrain-next-line|" in out and "acc" in out and "requests/s" in out  # lm-eval's table
    loop = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    in_loop = [r for r in loop if r.get("kind") == "eval"][-1]["podtrain-next-line/acc"]
    assert _acc(two) == _acc(one) == pytest.approx(in_loop)
    meta = json.loads(two.read_text())["podtrain"]
    assert meta["world_size"] == 2 and meta["step"] == 40 and meta["requests"] >= 4 * LIMIT


@pytest.mark.slow
def test_a_task_from_the_users_yaml_and_jsonl_runs_and_mistakes_are_one_line(trained, tmp_path, capsys):
    from podtrain.cli import main
    from podtrain.eval.tasks import task_yaml

    root, data, run_dir = trained
    docs = [{"context": "def add(a, b):\n", "choices": ["    return a + b\n", "import os\n"], "label": 0},
            {"context": "for i in range(3):\n", "choices": ["class A:\n", "    print(i)\n"], "label": 1}]
    mine = tmp_path / "tasks"
    mine.mkdir()
    (mine / "mine.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (mine / "mine.yaml").write_text(task_yaml("my-python", mine / "mine.jsonl"))
    out = tmp_path / "mine.json"
    assert main(["eval", str(run_dir), "--tasks", "my-python", "--include", str(mine), "--out", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["my-python"]
    assert result["acc,none"] in (0.0, 0.5, 1.0) and json.loads(out.read_text())["podtrain"]["requests"] == 4
    capsys.readouterr()
    # a dataset that is not on this machine (offline): one line naming it and how to get it
    (mine / "remote.yaml").write_text(task_yaml("remote", mine / "x.jsonl").replace(
        "dataset_path: json", "dataset_path: nobody/not-a-dataset"))
    assert main(["eval", str(run_dir), "--tasks", "remote", "--include", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nobody/not-a-dataset" in err[0] and "load_dataset" in err[0]
    # (an unknown name is one line too, but proving it indexes lm-eval's ~15,000 task configs: ~15 s)


@pytest.mark.slow
def test_without_lm_eval_one_line_names_the_extra(trained, monkeypatch, capsys):
    from podtrain.cli import main

    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets without the extra
    assert main(["eval", str(trained[2]), "--tasks", "podtrain-next-line"]) == 2
    assert capsys.readouterr().err.strip() == ("podtrain: error: podtrain eval needs lm-evaluation-harness, "
                                               "which is not installed: pip install 'podtrain[eval]'")
