"""Storage failures on a user's path are one line and exit 2, wherever they happen.

The disks are real: a 2 MiB tmpfs (a full disk) and a tmpfs remounted read-only, mounted by the
test (the suite runs as root in its container, where chmod 0o555 would not stop a write). Where
mounting is not permitted the tests that need it skip and say so.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from podtrain.cli import main
from podtrain.errors import storage_error
from synthetic_data import make_data_dir

BASE = ["data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2", "log.progress=plain",
        "monitor.watchdog=false", "eval.every=0", "log.every=1", "monitor.straggler_every=0"]


@pytest.fixture(autouse=True)
def _own_log_handlers():
    """An in-process ``train`` points podtrain's logger at this test's captured stdout: put the
    handlers back, so a later test does not log into a closed stream."""
    logger = logging.getLogger("podtrain")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate


def _mount(folder: Path, *options: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=2m", *options)), "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    return folder


@pytest.fixture
def read_only(tmp_path):
    """A read-only file system (tmpfs mounted with ``ro``)."""
    folder = _mount(tmp_path / "ro", "ro")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MiB tmpfs, filled to the last block."""
    folder = _mount(tmp_path / "full")
    with open(folder / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def _one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("podtrain: error: "), err
    return err[0]


# -- the rule ------------------------------------------------------------------------------------
def test_only_storage_conditions_on_a_named_path_become_one_line():
    ro = storage_error(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run"))
    assert str(ro) == "cannot write /mnt/ro/run: the file system is read-only; choose a writable location"
    assert "cannot use /x/y: a file is in the way" in str(storage_error(NotADirectoryError(errno.ENOTDIR, "x", "/x/y")))
    try:  # a background write re-raised at wait(): the cause counts
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/d/ckpt/step_4/model.safetensors")
        except OSError as cause:
            raise RuntimeError("checkpoint of step 4 failed") from cause
    except RuntimeError as exc:
        assert str(storage_error(exc)).startswith("cannot write /d/ckpt/step_4/model.safetensors: no space left")
    # Bugs keep their traceback: a missing file, a permission error naming no path, the rest;
    # a full or read-only disk is never a bug, even where the OS named no file.
    assert storage_error(FileNotFoundError(errno.ENOENT, "No such file", "/run/x.json")) is None
    assert str(storage_error(OSError(errno.ENOSPC, "No space left"))) == (
        "a write failed: no space left on the device; free some or choose another location")
    assert storage_error(OSError(errno.EACCES, "Permission denied")) is None  # no path: maybe a bug
    assert storage_error(ValueError("bad")) is None


# -- the commands ------------------------------------------------------------------------------------
def test_train_and_launch_local_on_a_read_only_run_dir(capsys, read_only, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    args = ["configs/demo.yaml", f"data.path={data}", f"run.dir={read_only / 'run'}", *BASE, "train.steps=1"]
    line = _one_line(capsys, main(["train", *args]))
    assert f"cannot write {read_only / 'run'}" in line and "read-only" in line
    line = _one_line(capsys, main(["launch", "local", *args, "--nproc", "2", "train.global_batch_size=4"]))
    assert f"cannot write {read_only / 'run'}" in line and "read-only" in line


def test_a_run_dir_where_no_folder_can_be_made_is_one_line(capsys, tmp_path, repo, monkeypatch):
    """/proc cannot hold folders (mkdir says ENOENT, which is otherwise left a traceback)."""
    monkeypatch.chdir(repo)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    args = ["configs/demo.yaml", f"data.path={data}", "run.dir=/proc/podtrain-run", *BASE, "train.steps=1"]
    for argv in (["train", *args], ["launch", "local", *args, "--nproc", "2", "train.global_batch_size=4"]):
        line = _one_line(capsys, main(argv))
        assert line.startswith("podtrain: error: cannot create /proc/podtrain-run") and "cannot hold folders" in line, line


def test_train_on_a_full_disk_ends_with_one_line(capsys, full_disk, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    args = ["train", "configs/demo.yaml", f"data.path={data}", *BASE, "train.steps=30", "ckpt.every=0"]
    line = _one_line(capsys, main([*args, f"run.dir={full_disk / 'run'}"]))  # full at the start
    assert line.startswith(f"podtrain: error: cannot write {full_disk / 'run'}") and "no space left" in line
    # Room to start (the probe, lineage.json, owner.json, the lease, config.yaml, metrics.jsonl's
    # first page), then the disk fills during training: the metrics line or TensorBoard's events that need another page fail.
    filler = full_disk / "filler"
    pages = filler.stat().st_size // 4096
    os.truncate(filler, (pages - 6) * 4096)
    code = main([*args, f"run.dir={full_disk / 'run'}"])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err, err
    assert "] done: " not in out and "step 3/30" in out  # it trained, then stopped at the failure
    line = err.strip().splitlines()[-1]
    assert line in (f"podtrain: error: cannot write {full_disk / 'run' / name}: no space left on the "
                    "device; free some or choose another location" for name in ("metrics.jsonl", "tb")), line


def test_prepare_export_and_plot_outputs_on_a_read_only_disk(capsys, read_only, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world\n" * 50)
    line = _one_line(capsys, main(["prepare", str(corpus), "--out", str(read_only / "data")]))
    assert f"cannot write {read_only / 'data'}" in line
    line = _one_line(capsys, main(["export", str(tmp_path / "run"), str(read_only / "hf")]))
    assert f"cannot write {read_only}" in line and "read-only" in line  # before any work
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0, "tokens_seen": 64}\n')
    line = _one_line(capsys, main(["plot", str(run), "--out", str(read_only / "sub" / "curves.html")]))
    assert f"cannot write {read_only / 'sub'}" in line


def test_doctor_reports_an_unwritable_run_dir_as_a_failed_check(capsys, read_only):
    code = main(["doctor", "--run-dir", str(read_only / "run"), "--matmul-size", "64"])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err, err
    check = [x for x in out.splitlines() if "run dir" in x and x.startswith("[FAIL]")]
    assert len(check) == 1 and f"{read_only / 'run'} not writable" in check[0] and "Read-only" in check[0], out


def test_launch_output_survives_its_log_on_a_full_disk(full_disk):
    """The agents' pipes keep draining (the workers never block) and the log's failure is one line."""
    from podtrain.launch.agent_output import AgentOutput

    script = ("import sys\n"
              "for i in range(3000): print('torchrun line', i, 'x' * 60)\n"
              "print('[default0]:worker says hi')\n")
    agent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    with AgentOutput([agent], full_disk / "torchrun.log") as output:
        assert agent.wait(timeout=60) == 0
    assert output.log_error is not None and output.log_error.startswith(f"cannot write {full_disk}")
    assert "no space left" in output.log_error
    assert output.torchrun_text.count("torchrun line") == 3000
