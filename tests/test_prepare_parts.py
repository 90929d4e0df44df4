"""``podtrain prepare --num-parts N --part I`` + ``merge``, and a small corpus's validation document."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_prepare import make_corpus, opts, run_cli, split_docs, split_tokens

from podtrain import cli
from podtrain.data.manifest import read_manifest, verify_shards
from podtrain.data.prepare import encode, parts
from podtrain.data.prepare import pipeline as prep
from podtrain.data.prepare.holdout import fallback_val_document
from podtrain.data.prepare.sources import resolve_inputs
from podtrain.distributed.env import task_slot
from podtrain.errors import UserError


def mixed_corpus(root: Path) -> Path:
    """Text files (one cut into pieces), a JSONL and a Parquet file: every reader crosses parts."""
    make_corpus(root, n=60)
    rows = [{"text": f"json record {i} " + "ß" * (i % 7)} for i in range(40)]
    (root / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": [f"parquet row {i}\n" * (1 + i % 3) for i in range(60)]}),
                   root / "p.parquet", row_group_size=16)
    return root


def prepare_in_parts(inputs, out: Path, n: int, **kw) -> None:
    """What a Slurm array does: the tokenizer step, then parts in any order, then merge."""
    base = opts(inputs, out, **kw)
    if base.tokenizer.startswith("bpe:"):
        prep.train_tokenizer(base)
    for i in reversed(range(n)):  # order does not matter
        prep.prepare(opts(inputs, out, num_parts=n, part=i, **kw))


# bpe in parts: test_s3_inputs_and_outputs_one_shot_and_in_parts (the same path, uploaded).
@pytest.mark.parametrize("tokenizer,n", [("byte", 3)])
def test_parts_then_merge_is_the_one_shot_token_stream(tmp_path, capsys, tokenizer, n):
    corpus = mixed_corpus(tmp_path / "c")
    kw = dict(tokenizer=tokenizer, workers=1)
    one = prep.prepare(opts([corpus], tmp_path / "one", **kw)).manifest
    prepare_in_parts([corpus], tmp_path / "many", n, **kw)
    assert not (tmp_path / "many/manifest.json").exists()  # nothing is complete before the merge
    assert cli.main(["prepare", "merge", str(tmp_path / "many")]) == 0
    assert f"merged {n} parts into" in capsys.readouterr().out
    many = read_manifest(tmp_path / "many")
    verify_shards(many)
    assert many.raw["parts"] == n and many.raw["tokenizer"] == one["tokenizer"]
    for split in ("train", "val"):
        got, want = split_tokens(tmp_path / "many", split), split_tokens(tmp_path / "one", split)
        assert got.size > 1000 and np.array_equal(got, want)  # the same stream, byte for byte
        for key in ("tokens", "documents"):
            assert many.raw["splits"][split][key] == one["splits"][split][key]
    # The shards of several parts make up the stream (each part cuts its own shard files).
    folders = {s.path.parent.name for split in ("train", "val") for s in many.shards(split)}
    assert len(folders) >= 2 and folders <= {parts.part_name(i, n) for i in range(n)}  # crosses parts
    assert split_docs(tmp_path / "many", "val") == split_docs(tmp_path / "one", "val")
    assert [(s["input"], s["files"], s["bytes"]) for s in many.raw["sources"]] == \
        [(s["input"], s["files"], s["bytes"]) for s in one["sources"]]
    # A part re-run is up to date and leaves the merged manifest to be written again.
    again = prep.prepare(opts([corpus], tmp_path / "many", num_parts=n, part=0, **kw))
    assert again.up_to_date and not (tmp_path / "many/manifest.json").exists()


def test_merge_refuses_missing_duplicate_and_mismatched_parts(tmp_path, capsys):
    make_corpus(tmp_path / "c", n=12)
    out = tmp_path / "d"

    def merge_err() -> str:
        assert cli.main(["prepare", "merge", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err
        return err

    assert "d: no such directory (the --out of the parts)" in merge_err()
    out.mkdir()
    (out / "train_00000.bin").write_bytes(b"\0\0")  # a one-shot run's shard: stale once parts are merged
    assert "no parts to merge" in merge_err()
    prep.prepare(opts([tmp_path / "c"], out, num_parts=2, part=0))
    assert "part 1 of 2 has not finished" in merge_err() and not (out / "manifest.json").exists()
    prep.prepare(opts([tmp_path / "c"], out, num_parts=2, part=1, val_fraction=0.3))
    assert "part 1 of 2 was made with another val_fraction than part 0" in merge_err()
    prep.prepare(opts([tmp_path / "c"], out, num_parts=2, part=1, chunk_bytes=8192))
    assert "part 1 of 2 was made from other inputs or options than part 0" in merge_err()
    prep.prepare(opts([tmp_path / "c"], out, num_parts=2, part=1))
    shutil.copytree(out / "parts/00000-of-00002", out / "parts/00002-of-00003")
    assert "parts of different --num-parts (2: 00000-of-00002, 00001-of-00002; 3: 00002-of-00003)" in merge_err()
    shutil.rmtree(out / "parts/00002-of-00003")
    shutil.rmtree(out / "parts/00001-of-00002")
    shutil.copytree(out / "parts/00000-of-00002", out / "parts/00001-of-00002")  # a duplicate of part 0
    assert "part 1 of 2: " in (err := merge_err()) and "says it is part 0 of 2" in err
    shutil.rmtree(out / "parts/00001-of-00002")
    prep.prepare(opts([tmp_path / "c"], out, num_parts=2, part=1))
    assert cli.main(["prepare", "merge", str(out)]) == 0
    assert read_manifest(out).raw["splits"]["train"]["documents"] > 0
    assert not (out / "train_00000.bin").exists()


def test_part_comes_from_slurm_and_bpe_parts_need_the_trained_tokenizer(tmp_path, capsys):
    assert task_slot({}) is None
    array = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert task_slot(array) == (1, 4)
    assert task_slot({**array, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == (3, 8)
    assert task_slot({"SLURM_PROCID": "2", "SLURM_NTASKS": "3"}) == (2, 3)
    assert parts.choose_part(4, None, array) == 1
    with pytest.raises(UserError, match="--num-parts 3 but this Slurm job has 4 tasks"):
        parts.choose_part(3, None, array)
    with pytest.raises(UserError, match=r"--num-parts 3 needs --part I \(0..2\)"):
        parts.choose_part(3, None, {})
    with pytest.raises(UserError, match="--part 3: must be between 0 and 2"):
        parts.choose_part(3, 3, {})
    make_corpus(tmp_path / "c", n=6)
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "d", "--tokenizer", "bpe:300",
                         "--num-parts", "2", "--part", "1"], capsys)
    assert code == 2 and "no bpe:300 tokenizer trained for these inputs" in err
    assert "--train-tokenizer-only" in err and not (tmp_path / "d/parts").exists()


def names_with_no_validation_document(n: int, frac: float) -> list[str]:
    """The first family of n file names none of which hashes into the validation split."""
    for family in range(1000):
        names = [f"f{family}_{i:02d}.txt" for i in range(n)]
        if not any(encode.is_val(name, frac) for name in names):
            return names
    raise AssertionError("unreachable: ~23% of families qualify")


def test_small_corpus_keeps_one_validation_document(tmp_path, capsys):
    """Issue 19 point 16: 48 files at the default --val-fraction 0.03 just work."""
    names = names_with_no_validation_document(48, prep.DEFAULT_VAL_FRACTION)
    for i, name in enumerate(names):
        (tmp_path / "c" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "c" / name).write_text(f"document {i}\n" * (i + 1))
    code, _ = run_cli([tmp_path / "c", "--out", tmp_path / "d"], capsys)
    assert code == 0
    held = min(names, key=encode.doc_hash)  # the one closest to being drawn
    assert split_docs(tmp_path / "d", "val") == [f"document {names.index(held)}\n" * (names.index(held) + 1)]
    assert len(split_docs(tmp_path / "d", "train")) == 47
    sources = resolve_inputs([str(tmp_path / "c")])
    assert fallback_val_document(sources, 0.03, "text") == held
    assert fallback_val_document(sources, 0.0, "text") is None
    assert fallback_val_document(sources[:1], 0.03, "text") is None  # one document cannot be both
    # JSONL lines are documents too (a blank line and an empty text are not).
    (tmp_path / "j.jsonl").write_text('{"text": "a"}\n\n{"text": ""}\n{"text": "b"}\n')
    jsonl = resolve_inputs([str(tmp_path / "j.jsonl")])
    want = min(["j.jsonl:1", "j.jsonl:4"], key=encode.doc_hash)
    assert fallback_val_document(jsonl, 1e-9, "text") == want


def s3_stream(url: str, split: str) -> bytes:
    """A split's concatenated shards, read back through the store."""
    from podtrain.storage import open_store
    store = open_store(url)
    manifest = json.loads(store.read_bytes("manifest.json"))
    return b"".join(store.read_bytes(s["file"]) for s in manifest["splits"][split]["shards"])


