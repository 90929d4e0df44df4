"""Shard output of ``podtrain prepare``: writing, the done records a resume trusts, and cleanup.

Every finished shard gets a done record (``DATA_DIR/.prepare/SPLIT_NNNNN.json``) keyed by the
run key (a fingerprint of the inputs and options) and saying where in the task stream the next
shard begins. A re-run with the same key verifies the finished shards' checksums, keeps them and
restarts the stream where the first unfinished shard begins.

Nothing is half-written: a shard is streamed into a temporary file and renamed when full, every
other file goes through ``fsutil.atomic_write_*``.

Each writer also counts the ids it writes (``ShardWriter.counts``, O(vocabulary)): the writer
thread sees every token of a split once, in order, whatever the number of tokenizing workers, so
the counts are exact. A resumed run counts the shards it keeps while it checks their checksums
(the same read), so the counts of a finished split are its shards' whatever the interruptions.
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from podtrain.data.manifest import COUNTS_NAME, FORMAT, MANIFEST_NAME, add_token_counts, \
    sum_token_counts
from podtrain.data.tokenizer import TOKENIZER_DIR
from podtrain.fsutil import atomic_write_text, open_temp, publish_temp, sha256_file

STATE_DIR = ".prepare"
RUN_STATE = "run.json"
PARTS_DIR = "parts"  # DATA_DIR/parts/IIIII-of-NNNNN/: the parts of a --num-parts prepare (see parts)
SHARD_RE = re.compile(r"^(train|val)_(\d{5})\.bin$")


def shard_name(split: str, index: int) -> str:
    """File name of shard ``index`` of ``split``."""
    return f"{split}_{index:05d}.bin"


def _record_path(out: Path, split: str, index: int) -> Path:
    return out / STATE_DIR / f"{split}_{index:05d}.json"


class ShardWriter:
    """Streams one split's tokens into fixed-size shards; each full shard is renamed into place
    and gets a done record saying where in the task stream the next shard begins."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int, key: str,
                 done: list[dict[str, Any]], resume_task: int, resume_skip: int, complete: bool,
                 counts: np.ndarray | None = None) -> None:
        """Continue after the ``done`` shards (their records; ``counts``: their token counts by id),
        skipping stream tokens before (``resume_task``, ``resume_skip``)."""
        self.out, self.split, self.dtype = out, split, dtype
        self.shard_tokens, self.key = shard_tokens, key
        self.records = list(done)
        self.resume_task, self.resume_skip, self.complete = resume_task, resume_skip, complete
        self.written = 0
        self.counts = np.zeros(0, dtype=np.int64) if counts is None else counts
        """How often each id occurs in the split's shards (finished and in progress)."""
        self._fh: Any = None
        self._tmp: Path | None = None
        self._fill = 0
        self._digest: Any = None
        self._max = 0
        self._eos_count = 0

    def _open(self) -> None:
        self._fh, self._tmp = open_temp(self.out / shard_name(self.split, len(self.records)))
        self._fill, self._digest, self._max, self._eos_count = 0, hashlib.sha256(), 0, 0

    def write(self, task_index: int, tokens: np.ndarray, eos_id: int,
              errors_before: dict[str, int]) -> None:
        """Append task ``task_index``'s tokens for this split (tasks arrive in order)."""
        if self.complete or task_index < self.resume_task:
            return
        pos = self.resume_skip if task_index == self.resume_task else 0
        while pos < tokens.size:
            if self._fh is None:
                self._open()
            take = min(self.shard_tokens - self._fill, tokens.size - pos)
            part = tokens[pos:pos + take]
            blob = memoryview(part).cast("B")  # no copy: file and hash read the array's buffer
            self._fh.write(blob)
            self._digest.update(blob)
            self._max = max(self._max, int(part.max()))
            self._eos_count += int(np.count_nonzero(part == eos_id))
            self.counts = add_token_counts(self.counts, part)
            self._fill += take
            pos += take
            if self._fill == self.shard_tokens:
                self._finish(task_index, pos, errors_before, last=False)

    def _finish(self, next_task: int, skip: int, errors_before: dict[str, int], last: bool) -> None:
        fh, tmp = self._fh, self._tmp
        assert fh is not None and tmp is not None
        name = shard_name(self.split, len(self.records))
        publish_temp(fh, tmp, self.out / name)
        self._fh = self._tmp = None
        rec = {"key": self.key, "file": name, "tokens": self._fill, "documents": self._eos_count,
               "sha256": self._digest.hexdigest(), "max_token_id": self._max,
               "next_task": next_task, "skip": skip, "errors_before": dict(errors_before), "last": last}
        atomic_write_text(_record_path(self.out, self.split, len(self.records)), json.dumps(rec))
        self.records.append(rec)
        self.written += 1

    def close(self, n_tasks: int, errors_total: dict[str, int]) -> None:
        """Write the partial last shard and mark the split complete."""
        if self.complete:
            return
        if self._fh is not None:
            self._finish(n_tasks, 0, errors_total, last=True)
        elif self.records and not self.records[-1]["last"]:
            # The stream ended exactly on a shard boundary: re-mark the last full shard as last.
            rec = dict(self.records[-1], last=True, next_task=n_tasks, skip=0, errors_before=errors_total)
            atomic_write_text(_record_path(self.out, self.split, len(self.records) - 1), json.dumps(rec))
            self.records[-1] = rec
        self.complete = True

    def abort(self) -> None:
        """Drop the shard in progress (its temporary file)."""
        if self._fh is not None:
            self._fh.close()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
        self._fh = self._tmp = None

    def tokens(self) -> int:
        """Tokens in this split's finished shards."""
        return sum(r["tokens"] for r in self.records)


