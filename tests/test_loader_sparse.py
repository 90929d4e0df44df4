"""A loader whose mix holds a billion-sample source, resumed deep into it, starts within 32 MB and
2 s of a loader over 1e5 samples (issue 27: the data order is computed on demand, O(1) memory per
rank, per source in a mix). tests/test_order.py checks one fresh source; this checks the path a
restart of a real mixed run takes: two sources (sparse shards: 1e9 samples take no disk),
resumed at stream position 6e8 from a saved state, where the small source is in its 1,500th
epoch. Measured side by side in one forked process whose private memory is capped, so an
O(samples) array anywhere on that path (an epoch permutation, a per-sample blend table: 4-8 GB
here) fails at once instead of filling the machine."""

from loader_scale import cap_private_memory, make_sparse_data_dir, peak_rss_growth
from multirank import run_ranks
from podtrain.data.loader import ShardedLoader
from podtrain.data.mixture import parse_mix
from podtrain.data.sources import DataSources

SEQ, GLOBAL, MICRO, SEED = 16, 8, 2, 5
BIG, SMALL, DEEP = 10**9, 10**5, 6 * 10**8


def _first_batch(make):
    """(seconds, resident-memory peak growth, first batch's ids, ledger after it) of a loader."""
    out = {}

    def start():
        ld = make()
        out["ids"] = ld.next().sample_ids
        out["ledger"] = ld.state_dict()["ledger"]
        ld.close()

    seconds, grew = peak_rss_growth(start)
    return seconds, grew, out["ids"], out["ledger"]


def _plain(small):
    return ShardedLoader(small, SEQ, GLOBAL, MICRO, 0, 1, seed=SEED, prefetch=1)


def _mixed_resumed(big, small):
    """web (1e9 samples) 3 : books (1e5) 1, continued from a saved state at stream position DEEP."""
    mix = [{"path": big, "weight": 3, "name": "web"}, {"path": small, "weight": 1, "name": "books"}]
    ld = ShardedLoader(None, SEQ, GLOBAL, MICRO, 0, 1, seed=SEED, prefetch=1,
                       sources=DataSources(parse_mix(mix, ""), SEQ))
    state = ld.state_dict()
    state["consumed"] = DEEP
    ld.load_state_dict(state)
    return ld


def _side_by_side(rank, world, big, small):
    cap_private_memory(1 << 30)
    _first_batch(lambda: _plain(small))  # imports and the first thread: paid by whichever starts first
    return _first_batch(lambda: _plain(small)), _first_batch(lambda: _mixed_resumed(big, small))


def test_a_mix_with_a_billion_sample_source_resumed_deep_starts_like_a_small_loader(tmp_path):
    small = str(make_sparse_data_dir(tmp_path / "books", SMALL, SEQ))
    big = str(make_sparse_data_dir(tmp_path / "web", BIG, SEQ))  # 32 GB of shards, none on disk
    (small_s, small_rss, _, _), (big_s, big_rss, ids, ledger) = run_ranks(_side_by_side, 1, big, small)[0]
    assert big_s - small_s < 2.0, (small_s, big_s)
    assert big_rss - small_rss < 32 << 20, (small_rss, big_rss)
    # The batch continues the blend at DEEP: 3 of every 4 positions from web, 1 from books.
    web, books = ids[ids < BIG], ids[ids >= BIG] - BIG
    assert (len(web), len(books)) == (6, 2) and len(set(ids.tolist())) == GLOBAL
    assert books.max() < SMALL and web.max() > 10**7  # drawn from all of web, not its start
    end = DEEP + GLOBAL
    assert ledger == {"web": {"samples": end * 3 // 4, "tokens": end * 3 // 4 * SEQ},
                      "books": {"samples": end // 4, "tokens": end // 4 * SEQ}}
