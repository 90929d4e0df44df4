"""Rank 0's storage requests at a save do not grow with the world size nor with the checkpoints
kept (issue 37 point 1): retention lists the step directories alone (S3: ``Delimiter='/'``; POSIX:
one directory read), reads a manifest only where its plan depends on one it has not seen, and
deletes a checkpoint with its manifest's DELETE, one listing of its files and DeleteObjects
batches (S3), never one request per object.

Real parts: the real ``Checkpointer`` saving in this process (rank 0 of a one-rank job: the
requests of rank 0 at a save depend on the world size only through the checkpoints of that world
size that retention lists and deletes), on a real directory and on a real S3 server (moto) behind
the counting proxy (tests/s3_fault_proxy.py: every HTTP request, by verb). The checkpoints already
there are laid out as a job of 2 or 8 ranks writes them: the files of a real save, its piece file
and sidecar once per rank, its manifest re-sealed with that world size.
"""

from __future__ import annotations

import collections
import functools
import json
from pathlib import Path

import pytest

from s3_fault_proxy import s3_proxy  # noqa: F401 (fixture)

WORLDS = (2, 8)
KEPT = (3, 12)
"""Checkpoints kept by keep_every in the two layouts compared. 12 (14 step directories with the
two newest) is enough: at 8 ranks they hold over 250 objects, five or more LIST pages of PAGE_KEYS
were their files listed, against two or three at 3 kept, so any per-checkpoint or per-file request
shows as a difference; 30 put ~1,100 objects through moto per run for the same verdict (about half the
test's time)."""
EVERY = 10
"""keep_every: the kept checkpoints are steps 10, 20, ... (kept forever, as keep_every keeps them)."""
PAGE_KEYS = 50
"""LIST page size for the S3 run: at the test's sizes one page of 1,000 keys would hide the growth
that at 512 ranks is a page per checkpoint kept (1,030 objects each)."""


def _model():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _checkpointer(run: Path, url: str):
    from multirank import gloo_context
    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection

    return Checkpointer(run, CkptSection(dir=url, keep_last=2, keep_every=EVERY, async_save=False), gloo_context())


def _save(ck, model, opt, step: int) -> None:
    ck.save(step, model, opt, None, {"step": step, "tokens_seen": step})
    ck.wait()


def _world_layout(files: dict[str, bytes], step: int, world: int, lineage: str) -> dict[str, bytes]:
    """The files of step ``step`` saved by ``world`` ranks, from the files of a real one-rank save:
    each rank's piece file and sidecar (rank 0's bytes), the small files, the manifest with that
    world size, those ranks' files and the job's lineage, sealed as the writer seals it."""
    from podtrain.ckpt import layout

    out, ranks = {}, {"sidecars": 0, "sidecar_bytes": 0, "piece_files": 0, "piece_bytes": 0}
    for rel, data in files.items():
        if rel.startswith(("rank_", "meta_")):
            for rank in range(world):
                out[rel[:5] + f"{rank:05d}" + rel[10:]] = data
            kind = ("piece_files", "piece_bytes") if rel.startswith("rank_") else ("sidecars", "sidecar_bytes")
            ranks[kind[0]] += world
            ranks[kind[1]] += world * len(data)
        elif rel != layout.MANIFEST:
            out[rel] = data
    manifest = {k: v for k, v in json.loads(files[layout.MANIFEST]).items() if k != "crc32"}
    out[layout.MANIFEST] = layout.sealed_manifest({**manifest, "step": step, "world_size": world, "ranks": ranks,
                                                        "lineage": lineage})
    assert len(out) == len(files) + 2 * (world - 1), sorted(out)
    return out


