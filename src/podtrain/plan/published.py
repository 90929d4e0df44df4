"""What the plan takes from published figures rather than this host: FP8's speed-up and the cost of
document masking. Each adjustment returns its factor and the sentence the plan prints, naming the
figure and its source (or saying it is an estimate).

FP8 (``train.fp8``): torchtitan's published Llama 3.1 8B figures on 8 x H100 (FSDP, torch.compile)
are 6,667 tokens/s/GPU in bf16 and 8,532 with Float8 (torchao ``Float8Linear``, tensorwise
scaling): 1.28x. FP8 converts the decoder's linear layers only, so the factor divides the plan's
decoder-matmul term (the step's other terms, attention, the LM head and loss, the optimizer and
communication, are left as they are, except FSDP's weight all-gather, which tensorwise FP8 sends
in one byte per weight instead of two: ``plan/steptime.py``). Rowwise scaling has no published
figure on that model here: it is planned at the same factor, stated as an estimate. FP8 needs
compute capability 8.9 or more (Ada L4/L40S, Hopper H100/H200, Blackwell): on a CPU or an older GPU
the plan says FP8 cannot run there and plans without it.

Memory: FP8 does not change the estimate under DDP: the fp32 master weights, fp32 gradients and
AdamW's fp32 moments are what they were; the FP8 copies of a layer's weight and input exist only
around its matmul (a few MB). Under FSDP the gathered weights of the tensorwise FP8 all-gather are
half the bytes, a small share of the total at these sizes, so the estimate keeps the 16-bit figure
(an overestimate on the safe side).

Document masking (``data.document_masking``): attention is kept inside each document. With
document boundaries falling at random (a Poisson process of mean spacing ``m``, the corpus's tokens
per document) a sample of ``S`` tokens computes, of its causal attention, the share
``2/x - 2(1 - exp(-x))/x**2`` with ``x = S/m`` (the expected sum of squared document lengths over
``S**2``; ~``2m/S`` for short documents, 1 for long ones), never less than one 128-token block
row of flex_attention's block mask (``FLEX_BLOCK / S``). The kernel that skips the masked blocks
runs slower than a dense causal one: the PyTorch blog "FlexAttention: The Flexibility of PyTorch
with the Performance of FlashAttention" (Aug 2024) reports ~90% of FlashAttention2's forward and
~85% of its backward speed, so the masked attention term is multiplied by ``FLEX_OVERHEAD`` = 1.15
(an estimate from those figures). On a CPU the run uses an explicit mask with SDPA, which computes
every score: the planner times that where it times the step (``plan/layertime.py``); on the FLOP
path it takes no FLOPs saved (an estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# torchtitan, Llama 3.1 8B, 8 x H100: tokens/s/GPU with torch.compile, bf16 vs Float8.
TORCHTITAN_BF16_TPS = 6667
TORCHTITAN_FP8_TPS = 8532
FP8_SPEEDUP = TORCHTITAN_FP8_TPS / TORCHTITAN_BF16_TPS
FP8_MIN_CAPABILITY = (8, 9)
# GPU models of the instance table with FP8 tensor cores (capability >= 8.9).
FP8_GPU_MODELS = frozenset({"B200", "H200", "H200 NVL", "H100 SXM", "H100 NVL", "H100 PCIe", "L40S", "L4"})
FLEX_BLOCK = 128
FLEX_OVERHEAD = 1.15


@dataclass(frozen=True)
class Adjustment:
    """A factor on one term of the step and the sentence the plan prints for it."""

    term: str
    """``matmul`` (decoder linear layers) or ``attention``."""
    factor: float
    """What the term's time is multiplied by (1: unchanged)."""
    note: str


def fp8_mode(cfg) -> str:
    """``train.fp8`` of ``cfg`` (``off`` where the config has no such key)."""
    value = getattr(cfg.train, "fp8", "off")
    return "off" if value in (None, False, "", "none") else str(value)


def masking_on(cfg) -> bool:
    """``data.document_masking`` of ``cfg`` (False where the config has no such key)."""
    return bool(getattr(cfg.data, "document_masking", False))


def fp8_adjustment(mode: str, machine_name: str, fp8_capable: bool) -> Adjustment | None:
    """FP8's factor on the decoder-matmul term on ``machine_name`` (None when ``mode`` is off)."""
    if mode == "off":
        return None
    if not fp8_capable:
        return Adjustment("matmul", 1.0,
                          f"fp8: train.fp8={mode} cannot run on {machine_name}: FP8 matmuls need a GPU of "
                          f"compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                          "(H100/H200 class); planned without it (unavailable)")
    basis = ("published" if mode == "tensorwise"
             else "published for tensorwise; rowwise planned at the same factor, an estimate")
    return Adjustment("matmul", 1 / FP8_SPEEDUP,
                      f"fp8: train.fp8={mode}: decoder matmuls / {FP8_SPEEDUP:.2f} ({basis}: torchtitan Llama "
                      f"3.1 8B on 8x H100, {TORCHTITAN_BF16_TPS:,} -> {TORCHTITAN_FP8_TPS:,} tokens/s/GPU "
                      "with Float8); memory as without FP8 (fp32 master weights, gradients and AdamW "
                      "state unchanged; FP8 copies live only around each matmul)"
                      + ("; under FSDP the weights are all-gathered in FP8 (half the bytes)" if mode == "tensorwise"
                         else ""))


def attention_share(seq_len: int, mean_document: float) -> float:
    """Share of a sample's causal attention computed when it is kept inside documents of
    ``mean_document`` tokens on average (Poisson boundaries; at least one flex_attention block row)."""
    x = seq_len / max(1.0, mean_document)
    share = 1.0 if x < 1e-9 else 2 / x - 2 * (1 - math.exp(-x)) / x**2
    return min(1.0, max(share, FLEX_BLOCK / seq_len))


def masking_adjustment(seq_len: int, mean_document: float | None, gpu: bool, timed: bool) -> Adjustment:
    """Document masking's factor on the attention term. ``timed``: the attention was timed with the
    run's explicit mask here (CPU), so no model applies."""
    if timed:
        return Adjustment("attention", 1.0, "document masking: attention timed here with the run's explicit "
                          f"mask (documents of {mean_document:,.0f} tokens)")
    if not gpu:
        return Adjustment("attention", 1.0, "document masking: an explicit mask through SDPA on CPU "
                          "computes every score: no attention saved (an estimate)")
    if mean_document is None:
        return Adjustment("attention", FLEX_OVERHEAD,
                          f"document masking: no prepared data here to read the document length from: "
                          f"planned as documents at least seq_len long, attention x {FLEX_OVERHEAD:g} for "
                          "flex_attention's speed against a dense causal kernel (estimate from the "
                          "PyTorch FlexAttention blog's ~85-90% of FlashAttention2)")
    share = attention_share(seq_len, mean_document)
    return Adjustment("attention", share * FLEX_OVERHEAD,
                      f"document masking: documents of {mean_document:,.0f} tokens on average leave "
                      f"{share:.2f} of a {seq_len}-token sample's causal attention (model: Poisson "
                      f"boundaries, at least one {FLEX_BLOCK}-token block); x {FLEX_OVERHEAD:g} for "
                      "flex_attention against a dense causal kernel (estimate from the PyTorch "
                      f"FlexAttention blog's ~85-90% of FlashAttention2): attention x {share * FLEX_OVERHEAD:.2f}")
