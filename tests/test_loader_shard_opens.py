"""A rank opens only the shards its own samples fall in, when they first reach them (issue 37, 2).

Counted for real: a CPython audit hook sees every ``open`` and ``mmap.__new__`` of the process;
the loader reads a real corpus of 200 small shards, as rank r of 2 and of 8 (a rank's view is the
same in-process: the loader takes rank and world size as arguments).
"""

import os
import sys
import threading

import numpy as np
import pytest

from podtrain.data.loader import ShardedLoader
from podtrain.data.manifest import read_manifest
from podtrain.data.tokens import SplitTokens
from synthetic_data import make_data_dir

SHARDS, SHARD_TOKENS, SEQ, GLOBAL, STEPS = 200, 40, 16, 16, 3

_seen = threading.local()


def _hook(event, args):
    counter = getattr(_seen, "counter", None)
    if counter is None:
        return
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        path = os.fspath(args[0])
        if path.startswith(counter["dir"]) and path.endswith(".bin"):
            counter["open"].append(path)
    elif event == "mmap.__new__":
        counter["mmap"] += 1


sys.addaudithook(_hook)  # audit hooks cannot be removed: it counts only while a test sets a counter


class Counting:
    """Count this thread's opens of shard files under ``folder`` and its memory maps."""

    def __init__(self, folder):
        self.counter = {"dir": str(folder), "open": [], "mmap": 0}

    def __enter__(self):
        _seen.counter = self.counter
        return self.counter

    def __exit__(self, *exc):
        _seen.counter = None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("opens") / "data", shard_tokens=(SHARD_TOKENS,) * SHARDS)


def shards_touched(bounds, ids):
    """The shards the windows of these samples fall in (a window may cross a shard edge)."""
    starts = np.asarray(ids, dtype=np.int64) * SEQ
    first = np.searchsorted(bounds, starts, side="right") - 1
    last = np.searchsorted(bounds, starts + SEQ, side="right") - 1  # the window's last token
    return {int(k) for a, b in zip(first, last) for k in range(a, b + 1)}


def rank_opens(corpus, rank, world):
    """(shard files opened, maps made, shards the rank's samples touch) over STEPS steps, all in
    this thread (``build``, not the background producer)."""
    with Counting(corpus) as counted:
        ld = ShardedLoader(corpus, SEQ, GLOBAL, 1, rank, world, seed=3)
        assert counted["open"] == [] and counted["mmap"] == 0, "the loader's start opened shards"
        ids, rows = [], []
        for step in range(STEPS):
            batch = ld.build(step * GLOBAL)
            ids.append(batch.sample_ids)
            rows.append(np.concatenate([m.numpy() for m in batch.micro_batches]))
    ld.close()
    ids, rows = np.concatenate(ids), np.concatenate(rows)
    # the rows are the samples' windows (token at stream position p is p % 256)
    expected = (ids[:, None] * SEQ + np.arange(SEQ + 1)[None, :]) % 256
    np.testing.assert_array_equal(rows, expected)
    bounds = np.arange(SHARDS + 1, dtype=np.int64) * SHARD_TOKENS
    return counted["open"], counted["mmap"], shards_touched(bounds, ids)


def test_a_rank_opens_and_maps_only_the_shards_its_samples_touch(corpus):
    counts = {}
    for world in (2, 8):
        for rank in (0, world - 1):
            opened, maps, touched = rank_opens(corpus, rank, world)
            assert len(opened) == len(set(opened)), f"a shard was opened twice: {sorted(opened)}"
            assert sorted(opened) == sorted(str(corpus / f"train_{k:05d}.bin") for k in touched)
            assert maps == len(touched) < SHARDS
            counts[world, rank] = len(opened)
    assert counts[8, 0] < counts[2, 0] and counts[8, 7] < counts[2, 1], counts


def test_open_shards_are_bounded_and_reopened_when_needed_again(corpus):
    manifest = read_manifest(corpus)
    tokens = SplitTokens(manifest, "train")
    tokens.max_open = 4
    starts = np.arange(0, SHARDS * SHARD_TOKENS - SEQ, SHARD_TOKENS, dtype=np.int64)  # one window per shard
    with Counting(corpus) as counted:
        rows = tokens.windows(starts, SEQ)
        assert len(tokens._open) == 4  # the four used last
        again = tokens.windows(starts[:1], SEQ)  # shard 0 was closed: opened again, same tokens
    np.testing.assert_array_equal(rows, (starts[:, None] + np.arange(SEQ)[None, :]) % 256)
    np.testing.assert_array_equal(again, rows[:1])
    assert len(counted["open"]) == len(starts) + 1 and counted["mmap"] == len(starts) + 1


def test_verify_opens_only_this_ranks_part(corpus):
    from podtrain.data.manifest import verify_shards

    manifest = read_manifest(corpus)
    for world in (2, 8):
        with Counting(corpus) as counted:
            verify_shards(manifest, ["train"], part=(1, world))
        assert sorted(counted["open"]) == [str(corpus / f"train_{k:05d}.bin") for k in range(1, SHARDS, world)]


def test_a_missing_shard_is_one_line_when_a_window_reaches_it(corpus, tmp_path):
    import shutil

    from podtrain.errors import UserError

    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    (data / "train_00150.bin").unlink()
    tokens = SplitTokens(read_manifest(data), "train")  # starts: nothing is read yet
    assert tokens.windows(np.array([0]), SEQ).shape == (1, SEQ)
    with pytest.raises(UserError, match=r"train_00150\.bin listed in .*manifest\.json is missing"):
        tokens.windows(np.array([150 * SHARD_TOKENS]), SEQ)
    (data / "train_00160.bin").write_bytes(b"\0" * 10)
    with pytest.raises(UserError, match=r"train_00160\.bin holds 5 tokens, the manifest says 40"):
        tokens.windows(np.array([160 * SHARD_TOKENS]), SEQ)
