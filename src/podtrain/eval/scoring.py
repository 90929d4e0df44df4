"""The model work behind lm-eval's requests, in plain torch (no lm-eval import here).

``score_pairs`` answers loglikelihood requests in batches: each request is already tokenized as
(context ids, continuation ids); requests are sorted longest first so each batch pads little, run
right-padded (a causal model's positions never see the padding after them), and the vocabulary
projection and log-softmax run only at the continuation's positions, not at every position (the
projection dominates a small model's forward, and the log-softmax over all positions of a batch
would hold batch x length x vocabulary floats). ``rolling_pairs`` cuts a whole text into the
disjoint windows ``loglikelihood_rolling`` sums; ``greedy_until`` decodes with the KV cache.

Every forward goes through the model's root module, never its base model alone: an FSDP/HSDP
root gathers its own weights (embeddings, final norm, LM head) in its forward hooks, so the
projection at the continuation's positions runs in a hook on the base model, inside the root's
forward. ``max_tokens`` bounds the tokens of one forward (a batch holds fewer requests when they
are long), so the memory of task evaluation during training is known in advance (``plan``).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Sequence

import torch
from torch import nn

# Architectures whose logits are exactly lm_head(final hidden state): only these take the
# projection-at-continuation-positions path; any other model gets its own full forward.
PLAIN_HEAD_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gpt2", "gpt_neox", "olmo", "olmo2"})

Pair = tuple[Sequence[int], Sequence[int]]


def _head_path(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(base model, lm_head)`` where logits are a plain projection of the base's output."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_TYPES:
        return None
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (base, head) if base is not None and head is not None else None


def max_length_of(model: nn.Module, default: int = 2048) -> int:
    """Tokens the model attends over (its position limit)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return default


