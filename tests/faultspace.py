"""Fault-space enumeration of the checkpoint layer: every storage call of a scenario, failed in turn.

A scenario is one job as a user runs it: open the run (its identity and lease), resume from the
newest checkpoint, train one step, save it (the background writer: prepare, write, commit, publish,
retain), close (the lease released). A fault-free run first counts its storage calls (``N``). Then,
for every call ``i`` in ``1..N`` and every mode, a fresh copy of the starting state is run again in a
forked process whose store fails call ``i`` in that mode:

- ``transient``   a transient fault that outlasted the store's retry budget (``Transient``);
- ``once``        a transient fault on the first attempt only (the store's retry must absorb it);
- ``denied``      access denied (a bucket without ``s3:DeleteObject``, a read-only mount);
- ``nospace``     no space left;
- ``kill_before`` the process killed (``os._exit``: no ``finally``, no clean-up) just before the call;
- ``kill_after``  the process killed just after the call took effect.

And for what a save leaves, every file of the newest checkpoint (``latest`` included) truncated to
half its size or with three bytes changed (``truncate``, ``flip``).

After each fault the job is resumed as a user would (a new process, no fault: resume, train, save,
close) and the invariants are checked:

- I1 once a checkpoint is committed there is always a complete one to resume from, and a save the
  job reported as done is the one resumed;
- I2 the restored state is exactly one save's: weights, optimizer state, train state (data
  position) and RNG equal that step's reference bit for bit;
- I3 nothing outside the run's own lineage changes (the bytes of another run sharing ``ckpt.dir``);
- I4 every job ends within its deadline, cleanly or with a documented error (a ``UserError``:
  exit 2, or a storage outage: exit 203), never a traceback of a bug, and the resumed job saves;
- I5 after a clean exit no temporary file (POSIX) and no incomplete multipart upload (S3) is left.

Calls are counted at the ``Store`` interface (the outermost call of a thread: ``write_bytes`` is one
call, not also the ``open_write`` inside it; a file streamed through ``open_write`` fails at its
commit, where it becomes visible). Nothing in podtrain is changed or mocked: the stores are the
real POSIX and S3 stores (S3: the real client against the tests' S3 server on loopback), patched
from outside in the forked job only. ``bench/faultspace.py`` runs the whole enumeration; the test
suite runs a reduced one (``tests/test_faultspace.py``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

CALL_MODES = ("transient", "once", "denied", "nospace", "kill_before", "kill_after")
DAMAGE_MODES = ("truncate", "flip")
START = 2
"""The starting state holds this run's steps up to START (the newest is what a fault must not lose)."""
JOB_DEADLINE_S = 60.0
"""Longest a job may run (I4): a fault-free one takes well under a second on this machine."""
KILLED = 137
VOCAB = 320
STORE_CALLS = ("stat", "size", "exists", "read_into", "read_range", "read_bytes", "iter_chunks", "open_read",
               "open_write", "write_bytes", "write_replayable", "list", "list_dirs", "delete", "delete_many", "delete_prefix",
               "read_versioned", "create_exclusive", "replace_if", "delete_if")
"""The ``Store`` methods counted as storage calls (those a store class has)."""


