"""The FLOP path of `plan --instance-type local` (``plan/calibrate.py``, taken for shapes beyond the
host) times this host's matmuls at the run's shapes: its largest piece, the LM head, against the same
product timed whole with torch, side by side."""

import time

import torch

from podtrain.plan.calibrate import MAX_TIMED_FLOPS, MIN_TIMED_ROWS, calibrate
from podtrain.plan.memory import ModelShape


def _best_of(fn, trials: int) -> float:
    fn()  # warm-up, as the calibration does
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def test_lm_head_estimate_is_within_2x_of_the_head_timed_whole():
    # The tiny preset's 192-wide residual with a 32k vocabulary, one 512-token micro-batch: the
    # head's forward + backward (1.9e10 FLOPs, ~0.3 s on one core) is 48x the FLOP cap, so the
    # planner times part of it and scales. Timed on 10 rows (the cap's share, as before), its
    # memory-bound matrix-vector products planned the head at ~4x its real time.
    # (The shape by hand: counting a transformers model costs seconds of imports.)
    micro_batch, seq_len = 1, 512
    shape = ModelShape(params=0, embedding_params=0, matmul_params=0, flops_per_token=0.0, layers=4,
                       hidden=192, attn_width=192, kv_width=192, heads=6, intermediate=512, vocab=32768,
                       gated_mlp=True, rotary=True)
    tokens = micro_batch * seq_len
    assert 6.0 * tokens * shape.hidden * shape.vocab > 40 * MAX_TIMED_FLOPS and tokens > MIN_TIMED_ROWS
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, shape.hidden, generator=gen, requires_grad=True)
        head = torch.randn(shape.vocab, shape.hidden, generator=gen, requires_grad=True)
        grad = torch.randn(tokens, shape.vocab, generator=gen)

        def forward_backward() -> None:  # what the model's lm_head does in one micro-batch
            torch.nn.functional.linear(x, head).backward(grad)

        # Measured around the calibration, the faster taken, so that load from other processes
        # on the shared machine falls on both sides alike.
        before = _best_of(forward_backward, trials=1)
        planned = calibrate(shape, micro_batch, seq_len, threads=1, bandwidth=10e9).head_s
        measured = min(before, _best_of(forward_backward, trials=1))
    finally:
        torch.set_num_threads(previous)
    assert 0.5 <= planned / measured <= 2.0, (planned, measured)
