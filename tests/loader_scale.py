"""A loader at corpus scale without the disk: sparse data directories, and what starting costs.

Used by tests/test_order.py and bench/order_scale.py (which puts tests/ on its path).
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

VOCAB = 257


def make_sparse_data_dir(root: Path, samples: int, seq_len: int, shards: int = 4) -> Path:
    """A ``podtrain prepare``-shaped directory whose train split holds exactly ``samples`` samples
    of ``seq_len`` tokens, in ``shards`` sparse files: each is truncated to its size without a
    byte written, so a 1e9-sample corpus takes no disk and reads as token 0. The manifest's
    sha256 fields are placeholders: ``data.verify`` would refuse it."""
    root.mkdir(parents=True, exist_ok=True)
    tokens = samples * seq_len + 1  # windows of seq_len + 1 overlap by one token
    per_shard = -(-tokens // shards)
    entries, left = [], tokens
    for i in range(shards):
        count = min(per_shard, left)
        left -= count
        name = f"train_{i:05d}.bin"
        with open(root / name, "wb") as fh:
            fh.truncate(count * 2)  # uint16 tokens
        entries.append({"file": name, "tokens": count, "documents": 1, "max_token_id": 0, "sha256": "0" * 64})
    manifest = {"format": "podtrain-shards/1", "dtype": "uint16",
                "splits": {"train": {"tokens": tokens, "documents": shards, "shards": entries}},
                "tokenizer": {"kind": "byte", "name": "byte", "vocab_size": VOCAB, "eos_id": VOCAB - 1,
                              "files": []}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS, VmHWM, VmData)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_rss_growth(fn) -> tuple[float, int]:
    """``(seconds, bytes)``: how long ``fn()`` took and how far this process's resident memory
    peaked above where it was when ``fn`` started (the kernel's high-water mark, reset first
    through ``/proc/self/clear_refs``; without that, the growth of the lifetime peak)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        resettable = True
    except OSError:
        resettable = False
    before = _status_kb("VmRSS") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    after = _status_kb("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return seconds, (after - before) * 1024


def cap_private_memory(extra_bytes: int) -> None:
    """Let this process allocate at most ``extra_bytes`` more private memory (RLIMIT_DATA; file
    mappings such as memory-mapped shards do not count): an O(samples) allocation fails at once
    with MemoryError instead of filling the machine. Call it in a forked child only."""
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    limit = _status_kb("VmData") * 1024 + extra_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
