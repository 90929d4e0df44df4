"""What one rank needs from all is gathered to that rank alone (``dist.gather_object``), not sent
to every rank: ``DistContext.gather_object`` and lm-eval's ``gather_object`` of ``PodtrainLM``
(the per-document samples and metrics that only rank 0 aggregates)."""

import pytest
import torch

from multirank import gloo_context, run_ranks

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")


def _gather_rank(rank, world):
    from podtrain.data.tokenizer import ByteTokenizer
    from podtrain.eval.adapter import PodtrainLM

    ctx = gloo_context()
    to_last = ctx.gather_object(("rank", rank), dst=world - 1)
    lm = PodtrainLM(torch.nn.Linear(2, 2), ByteTokenizer(), ctx, max_length=16)
    metrics = lm.gather_object({"acc": rank / 10}, dst=0)
    ops = [entry["op"] for entry in ctx.recorder.snapshot()]
    return to_last, metrics, ops


def test_gather_object_reaches_the_destination_rank_alone():
    results = run_ranks(_gather_rank, 3, timeout=60)
    for rank, (to_last, metrics, ops) in enumerate(results):
        assert to_last == ([("rank", r) for r in range(3)] if rank == 2 else None)
        assert metrics == ([{"acc": r / 10} for r in range(3)] if rank == 0 else None)
        assert ops == ["gather_object", "gather_object"], ops  # before: all_gather_object to every rank
