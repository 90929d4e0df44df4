"""``prepare`` never replaces another dataset without ``--force`` (issue 30, point 2)."""

import json

from test_prepare import make_corpus, opts, run_cli

from podtrain.data.prepare import pipeline as prep


# What run_cli passes: the CLI's defaults for the options that shape shards.
SAME = {"chunk_bytes": prep.DEFAULT_CHUNK_BYTES, "shard_tokens": prep.DEFAULT_SHARD_TOKENS}


def snapshot(folder) -> dict:
    """Every file under ``folder`` with its bytes and mtime: what "unchanged" means."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_another_dataset_is_refused_in_one_line_and_left_unchanged(tmp_path, capsys, monkeypatch):
    make_corpus(tmp_path / "big", n=40)
    (tmp_path / "small").mkdir()
    (tmp_path / "small/one.txt").write_text("a much smaller corpus\n")
    base = ["--out", tmp_path / "d", "--val-fraction", "0"]
    code, _ = run_cli([tmp_path / "big", *base], capsys)
    assert code == 0
    tokens = json.loads((tmp_path / "d/manifest.json").read_text())["splits"]["train"]["tokens"]
    before = snapshot(tmp_path / "d")

    code, err = run_cli([tmp_path / "small", *base], capsys)
    assert code == 2
    assert err == (f"podtrain: error: --out {tmp_path / 'd'} holds another dataset ({tokens:,} tokens from "
                   f"{tmp_path / 'big'} (41 files), tokenizer 'byte'); this prepare would replace it with "
                   f"{tmp_path / 'small'} (1 file), tokenizer 'byte' (inputs: 41 files -> 1 file): choose another --out, "
                   "or pass --force to replace it")
    code, err = run_cli([tmp_path / "big", *base[:-1], "0.1"], capsys)  # the same inputs, another split
    assert code == 2 and "(options: --val-fraction 0.0 -> 0.1)" in err
    assert snapshot(tmp_path / "d") == before  # not a byte, not a timestamp

    # The same command is not refused: up to date, then rebuilt from an input changed since (an update),
    # also when the folder is named from another working directory (the recipe's inputs are absolute).
    assert prep.prepare(opts([tmp_path / "big"], tmp_path / "d", val_fraction=0.0, **SAME)).up_to_date
    (tmp_path / "big/d000.txt").write_text("changed\n")
    monkeypatch.chdir(tmp_path)
    again = prep.prepare(opts(["big"], tmp_path / "d", val_fraction=0.0, **SAME))
    assert not again.up_to_date and again.manifest["splits"]["train"]["tokens"] != tokens

    code, _ = run_cli([tmp_path / "small", *base, "--force"], capsys)
    assert code == 0
    assert json.loads((tmp_path / "d/manifest.json").read_text())["splits"]["train"]["documents"] == 1


def test_a_dataset_from_before_the_recipe_is_compared_by_what_it_records(tmp_path, capsys):
    make_corpus(tmp_path / "c", n=6)
    make_corpus(tmp_path / "other", n=3)
    prep.prepare(opts([tmp_path / "c"], tmp_path / "d", val_fraction=0.0))
    manifest = json.loads((tmp_path / "d/manifest.json").read_text())
    del manifest["recipe"]  # as podtrain wrote it before
    (tmp_path / "d/manifest.json").write_text(json.dumps(manifest))
    assert prep.prepare(opts([tmp_path / "c"], tmp_path / "d", val_fraction=0.0)).up_to_date
    code, err = run_cli([tmp_path / "other", "--out", tmp_path / "d", "--val-fraction", "0"], capsys)
    assert code == 2 and "holds another dataset" in err and "(inputs: 7 files -> 4 files)" in err
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "d", "--val-fraction", "0", "--tokenizer", "bpe:300"],
                        capsys)
    assert code == 2 and "(tokenizer byte -> bpe:300)" in err


def test_parts_and_the_tokenizer_step_are_refused_over_another_dataset(tmp_path, capsys):
    make_corpus(tmp_path / "c", n=6)
    make_corpus(tmp_path / "other", n=3)
    prep.prepare(opts([tmp_path / "c"], tmp_path / "d"))
    before = snapshot(tmp_path / "d")
    for extra in (["--num-parts", "2", "--part", "0"], ["--tokenizer", "bpe:300", "--train-tokenizer-only"]):
        code, err = run_cli([tmp_path / "other", "--out", tmp_path / "d", *extra], capsys)
        assert code == 2 and "holds another dataset" in err, err
    assert snapshot(tmp_path / "d") == before  # the merged manifest a part would remove is still there
