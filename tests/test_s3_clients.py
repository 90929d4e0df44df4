"""S3 clients belong to a scope, not to the module: the stores of one ``shared_s3_clients()`` block
(a CLI command, a ``train()``) share one CRT client per endpoint, the S3 block cache's fetch
threads included, and the block's end releases them; outside any block a store owns its own."""

from __future__ import annotations

import numpy as np

from podtrain.data.cache import BlockCache, CacheSpec
from podtrain.storage import S3Clients, open_store, shared_s3_clients


def _client_of(store):
    store.list()  # a real request: the client is made and used
    return store.client


def test_stores_of_one_scope_share_one_client_and_the_scope_releases_it(s3_server, s3_bucket, tmp_path):
    s3_server.boto.put_object(Bucket=s3_bucket, Key="web/shard_0.bin", Body=bytes(range(256)) * 64)
    with shared_s3_clients() as clients:
        with shared_s3_clients() as inner:  # a nested block (train() inside the CLI) is the outer one's
            assert inner is clients
        first, second = (_client_of(open_store(f"s3://{s3_bucket}/{p}")) for p in ("web", "ckpt"))
        assert first is second and clients._clients == {next(iter(clients._clients)): first}
        # The cache's fetch threads do not see the block: the cache took its clients when made.
        cache = BlockCache(CacheSpec(str(tmp_path / "cache"), 1 << 20))
        key = (f"s3://{s3_bucket}/web", "shard_0.bin", 0)
        got = cache.blocks({key: ("a" * 64, cache.block)})[key]
        assert np.array_equal(got, np.frombuffer(bytes(range(256)) * 64, np.uint8)[:cache.block])
        assert cache._stores[key[0]].client is first
        cache.close()
    assert clients._clients == {}  # the scope's end dropped them
    # Outside any scope each store owns its clients; given clients, stores share those.
    alone = [_client_of(open_store(f"s3://{s3_bucket}/web")) for _ in range(2)]
    assert alone[0] is not alone[1]
    pool = S3Clients()
    assert _client_of(open_store(f"s3://{s3_bucket}/a", clients=pool)) is _client_of(
        open_store(f"s3://{s3_bucket}/b", clients=pool))