# -- the job -----------------------------------------------------------------------------------------
def tiny_model(seed: int = 0):
    """The tiny Llama and its AdamW, as every job builds them."""
    from podtrain.model import build_model, preset_config

    model = build_model(preset_config("tiny", VOCAB), seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, opt, step: int) -> None:
    """The optimizer step ``step``: a batch fixed by the step number, so it is the same in every job."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (2, 33), generator=g)
    model(input_ids=x[:, :-1], labels=x[:, 1:]).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_state(step: int) -> dict:
    """What the loop saves with step ``step`` (the data position follows the step)."""
    return {"step": step, "tokens_seen": step * 64, "loader": {"epoch": 0, "consumed": 2 * step}}


def seed_rngs(step: int) -> None:
    """The RNG states saved with step ``step`` (set just before its save)."""
    random.seed(1000 + step)
    np.random.seed(1000 + step)
    torch.manual_seed(1000 + step)


def draws() -> list[float]:
    """One value from each RNG a checkpoint restores."""
    return [random.random(), float(np.random.rand()), *torch.rand(2).tolist()]


def fingerprint(model, opt) -> str:
    """A digest of the weights and the optimizer state, bit for bit."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    sd = opt.state_dict()
    for pid in sorted(sd["state"]):
        for k, v in sorted(sd["state"][pid].items()):
            h.update(f"{pid}/{k}".encode())
            h.update(v.detach().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    h.update(json.dumps(sd["param_groups"], sort_keys=True, default=str).encode())
    return h.hexdigest()


def references(steps: int) -> dict[int, dict]:
    """What a job restoring step ``s`` must find, for each ``s`` in ``1..steps``."""
    model, opt = tiny_model()
    refs = {}
    for step in range(1, steps + 1):
        train_step(model, opt, step)
        seed_rngs(step)
        refs[step] = {"state": fingerprint(model, opt), "train_state": train_state(step), "draws": draws()}
    return refs


@dataclass
class Scenario:
    """One scenario: where the checkpoints live and how many are kept."""

    name: str
    ckpt_dir: Callable[[Path], str]
    """The ``ckpt.dir`` of a root (a folder, or an ``s3://`` prefix of its own)."""
    keep_last: int = 1
    s3: bool = False
    local: bool = False
    """With a node-local tier (``ckpt.local_dir`` under the root, a local save of every step
    before the durable one; one node: no peer replicas)."""

    def cfg(self, root: Path):
        """The job's checkpoint section (defaults but for where and how many)."""
        from podtrain.config_sections import CkptSection

        local = {"local_dir": str(root / "local"), "local_every": 1, "local_keep": 1} if self.local else {}
        return CkptSection(dir=self.ckpt_dir(root), keep_last=self.keep_last, lease_timeout_s=600.0, **local)


def run_job(root: Path, scenario: Scenario, result: Path) -> None:
    """One job (see the module docstring), in the calling process; writes what happened to ``result``."""
    import torch.distributed  # noqa: F401 (imported before any thread starts)

    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.ckpt.state import restore_rng
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext

    out: dict[str, Any] = {"outcome": "ok"}
    try:
        ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
        model, opt = tiny_model()
        ck = Checkpointer(root / "run", scenario.cfg(root), ctx)
        try:
            state = ck.restore(model, opt, None, fresh=lambda: model.load_state_dict(tiny_model()[0].state_dict()))
            if state is not None:
                out["restored"] = state.step
                out["state"] = fingerprint(model, opt)
                out["train_state"] = {k: state.train_state.get(k) for k in ("step", "tokens_seen", "loader")}
                if state.rng is not None:
                    restore_rng(state.rng, ctx.device)
                    out["draws"] = draws()
            step = (state.step if state is not None else 0) + 1
            train_step(model, opt, step)
            seed_rngs(step)
            out["saving"] = step
            if scenario.local:
                ck.save(step, model, opt, None, train_state(step), local=True)
            ck.save(step, model, opt, None, train_state(step))
        finally:
            ck.close()
        out["saved"] = step
    except BaseException as exc:  # noqa: BLE001 (reported to the parent, which judges it)
        from podtrain.errors import UserError

        out["outcome"] = "user" if isinstance(exc, UserError) else "bug"
        out["error"] = f"{type(exc).__name__}: {exc}"
        if out["outcome"] == "bug":
            out["traceback"] = traceback.format_exc()[-2000:]
    result.write_text(json.dumps(out))


# -- the fault injector ------------------------------------------------------------------------------
class Injector:
    """Counts the storage calls of this process and fails call ``index`` in ``mode`` (0: none)."""

    def __init__(self, index: int = 0, mode: str = "", log: Path | None = None) -> None:
        self.index, self.mode, self.log = index, mode, log
        self.count = 0
        self.calls: list[str] = []
        self.fired = False
        self._lock = threading.Lock()
        self._depth = threading.local()

    def install(self) -> None:
        """Patch the store classes of this process (call it in the forked job only)."""
        from podtrain.storage.posix import PosixStore

        classes = [PosixStore]
        try:
            from podtrain.storage.s3 import S3Store
            classes.append(S3Store)
        except ImportError:
            pass
        for cls in classes:
            for method in STORE_CALLS:
                original = getattr(cls, method, None)
                if original is not None:
                    setattr(cls, method, self._wrap(method, original))

    def _wrap(self, method: str, original):
        injector = self

        def counted(store, *args, **kwargs):
            depth = getattr(injector._depth, "n", 0)
            if depth:
                return original(store, *args, **kwargs)
            with injector._lock:
                injector.count += 1
                number = injector.count
                injector.calls.append(f"{method}({args[0] if args else ''})")
            hit = number == injector.index
            if hit:
                injector.fired = True
                injector._record(number, method, args)
            if method == "open_write":  # the file becomes visible at its commit: the fault fires there
                writer = original(store, *args, **kwargs)
                return _FaultyWriter(writer, injector, store, args[0]) if hit else writer
            if hit and injector.mode != "kill_after":
                injector.fire(store, args[0] if args else "")
            injector._depth.n = depth + 1
            try:
                result = original(store, *args, **kwargs)
            finally:
                injector._depth.n = depth
            if hit and injector.mode == "once":
                injector.mode = ""  # the retry succeeded; the fault is spent
            if hit and injector.mode == "kill_after":
                os._exit(KILLED)
            return result

        counted.__wrapped__ = original
        return counted

    def _record(self, number: int, method: str, args) -> None:
        if self.log is not None:
            self.log.write_text(f"{number} {method}({args[0] if args else ''})")

    def fire(self, store, name: str) -> None:
        """Carry out the mode at the chosen call, before it happens (``kill_after`` is the caller's)."""
        from podtrain.storage.errors import AccessDenied, NoSpace, Transient

        where = store.where(name) if name else str(store.url)
        if self.mode == "kill_before":
            os._exit(KILLED)
        if self.mode == "transient":
            raise Transient(where, "injected: SlowDown, the retry budget is spent")
        if self.mode == "denied":
            raise AccessDenied(where, "injected: AccessDenied")
        if self.mode == "nospace":
            raise NoSpace(where, "injected: no space left on device")
        if self.mode == "once":  # the first attempt fails; the store's own retry must absorb it
            self.mode = ""
            store.retry.run(where, _fail_once())


def _fail_once():
    """An operation that fails transiently on its first attempt and succeeds on the next."""
    from podtrain.storage.errors import Transient

    state = {"tries": 0}

    def op():
        state["tries"] += 1
        if state["tries"] == 1:
            raise Transient("injected", "injected: one SlowDown")

    return op


class _FaultyWriter:
    """A store's writer whose commit is the chosen fault point."""

    def __init__(self, inner, injector: Injector, store, name: str) -> None:
        self.inner, self.injector, self.store, self.name = inner, injector, store, name

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.inner.abort()
            return False
        self.commit()
        return False

    def commit(self) -> None:
        """The fault, then (unless it raised or killed) the real commit."""
        mode = self.injector.mode
        if mode in ("transient", "denied", "nospace", "kill_before"):
            try:
                self.injector.fire(self.store, self.name)
            except BaseException:
                self.inner.abort()
                raise
        self.inner.commit()
        if mode == "kill_after":
            os._exit(KILLED)


# -- running jobs in processes -----------------------------------------------------------------------
def _child(root: str, scenario: Scenario, result: str, index: int, mode: str, log: str) -> None:
    injector = Injector(index, mode, Path(log))
    injector.install()
    run_job(Path(root), scenario, Path(result))
    Path(log + ".count").write_text(json.dumps({"count": injector.count, "calls": injector.calls}))
    os._exit(0)  # no atexit of the parent's (pytest's) in the fork


def spawn_job(root: Path, scenario: Scenario, index: int = 0, mode: str = "",
              deadline_s: float = JOB_DEADLINE_S) -> dict[str, Any]:
    """Run one job in a forked process (faulty at call ``index`` in ``mode``); what it reported,
    with ``exit`` (its exit code, ``None`` when it outlived ``deadline_s`` and was killed), ``seconds``,
    ``count`` (storage calls made) and ``calls``."""
    tag = f"{index}-{mode or 'none'}-{time.monotonic_ns()}"
    result, log = root / f".job-{tag}.json", root / f".job-{tag}.fault"
    proc = mp.get_context("fork").Process(target=_child, args=(str(root), scenario, str(result), index, mode, str(log)))
    t0 = time.monotonic()
    proc.start()
    proc.join(deadline_s)
    out: dict[str, Any] = {}
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        out["exit"] = None
    else:
        out["exit"] = proc.exitcode
    out["seconds"] = time.monotonic() - t0
    if result.exists():
        out.update(json.loads(result.read_text()))
    counted = Path(str(log) + ".count")
    if counted.exists():
        out.update(json.loads(counted.read_text()))
    out["fault"] = log.read_text() if log.exists() else ""
    for f in (result, log, counted):
        f.unlink(missing_ok=True)
    return out


# -- the invariants ----------------------------------------------------------------------------------
def tree_hashes(path: Path) -> dict[str, str]:
    """Every file under ``path`` and a digest of its bytes."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def temp_files(path: Path) -> list[str]:
    """Temporary files (``fsutil``'s hidden ``.NAME.XXXX.tmp``) left under ``path``."""
    from podtrain.storage.posix import is_temp_name

    return [str(p.relative_to(path)) for p in path.rglob("*") if is_temp_name(p.name)]


@dataclass
class Verdict:
    """The outcome of one fault point: which invariants failed, and why."""

    point: str
    broken: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """Every invariant held."""
        return not self.broken


def judge(point: str, fault: dict, resumed: dict, refs: dict[int, dict], before_hashes: dict[str, str],
          after_hashes: dict[str, str], leftovers: list[str], committed_before: int) -> Verdict:
    """Check I1-I5 for one fault point from the faulty job's and the resumed job's reports;
    ``committed_before``: the newest step committed before the fault (the resume may not find less:
    a fault that made the job start afresh and its save then replace that step is caught here)."""
    v = Verdict(point)
    for who, job in (("the faulty job", fault), ("the resumed job", resumed)):
        if job.get("exit") is None:
            v.broken.append(f"I4: {who} did not end within {JOB_DEADLINE_S:.0f} s")
        elif job.get("outcome") == "bug":
            v.broken.append(f"I4: {who} ended with a bug: {job.get('error')}")
    if resumed.get("outcome") != "ok" or resumed.get("exit") != 0:
        v.broken.append(f"I4: the resumed job did not save (exit {resumed.get('exit')}: {resumed.get('error')})")
    step = resumed.get("restored")
    if committed_before and (step is None or step < committed_before):
        v.broken.append(f"I1: step {committed_before} was committed, and the resume found "
                        f"{'nothing' if step is None else f'step {step}'}")
    if fault.get("outcome") == "ok" and fault.get("exit") == 0 and step != fault.get("saved"):
        v.broken.append(f"I1: the job reported step {fault.get('saved')} saved, the resume found step {step}")
    if step is not None:
        ref = refs.get(step)
        if ref is None:
            v.broken.append(f"I2: restored step {step}, which no job saved")
        else:
            if resumed.get("state") != ref["state"]:
                v.broken.append(f"I2: the weights or optimizer state of step {step} differ from its save")
            if resumed.get("train_state") != {k: ref["train_state"][k] for k in ("step", "tokens_seen", "loader")}:
                v.broken.append(f"I2: the train state of step {step} is {resumed.get('train_state')}")
            if resumed.get("draws") != ref["draws"]:
                v.broken.append(f"I2: the RNG states of step {step} differ from its save")
    if before_hashes != after_hashes:
        changed = sorted(set(before_hashes.items()) ^ set(after_hashes.items()))
        v.broken.append(f"I3: another run's files changed: {changed[:3]}")
    if leftovers:
        v.broken.append(f"I5: left after a clean exit: {leftovers[:3]}")
    return v


# -- enumeration -------------------------------------------------------------------------------------
@dataclass
class Space:
    """A scenario's starting state (this run's committed step 1, another run's checkpoint in the
    same ``ckpt.dir``) kept as a snapshot, and the references every restore is compared with.

    Jobs always run in ``work`` (the paths recorded in ``lineage.json`` are absolute): each fault
    point starts from the snapshot copied back there."""

    scenario: Scenario
    work: Path
    refs: dict[int, dict]
    s3: Any = None
    """The S3 helpers (``tests/faultspace_s3.S3Snapshots``) of an S3 scenario, else None."""
    snapshots: dict[str, Any] = field(default_factory=dict)

    def take(self, label: str) -> None:
        """Keep the state of ``work`` as ``label``."""
        copy = self.work.parent / f"{self.work.name}.{label}"
        if copy.exists():
            shutil.rmtree(copy)
        shutil.copytree(self.work, copy, symlinks=True)
        self.snapshots[label] = (copy, self.s3.snapshot(self.scenario.ckpt_dir(self.work)) if self.s3 else None)

    def reset(self, label: str = "start") -> Path:
        """Put ``work`` back to snapshot ``label``."""
        copy, objects = self.snapshots[label]
        if self.work.exists():
            shutil.rmtree(self.work)
        shutil.copytree(copy, self.work, symlinks=True)
        if self.s3 is not None:
            self.s3.restore(self.scenario.ckpt_dir(self.work), objects)
        return self.work

    def other_run(self) -> dict[str, str]:
        """The bytes of the other run, under ``ckpt.dir``'s ``runs/`` (I3)."""
        if self.s3 is not None:
            return self.s3.hashes(self.scenario.ckpt_dir(self.work).rstrip("/") + "/runs/")
        return tree_hashes(Path(self.scenario.ckpt_dir(self.work)) / "runs")

    def leftovers(self) -> list[str]:
        """I5's temporary files and incomplete uploads."""
        found = temp_files(self.work)
        if self.s3 is not None:
            found += self.s3.incomplete_uploads(self.scenario.ckpt_dir(self.work))
        return found


def warm() -> None:
    """Import what a job uses, and build and train the model once, in the parent: each forked job
    then starts in milliseconds instead of paying the imports (seconds) itself."""
    import torch.distributed  # noqa: F401

    torch.set_num_threads(1)  # a forked child inherits a broken intra-op pool of a multi-threaded parent
    from podtrain.ckpt import checkpointer  # noqa: F401
    from podtrain.storage import posix  # noqa: F401

    try:
        from podtrain.storage import s3  # noqa: F401
    except ImportError:
        pass
    model, opt = tiny_model()
    train_step(model, opt, 1)


def prepare_space(scenario: Scenario, work: Path, s3=None) -> Space:
    """The starting state: this run's step 1 committed (it owns ``ckpt.dir``'s top level), then
    another run's step 1 beside it (in ``ckpt.dir/runs/<its lineage>``): two fault-free jobs."""
    warm()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    space = Space(scenario, work, references(START + 1), s3)
    for step in range(1, START + 1):
        job = spawn_job(work, scenario)
        assert job.get("outcome") == "ok" and job.get("saved") == step, job
    other = work / "other"
    other.mkdir()
    theirs = spawn_job(other, Scenario(scenario.name + "-other", lambda _root: scenario.ckpt_dir(work),
                                       scenario.keep_last, scenario.s3))
    assert theirs.get("outcome") == "ok", theirs
    assert space.other_run(), "the other run's checkpoint is not under ckpt.dir/runs/"
    space.take("start")
    return space


def count_calls(space: Space) -> dict[str, Any]:
    """A fault-free job from the starting state: its storage calls, in order."""
    space.reset()
    job = spawn_job(space.work, space.scenario)
    assert job.get("outcome") == "ok", job
    return job


def enumerate_calls(space: Space, modes=CALL_MODES, points: list[int] | None = None,
                    say: Callable[[str], None] = print) -> tuple[int, list[Verdict]]:
    """Fail every storage call (or those of ``points``) of the scenario's job in every mode; resume
    after each and judge. Returns the number of calls and the verdicts."""
    n = count_calls(space)["count"]
    verdicts = []
    for index in points if points is not None else range(1, n + 1):
        for mode in modes:
            space.reset()
            before = space.other_run()
            fault = spawn_job(space.work, space.scenario, index, mode)
            leftovers = space.leftovers() if fault.get("exit") == 0 else []
            resumed = spawn_job(space.work, space.scenario)
            point = f"{space.scenario.name}: call {fault.get('fault') or index} in mode {mode}"
            v = judge(point, fault, resumed, space.refs, before, space.other_run(), leftovers, START)
            verdicts.append(v)
            if not v.held:
                say(f"BROKEN {point}: " + "; ".join(v.broken))
    return n, verdicts


def enumerate_damage(space: Space, modes=DAMAGE_MODES,
                     say: Callable[[str], None] = print) -> tuple[int, list[Verdict]]:
    """Save the next step cleanly, then damage each of its files (and ``latest``) in each mode,
    resume, judge: the damaged save, or the one before it (``keep_last`` >= 2), is restored whole."""
    if space.s3 is not None:
        raise ValueError("damage is enumerated on POSIX (the bytes a resume checks are the same on S3)")
    space.reset()
    job = spawn_job(space.work, space.scenario)
    assert job.get("saved") == START + 1, job
    space.take("saved")
    ckpt = Path(json.loads((space.work / "run" / "lineage.json").read_text())["ckpt_url"])
    files = sorted(str(p.relative_to(space.work)) for p in [*(ckpt / f"step_{START + 1:06d}").iterdir(), ckpt / "latest"])
    verdicts = []
    for rel in files:
        for mode in modes:
            space.reset("saved")
            before = space.other_run()
            _damage(space.work / rel, mode)
            resumed = spawn_job(space.work, space.scenario)
            point = f"{space.scenario.name}: {rel} {mode}"
            v = judge(point, {"exit": 0, "outcome": "damaged"}, resumed, space.refs, before, space.other_run(), [], START)
            verdicts.append(v)
            if not v.held:
                say(f"BROKEN {point}: " + "; ".join(v.broken))
    return len(files), verdicts


def _damage(path: Path, mode: str) -> None:
    data = bytearray(path.read_bytes())
    if mode == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return
    at = min(4096, len(data) // 2)
    for i in range(at, min(at + 3, len(data))):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


# -- S3 ----------------------------------------------------------------------------------------------
class S3Snapshots:
    """Snapshots of an ``s3://`` prefix on the tests' S3 server (boto3, in the parent only: the
    forked jobs make their own clients), for ``Space`` to reset between fault points."""

    def __init__(self, boto) -> None:
        self.boto = boto

    @staticmethod
    def _split(url: str) -> tuple[str, str]:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return bucket, prefix.rstrip("/") + "/" if prefix else ""

    def _keys(self, bucket: str, prefix: str) -> list[str]:
        keys = []
        for page in self.boto.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return keys

    def snapshot(self, url: str) -> dict[str, bytes]:
        """Every object under ``url`` and its bytes."""
        bucket, prefix = self._split(url)
        return {k: self.boto.get_object(Bucket=bucket, Key=k)["Body"].read() for k in self._keys(bucket, prefix)}

    def restore(self, url: str, objects: dict[str, bytes]) -> None:
        """Make ``url`` hold exactly ``objects`` again (incomplete uploads aborted)."""
        bucket, prefix = self._split(url)
        self.incomplete_uploads(url, abort=True)
        for key in self._keys(bucket, prefix):
            if key not in objects:
                self.boto.delete_object(Bucket=bucket, Key=key)
        for key, data in objects.items():
            self.boto.put_object(Bucket=bucket, Key=key, Body=data)

    def hashes(self, url: str) -> dict[str, str]:
        """Every object under ``url`` and a digest of its bytes."""
        return {k: hashlib.sha256(v).hexdigest() for k, v in self.snapshot(url).items()}

    def incomplete_uploads(self, url: str, abort: bool = False) -> list[str]:
        """Multipart uploads started under ``url`` and never completed (``abort``: and abort them)."""
        bucket, prefix = self._split(url)
        deadline = time.monotonic() + (0 if abort else 5.0)  # the client aborts asynchronously, a moment after
        while (found := self.boto.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        if abort:
            for up in found:
                self.boto.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        return [f"incomplete upload {up['Key']}" for up in found]
