"""On-disk layout of checkpoints, the manifest, and the choice of the checkpoint to resume from.

::

    CKPT_DIR/step_000123/              one checkpoint (the same layout for ddp, fsdp, hsdp, any world size)
        rank_00000.safetensors         rank 0's pieces: flat ranges of tensors (podtrain.ckpt.plan)
        rank_00001.safetensors         ... every rank that holds pieces writes its own file, in parallel
        meta_00000.json                rank 0's sidecar: its pieces (offset, range, block CRC-32s),
        meta_00001.json                its file's size, its RNG states (podtrain.ckpt.sidecar)
        state.safetensors              small tensors: scaler, train state
        state.json                     everything else, plain JSON: train state, optimizer
                                       hyperparameters by parameter name, tied-weight aliases
        config.json                    the transformers model config
        manifest.json                  written LAST by rank 0: the commit. O(tensors): each tensor's
                                       shape, dtype and split rule; the small files' sizes and
                                       CRC-32s; the ranks' files as a count and a total
    CKPT_DIR/latest                    "step_000123", written after the manifest (a hint)
    CKPT_DIR/abandoned/                checkpoints of a timeline a later save superseded

A step directory without ``manifest.json`` is a save that did not finish: never chosen, removed
by rank 0 at the next start (and at once when the save fails). Checkpoints are committed by the
manifest object rather than a directory rename, so the same protocol works on object storage.
Everything here runs on one process; the callers broadcast what it decides.

What the start and a save ask of the storage (one listing, no request per step directory or
per rank's file) is said by ``scan`` and ``apply_retention``, and in docs/checkpoints.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from podtrain.ckpt.store import NotFound, StorageError, open_store, read_json
from podtrain.storage import Entry
from podtrain.storage.errors import NoSuchBucket, Transient
from podtrain.errors import UserError

log = logging.getLogger("podtrain.checkpoint")

CKPT_SUBDIR = "ckpt"
LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = "podtrain-ckpt/3"
READABLE_FORMATS = (FORMAT, "podtrain-ckpt/2")
"""Formats a resume reads: /3 keeps each rank's pieces in its sidecar; /2 kept them in the manifest."""
OLD_FORMATS = {"podtrain-ckpt/1": "the podtrain-ckpt/1 layout (ckpt.format=safetensors/dcp/sharded)"}
ABANDONED = "abandoned"
STATE_FILE = "state.safetensors"
STATE_JSON = "state.json"
CONFIG_JSON = "config.json"
_STEP_RE = re.compile(r"^step_(\d{6,})$")
_RANK_FILE_RE = re.compile(r"^rank_\d{5,}\.safetensors$")
_SIDECAR_RE = re.compile(r"^meta_\d{5,}\.json$")
# Files a checkpoint may hold: safetensors and JSON only (both parsed without running code).
_ALLOWED = re.compile(r"^[A-Za-z0-9_.\-]+\.(?:safetensors|json)$")
_PICKLE_SUFFIXES = {".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".distcp", ".metadata", ".npy", ".npz"}
_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")


def step_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``."""
    return f"step_{step:06d}"


def rank_file(rank: int) -> str:
    """The piece file rank ``rank`` writes."""
    return f"rank_{rank:05d}.safetensors"


def parse_step(name: str) -> int | None:
    """The step of a ``step_NNNNNN`` directory name; None for anything else."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StepListing:
    """The step directories of a checkpoint location as one look at it found them (``scan``)."""

    steps: list[tuple[int, str]]
    """``(step, directory name)`` of every step directory, oldest first."""
    committed: list[tuple[int, str]]
    """Those holding a manifest (committed checkpoints), oldest first."""
    files: dict[str, list[Entry]] | None = None
    """S3: each step directory's files (names relative to the store, sizes); None on POSIX."""

    @property
    def unfinished(self) -> list[str]:
        """Step directories without a manifest: saves that did not finish."""
        done = {name for _, name in self.committed}
        return [name for _, name in self.steps if name not in done]

    def entries(self, name: str) -> list[Entry] | None:
        """Step directory ``name``'s files as listed (None: not listed, ask the store)."""
        return None if self.files is None else self.files.get(name, [])


def scan(store) -> StepListing:
    """The step directories of ``store`` and which are committed: on S3 one paged LIST of
    ``step_`` (the manifests are visible in it: no HEAD per directory); on POSIX a directory read
    and a stat of each manifest (no request; listing would stat every rank's file)."""
    if store.is_local:
        steps = step_dirs(store)
        return StepListing(steps, [(s, n) for s, n in steps if store.exists(f"{n}/{MANIFEST}")])
    files: dict[str, list[Entry]] = {}
    for entry in store.list("step_"):
        top, _, rest = entry.name.partition("/")
        if rest and parse_step(top) is not None:
            files.setdefault(top, []).append(entry)
    steps = sorted((parse_step(n), n) for n in files)
    committed = [(s, n) for s, n in steps if any(e.name == f"{n}/{MANIFEST}" for e in files[n])]
    return StepListing(steps, committed, files)


def committed_steps(store) -> list[tuple[int, str]]:
    """``(step, directory name)`` of every committed checkpoint (manifest present), oldest first
    (``scan``: one listing)."""
    return scan(store).committed


def list_checkpoints(root: str | Path) -> list[tuple[int, Path | str]]:
    """``(step, where)`` of every committed checkpoint under ``root`` (a directory: a Path; an
    ``s3://`` prefix: its URL), oldest first."""
    store = open_store(str(root))
    return [(step, Path(root) / name if store.is_local else f"{store.url}/{name}")
            for step, name in committed_steps(store)]


def ckpt_url(run_dir: str | Path, configured: str = "") -> str:
    """Where a run's durable checkpoints live: ``ckpt.dir`` when set, else ``RUN_DIR/ckpt``."""
    return configured or str(Path(run_dir) / CKPT_SUBDIR)


LINEAGE_FILE = "lineage.json"
"""``RUN_DIR/lineage.json``: the run's identity and checkpoint location (``podtrain.ckpt.lineage``)."""


def run_ckpt_url(run_dir: str | Path) -> str:
    """A run's checkpoint location: the one its ``RUN_DIR/lineage.json`` records (a run that
    shares a ``ckpt.dir`` keeps its checkpoints in a folder of its own there), else ``ckpt.dir``
    as its ``RUN_DIR/config.yaml`` records it, else ``RUN_DIR/ckpt``: what ``sample``,
    ``export``, ``eval``, ``ckpt.resume_from`` and the launcher read."""
    import yaml

    path = Path(run_dir) / LINEAGE_FILE
    try:  # absent, unreadable or damaged: the config's
        recorded = (read_json(None, str(path), path.read_bytes(), error=None) or {}).get("ckpt_url")
        if recorded:
            return str(recorded)
    except OSError:
        pass
    try:
        raw = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
        configured = str((raw.get("ckpt") or {}).get("dir") or "")
    except (OSError, yaml.YAMLError, AttributeError):
        configured = ""
    return ckpt_url(run_dir, configured)


def resolve_resume(resume: str, key: str = "ckpt.resume"):
    """A checkpoint path (``key``'s value: a directory or an ``s3://`` URL): ``(store, name)`` of a
    checkpoint (it holds a manifest), or ``(store, None)`` of a run/ckpt location holding checkpoints."""
    resume = resume.rstrip("/")
    if open_store(resume).exists(MANIFEST):
        parent, _, name = resume.rpartition("/")
        return open_store(parent or "."), name
    candidates = [f"{resume}/{CKPT_SUBDIR}", resume]
    if "://" not in resume:
        candidates.insert(0, run_ckpt_url(resume))
    for candidate in candidates:
        store = open_store(candidate)
        if committed_steps(store):
            return store, None
    raise UserError(f"{key}={resume}: neither a checkpoint (with {MANIFEST}) nor a run or "
                    "checkpoint directory holding checkpoints")


class UnsafeCheckpoint(UserError):
    """The checkpoint holds a file that would have to be unpickled: refused, never opened."""


def refuse_pickles(store, name: str, entries: list[Entry]) -> None:
    """Raise ``UnsafeCheckpoint`` when checkpoint ``name`` (``entries``: its files as listed) holds
    a pickle / torch.save file (only the first bytes of files other than .safetensors/.json are
    read, never unpickled)."""
    for entry in entries:
        rel = entry.name[len(name) + 1:]
        if _ALLOWED.match(rel):
            continue
        head = store.read_range(entry.name, 0, min(4, entry.size)) if entry.size else b""
        if os.path.splitext(rel)[1].lower() in _PICKLE_SUFFIXES or head.startswith(_PICKLE_MAGIC):
            raise UnsafeCheckpoint(
                f"checkpoint {store.url}/{name} holds {rel}, a pickle/torch.save file: podtrain never "
                "unpickles checkpoint files (unpickling can run arbitrary code); remove it or set ckpt.resume")


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """A manifest's bytes: compact JSON in the dict's order (parsing keeps the order, so the same
    bytes come back from a parsed manifest: what its CRC-32 is checked against)."""
    return json.dumps(manifest, separators=(",", ":")).encode()


def sealed_manifest(manifest: dict[str, Any]) -> bytes:
    """The bytes to write for ``manifest``: it with a ``crc32`` of itself last, so that a changed
    byte that still parses (a digit, a letter of a key) is found, like the sidecars' and data's."""
    return encode_manifest({**manifest, "crc32": zlib.crc32(encode_manifest(manifest))})


def read_manifest(store, name: str, size: int | None = None) -> dict[str, Any]:
    """Parse checkpoint ``name``'s manifest. ValueError says what is wrong (an unfinished save, a
    damaged manifest); an older podtrain layout is a one-line ``UserError`` naming it. ``size``:
    the manifest's listed size (S3: read with one GET, no HEAD)."""
    where = f"{name}/{MANIFEST}"
    try:  # one request: a range read at the listed size, else on S3 one GET (``read_bytes`` sends a HEAD first)
        if size is not None:
            raw = store.read_range(where, 0, size)
        else:
            raw = store.read_bytes(where) if store.is_local else store.read_versioned(where)[0]
    except NoSuchBucket:
        raise
    except (FileNotFoundError, NotFound):
        raise ValueError(NO_MANIFEST) from None
    manifest = read_json(store, where, raw)  # not JSON: a ValueError naming it (the scan skips it)
    if "crc32" in manifest:  # manifests before the CRC have none
        if manifest["crc32"] != zlib.crc32(encode_manifest({k: v for k, v in manifest.items() if k != "crc32"})):
            raise ValueError("manifest.json fails its CRC-32 check (damaged)")
        del manifest["crc32"]
    fmt = manifest.get("format")
    if fmt in OLD_FORMATS:
        raise UserError(f"checkpoint {store.url}/{name} has {OLD_FORMATS[fmt]}, which this podtrain no "
                        f"longer reads (it reads {FORMAT}): resume it with the podtrain that wrote it, "
                        "or start a new run.dir")
    if fmt not in READABLE_FORMATS or not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        raise ValueError(f"manifest.json is not a {FORMAT} manifest")
    for rel in manifest["files"]:
        if not _ALLOWED.match(rel):
            raise UnsafeCheckpoint(f"checkpoint {store.url}/{name} lists {rel!r}: only .safetensors and "
                                   ".json files are accepted (podtrain never unpickles checkpoint files)")
    return manifest


NO_MANIFEST = "no manifest.json (the save did not finish)"
"""``read_manifest``'s reason for a step directory without a manifest (an unfinished save)."""


def size_problem(name: str, manifest: dict[str, Any], entries: list[Entry]) -> str | None:
    """What is wrong with the sizes of the files the manifest lists (``entries``: checkpoint
    ``name``'s files as listed; no data read)."""
    sizes = {e.name[len(name) + 1:]: e.size for e in entries}
    for rel, rec in manifest["files"].items():
        if rel not in sizes:
            return f"{rel} is missing"
        if sizes[rel] != rec.get("bytes"):
            return f"{rel} has {sizes[rel]} bytes, the manifest says {rec.get('bytes')}"
    ranks = manifest.get("ranks")
    if ranks is not None:  # podtrain-ckpt/3: the ranks' files, as a count and a total
        for what, pattern, count, total in (("sidecars", _SIDECAR_RE, "sidecars", "sidecar_bytes"),
                                            ("piece files", _RANK_FILE_RE, "piece_files", "piece_bytes")):
            found = [size for rel, size in sizes.items() if pattern.match(rel)]
            if (len(found), sum(found)) != (ranks.get(count), ranks.get(total)):
                return (f"its {what} are {len(found)} file(s) of {sum(found)} bytes in all; the manifest "
                        f"says {ranks.get(count)} of {ranks.get(total)} bytes")
    return None


@dataclass
class Choice:
    """Which checkpoint to resume from (None: start fresh)."""

    name: str | None = None
    manifest: dict[str, Any] | None = None

    @property
    def step(self) -> int | None:
        """The chosen checkpoint's step."""
        return None if self.manifest is None else int(self.manifest["step"])


def check(store, name: str, listing: StepListing | None = None) -> tuple[dict[str, Any] | None, str]:
    """``(manifest, "")`` when checkpoint ``name`` is committed with every file at its size, else
    ``(None, reason)``. Reads the manifest (at its listed size) and one listing of the directory
    (``listing``'s, when it has the files): cheap at any checkpoint size (the data's checksums are
    verified by each rank as it loads its share)."""
    entries = listing.entries(name) if listing is not None else None
    if entries is None:
        entries = store.list(name + "/")  # one listing: the pickle check, the manifest's and files' sizes
    refuse_pickles(store, name, entries)
    try:
        manifest = read_manifest(store, name, next((e.size for e in entries if e.name == f"{name}/{MANIFEST}"), None))
    except ValueError as exc:
        return None, str(exc)
    problem = size_problem(name, manifest, entries)
    return (None, problem) if problem else (manifest, "")


def find_latest(store, exclude: set[str] = frozenset(), lineage: str | None = None,
                skip_unsafe: bool = False, listing: StepListing | None = None) -> Choice:
    """The newest committed checkpoint whose files have their sizes (``exclude``: names that
    failed to load; ``lineage``: only that run's); warns naming each one skipped. A checkpoint
    holding a pickle file is refused (``UnsafeCheckpoint``), or with ``skip_unsafe`` (a training
    run's resume: a stray file must not stop the job) skipped like a damaged one. The newest by step wins over
    ``latest``: a kill between the manifest and the pointer leaves the pointer one behind.
    ``listing``: the store's ``scan`` when the caller has one (else one is made here); an unfinished
    save (no manifest) is passed over in silence: it is removed at the start."""
    choice = Choice()
    listing = listing if listing is not None else scan(store)
    for _, name in reversed(listing.committed):
        if name in exclude:  # it failed to load
            continue
        try:
            manifest, reason = check(store, name, listing)
        except UnsafeCheckpoint as exc:
            if not skip_unsafe:
                raise
            manifest, reason = None, str(exc)
        if manifest is not None and lineage is not None:
            other = checkpoint_lineage(store, name, manifest)
            if other not in (None, lineage):
                manifest, reason = None, f"it belongs to another run (lineage {other}, not {lineage})"
        if manifest is not None:
            choice.name, choice.manifest = name, manifest
            return choice
        if reason.startswith("no manifest"):
            continue  # an unfinished save (removed at the start): not worth a warning
        log.warning("skipping checkpoint %s/%s: %s", store.url, name, reason)
    return choice


class Housekeeping:
    """The one way checkpoint files are deleted. Best effort (the default: retention, the clean-up
    of unfinished saves, a failed save's leftovers): a storage that refuses a delete (a bucket with
    object lock or without ``s3:DeleteObject``, an outage, a full disk) is a warning, said once per
    store and kind of failure for the life of this object (one per writer), and the caller goes on.
    ``strict``: the refusal is raised instead (a save's own clearing, whose failure fails the save)."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._said: set[tuple[str, str]] = set()
        self.known: dict[tuple[str, str], tuple[bool, str | None]] = {}
        """``(store url, step directory)`` -> ``(committed, lineage)`` of the step directories
        retention has read or this writer committed: a later save reads none of them again (a
        checkpoint only this job writes or deletes while it holds the run's lease)."""

    def attempt(self, store, what: str, fn: Callable[..., Any], *args) -> bool:
        """``fn(*args)``; False (and a warning the first time) when the storage refused it."""
        try:
            fn(*args)
            return True
        except (StorageError, OSError) as exc:
            if self.strict:
                raise
            key = (str(store.url), type(exc).__name__)
            if key not in self._said:
                self._said.add(key)
                log.warning("could not %s in %s: %s; training goes on (checkpoints this run cannot delete "
                            "stay; this is said once per kind of failure)", what, store.url, exc)
            return False

    def remove(self, store, name: str, first=(MANIFEST,), rest=("",)) -> bool:
        """Delete in folder ``name`` the files ``first``, in order (a commit: once it is gone a kill
        mid-way leaves an unfinished save, never a committed one with files missing), then every
        file whose name starts with one of ``rest`` (``""``: all the rest), then the folder and its
        parents in ``name`` once empty (POSIX). The defaults remove a checkpoint. False when a file
        of ``first`` could not be deleted (it may still stand: nothing after it is tried)."""
        self.known.pop((str(store.url), name), None)  # whatever is left of it is read again
        for rel in first:
            if not self.attempt(store, f"delete {name}/{rel}", store.delete, f"{name}/{rel}"):
                return False
        for rel in rest:
            self.attempt(store, f"delete the files of {name}", store.delete_prefix, f"{name}/{rel}")
        parts = name.split("/")
        for depth in range(len(parts), 0, -1):  # a folder another rank still writes into stays
            path = store.local_path("/".join(parts[:depth]))
            try:
                if path is None:  # S3: no folders
                    break
                path.rmdir()
            except FileNotFoundError:  # gone already (delete_prefix removes the folders it empties)
                continue
            except OSError:  # not empty: its parents are not either
                break
        return True


def retention_plan(steps: list[int], current: int, keep_last: int, keep_every: int,
                   mine: Callable[[int], bool] | None = None) -> tuple[list[int], list[int]]:
    """Which complete checkpoints to delete and which to move aside, after saving ``current``.

    Keep the newest ``keep_last`` (0: all) at or below ``current``, every multiple of
    ``keep_every`` (0: none), and ``current``. Steps above ``current`` belong to a timeline this run
    left (resume=never or an explicit older checkpoint): they are moved aside, not deleted, so
    "newest" means this run's newest again. Only the steps ``mine`` says are this run's count and
    are touched (None: all are); it is asked lazily, newest first, only where the plan depends on
    the answer (a step kept whoever wrote it is not asked, nor ``current``): each answer may be a
    storage read. Pure otherwise: returns ``(delete, abandon)``, each oldest first.
    """
    ours = mine if mine is not None else (lambda step: True)
    abandon = [s for s in sorted(steps) if s > current and ours(s)]
    delete, kept = [], 0
    for step in sorted((s for s in steps if s <= current), reverse=True):
        if keep_last <= 0:
            break  # every step at or below current is kept
        if step == current or kept < keep_last:  # inside the newest keep_last of this run's
            if step == current or ours(step):
                kept += 1
        elif not (keep_every > 0 and step % keep_every == 0) and ours(step):
            delete.append(step)
    return sorted(delete), abandon


def apply_retention(store, current: int, keep_last: int, keep_every: int, lineage: str | None,
                    tidy: Housekeeping) -> None:
    """Carry out ``retention_plan`` after saving ``current`` over the checkpoints of ``lineage``
    (None: all): delete, or move to ``abandoned/`` (a rename on a POSIX store; on S3, deleted
    with a warning: S3 has no rename, and a copy through the client would move every byte through
    this node; a bucket with versioning keeps them recoverable). The step directories come from
    one listing of them alone (``step_dirs``: not their files); whether one is committed and whose
    it is (its manifest: one GET) is read only where the plan depends on it and only once per
    ``tidy`` (``Housekeeping.known``): at a save that is no read at all once the writer has seen
    its window; a deleted checkpoint costs its manifest's DELETE, one listing of its files and
    DeleteObjects batches of 1,000 keys (``Store.delete_prefix``). Every delete is best effort
    (``tidy``): a refused one is a warning, and ``current`` is never touched."""
    steps = [s for s, _ in step_dirs(store)]
    tidy.known[(str(store.url), step_name(current))] = (True, lineage)  # committed just now, by this run

    def mine(step: int) -> bool:
        committed, whose = _whose(store, step_name(step), tidy)
        # an unfinished save is nobody's checkpoint (removed at the next start); another run's
        # checkpoints (those from before lineages count as this run's) are never touched
        return committed and (lineage is None or whose in (None, lineage))

    delete, abandon = retention_plan(steps, current, keep_last, keep_every, mine)
    for step in abandon:
        src = store.local_path(step_name(step))
        if src is None:
            log.warning("deleting %s/%s (newer than this run's step %d, from an earlier timeline)",
                        store.url, step_name(step), current)
            tidy.remove(store, step_name(step))
            continue
        dst = src.parent / ABANDONED / f"{src.name}-{uuid.uuid4().hex[:6]}"
        log.warning("moving %s (newer than this run's step %d, from an earlier timeline) to %s",
                    src, current, dst)
        tidy.known.pop((str(store.url), step_name(step)), None)
        tidy.attempt(store, f"move {src.name} aside", lambda: (dst.parent.mkdir(exist_ok=True), os.rename(src, dst)))
    for step in delete:
        if step != current:  # retention_plan never names it: kept explicit, the newest is never deleted here
            tidy.remove(store, step_name(step))


def step_dirs(store) -> list[tuple[int, str]]:
    """``(step, directory name)`` of every step directory, oldest first, from one listing of the
    directories alone (S3: a LIST with ``Delimiter='/'``, a page per 1,000 directories; POSIX: one
    directory read): committed or not, without a request per directory or per file."""
    return sorted((s, n) for n in store.list_dirs("") if (s := parse_step(n)) is not None)


def _whose(store, name: str, tidy: Housekeeping) -> tuple[bool, str | None]:
    """``(committed, lineage)`` of step directory ``name``: ``tidy.known``'s, else read from its
    manifest (one GET) and remembered there. A damaged
    manifest counts as a committed checkpoint of no known lineage (as a ``scan`` lists it); a
    storage outage is raised (retention waits for the next save)."""
    key = (str(store.url), name)
    if key not in tidy.known:
        try:
            answer = (True, checkpoint_lineage(store, name, read_manifest(store, name)))
        except ValueError as exc:
            answer = (str(exc) != NO_MANIFEST, None)
        tidy.known[key] = answer
    return tidy.known[key]


def checkpoint_lineage(store, name: str, manifest: dict[str, Any]) -> str | None:
    """The run (lineage, ``podtrain.ckpt.lineage``) checkpoint ``name`` belongs to: the manifest's,
    else (a checkpoint written before lineages) the ``run_id`` its ``state.json`` train state
    kept (a plain string there), else None. A storage outage is raised: never a reason to skip."""
    if manifest.get("lineage"):
        return str(manifest["lineage"])
    try:
        state = read_json(store, f"{name}/{STATE_JSON}", error=None, missing=None) or {}
        run_id = (state.get("train_state") or {}).get("run_id")
    except Transient:
        raise
    except (AttributeError, StorageError, OSError):
        return None
    return str(run_id) if isinstance(run_id, str) and run_id else None


def write_latest(store, name: str) -> None:
    """Point ``latest`` at checkpoint ``name`` (after its manifest)."""
    store.write_bytes(LATEST, (name + "\n").encode())
