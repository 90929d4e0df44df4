"""On-disk layout of checkpoints, the manifest, validation, and the choice of the newest valid one.

::

    RUN_DIR/ckpt/step_000123/        one complete checkpoint (renamed into place when finished)
        model.safetensors            weights, unwrapped names, tied copies stored once
        state.safetensors            optimizer tensors, RNG tensors of every rank
        state.json                   everything else, plain JSON (see ``podtrain.ckpt.checkpointer``)
        config.json                  the transformers model config
        dcp/*.safetensors            (format=dcp, or any fsdp/hsdp run) shards written by every
                                     rank instead of the two .safetensors files above
        manifest.json                written last: size and SHA-256 of every file above
    RUN_DIR/ckpt/latest              "step_000123": the newest complete checkpoint (a hint)
    RUN_DIR/ckpt/.tmp-step_000124-*  a save in progress (never chosen; removed at the next start)
    RUN_DIR/ckpt/abandoned/          checkpoints from a timeline a later save superseded

Everything here runs on one process (rank 0 in a job); the callers broadcast what it decides.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podtrain.errors import UserError
from podtrain.fsutil import sha256_file

log = logging.getLogger("podtrain.checkpoint")

CKPT_SUBDIR = "ckpt"
LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = "podtrain-ckpt/1"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
ABANDONED = "abandoned"
# The files of one checkpoint directory (see the tree above).
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
STATE_JSON = "state.json"
CONFIG_JSON = "config.json"
DCP_SUBDIR = "dcp"
# The manifest "layout" of an FSDP/HSDP checkpoint: dcp/ holds every rank's pieces (ckpt/sharded.py).
SHARDED = "sharded"
_STEP_RE = re.compile(r"^step_(\d{6,})$")
# Files a checkpoint may list: safetensors and JSON only (both parsed without running code).
_ALLOWED = re.compile(r"^(?:dcp/)?[A-Za-z0-9_.\-]+\.(?:safetensors|json)$")
# What a pickle-based checkpoint looks like: these suffixes, or pickle / torch.save zip magic.
_PICKLE_SUFFIXES = {".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".distcp", ".metadata", ".npy", ".npz"}
_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")


def step_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``."""
    return f"step_{step:06d}"


