"""`podtrain eval` on a run takes the tokenizer from the same place as export and sample (the run's
data.path or its mix's first source, local or s3://) and reads the model's tensors only."""

import json

import pytest

from podtrain.cli import main
from test_export_sample import _corrupt_optimizer_pieces, bpe_data, make_run, mix_run

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")

DOCS = [{"context": "def add(a, b):\n", "choices": ["    return a + b\n", "import os\n"], "label": 0},
        {"context": "class Point:\n", "choices": ["    x: int = 0\n", "for i in range(10):\n"], "label": 0},
        {"context": "for i in range(10):\n", "choices": ["class A:\n", "    print(i * i)\n"], "label": 1}]


@pytest.fixture
def task_dir(tmp_path):
    from podtrain.eval.tasks import task_yaml

    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "code.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "code.yaml").write_text(task_yaml("code-choice", folder / "code.jsonl"))
    return folder


def _eval(run_dir, task_dir, out, *extra):
    assert main(["eval", str(run_dir), "--tasks", "code-choice", "--include", str(task_dir),
                 "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _same_scores(a, b):
    assert a["results"]["code-choice"] == b["results"]["code-choice"]
    assert a["podtrain"]["requests"] == b["podtrain"]["requests"] == 2 * len(DOCS)


@pytest.mark.slow
def test_eval_of_a_mix_run_uses_its_first_sources_tokenizer_and_no_optimizer_bytes(tmp_path, task_dir):
    from test_export_sample import byte_data

    run_dir, first, _ = mix_run(tmp_path, str(byte_data(tmp_path / "other")))  # data.path: another tokenizer
    _corrupt_optimizer_pieces(run_dir)  # eval reads the model's pieces only
    got = _eval(run_dir, task_dir, tmp_path / "mix.json")
    assert got["podtrain"]["data"] == str(first)
    _same_scores(got, _eval(run_dir, task_dir, tmp_path / "explicit.json", "--data", str(first)))


@pytest.mark.slow
def test_eval_of_a_run_whose_data_is_on_s3(tmp_path, task_dir, s3_server, s3_bucket):
    data = bpe_data(tmp_path / "data")
    for path in data.rglob("*"):
        if path.is_file():
            s3_server.boto.upload_file(str(path), s3_bucket, f"data/{path.relative_to(data)}")
    sha = json.loads((data / "manifest.json").read_text())["tokenizer"]["sha256"]
    url = f"s3://{s3_bucket}/data"
    make_run(tmp_path / "run", url, vocab=320, tokenizer_sha256=sha)
    got = _eval(tmp_path / "run", task_dir, tmp_path / "s3.json")
    assert got["podtrain"]["data"] == url
    _same_scores(got, _eval(tmp_path / "run", task_dir, tmp_path / "local.json", "--data", str(data)))
