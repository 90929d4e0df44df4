"""``prepare`` never replaces another dataset unless told to (``--force``).

A finished dataset (DATA_DIR/manifest.json, a folder or an ``s3://`` prefix) records its
**recipe**: the INPUTs (absolute), the tokenizer (``byte``, ``bpe:VOCAB``, or the SHA-256 of the
tokenizer file it was given: the same file at another path is the same tokenizer) and the options
that shape the shards. A prepare with the same recipe may rewrite it: rerunning the command
resumes, finds it up to date, or rebuilds it from inputs that changed since. Any other recipe is
refused, before anything is read or written, in one line naming what is there (tokens, inputs,
tokenizer), what would replace it and what differs. Manifests written before the recipe was
recorded are compared by what they do record (inputs as given, tokenizer, split fraction, text
field).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from podtrain.data.manifest import MANIFEST_NAME
from podtrain.data.prepare.sources import is_s3
from podtrain.errors import UserError
from podtrain.storage import NotFound, open_store

SHOWN_INPUTS = 3  # inputs named in the refusal before "and N more"


def input_where(inp: str) -> str:
    """An INPUT as the recipe records it: absolute for a local path (or pattern), else as given."""
    return inp if is_s3(inp) or inp == "builtin" else os.path.abspath(inp)


def make_recipe(inputs: tuple[str, ...], tokenizer: str, options: dict[str, Any],
                files: int | None = None) -> dict[str, Any]:
    """The recipe of a prepare: its INPUTs, its tokenizer as ``tokenizer_recipe`` says it, and the
    options that shape the shards (``PrepareOptions.key_fields`` without tokenizer and version);
    ``files``, the number of files the INPUTs resolved to, is recorded for the refusal's words
    (``inputs: 1,005 files -> 5 files``), not compared."""
    recipe = {"inputs": [input_where(i) for i in inputs], "tokenizer": tokenizer,
              "options": {k: v for k, v in options.items() if k not in ("tokenizer", "pipeline")}}
    if files is not None:
        recipe["files"] = files
    return recipe


def tokenizer_recipe(spec: str, tokenizer_sha256: str | None) -> str:
    """``byte``, ``bpe:VOCAB`` (trained from the inputs), or ``sha256:HEX`` of the tokenizer file
    a path, hub name or dataset gave (``None``: a byte-level dataset's)."""
    if spec.startswith("bpe:"):
        return spec
    return f"sha256:{tokenizer_sha256}" if tokenizer_sha256 else "byte"


def read_existing(out: str | Path) -> dict[str, Any] | None:
    """The manifest of the finished dataset at ``out``, if there is one. On S3 this is the
    prepare's first request: missing credentials, a missing bucket or a denied read are one line
    (the store's) before any work."""
    if is_s3(str(out)):
        try:
            text = open_store(str(out)).read_bytes(MANIFEST_NAME)
        except NotFound:
            return None
    else:
        try:
            text = (Path(out) / MANIFEST_NAME).read_bytes()
        except OSError:
            return None
    try:
        manifest = json.loads(text)
    except ValueError:
        return None  # nothing readable to protect (an interrupted write never leaves one: atomic)
    return manifest if isinstance(manifest, dict) else None


def differences(existing: dict[str, Any], recipe: dict[str, Any], spec: str) -> list[str]:
    """What differs between the dataset (or trained-tokenizer record) ``existing`` and the
    ``recipe`` (``spec``: the --tokenizer given), concretely: ``inputs: 1,005 files -> 5 files``
    (or the first input that differs), ``vocabulary 4096 -> 2048`` (or ``tokenizer A -> B``),
    ``options: --val-fraction 0.0 -> 0.1``; empty when the prepare would remake the same dataset."""
    old = existing.get("recipe")
    if isinstance(old, dict):
        diff = []
        if old.get("inputs") != recipe["inputs"]:
            diff.append(_inputs_difference(old.get("inputs") or [], recipe["inputs"],
                                           old.get("files", _manifest_files(existing)), recipe.get("files")))
        if old.get("tokenizer") != recipe["tokenizer"]:
            diff.append(_tokenizer_difference(str(old.get("tokenizer")), recipe["tokenizer"]))
        before, now = old.get("options") or {}, recipe["options"]
        opts = [f"--{k.replace('_', '-')} {before.get(k)} -> {now[k]}" for k in now if before.get(k) != now[k]]
        if opts:
            diff.append("options: " + ", ".join(opts))
        return diff
    return _legacy_differences(existing, recipe, spec)


def _manifest_files(existing: dict[str, Any]) -> int | None:
    """How many files a dataset's manifest says its inputs held (None: no sources listed)."""
    sources = existing.get("sources")
    if not isinstance(sources, list) or not sources:
        return None
    return sum(int(s.get("files", 0)) for s in sources if isinstance(s, dict))


def _inputs_difference(old: list[str], new: list[str], old_files: int | None, new_files: int | None) -> str:
    """``inputs: 1,005 files -> 5 files`` when the counts of files differ (an unquoted glob
    passes thousands of INPUTs: listing them says nothing), else the first INPUT that differs."""
    if old_files is not None and new_files is not None and old_files != new_files:
        return f"inputs: {_files(old_files)} -> {_files(new_files)}"
    for i in range(max(len(old), len(new))):
        a = old[i] if i < len(old) else "nothing"
        b = new[i] if i < len(new) else "nothing"
        if a != b:
            return f"inputs: {a} -> {b}" + (f" (input {i + 1})" if i else "")
    return "inputs: other inputs"  # pragma: no cover - the lists differ, so some position does


def _tokenizer_difference(old: str, new: str) -> str:
    """``vocabulary 4096 -> 2048`` between two trained BPEs, else ``tokenizer A -> B`` (a file's
    SHA-256 shortened: ``sha256:1a2b3c4d5e6f``)."""
    if old.startswith("bpe:") and new.startswith("bpe:"):
        return f"vocabulary {old[4:]} -> {new[4:]}"

    def short(t: str) -> str:
        return t[:len("sha256:") + 12] if t.startswith("sha256:") else t
    return f"tokenizer {short(old)} -> {short(new)}"


def _legacy_differences(existing: dict[str, Any], recipe: dict[str, Any], spec: str) -> list[str]:
    """``differences`` for a manifest without a recipe (podtrain before it was recorded)."""
    diff = []
    inputs = [input_where(str(s.get("input"))) for s in existing.get("sources") or []]
    if inputs != recipe["inputs"]:
        diff.append(_inputs_difference(inputs, recipe["inputs"], _manifest_files(existing), recipe.get("files")))
    tok = existing.get("tokenizer") or {}
    same_file = recipe["tokenizer"] == f"sha256:{tok.get('sha256')}"
    if not same_file and tok.get("name") != spec and not (spec == "byte" and tok.get("kind") == "byte"):
        diff.append(_tokenizer_difference(str(tok.get("name")), spec))
    opts = [f"--{key.replace('_', '-')} {existing[key]} -> {recipe['options'].get(key)}"
            for key in ("val_fraction", "text_field")
            if key in existing and existing[key] != recipe["options"].get(key)]
    if opts:
        diff.append("options: " + ", ".join(opts))
    return diff


def _files(n: int) -> str:
    return f"{n:,} file{'' if n == 1 else 's'}"


def shown_inputs(inputs: list[str]) -> str:
    """The first ``SHOWN_INPUTS`` INPUTs and how many more: an unquoted glob passes thousands."""
    shown = ", ".join(inputs[:SHOWN_INPUTS])
    return shown + (f" and {len(inputs) - SHOWN_INPUTS} more" if len(inputs) > SHOWN_INPUTS else "")


def refuse_replacing(out: str | Path, existing: dict[str, Any] | None, recipe: dict[str, Any],
                     spec: str, inputs: tuple[str, ...], files: int) -> None:
    """A one-line UserError when ``out`` holds a finished dataset that this prepare (``recipe``,
    ``--tokenizer spec``, ``inputs`` resolving to ``files`` files) would replace by another."""
    if existing is None:
        return
    diff = differences(existing, recipe, spec)
    if not diff:
        return
    splits = existing.get("splits") or {}
    tokens = sum(int(s.get("tokens", 0)) for s in splits.values() if isinstance(s, dict))
    sources = existing.get("sources") or []
    old_files = sum(int(s.get("files", 0)) for s in sources)
    old_tok = (existing.get("tokenizer") or {}).get("name")
    raise UserError(
        f"--out {out} holds another dataset ({tokens:,} tokens from "
        f"{shown_inputs([str(s.get('input')) for s in sources]) or 'unknown inputs'} ({_files(old_files)}), "
        f"tokenizer {old_tok!r}); this prepare would replace it with {shown_inputs(list(inputs))} "
        f"({_files(files)}), tokenizer {spec!r} ({', '.join(diff)}): choose another --out, or pass "
        "--force to replace it")
