"""``podtrain sample RUN_DIR``: generate text from a run's newest checkpoint.

The weights and the model config come from the checkpoint (no process group), the run config from
the checkpoint's own copy (else ``RUN_DIR/config.yaml``), and the tokenizer from the run's data
directory (``data.path``, relative to the current directory as at training time).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from podtrain.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain sample``."""
    parser.add_argument("run_dir", help="run directory (holds ckpt/ and config.yaml)")
    parser.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature; 0 picks the most likely token (default 0.8)")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the K likeliest; 0: all (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--data", default=None, help="data directory holding the tokenizer "
                        "(default: the run's data.path)")


def run(args: argparse.Namespace) -> int:
    """Load the run's newest weights and tokenizer, generate, print the text."""
    from podtrain.ckpt.reader import build_model_from_checkpoint, check_tokenizer, load_latest, run_config_of
    from podtrain.data.manifest import read_manifest
    from podtrain.data.mixture import primary_path
    from podtrain.data.tokenizer import load_tokenizer

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    ckpt = load_latest(args.run_dir)
    run_config = run_config_of(args.run_dir, ckpt)
    section = run_config.get("data") or {}
    data = Path(args.data or primary_path(section.get("mix") or [], section.get("path", "")))
    if not (data / "manifest.json").is_file():
        raise UserError(f"tokenizer not found: {data} (the run's data.path) has no manifest.json; "
                        "pass --data DATA_DIR")
    manifest = read_manifest(data)
    check_tokenizer(ckpt, manifest.raw["tokenizer"], data)
    tokenizer = load_tokenizer(manifest)
    model = build_model_from_checkpoint(ckpt, run_config)
    text = generate_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                         args.top_k, args.seed)
    print(text)
    return 0


@torch.no_grad()
def generate_text(model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int,
                  temperature: float = 0.8, top_k: int = 50, seed: int = 0) -> str:
    """``prompt`` followed by up to ``max_new_tokens`` sampled tokens (stops at EOS), as text.

    Temperature 0 is greedy decoding. An empty prompt starts after an EOS (a document boundary),
    the state the model saw at the start of every training document. Uses the KV cache.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
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
        out = model.generate(torch.tensor([ids], device=device), generation_config=gen,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device))
    finally:
        model.train(was_training)
    new = [int(i) for i in out[0, len(ids):].tolist()]
    if new and new[-1] == tokenizer.eos_id:
        new = new[:-1]
    return prompt + tokenizer.decode(new)
