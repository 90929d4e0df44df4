"""This host's matmul rate at the run's own shapes: the FLOP path of ``plan --instance-type local``.

The plan times the step itself where it can (``plan/layertime.py``: a real decoder layer, the LM
head and loss, the optimizer); this module is what it falls back to when the run's shapes are beyond
what the host is asked to time (a 70B plan on a laptop) or ``--efficiency`` is given: the step's
FLOPs over the rate measured here, which misses the element-wise, normalisation and optimizer work
a FLOP count does not see (it planned 0.68-0.78 of the measured step on a quiet 2-core host).

A CPU's matmul rate depends on the shapes: a 2048 x 192 by 192 x 576 product runs far below a
768-cube one, and a transformer step is made of such thin products, attention and elementwise
work. So instead of one square matmul times a constant efficiency, one micro-batch's forward and
backward is timed here piece by piece, each piece at the run's shapes, in fp32 (CPU training):

* every matmul of one decoder block and of the LM head: forward ``X @ W``, backward ``dY @ W^T`` and
  ``X^T @ dY``, each the best of a few trials (a trial shorter than a time slice measures the
  core, not the other processes sharing it);
* causal scaled-dot-product attention, forward and backward;
* the elementwise work (norms, rotary, activation function, residuals, softmax of the loss): the
  bytes autograd saves (``plan.memory.activation_bytes``) move ~3 times (written in forward, read
  and their gradient written in backward) at the host's measured copy bandwidth.

Pieces too large to time quickly are timed on fewer rows (tokens, or attention's sequences) and
scaled linearly, but never on fewer than ``MIN_TIMED_ROWS`` tokens: a product of a few rows is a
matrix-vector product that streams the whole weight for a handful of FLOPs per byte, so it runs at
memory speed, and scaling it by the token count overstates a large piece many times over
(gpt2-124m's LM head timed on one row planned 549.6 s per step against 23.0 s measured). A piece
this large is timed on fewer trials (``TRIAL_BUDGET_S``) instead. The result is given
to the plan as a peak (the matmul rate at these shapes) and the efficiency that makes
FLOPs / (peak x efficiency) equal the measured sum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from podtrain.plan.memory import ModelShape, activation_bytes

# Largest piece timed at full size (FLOPs): above it, fewer rows are timed and scaled.
MAX_TIMED_FLOPS = 4e8
# Fewest tokens a scaled matmul is timed on: at 256 rows an fp32 GEMM does ~100 FLOPs per byte of
# its weight (hidden 768), far past what memory bandwidth limits, so it runs at the compute rate the
# full product runs at and scales linearly.
MIN_TIMED_ROWS = 256
# Seconds of trials per piece after which no more are started (at least MIN_TRIALS run): the best
# of many short trials filters other processes' time slices; a long trial already averages them.
TRIAL_BUDGET_S = 0.5
MIN_TRIALS = 2
# Passes over the saved activations in a forward + backward (write, read, gradient write).
ELEMENTWISE_PASSES = 3
TRIALS = 5


@dataclass(frozen=True)
class Calibration:
    """One micro-batch's forward + backward on one rank of this host, by piece (seconds)."""

    matmul_s: float
    attention_s: float
    elementwise_s: float
    matmul_flops_per_s: float
    """FLOP/s of the matmuls at the run's shapes."""
    head_s: float
    """The LM head's share of ``matmul_s`` (the largest single piece: vocabulary x hidden)."""

    @property
    def micro_batch_s(self) -> float:
        """Seconds of one micro-batch's forward and backward."""
        return self.matmul_s + self.attention_s + self.elementwise_s


def _best(fn, trials: int = TRIALS) -> float:
    """The fastest of up to ``trials`` runs of ``fn`` after a warm-up (fewer, but at least
    MIN_TRIALS, once TRIAL_BUDGET_S is spent)."""
    fn()  # warm-up: allocation, kernel choice
    best = float("inf")
    spent = 0.0
    for done in range(trials):
        if done >= MIN_TRIALS and spent >= TRIAL_BUDGET_S:
            break
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best


def timed_rows(rows: int, flops: float, fewest: int = 1) -> int:
    """How many of ``rows`` to time for a piece of ``flops``: all when within MAX_TIMED_FLOPS,
    else the share that fits it, but not fewer than ``fewest`` (nor more than ``rows``)."""
    if flops <= MAX_TIMED_FLOPS:
        return rows
    return min(rows, max(fewest, int(rows * MAX_TIMED_FLOPS / flops)))


def matmul_seconds(rows: int, inner: int, cols: int, gen: torch.Generator) -> float:
    """Seconds of a linear layer's forward and backward matmuls for ``rows`` tokens, ``inner`` in
    and ``cols`` out (timed on fewer rows when large, at least MIN_TIMED_ROWS, scaled linearly)."""
    timed = timed_rows(rows, 6.0 * rows * inner * cols, MIN_TIMED_ROWS)
    x = torch.randn(timed, inner, generator=gen)
    w = torch.randn(inner, cols, generator=gen)
    g = torch.randn(timed, cols, generator=gen)

    def run() -> None:
        x @ w
        g @ w.T
        x.T @ g

    return _best(run) * rows / timed


def attention_seconds(micro_batch: int, heads: int, seq_len: int, head_dim: int, gen: torch.Generator) -> float:
    """Seconds of causal SDPA's forward and backward for one layer (fewer sequences when large:
    one whole sequence is already seq_len rows of products)."""
    sequences = micro_batch * heads
    timed = timed_rows(sequences, 3.0 * 4 * sequences * seq_len * seq_len * head_dim / 2)
    q, k, v = (torch.randn(timed, 1, seq_len, head_dim, generator=gen, requires_grad=True) for _ in range(3))

    def run() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    return _best(run) * sequences / timed


def calibrate(shape: ModelShape, micro_batch: int, seq_len: int, threads: int,
              bandwidth: float) -> Calibration:
    """Time one micro-batch's pieces on ``threads`` threads (a rank's share of the cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)  # the global RNG belongs to training
    try:
        tokens = micro_batch * seq_len
        h, a, kv, inter = shape.hidden, shape.attn_width, shape.kv_width, shape.intermediate
        block = [(h, a + 2 * kv), (a, h)]  # q, k, v projections; attention output
        block += [(h, 2 * inter), (inter, h)] if shape.gated_mlp else [(h, inter), (inter, h)]
        per_block = sum(matmul_seconds(tokens, i, o, gen) for i, o in block)
        head = matmul_seconds(tokens, h, shape.vocab, gen)
        flops = 6.0 * tokens * (shape.layers * sum(i * o for i, o in block) + h * shape.vocab)
        matmul = shape.layers * per_block + head
        attention = shape.layers * attention_seconds(micro_batch, shape.heads, seq_len, a // shape.heads, gen)
    finally:
        torch.set_num_threads(previous)
    moved = ELEMENTWISE_PASSES * activation_bytes(shape, micro_batch, seq_len, 4, checkpointing=False)
    return Calibration(matmul_s=matmul, attention_s=attention, elementwise_s=moved / bandwidth,
                       matmul_flops_per_s=flops / matmul, head_s=head)
