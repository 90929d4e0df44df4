"""``prepare`` on a real tree (issue 38): files named by the shell split like their folder, text
decided by content where the suffix says nothing, a trained tokenizer not replaced silently, and
a split emptied by ``--errors skip`` that says so."""

import gzip
import json
import struct
import zlib

from test_prepare import make_corpus, opts, run_cli, split_docs
from test_prepare_replace import snapshot

from podtrain.data.prepare import pipeline as prep


def notes_tree(root, n: int = 20) -> dict[str, str]:
    """``bN/notes.txt`` for N < n: one file name in many folders (a package-docs tree)."""
    docs = {}
    for i in range(n):
        (root / f"b{i}").mkdir(parents=True)
        docs[f"b{i}/notes.txt"] = f"notes of package {i}\n" * (i + 1)
        (root / f"b{i}/notes.txt").write_text(docs[f"b{i}/notes.txt"])
    return docs


def test_files_named_on_the_command_line_split_like_their_folder(tmp_path, capsys):
    docs = notes_tree(tmp_path / "c")
    common = ["--val-fraction", "0.2"]
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "whole", *common], capsys)
    assert code == 0, err
    val = sorted(split_docs(tmp_path / "whole", "val"))
    assert 0 < len(val) < len(docs)  # a real split, not all-or-nothing
    # As an unquoted shell glob passes them: 20 files, one bare name. And the glob quoted.
    named = [tmp_path / "c" / name for name in sorted(docs)]
    code, err = run_cli([*named, "--out", tmp_path / "named", *common], capsys)
    assert code == 0, err
    code, err = run_cli([str(tmp_path / "c" / "*" / "notes.txt"), "--out", tmp_path / "glob", *common], capsys)
    assert code == 0, err
    for out in ("named", "glob"):
        assert sorted(split_docs(tmp_path / out, "val")) == val
        assert sorted(split_docs(tmp_path / out, "train")) == sorted(split_docs(tmp_path / "whole", "train"))
    # One file, or the files of one folder, keep their bare names (datasets made before stay valid).
    res = prep.prepare(opts([tmp_path / "c/b3/notes.txt"], tmp_path / "one", val_fraction=0.0))
    assert res.manifest["splits"]["train"]["documents"] == 1
    assert json.loads((tmp_path / "one/manifest.json").read_text())["sources"][0]["files"] == 1


