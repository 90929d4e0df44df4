"""S3 at job scale (issue 27 point 3): a start whose requests do not grow with the world size, and
checkpoint saves without a request per step directory.

Requests are counted for real: each rank's CRT client talks to a real S3 server (moto) through a
counting proxy of its own (tests/s3_requests.py); the data is uploaded with boto3, so this process
makes no CRT client before the ranks fork."""

from __future__ import annotations

from multirank import gloo_context
from s3_requests import startup_requests, upload_dir
from synthetic_data import make_data_dir


def test_a_start_lists_each_s3_prefix_once_at_1_and_at_4_ranks(tmp_path, s3_server, s3_bucket):
    """A two-source mix with train and val splits and data.verify: rank 0 lists each prefix once
    and reads each manifest once, whatever the world size; the other ranks send no metadata
    request at all (their GETs are their share of the shards' checksums and their first batch)."""
    web = upload_dir(s3_server, s3_bucket, make_data_dir(tmp_path / "web", shard_tokens=(3000, 2000)), "web")
    code = upload_dir(s3_server, s3_bucket, make_data_dir(tmp_path / "code", shard_tokens=(2500,)), "code")
    data = {"mix": [{"path": web, "weight": 3}, {"path": code, "weight": 1}], "verify": True}
    one = startup_requests(s3_server.endpoint, data, 1)
    four = startup_requests(s3_server.endpoint, data, 4)
    lists = [sum(r["requests"]["LIST"] for r in run) for run in (one, four)]
    assert lists == [2, 2], f"LISTs at start, 1 rank and 4 ranks: {lists} (one per prefix expected)"
    assert [r["requests"]["HEAD"] for r in one + four] == [0] * 5
    # rank 0 reads what it read alone; the others' GETs are their part of the data, never more
    assert four[0]["requests"]["GET"] <= one[0]["requests"]["GET"]
    assert all(r["requests"]["GET"] <= one[0]["requests"]["GET"] for r in four)
    # and every rank got the same data: one epoch's samples, its slice of the first global batch
    assert {r["samples"] for r in one + four} == {one[0]["samples"]}
    assert sum((r["ids"] for r in four), []) == one[0]["ids"]


def _shared_or_error(rank, world, endpoint, url):
    import os

    from podtrain.config_sections import DataSection
    from podtrain.data.sources import shared_manifests
    from podtrain.errors import UserError

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        return shared_manifests(DataSection(path=url), gloo_context())
    except UserError as exc:
        return str(exc)


def test_a_missing_s3_manifest_is_one_line_on_every_rank(s3_server, s3_bucket):
    """Rank 0 alone reads S3 at start: its one-line error reaches every rank (none waits in the
    broadcast), naming the missing manifest."""
    from multirank import run_ranks

    missing = f"s3://{s3_bucket}/nothing"
    errors = run_ranks(_shared_or_error, 2, s3_server.endpoint, missing, timeout=60)
    assert errors[0] == f"{missing}/manifest.json is missing: {missing} is not a finished `podtrain prepare` output"
    assert errors[1].startswith("rank 0 on ") and errors[1].endswith(errors[0])
