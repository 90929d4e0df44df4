"""Run identity: which checkpoints are this run's, and where its own go.

Teams start dozens of runs from one base YAML against one shared ``ckpt.dir`` and one
``ckpt.local_dir``. A run must never resume, prune or clean up another run's checkpoints, so each
run has a **lineage** id: new at a fresh start, kept by every resume of the run (it is the run's
``run_id`` in metrics and trackers), written into every manifest and local-tier marker.

Where things are recorded::

    RUN_DIR/lineage.json          {"lineage", "ckpt_url", "parent", "created"}: the run's identity;
                                  a restart of the run reads it (rank 0) and resumes only its lineage
    CKPT_DIR/owner.json           the lineage that owns this checkpoint location's top level
    CKPT_DIR/runs/<lineage>/      the checkpoints of any other lineage given the same ckpt.dir
    LOCAL_DIR/<lineage>/          every lineage's node-local tier in a folder of its own

The first lineage to use a ``ckpt.dir`` owns it (``owner.json``, created by compare-and-swap, so
of runs starting at once exactly one owns it: ``lease.claim_once``; checkpoints of a podtrain that
predates lineages count as their run's); any other lineage that is given the same ``ckpt.dir``
writes under ``CKPT_DIR/runs/<lineage>/`` and says so in one line naming the owner and the ways
to continue or branch from it. So an LR sweep from one base YAML starts fresh in every run,
and nothing of the first run is touched.

Starting from another run's checkpoint on purpose is ``ckpt.resume_from``: the new run keeps its
own lineage and records the other one as its ``parent``. Everything here runs on rank 0; the
checkpointer broadcasts what it decides.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from podtrain.ckpt import layout
from podtrain.ckpt.lease import claim_once
from podtrain.storage.errors import Transient
from podtrain.ckpt.store import StorageError, open_store, read_json

log = logging.getLogger("podtrain.checkpoint")

LINEAGE_FILE = layout.LINEAGE_FILE
OWNER_FILE = "owner.json"
RUNS_SUBDIR = "runs"


def new_lineage() -> str:
    """A fresh lineage id (12 hex digits, as podtrain's run ids have always been)."""
    return uuid.uuid4().hex[:12]


@dataclass
class RunIdentity:
    """Who this run is and where its durable checkpoints live (rank 0 decides, all ranks hold it)."""

    lineage: str
    ckpt_url: str
    """This lineage's checkpoint location: ``ckpt.dir`` itself, or ``ckpt.dir/runs/<lineage>``."""
    parent: dict[str, Any] | None = None
    """Where a ``ckpt.resume_from`` start came from: ``{"lineage", "step", "path"}``; None."""
    created: float = 0.0
    fresh: bool = True
    """True when this start created the lineage (nothing of it can exist yet)."""
    configured: str = ""
    """The ``ckpt.dir`` (or ``RUN_DIR/ckpt``) the location was decided under."""

    def record(self) -> dict[str, Any]:
        """What ``RUN_DIR/lineage.json`` and every manifest carry."""
        return {"lineage": self.lineage, "parent": self.parent}


def _read_record(store, name: str) -> dict[str, Any] | None:
    """A record (``lineage.json``, ``owner.json``), or None when absent or damaged (warned)."""
    try:
        return read_json(store, name, missing=None)
    except ValueError as exc:
        log.warning("%s: ignored", exc)
        return None


def owner_of(store) -> dict[str, Any] | None:
    """The owner record of a checkpoint location: ``owner.json``, else the lineage of its newest
    committed checkpoint (a location written before lineages), else None (nobody owns it)."""
    owner = _read_record(store, OWNER_FILE)
    if owner and owner.get("lineage"):
        return owner
    for step, name in reversed(layout.committed_steps(store)):
        try:
            manifest = layout.read_manifest(store, name)
        except Transient:  # an outage is not a bad checkpoint: never skip one for it
            raise
        except (ValueError, StorageError):
            continue
        lineage = layout.checkpoint_lineage(store, name, manifest)
        if lineage:
            return {"lineage": lineage, "run_dir": None, "newest_step": step}
    return None


def _legacy_run_id(run_dir: Path) -> str | None:
    """The run id a run directory's metrics carry (a run started before lineage.json existed)."""
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        run_id = (read_json(None, str(path), line.encode(), error=None) or {}).get("run_id")
        if run_id:
            return str(run_id)
    return None


def establish(run_dir: Path, configured_url: str, fresh_start: bool) -> RunIdentity:
    """Rank 0: this run's identity and checkpoint location, recorded in ``RUN_DIR/lineage.json``.

    ``configured_url``: ``ckpt.dir`` (or ``RUN_DIR/ckpt``). ``fresh_start`` (``ckpt.resume=never``):
    a new lineage even when the run directory has one. The lineage of the run directory is kept
    otherwise; a run directory without ``lineage.json`` adopts the run id its ``metrics.jsonl``
    carries (checkpoints written before lineages stay resumable), else starts a new lineage.
    """
    run_dir = Path(run_dir)
    recorded = None if fresh_start else _read_record(open_store(str(run_dir)), LINEAGE_FILE)
    if recorded and recorded.get("lineage"):
        lineage, parent, fresh = str(recorded["lineage"]), recorded.get("parent"), False
        created = float(recorded.get("created") or time.time())
    else:
        adopted = None if fresh_start else _legacy_run_id(run_dir)
        lineage, parent, fresh, created = adopted or new_lineage(), None, adopted is None, time.time()
    if recorded and recorded.get("lineage") == lineage and recorded.get("configured") == configured_url:
        location = str(recorded["ckpt_url"])  # decided at the run's first start: never re-decided
    else:
        location = _location(run_dir, configured_url, lineage)
    identity = RunIdentity(lineage, location, parent, created, fresh, configured_url)
    write(run_dir, identity)
    return identity


def _location(run_dir: Path, configured_url: str, lineage: str) -> str:
    """The checkpoint location of ``lineage`` under ``configured_url``: the top level when this
    lineage owns it or nobody does (then it claims it), else ``runs/<lineage>``."""
    base = open_store(configured_url)
    owner = owner_of(base)
    if owner is None:  # two fresh runs at once: exactly one claim stands, and both read it
        owner = claim_once(base, OWNER_FILE, {"lineage": lineage, "run_dir": str(run_dir.resolve()),
                                              "created": time.time()})
    if owner.get("lineage") == lineage:
        return configured_url
    own = f"{configured_url.rstrip('/')}/{RUNS_SUBDIR}/{lineage}"
    if not layout.committed_steps(open_store(own)):  # said once, when this lineage starts there
        newest = layout.committed_steps(base)
        log.warning(
            "%s belongs to another run (lineage %s%s%s): podtrain never resumes, prunes or overwrites "
            "another run's checkpoints, so this run (lineage %s) keeps its own in %s. To continue "
            "that run, use its run.dir; to start from its weights, set ckpt.resume_from=%s; to "
            "keep runs apart from the start, give each its own ckpt.dir", configured_url,
            owner.get("lineage"), f", run.dir {owner['run_dir']}" if owner.get("run_dir") else "",
            f", newest step {newest[-1][0]}" if newest else "", lineage, own,
            f"{configured_url.rstrip('/')}/{newest[-1][1]}" if newest else configured_url)
    return own


def write(run_dir: Path, identity: RunIdentity) -> None:
    """Record ``identity`` in ``RUN_DIR/lineage.json`` (atomically)."""
    body = {**asdict(identity)}
    body.pop("fresh")
    open_store(str(run_dir)).write_bytes(LINEAGE_FILE, json.dumps(body, indent=1).encode())


def local_url(local_dir: str, lineage: str) -> str:
    """The node-local tier's folder of ``lineage`` under ``ckpt.local_dir``."""
    return f"{local_dir.rstrip('/')}/{lineage}"
