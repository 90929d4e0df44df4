"""Count the S3 requests of a job's data start-up, per rank and by verb, over real HTTP.

Each forked rank (``multirank.run_ranks``: gloo, real processes) talks to S3 through its own
counting proxy (``s3_fault_proxy.S3FaultProxy``, no faults) in front of a real S3 server (moto),
so the count is what that rank's CRT client sent, split by verb. The start-up is the trainer's
data path, in its order: ``shared_manifests`` (rank 0 reads, every rank receives),
``DataSources.from_config`` with them, the validation splits, ``data.verify``'s share of this rank
and the loader's first batch. Used by tests/test_s3_scale.py and the scale bench::

    from s3_requests import startup_requests, upload_dir
    url = upload_dir(server, bucket, make_data_dir(tmp / "web"), "web")
    per_rank = startup_requests(server.endpoint, url, world=4)
    per_rank[0]  # {"LIST": 1, "GET": 5, ...}
"""

from __future__ import annotations

import collections
import os
import tempfile
from pathlib import Path
from typing import Any

VERBS = ("LIST", "HEAD", "GET", "PUT", "POST", "DELETE")
"""``request_verbs``' keys: a ListObjectsV2 is a GET with ``list-type=2``, counted as LIST."""


def verb(method: str, path: str) -> str:
    """The S3 operation of an HTTP request: LIST for a ListObjectsV2, else the HTTP method."""
    query = path.split("?", 1)[1] if "?" in path else ""
    return "LIST" if method == "GET" and "list-type=2" in query.split("&") else method


def request_verbs(history: list[tuple[str, str, bool]]) -> dict[str, int]:
    """``{verb: count}`` (every one of ``VERBS``, zeros included) of a proxy's ``history()``."""
    counts = collections.Counter(verb(method, path) for method, path, _ in history)
    return {v: counts.get(v, 0) for v in (*VERBS, *sorted(set(counts) - set(VERBS)))}


def upload_dir(server, bucket: str, local: Path, prefix: str) -> str:
    """Upload a local data directory under ``s3://bucket/prefix`` with the server's boto3 client
    (so the caller's process makes no CRT client) and return that url."""
    for path in sorted(Path(local).rglob("*")):
        if path.is_file():
            server.boto.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")
    return f"s3://{bucket}/{prefix}"


def _start_rank(rank: int, world: int, endpoints: list[str], data: dict[str, Any], global_batch: int,
                cache_dir: str) -> dict[str, Any]:
    """One rank's data start-up, as ``Trainer.setup`` runs it; returns what the rank saw."""
    os.environ["AWS_ENDPOINT_URL"] = endpoints[rank]  # this rank's own counting proxy
    from multirank import gloo_context
    from podtrain.config_sections import DataSection
    from podtrain.data.loader import ShardedLoader
    from podtrain.data.sources import DataSources, shared_manifests

    ctx = gloo_context()
    section = DataSection(**{"cache_dir": cache_dir, "cache_gb": 0.01, **data})
    manifests = shared_manifests(section, ctx)
    sources = ctx.agree_on(lambda: DataSources.from_config(section, manifests=manifests))
    sources.val_indexes()
    if section.verify:
        ctx.agree_on(lambda: sources.verify(part=(ctx.rank, ctx.world_size)))
    loader = ShardedLoader(None, section.seq_len, global_batch, global_batch // world, ctx.rank, world, seed=1,
                           sources=sources)
    batch = loader.build(0)  # the first batch, without the producer's read-ahead of the next ones
    return {"samples": loader.samples_per_epoch, "ids": batch.sample_ids.tolist()}


def startup_requests(upstream: str, data: str | dict[str, Any], world: int, global_batch: int = 8,
                     timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run a job's data start-up on ``world`` forked ranks against the S3 server at ``upstream``
    (``http://host:port``; its credentials in this process's environment, as ``s3_server``'s
    fixture sets them) and return, per rank, ``{"requests": {verb: count}, "samples", "ids"}``:
    the S3 requests that rank sent by verb (``request_verbs``), the samples per epoch it found and
    the sample ids of its first batch.

    ``data``: an ``s3://`` data directory, or ``DataSection`` fields (``{"mix": [...]}``,
    ``{"path": ..., "verify": False}``); ``seq_len`` defaults to 16. ``global_batch`` must divide
    by ``world``. The caller's process should hold no CRT client of its own (the ranks fork)."""
    from multirank import run_ranks
    from s3_fault_proxy import S3FaultProxy

    # imported once here, not in every forked rank (a client is made only in the ranks)
    import podtrain.data.loader  # noqa: F401
    import podtrain.data.sources  # noqa: F401
    import s3torchconnector._s3client  # noqa: F401

    fields = {"path": data} if isinstance(data, str) else dict(data)
    fields.setdefault("seq_len", 16)
    proxies = [S3FaultProxy(upstream, lifetime_s=timeout + 60) for _ in range(world)]
    try:
        with tempfile.TemporaryDirectory(prefix="podtrain-s3-start-") as cache_dir:
            seen = run_ranks(_start_rank, world, [p.endpoint for p in proxies], fields, global_batch, cache_dir,
                             timeout=timeout)
        return [{"requests": request_verbs(p.history()), **rank_seen} for p, rank_seen in zip(proxies, seen)]
    finally:
        for proxy in proxies:
            proxy.stop()
