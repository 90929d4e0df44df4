"""The closing line's unigram entropy comes from token counts ``prepare`` kept, not from the shards
(issue 37, 4): it reads no token at the end of a run, and its value is the one read from the tokens.

Shard reads are counted for real by a CPython audit hook (every ``open`` of the process).
"""

import json
import math
import os
import shutil
import sys
import threading

import numpy as np
import pytest
from test_prepare import make_corpus, opts, split_tokens
from test_prepare_parts import prepare_in_parts

from podtrain import cli
from podtrain.data.loader import blend_entropy
from podtrain.data.manifest import read_manifest
from podtrain.data.prepare import pipeline as prep

_opened: list | None = None  # (thread name, path) of each shard file opened while a test records


def _hook(event, args):
    if _opened is not None and event == "open" and isinstance(args[0], (str, os.PathLike)):
        path = os.fspath(args[0])
        if isinstance(path, str) and path.endswith(".bin"):
            _opened.append((threading.current_thread().name, path))


sys.addaudithook(_hook)  # cannot be removed: it records only while a test sets _opened


def old_entropy(data_dir, split="train") -> float:
    """What the closing line printed before counts: every token read, counted, normalised."""
    manifest = read_manifest(data_dir)
    counts = np.bincount(split_tokens(data_dir, split), minlength=manifest.vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_the_closing_line_reads_no_shard_and_gives_the_demo_corpus_entropy(builtin_corpus, tmp_path, capsys):
    global _opened
    expected = old_entropy(builtin_corpus)
    _opened = []
    try:
        code = cli.main(["train", "configs/demo.yaml", f"data.path={builtin_corpus}", f"run.dir={tmp_path / 'run'}",
                         "train.steps=2", "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2",
                         "optim.warmup_steps=1", "eval.every=0", "ckpt.every=0", "data.verify=false",
                         "log.progress=plain"])
        opened = list(_opened)
    finally:
        _opened = None
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    # The batches are read by the loader's thread; the main thread (where the closing line is
    # made, data.verify off) opens no training shard: the old line read 15 MB of it there.
    main = threading.main_thread().name
    assert [p for t, p in opened if t == main and "train_" in os.path.basename(p)] == []
    assert any("train_" in os.path.basename(p) for _, p in opened)  # the hook does see the loader's reads
    line = next(ln for ln in (out.err + out.out).splitlines() if "unigram entropy of the training data" in ln)
    assert f"unigram entropy of the training data {expected:.4f} nats" in line, line
    # the same figure, to the last bit, as the tokens give (read with HEAD's method)
    from podtrain.data.mixture import entropy_clause  # (new: imported here, so HEAD fails above)

    manifest = read_manifest(builtin_corpus)
    assert entropy_clause([manifest], [1.0]) == f"{expected:.4f} nats (a model that ignored context would sit there)"
    assert blend_entropy([manifest], [1.0]) == pytest.approx(expected, abs=1e-12)
    assert math.isclose(float(entropy_clause([manifest], [1.0]).split()[0]), expected, abs_tol=5e-5)


def test_counts_are_exact_with_workers_resumes_parts_and_a_mixture(tmp_path):
    from podtrain.data.manifest import COUNTS_NAME
    from podtrain.data.mixture import entropy_clause

    corpus = tmp_path / "c"
    make_corpus(corpus, n=60)
    kw = dict(tokenizer="byte", workers=2, shard_tokens=3000)
    one = tmp_path / "one"
    prep.prepare(opts([corpus], one, **kw))
    manifest = read_manifest(one)
    for split in ("train", "val"):
        np.testing.assert_array_equal(
            manifest.token_counts(split), np.bincount(split_tokens(one, split), minlength=manifest.vocab_size))
    full = manifest.token_counts("train")

    # An interrupted run (its manifest, counts and last shards gone) resumes: the counts of the
    # kept shards are read while they are checked, those written now are counted as written.
    resumed = tmp_path / "resumed"
    shutil.copytree(one, resumed)
    shards = sorted(resumed.glob("train_*.bin"))
    assert len(shards) >= 4
    for gone in [resumed / "manifest.json", resumed / COUNTS_NAME, *shards[-2:]]:
        gone.unlink()
    result = prep.prepare(opts([corpus], resumed, **kw))
    assert result.shards_written == 2 and result.shards_skipped > 0
    np.testing.assert_array_equal(read_manifest(resumed).token_counts("train"), full)

    # Data prepared before counts: the line says so, reading nothing; the same prepare command
    # counts its shards without writing one again.
    old = tmp_path / "old"
    shutil.copytree(one, old)
    raw = json.loads((old / "manifest.json").read_text())
    del raw["token_counts"]
    (old / "manifest.json").write_text(json.dumps(raw))
    (old / COUNTS_NAME).unlink()
    global _opened
    _opened = []
    try:
        note = entropy_clause([read_manifest(old)], [1.0])
        assert _opened == []
    finally:
        _opened = None
    assert note == (f"n/a ({old} was prepared before podtrain counted tokens; run its `podtrain prepare` "
                    "command again to count them)")
    again = prep.prepare(opts([corpus], old, **kw))
    assert again.shards_written == 0 and not again.up_to_date
    np.testing.assert_array_equal(read_manifest(old).token_counts("train"), full)

    # Parts then merge: the parts' counts summed are the one-shot counts.
    prepare_in_parts([corpus], tmp_path / "many", 3, **kw)
    assert cli.main(["prepare", "merge", str(tmp_path / "many")]) == 0
    for split in ("train", "val"):
        np.testing.assert_array_equal(read_manifest(tmp_path / "many").token_counts(split),
                                      manifest.token_counts(split))

    # A mixture's figure: the blend of the sources' counts, as the tokens give it.
    other = tmp_path / "other"
    prep.prepare(opts([corpus / "d000.txt", corpus / "d001.txt"], other, tokenizer="byte", val_fraction=0.0))
    both = [manifest, read_manifest(other)]
    value = float(entropy_clause(both, [3.0, 1.0]).split()[0])
    assert value == pytest.approx(blend_entropy(both, [3.0, 1.0]), abs=5e-5)
    assert round(blend_entropy(both, [3.0, 1.0]), 4) == value
