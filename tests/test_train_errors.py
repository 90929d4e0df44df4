"""`podtrain train` on bad data: one line naming the culprit, exit code 2, in one process."""

import json

import pytest

from podtrain.cli import main
from synthetic_data import make_data_dir


@pytest.fixture
def data(tmp_path):
    return make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)


def train(capsys, data, tmp_path, *overrides):
    code = main(["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={tmp_path / 'run'}",
                 "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2",
                 "train.steps=1", "log.progress=off", "monitor.watchdog=false", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


def test_flipped_byte_in_a_shard_is_named(capsys, data, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    raw = bytearray((data / "train_00000.bin").read_bytes())
    raw[100] ^= 0xFF
    (data / "train_00000.bin").write_bytes(bytes(raw))
    code, err = train(capsys, data, tmp_path)
    assert code == 2 and len(err) == 1
    assert "train_00000.bin: sha256 does not match" in err[0]


def test_model_vocabulary_smaller_than_the_tokenizer(capsys, data, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    code, err = train(capsys, data, tmp_path, "model.vocab_size=128")
    assert code == 2 and len(err) == 1
    assert "has vocab_size 257 but the model's vocabulary has 128" in err[0]


def test_missing_data_directory(capsys, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    code, err = train(capsys, tmp_path / "nope", tmp_path)
    assert code == 2 and err == [f"podtrain: error: data directory {tmp_path / 'nope'} does not exist "
                                 f"(run `podtrain prepare ... --out {tmp_path / 'nope'}`)"]


def test_one_process_trains_and_writes_its_config(capsys, data, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    code, _ = train(capsys, data, tmp_path, "train.steps=3", "log.every=1", "eval.every=0")
    assert code == 0
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the segment marker, 3 train lines, the final save's stall, the goodput account
    assert kinds == ["segment"] + ["train"] * 3 + ["save", "goodput"], kinds
    assert (tmp_path / "run" / "config.yaml").is_file()


def _train_with_rank_local_mistake(rank, world, good, bad, run_dir):
    from podtrain.config import load_config
    from podtrain.errors import UserError
    from podtrain.train.loop import train as train_run

    # Only rank 1 sees a missing data directory (as with a node whose shared mount failed).
    cfg = load_config("configs/demo.yaml", [f"data.path={bad if rank == 1 else good}", f"run.dir={run_dir}",
                                            "data.seq_len=32", "train.micro_batch_size=2",
                                            "train.global_batch_size=4", "monitor.watchdog=false"])
    try:
        train_run(cfg)
    except UserError as exc:
        return str(exc)
    return None


def test_a_mistake_on_one_rank_stops_every_rank(data, tmp_path, repo, monkeypatch):
    from multirank import run_ranks

    monkeypatch.chdir(repo)
    bad = tmp_path / "missing"
    errors = run_ranks(_train_with_rank_local_mistake, 2, str(data), str(bad), str(tmp_path / "run"), timeout=60)
    assert errors[1] == f"data directory {bad} does not exist (run `podtrain prepare ... --out {bad}`)"
    assert errors[0].startswith("rank 1 on ") and errors[0].endswith(errors[1])


def test_launch_local_checks_data_and_memory_before_starting_torchrun_on_mocked_80gb_devices(
        capsys, data, tmp_path, repo, monkeypatch):
    monkeypatch.chdir(repo)
    # The memory a rank's device holds is mocked (80 GiB, an H100's): the verdict must not depend
    # on the memory of the host the test runs on.
    import podtrain.train.preflight as preflight

    monkeypatch.setattr(preflight, "device_memory_bytes", lambda device, local_ranks: 80 * 2**30)
    for override, expected in ((f"data.path={tmp_path / 'nope'}", "does not exist"),
                               ("model.preset=llama-8b", "under dist.strategy=ddp needs")):
        code = main(["launch", "local", "configs/demo.yaml", "--nproc", "2", f"data.path={data}",
                     f"run.dir={tmp_path / 'run'}", "data.seq_len=32", override])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and expected in err[0], err
        if override.startswith("model."):  # the refusal names the strategy that fits
            assert "set dist.strategy=fsdp" in err[0], err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