@pytest.mark.slow
def test_s3_inputs_and_outputs_one_shot_and_in_parts(s3_bucket, tmp_path, monkeypatch, capsys):
    """Text, JSONL and Parquet objects under an s3:// prefix (moto's real S3 server on loopback) ->
    --out s3://: one shot, and bpe in 2 parts + merge; the same streams, the manifest last."""
    from podtrain.storage import open_store
    monkeypatch.setenv("PODTRAIN_PREPARE_STAGING", str(tmp_path / "staging"))
    corpus = mixed_corpus(tmp_path / "c")
    src = open_store(f"s3://{s3_bucket}/corpus")
    for p in sorted(corpus.iterdir()):
        src.write_bytes(p.name, p.read_bytes())
    inputs, kw = [f"s3://{s3_bucket}/corpus"], dict(tokenizer="bpe:300", workers=1)
    def s3opts(out: str, **more):
        return dataclasses.replace(opts(inputs, tmp_path, **kw, **more), out=f"s3://{s3_bucket}/{out}")

    one = prep.prepare(s3opts("one"))
    assert one.out == f"s3://{s3_bucket}/one"
    assert "trained bpe:300 into s3://" in prep.train_tokenizer(s3opts("many"))
    for i in (1, 0):
        prep.prepare(s3opts("many", num_parts=2, part=i))
    assert cli.main(["prepare", "merge", f"s3://{s3_bucket}/many"]) == 0
    for split in ("train", "val"):
        got = s3_stream(f"s3://{s3_bucket}/many", split)
        assert len(got) > 1000 and got == s3_stream(f"s3://{s3_bucket}/one", split)
    shards = [s["file"] for split in one.manifest["splits"].values() for s in split["shards"]]
    names = {e.name for e in open_store(f"s3://{s3_bucket}/one").list()}
    assert names == {"manifest.json", "token_counts.json", "tokenizer/tokenizer.json", *shards}  # nothing else
    # Every document of every reader: 61 text files, 40 JSONL lines, 60 Parquet rows.
    assert sum(s["documents"] for s in one.manifest["splits"].values()) == 61 + 40 + 60
    assert not list((tmp_path / "staging").iterdir())  # staging removed after each upload
