"""Hand-made data directories for loader tests (independent of `podtrain prepare`)."""

import hashlib
import json
from pathlib import Path

import numpy as np


def make_data_dir(root: Path, shard_tokens=(1000, 777, 1500), val_tokens=400, vocab=257) -> Path:
    """Shards whose token at global position p is p % (vocab - 1): every window is recognisable."""
    root.mkdir(parents=True, exist_ok=True)
    splits, pos = {}, 0
    for split, sizes in (("train", shard_tokens), ("val", (val_tokens,))):
        shards = []
        for i, n in enumerate(sizes):
            arr = (np.arange(pos, pos + n) % (vocab - 1)).astype(np.uint16)
            pos += n
            name = f"{split}_{i:05d}.bin"
            arr.tofile(root / name)
            shards.append({"file": name, "tokens": n, "documents": 1, "max_token_id": int(arr.max()),
                           "sha256": hashlib.sha256(arr.tobytes()).hexdigest()})
        splits[split] = {"tokens": sum(sizes), "documents": len(sizes), "shards": shards}
    manifest = {"format": "podtrain-shards/1", "dtype": "uint16", "splits": splits,
                "tokenizer": {"kind": "byte", "name": "byte", "vocab_size": vocab, "eos_id": vocab - 1,
                              "files": []}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root
