"""A rank's failed upload is sent again (issue 34, defect 8): on S3 one part that fails all of the
client's attempts aborts its multipart upload, and without a re-send one such part among all the
ranks' parts abandons the whole save, a chance that grows with the world size.

Real parts only: two forked gloo ranks save through podtrain's Checkpointer and s3torchconnector's
CRT client to moto's S3 server, through tests/s3_fault_proxy.py. The proxy first refuses rank 1's
part uploads with 502 (which the CRT does not retry: the part fails at once, as one that spent its
attempts) until one has been refused, so a re-send is certain whatever the timing; then 20% of the
save's requests (seeded) with 503 SlowDown, S3's throttling answer, for the rest of it. (The CRT
retries a 503 on every request, its multipart abort included; an abort refused with a status it
does not retry, or past its attempts, leaves an incomplete upload: see podtrain.storage.s3.) Both staging regimes of ``SaveStream`` are covered:
the share fits the pool (the written slabs are kept and read again) and it does not (the step loop
stages the file again from the live tensors)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from multirank import gloo_context, run_ranks
from s3_fault_proxy import s3_proxy  # noqa: F401 (fixture)

RANK1_PARTS = "rank_00001.safetensors?partNumber="
RANK1_CREATES = "rank_00001.safetensors?uploads"


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """Import the checkpoint stack and the state-dict API here once, so forked ranks do not each pay."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import podtrain.ckpt.checkpointer  # noqa: F401


def _trained(seed: int = 0):
    """A 3.1M-parameter model after one AdamW step (weights + moments: 19 MB per rank of two, 3
    parts of the CRT's 8 MiB), the same in every process for a seed."""
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(3)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _save_rank(rank, world, run_dir, url, budget_mb):
    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection

    from podtrain.errors import UserError

    model, opt = _trained()
    ck = Checkpointer(Path(run_dir), CkptSection(dir=url, host_staging_mb=budget_mb), gloo_context())
    try:
        ck.save(1, model, opt, None, {"step": 1, "tokens_seen": 1})
        stream = ck._pending.stream
        try:
            ck.wait(final=True)  # final: a save abandoned on a transient fault raises too
            error = None
        except UserError as exc:
            error = str(exc)
        return {"error": error, "replay": getattr(stream, "replay", None), "staged": stream.staged_bytes,
                "nbytes": stream.nbytes,
                "in_use": ck._pool._in_use, "budget": ck._pool.budget_bytes, "peak": ck._pool.peak_in_use_bytes}
    finally:
        ck.close()


class _FirstPartRefused(threading.Thread):
    """Refuses rank 1's part uploads with 502 until one was refused, then ``fraction`` of every
    request under a step directory (the save's own) with 503 SlowDown."""

    def __init__(self, proxy, fraction: float, seed: int):
        super().__init__(daemon=True, name="first-part-refused")
        self.proxy, self.fraction, self.seed = proxy, fraction, seed
        self.halt = threading.Event()
        proxy.fail_with(502, "BadGateway", "refused by the test")
        proxy.fail_only(RANK1_PARTS)
        proxy.fail_fraction(1.0)

    def run(self) -> None:
        while not self.halt.wait(0.002):
            if self.proxy.stats()["failed"]:
                self.proxy.fail_with(503, "SlowDown", "Please reduce your request rate.")
                self.proxy.fail_only("/step_")
                self.proxy.fail_fraction(self.fraction, seed=self.seed)
                return


def _save_with_faults(tmp_path, proxy, s3_server, bucket, budget_mb):
    url = f"s3://{bucket}/ckpt"
    run_dir = tmp_path / "run"
    director = _FirstPartRefused(proxy, 0.2, seed=3)
    director.start()
    try:
        results = run_ranks(_save_rank, 2, str(run_dir), url, budget_mb, timeout=120)
    finally:
        director.halt.set()
        director.join(5)
    history = proxy.history()
    proxy.reset()
    return url, run_dir, results, history