class WriterThread:
    """Runs the shard writers on one thread, in task order, so writing, hashing and fsync overlap
    the tokenizing (file writes, sha256 and numpy copies release the GIL)."""

    def __init__(self, writers: dict[str, ShardWriter], eos_id: int, depth: int) -> None:
        """Start the thread; at most ``depth`` results wait for it (bounded memory)."""
        self.writers, self.eos_id = writers, eos_id
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="podtrain-prepare-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue  # keep draining so a blocked put() in the main thread returns
            index, train, val, before = item
            try:
                self.writers["train"].write(index, train, self.eos_id, before)
                if "val" in self.writers:
                    self.writers["val"].write(index, val, self.eos_id, before)
            except BaseException as exc:  # re-raised in the main thread, which owns the run
                self.error = exc

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, index: int, train: np.ndarray, val: np.ndarray, before: dict[str, int]) -> None:
        """Queue one task's tokens; raises what the thread hit earlier."""
        self._raise()
        self.queue.put((index, train, val, before))

    def stop(self) -> None:
        """Wait for every queued write to finish (the writers are the main thread's again)."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()

    def finish(self) -> None:
        """``stop`` and raise what the thread hit, if anything."""
        self.stop()
        self._raise()


# ------------------------------------------------------------------------- state and cleanup


def remove_temp_files(out: Path) -> None:
    """Temporary files left by a killed run (``fsutil.open_temp`` names: '.' ... '.tmp')."""
    for folder in (out, out / STATE_DIR, out / TOKENIZER_DIR):
        if folder.is_dir():
            for p in folder.glob(".*.tmp"):
                p.unlink(missing_ok=True)


def clean_outputs(out: Path) -> None:
    """Remove every file ``prepare`` writes in ``out`` (manifest first, so the directory never
    looks complete); files that are not ours are left alone."""
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    (out / COUNTS_NAME).unlink(missing_ok=True)
    if out.is_dir():
        for p in out.iterdir():
            if SHARD_RE.match(p.name):
                p.unlink(missing_ok=True)
    for sub in (STATE_DIR, TOKENIZER_DIR, PARTS_DIR):
        if (out / sub).is_dir():
            shutil.rmtree(out / sub)
    remove_temp_files(out)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_run_state(out: Path) -> dict[str, Any] | None:
    """The run key and tokenizer identity of the last run into ``out``; ``None`` if unreadable."""
    return _read_json(out / STATE_DIR / RUN_STATE)


def write_run_state(out: Path, key: str, identity: dict[str, Any]) -> None:
    """Record the run key and tokenizer identity, so an interrupted run can reuse the tokenizer."""
    atomic_write_text(out / STATE_DIR / RUN_STATE, json.dumps({"key": key, "tokenizer": identity}))


COUNT_CHUNK = 1 << 22  # bytes read at a time when a kept shard is hashed and counted


def _shard_ok(out: Path, rec: dict[str, Any], itemsize: int, tally: "SplitResume | None" = None) -> bool:
    """Whether the shard of done record ``rec`` is whole (size and SHA-256); with ``tally``, its
    ids are counted in the same read and added to ``tally.counts`` when it is."""
    path = out / rec["file"]
    try:
        if path.stat().st_size != rec["tokens"] * itemsize:
            return False
    except OSError:
        return False
    if tally is None:
        return sha256_file(path) == rec["sha256"]
    dtype = np.dtype(f"<u{itemsize}")
    digest, counts = hashlib.sha256(), np.zeros(0, dtype=np.int64)
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(COUNT_CHUNK):  # a multiple of the item size (checked above)
                digest.update(chunk)
                counts = add_token_counts(counts, np.frombuffer(chunk, dtype=dtype))
    except OSError:
        return False
    if digest.hexdigest() != rec["sha256"]:
        return False
    tally.counts = sum_token_counts(tally.counts, counts)  # only once the shard is known whole
    return True


def up_to_date_manifest(out: Path, key: str, state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The manifest of a finished run with this ``key`` whose shards all check out, else ``None``."""
    if state is None or state.get("key") != key:
        return None
    manifest = _read_json(out / MANIFEST_NAME)
    if manifest is None or manifest.get("format") != FORMAT:
        return None
    if not manifest.get("token_counts") or not (out / manifest["token_counts"]).is_file():
        return None  # made before podtrain counted tokens: resumed, its shards are counted (not remade)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            if not _shard_ok(out, {"file": shard["file"], "tokens": shard["tokens"],
                                   "sha256": shard["sha256"]}, itemsize):
                return None
    return manifest


