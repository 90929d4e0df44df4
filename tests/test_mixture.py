"""data.mix: the greedy blend's guarantees as pure functions, the ledger and its resume rules,
and the loader over several sources (in one process: the loader needs no process group)."""

import random

import numpy as np
import pytest

from podtrain.data.loader import ShardedLoader
from podtrain.data.mixture import (Blend, MixOrder, SourceSpec, integer_weights, ledger_line, parse_mix,
                                   restore_blend)
from podtrain.data.samples import KeyedOrder, permute, shuffled_permutation
from podtrain.data.sources import DataSources
from podtrain.errors import UserError
from synthetic_data import make_data_dir


def prefix_counts(blend: Blend, n: int) -> np.ndarray:
    source, _ = blend.assign(blend.start, n)
    onehot = np.zeros((n, len(blend.weights)), dtype=np.int64)
    onehot[np.arange(n), source] = 1
    return np.cumsum(onehot, axis=0)  # row p: counts in positions [0, p]


def test_every_prefix_is_within_one_sample_per_source_of_the_weights():
    rng = random.Random(7)
    cases = [[3, 1], [0.7, 0.2, 0.1], [1, 1, 1, 1, 1, 1, 1, 10]]
    cases += [[round(rng.uniform(0.05, 5), rng.randint(0, 2)) or 1 for _ in range(rng.randint(2, 6))]
              for _ in range(40)]
    for weights in cases:
        blend = Blend(weights)
        n = 3 * len(blend.period) + 5
        share = np.asarray(weights, dtype=float) / sum(weights)
        deviation = np.abs(prefix_counts(blend, n) - np.arange(1, n + 1)[:, None] * share)
        assert deviation.max() < 1.0, (weights, deviation.max())
    assert Blend([3, 1]).period.tolist() == [0, 0, 1, 0]


def test_integer_weights_are_exact_as_typed_and_bounded():
    assert integer_weights([3, 1]) == [3, 1]
    assert integer_weights([0.7, 0.2, 0.1]) == [7, 2, 1]
    assert integer_weights([6.0, 2.0]) == [3, 1]
    rounded = integer_weights([0.123457, 0.654321, 1e-9])
    assert sum(rounded) <= 1 << 16 and rounded[2] == 1  # a tiny source still appears