def png() -> bytes:
    """A 1x1 grey PNG, as any image writer makes it (its IHDR length and size hold NUL bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\x80")) + chunk(b"IEND", b""))


def test_text_is_decided_by_content_where_the_suffix_says_nothing(tmp_path, capsys):
    root = tmp_path / "doc"
    root.mkdir()
    texts = {"changelog.Debian.gz": "pkg (1.0-1) unstable; urgency=low\n\n  * Initial release.\n",
             "README": "This package does one thing well.\n",
             "a.txt": "first text file\n", "b.txt": "second text file\n", "c.txt": "third text file\n"}
    (root / "changelog.Debian.gz").write_bytes(gzip.compress(texts["changelog.Debian.gz"].encode()))
    for name in ("README", "a.txt", "b.txt", "c.txt"):
        (root / name).write_text(texts[name])
    (root / "logo.png").write_bytes(png())
    (root / "zeros.txt").write_bytes(b"\0" * 20_000)  # 20,001 tokens before: binary, whatever its suffix
    line = prep_cli_summary(root, tmp_path / "d", capsys)
    assert line.endswith("; skipped 2 files: 1 binary (NUL bytes: zeros.txt), 1 binary (by suffix: logo.png)"), line
    assert sorted(split_docs(tmp_path / "d", "train")) == sorted(texts.values())  # five documents

    # A file whose name says nothing must also be UTF-8; the summary line carries the reasons.
    (root / "legacy.dat").write_bytes(b"caf\xe9 cr\xe8me\n")
    line = prep_cli_summary(root, tmp_path / "d2", capsys)
    assert line.endswith("; skipped 3 files: 1 binary (NUL bytes: zeros.txt), 1 binary (by suffix: logo.png), "
                         "1 not UTF-8 text (legacy.dat)"), line

    # Named on the command line, a file is text unless it holds NUL bytes; nothing else: one line.
    code, err = run_cli([root / "zeros.txt", "--out", tmp_path / "d3"], capsys)
    assert (code, err) == (2, f"podtrain: error: {root / 'zeros.txt'}: no input files found "
                              "(skipped 1 file: 1 binary (NUL bytes: zeros.txt))")
    assert not (tmp_path / "d3").exists()


def prep_cli_summary(root, out, capsys) -> str:
    """The summary line ``podtrain prepare ROOT --out OUT --val-fraction 0`` prints."""
    from podtrain import cli
    assert cli.main(["prepare", str(root), "--out", str(out), "--val-fraction", "0", "--no-progress",
                     "--workers", "1"]) == 0
    return capsys.readouterr().out.strip()


def test_train_tokenizer_only_does_not_replace_another_tokenizer(tmp_path, capsys):
    make_corpus(tmp_path / "a", n=4)
    make_corpus(tmp_path / "b", n=2)
    tok = tmp_path / "tok"
    train = ["--out", tok, "--tokenizer", "bpe:300", "--train-tokenizer-only"]
    assert run_cli([tmp_path / "a", *train], capsys)[0] == 0
    before = snapshot(tok)
    # The same command again: a no-op, the tokenizer (and the datasets made with it) untouched.
    from podtrain import cli
    assert cli.main(["prepare", str(tmp_path / "a"), *map(str, train), "--no-progress", "--workers", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"{tok / 'tokenizer'}: bpe:300 already trained for these inputs"
    assert snapshot(tok) == before

    code, err = run_cli([tmp_path / "b", *train], capsys)
    assert (code, err) == (2, f"podtrain: error: --out {tok} holds a tokenizer ('bpe:300', "
                              f"{tok / 'tokenizer/tokenizer.json'}) trained differently (inputs: 5 files -> 3 files); "
                              f"training bpe:300 would replace it under the datasets prepared with --tokenizer "
                              f"{tok}: choose another --out, or pass --force to replace it")
    code, err = run_cli([tmp_path / "a", *train[:3], "bpe:320", train[4]], capsys)
    assert code == 2 and "trained differently (vocabulary 300 -> 320)" in err, err
    assert snapshot(tok) == before  # not a byte, not a timestamp

    assert run_cli([tmp_path / "b", *train, "--force"], capsys)[0] == 0
    record = json.loads((tok / ".prepare/trained-tokenizer.json").read_text())
    assert record["recipe"]["inputs"] == [str(tmp_path / "b")]
    assert (tok / "tokenizer/tokenizer.json").read_bytes() != before["tokenizer/tokenizer.json"][0]


def test_train_tokenizer_only_adopts_the_tokenizer_of_the_same_prepare(tmp_path, capsys):
    make_corpus(tmp_path / "a", n=3)
    data = ["--out", tmp_path / "d", "--tokenizer", "bpe:300", "--val-fraction", "0"]
    assert run_cli([tmp_path / "a", *data], capsys)[0] == 0
    before = snapshot(tmp_path / "d/tokenizer")
    from podtrain import cli
    assert cli.main(["prepare", str(tmp_path / "a"), *map(str, data), "--train-tokenizer-only",
                     "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'd/tokenizer'}: bpe:300 already trained for these inputs"
    assert snapshot(tmp_path / "d/tokenizer") == before  # kept (not a timestamp changed), not trained again
    assert json.loads((tmp_path / "d/.prepare/trained-tokenizer.json").read_text())["tokenizer"]["sha256"] == \
        json.loads((tmp_path / "d/manifest.json").read_text())["tokenizer"]["sha256"]


def test_a_split_emptied_by_errors_skip_says_what_was_skipped(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c/good.txt").write_text("the one decodable document\n")
    for i in range(4):
        (tmp_path / f"c/latin1_{i}.txt").write_bytes(b"caf\xe9 " * (i + 1) + b"\n")
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "d", "--errors", "skip"], capsys)
    assert (code, err) == (2, f"podtrain: error: {tmp_path / 'c'}: no document fell into the validation split "
                              "(--val-fraction 0.03); raise it, add documents, or pass --val-fraction 0; "
                              "--errors skip dropped 4 undecodable documents or pieces")
    assert not (tmp_path / "d").exists()


def test_the_summary_names_a_few_files_per_reason():
    from podtrain.data.prepare.sources import BINARY, NOT_UTF8, Inputs

    inputs = Inputs([])
    for i in range(1300):
        inputs.skip(BINARY, f"pkg{i}/changelog.Debian.gz")
    inputs.skip(NOT_UTF8, "legacy/README")
    assert inputs.skipped_line() == (
        "skipped 1,301 files: 1,300 binary (NUL bytes: pkg0/changelog.Debian.gz, pkg1/changelog.Debian.gz, "
        "pkg2/changelog.Debian.gz, ...), 1 not UTF-8 text (legacy/README)")
    assert Inputs([]).skipped_line() == ""


def test_s3_objects_are_decided_by_their_head_too(s3_bucket, tmp_path, monkeypatch, capsys):
    """Under an s3:// prefix (moto's real S3 server): a ranged GET of each head, a compressed one
    decompressed from its first bytes only; and --train-tokenizer-only refuses there as well."""
    import os

    from podtrain.storage import open_store
    monkeypatch.setenv("PODTRAIN_PREPARE_STAGING", str(tmp_path / "staging"))
    store = open_store(f"s3://{s3_bucket}/docs")
    big = "".join(os.urandom(64).hex() + "\n" for _ in range(2000))  # ~130 KB of gzip: more than one head
    store.write_bytes("pkg/changelog.Debian.gz", gzip.compress(big.encode()))
    store.write_bytes("pkg/README", b"readme text\n")
    store.write_bytes("pkg/core", b"\x7fELF\x02\x01\x01\x00" + b"\0" * 100)
    res = prep.prepare(opts([f"s3://{s3_bucket}/docs"], tmp_path / "d", val_fraction=0.0))
    assert sorted(split_docs(tmp_path / "d", "train")) == sorted([big, "readme text\n"])
    assert res.skipped_files == "skipped 1 file: 1 binary (NUL bytes: pkg/core)"

    tok = f"s3://{s3_bucket}/tok"
    train = ["--out", tok, "--tokenizer", "bpe:300", "--train-tokenizer-only"]
    make_corpus(tmp_path / "a", n=2)
    assert run_cli([tmp_path / "a", *train], capsys)[0] == 0
    before = open_store(tok).read_bytes("tokenizer/tokenizer.json")
    code, err = run_cli([f"s3://{s3_bucket}/docs", *train], capsys)
    assert code == 2 and err.startswith(f"podtrain: error: --out {tok} holds a tokenizer ('bpe:300', "
                                        f"{tok}/tokenizer/tokenizer.json) trained differently (inputs: "), err
    assert open_store(tok).read_bytes("tokenizer/tokenizer.json") == before
    assert not list((tmp_path / "staging").iterdir())
