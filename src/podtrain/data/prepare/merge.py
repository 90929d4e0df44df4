"""``podtrain prepare merge DATA_DIR``: the parts of a ``--num-parts N`` prepare under one manifest.

Every part 0..N-1 must be there (``DATA_DIR/parts/IIIII-of-NNNNN/manifest.json``), once, made with
the same N from the same corpus, options and tokenizer; anything else is refused in one line
naming the part. The merged manifest lists each split's shards part by part (a shard's ``file`` is
relative to DATA_DIR, e.g. ``parts/00001-of-00004/train_00000.bin``), so a split is the one-shot
token stream. No shard is copied: merging costs a ``stat`` per shard. It is written last and
atomically; a re-run writes the same manifest.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from podtrain.data.manifest import MANIFEST_NAME
from podtrain.data.prepare.parts import PART_RE, part_name
from podtrain.data.prepare.pipeline import PrepareOptions, check_not_empty, lock_dir
from podtrain.data.prepare.shards import PARTS_DIR, SHARD_RE
from podtrain.errors import UserError
from podtrain.fsutil import atomic_write_bytes, atomic_write_text

# Must agree in every part (the corpus key covers inputs and options; these are checked by name
# so the refusal can say what differs).
SAME_IN_EVERY_PART = ("tokenizer", "dtype", "val_fraction", "text_field", "shard_tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``podtrain prepare merge``."""
    parser.add_argument("out", type=Path, metavar="DATA_DIR",
                        help="the --out of the parts (holds parts/IIIII-of-NNNNN/)")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``podtrain prepare merge``."""
    manifest = merge(args.out)
    splits = "; ".join(f"{k} {s['tokens']:,} tokens / {s['documents']:,} docs / {len(s['shards'])} shards"
                       for k, s in manifest["splits"].items())
    print(f"merged {manifest['parts']} parts into {args.out / MANIFEST_NAME}: {splits}")
    return 0


def _read_part(folder: Path, index: int, count: int) -> dict[str, Any]:
    path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"part {index} of {count} has not finished ({path} is missing): run it "
                        f"(--num-parts {count} --part {index}), then merge again") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"part {index} of {count}: {path} is unreadable ({exc})") from None
    got = manifest.get("part") if isinstance(manifest, dict) else None
    if not isinstance(got, dict) or (got.get("index"), got.get("count")) != (index, count):
        raise UserError(f"part {index} of {count}: {path} says it is part {got and got.get('index')} of "
                        f"{got and got.get('count')} (a copied or duplicate folder?): remove it and run "
                        f"part {index} again")
    return manifest


def find_parts(out: Path) -> list[dict[str, Any]]:
    """The manifests of parts 0..N-1 under ``out/parts``, checked to be complete and consistent."""
    root = Path(out) / PARTS_DIR
    try:
        found = [(m, p) for p in sorted(root.iterdir()) if (m := PART_RE.match(p.name))]
    except FileNotFoundError:
        raise UserError(f"{root}: no parts to merge (run `podtrain prepare ... --out {out} "
                        "--num-parts N --part I` for every I first)") from None
    counts = sorted({int(m.group(2)) for m, _ in found})
    if not counts:
        raise UserError(f"{root}: no parts to merge (no IIIII-of-NNNNN folders)")
    if len(counts) > 1:
        groups = "; ".join(f"{n}: " + ", ".join(p.name for m, p in found if int(m.group(2)) == n) for n in counts)
        raise UserError(f"{root}: parts of different --num-parts ({groups}): remove those left over "
                        "from another run")
    count = counts[0]
    manifests = [_read_part(root / part_name(i, count), i, count) for i in range(count)]
    first = manifests[0]
    for i, m in enumerate(manifests[1:], start=1):
        for key in SAME_IN_EVERY_PART:
            if m.get(key) != first.get(key):
                raise UserError(f"part {i} of {count} was made with another {key} than part 0 "
                                f"({m.get(key)!r} vs {first.get(key)!r}): run every part with the same "
                                "inputs and options")
        if m["part"].get("corpus") != first["part"].get("corpus"):
            raise UserError(f"part {i} of {count} was made from other inputs or options than part 0 "
                            "(the corpus fingerprints differ): run every part with the same command")
    return manifests


def merged_manifest(out: Path, manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """One manifest for all parts: shards listed part by part, counts and sources summed."""
    first, count = manifests[0], len(manifests)
    itemsize = np.dtype(first["dtype"]).itemsize
    splits: dict[str, dict[str, Any]] = {}
    sources: dict[str, dict[str, Any]] = {}
    errors = {"policy": first["errors"]["policy"], "replaced": 0, "skipped": 0}
    for i, m in enumerate(manifests):
        prefix = f"{PARTS_DIR}/{part_name(i, count)}"
        for split, s in m["splits"].items():
            into = splits.setdefault(split, {"tokens": 0, "documents": 0, "shards": []})
            for shard in s["shards"]:
                file = f"{prefix}/{shard['file']}"
                try:
                    size = os.stat(Path(out) / file).st_size
                except OSError:
                    size = -1
                if size != shard["tokens"] * itemsize:
                    raise UserError(f"part {i} of {count}: shard {Path(out) / file} is missing or has "
                                    f"another size than its manifest says; run part {i} again")
                into["shards"].append(dict(shard, file=file))
            into["tokens"] += s["tokens"]
            into["documents"] += s["documents"]
        for src in m["sources"]:
            entry = sources.setdefault(src["input"], {"input": src["input"], "files": 0, "bytes": 0})
            entry.update({k: v for k, v in src.items() if k not in ("files", "bytes")})
            entry["files"] += src["files"]
            entry["bytes"] += src["bytes"]
        errors["replaced"] += m["errors"].get("replaced", 0)
        errors["skipped"] += m["errors"].get("skipped", 0)
    merged = {k: v for k, v in first.items() if k != "part"}
    merged.update(splits=splits, sources=list(sources.values()), errors=errors, parts=count)
    return merged


def merge(out: Path) -> dict[str, Any]:
    """Write ``out/manifest.json`` for the parts under ``out/parts``; returns the manifest."""
    out = Path(out)
    if not out.is_dir():
        raise UserError(f"{out}: no such directory (the --out of the parts)")
    lock = lock_dir(out, created=False)
    try:
        manifests = find_parts(out)
        merged = merged_manifest(out, manifests)
        opts = PrepareOptions(inputs=tuple(s["input"] for s in merged["sources"]), out=out,
                              val_fraction=merged["val_fraction"])
        check_not_empty(opts, {k: s["tokens"] for k, s in merged["splits"].items()})
        first = out / PARTS_DIR / part_name(0, len(manifests))
        for name in merged["tokenizer"]["files"]:  # the files the identity lists, next to the manifest
            blob = (first / name).read_bytes()
            target = out / name
            if not target.is_file() or target.read_bytes() != blob:
                atomic_write_bytes(target, blob)
        for stale in out.iterdir():  # a one-shot run's shards, made stale by the parts
            if SHARD_RE.match(stale.name):
                stale.unlink()
        atomic_write_text(out / MANIFEST_NAME, json.dumps(merged, indent=1) + "\n")
    finally:
        os.close(lock)
    return merged