def rows_per_forward(batch_size: int, max_tokens: int | None, tokens_per_row: int) -> int:
    """Rows of ``tokens_per_row`` tokens in one forward: ``batch_size``, fewer when ``max_tokens``
    (None: no bound) would be exceeded, at least one."""
    if max_tokens is None:
        return batch_size
    return max(1, min(batch_size, max_tokens // max(1, tokens_per_row)))


@torch.no_grad()
def score_pairs(model: nn.Module, pairs: Sequence[Pair], batch_size: int, max_length: int,
                autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                on_batch: Callable[[int], None] = lambda scored: None,
                max_tokens: int | None = None) -> list[tuple[float, bool]]:
    """``(sum of log p(continuation | context), continuation is the greedy choice)`` per pair.

    Identical pairs are scored once (lm-eval pads a rank's requests with copies). Continuations
    of one context (a multiple-choice question's choices) share one forward of the context: its
    KV cache is repeated for a batch of the continuations, so a 4-choice question costs about
    one context instead of four. The rest run in batches, longest first. The input is the last
    ``max_length`` tokens of context + continuation (minus the last token): a group that does
    not fit is scored in batches, truncated from the left. Each question's numbers come from
    its own forwards only, so they do not depend on how requests are shared over ranks. One
    host sync per forward batch (its scores), then ``on_batch(distinct pairs it scored)``. A
    batch holds at most ``batch_size`` requests and ``max_tokens`` tokens (padding and a shared
    context's cache copies included; None: no bound).
    """
    index: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    keys = [(tuple(ctx), tuple(cont)) for ctx, cont in pairs]
    for key in keys:
        if not key[1] or not (key[0] or len(key[1]) > 1):
            raise ValueError("a loglikelihood request needs a non-empty continuation and context")
        index.setdefault(key, len(index))
    unique = list(index)
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(unique):
        by_context.setdefault(ctx, []).append(i)
    scores: list[tuple[float, bool]] = [(0.0, False)] * len(unique)
    singles = []
    for ctx, members in by_context.items():
        longest = max(len(unique[i][1]) for i in members)
        if len(members) > 1 and ctx and len(ctx) + longest <= max_length + 1:
            conts = [unique[i][1] for i in members]
            for i, score in zip(members, _score_shared(model, ctx, conts, batch_size, autocast, on_batch,
                                                       max_tokens)):
                scores[i] = score
        else:
            singles += members
    rows = [[*unique[i][0], *unique[i][1]][-(max_length + 1):] for i in singles]
    lengths = [min(len(unique[i][1]), len(r) - 1) for i, r in zip(singles, rows)]
    for i, score in zip(singles, _score_rows(model, rows, lengths, batch_size, autocast, on_batch, max_tokens)):
        scores[i] = score
    return [scores[index[key]] for key in keys]


def _score_rows(model: nn.Module, rows: list[list[int]], lengths: list[int], batch_size: int,
                autocast: Callable, on_batch: Callable, max_tokens: int | None) -> list[tuple[float, bool]]:
    """Score the last ``lengths[i]`` tokens of each row given the tokens before them."""
    device = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    start = 0
    while start < len(order):
        # longest first: the chunk's first row is its padded length
        chunk = order[start:start + rows_per_forward(batch_size, max_tokens, len(rows[order[start]]) - 1)]
        start += len(chunk)
        inputs = torch.zeros(len(chunk), len(rows[chunk[0]]) - 1, dtype=torch.long)
        picks = []
        for b, i in enumerate(chunk):
            full, n = rows[i], lengths[i]
            inputs[b, :len(full) - 1] = torch.tensor(full[:-1])
            picks.append((b, len(full) - 1 - n, full[-n:]))
        with autocast():
            results = _continuation_scores(model, inputs.to(device), None, picks)
        for b, score in enumerate(results):
            out[chunk[b]] = score
        on_batch(len(chunk))
    return out


def _score_shared(model: nn.Module, ctx: Sequence[int], conts: list[Sequence[int]], batch_size: int,
                  autocast: Callable, on_batch: Callable, max_tokens: int | None) -> list[tuple[float, bool]]:
    """Score each continuation after ``ctx``, the context's forward done once (KV cache)."""
    device = next(model.parameters()).device
    past = None
    with autocast():
        if len(ctx) > 1:
            past = _cache_of(_forward(model, torch.tensor([list(ctx[:-1])], device=device), None)[0])
    out = []
    # each row of a batch: the context's cache copy and the longest continuation
    step = rows_per_forward(batch_size, max_tokens, len(ctx) + max(len(c) for c in conts))
    for start in range(0, len(conts), step):
        chunk = conts[start:start + step]
        inputs = torch.zeros(len(chunk), max(len(c) for c in chunk), dtype=torch.long)
        for b, cont in enumerate(chunk):
            inputs[b, :len(cont)] = torch.tensor([ctx[-1], *cont[:-1]])
        cache = None
        if past is not None:
            cache = copy.deepcopy(past)
            cache.batch_repeat_interleave(len(chunk))
        with autocast():
            out += _continuation_scores(model, inputs.to(device), cache,
                                        [(b, 0, list(c)) for b, c in enumerate(chunk)])
        on_batch(len(chunk))
    return out


def _forward(model: nn.Module, inputs: torch.Tensor, past: Any, use_cache: bool = True,
             rows: torch.Tensor | None = None, pos: torch.Tensor | None = None) -> tuple[Any, torch.Tensor | None]:
    """``(the root model's output, the logits at (rows, pos))`` (None without ``rows``).

    Where the head is plain, the LM head runs only at those positions, in a hook on the base
    model, inside the root's forward (whose hooks gather an FSDP root's weights), and the root's
    own head only at the last position; other models give their full logits, picked after.
    """
    path = _head_path(model)
    kwargs = {"input_ids": inputs, "use_cache": use_cache, **_cache_arg(model, past)}
    if path is None:
        out = model(**kwargs)
        return out, (out.logits[rows, pos] if rows is not None else None)
    base, head = path
    picked: list[torch.Tensor] = []

    def project(module: nn.Module, args: Any, output: Any) -> None:
        if rows is not None:
            picked.append(head(output.last_hidden_state[rows, pos]))

    handle = base.register_forward_hook(project)
    try:
        out = model(**kwargs, **_last_logits_only(model))
    finally:
        handle.remove()
    return out, (picked[0] if picked else None)


def _last_logits_only(model: nn.Module) -> dict[str, Any]:
    """``logits_to_keep=1`` where the model's forward takes it (its own head then projects one
    position, not every one)."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _cache_arg(module: nn.Module, past: Any) -> dict[str, Any]:
    """The KV cache argument by its name in this transformers (``cache`` from 5.x, before it
    ``past_key_values``)."""
    if past is None:
        return {}
    import inspect

    names = inspect.signature(module.forward).parameters
    return {"cache": past} if "cache" in names else {"past_key_values": past}


def _cache_of(output: Any) -> Any:
    """The KV cache a forward returned (``cache`` from transformers 5.x, ``past_key_values`` before)."""
    fields = getattr(output, "__dataclass_fields__", {})
    return output.cache if "cache" in fields else output.past_key_values


def _continuation_scores(model: nn.Module, inputs: torch.Tensor, past: Any,
                         picks: list[tuple[int, int, list[int]]]) -> list[tuple[float, bool]]:
    """For each ``(row, first position, targets)``: the targets' summed log-probability at
    positions first.. of ``row``, and whether each was the argmax. Logits only where needed."""
    device = inputs.device
    rows = torch.tensor([b for b, first, t in picks for _ in t], device=device)
    pos = torch.tensor([first + j for b, first, t in picks for j in range(len(t))], device=device)
    tgt = torch.tensor([x for _, _, t in picks for x in t], device=device)
    logits = _forward(model, inputs, past, past is not None, rows, pos)[1].float()
    token_lp = torch.log_softmax(logits, dim=-1).gather(1, tgt[:, None])[:, 0].double()
    hit = (logits.argmax(-1) == tgt).long()
    owner = torch.tensor([b for b, (_, _, t) in enumerate(picks) for _ in t], device=device)
    sums = torch.zeros(len(picks), dtype=torch.float64, device=device).index_add_(0, owner, token_lp)
    misses = torch.zeros(len(picks), dtype=torch.long, device=device).index_add_(0, owner, 1 - hit)
    return [(s, m == 0) for s, m in zip(sums.tolist(), misses.tolist())]


def rolling_pairs(tokens: Sequence[int], prefix: int, max_length: int) -> list[Pair]:
    """Disjoint windows predicting every token of ``tokens`` once, the first after ``prefix``
    (EOS: a document start), each with as much preceding context as fits ``max_length``."""
    full = [prefix, *tokens]
    pairs = []
    for s in range(0, len(tokens), max_length):
        e = min(s + max_length, len(tokens))
        pairs.append((full[max(0, e - max_length):s + 1], full[s + 1:e + 1]))
    return pairs


@torch.no_grad()
def greedy_until(model: nn.Module, ids: Sequence[int], decode: Callable[[list[int]], str],
                 until: Sequence[str], max_new_tokens: int, eos_id: int, max_length: int,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> str:
    """Greedy continuation of ``ids`` (KV cache), cut before the first of ``until``; stops at EOS,
    at a stop string, after ``max_new_tokens``, or at the model's position limit."""
    device = next(model.parameters()).device
    ids = list(ids)[-max(1, max_length - max_new_tokens):] or [eos_id]
    new: list[int] = []
    past = None
    step_input = torch.tensor([ids], device=device)
    text = ""
    for _ in range(max_new_tokens):
        with autocast():
            out = model(input_ids=step_input, use_cache=True, **_cache_arg(model, past))
        past = _cache_of(out)
        token = int(out.logits[0, -1].argmax())
        if token == eos_id:
            break
        new.append(token)
        text = decode(new)
        if any(stop and stop in text for stop in until):
            break
        step_input = torch.tensor([[token]], device=device)
    cut = min((text.index(s) for s in until if s and s in text), default=len(text))
    return text[:cut]
