"""The epoch order computed on demand (``samples.permute``): exactly once per epoch for any size,
the same stream however it is cut, a fresh order per epoch and per seed, and a loader over a
billion samples that starts as fast and as small as one over a hundred thousand."""

import numpy as np
import pytest

from loader_scale import cap_private_memory, make_sparse_data_dir, peak_rss_growth
from multirank import run_ranks
from podtrain.data.loader import ShardedLoader
from podtrain.data.samples import KeyedOrder, permute, validation_ids

SIZES = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32, 33, 64, 65, 97, 127, 128, 129, 1000, 1021, 1024, 1025,
         4093, 4096, 4097, 65521, 65536, 65537]  # primes, powers of two, 2^k + 1
SEEDS = [0, 7, 2**40 + 3]


@pytest.mark.parametrize("n", SIZES)
def test_every_position_maps_to_a_distinct_sample_for_any_size(n):
    for seed in SEEDS:
        for epoch in (0, 1, 9):
            ids = permute(np.arange(n, dtype=np.uint64), n, seed, epoch)
            assert ids.dtype == np.int64
            assert np.array_equal(np.sort(ids), np.arange(n)), (n, seed, epoch)


@pytest.mark.parametrize("n", [1, 2, 17, 64, 97, 1025])
def test_the_stream_is_the_same_however_it_is_cut(n):
    rng = np.random.default_rng(n)
    order = KeyedOrder(n, 11)
    length = 3 * n + 5  # several epochs and a partial one
    whole = order.ids(0, length)
    for e in range(3):
        assert np.array_equal(np.sort(whole[e * n:(e + 1) * n]), np.arange(n))
    cuts = np.sort(rng.choice(np.arange(1, length), size=min(length - 1, 12), replace=False))
    pieces = [order.ids(int(a), int(b - a)) for a, b in zip([0, *cuts], [*cuts, length])]
    assert np.array_equal(np.concatenate(pieces), whole)
    for start in rng.integers(0, length, size=10):  # resume anywhere: the same continuation
        assert np.array_equal(KeyedOrder(n, 11).ids(int(start), 7), order.ids(0, int(start) + 7)[int(start):])


def test_orders_differ_by_epoch_and_seed_and_show_no_structure():
    n = 10007
    at = np.arange(n, dtype=np.uint64)
    first = permute(at, n, 1, 0)
    assert np.array_equal(first, permute(at, n, 1, 0))  # a pure function of (seed, epoch)
    others = [permute(at, n, 1, e) for e in range(1, 6)] + [permute(at, n, s, 0) for s in (2, 3, 2**63 + 1)]
    for other in others:
        assert (other == first).sum() < 10  # a random pair of permutations shares ~1 place
        assert abs(np.corrcoef(first, other)[0, 1]) < 0.05
    assert abs(np.corrcoef(np.arange(n), first)[0, 1]) < 0.05  # not the identity, nor close to it
    assert (np.abs(np.diff(first)) == 1).sum() < 10  # neighbours in the order are not neighbours on disk
    # tiny epochs still vary: the 4! orders of 4 samples over 400 epochs show most of them
    assert len({tuple(permute(np.arange(4, dtype=np.uint64), 4, 5, e)) for e in range(400)}) >= 12


def test_validation_ids_cost_follows_the_limit_not_the_split():
    assert validation_ids(10**15, 3, 512, 4).tolist() == [3, 515, 1027, 1539]
    parts = [validation_ids(10, r, 3, 2) for r in range(3)]
    assert [p.tolist() for p in parts] == [[0, 3], [1, 4], [2, 5]]


SEQ, GLOBAL, MICRO = 16, 8, 2  # few windows: the first batch reads one page (and its read-ahead) each


def _start(data):
    def start():
        ld = ShardedLoader(data, SEQ, GLOBAL, MICRO, 0, 1, seed=5, prefetch=1)
        ids = ld.next().sample_ids
        ld.close()
        return ids
    out = {}
    seconds, grew = peak_rss_growth(lambda: out.setdefault("ids", start()))
    return seconds, grew, out["ids"]


def _small_and_big(rank, world, small, big):
    cap_private_memory(1 << 30)  # an O(samples) order (4 GB at 1e9) fails here at once
    _start(small)  # imports, the first thread: paid by whichever starts first
    return _start(small), _start(big)


def test_a_loader_over_a_billion_samples_starts_like_a_small_one(tmp_path):
    small = make_sparse_data_dir(tmp_path / "small", 10**5, SEQ)
    big = make_sparse_data_dir(tmp_path / "big", 10**9, SEQ)  # 32 GB of shards, none on disk
    (small_s, small_rss, _), (big_s, big_rss, ids) = run_ranks(_small_and_big, 1, small, big)[0]
    assert big_s - small_s < 2.0, (small_s, big_s)
    assert big_rss - small_rss < 32 << 20, (small_rss, big_rss)
    assert len(set(ids.tolist())) == GLOBAL and 0 <= ids.min() and ids.max() < 10**9
    assert ids.max() > 10**8  # drawn from the whole corpus, not its start
