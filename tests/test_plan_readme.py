"""`podtrain plan` plans the preset it is given, and the docs' example (docs/planning.md) is what it prints.

Issue 30 point 4: over the demo's byte-level data (`make demo`'s data/builtin) a preset was planned
with the data's 320-token vocabulary (llama-8b: 6,982M parameters instead of its 8,030M, and the
README's llama-1b example, 1,235.8M, printed 973.8M). The example now lives in docs/planning.md.
"""

import json
import re
import shlex
import shutil

import pytest

from podtrain.cli import main

PLANNING_PAGE = "docs/planning.md"


def readme_example(repo) -> tuple[list[str], list[str]]:
    """The planning page's example: (argv after `podtrain`, the output lines it shows, '...' aside)."""
    section = (repo / PLANNING_PAGE).read_text()
    block = re.search(r"```\n(\$ podtrain plan .*?)```", section, re.S)[1]
    command, shown = [], []
    lines = iter(block.splitlines())
    for line in lines:
        if line.startswith("$ ") or (command and command[-1].endswith("\\")):
            command.append(line.removeprefix("$ "))
        elif line != "...":
            shown.append(line)
    argv = shlex.split(" ".join(part.rstrip("\\") for part in command))
    assert argv[0] == "podtrain"
    return argv[1:], shown


def in_demo_checkout(repo, tmp_path, monkeypatch, prepared: bool):
    """A directory laid out as a fresh clone (configs/demo.yaml), after `make demo`'s prepare when
    ``prepared``."""
    (tmp_path / "configs").mkdir()
    shutil.copy(repo / "configs/demo.yaml", tmp_path / "configs/demo.yaml")
    monkeypatch.chdir(tmp_path)
    if prepared:
        assert main(["prepare", "builtin", "--out", "data/builtin"]) == 0


def run_plan(capsys, *argv) -> str:
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_the_readme_plan_example_is_what_plan_prints_after_make_demo(repo, tmp_path, monkeypatch, capsys):
    argv, shown = readme_example(repo)
    in_demo_checkout(repo, tmp_path, monkeypatch, prepared=True)
    printed = run_plan(capsys, *argv).splitlines()
    assert printed[0] == shown[0]  # the parameter count and the vocabulary's choice
    assert "1,235.8M parameters with the preset's own vocabulary (128,256)" in printed[0]
    position = 0
    for line in shown:  # every line the page shows, in its order
        assert line in printed[position:], f"{PLANNING_PAGE} line not printed (in order): {line!r}"
        position = printed.index(line, position) + 1


def test_the_readme_example_counts_the_same_model_before_make_demo(repo, tmp_path, monkeypatch, capsys):
    argv, shown = readme_example(repo)
    in_demo_checkout(repo, tmp_path, monkeypatch, prepared=False)
    printed = run_plan(capsys, *argv).splitlines()
    assert printed[0] == shown[0]
    assert printed[1] == "vocabulary: data/builtin has no prepared data here; model.vocab_size=N plans another"


def test_a_preset_over_byte_data_is_planned_at_its_own_size_and_says_what_training_builds(
        repo, tmp_path, monkeypatch, capsys):
    in_demo_checkout(repo, tmp_path, monkeypatch, prepared=True)
    base = ["plan", "configs/demo.yaml", "--instance-type", "p5.48xlarge", "model.preset=llama-8b",
            "train.global_batch_size=64"]
    first, second = run_plan(capsys, *base).splitlines()[:2]
    assert first.startswith("model: llama-8b, 8,030.3M parameters with the preset's own vocabulary (128,256)")
    assert second == ("vocabulary: data/builtin is byte-level (257 ids), a stand-in, not llama-8b's tokenizer; "
                      "training this config as written builds a 320-token embedding: model.vocab_size=320 "
                      "plans that")
    # The override it names plans the model training builds.
    assert run_plan(capsys, *base, "model.vocab_size=320").startswith(
        "model: llama-8b, 6,982.2M parameters with the vocabulary of model.vocab_size (320)")
    plan = json.loads(run_plan(capsys, *base, "--json"))
    assert (plan["model"]["preset"], plan["model"]["params"], plan["vocab"]["size"]) == ("llama-8b", 8030261248, 128256)


@pytest.mark.parametrize("kind, name", [("bpe", "bpe:4096"), ("hf", "gpt2")])
def test_a_trained_tokenizer_in_the_data_is_the_vocabulary_planned(repo, tmp_path, capsys, kind, name):
    from synthetic_data import make_data_dir

    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"].update(kind=kind, name=name, vocab_size=4000)
    (data / "manifest.json").write_text(json.dumps(manifest))
    out = run_plan(capsys, "plan", str(repo / "configs/demo.yaml"), "--instance-type", "p5.48xlarge",
                   f"data.path={data}", "model.preset=llama-1b", "train.micro_batch_size=1",
                   "train.global_batch_size=8")
    label = name if name.startswith(kind) else f"{kind}:{name}"
    first, second = out.splitlines()[:2]
    assert f"with the vocabulary of the data's {label} tokenizer (4,032)" in first
    assert second == (f"vocabulary: the tokenizer of {data} (4,000 tokens, rounded up to 64), which the "
                      "embedding is trained with; model.vocab_size=N plans another")
