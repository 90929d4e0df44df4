"""``podtrain prepare merge DATA_DIR``: the parts of a ``--num-parts N`` prepare under one manifest.

Every part 0..N-1 must be there (``DATA_DIR/parts/IIIII-of-NNNNN/manifest.json``), once, made with
the same N from the same corpus, options and tokenizer; anything else is refused in one line
naming the part. The merged manifest lists each split's shards part by part (a shard's ``file`` is
relative to DATA_DIR, e.g. ``parts/00001-of-00004/train_00000.bin``), so a split is the one-shot
token stream. No shard is copied: merging costs a ``stat`` per shard. It is written last and
atomically (``podtrain.storage``: a folder or an ``s3://`` prefix); a re-run writes the same
manifest.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from podtrain.data.manifest import COUNTS_NAME, MANIFEST_NAME, decode_token_counts, encode_token_counts, \
    sum_token_counts
from podtrain.data.prepare.parts import PART_RE, part_name
from podtrain.data.prepare.output import lock_dir
from podtrain.data.prepare.pipeline import PrepareOptions, check_not_empty, skipped_note
from podtrain.data.prepare.shards import PARTS_DIR, SHARD_RE
from podtrain.errors import UserError
from podtrain.storage import NotFound, Store, open_store
from podtrain.storage.s3_client import sharing_s3_clients

# Must agree in every part (the corpus key covers inputs and options; these are checked by name
# so the refusal can say what differs).
SAME_IN_EVERY_PART = ("tokenizer", "dtype", "val_fraction", "text_field", "shard_tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``podtrain prepare merge``."""
    parser.add_argument("out", metavar="DATA_DIR",
                        help="the --out of the parts (holds parts/IIIII-of-NNNNN/): a folder or s3:// prefix")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``podtrain prepare merge``."""
    manifest = merge(args.out)
    splits = "; ".join(f"{k} {s['tokens']:,} tokens / {s['documents']:,} docs / {len(s['shards'])} shards"
                       for k, s in manifest["splits"].items())
    print(f"merged {manifest['parts']} parts into {open_store(args.out).where(MANIFEST_NAME)}: {splits}")
    return 0


def _read_part(store: Store, index: int, count: int) -> dict[str, Any]:
    name = f"{PARTS_DIR}/{part_name(index, count)}/{MANIFEST_NAME}"
    try:
        manifest = json.loads(store.read_bytes(name))
    except NotFound:
        raise UserError(f"part {index} of {count} has not finished ({store.where(name)} is missing): run it "
                        f"(--num-parts {count} --part {index}), then merge again") from None
    except ValueError as exc:
        raise UserError(f"part {index} of {count}: {store.where(name)} is unreadable ({exc})") from None
    got = manifest.get("part") if isinstance(manifest, dict) else None
    if not isinstance(got, dict) or (got.get("index"), got.get("count")) != (index, count):
        raise UserError(f"part {index} of {count}: {store.where(name)} says it is part "
                        f"{got and got.get('index')} of {got and got.get('count')} (a copied or duplicate "
                        f"folder?): remove it and run part {index} again")
    return manifest


def find_parts(store: Store) -> list[dict[str, Any]]:
    """The manifests of parts 0..N-1 under ``parts/``, checked to be complete and consistent."""
    root = store.where(PARTS_DIR)
    found = [(m, name) for d in store.list_dirs(PARTS_DIR) if (m := PART_RE.match(name := d.rsplit("/", 1)[-1]))]
    counts = sorted({int(m.group(2)) for m, _ in found})
    if not counts:
        raise UserError(f"{root}: no parts to merge (run `podtrain prepare ... --out {store.url} "
                        "--num-parts N --part I` for every I first)")
    if len(counts) > 1:
        groups = "; ".join(f"{n}: " + ", ".join(name for m, name in found if int(m.group(2)) == n) for n in counts)
        raise UserError(f"{root}: parts of different --num-parts ({groups}): remove those left over "
                        "from another run")
    count = counts[0]
    manifests = [_read_part(store, i, count) for i in range(count)]
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


def merged_manifest(store: Store, manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """One manifest for all parts: shards listed part by part, counts and sources summed."""
    first, count = manifests[0], len(manifests)
    itemsize = np.dtype(first["dtype"]).itemsize
    sizes = {e.name: e.size for e in store.list(PARTS_DIR + "/")}  # one listing, not a request per shard
    splits: dict[str, dict[str, Any]] = {}
    sources: dict[str, dict[str, Any]] = {}
    errors = {"policy": first["errors"]["policy"], "replaced": 0, "skipped": 0}
    for i, m in enumerate(manifests):
        prefix = f"{PARTS_DIR}/{part_name(i, count)}"
        for split, s in m["splits"].items():
            into = splits.setdefault(split, {"tokens": 0, "documents": 0, "shards": []})
            for shard in s["shards"]:
                file = f"{prefix}/{shard['file']}"
                if sizes.get(file) != shard["tokens"] * itemsize:
                    raise UserError(f"part {i} of {count}: shard {store.where(file)} is missing or has "
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


def merged_counts(store: Store, manifests: list[dict[str, Any]]) -> bytes | None:
    """The parts' token counts summed split by split (``token_counts.json`` of the whole), or
    None when a part has none (made before podtrain counted tokens)."""
    total: dict[str, np.ndarray] = {}
    for i, m in enumerate(manifests):
        if not m.get("token_counts"):
            return None
        name = f"{PARTS_DIR}/{part_name(i, len(manifests))}/{m['token_counts']}"
        try:
            counts = decode_token_counts(store.read_bytes(name))
        except (NotFound, ValueError, KeyError, TypeError):
            raise UserError(f"part {i} of {len(manifests)}: {store.where(name)} is missing or unreadable; "
                            f"run part {i} again") from None
        for split, c in counts.items():
            total[split] = sum_token_counts(total.get(split, np.zeros(0, dtype=np.int64)), c)
    return encode_token_counts(total, int(manifests[0]["tokenizer"]["vocab_size"]))


@sharing_s3_clients
def merge(out: str | Path) -> dict[str, Any]:
    """Write ``out/manifest.json`` for the parts under ``out/parts`` (a folder or ``s3://``
    prefix); returns the manifest."""
    store = open_store(out)
    local = Path(out) if store.is_local else None
    if local is not None and not local.is_dir():
        raise UserError(f"{out}: no such directory (the --out of the parts)")
    lock = lock_dir(local, created=False) if local is not None else None
    try:
        manifests = find_parts(store)
        merged = merged_manifest(store, manifests)
        opts = PrepareOptions(inputs=tuple(s["input"] for s in merged["sources"]), out=Path(str(out)),
                              val_fraction=merged["val_fraction"])
        check_not_empty(opts, {k: s["tokens"] for k, s in merged["splits"].items()},
                        skipped_note(merged["errors"], ""))
        first = f"{PARTS_DIR}/{part_name(0, len(manifests))}"
        for name in merged["tokenizer"]["files"]:  # the files the identity lists, next to the manifest
            blob = store.read_bytes(f"{first}/{name}")
            if not store.exists(name) or store.read_bytes(name) != blob:
                store.write_bytes(name, blob)
        for stale in store.list():  # a one-shot run's shards, made stale by the parts
            if SHARD_RE.match(stale.name):
                store.delete(stale.name)
        counts = merged_counts(store, manifests)
        if counts is None:  # a part prepared before podtrain counted tokens
            merged.pop("token_counts", None)
        else:
            store.write_bytes(COUNTS_NAME, counts)
            merged["token_counts"] = COUNTS_NAME
        store.write_bytes(MANIFEST_NAME, (json.dumps(merged, indent=1) + "\n").encode("utf-8"))
    finally:
        if lock is not None:
            os.close(lock)
    return merged
