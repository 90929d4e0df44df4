"""``podtrain prepare``: determinism, idempotence, resume, input formats, bad input."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from podtrain import cli
from podtrain.data.manifest import check_vocab, read_manifest, verify_shards
from podtrain.data.prepare import encode, shards
from podtrain.data.prepare import pipeline as prep
from podtrain.data.prepare.builtin import builtin_files, iter_builtin_documents
from podtrain.data.tokenizer import load_tokenizer, train_bpe
from podtrain.errors import UserError


def make_corpus(root: Path, n: int = 40) -> dict[str, str]:
    """n small text files of varied length plus one large file that must be cut into pieces."""
    root.mkdir(parents=True, exist_ok=True)
    docs = {}
    for i in range(n):
        text = "".join(f"line {j} of doc {i}: {'é' * (j % 3)} {'x' * ((i * 7 + j) % 23)}\n"
                       for j in range(5 + (i * 13) % 40))
        docs[f"d{i:03d}.txt"] = text
    big = "".join(f"def f{j}(x):\n    return x * {j}  # ünïcode\n\n" for j in range(600))
    docs["zbig.md"] = big
    for name, text in docs.items():
        (root / name).write_text(text, encoding="utf-8")
    (root / "ignored.bin").write_bytes(b"\x00\x01")  # unknown suffix inside a directory: not read
    return docs


def opts(inputs, out, **kw) -> prep.PrepareOptions:
    """Small chunks and shards so a small corpus spans many tasks and shards."""
    kw.setdefault("chunk_bytes", 4096)
    kw.setdefault("shard_tokens", 6000)
    kw.setdefault("val_fraction", 0.2)
    kw.setdefault("workers", 1)
    kw.setdefault("progress", False)
    return prep.PrepareOptions(inputs=tuple(str(i) for i in inputs), out=Path(out), **kw)


def split_tokens(data_dir: Path, split: str) -> np.ndarray:
    m = read_manifest(data_dir)
    return np.concatenate([np.fromfile(s.path, dtype=m.dtype) for s in m.shards(split)])


def split_docs(data_dir: Path, split: str) -> list[str]:
    """The documents of a split, decoded (the EOS after each one is the separator)."""
    m = read_manifest(data_dir)
    tok = load_tokenizer(m)
    ids = split_tokens(data_dir, split)
    ends = np.flatnonzero(ids == m.eos_id)
    assert ends.size and ends[-1] == ids.size - 1  # every split ends with a finished document
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]


def shard_bytes(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data_dir.glob("*.bin"))}


def leftovers(data_dir: Path) -> list[str]:
    """Files that must not survive a failed run."""
    if not data_dir.exists():
        return []
    return sorted(str(p.relative_to(data_dir)) for p in data_dir.rglob("*")
                  if p.name == "manifest.json" or p.name.endswith(".tmp") or p.suffix == ".bin")


# ------------------------------------------------------------------------- correctness


def test_every_document_lands_once_in_its_hashed_split(tmp_path):
    docs = make_corpus(tmp_path / "c")
    res = prep.prepare(opts([tmp_path / "c"], tmp_path / "out"))
    m = res.manifest
    want_val = sorted(t for n, t in docs.items() if encode.is_val(n, 0.2))
    want_train = sorted(t for n, t in docs.items() if not encode.is_val(n, 0.2))
    assert 0 < len(want_val) < len(docs)
    assert sorted(split_docs(tmp_path / "out", "train")) == want_train
    assert sorted(split_docs(tmp_path / "out", "val")) == want_val
    # Token and document counts: byte-level means tokens = UTF-8 bytes + one EOS per document.
    for split, want in (("train", want_train), ("val", want_val)):
        s = m["splits"][split]
        assert s["documents"] == len(want)
        assert s["tokens"] == sum(len(t.encode()) for t in want) + len(want)
        assert [sh["tokens"] for sh in s["shards"][:-1]] == [6000] * (len(s["shards"]) - 1)
        for sh in s["shards"]:
            arr = np.fromfile(tmp_path / "out" / sh["file"], dtype=np.uint16)
            assert (sh["max_token_id"], sh["documents"]) == (arr.max(), np.count_nonzero(arr == 256))
    assert len(m["splits"]["train"]["shards"]) >= 3
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 257
    assert m["sources"] == [{"input": str(tmp_path / "c"), "files": len(docs), "bytes":
                             sum(len(t.encode()) for t in docs.values())}]
    verify_shards(read_manifest(tmp_path / "out"))
    # Nothing but our files: no temporaries.
    assert not [p for p in (tmp_path / "out").rglob(".*.tmp")]


def test_deterministic_across_runs_workers_and_chunk_sizes(tmp_path):
    make_corpus(tmp_path / "c")
    prep.prepare(opts([tmp_path / "c"], tmp_path / "a", workers=1))
    prep.prepare(opts([tmp_path / "c"], tmp_path / "b", workers=2))
    # Byte-level ids do not depend on where a large file is cut into pieces.
    prep.prepare(opts([tmp_path / "c"], tmp_path / "c2", workers=1, chunk_bytes=1 << 20))
    ref = shard_bytes(tmp_path / "a")
    assert len(ref) >= 4
    assert shard_bytes(tmp_path / "b") == ref
    assert shard_bytes(tmp_path / "c2") == ref
    assert (tmp_path / "a/manifest.json").read_bytes() == (tmp_path / "b/manifest.json").read_bytes()


@pytest.mark.slow
def test_bpe_deterministic_with_1_and_2_workers_and_roundtrips(tmp_path):
    docs = make_corpus(tmp_path / "c", n=20)
    common = dict(tokenizer="bpe:400", shard_tokens=2000)
    r1 = prep.prepare(opts([tmp_path / "c"], tmp_path / "a", workers=1, **common))
    prep.prepare(opts([tmp_path / "c"], tmp_path / "b", workers=2, **common))
    # A large file cut at "newline before non-space" encodes exactly as when read whole.
    prep.prepare(opts([tmp_path / "c"], tmp_path / "w", workers=1, **dict(common, chunk_bytes=1 << 20)))
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b") == shard_bytes(tmp_path / "w")
    assert (tmp_path / "a/tokenizer/tokenizer.json").read_bytes() == \
        (tmp_path / "b/tokenizer/tokenizer.json").read_bytes()
    tok = r1.manifest["tokenizer"]
    assert (tok["kind"], tok["name"], tok["vocab_size"], tok["eos_id"]) == ("bpe", "bpe:400", 400, 0)
    assert tok["files"] == ["tokenizer/tokenizer.json"]
    assert sorted(split_docs(tmp_path / "a", "train") + split_docs(tmp_path / "a", "val")) == sorted(docs.values())
    total = r1.manifest["splits"]["train"]["tokens"]
    assert total < 0.6 * sum(len(t.encode()) for n, t in docs.items() if not encode.is_val(n, 0.2))


def test_hf_tokenizer_folder_and_uint32(tmp_path):
    import tokenizers
    docs = {"a.txt": "hello world\n", "b.txt": "world hello hello\n", "c.txt": "hello\n", "d.txt": "bye\n"}
    (tmp_path / "c").mkdir()
    for n, t in docs.items():
        (tmp_path / "c" / n).write_text(t)
    # Sparse ids past 65535: the shards must widen to uint32.
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "bye": 70_000, "</s>": 70_001}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok/tokenizer.json").write_text(tok.to_str())
    (tmp_path / "tok/tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    res = prep.prepare(opts([tmp_path / "c"], tmp_path / "out", tokenizer=str(tmp_path / "tok"),
                            val_fraction=0.0))
    m = res.manifest
    assert m["dtype"] == "uint32" and "val" not in m["splits"]
    assert m["tokenizer"]["vocab_size"] == 70_002 and m["tokenizer"]["eos_id"] == 70_001
    assert m["tokenizer"]["files"] == ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]
    ids = split_tokens(tmp_path / "out", "train").tolist()
    assert ids == [1, 2, 70_001, 2, 1, 1, 70_001, 1, 70_001, 70_000, 70_001]
    assert m["splits"]["train"]["shards"][0]["max_token_id"] == 70_001
    assert load_tokenizer(tmp_path / "out").encode("bye hello") == [70_000, 1]
    with pytest.raises(UserError, match="has vocab_size 70002 but the model's vocabulary has 50000"):
        check_vocab(read_manifest(tmp_path / "out"), 50_000)


def test_jsonl_input_with_text_field(tmp_path):
    rows = [{"body": f"record {i} " + "ü" * i, "id": i} for i in range(30)] + [{"body": ""}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # a blank line is skipped
    res = prep.prepare(opts([path], tmp_path / "out", text_field="body", chunk_bytes=256))
    got = sorted(split_docs(tmp_path / "out", "train") + split_docs(tmp_path / "out", "val"))
    assert got == sorted(r["body"] for r in rows if r["body"])
    val = split_docs(tmp_path / "out", "val")
    # Line i+1 holds record i; its split is the hash of "data.jsonl:LINE".
    assert sorted(val) == sorted(rows[i]["body"] for i in range(30) if encode.is_val(f"data.jsonl:{i + 1}", 0.2))
    assert res.manifest["text_field"] == "body"


def test_parquet_input(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    texts = [f"parquet row {i}\n" * (1 + i % 4) for i in range(600)]
    texts[5] = None  # nulls are skipped
    pq.write_table(pa.table({"content": texts, "n": list(range(600))}), tmp_path / "t.parquet",
                   row_group_size=100)
    prep.prepare(opts([tmp_path / "t.parquet"], tmp_path / "out", text_field="content"))
    got = split_docs(tmp_path / "out", "train") + split_docs(tmp_path / "out", "val")
    assert sorted(got) == sorted(t for t in texts if t)
    val = split_docs(tmp_path / "out", "val")
    assert val == [t for i, t in enumerate(texts) if t and encode.is_val(f"t.parquet#{i}", 0.2)]


def test_glob_and_multiple_inputs(tmp_path):
    make_corpus(tmp_path / "c", n=6)
    (tmp_path / "extra.txt").write_text("extra document\n")
    res = prep.prepare(opts([tmp_path / "c" / "d00*.txt", tmp_path / "extra.txt"], tmp_path / "out",
                            val_fraction=0.0))
    assert res.manifest["splits"]["train"]["documents"] == 7
    assert split_docs(tmp_path / "out", "train")[-1] == "extra document\n"


# -------------------------------------------------------------------- idempotence, resume


def test_second_run_skips_everything(tmp_path):
    make_corpus(tmp_path / "c")
    first = prep.prepare(opts([tmp_path / "c"], tmp_path / "out"))
    n = first.shards_written
    assert n >= 4 and first.shards_skipped == 0
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    second = prep.prepare(opts([tmp_path / "c"], tmp_path / "out", workers=2))  # worker count: not a key
    assert (second.up_to_date, second.shards_written, second.shards_skipped, second.tasks_run) == (True, 0, n, 0)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == mtimes


@pytest.mark.parametrize("tokenizer", ["byte", "bpe:300"])
def test_interrupted_run_resumes_from_the_first_unfinished_shard(tmp_path, monkeypatch, tokenizer):
    make_corpus(tmp_path / "c")
    kw = {"tokenizer": tokenizer, "shard_tokens": 6000 if tokenizer == "byte" else 2500}
    ref = prep.prepare(opts([tmp_path / "c"], tmp_path / "ref", **kw))
    finish = shards.ShardWriter._finish
    calls = []

    def dying_finish(self, *a, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the user pressed Ctrl-C while the 4th shard was filling
        calls.append(self.split)
        return finish(self, *a, **kw)

    monkeypatch.setattr(shards.ShardWriter, "_finish", dying_finish)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(opts([tmp_path / "c"], tmp_path / "out", **kw))
    assert not (tmp_path / "out/manifest.json").exists()
    assert not list((tmp_path / "out").rglob(".*.tmp"))
    assert len(list((tmp_path / "out").glob("*.bin"))) == 3
    tok_file = tmp_path / "out/tokenizer/tokenizer.json"
    tok_mtime = tok_file.stat().st_mtime_ns if tokenizer != "byte" else None
    # The run restarts at the earliest task a split still needs (0 for a split with no shard done).
    restart = min(max((json.loads(p.read_text())["next_task"]
                       for p in (tmp_path / "out/.prepare").glob(f"{split}_*.json")), default=0)
                  for split in ("train", "val"))
    if tokenizer == "byte":
        assert restart > 0
    monkeypatch.setattr(shards.ShardWriter, "_finish", finish)
    res = prep.prepare(opts([tmp_path / "c"], tmp_path / "out", **kw))
    if tok_mtime is not None:  # the trained tokenizer was reused, not trained again
        assert tok_file.stat().st_mtime_ns == tok_mtime
    assert res.shards_skipped == 3
    assert res.shards_written == ref.shards_written - 3
    assert (res.tasks_skipped, res.tasks_run) == (restart, ref.tasks_run - restart)
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "ref")
    assert (tmp_path / "out/manifest.json").read_bytes() == (tmp_path / "ref/manifest.json").read_bytes()


def test_corrupt_shard_is_rebuilt_and_changed_input_starts_over(tmp_path):
    make_corpus(tmp_path / "c")
    first = prep.prepare(opts([tmp_path / "c"], tmp_path / "out"))
    good = shard_bytes(tmp_path / "out")
    shard = tmp_path / "out/train_00001.bin"
    blob = bytearray(shard.read_bytes())
    blob[10] ^= 1
    shard.write_bytes(bytes(blob))
    with pytest.raises(UserError, match=r"train_00001.bin: sha256 does not match"):
        verify_shards(read_manifest(tmp_path / "out"))
    again = prep.prepare(opts([tmp_path / "c"], tmp_path / "out"))
    n_val = len(first.manifest["splits"]["val"]["shards"])
    assert again.shards_skipped == 1 + n_val  # train_00000 and the val shards were still good
    assert shard_bytes(tmp_path / "out") == good
    # A changed input file changes the fingerprint: nothing is reused.
    (tmp_path / "c/d000.txt").write_text("changed\n")
    third = prep.prepare(opts([tmp_path / "c"], tmp_path / "out"))
    assert third.shards_skipped == 0 and third.shards_written >= 4


# ---------------------------------------------------------------------------- bad input


def run_cli(args, capsys):
    code = cli.main(["prepare", *map(str, args), "--no-progress", "--workers", "1"])
    err = capsys.readouterr().err.strip()
    return code, err


def test_missing_path_is_one_line_error_and_writes_nothing(tmp_path, capsys):
    code, err = run_cli([tmp_path / "nope", "--out", tmp_path / "out"], capsys)
    assert code == 2
    assert err == f"podtrain: error: {tmp_path / 'nope'}: no such file or directory"
    assert not (tmp_path / "out").exists()
    code, err = run_cli([str(tmp_path / "*.txt"), "--out", tmp_path / "out"], capsys)
    assert (code, err) == (2, f"podtrain: error: {tmp_path / '*.txt'}: no file matches this pattern")


@pytest.mark.parametrize("content", [None, "", "\n\n"])
def test_empty_corpus(tmp_path, capsys, content):
    (tmp_path / "c").mkdir()
    if content is not None:
        (tmp_path / "c/a.jsonl" if content.strip() == "" and content else tmp_path / "c/a.txt").write_text(content)
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "out"], capsys)
    assert code == 2 and "\n" not in err
    assert err.startswith(f"podtrain: error: {tmp_path / 'c'}: ")
    assert ("no text, .jsonl or .parquet files" in err) if content is None else ("empty corpus" in err)
    assert not (tmp_path / "out").exists()


def test_undecodable_bytes_strict_replace_skip(tmp_path, capsys, monkeypatch):
    finished = []
    finish = shards.ShardWriter._finish
    monkeypatch.setattr(shards.ShardWriter, "_finish",
                        lambda self, *a, **kw: (finished.append(self.split), finish(self, *a, **kw)))
    make_corpus(tmp_path / "c", n=10)
    bad = tmp_path / "c/zz_bad.txt"  # sorted last: earlier shards are written before the error
    bad.write_bytes(b"good start\n" + b"\xff\xfe broken\n")
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "out", "--shard-tokens", "2000",
                         "--chunk-bytes", "2048", "--val-fraction", "0.2"], capsys)
    assert code == 2
    assert err == (f"podtrain: error: {bad}: byte 11 is not valid UTF-8 "
                   "(pass --errors replace or --errors skip)")
    assert len(finished) >= 3  # shards were complete before the bad file came up ...
    assert not (tmp_path / "out").exists()  # ... and are gone: the directory was ours, so removed

    (tmp_path / "keep").mkdir()  # a pre-existing --out directory is kept, emptied of our files
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "keep", "--shard-tokens", "2000"], capsys)
    assert code == 2 and list((tmp_path / "keep").iterdir()) == []

    res = prep.prepare(opts([tmp_path / "c"], tmp_path / "rep", errors="replace", val_fraction=0.0))
    assert res.manifest["errors"] == {"policy": "replace", "replaced": 1, "skipped": 0}
    assert split_docs(tmp_path / "rep", "train")[-1] == "good start\n\ufffd\ufffd broken\n"
    res = prep.prepare(opts([tmp_path / "c"], tmp_path / "skip", errors="skip", val_fraction=0.0))
    assert res.manifest["errors"] == {"policy": "skip", "replaced": 0, "skipped": 1}
    docs = split_docs(tmp_path / "skip", "train")
    assert len(docs) == 11 and not any("broken" in d for d in docs)


def test_all_documents_skipped_is_empty_corpus(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c/a.txt").write_bytes(b"\xff\xff")
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "out", "--errors", "skip"], capsys)
    assert code == 2 and "empty corpus (no text left after decoding" in err
    assert leftovers(tmp_path / "out") == [] and not (tmp_path / "out").exists()


def test_bad_jsonl_lines(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok2"}\n{oops\n')
    code, err = run_cli([path, "--out", tmp_path / "out"], capsys)
    assert code == 2 and err.startswith(f"podtrain: error: {path}:3: not valid JSON (")
    path.write_text('{"text": "ok"}\n{"body": "x"}\n')
    code, err = run_cli([path, "--out", tmp_path / "out"], capsys)
    assert (code, err) == (2, f"podtrain: error: {path}:2: no 'text' field (pass --text-field)")
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    code, err = run_cli([path, "--out", tmp_path / "out"], capsys)
    assert code == 2 and err.startswith(f"podtrain: error: {path}:2: byte 10 is not valid UTF-8")
    assert not (tmp_path / "out").exists()


def test_bad_parquet_column_and_tokenizer_path(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "t.parquet")
    code, err = run_cli([tmp_path / "t.parquet", "--out", tmp_path / "out"], capsys)
    assert (code, err) == (2, f"podtrain: error: {tmp_path / 't.parquet'}: no column 'text' "
                              "(has body, n; pass --text-field)")
    code, err = run_cli([tmp_path / "t.parquet", "--text-field", "n", "--out", tmp_path / "out"], capsys)
    assert code == 2 and "column 'n' has type int64, expected a string column" in err
    (tmp_path / "a.txt").write_text("x")
    code, err = run_cli([tmp_path / "a.txt", "--tokenizer", str(tmp_path / "missing_tok"),
                         "--out", tmp_path / "out"], capsys)
    assert code == 2 and err.startswith(f"podtrain: error: --tokenizer {tmp_path / 'missing_tok'}: no such file")
    code, err = run_cli([tmp_path / "a.txt", "--tokenizer", "bpe:12", "--out", tmp_path / "out"], capsys)
    assert code == 2 and "VOCAB must be between" in err
    assert not (tmp_path / "out").exists()


def test_concurrent_prepare_into_one_directory_is_refused(tmp_path, capsys):
    import fcntl
    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "out").mkdir()
    fd = os.open(tmp_path / "out", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as another running prepare would hold it
    try:
        code, err = run_cli([tmp_path / "a.txt", "--out", tmp_path / "out", "--val-fraction", "0"], capsys)
    finally:
        os.close(fd)
    assert (code, err) == (2, f"podtrain: error: --out {tmp_path / 'out'}: another `podtrain prepare` "
                              "is writing this directory")
    code, _ = run_cli([tmp_path / "a.txt", "--out", tmp_path / "out", "--val-fraction", "0"], capsys)
    assert code == 0
    assert oct((tmp_path / "out/train_00000.bin").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_too_small_for_validation_split(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("just one document\n")
    # Find a fraction that puts this single document in train, so val stays empty.
    code, err = run_cli([tmp_path / "a.txt", "--out", tmp_path / "out", "--val-fraction", "0.001"], capsys)
    assert code == 2 and "no document fell into the validation split (--val-fraction 0.001)" in err
    assert not (tmp_path / "out").exists()
    code, _ = run_cli([tmp_path / "a.txt", "--out", tmp_path / "out", "--val-fraction", "0"], capsys)
    assert code == 0 and read_manifest(tmp_path / "out").splits() == ["train"]


# ------------------------------------------------------------------------------- builtin


def test_builtin_corpus_is_deterministic_and_filtered():
    files = builtin_files(2_000_000)
    assert files == builtin_files(2_000_000)
    names = [f.name for f in files]
    assert names == sorted(names) and all(n.endswith(".py") for n in names)
    assert not any(part in ("test", "tests", "idlelib", "site-packages") for n in names for part in n.split("/"))
    assert sum(f.size for f in files) <= 2_000_000
    first = next(iter_builtin_documents(2_000_000))
    assert first[0] == names[0] and first[1] == files[0].path.read_text(encoding="utf-8")


def test_builtin_prepare_default_has_a_real_validation_split(tmp_path, capsys):
    code = cli.main(["prepare", "builtin", "--out", str(tmp_path / "b"), "--no-progress", "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(f"prepared {tmp_path / 'b'}: ")
    m = read_manifest(tmp_path / "b")
    assert m.vocab_size == 257 and m.eos_id == 256 and m.dtype == np.uint16
    val = m.raw["splits"]["val"]
    assert val["tokens"] >= 50_000 and val["documents"] >= 3
    assert m.raw["splits"]["train"]["tokens"] > 5_000_000
    n_files = m.raw["sources"][0]["files"]
    n_empty = sum(1 for f in builtin_files() if f.size == 0)
    assert val["documents"] + m.raw["splits"]["train"]["documents"] == n_files - n_empty
    tok = load_tokenizer(tmp_path / "b")
    head = np.fromfile(m.shards("train")[0].path, dtype=m.dtype, count=200).tolist()
    assert tok.decode(head) == next(iter_builtin_documents())[1].encode()[:200].decode("utf-8", "replace")


def test_load_tokenizer_from_bpe_data_dir_matches_trained(tmp_path):
    docs = make_corpus(tmp_path / "c", n=8)
    prep.prepare(opts([tmp_path / "c"], tmp_path / "out", tokenizer="bpe:300", val_fraction=0.0))
    tok = load_tokenizer(tmp_path / "out")
    assert (tok.vocab_size, tok.eos_id) == (300, 0)
    again = train_bpe([docs[n] for n in sorted(docs)], 300)  # trained on the same train documents
    text = docs["d001.txt"]
    assert tok.encode(text) == again.encode(text) and tok.decode(tok.encode(text)) == text
    ids = split_tokens(tmp_path / "out", "train")
    assert ids[: len(tok.encode(docs["d000.txt"]))].tolist() == tok.encode(docs["d000.txt"])
    os.remove(tmp_path / "out/tokenizer/tokenizer.json")
    with pytest.raises(UserError, match=r"tokenizer.json is missing"):
        load_tokenizer(tmp_path / "out")


def test_worker_that_cannot_start_fails_instead_of_hanging():
    spec = encode.EncodeSpec("bpe", "{not a tokenizer", 0, "uint16", 0.0, "text", "strict")
    pool = encode._Pool(spec, 1)
    try:
        with pytest.raises(RuntimeError, match="prepare worker process died or could not start"):
            pool.submit([])()
    finally:
        pool.close()