@dataclass
class SplitResume:
    """Where a split's stream restarts: after ``done`` shards, at (``task``, ``skip``)."""

    done: list[dict[str, Any]] = field(default_factory=list)
    task: int = 0
    skip: int = 0
    errors_before: dict[str, int] = field(default_factory=lambda: {"replaced": 0, "skipped": 0})
    complete: bool = False
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Token counts by id of the ``done`` shards."""


def _resume_split(out: Path, split: str, key: str, itemsize: int) -> SplitResume:
    res = SplitResume()
    index = 0
    while True:
        rec = _read_json(_record_path(out, split, index))
        if rec is None or rec.get("key") != key or rec.get("file") != shard_name(split, index) \
                or not _shard_ok(out, rec, itemsize, tally=res):
            break
        res.done.append(rec)
        res.task, res.skip, res.errors_before = rec["next_task"], rec["skip"], rec["errors_before"]
        index += 1
        if rec["last"]:
            res.complete = True
            break
    # Anything after the valid prefix is stale: drop it so the directory matches the records.
    for p in list(out.glob(f"{split}_*.bin")) + list((out / STATE_DIR).glob(f"{split}_*.json")):
        m = re.match(rf"^{split}_(\d{{5}})\.(bin|json)$", p.name)
        if m and int(m.group(1)) >= index:
            p.unlink(missing_ok=True)
    return res


def resume_splits(out: Path, splits: list[str], key: str, itemsize: int) -> dict[str, SplitResume]:
    """Each split's restart point from its valid done records; stale shards and records removed."""
    return {s: _resume_split(out, s, key, itemsize) for s in splits}


def earliest(resumes: dict[str, SplitResume]) -> SplitResume:
    """The split whose stream restarts first: the whole run restarts at its task."""
    open_ = [r for r in resumes.values() if not r.complete]
    return min(open_ or list(resumes.values()), key=lambda r: r.task)
