"""Training data read as one token stream per split, from local disk or from S3 (issue 21 point 5).

The S3 tests talk to a real S3 server (moto on localhost) through podtrain.storage; the data is
uploaded with boto3 so the pytest process never makes a CRT client, and the loader's client is
made inside the forked ranks (as in a real run)."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from multirank import run_ranks
from podtrain.data.loader import ShardedLoader
from podtrain.data.samples import ShuffledOrder
from podtrain.errors import UserError
from synthetic_data import make_data_dir

SEQ, GLOBAL, MICRO = 16, 8, 2


def _batches(data, steps, world=1, rank=0, sources=None):
    ld = ShardedLoader(data, SEQ, GLOBAL, MICRO, rank, world, seed=3, prefetch=2, sources=sources)
    out = []
    for _ in range(steps):
        batch = ld.next()
        out.append((batch.sample_ids.copy(), torch.cat(batch.micro_batches).numpy().copy()))
    ld.close()
    return out, ld


def test_a_split_is_one_stream_whatever_the_shard_cuts(tmp_path):
    """A prepare --num-parts + merge dataset holds the one-shot token stream cut elsewhere (shard
    files in parts/ folders): the loader gives the same batches, windows crossing shard edges."""
    one = make_data_dir(tmp_path / "one", shard_tokens=(3277,))
    merged = make_data_dir(tmp_path / "merged", shard_tokens=(1000, 777, 1500))
    (merged / "parts").mkdir()  # the merged layout: shard files under parts/IIIII-of-NNNNN/
    import json

    manifest = json.loads((merged / "manifest.json").read_text())
    for i, shard in enumerate(manifest["splits"]["train"]["shards"]):
        folder = merged / "parts" / f"{i:05d}-of-00003"
        folder.mkdir()
        os.replace(merged / shard["file"], folder / "train_00000.bin")
        shard["file"] = f"parts/{i:05d}-of-00003/train_00000.bin"
    manifest["parts"] = 3
    (merged / "manifest.json").write_text(json.dumps(manifest))
    steps = 3277 // SEQ // GLOBAL + 2  # past one epoch
    a, ld = _batches(one, steps)
    b, _ = _batches(merged, steps)
    assert ld.samples_per_epoch == (3277 - 1) // SEQ
    for (ids_a, rows_a), (ids_b, rows_b) in zip(a, b):
        assert np.array_equal(ids_a, ids_b) and np.array_equal(rows_a, rows_b)
        # sample i is tokens [i*SEQ, i*SEQ + SEQ + 1) of the stream (token p is p % 256 here)
        assert np.array_equal(rows_a, (ids_a[:, None] * SEQ + np.arange(SEQ + 1)) % 256)
    crossing = [i for ids, _ in a for i in ids if (i * SEQ) // 1000 != (i * SEQ + SEQ) // 1000]
    assert crossing, "no window crossed a shard edge"
    # a checkpoint from the per-shard windowing: refused in one line where the samples changed ...
    per_shard = (1000 - 1) // SEQ + (777 - 1) // SEQ + (1500 - 1) // SEQ  # that podtrain's count
    old = {"consumed": 16, "samples_per_epoch": per_shard, "seed": 3}
    with pytest.raises(UserError, match="cut samples from each shard of .*merged.*one token stream"):
        ShardedLoader(merged, SEQ, GLOBAL, MICRO, 0, 1, seed=3).load_state_dict(old)
    old["samples_per_epoch"] = ld.samples_per_epoch  # one shard: (3277 - 1) // SEQ either way
    # ... and resumed unchanged where the split is one shard (the windows are the same), in the
    # order such a checkpoint was made with
    resumed = ShardedLoader(one, SEQ, GLOBAL, MICRO, 0, 1, seed=3)
    resumed.load_state_dict(old)
    assert np.array_equal(resumed.next().sample_ids, ShuffledOrder(ld.samples_per_epoch, 3).ids(16, GLOBAL))
    resumed.close()
    assert ld.state_dict()["windows"] == "stream"


def _upload(s3_server, bucket: str, local: Path, prefix: str) -> str:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3_server.boto.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")
    return f"s3://{bucket}/{prefix}"


def _s3_rank(rank, world, local, url, cache_dir, cap_bytes, steps):
    from podtrain.data.cache import CacheSpec
    from podtrain.data.mixture import parse_mix
    from podtrain.data.sources import DataSources

    sources = DataSources(parse_mix([], url), SEQ)
    spec = CacheSpec(str(cache_dir), cap_bytes, rank, world)
    sources.use_cache(spec)
    remote, _ = _batches(None, steps, world, rank, sources)
    here, _ = _batches(local, steps, world, rank)
    same = all(np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0]) for a, b in zip(remote, here))
    cache = sources.cache  # closed with the loader: its read-ahead was cancelled or finished
    cache.wait_fetches()
    on_disk = sum(f.stat().st_size for f in cache.dir.iterdir())
    return same, cache.used_bytes, on_disk, cache.block, len(list(cache.dir.iterdir()))


@pytest.mark.slow
def test_s3_batches_equal_local_and_the_cache_stays_within_its_budget(tmp_path, s3_server, s3_bucket):
    local = make_data_dir(tmp_path / "d", shard_tokens=(9000, 7001))
    url = _upload(s3_server, s3_bucket, local, "web")
    cap = 20_000  # 2 ranks x 10 kB: 4 KiB blocks, 2 kept per rank, of 32 kB of shards: evictions
    with pytest.raises(AssertionError, match=f"UserError: s3://{s3_bucket}/nothing/manifest.json is missing: "):
        run_ranks(_s3_rank, 1, local, f"s3://{s3_bucket}/nothing", tmp_path / "cache", cap, 1, timeout=60)
    results = run_ranks(_s3_rank, 2, local, url, tmp_path / "cache", cap, 12, timeout=120)
    for same, used, on_disk, block, files in results:
        assert same, "the batches read from S3 differ from the local ones"
        assert block == 4096 and 0 < used == on_disk <= cap // 2 and files >= 2


def _train(rank, world, overrides):
    from podtrain.config import load_config
    from podtrain.train.loop import train

    return train(load_config("configs/demo.yaml", overrides)).step


def _losses(run_dir):
    import json

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r.get("kind") == "train"}


@pytest.mark.slow
def test_training_from_s3_mix_runs_and_resumes_with_the_local_losses(tmp_path, repo, s3_server, s3_bucket):
    from podtrain.model import preset_config

    preset_config("tiny", 320)  # import transformers' model code once, before the ranks fork
    web = make_data_dir(tmp_path / "web", shard_tokens=(2000, 1500), val_tokens=300)
    code = make_data_dir(tmp_path / "code", shard_tokens=(1500,), val_tokens=300)
    urls = [_upload(s3_server, s3_bucket, d, d.name) for d in (web, code)]

    def mix(paths):
        return f"data.mix=[{{path: {paths[0]}, weight: 3}}, {{path: {paths[1]}, weight: 1}}]"

    common = ["data.seq_len=32", "train.micro_batch_size=4", "train.global_batch_size=8", "train.steps=4",
              "log.every=1", "eval.every=0", "ckpt.every=2", "ckpt.keep_last=0", "monitor.watchdog=false",
              "log.progress=off", "log.trackers=none", "optim.warmup_steps=1", "data.verify=false",
              f"data.cache_dir={tmp_path / 'cache'}"]
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        assert run_ranks(_train, 1, common + [mix([web, code]), f"run.dir={tmp_path / 'local'}"]) == [4]
        step2 = tmp_path / "local" / "ckpt" / "step_000002"
        assert run_ranks(_train, 1, common + [mix(urls), f"run.dir={tmp_path / 's3'}",
                                              f"ckpt.resume={step2}", "ckpt.allow_changes=[data.mix]"]) == [4]
    finally:
        os.chdir(cwd)
    # a run from S3 (here resumed mid-stream, the harder case; the moved paths are allowed) continues
    # the local run's losses
    # exactly: same data, same positions (the loader test above compares the batches bit for bit)
    local, s3 = _losses(tmp_path / "local"), _losses(tmp_path / "s3")
    assert sorted(local) == [1, 2, 3, 4] and sorted(s3) == [3, 4]
    assert s3 == pytest.approx({k: local[k] for k in (3, 4)}, rel=1e-5)


def _zeroed_block_rank(rank, world, url, shard, sha, cache_dir):
    import logging

    from podtrain.data.cache import BlockCache, CacheSpec

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("podtrain").addHandler(handler)
    spec = CacheSpec(str(cache_dir), 1 << 20)  # 16 KiB blocks
    first = BlockCache(spec)
    key = (url, shard, 1)
    wanted = {key: (sha, first.block)}
    fetched = bytes(first.blocks(wanted)[key])
    [cached] = [f for f in first.dir.iterdir() if not f.name.startswith(".")]
    cached.write_bytes(bytes(cached.stat().st_size))  # a node crash: the right size, all zeros
    later = BlockCache(spec)  # the next process on this node
    again = bytes(later.blocks(wanted)[key])
    third = bytes(BlockCache(spec).blocks(wanted)[key])  # the block fetched again was cached whole
    return fetched, again, third, warnings


def test_a_zero_filled_cached_block_is_discarded_and_fetched_again(tmp_path, s3_server, s3_bucket):
    """A cached block carries its CRC: a file of the right size full of zeros (what a node crash
    leaves when the rename reached the disk and the data did not) is never trained on."""
    import hashlib

    local = make_data_dir(tmp_path / "d", shard_tokens=(20000,))
    url = _upload(s3_server, s3_bucket, local, "web")
    shard = next(p for p in local.iterdir() if p.name.startswith("train_"))
    data = shard.read_bytes()
    [(fetched, again, third, warnings)] = run_ranks(
        _zeroed_block_rank, 1, url, shard.name, hashlib.sha256(data).hexdigest(), tmp_path / "cache", timeout=60)
    assert fetched == again == third == data[16384:32768]
    assert len(warnings) == 1 and "discarded and fetched again" in warnings[0] and "checksum" in warnings[0]