def test_each_source_keeps_its_own_exactly_once_order_and_chunks_do_not_matter():
    sizes, seed = [7, 5], 3
    order = MixOrder([KeyedOrder(n, seed) for n in sizes], Blend([3, 1]), seed)
    stream = order.ids(0, 120)
    chunked = np.concatenate([order.ids(s, c) for s, c in ((0, 13), (13, 50), (63, 57))])
    assert stream.tolist() == chunked.tolist()  # any world size cuts the same stream
    heavy, light = stream[stream < 7], stream[stream >= 7] - 7
    assert len(heavy) == 90 and len(light) == 30
    for e in range(90 // 7):  # the up-weighted source repeats whole epochs, each exactly once
        assert heavy[7 * e:7 * e + 7].tolist() == permute(np.arange(7, dtype=np.uint64), 7, seed, e).tolist()
    for e in range(30 // 5):  # the down-weighted one goes on where it stopped
        assert light[5 * e:5 * e + 5].tolist() == permute(np.arange(5, dtype=np.uint64), 5, seed, e).tolist()


def test_one_source_is_the_single_dataset_order():
    order = MixOrder([KeyedOrder(11, 5)], Blend([1.0]), 5)
    assert order.ids(3, 30).tolist() == KeyedOrder(11, 5).ids(3, 30).tolist()


def test_resume_continues_the_segment_and_a_changed_mix_continues_from_the_ledger():
    names, blend = ["web", "code"], Blend([3, 1])
    saved = {"weights": {"web": 3.0, "code": 1.0}, "start": 0, "base": {"web": 0, "code": 0}}
    ledger = {"web": {"samples": 30}, "code": {"samples": 10}, "old": {"samples": 4}}
    same, retired = restore_blend(names, [3, 1], saved, ledger, 40)
    assert same.counts(100).tolist() == blend.counts(100).tolist() and retired == {"old": 4}
    # curriculum: 1:1 from position 40, starting from each source's ledger count
    new, _ = restore_blend(names, [1, 1], saved, ledger, 40)
    assert new.counts(40).tolist() == [30, 10]
    assert new.counts(60).tolist() == [40, 20]
    third, _ = restore_blend(names + ["math"], [1, 1, 2], saved, ledger, 40)
    assert third.counts(44).tolist() == [31, 11, 2]


def test_mix_config_mistakes_are_one_line():
    assert parse_mix([], "data/web/") == [SourceSpec("web", "data/web/", 1.0)]
    bad = [([{"path": "a", "weight": 0}], "'weight' must be a positive number"),
           ([{"path": "a", "wieght": 1}], "unknown key(s) 'wieght'"),
           (["a"], "expected a mapping"),
           ([{"path": "x/web", "weight": 1}, {"path": "y/web", "weight": 2}],
            "sources x/web and y/web are both named 'web'")]
    for mix, message in bad:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_mix(mix, "data/builtin")


def test_sources_with_different_tokenizers_are_refused_naming_both(tmp_path):
    a, b = make_data_dir(tmp_path / "a"), make_data_dir(tmp_path / "b", vocab=300)
    with pytest.raises(UserError, match=f"{a} was prepared with tokenizer byte:257 but {b} "
                                        "with byte:300"):
        DataSources(parse_mix([{"path": str(a), "weight": 1}, {"path": str(b), "weight": 1}], ""), 16)


def _mix_loader(paths, weights, rank, world, state=None):
    specs = parse_mix([{"path": str(p), "weight": w} for p, w in zip(paths, weights)], "")
    ld = ShardedLoader(None, 16, 8, 2, rank, world, seed=5, sources=DataSources(specs, 16))
    if state:
        ld.load_state_dict(state)
    return ld


def test_loader_ledger_and_resume_at_another_world_size(tmp_path):
    a = make_data_dir(tmp_path / "a", shard_tokens=(800,))
    b = make_data_dir(tmp_path / "b", shard_tokens=(300,))
    one = _mix_loader([a, b], [3, 1], 0, 1)
    full = [one.next().sample_ids for _ in range(10)]
    assert one.ledger() == {"a": {"samples": 60, "tokens": 960}, "b": {"samples": 20, "tokens": 320}}
    assert ledger_line(one.ledger()) == "tokens by source: a 960 (75.0%), b 320 (25.0%)"
    state = one.state_dict()
    one.close()
    # four steps on one rank, then two ranks continue from its state
    first = _mix_loader([a, b], [3, 1], 0, 1)
    head = [first.next().sample_ids for _ in range(4)]
    saved = first.state_dict()
    first.close()
    pair = [_mix_loader([a, b], [3, 1], r, 2, saved) for r in range(2)]
    tail = [np.concatenate([ld.next().sample_ids for ld in pair]) for _ in range(6)]
    assert np.concatenate(head + tail).tolist() == np.concatenate(full).tolist()
    assert pair[0].state_dict()["ledger"] == state["ledger"]
    for ld in pair:
        ld.close()


def test_an_old_order_mix_checkpoint_continues_each_source_in_its_shuffled_order(tmp_path):
    a = make_data_dir(tmp_path / "a", shard_tokens=(800,))
    b = make_data_dir(tmp_path / "b", shard_tokens=(300,))
    sizes = [49, 18]  # (tokens - 1) // 16
    state = _mix_loader([a, b], [3, 1], 0, 1).state_dict()
    state.pop("order")  # as podtrain wrote it before the order was named
    state.update(consumed=40, ledger={"a": {"samples": 30}, "b": {"samples": 10}})
    for weights in ([3, 1], [1, 1]):  # the same segment, and a curriculum from the ledger
        ld = _mix_loader([a, b], weights, 0, 1, dict(state, mix=dict(state["mix"], weights={"a": 3.0, "b": 1.0})))
        ids = np.concatenate([ld.next().sample_ids for _ in range(8)])
        ld.close()
        assert ld.state_dict()["order"] == "pcg64-shuffle"
        taken = ld.order.blend.counts(ld.consumed) - np.asarray([30, 10])
        for i, (n, k) in enumerate(zip(sizes, taken)):
            mine = ids[(ids >= sum(sizes[:i])) & (ids < sum(sizes[:i + 1]))] - sum(sizes[:i])
            stream = np.concatenate([shuffled_permutation(n, 5, e) for e in range(3)])
            start = 30 if i == 0 else 10
            assert mine.tolist() == stream[start:start + k].tolist(), (weights, i)
            assert mine.tolist() != KeyedOrder(n, 5).ids(start, int(k)).tolist()


def test_a_changed_mix_on_resume_is_refused_unless_allowed(caplog):
    from podtrain.config import load_config, to_dict
    from podtrain.train.resume import check_resume

    before = load_config(None, ["data.mix=[{path: d/web, weight: 3}, {path: d/code, weight: 1}]"])
    saved = {"config": to_dict(before)}
    now = ["data.mix=[{path: d/web, weight: 1}, {path: d/code, weight: 1}]"]
    with pytest.raises(UserError, match=r"data.mix was .* ckpt.allow_changes=\[data.mix\]"):
        check_resume(saved, load_config(None, now), None, 3, "ckpt/step_000003")
    caplog.set_level("WARNING", logger="podtrain")
    check_resume(saved, load_config(None, now + ["ckpt.allow_changes=[data.mix]"]), None, 3, "ckpt/step_000003")
    assert [r.message for r in caplog.records if "data.mix" in r.message][0].startswith(
        "resuming with data.mix changed from")
