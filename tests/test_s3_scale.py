"""S3 at job scale (issue 27 point 3): a start whose requests do not grow with the world size, and
checkpoint saves without a request per step directory.

Requests are counted for real: each rank's CRT client talks to a real S3 server (moto) through a
counting proxy of its own (tests/s3_requests.py); the data is uploaded with boto3, so this process
makes no CRT client before the ranks fork."""

from __future__ import annotations

import pytest

from multirank import gloo_context
from s3_fault_proxy import s3_proxy  # noqa: F401 (fixture)
from s3_requests import request_verbs, startup_requests, upload_dir
from synthetic_data import make_data_dir


@pytest.mark.slow
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


def _save_requests(ck, proxy, model, opt, step: int) -> dict[str, int]:
    """The S3 requests of one synchronous save (its retention included), by verb; asserts that
    none of them asked about a step directory one at a time (a HEAD under ``step_``)."""
    proxy.reset()
    ck.save(step, model, opt, None, {"step": step, "tokens_seen": step})
    ck.wait()
    history = proxy.history()
    assert not [path for method, path, _ in history if method == "HEAD" and "/step_" in path]
    return request_verbs(history)


@pytest.mark.slow
def test_saves_retention_and_resume_on_s3_send_no_request_per_step_directory(tmp_path, s3_proxy, s3_bucket):
    """Saves with every checkpoint kept: each save's requests do not grow with the step
    directories already there (main: a HEAD and a manifest read per directory, each save). Then a
    retention cycle (keep_last=2) and a resume over an unfinished save: no HEAD per step
    directory, the right checkpoints kept, the unfinished save removed."""
    import torch

    from podtrain.ckpt import layout
    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection

    ctx = gloo_context()  # one process, no process group
    model = torch.nn.Linear(8, 4)  # the requests do not depend on the model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    url = f"s3://{s3_bucket}/ckpt"
    ck = Checkpointer(tmp_path / "run", CkptSection(dir=url, keep_last=0, async_save=False), ctx)
    kept_all = [_save_requests(ck, s3_proxy, model, opt, step) for step in range(1, 5)]
    ck.close()
    assert kept_all[1:] == [kept_all[1]] * 3, f"requests per save grew with the step directories: {kept_all}"
    ck = Checkpointer(tmp_path / "run", CkptSection(dir=url, keep_last=2, async_save=False), ctx)
    pruned = [_save_requests(ck, s3_proxy, model, opt, step) for step in range(5, 8)]
    ck.close()
    assert pruned[2] == pruned[1] and pruned[1]["LIST"] <= kept_all[1]["LIST"] + 1  # + the deletion's
    assert [s for s, _ in layout.list_checkpoints(url)] == [6, 7]
    store = layout.open_store(url)
    store.write_bytes("step_000008/rank_00000.safetensors", b"a save killed before its manifest")
    s3_proxy.reset()
    ck = Checkpointer(tmp_path / "run", CkptSection(dir=url), ctx)
    assert ck.restore(model, opt, None).step == 7
    ck.close()
    asked = {path.split("/")[3] for method, path, _ in s3_proxy.history() if method == "HEAD" and "/step_" in path}
    assert asked <= {"step_000007"}, f"HEAD requests in step directories other than the one resumed: {asked}"
    assert [s for s, _ in layout.scan(store).steps] == [6, 7]  # the unfinished save is gone


def _reference_plan(steps, current, keep_last, keep_every):
    """retention_plan as it was before it asked about lineages lazily (every step this run's)."""
    abandon = [s for s in steps if s > current]
    mine = sorted(s for s in steps if s <= current)
    keep = set(mine[-keep_last:]) if keep_last > 0 else set(mine)
    if keep_every > 0:
        keep |= {s for s in mine if s % keep_every == 0}
    keep.add(current)
    return [s for s in mine if s not in keep], abandon


def test_retention_asks_whose_a_checkpoint_is_only_where_the_plan_depends_on_it():
    """The lazy plan equals filtering every step by lineage first (the old way, a manifest read
    per step directory per save), never asks about ``current`` or twice about one step, and asks
    about few: with 60 checkpoints kept by keep_every and keep_last=3, a save asks about the 2
    others of its window, not 62."""
    import random

    from podtrain.ckpt.layout import retention_plan

    rng = random.Random(0)
    for _ in range(2000):
        steps = sorted(rng.sample(range(1, 40), rng.randint(0, 12)))
        current = rng.choice(steps) if steps and rng.random() < 0.8 else rng.randint(1, 40)
        keep_last, keep_every = rng.randint(0, 4), rng.choice([0, 0, 2, 5])
        others = {s for s in steps if rng.random() < 0.3} - {current}
        asked = []

        def mine(step):
            asked.append(step)
            return step not in others

        got = retention_plan(steps, current, keep_last, keep_every, mine)
        assert got == _reference_plan([s for s in steps if s not in others], current, keep_last, keep_every)
        assert current not in asked and len(asked) == len(set(asked))
    asked = []
    steps = [10 * i for i in range(1, 61)] + [601, 602, 603]
    plan = retention_plan(steps, 603, 3, 10, lambda s: asked.append(s) or True)
    assert plan == ([], []) and sorted(asked) == [601, 602]