def _upload_id(path: str) -> str:
    return path.split("uploadId=")[1].split("&")[0]


def _incomplete(s3_server, bucket: str, expected: set[str], settle_s: float = 5.0) -> set[str]:
    """Ids of the multipart uploads left in ``bucket``, once they are ``expected`` or ``settle_s``
    has passed (the CRT sends its abort from its own event loop, a moment after the failure)."""
    deadline = time.monotonic() + settle_s
    while True:
        left = {u["UploadId"] for u in s3_server.boto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}
        if left == expected or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _check_saved(url, run_dir, results, history, s3_server, bucket) -> None:
    """Committed, rank 1's file uploaded more than once, nothing left behind, and exactly the state."""
    from podtrain.ckpt import layout
    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection

    assert [r["error"] for r in results] == [None, None]
    refused_parts = [p for m, p, failed in history if failed and RANK1_PARTS in p]
    creates = [p for m, p, failed in history if m == "POST" and RANK1_CREATES in p and not failed]
    uploads = {_upload_id(p) for m, p, _ in history if m == "PUT" and RANK1_PARTS in p}  # refused or not
    assert refused_parts, "no part of rank 1's file was refused"
    assert len(creates) >= 2 and len(uploads) >= 2, (creates, uploads)  # its file was sent again
    assert sum(failed for _, _, failed in history) > len(refused_parts)  # the 20% hit more than that
    assert [s for s, _ in layout.list_checkpoints(url)] == [1]
    # I5: every failed upload was aborted by the CRT, except where the storage refused that abort
    # (the CRT sends it once; s3torchconnector offers no abort of its own: a lifecycle rule's job)
    refused_aborts = {_upload_id(p) for m, p, failed in history if m == "DELETE" and "uploadId=" in p and failed}
    assert _incomplete(s3_server, bucket, refused_aborts) == refused_aborts
    assert all(r["in_use"] == 0 for r in results)  # every slab back in the pool
    model, opt = _trained(seed=1)
    ck = Checkpointer(run_dir, CkptSection(dir=url), gloo_context())
    try:
        ck.restore(model, opt, None)
    finally:
        ck.close()  # its lease must not go on renewing into the worker's later tests
    ref_model, ref_opt = _trained(seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref_model.state_dict().values()))
    for a, b in zip(opt.state.values(), ref_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


@pytest.mark.slow
def test_a_refused_part_is_sent_again_from_the_kept_slabs_and_the_save_commits(tmp_path, s3_proxy, s3_server,
                                                                               s3_bucket):
    """The default budget: each rank's share fits its pool, so the re-send reads the slabs again
    (nothing staged twice); main abandoned this save."""
    url, run_dir, results, history = _save_with_faults(tmp_path, s3_proxy, s3_server, s3_bucket, None)
    _check_saved(url, run_dir, results, history, s3_server, s3_bucket)
    assert [r["replay"] for r in results] == ["keep", "keep"]
    assert all(r["staged"] == r["nbytes"] > 8 << 20 for r in results)  # several parts, staged once


@pytest.mark.slow
def test_a_refused_part_is_sent_again_restaged_when_the_share_exceeds_the_pool(tmp_path, s3_proxy, s3_server,
                                                                              s3_bucket):
    """A 1 MB budget, 19 MB shares: the slabs are reused as the file is written, so the step loop
    stays in the save until the file is committed and stages it again for the re-send; the pool
    never held more than its budget."""
    url, run_dir, results, history = _save_with_faults(tmp_path, s3_proxy, s3_server, s3_bucket, 1.0)
    _check_saved(url, run_dir, results, history, s3_server, s3_bucket)
    assert [r["replay"] for r in results] == ["restage", "restage"]
    assert results[1]["staged"] > results[1]["nbytes"]  # rank 1 staged its file again
    assert all(r["budget"] == 1 << 20 and 0 < r["peak"] <= r["budget"] for r in results)
