"""Compressed inputs (.gz, .bz2, .xz, .zst) read as they stream, and the files not read counted."""

import bz2
import gzip
import importlib
import json
import lzma

import pytest
from test_prepare import opts, run_cli, split_docs

from podtrain import cli
from podtrain.data.prepare import pipeline as prep


def zstd_module():
    """What can write zstd here: Python 3.14's compression.zstd, else zstandard, else None."""
    for name in ("compression.zstd", "zstandard"):
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    return None


HAS_ZSTD = zstd_module() is not None


def zst(data: bytes) -> bytes:
    """Two zstd frames (as pzstd writes them): a reader must go on past the first."""
    if HAS_ZSTD:
        z = zstd_module()
        compress = z.compress if hasattr(z, "ZstdFile") else z.ZstdCompressor().compress
        half = len(data) // 2
        return compress(data[:half]) + compress(data[half:])
    # zstd's magic number and a frame header: enough to be met as a .zst file, and refused.
    return bytes.fromhex("28b52ffd2000") + data


def write_corpus(root):
    """One document per reader and compression, a picture, a tarball, and a hidden file."""
    root.mkdir()
    docs = {"plain.txt": "plain text document\n",
            "notes.md.gz": "gzip text " * 500 + "\n",
            "more.txt.bz2": "bzip2 text document\n",
            "old.txt.xz": "xz text document\n",
            "deep.txt.zst": "zstd text document, " * 300 + "in two frames\n"}
    rows = [{"text": f"jsonl row {i} in a gzip file"} for i in range(3)]
    (root / "plain.txt").write_text(docs["plain.txt"])
    (root / "notes.md.gz").write_bytes(gzip.compress(docs["notes.md.gz"].encode()))
    (root / "more.txt.bz2").write_bytes(bz2.compress(docs["more.txt.bz2"].encode()))
    (root / "old.txt.xz").write_bytes(lzma.compress(docs["old.txt.xz"].encode()))
    (root / "deep.txt.zst").write_bytes(zst(docs["deep.txt.zst"].encode()))
    # Two gzip members, as `cat a.gz b.gz` makes: one file, read to the end.
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (root / "rows.jsonl.gz").write_bytes(gzip.compress(lines[:30]) + gzip.compress(lines[30:]))
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (root / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (root / "bundle.tar.gz").write_bytes(gzip.compress(b"not read"))
    (root / ".hidden.txt").write_text("not corpus\n")
    return sorted(docs.values()) + [r["text"] for r in rows]


@pytest.mark.skipif(not HAS_ZSTD, reason="no zstd reader here (Python 3.14 or `pip install zstandard`)")
def test_compressed_text_and_jsonl_are_read_and_other_files_counted(tmp_path, capsys):
    want = write_corpus(tmp_path / "c")
    code = cli.main(["prepare", str(tmp_path / "c"), "--out", str(tmp_path / "d"), "--val-fraction", "0",
                     "--no-progress", "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert sorted(split_docs(tmp_path / "d", "train")) == sorted(want)
    assert out.strip().endswith("; skipped 3 files: 3 binary (by suffix: bundle.tar.gz, logo.png, photo.png)"), out


def test_compressed_inputs_without_zstd_stop_at_the_zst_file_naming_the_extra(tmp_path, capsys):
    want = write_corpus(tmp_path / "c")
    if HAS_ZSTD:  # the rest of the corpus is what the other test reads in full
        pytest.skip("a zstd reader is installed here: test_compressed_text_and_jsonl_are_read... covers .zst")
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "d", "--val-fraction", "0"], capsys)
    assert (code, err) == (2, f"podtrain: error: {tmp_path / 'c' / 'deep.txt.zst'}: reading .zst files needs "
                              "the zstandard package: pip install 'podtrain[zstd]'")
    assert not (tmp_path / "d").exists()  # before any work
    (tmp_path / "c" / "deep.txt.zst").unlink()
    res = prep.prepare(opts([tmp_path / "c"], tmp_path / "d", val_fraction=0.0))
    assert sorted(split_docs(tmp_path / "d", "train")) == sorted(w for w in want if "zstd" not in w)
    assert res.skipped_files == "skipped 3 files: 3 binary (by suffix: bundle.tar.gz, logo.png, photo.png)"


def test_a_compressed_file_is_cut_into_tasks_like_a_plain_one(tmp_path):
    """Streaming: a file larger than a task is read and cut piece by piece, giving the same tokens."""
    text = "".join(f"line {i}: {'w' * (i % 37)}\n" for i in range(3000))
    (tmp_path / "plain").mkdir()
    (tmp_path / "gz").mkdir()
    (tmp_path / "plain/big.txt").write_text(text)
    (tmp_path / "gz/big.txt.gz").write_bytes(gzip.compress(text.encode()))
    a = prep.prepare(opts([tmp_path / "plain"], tmp_path / "a", val_fraction=0.0, chunk_bytes=4096))
    b = prep.prepare(opts([tmp_path / "gz"], tmp_path / "b", val_fraction=0.0, chunk_bytes=4096))
    assert b.tasks_run == a.tasks_run > 10  # cut in pieces, not read whole
    assert split_docs(tmp_path / "b", "train") == [text]
    assert (tmp_path / "a/train_00000.bin").read_bytes() == (tmp_path / "b/train_00000.bin").read_bytes()


def test_corrupt_compressed_file_and_compressed_parquet_are_one_line(tmp_path, capsys):
    (tmp_path / "bad.txt.gz").write_bytes(b"this is not gzip at all\n")
    code, err = run_cli([tmp_path / "bad.txt.gz", "--out", tmp_path / "d"], capsys)
    assert code == 2 and err.startswith(f"podtrain: error: {tmp_path / 'bad.txt.gz'}: not a readable gzip file (")
    (tmp_path / "cut.txt.xz").write_bytes(lzma.compress(b"truncated " * 1000)[:40])
    code, err = run_cli([tmp_path / "cut.txt.xz", "--out", tmp_path / "d"], capsys)
    assert code == 2 and err.startswith(f"podtrain: error: {tmp_path / 'cut.txt.xz'}: not a readable xz file (")
    assert "\n" not in err and not (tmp_path / "d").exists()
    (tmp_path / "t.parquet.gz").write_bytes(gzip.compress(b"PAR1"))
    code, err = run_cli([tmp_path / "t.parquet.gz", "--out", tmp_path / "d"], capsys)
    assert (code, err) == (2, f"podtrain: error: {tmp_path / 't.parquet.gz'}: a compressed Parquet file cannot "
                              "be read (Parquet compresses its own columns): decompress it first")


def test_a_directory_of_nothing_readable_says_what_it_skipped(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    for name in ("a.pdf", "b.pdf", "c.png", "README"):
        (tmp_path / "c" / name).write_bytes(b"\0")
    code, err = run_cli([tmp_path / "c", "--out", tmp_path / "d"], capsys)
    assert (code, err) == (2, f"podtrain: error: {tmp_path / 'c'}: directory holds no text, .jsonl or .parquet "
                              "files (skipped 4 files: 3 binary (by suffix: a.pdf, b.pdf, c.png), 1 binary (NUL bytes: README))")

