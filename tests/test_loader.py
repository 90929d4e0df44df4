"""The sharded loader: exactly once per epoch, exact resume across world sizes, fresh order per epoch."""

import numpy as np
import pytest
import torch

from multirank import run_ranks
from podtrain.data.loader import ShardedLoader
from podtrain.data.samples import KeyedOrder, shuffled_permutation, validation_ids
from podtrain.data.manifest import read_manifest
from podtrain.errors import UserError
from synthetic_data import make_data_dir

SEQ, GLOBAL, MICRO = 16, 24, 2


def loader(data, rank, world, workers=0, state=None):
    ld = ShardedLoader(data, SEQ, GLOBAL, MICRO, rank, world, seed=5, num_workers=workers, prefetch=2)
    if state:
        ld.load_state_dict(state)
    return ld


def rank_epoch_ids(rank, world, data, workers, steps):
    ld = loader(data, rank, world, workers)
    ids, rows_ok = [], True
    for _ in range(steps):
        batch = ld.next()
        ids.append(batch.sample_ids)
        rows = torch.cat(batch.micro_batches)
        assert rows.shape == (GLOBAL // world, SEQ + 1)
        # window content must match its id: consecutive tokens of the recognisable stream
        rows_ok &= bool(((rows[:, 1:] - rows[:, :-1]) % 256 == 1).all())
    ld.close()
    return np.concatenate(ids), rows_ok, ld.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_exactly_once_per_epoch(tmp_path, world, workers):
    data = make_data_dir(tmp_path / "d")
    n = ShardedLoader(data, SEQ, GLOBAL, MICRO, 0, 1, seed=5).samples_per_epoch
    steps = -(-n // GLOBAL)  # enough steps to cover one epoch (the last straddles into epoch 1)
    results = run_ranks(rank_epoch_ids, world, data, workers, steps)
    per_step = [np.split(r[0], steps) for r in results]
    # interleave ranks per step: the global consumption order
    stream = np.concatenate([np.concatenate([per_step[r][s] for r in range(world)]) for s in range(steps)])
    first_epoch = stream[:n]
    assert sorted(first_epoch.tolist()) == list(range(n))
    assert all(r[1] for r in results)
    assert results[0][2]["consumed"] == steps * GLOBAL and results[0][2]["epoch"] == 1
    # the tail of the last step is the start of epoch 1's order: nothing dropped, nothing padded
    assert stream[n:].tolist() == KeyedOrder(n, 5).ids(n, steps * GLOBAL - n).tolist()


def run_segment(rank, world, data, state, steps):
    ld = loader(data, rank, world, state=state)
    ids = [ld.next().sample_ids for _ in range(steps)]
    ld.close()
    return ids, ld.state_dict()


def global_sequence(results):
    steps = len(results[0][0])
    return [i for s in range(steps) for r in results for i in r[0][s].tolist()]


@pytest.mark.slow
def test_resume_with_other_world_sizes_continues_exactly(tmp_path):
    data = make_data_dir(tmp_path / "d")
    full = global_sequence(run_ranks(run_segment, 4, data, None, 30))
    a = run_ranks(run_segment, 4, data, None, 7)
    b = run_ranks(run_segment, 2, data, a[0][1], 11)
    c = run_ranks(run_segment, 3, data, b[0][1], 12)
    assert global_sequence(a) + global_sequence(b) + global_sequence(c) == full
    assert c[0][1]["consumed"] == 30 * GLOBAL


def test_validation_split_disjoint_without_padding():
    parts = [validation_ids(10, r, 3, None) for r in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))
    assert [len(p) for p in parts] == [4, 3, 3]


def test_resume_on_different_data_is_refused(tmp_path):
    data = make_data_dir(tmp_path / "d")
    ld = loader(data, 0, 1)
    with pytest.raises(UserError, match="samples per epoch"):
        ld.load_state_dict({"consumed": 5, "samples_per_epoch": 3})


def test_truncated_shard_is_named(tmp_path):
    data = make_data_dir(tmp_path / "d")
    with open(data / "train_00001.bin", "r+b") as fh:
        fh.truncate(100)
    ld = loader(data, 0, 1)  # a shard is checked when a window first reaches it (data.verify: at start)
    with pytest.raises(UserError, match="train_00001.bin holds 50 tokens, the manifest says 777"):
        ld.index.gather(np.arange(ld.samples_per_epoch))


def test_token_ids_beyond_the_model_vocabulary_are_named(tmp_path):
    from podtrain.data.manifest import check_vocab

    manifest = read_manifest(make_data_dir(tmp_path / "d", vocab=300))
    with pytest.raises(UserError, match="prepare the data with the model's tokenizer"):
        check_vocab(manifest, 257)
    check_vocab(manifest, 320)


def test_resume_with_another_seed_is_refused(tmp_path):
    data = make_data_dir(tmp_path / "d")
    state = loader(data, 0, 1).state_dict()
    other = ShardedLoader(data, SEQ, GLOBAL, MICRO, 0, 1, seed=6)
    with pytest.raises(UserError, match="run.seed is 6 but the checkpoint's data order was made with seed 5"):
        other.load_state_dict(state)


def test_a_producer_stuck_in_a_slow_read_ends_once_the_read_returns(tmp_path):
    """A slow read injected into the producer (issue 19.7): close() cannot join it, a new stream
    starts, and the stuck producer must still end when its read returns instead of running on
    into the orphaned queue (one stop Event shared by the streams kept it going)."""
    import threading

    ld = loader(make_data_dir(tmp_path / "d"), 0, 1)
    ld.join_timeout_s = 0.05
    gate, stuck, real_gather, calls = threading.Event(), threading.Event(), ld.index.gather, []

    def slow_gather(ids):
        calls.append(threading.current_thread())
        if calls[0] is threading.current_thread() and len(calls) == 3:  # the first producer, 3rd batch
            stuck.set()
            gate.wait(20)
        return real_gather(ids)

    ld.index.gather = slow_gather
    first = ld.next()
    producer = ld._thread
    assert stuck.wait(10)
    ld.close()  # gives up joining after join_timeout_s: the producer is in its read
    assert producer.is_alive()
    second = ld.next()  # a new stream with its own producer
    assert second.consumed == first.consumed + GLOBAL
    gate.set()
    producer.join(timeout=5)
    alive = producer.is_alive()
    ld.close()
    assert not alive, "the first stream's producer kept running after close()"


def test_token_ids_beyond_the_vocabulary_are_one_line_at_start_and_when_read(tmp_path):
    """Issue 19.17: the manifest's max_token_id is checked at start; a shard changed after
    prepare (data.verify=false skips its checksum) is named when a batch reads it, not an
    embedding IndexError on every rank."""
    import json

    from podtrain.data.mixture import parse_mix
    from podtrain.data.sources import DataSources

    data = make_data_dir(tmp_path / "d")
    raw = json.loads((data / "manifest.json").read_text())
    raw["splits"]["train"]["shards"][1]["max_token_id"] = 300  # ids past the tokenizer's vocab_size
    (data / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="train_00001.bin holds token id 300, at or above the model's vocabulary size 280"):
        DataSources(parse_mix([], str(data)), SEQ).check_vocab(280)
    tokens = np.fromfile(data / "train_00000.bin", dtype=np.uint16)
    tokens[40] = 1000
    tokens.tofile(data / "train_00000.bin")
    sources = DataSources(parse_mix([], str(data)), SEQ)
    sources.check_vocab(320)
    sources.indexes[0].gather(np.arange(2))  # samples before the changed token read fine
    with pytest.raises(UserError, match="train_00000.bin holds token id 1000, at or above the model's "
                                        "vocabulary size 320; its manifest says at most 255"):
        sources.indexes[0].gather(np.arange(5))


def test_a_resume_past_the_end_of_another_datasets_epoch_is_refused(tmp_path):
    """ckpt.allow_changes=[data.path] to a smaller dataset: a saved position beyond its epoch is
    refused in one line (main continued with 'epoch 0' at a position past the end)."""
    big, small = make_data_dir(tmp_path / "big", shard_tokens=(4000,)), make_data_dir(tmp_path / "small")
    state = loader(big, 0, 1).state_dict()
    state["consumed"] = loader(small, 0, 1).samples_per_epoch + 1
    with pytest.raises(UserError, match=r"past the end of an epoch of .*small.*resume_from_reset=\[data\]"):
        loader(small, 0, 1).load_state_dict(state)
    state["consumed"] = 3  # within the new epoch: the run goes on from there
    ld = loader(small, 0, 1)
    ld.load_state_dict(state)
    assert ld.consumed == 3


def test_a_checkpoint_from_before_the_order_was_named_resumes_in_its_own_order(tmp_path):
    data = make_data_dir(tmp_path / "d")
    fresh = loader(data, 0, 1)
    n = fresh.samples_per_epoch
    assert fresh.state_dict()["order"] == "feistel-1"
    old = {k: v for k, v in fresh.state_dict().items() if k != "order"}  # as podtrain wrote it before
    old["consumed"] = n - 30  # the resumed steps straddle an epoch boundary
    shuffled = np.concatenate([shuffled_permutation(n, 5, 0), shuffled_permutation(n, 5, 1)])
    expected = shuffled[n - 30:n - 30 + 3 * GLOBAL].tolist()
    assert KeyedOrder(n, 5).ids(n - 30, 3 * GLOBAL).tolist() != expected  # the new order would re-order it
    for state in (old, {"consumed": n - 30, "samples_per_epoch": n, "seed": 5}):  # with and before data.mix
        ld = loader(data, 0, 1, state=state)
        assert [i for _ in range(2) for i in ld.next().sample_ids.tolist()] == expected[:2 * GLOBAL]
        ld.close()
        saved = ld.state_dict()
        assert saved["order"] == "pcg64-shuffle"  # and its next checkpoint says so
        again = loader(data, 0, 1, state=saved)
        again.load_state_dict({"consumed": saved["consumed"]})  # the guard's skip keeps the order
        assert again.next().sample_ids.tolist() == expected[2 * GLOBAL:]
        again.close()


def test_a_checkpoint_in_an_order_this_podtrain_does_not_know_is_refused_in_one_line(tmp_path):
    data = make_data_dir(tmp_path / "d")
    state = dict(loader(data, 0, 1).state_dict(), order="feistel-9")
    with pytest.raises(UserError) as err:
        loader(data, 0, 1, state=state)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("the checkpoint's data order 'feistel-9' is not one this podtrain knows "
                                     "(feistel-1, pcg64-shuffle)")
    assert str(err.value).endswith("finish the run with the podtrain that wrote it, or branch with "
                                   "ckpt.resume_from=CHECKPOINT ckpt.resume_from_reset=[data] in a new run.dir")