class _Counted:
    """Counts the POSIX store's calls of this process by request kind (the outermost call of a
    thread: ``read_bytes`` is one GET, not also its ``size``), wrapping the real class's methods."""

    KINDS = {"list": "LIST", "list_dirs": "LIST", "stat": "HEAD", "size": "HEAD", "exists": "HEAD",
             "read_into": "GET", "read_range": "GET", "read_bytes": "GET", "read_versioned": "GET",
             "open_read": "GET", "iter_chunks": "GET", "open_write": "PUT", "write_bytes": "PUT",
             "write_replayable": "PUT", "create_exclusive": "PUT", "replace_if": "PUT", "delete": "DELETE",
             "delete_prefix": "DELETE", "delete_many": "DELETE", "delete_if": "DELETE"}

    def __init__(self, monkeypatch) -> None:
        import threading

        from podtrain.storage.posix import PosixStore

        self.counts: collections.Counter = collections.Counter()
        self._depth = threading.local()
        for method, kind in self.KINDS.items():
            if hasattr(PosixStore, method):
                monkeypatch.setattr(PosixStore, method, self._wrap(kind, getattr(PosixStore, method)))

    def _wrap(self, kind: str, original):
        @functools.wraps(original)
        def counted(store, *args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if not depth:
                self.counts[kind] += 1
            self._depth.n = depth + 1
            try:
                return original(store, *args, **kwargs)
            finally:
                self._depth.n = depth
        return counted


def _s3_kind(method: str, path: str) -> str:
    query = path.split("?", 1)[1].split("&") if "?" in path else []
    if method == "GET" and "list-type=2" in query:
        return "LIST"
    if method == "POST" and any(q.split("=")[0] == "delete" for q in query):
        return "DeleteObjects"
    if method == "HEAD" and "/step_" in path:
        return "HEAD step_"  # a request per step directory: what the listing replaces
    return method


@pytest.fixture(scope="module")
def saved_files(tmp_path_factory) -> dict[str, bytes]:
    """The files of a real one-rank save (POSIX), relative to its step directory: what every
    synthesised checkpoint is laid out from."""
    from podtrain.ckpt import layout

    root = tmp_path_factory.mktemp("proto")
    model, opt = _model()
    ck = _checkpointer(root / "run", str(root / "ckpt"))
    _save(ck, model, opt, 1)
    ck.close()
    return {p.name: p.read_bytes() for p in sorted((root / "ckpt" / layout.step_name(1)).iterdir())}


def _scenario(tmp_path: Path, files: dict[str, bytes], world: int, kept: int, bucket: str | None,
              counter) -> tuple[dict, list[int]]:
    """A job (a Checkpointer: keep_last=2, keep_every=10) over ``kept`` checkpoints of ``world``
    ranks kept by keep_every and two newer ones of its lineage saves twice: rank 0's requests at
    its second save, by kind, and the steps left."""
    from podtrain.ckpt import layout

    name = f"w{world}k{kept}"
    url = str(tmp_path / name) if bucket is None else f"s3://{bucket}/{name}"
    model, opt = _model()
    ck = _checkpointer(tmp_path / f"run_{name}", url)
    store = ck.store
    newest = EVERY * kept + 2
    steps = [EVERY * i for i in range(1, kept + 1)] + [newest - 1, newest]
    laid = {f"{layout.step_name(step)}/{rel}": data for step in steps
            for rel, data in _world_layout(files, step, world, ck.identity.lineage).items()}
    if store.is_local:
        for where, data in laid.items():
            store.local_path(where).parent.mkdir(parents=True, exist_ok=True)
            store.local_path(where).write_bytes(data)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda item: counter.boto.put_object(
                Bucket=store.loc.bucket, Key=store.loc.key(item[0]), Body=item[1]), laid.items()))
    layout.write_latest(store, layout.step_name(newest))
    _save(ck, model, opt, newest + 1)  # the job's first save: it reads the manifests of its window once
    counter.reset()
    _save(ck, model, opt, newest + 2)
    counts = counter.counts()
    ck.close()
    return counts, sorted(s for n in store.list_dirs("") if (s := layout.parse_step(n)) is not None)


