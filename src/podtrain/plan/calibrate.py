"""This host's compute for one run, measured at the run's own shapes (``plan --instance-type local``).

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

Pieces too large to time quickly are timed on fewer rows and scaled linearly. The result is given
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

    @property
    def micro_batch_s(self) -> float:
        """Seconds of one micro-batch's forward and backward."""
        return self.matmul_s + self.attention_s + self.elementwise_s


def _best(fn, trials: int = TRIALS) -> float:
    fn()  # warm-up: allocation, kernel choice
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_seconds(rows: int, inner: int, cols: int, gen: torch.Generator) -> float:
    """Seconds of a linear layer's forward and backward matmuls for ``rows`` tokens, ``inner`` in
    and ``cols`` out (timed on fewer rows when large, scaled linearly)."""
    flops = 6.0 * rows * inner * cols
    timed = max(1, min(rows, int(rows * MAX_TIMED_FLOPS / flops))) if flops > MAX_TIMED_FLOPS else rows
    x = torch.randn(timed, inner, generator=gen)
    w = torch.randn(inner, cols, generator=gen)
    g = torch.randn(timed, cols, generator=gen)

    def run() -> None:
        x @ w
        g @ w.T
        x.T @ g

    return _best(run) * rows / timed


def attention_seconds(micro_batch: int, heads: int, seq_len: int, head_dim: int, gen: torch.Generator) -> float:
    """Seconds of causal SDPA's forward and backward for one layer (fewer sequences when large)."""
    sequences = micro_batch * heads
    flops = 3.0 * 4 * sequences * seq_len * seq_len * head_dim / 2
    timed = max(1, min(sequences, int(sequences * MAX_TIMED_FLOPS / flops))) if flops > MAX_TIMED_FLOPS else sequences
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
                       matmul_flops_per_s=flops / matmul)
