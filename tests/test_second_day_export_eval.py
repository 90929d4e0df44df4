"""Issue 38, items 4-6: `export` onto a full disk is one line and leaves nothing half-written; a
second `eval` of one step keeps the first one's tasks; a mistyped local `--tokenizer` path fails
at once, without asking the Hugging Face Hub."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from podtrain.cli import main
from test_export_sample import bpe_data, make_run
from test_storage_errors import _mount

SRC = Path(__import__("podtrain").__file__).resolve().parents[1]
"""The tree this test imports podtrain from (its subprocess imports the same)."""


def _one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("podtrain: error: "), (code, err)
    return err[0]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """One checkpoint of a tiny model (test_export_sample's ``make_run``: 3 steps in this process,
    ~7 MiB of weights) on a BPE data directory, shared by this module's export and eval tests
    (export only reads the run; eval writes under its eval/ folder)."""
    base = tmp_path_factory.mktemp("trained")
    make_run(base / "run", bpe_data(base / "data"), vocab=320)
    return base / "run"


# -- 4. export onto a full disk -------------------------------------------------------------------
@pytest.mark.slow
def test_export_onto_a_small_disk_is_one_line_exit_2_and_writes_nothing(trained_run, tmp_path, capsys,
                                                                        monkeypatch):
    from podtrain import export

    disk = _mount(tmp_path / "disk")  # a real 2 MiB tmpfs
    try:
        out = disk / "hf"
        capsys.readouterr()
        line = _one_line(capsys, main(["export", str(trained_run), str(out)]))
        assert f"cannot export to {out}: no space left on the device" in line
        assert "the export needs about 8.0M, 2M is free in" in line, line  # 7.0M of weights + 1M slack
        assert list(disk.iterdir()) == []  # no folder, no temporary one, no probe

        # The disk fills up while writing (the check before passed): the same line, nothing left,
        # and a folder that --force would have replaced is still whole.
        monkeypatch.setattr(export, "export_size", lambda model: 0)
        out.mkdir()
        (out / "earlier.txt").write_text("an earlier export")
        line = _one_line(capsys, main(["export", str(trained_run), str(out), "--force"]))
        assert f"cannot export to {out}: no space left on the device" in line
        assert "is free in" in line and "free some space or choose another OUT_DIR" in line
        assert [p.name for p in disk.iterdir()] == ["hf"]
        assert [p.name for p in out.iterdir()] == ["earlier.txt"]
        assert (out / "earlier.txt").read_text() == "an earlier export"

        # A disk full to the last block: the same line (not the probe's, which cannot say how much).
        (out / "earlier.txt").unlink()
        out.rmdir()
        with open(disk / "filler", "wb") as fh:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
        line = _one_line(capsys, main(["export", str(trained_run), str(out)]))
        assert f"cannot export to {out}: no space left on the device (the export needs about " in line
        assert ", 0B is free in" in line, line
        assert [p.name for p in disk.iterdir()] == ["filler"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_export_size_is_the_weights_save_pretrained_writes(tmp_path):
    """The estimate the free-space check uses equals the tensor bytes of model.safetensors (the
    tied embedding and LM head counted once, as written)."""
    import struct

    from podtrain.export import export_size
    from podtrain.model import build_model, preset_config

    model = build_model(preset_config("tiny", 320), seed=0)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    blob = (tmp_path / "model.safetensors").read_bytes()
    (header,) = struct.unpack("<Q", blob[:8])
    assert export_size(model) == len(blob) - 8 - header > 0


# -- 5. a second eval of the same step ------------------------------------------------------------
@pytest.mark.slow
def test_two_evals_of_one_step_keep_both_tasks_and_a_task_again_replaces_its_own(trained_run, tmp_path,
                                                                                  capsys):
    pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")
    from podtrain.eval.tasks import task_yaml
    from test_eval_source import DOCS

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "code.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name in ("code-a", "code-b"):
        (tasks / f"{name}.yaml").write_text(task_yaml(name, tasks / "code.jsonl"))
    argv = ["eval", str(trained_run), "--include", str(tasks)]
    out = trained_run / "eval" / "step_000003.json"

    assert main(argv + ["--tasks", "code-a,code-b", "--limit", "1"]) == 0
    first = json.loads(out.read_text())
    assert first["n-samples"]["code-b"]["effective"] == 1
    assert main(argv + ["--tasks", "code-b"]) == 0  # all 3 documents this time
    printed = capsys.readouterr().out
    got = json.loads(out.read_text())
    assert sorted(got["results"]) == sorted(got["configs"]) == sorted(got["n-samples"]) == ["code-a", "code-b"]
    assert got["results"]["code-a"] == first["results"]["code-a"]  # kept as it was
    assert got["n-samples"]["code-a"]["effective"] == 1
    assert got["n-samples"]["code-b"]["effective"] == 3  # replaced by the second eval
    assert got["podtrain"]["tasks"] == ["code-b"] and got["podtrain"]["requests"] == 6
    assert got["podtrain_tasks"]["code-a"]["requests"] == 4  # 2 documents x 2 choices, first eval
    assert got["podtrain_tasks"]["code-b"] == got["podtrain"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["step_000003.json"]  # no temporary left
    assert "(kept the earlier results of code-a)" in printed


def test_merge_is_by_task_and_only_within_one_step():
    from podtrain.eval.cli import merge_results

    def evaluation(step, **scores):
        summary = {"step": step, "tasks": sorted(scores), "source": "run"}
        return {"results": {t: {"acc,none": v} for t, v in scores.items()},
                "versions": {t: 1 for t in scores}, "date": float(step or 0) + sum(scores.values()),
                "podtrain": summary, "podtrain_tasks": {t: summary for t in scores}}

    merged, kept = merge_results(evaluation(5, a=0.1, b=0.2), evaluation(5, b=0.9, c=0.3))
    assert kept == ["a"]
    assert merged["results"] == {"a": {"acc,none": 0.1}, "b": {"acc,none": 0.9}, "c": {"acc,none": 0.3}}
    assert merged["versions"] == {"a": 1, "b": 1, "c": 1}
    assert merged["podtrain"]["tasks"] == ["b", "c"] and merged["podtrain_tasks"]["a"]["tasks"] == ["a", "b"]
    # another step's file is replaced whole; a file written before podtrain_tasks existed merges too
    assert merge_results(evaluation(4, a=0.1), evaluation(5, b=0.9)) == (evaluation(5, b=0.9), [])
    legacy = evaluation(None, a=0.5)
    del legacy["podtrain_tasks"]
    merged, kept = merge_results(legacy, evaluation(None, b=0.9))
    assert kept == ["a"] and merged["podtrain_tasks"]["a"] == legacy["podtrain"]


def test_evals_of_one_step_writing_at_once_keep_every_task(tmp_path):
    """Eight writers of one step's file at the same moment (threads: each locks through its own
    open file description, as processes do): every task is in the file, and nothing else is left."""
    pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")
    from podtrain.eval.cli import write_results

    out = tmp_path / "eval" / "step_000007.json"
    start = threading.Barrier(8)

    def write(i: int) -> None:
        start.wait(timeout=30)
        for _ in range(5):  # the same task again: replaces its own entry
            write_results(out, {"results": {f"task-{i}": {"acc,none": i / 10}}, "versions": {f"task-{i}": 1}},
                          {"step": 7, "tasks": [f"task-{i}"], "requests": i})

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    got = json.loads(out.read_text())
    assert got["results"] == {f"task-{i}": {"acc,none": i / 10} for i in range(8)}
    assert {t: s["requests"] for t, s in got["podtrain_tasks"].items()} == {f"task-{i}": i for i in range(8)}
    assert [p.name for p in out.parent.iterdir()] == [out.name]


# -- 6. a local tokenizer path is never sent to the Hub -------------------------------------------
def test_a_mistyped_local_tokenizer_path_fails_in_one_line_without_the_network(tmp_path):
    """`--tokenizer data/tokk` with data/ present: one line in under a second, and no connection to
    the Hub, whose address is a socket of this test's (HF_HUB_OFFLINE=0: the network is allowed)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "corpus.txt").write_text("hello world\n" * 10)
    hub = socket.create_server(("127.0.0.1", 0))
    hub.settimeout(0.2)
    connections: list[object] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = hub.accept()
            except (TimeoutError, OSError):
                continue
            connections.append(conn)
            conn.close()  # refuses at once: an unfixed run retries against it, but never hangs

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    timed = ("import sys, time\nimport podtrain.data.prepare.cli\nfrom podtrain.cli import main\n"
             "print(f'podtrain={podtrain.__file__}')\n"
             "t0 = time.monotonic()\nrc = main(sys.argv[1:])\n"
             "print(f'seconds={time.monotonic() - t0:.3f}')\nsys.exit(rc)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "OMP_NUM_THREADS": "1",
           "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}", "HF_HOME": str(tmp_path / "hf_home"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-c", timed, "prepare", "corpus.txt", "--out", "out",
                               "--tokenizer", "data/tokk"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)
    finally:
        stop.set()
        server.join(timeout=5)
        hub.close()
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
    assert err[0].startswith("podtrain: error: --tokenizer data/tokk: no such file or directory")
    assert "not a Hugging Face Hub id, because data/ is a folder here" in err[0]
    assert f"podtrain={SRC / 'podtrain' / '__init__.py'}" in done.stdout  # the tree under test
    seconds = float(done.stdout.strip().rsplit("seconds=", 1)[-1])
    assert seconds < 1.0, seconds
    assert connections == []  # the Hub was never asked
    assert not (tmp_path / "out").exists()


def test_which_tokenizer_values_are_paths_and_which_hub_ids(tmp_path, monkeypatch):
    from podtrain.data.tokenizer import hub_name_or_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "a-file").write_text("")
    for spec in ("./tok", "../tok", "/abs/tok", "~/tok", "~nobody-here/tok", ".tok", "data/tokk",
                 "data/sub/tok", "org/name/extra", "org/tokenizer.json", "tok.json", "gpt2", "a-file",
                 "org/na me", "org/../name", "org/", "/org", "org//name"):
        assert hub_name_or_path(spec) == "path", spec
    for spec in ("gpt2-org/gpt2", "meta-llama/Llama-3.1-8B", "EleutherAI/pythia-70m", "my_org/tok.v2"):
        assert hub_name_or_path(spec) == "hub", spec
