"""``podtrain sample RUN_DIR``: generate text from a run's newest checkpoint.

The weights and the model config come from the checkpoint (no process group; the optimizer's
pieces are not read), the run config from the checkpoint's own copy (else ``RUN_DIR/config.yaml``),
and the tokenizer from the run's data (``ckpt.reader.run_data``: ``data.path`` or the first source
of ``data.mix``, local or ``s3://``; ``--data`` overrides).

A small model left to itself falls into a run of one token (the 200-step demo: 249 spaces in a
305-character sample), so by default no token is drawn more than ``MAX_RUN`` times in a row, and
the sample ends at a natural boundary (the end of its first block, else its last whole line).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch

from podtrain.errors import UserError


MAX_RUN = 16
"""The repetition guard: a token already generated this many times in a row is not drawn again."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain sample``."""
    parser.add_argument("run_dir", help="run directory (holds ckpt/ and config.yaml)")
    parser.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature; 0 picks the most likely token (default 0.8)")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the K likeliest; 0: all (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--max-run", type=int, default=MAX_RUN,
                        help=f"never draw a token more than this many times in a row; 0: off (default {MAX_RUN})")
    parser.add_argument("--stop", choices=("block", "none"), default="block",
                        help="block (default): end at the first blank line followed by unindented text "
                        "(a function's or a paragraph's end), else at the last whole line; none: at EOS "
                        "or --max-new-tokens")
    parser.add_argument("--data", default=None, help="data directory holding the tokenizer, a folder or "
                        "s3://... (default: the run's data.path, or the first source of its data.mix)")


def run(args: argparse.Namespace) -> int:
    """Load the run's newest weights and tokenizer, generate, print the text."""
    from podtrain.ckpt.reader import build_model_from_checkpoint, load_latest, run_config_of, run_data
    from podtrain.data.tokenizer import load_tokenizer

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.max_run < 0:
        raise UserError(f"--max-run must be 0 (off) or more, got {args.max_run}")
    ckpt = load_latest(args.run_dir)
    run_config = run_config_of(args.run_dir, ckpt)
    tokenizer = load_tokenizer(run_data(ckpt, run_config, args.data))
    model = build_model_from_checkpoint(ckpt, run_config)
    text = generate_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                         args.top_k, args.seed, args.max_run, args.stop)
    print(text)
    return 0


def run_guard(max_run: int, prompt_len: int) -> Any:
    """A logits processor: once the last ``max_run`` generated tokens are one token, that token
    is forbidden for the next draw.

    A small model's likeliest failure is a run of one token it cannot leave (on a byte-level
    code corpus: hundreds of spaces), which buries whatever else it learned; capping the run
    makes it continue with its next choice. The prompt does not count.
    """
    from transformers import LogitsProcessor

    class RunGuard(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] - prompt_len < max_run:
                return scores
            last = input_ids[:, -1]
            stuck = (input_ids[:, -max_run:] == last[:, None]).all(dim=1)
            rows = stuck.nonzero().flatten()
            scores[rows, last[rows]] = float("-inf")
            return scores

    return RunGuard()


def block_end(text: str) -> int | None:
    """Where the first block of ``text`` ends: the first blank line followed by unindented text
    (the end of a function or class before the next top-level statement; the end of a
    paragraph), or None. The index is that of the blank line's first newline."""
    match = BLOCK_END.search(text)
    return None if match is None else match.start(1)


BLOCK_END = re.compile(r"\S[^\n]*(\n(?:[ \t]*\n)+)(?=\S)")
"""A non-blank line, one or more blank lines, then text at column 0 (see ``block_end``)."""


def stop_at_block_end(tokenizer: Any, prompt_len: int) -> Any:
    """A stopping criterion: generation ends once the generated text holds a ``block_end``."""
    from transformers import StoppingCriteria

    class BlockEnd(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            text = tokenizer.decode([int(i) for i in input_ids[0, prompt_len:].tolist()])
            done = block_end(text) is not None
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return BlockEnd()


def _trimmed(text: str, stop: str) -> str:
    """The generated ``text`` cut where the sample should end: at its first ``block_end`` with
    ``stop="block"``, else at its last complete line when the token limit cut a line short."""
    if stop != "block":
        return text
    end = block_end(text)
    if end is not None:
        return text[:end]
    last = text.rfind("\n")
    return text[:last] if last > 0 else text


@torch.no_grad()
def generate_text(model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int,
                  temperature: float = 0.8, top_k: int = 50, seed: int = 0, max_run: int = MAX_RUN,
                  stop: str = "none") -> str:
    """``prompt`` followed by up to ``max_new_tokens`` sampled tokens (stops at EOS), as text.

    The prompt starts a document: it follows an EOS, as every training document did (a window
    of packed training data starts mid-document, so without it the model would not know where
    it is). Temperature 0 is greedy decoding; ``max_run`` is the repetition guard (``run_guard``;
    0: off). ``stop="block"`` ends the sample at the end of its first block (``block_end``) or
    its last whole line. Uses the KV cache.
    """
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    device = next(model.parameters()).device
    ids = [tokenizer.eos_id] + (tokenizer.encode(prompt) if prompt else [])
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and len(ids) + max_new_tokens > limit:
        raise UserError(f"prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                        f"model's {limit} positions")
    greedy = temperature <= 0
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not greedy, use_cache=True,
                           eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id,
                           **({} if greedy else {"temperature": temperature, "top_k": top_k or None}))
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        guards = LogitsProcessorList([run_guard(max_run, len(ids))] if max_run > 0 else [])
        stops = StoppingCriteriaList([stop_at_block_end(tokenizer, len(ids))] if stop == "block" else [])
        out = model.generate(torch.tensor([ids], device=device), generation_config=gen, logits_processor=guards,
                             stopping_criteria=stops,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device))
    finally:
        model.train(was_training)
    new = [int(i) for i in out[0, len(ids):].tolist()]
    if new and new[-1] == tokenizer.eos_id:
        new = new[:-1]
    return prompt + _trimmed(tokenizer.decode(new), stop)