class _PosixCounter:
    def __init__(self, monkeypatch) -> None:
        self._counted = _Counted(monkeypatch)

    def reset(self) -> None:
        self._counted.counts.clear()

    def counts(self) -> dict[str, int]:
        return dict(self._counted.counts)


class _S3Counter:
    def __init__(self, proxy, server) -> None:
        self.proxy, self.boto = proxy, server.boto

    def reset(self) -> None:
        self.proxy.reset()

    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(_s3_kind(m, p) for m, p, _ in self.proxy.history()))


def _check(results: dict[tuple[int, int], tuple[dict, list[int]]]) -> dict[str, int]:
    counts = {key: c for key, (c, _) in results.items()}
    first = counts[(WORLDS[0], KEPT[0])]
    assert all(c == first for c in counts.values()), (
        f"rank 0's requests at a save by (world size, checkpoints kept): {counts}")
    for (world, kept), (_, left) in results.items():
        newest = EVERY * kept + 2
        assert left == [EVERY * i for i in range(1, kept + 1)] + [newest + 1, newest + 2], (world, kept, left)
    return first


def test_a_saves_posix_requests_do_not_grow_with_ranks_or_kept_checkpoints(tmp_path, monkeypatch, saved_files):
    """POSIX: at 2 and 8 ranks, 3 and 12 checkpoints kept, a save's calls are the same: one
    directory read of the step directories, no stat or read per kept checkpoint, the deleted
    checkpoint's manifest then the rest of it in one call."""
    counter = _PosixCounter(monkeypatch)
    results = {(w, k): _scenario(tmp_path, saved_files, w, k, None, counter) for w in WORLDS for k in KEPT}
    counts = _check(results)
    assert counts.get("HEAD", 0) == 0 and counts["DELETE"] == 2, counts


@pytest.mark.slow
def test_a_saves_s3_requests_do_not_grow_with_ranks_or_kept_checkpoints(tmp_path, monkeypatch, s3_proxy,
                                                                          s3_server, s3_bucket, saved_files):
    """S3, every HTTP request counted: at 2 and 8 ranks, 3 and 12 checkpoints kept (LIST pages of
    50 keys), a save's requests are the same: LIST pages of the step directories (common
    prefixes), not of their files; the deleted checkpoint's manifest (one DELETE), one listing of
    its files and one DeleteObjects for all of them; no HEAD."""
    from podtrain.storage import s3

    monkeypatch.setattr(s3, "LIST_PAGE_KEYS", PAGE_KEYS)
    counter = _S3Counter(s3_proxy, s3_server)
    results = {(w, k): _scenario(tmp_path, saved_files, w, k, s3_bucket, counter) for w in WORLDS for k in KEPT}
    counts = _check(results)
    assert counts.get("HEAD step_", 0) == 0, counts
    assert counts["DELETE"] == 1 and counts["DeleteObjects"] == 1, counts
    assert counts["LIST"] <= 3, counts  # the step's own (empty) folder, the step directories, the deleted one's files


def test_s3_delete_many_sends_one_request_per_1000_keys(s3_server, s3_bucket, monkeypatch):
    """DeleteObjects in batches of ``DELETE_BATCH_KEYS``: 2,500 names (some never written: not
    an error) are 3 requests, and nothing of them is left."""
    from podtrain.storage import open_store, s3

    store = open_store(f"s3://{s3_bucket}/many")
    names = [f"d/{i:05d}" for i in range(2500)]
    for name in names[:30] + names[-30:]:
        s3_server.boto.put_object(Bucket=s3_bucket, Key=f"many/{name}", Body=b"x")
    sent = []
    real = s3.S3Store._delete_batch
    monkeypatch.setattr(s3.S3Store, "_delete_batch", lambda self, batch: (sent.append(len(batch)), real(self, batch)))
    store.delete_many(names)
    assert sent == [1000, 1000, 500]
    assert s3_server.boto.list_objects_v2(Bucket=s3_bucket, Prefix="many/").get("KeyCount") == 0