def parse_step(name: str) -> int | None:
    """The step of a ``step_NNNNNN`` directory name; None for anything else (temp names)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_*`` directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = parse_step(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found)


class UnsafeCheckpoint(UserError):
    """The checkpoint holds a file that would have to be unpickled: refused, never opened."""


@dataclass
class Verdict:
    """Outcome of validating one checkpoint directory."""

    path: Path
    ok: bool
    reason: str = ""
    manifest: dict[str, Any] | None = None


def refuse_pickles(path: Path) -> None:
    """Raise ``UnsafeCheckpoint`` when ``path`` holds a pickle / torch.save file.

    Only the first bytes are read (never unpickled). safetensors and JSON files are exempt: their
    first byte is a length or text, and they are parsed without running code.
    """
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        if _ALLOWED.match(rel):
            continue
        with open(f, "rb") as fh:
            head = fh.read(4)
        if f.suffix.lower() in _PICKLE_SUFFIXES or head.startswith(_PICKLE_MAGIC):
            raise UnsafeCheckpoint(
                f"checkpoint {path} holds {rel}, a pickle/torch.save file: podtrain never unpickles "
                "checkpoint files (unpickling can run arbitrary code); remove it or set ckpt.resume")


def read_manifest(path: Path) -> dict[str, Any]:
    """Parse and sanity-check ``path/manifest.json``; ValueError says what is wrong."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ValueError("no manifest.json (the save did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"manifest.json is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"manifest.json has an unknown format (expected {FORMAT!r})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError("manifest.json lists no files")
    for rel in files:
        if not _ALLOWED.match(rel):
            raise UnsafeCheckpoint(
                f"checkpoint {path} lists {rel!r}: only .safetensors and .json files are accepted "
                "(podtrain never unpickles checkpoint files: unpickling can run arbitrary code)")
    return manifest


def verify(path: Path) -> Verdict:
    """Check a checkpoint: manifest present, every listed file present with its size and SHA-256.

    Pickle files raise ``UnsafeCheckpoint`` instead of giving a verdict: such a directory was not
    written by podtrain and must not be silently passed over either.
    """
    refuse_pickles(path)
    try:
        manifest = read_manifest(path)
    except UnsafeCheckpoint:
        raise
    except ValueError as exc:
        return Verdict(path, False, str(exc))
    problem = file_problem(path, manifest)
    if problem:
        return Verdict(path, False, problem)
    return Verdict(path, True, manifest=manifest)


def file_problem(path: Path, manifest: dict[str, Any]) -> str | None:
    """What is wrong with the files ``manifest`` lists under ``path`` (presence, size, SHA-256)."""
    for rel, rec in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size != rec.get("bytes"):
            return f"{rel} has {size} bytes, the manifest says {rec.get('bytes')}"
        if sha256_file(f) != rec.get("sha256"):
            return f"{rel} fails its SHA-256 check (corrupted)"
    return None


def check_files(path: Path, manifest: dict[str, Any]) -> None:
    """Raise ``UserError`` unless this process reads the files ``manifest`` (another rank's) lists
    with their SHA-256. Only reads are trusted: metadata queries (exists, is_file) of a shared file
    system can be stale where the data is not."""
    problem = None
    for rel, rec in manifest["files"].items():
        try:
            if sha256_file(path / rel) != rec.get("sha256"):
                problem = f"{rel} fails its SHA-256 check"
        except FileNotFoundError:
            problem = f"{rel} is missing"
        if problem:
            break
    if problem:
        raise UserError(f"checkpoint {path} as seen from this host: {problem} (a stale or "
                        "different view of the shared storage than rank 0's?)")


@dataclass
class Choice:
    """Which checkpoint to resume from (None: start fresh) and which ones were passed over."""

    path: Path | None = None
    manifest: dict[str, Any] | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def step(self) -> int | None:
        """The chosen checkpoint's step."""
        return None if self.manifest is None else int(self.manifest["step"])


def find_latest_valid(root: Path) -> Choice:
    """The newest complete, checksum-valid checkpoint under ``root``; warns naming each skipped one.

    The newest by step wins over ``latest``: a kill between the rename and the pointer update
    leaves the pointer one behind, and the renamed directory is complete.
    """
    choice = Choice()
    for _, path in reversed(list_checkpoints(root)):
        verdict = verify(path)
        if verdict.ok:
            choice.path, choice.manifest = path, verdict.manifest
            return choice
        log.warning("skipping checkpoint %s: %s", path, verdict.reason)
        choice.skipped.append((str(path), verdict.reason))
    return choice


def resolve_resume(run_dir: Path, resume: str) -> Choice:
    """Apply ``ckpt.resume``: auto (newest valid in the run), never, or an explicit path."""
    root = run_dir / CKPT_SUBDIR
    if resume == "never":
        if list_checkpoints(root):
            log.warning("ckpt.resume=never: starting fresh although %s holds checkpoints "
                        "(later saves move newer ones to %s/)", root, ABANDONED)
        return Choice()
    if resume == "auto":
        return find_latest_valid(root)
    path = Path(resume)
    if (path / MANIFEST).is_file():
        verdict = verify(path)
        if not verdict.ok:
            raise UserError(f"ckpt.resume={resume}: checkpoint is not usable: {verdict.reason}")
        return Choice(path=path, manifest=verdict.manifest)
    for candidate in (path / CKPT_SUBDIR, path):
        if list_checkpoints(candidate):
            choice = find_latest_valid(candidate)
            if choice.path is None:
                raise UserError(f"ckpt.resume={resume}: no valid checkpoint in {candidate}")
            return choice
    raise UserError(f"ckpt.resume={resume}: neither a checkpoint directory (with {MANIFEST}) "
                    "nor a run directory holding checkpoints")


def remove_tree(path: Path) -> None:
    """Delete a directory so it vanishes at once: rename to a trash name, then remove."""
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clean_stale(root: Path) -> list[str]:
    """Remove temporary and trash directories left by a killed save or deletion."""
    removed = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def retention_plan(steps: list[int], current: int, keep_last: int, keep_every: int) -> tuple[list[int], list[int]]:
    """Which complete checkpoints to delete and which to move aside, after saving ``current``.

    Keep the newest ``keep_last`` (0: all) at or below ``current``, every multiple of
    ``keep_every`` (0: none), and ``current``. Steps above ``current`` belong to a timeline this run
    left (resume=never or an explicit older checkpoint): they are moved aside, not deleted, so
    "newest" means this run's newest again. Pure: returns ``(delete, abandon)``.
    """
    abandon = [s for s in steps if s > current]
    mine = sorted(s for s in steps if s <= current)
    keep = set(mine[-keep_last:]) if keep_last > 0 else set(mine)
    if keep_every > 0:
        keep |= {s for s in mine if s % keep_every == 0}
    keep.add(current)
    return [s for s in mine if s not in keep], abandon


def apply_retention(root: Path, current: int, keep_last: int, keep_every: int) -> None:
    """Carry out ``retention_plan`` after saving ``current``: delete, or move to ``abandoned/``."""
    complete = [s for s, p in list_checkpoints(root) if (p / MANIFEST).is_file()]
    delete, abandon = retention_plan(complete, current, keep_last, keep_every)
    for step in abandon:
        src = root / step_name(step)
        dst = root / ABANDONED / f"{src.name}-{uuid.uuid4().hex[:6]}"
        dst.parent.mkdir(exist_ok=True)
        log.warning("moving %s (newer than this run's step %d, from an earlier timeline) to %s",
                    src, current, dst)
        os.rename(src, dst)
    for step in delete:
        remove_tree(root / step_name(step))
