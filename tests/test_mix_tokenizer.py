"""Sources mixed in one run share one tokenizer: by content, reused with ``--tokenizer DATA_DIR``,
and a refused mix says which command fixes it (issue 30, point 1)."""

import json
import shlex

import numpy as np
import pytest

from podtrain import cli
from podtrain.data.mixture import parse_mix
from podtrain.data.sources import DataSources
from podtrain.errors import UserError

SMALL = ["--no-progress", "--workers", "1", "--val-fraction", "0.1"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two small corpora of different text: web pages and code."""
    root = tmp_path_factory.mktemp("corpora")
    (root / "web").mkdir()
    (root / "code").mkdir()
    for i in range(30):
        (root / "web" / f"{i:02d}.txt").write_text(f"web page {i} about the weather and the news {i * 7}\n" * 3)
        (root / "code" / f"{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}  # code\n" * 3)
    return root


def prepare(*args: str) -> None:
    assert cli.main(["prepare", *map(str, args), *SMALL]) == 0


def mix(*paths) -> DataSources:
    return DataSources(parse_mix([{"path": str(p)} for p in paths], ""), 8)


def tokenizer_of(data) -> dict:
    return json.loads((data / "manifest.json").read_text())["tokenizer"]


@pytest.mark.slow
def test_the_readme_recipe_one_tokenizer_trained_once_then_every_source_prepared_with_it(corpora, tmp_path, repo,
                                                                                         monkeypatch):
    web, code, tok = corpora / "web", corpora / "code", tmp_path / "tok"
    assert cli.main(["prepare", str(web), str(code), "--out", str(tok), "--tokenizer", "bpe:300",
                     "--train-tokenizer-only"]) == 0
    prepare(web, "--out", tmp_path / "web", "--tokenizer", tok)
    prepare(code, "--out", tmp_path / "code", "--tokenizer", tok)
    a, b = tokenizer_of(tmp_path / "web"), tokenizer_of(tmp_path / "code")
    assert a == b and (a["kind"], a["name"], a["vocab_size"]) == ("bpe", "bpe:300", 300)
    assert (tmp_path / "web/tokenizer/tokenizer.json").read_bytes() == (tok / "tokenizer/tokenizer.json").read_bytes()
    sources = mix(tmp_path / "web", tmp_path / "code")  # accepted
    from podtrain.data.sources import MixedIndex
    index = MixedIndex(sources.indexes)
    rows = index.gather(np.array([0, index.offsets[1]]))  # one sample of each source
    assert rows.shape == (2, 9) and rows.max() < 300 and not np.array_equal(rows[0], rows[1])
    # ... and the mix trains (one process, two steps; the config of the mixing example in docs/data.md)
    run = tmp_path / "run"
    monkeypatch.chdir(repo)
    assert cli.main(["train", "configs/demo.yaml", f"run.dir={run}", "train.steps=2", "data.seq_len=16",
                     "train.micro_batch_size=2", "train.global_batch_size=2", "eval.every=0", "log.every=1",
                     "log.progress=off", "log.trackers=none", "monitor.watchdog=false",
                     f"data.mix=[{{path: {tmp_path / 'web'}, weight: 3}}, {{path: {tmp_path / 'code'}, weight: 1}}]"]) == 0
    trained = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in trained if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2] and set(steps[-1]["tokens_by_source"]) == {"web", "code"}


def test_a_byte_identical_tokenizer_at_another_path_is_the_same_tokenizer(corpora, tmp_path):
    prepare(corpora / "web", "--out", tmp_path / "a", "--tokenizer", "bpe:300")
    prepare(corpora / "code", "--out", tmp_path / "b", "--tokenizer", tmp_path / "a" / "tokenizer")
    a, b = tokenizer_of(tmp_path / "a"), tokenizer_of(tmp_path / "b")
    assert (a["kind"], b["kind"]) == ("bpe", "hf") and a["sha256"] == b["sha256"]
    mix(tmp_path / "a", tmp_path / "b")  # kind and path are display only: accepted
    # --tokenizer DATA_DIR: the dataset's own tokenizer, under its own name.
    prepare(corpora / "code", "--out", tmp_path / "c", "--tokenizer", tmp_path / "a")
    assert tokenizer_of(tmp_path / "c") == a
    mix(tmp_path / "a", tmp_path / "b", tmp_path / "c")


def test_a_refused_mix_names_both_tokenizers_and_the_command_that_fixes_it(corpora, tmp_path, monkeypatch):
    prepare(corpora / "web", "--out", tmp_path / "web", "--tokenizer", "bpe:300")
    prepare(corpora / "code", "--out", tmp_path / "code", "--tokenizer", "bpe:300")  # its own BPE
    sha_web, sha_code = tokenizer_of(tmp_path / "web")["sha256"], tokenizer_of(tmp_path / "code")["sha256"]
    assert sha_web != sha_code
    with pytest.raises(UserError) as refused:
        mix(tmp_path / "web", tmp_path / "code")
    line = str(refused.value)
    assert "\n" not in line
    assert f"{tmp_path / 'web'} was prepared with tokenizer bpe:300:{sha_web[:12]} but {tmp_path / 'code'} " \
           f"with bpe:300:{sha_code[:12]}" in line
    command = line.rsplit("`", 2)[-2]
    assert command == (f"podtrain prepare {corpora / 'code'} --out {tmp_path / 'code'} --tokenizer "
                       f"{tmp_path / 'web'} --val-fraction 0.1 --force")
    monkeypatch.chdir(tmp_path)  # the command as the user would paste it
    assert cli.main(shlex.split(command)[1:] + ["--no-progress", "--workers", "1"]) == 0
    assert tokenizer_of(tmp_path / "code")["sha256"] == sha_web
    mix(tmp_path / "web", tmp_path / "code")
