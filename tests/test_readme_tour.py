"""Every `podtrain` command of the README's ten-minute tour works as shown.

The commands are read from README.md's "A ten-minute tour" section and run in a fresh directory laid
out as a clone (configs/demo.yaml) with a small `corpus/` of text files. Only the training is cut
short: `launch local` gets overrides appended (later overrides win) so that it trains 2 steps of a
small batch instead of 60; every other command runs exactly as the README prints it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from podtrain import cli

pytestmark = pytest.mark.e2e

SECTION = "## A ten-minute tour"
SHORT_TRAINING = ["train.steps=2", "eval.every=2", "ckpt.every=2", "eval.max_batches=2", "data.seq_len=32",
                  "train.micro_batch_size=2", "train.global_batch_size=4", "log.every=1", "log.progress=plain",
                  "optim.warmup_steps=1", "log.trackers=none"]


def tour_commands(readme: str) -> list[list[str]]:
    """The argv (after `podtrain`) of every `podtrain ...` line in the tour's code blocks, in order."""
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start:end if end != -1 else None]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():  # a command continued with a backslash
            if line.startswith("podtrain "):
                commands.append(shlex.split(line)[1:])
    return commands


def make_corpus(folder: Path) -> None:
    """About 300 KB of real text: Python standard-library modules saved as .txt files."""
    folder.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse", "json/decoder", "shlex", "textwrap", "string", "pathlib", "glob", "fnmatch"):
        source = stdlib / f"{name}.py"
        if source.is_file():
            (folder / f"{name.replace('/', '_')}.txt").write_text(source.read_text())


def test_every_command_of_the_readme_tour_runs_as_shown(repo, tmp_path, monkeypatch, capsys):
    commands = tour_commands((repo / "README.md").read_text())
    names = [" ".join(c[:2]) if c[0] == "launch" else c[0] for c in commands]
    assert names == ["prepare", "launch local", "plot", "sample", "export", "plan", "launch slurm",
                     "launch k8s"], names
    (tmp_path / "configs").mkdir()
    shutil.copy(repo / "configs/demo.yaml", tmp_path / "configs/demo.yaml")
    make_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    outputs = {}
    for argv, name in zip(commands, names):
        capsys.readouterr()
        if name == "launch local":  # torchrun in its own process, as a user runs it
            proc = subprocess.run([sys.executable, "-m", "podtrain.cli", *argv, *SHORT_TRAINING],
                                  capture_output=True, text=True, timeout=300, cwd=tmp_path)
            assert proc.returncode == 0, f"podtrain {shlex.join(argv)}: {proc.stderr[-3000:]}"
            continue
        code = cli.main(argv)
        out = capsys.readouterr()
        assert code == 0, f"podtrain {shlex.join(argv)} exited {code}: {out.err[-2000:]}"
        outputs[name] = out.out

    tokenizer = json.loads((tmp_path / "data/mine/manifest.json").read_text())["tokenizer"]
    assert (tokenizer["kind"], tokenizer["name"]) == ("bpe", "bpe:4096")
    records = [json.loads(line) for line in (tmp_path / "runs/mine/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "train"] == [1, 2]
    assert any(r.get("kind") == "eval" and r["val_loss"] > 0 for r in records)
    assert (tmp_path / "mine.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert outputs["sample"].strip()  # some text came out
    exported = json.loads((tmp_path / "hf/mine/config.json").read_text())
    assert exported["vocab_size"] >= tokenizer["vocab_size"] and (tmp_path / "hf/mine/tokenizer.json").is_file()
    assert outputs["plan"].startswith("model: tiny")
    script = (tmp_path / "job.sh").read_text()
    assert script.startswith("#!/bin/bash") and "/fsx/runs/mine" in script and "torchrun" in script
    manifest = (tmp_path / "job.yaml").read_text()
    assert "kind: PyTorchJob" in manifest and "REPO/podtrain:0.1" in manifest and "fsx-claim" in manifest
