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

Three more scenarios (``Scenario.kind``), each with its own job and checks:

- ``lease``: a short lease (``ckpt.lease_timeout_s=2``, a renewal every 0.5 s); the job holds after
  its restore until the lease was renewed ``LEASE_RENEWALS`` times, and a second job (another
  process of this host) tries to open the run meanwhile. The renewal thread's calls are numbered in
  a stream of their own (``lease``: their moments are the clock's) and are fault points too. Plus:
  the second job is refused in one line and changes nothing of the run (I3), and a failed renewal
  neither stops the job nor counts as a lost lease (I4);
- ``stop``: after a committed save (step 3) and one more step, SIGTERM (a real signal, podtrain's
  ``StopSignal``) and the loop's stop path (``run_stop_job``); the fault points are the calls after
  the signal, in every mode and ``hang`` (a call that never answers). Plus: exit 143 (the CLI's 2
  for a permanent fault) within ``ckpt.grace_s`` (``GRACE_S``) of the signal (I4); step 3 must stay
  restorable (I1);
- ``peers``: 2 forked ranks joined by gloo, each the only rank of its own node (host name, local
  directory), the local tier with one peer replica: durable step 1, local step 2, then node 1's
  local directory is lost (``prepare_space``); the job's restore takes rank 1's share from node 0's
  replica. The fault points are the restore's calls on both ranks (rank 0's numbered first), and
  ``enumerate_replica_damage`` damages each file of that replica. Plus: both ranks restore the same
  save (I2). A rank killed ends the job as torchrun would (the other rank stopped).

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
HANG = "hang"
"""A mode of the stop scenario only: the call never answers (a storage that accepts the connection
and stays silent); the stop path must end within ``ckpt.grace_s`` all the same."""
STOP_MODES = (*CALL_MODES, HANG)
DAMAGE_MODES = ("truncate", "flip")
START = 2
"""The starting state holds this run's steps up to START (the newest is what a fault must not lose)."""
JOB_DEADLINE_S = 60.0
"""Longest a job may run (I4): a fault-free one takes well under a second on this machine."""
KILLED = 137
REQUEUE = 143
"""The stop path's exit code after SIGTERM (``train/signals.py``: ``REQUEUE_EXIT_CODE``)."""
LEASE_THREAD = "podtrain-lease"
"""The lease's renewal thread (``ckpt/lease.py``): its calls are numbered in a stream of their own
(``lease``), since they interleave with the job's at moments the clock decides."""
LEASE_TIMEOUT_S = 2.0
"""The lease scenario's ``ckpt.lease_timeout_s``: a renewal every 0.5 s (a quarter of it)."""
LEASE_RENEWALS = 4
"""Renewal calls the lease scenario's job waits for before it saves (two rounds over its two
locations, the run directory and ``ckpt.dir``); the fault points of the ``lease`` stream."""
GRACE_S = 4.0
"""The stop scenario's ``ckpt.grace_s``: I4's bound from the signal to the exit (a fault-free stop
path takes well under a second here; a storage that never answers costs the whole of it)."""
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
    kind: str = "save"
    """What the job does: ``save`` (``run_job``); ``lease`` (``run_job`` with a short lease, held
    until it was renewed ``LEASE_RENEWALS`` times, and a second job trying to open the run
    meanwhile); ``peers`` (``run_peer_rank``: 2 ranks as 2 nodes, restoring from a peer's
    replica); ``stop`` (``run_stop_job``: SIGTERM after a committed save, the stop path)."""
    rank0_calls: int = 0
    """``peers``: rank 0's storage calls in a fault-free job (``count_calls`` sets it): the fault
    points past it are rank 1's."""

    def cfg(self, root: Path, host: str | None = None):
        """The job's checkpoint section (defaults but for where and how many); ``host``: the node
        of a ``peers`` rank (its own local directory, one peer replica)."""
        from podtrain.config_sections import CkptSection

        local = {"local_dir": str(root / "local"), "local_every": 1, "local_keep": 1} if self.local else {}
        if self.kind == "peers":
            local = {"local_dir": str(root / "local" / (host or "node0")), "local_every": 1, "local_keep": 2,
                     "local_replicas": 1}
        return CkptSection(dir=self.ckpt_dir(root), keep_last=self.keep_last,
                           lease_timeout_s=LEASE_TIMEOUT_S if self.kind == "lease" else 600.0,
                           **({"grace_s": GRACE_S} if self.kind == "stop" else {}), **local)

    @property
    def committed_before(self) -> int:
        """The newest durable step committed before a fault (I1: the resume may not find less):
        the stop job commits ``START + 1`` before its signal; the peers' starting state holds
        durable step 1 (step 2 is on the local tier only)."""
        return {"stop": START + 1, "peers": 1}.get(self.kind, START)

    def resumed(self) -> "Scenario":
        """The job that resumes after a fault: the plain one (a stop or lease job's extras are the
        faulty job's), the 2-rank job for ``peers``."""
        if self.kind in ("lease", "stop"):
            return Scenario(self.name, self.ckpt_dir, self.keep_last, self.s3, self.local)
        return self


def restored_record(state, model, opt, ctx) -> dict[str, Any]:
    """What a job reports of the save it restored (judged against that step's reference): the step,
    the weights' and optimizer's fingerprint, the train state, and the draws of its restored RNG."""
    from podtrain.ckpt.state import restore_rng

    out = {"restored": state.step, "state": fingerprint(model, opt),
           "train_state": {k: state.train_state.get(k) for k in ("step", "tokens_seen", "loader")}}
    if state.rng is not None:
        restore_rng(state.rng, ctx.device)
        out["draws"] = draws()
    return out


def run_job(root: Path, scenario: Scenario, result: Path, injector: "Injector | None" = None) -> None:
    """One job (see the module docstring), in the calling process; writes what happened to ``result``.
    A ``lease`` scenario's job holds after its restore until the lease was renewed
    ``LEASE_RENEWALS`` times (``injector`` counts them), lets a second job try to open the run
    (``_intruder``), then saves; it reports whether it lost the lease."""
    import torch.distributed  # noqa: F401 (imported before any thread starts)

    from podtrain.ckpt.checkpointer import Checkpointer
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
                out.update(restored_record(state, model, opt, ctx))
            step = (state.step if state is not None else 0) + 1
            if scenario.kind == "lease" and injector is not None:
                _hold_for_renewals(injector)
                out.update(_intruder(root, scenario, injector))
            train_step(model, opt, step)
            seed_rngs(step)
            out["saving"] = step
            if scenario.local:
                ck.save(step, model, opt, None, train_state(step), local=True)
            ck.save(step, model, opt, None, train_state(step))
            out["lease_lost"] = ck.lease_lost
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


def _hold_for_renewals(injector: "Injector", deadline_s: float = 20.0) -> None:
    """Wait until the lease's thread has made ``LEASE_RENEWALS`` storage calls (renewals, failed
    ones too); a lease not renewed by ``deadline_s`` is a bug (I4)."""
    end = time.monotonic() + deadline_s
    while injector.counts["lease"] < LEASE_RENEWALS:
        if time.monotonic() > end:
            raise RuntimeError(f"the lease was renewed {injector.counts['lease']} times in {deadline_s:.0f} s "
                               f"(ckpt.lease_timeout_s={LEASE_TIMEOUT_S:g}: one renewal every "
                               f"{LEASE_TIMEOUT_S / 4:g} s)")
        time.sleep(0.02)


def run_files(root: Path, scenario: Scenario) -> dict[str, str]:
    """The bytes of this run (its run directory and ``ckpt.dir``, POSIX) but for the lease files
    its own renewals rewrite meanwhile (and their lock and temporary files)."""
    from podtrain.storage.posix import is_lock_name, is_temp_name

    found = {}
    for top in (root / "run", Path(scenario.ckpt_dir(root))):
        if top.exists():
            found.update({f"{top.name}/{k}": v for k, v in tree_hashes(top).items()
                          if not (Path(k).name == "lease" or is_lock_name(Path(k).name) or is_temp_name(Path(k).name))})
    return found


def _intruder(root: Path, scenario: Scenario, injector: "Injector") -> dict[str, Any]:
    """A second job (another process of this host, another job id) opens this run while the lease
    is held, renewed or not: it must be refused in one line and write nothing into the run."""
    before = run_files(root, scenario)
    result = root / f".intruder-{os.getpid()}.json"
    proc = mp.get_context("fork").Process(target=_intrude, args=(root, scenario, result, injector))
    proc.start()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    report = json.loads(result.read_text()) if result.exists() else {"outcome": f"no report (exit {proc.exitcode})"}
    result.unlink(missing_ok=True)
    after = run_files(root, scenario)
    return {"intruder": report, "intruder_changed": sorted(set(before.items()) ^ set(after.items()))[:3]}


def _intrude(root: Path, scenario: Scenario, result: Path, injector: "Injector") -> None:
    injector.index, injector._lock = 0, threading.Lock()  # no fault here: the lease thread may have held it
    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext
    from podtrain.errors import UserError

    out: dict[str, Any] = {}
    try:
        ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
        Checkpointer(root / "run", scenario.cfg(root), ctx).close()
        out["outcome"] = "took the run"
    except UserError as exc:
        out = {"outcome": "refused", "error": str(exc)}
    except BaseException as exc:  # noqa: BLE001 (judged by the parent)
        out = {"outcome": "bug", "error": f"{type(exc).__name__}: {exc}"}
    result.write_text(json.dumps(out))
    os._exit(0)


def run_stop_job(root: Path, scenario: Scenario, result: Path, injector: "Injector | None" = None) -> None:
    """The stop scenario's job: resume, train and save the next step (committed, as a scheduled
    save is), train one more, then SIGTERM (a real signal to this process, caught by podtrain's
    ``StopSignal``) and the loop's stop path on the Checkpointer as ``train/loop.py`` runs it:
    ``saving.stop_deadline`` (``ckpt.grace_s`` after the signal, less the exit's reserve), the
    current step saved and waited for by that deadline less ``saving.STOP_SAVE_RESERVE_S``
    (``saving.save_for_stop``), then ``Checkpointer.close`` by the deadline (``Trainer.close``);
    exit 143 (a ``UserError`` on the way: the CLI's 2). Reports ``signal_call`` (the job's
    storage calls before the signal) and ``stop_s`` (the signal to the end of the stop path)."""
    import signal as signals
    from types import SimpleNamespace

    import torch.distributed  # noqa: F401

    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext
    from podtrain.errors import UserError
    from podtrain.train import saving
    from podtrain.train.signals import StopSignal

    out: dict[str, Any] = {"outcome": "ok"}
    stop = StopSignal(("SIGTERM",))
    try:
        ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
        cfg = scenario.cfg(root)
        model, opt = tiny_model()
        ck = Checkpointer(root / "run", cfg, ctx)
        deadline = None
        try:
            state = ck.restore(model, opt, None, fresh=lambda: model.load_state_dict(tiny_model()[0].state_dict()))
            step = (state.step if state is not None else 0) + 1
            train_step(model, opt, step)
            seed_rngs(step)
            ck.save(step, model, opt, None, train_state(step))
            ck.wait()
            out["committed"] = step
            step += 1
            train_step(model, opt, step)
            seed_rngs(step)
            out["signal_call"] = injector.counts["job"] if injector is not None else 0
            os.kill(os.getpid(), signals.SIGTERM)
            end = time.monotonic() + 5.0
            while not stop.requested and time.monotonic() < end:  # the handler runs between bytecodes
                time.sleep(0.001)
            assert stop.requested, "SIGTERM was not caught by podtrain's StopSignal"
            # the loop's own functions, given the two parts of its state that they read here
            deadline = saving.stop_deadline(SimpleNamespace(cfg=SimpleNamespace(ckpt=cfg), stop_signal=stop))
            save_by = deadline.sooner(min(saving.STOP_SAVE_RESERVE_S, deadline.remaining() / 5))
            out["saving"] = step
            saved = ck.save(step, model, opt, None, train_state(step), deadline=save_by)
            ck.wait(deadline=save_by)
            if saved and ck.last_save.get("step") == step:
                out["saved"] = step
        finally:
            ck.close(deadline=deadline)
        out["exit_code"] = stop.exit_code
    except BaseException as exc:  # noqa: BLE001 (reported to the parent, which judges it)
        out["outcome"] = "user" if isinstance(exc, UserError) else "bug"
        out["exit_code"] = 2 if isinstance(exc, UserError) else 1
        out["error"] = f"{type(exc).__name__}: {exc}"
        if out["outcome"] == "bug":
            out["traceback"] = traceback.format_exc()[-2000:]
    finally:
        out["stop_s"] = stop.seconds_since_signal()
        stop.restore()
    result.write_text(json.dumps(out))


PEER_HOSTS = ("node0", "node1")


def run_peer_rank(root: Path, scenario: Scenario, result: Path, rank: int, port: int, phase: str,
                  injector: "Injector | None" = None) -> None:
    """One rank of the ``peers`` scenario's 2-rank job (forked, gloo over loopback), placed as a
    launcher places the only rank of node ``PEER_HOSTS[rank]`` (its host name, local rank 0 of 1,
    its own ``ckpt.local_dir``; one peer replica). ``phase``: ``setup`` (a fresh start: step 1
    to the local tier, then durably; step 2 to the local tier only, replicated to the other node),
    ``job`` (resume, the next step to the local tier then durably, each waited for: the job the
    harness enumerates and resumes with). Reports ``restore_calls`` (this rank's storage calls up
    to the end of its restore)."""
    import datetime

    import torch.distributed as dist

    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext
    from podtrain.errors import UserError

    host = PEER_HOSTS[rank]
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "PODTRAIN_HOSTNAME": host})
    out: dict[str, Any] = {"outcome": "ok", "rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        try:
            ctx = DistContext(env=ClusterEnv.detect(), backend="gloo", device=torch.device("cpu"), initialized=True)
            model, opt = tiny_model()
            ck = Checkpointer(root / "run", scenario.cfg(root, host), ctx)
            try:
                state = ck.restore(model, opt, None,
                                   fresh=lambda: model.load_state_dict(tiny_model()[0].state_dict()))
                out["restore_calls"] = injector.counts["job"] if injector is not None else 0
                if state is not None:
                    out.update(restored_record(state, model, opt, ctx), **{
                        "from": str(state.path), "peer_bytes": ck.restored.peer_bytes})
                step = (state.step if state is not None else 0) + 1
                train_step(model, opt, step)
                seed_rngs(step)
                out["saving"] = step
                ck.save(step, model, opt, None, train_state(step), local=True)
                ck.wait()
                ck.save(step, model, opt, None, train_state(step))
                ck.wait()
                if phase == "setup":
                    step += 1
                    train_step(model, opt, step)
                    seed_rngs(step)
                    ck.save(step, model, opt, None, train_state(step), local=True)
                    ck.wait()
            finally:
                ck.close()
            out["saved"] = step
        finally:
            import gc

            gc.collect()
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 (reported to the parent, which judges it)
        out["outcome"] = "user" if isinstance(exc, UserError) else "bug"
        out["exit_code"] = exc.exit_code if isinstance(exc, UserError) else 1  # 2, or a storage outage's 203
        out["error"] = f"{type(exc).__name__}: {exc}"
        if out["outcome"] == "bug":
            out["traceback"] = traceback.format_exc()[-2000:]
    result.write_text(json.dumps(out))


# -- the fault injector ------------------------------------------------------------------------------
class Injector:
    """Counts the storage calls of this process and fails call ``index`` of ``stream`` in ``mode``
    (0: none). Two streams: ``lease`` (the lease's renewal thread, ``LEASE_THREAD``) and ``job``
    (every other thread: the job's own, the writers', the replicator's, the lease's release)."""

    def __init__(self, index: int = 0, mode: str = "", log: Path | None = None, stream: str = "job") -> None:
        self.index, self.mode, self.log, self.stream = index, mode, log, stream
        self.counts = {"job": 0, "lease": 0}
        self.calls: list[str] = []
        self.lease_calls: list[str] = []
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
            stream = "lease" if threading.current_thread().name == LEASE_THREAD else "job"
            with injector._lock:
                injector.counts[stream] += 1
                number = injector.counts[stream]
                (injector.calls if stream == "job" else injector.lease_calls).append(
                    f"{method}({args[0] if args else ''})")
            hit = number == injector.index and stream == injector.stream and not injector.fired
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

    @property
    def count(self) -> int:
        """The job stream's storage calls so far."""
        return self.counts["job"]

    def _record(self, number: int, method: str, args) -> None:
        if self.log is not None:
            self.log.write_text(f"{number} {method}({args[0] if args else ''})")

    def fire(self, store, name: str) -> None:
        """Carry out the mode at the chosen call, before it happens (``kill_after`` is the caller's)."""
        from podtrain.storage.errors import AccessDenied, NoSpace, Transient

        where = store.where(name) if name else str(store.url)
        if self.mode == "kill_before":
            os._exit(KILLED)
        if self.mode == HANG:  # the storage never answers; the process's end (os._exit) ends this thread
            threading.Event().wait()
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
        if mode in ("transient", "denied", "nospace", "kill_before", HANG):
            try:
                self.injector.fire(self.store, self.name)
            except BaseException:
                self.inner.abort()
                raise
        self.inner.commit()
        if mode == "kill_after":
            os._exit(KILLED)


# -- running jobs in processes -----------------------------------------------------------------------
def _child(root: str, scenario: Scenario, result: str, index: int, mode: str, log: str, stream: str = "job") -> None:
    injector = Injector(index, mode, Path(log), stream)
    injector.install()
    (run_stop_job if scenario.kind == "stop" else run_job)(Path(root), scenario, Path(result), injector)
    Path(log + ".count").write_text(json.dumps({"count": injector.count, "calls": injector.calls,
                                                "lease_calls": injector.lease_calls}))
    code = json.loads(Path(result).read_text()).get("exit_code", 0) if Path(result).exists() else 1
    os._exit(code)  # no atexit of the parent's (pytest's) in the fork; the stop path's 143


def _peer_child(root: str, scenario: Scenario, result: str, index: int, mode: str, log: str,
                rank: int, port: int, phase: str) -> None:
    injector = Injector(index, mode, Path(log))
    injector.install()
    run_peer_rank(Path(root), scenario, Path(result), rank, port, phase, injector)
    Path(log + ".count").write_text(json.dumps({"count": injector.count, "calls": injector.calls}))
    os._exit(json.loads(Path(result).read_text()).get("exit_code", 0))  # as the CLI ends (2, 203, 1)


def spawn_job(root: Path, scenario: Scenario, index: int = 0, mode: str = "",
              deadline_s: float = JOB_DEADLINE_S, stream: str = "job", phase: str = "job") -> dict[str, Any]:
    """Run one job in a forked process (faulty at call ``index`` of ``stream`` in ``mode``); what
    it reported, with ``exit`` (its exit code, ``None`` when it outlived ``deadline_s`` and was
    killed), ``seconds``, ``count`` (storage calls made), ``calls`` and ``lease_calls``. A
    ``peers`` scenario's job is 2 ranks (``spawn_ranks``)."""
    if scenario.kind == "peers":
        return spawn_ranks(root, scenario, index, mode, deadline_s, phase)
    tag = f"{index}-{mode or 'none'}-{time.monotonic_ns()}"
    result, log = root / f".job-{tag}.json", root / f".job-{tag}.fault"
    proc = mp.get_context("fork").Process(target=_child, args=(str(root), scenario, str(result), index, mode,
                                                                str(log), stream))
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


PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
"""gloo's errors on a rank whose peer process ended (not a timeout: that is a hang)."""
LAUNCHER_GRACE_S = 3.0
"""After one rank of a 2-rank job ends with an error, how long the other gets before it is killed
(as torchrun stops a job's other workers when one fails; they would wait in a collective)."""


def spawn_ranks(root: Path, scenario: Scenario, index: int = 0, mode: str = "",
                deadline_s: float = JOB_DEADLINE_S, phase: str = "job") -> dict[str, Any]:
    """A ``peers`` job: 2 forked ranks. ``index`` numbers rank 0's storage calls, then rank 1's
    (the call ``index - n0`` of rank 1, where ``n0`` is ``scenario``'s fault-free count of rank
    0's calls: ``Scenario.rank0_calls``), the fault injected on that rank only. Returns the job's
    ``exit`` (the first failing rank's code, 0, or None past ``deadline_s``), ``ranks`` (each
    rank's report), ``count``/``calls`` over both ranks (``rank0: ...``, ``rank1: ...``) and the
    fields the judge reads, from rank 0's report (``outcome`` the worst of the two)."""
    from podtrain.launch.local import free_port

    n0 = scenario.rank0_calls
    fault_rank, at = (0, index) if not index or not n0 or index <= n0 else (1, index - n0)
    tag = f"{index}-{mode or 'none'}-{time.monotonic_ns()}"
    port = free_port()
    files = [(root / f".job-{tag}.r{r}.json", root / f".job-{tag}.r{r}.fault") for r in range(2)]
    procs = [mp.get_context("fork").Process(target=_peer_child, args=(
        str(root), scenario, str(files[r][0]), at if r == fault_rank else 0, mode if r == fault_rank else "",
        str(files[r][1]), r, port, phase)) for r in range(2)]
    t0 = time.monotonic()
    for proc in procs:
        proc.start()
    failed_at = None
    while any(p.is_alive() for p in procs) and time.monotonic() - t0 < deadline_s:
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > LAUNCHER_GRACE_S:
            break
        time.sleep(0.02)
    out: dict[str, Any] = {"exit": 0}
    overdue = failed_at is None and any(p.is_alive() for p in procs)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    codes = [p.exitcode for p in procs]
    out["exit"] = None if overdue else next((c for c in codes if c not in (0, -9)), 0)
    out["seconds"] = time.monotonic() - t0
    ranks, count, calls, fault = [], 0, [], ""
    for r, (result, log) in enumerate(files):
        report = json.loads(result.read_text()) if result.exists() else {"outcome": "killed", "code": codes[r]}
        counted = Path(str(log) + ".count")
        if counted.exists():
            seen = json.loads(counted.read_text())
            report["count"] = seen["count"]
            count += seen["count"]
            calls += [f"rank{r}: {c}" for c in seen["calls"]]
        if log.exists():
            fault = f"rank{r}: {log.read_text()}"
        ranks.append(report)
        for f in (result, log, counted):
            f.unlink(missing_ok=True)
    out.update({k: v for k, v in ranks[0].items() if k not in ("count",)})
    order = ["ok", "killed", "user", "bug"]
    out["outcome"] = max((rep.get("outcome", "killed") for rep in ranks), key=order.index)
    if KILLED in codes:  # a rank killed: the other's error (its peer gone mid-collective) is that kill's
        out["outcome"] = "killed"
    documented = [rep for rep in ranks if rep.get("outcome") == "user"]
    if out["outcome"] == "bug" and documented and all(
            rep.get("outcome") != "bug" or any(m in rep.get("error", "") for m in PEER_GONE) for rep in ranks):
        # one rank ended with its one line (exit 2 or 203); the other's collective then lost its
        # peer at once, as under torchrun, which stops the job's other workers: the job's end is
        # that line's. A rank left waiting until the group's timeout is not (a hang: I4).
        out["outcome"] = "user"
    out["error"] = next((rep.get("error") for rep in documented + ranks if rep.get("error")), None)
    out.update({"ranks": ranks, "count": count, "calls": calls, "fault": fault,
                "rank_counts": [rep.get("count", 0) for rep in ranks]})
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
          after_hashes: dict[str, str], leftovers: list[str], committed_before: int, kind: str = "save",
          mode: str = "", stream: str = "job") -> Verdict:
    """Check I1-I5 for one fault point from the faulty job's and the resumed job's reports;
    ``committed_before``: the newest step committed before the fault (the resume may not find less:
    a fault that made the job start afresh and its save then replace that step is caught here).
    ``kind`` (the scenario's), ``mode`` and ``stream`` (the fault's) add the scenario's own:
    ``lease``: the second job was refused and wrote nothing into the run (I3), and a failed
    renewal neither lost the lease nor stopped the job; ``stop``: the stop path ended with 143 (a
    permanent fault ``denied``/``nospace``: or the CLI's 2) within ``GRACE_S`` of the signal (I4);
    ``peers``: every rank of the resumed job restored the same save (I2)."""
    v = Verdict(point)
    killed = mode in ("kill_before", "kill_after")
    if kind == "lease" and "intruder" in fault:
        if fault["intruder"].get("outcome") != "refused":
            v.broken.append(f"I3: a second job opening the run while its lease was held: {fault['intruder']}")
        if fault.get("intruder_changed"):
            v.broken.append(f"I3: a second job changed the run's files: {fault['intruder_changed']}")
    if kind == "lease" and stream == "lease" and not killed:
        if fault.get("outcome") != "ok" or fault.get("saved") != START + 1:
            v.broken.append(f"I4: a failed renewal stopped the job ({fault.get('error') or fault.get('outcome')})")
        elif fault.get("lease_lost"):
            v.broken.append(f"I4: a failed renewal counted as a lost lease: {fault['lease_lost']}")
    if kind == "stop" and not killed and fault.get("exit") is not None:
        allowed = (REQUEUE, 2) if mode in ("denied", "nospace") else (REQUEUE,)
        if fault.get("exit") not in allowed:
            v.broken.append(f"I4: the stop path exited {fault.get('exit')}, not {REQUEUE} "
                            f"({fault.get('error') or 'no error'})")
        if fault.get("stop_s") is None or fault["stop_s"] > GRACE_S:
            v.broken.append(f"I4: the stop path took {fault.get('stop_s')} s after SIGTERM (ckpt.grace_s={GRACE_S:g})")
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
    if fault.get("outcome") == "ok" and fault.get("exit") == fault.get("exit_code", 0) \
            and fault.get("saved") is not None and step != fault.get("saved"):
        v.broken.append(f"I1: the job reported step {fault.get('saved')} saved, the resume found step {step}")
    for rank, other in enumerate(resumed.get("ranks", [])[1:], 1):
        if (other.get("restored"), other.get("state"), other.get("train_state"), other.get("draws")) != \
                (step, resumed.get("state"), resumed.get("train_state"), resumed.get("draws")):
            v.broken.append(f"I2: rank {rank} restored step {other.get('restored')}, another state than rank 0's "
                            f"(step {step})")
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
    space = Space(scenario, work, references(START + 2), s3)
    if scenario.kind == "peers":
        # durable step 1 (and local), then step 2 on the local tier only, replicated to the other
        # node; then node 1 is lost with its disk: the resume takes rank 1's share from node 0
        job = spawn_job(work, scenario, phase="setup")
        assert job.get("outcome") == "ok" and [r.get("saved") for r in job["ranks"]] == [START, START], job
        shutil.rmtree(work / "local" / PEER_HOSTS[1])
    else:
        for step in range(1, START + 1):
            job = spawn_job(work, scenario.resumed())
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
    """A fault-free job from the starting state: its storage calls, in order (``peers``: rank 0's,
    then rank 1's; the lease scenario's renewals in ``lease_calls``)."""
    space.reset()
    job = spawn_job(space.work, space.scenario)
    assert job.get("outcome") == "ok" and job.get("exit") == job.get("exit_code", 0), job
    if space.scenario.kind == "peers":
        # the point of the scenario: rank 1's share comes from node 0's replica of it
        assert [r.get("restored") for r in job["ranks"]] == [START, START] and job["ranks"][1]["peer_bytes"] > 0, job
        space.scenario.rank0_calls = job["rank_counts"][0]
    if space.scenario.kind == "lease":
        assert len(job["lease_calls"]) >= LEASE_RENEWALS and job["intruder"]["outcome"] == "refused", job
    return job


def fault_points(space: Space, job: dict[str, Any]) -> list[tuple[str, int]]:
    """Every fault point of a scenario's job (``job``: its fault-free run): each of its storage
    calls; ``lease``: and the first ``LEASE_RENEWALS`` calls of the renewal thread; ``stop``: the
    calls after the signal only (the stop path); ``peers``: the restore's calls on both ranks."""
    if space.scenario.kind == "peers":  # the restore's calls: rank 0's, then rank 1's (numbered after rank 0's)
        n0 = job["rank_counts"][0]
        return [("job", i) for i in range(1, job["ranks"][0]["restore_calls"] + 1)] + \
               [("job", n0 + i) for i in range(1, job["ranks"][1]["restore_calls"] + 1)]
    first = job.get("signal_call", 0) + 1 if space.scenario.kind == "stop" else 1
    points = [("job", i) for i in range(first, job["count"] + 1)]
    if space.scenario.kind == "lease":
        points += [("lease", i) for i in range(1, LEASE_RENEWALS + 1)]
    return points


def enumerate_calls(space: Space, modes=CALL_MODES, points: list | None = None,
                    say: Callable[[str], None] = print, counted: dict | None = None) -> tuple[int, list[Verdict]]:
    """Fail every storage call (``fault_points``, or those of ``points``: call numbers of the job
    stream, or ``(stream, number)``) of the scenario's job in every mode; resume after each and
    judge. ``counted``: the scenario's ``count_calls`` already made. Returns the number of fault
    points and the verdicts."""
    job = counted if counted is not None else count_calls(space)
    every = fault_points(space, job)
    scenario = space.scenario
    verdicts = []
    for stream, index in every if points is None else [p if isinstance(p, tuple) else ("job", p) for p in points]:
        for mode in modes:
            space.reset()
            before = space.other_run()
            fault = spawn_job(space.work, scenario, index, mode, stream=stream)
            leftovers = space.leftovers() if fault.get("exit") == 0 else []
            resumed = spawn_job(space.work, scenario.resumed())
            where = fault.get("fault") or f"{index}"
            point = f"{scenario.name}: {'renewal call' if stream == 'lease' else 'call'} {where} in mode {mode}"
            v = judge(point, fault, resumed, space.refs, before, space.other_run(), leftovers,
                      scenario.committed_before, scenario.kind, mode, stream)
            verdicts.append(v)
            if not v.held:
                say(f"BROKEN {point}: " + "; ".join(v.broken))
    return len(every), verdicts


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


def enumerate_replica_damage(space: Space, modes=DAMAGE_MODES,
                             say: Callable[[str], None] = print) -> tuple[int, list[Verdict]]:
    """``peers``: from the starting state (node 1's disk lost), damage each file of node 0's
    replica of rank 1 (the pieces, sidecar and marker the restore takes from the peer) in each
    mode, resume on both ranks, judge: step 2 restored whole, or the durable step 1, never a mix."""
    from podtrain.ckpt import replicas

    if space.scenario.kind != "peers":
        raise ValueError("replica damage is the peers scenario's")
    space.reset()
    node0 = next((space.work / "local" / PEER_HOSTS[0]).iterdir())
    folder = node0 / f"step_{START:06d}" / replicas.replica_dir(1)
    files = sorted(str(p.relative_to(space.work)) for p in folder.rglob("*") if p.is_file())
    verdicts = []
    for rel in files:
        for mode in modes:
            space.reset()
            before = space.other_run()
            _damage(space.work / rel, mode)
            resumed = spawn_job(space.work, space.scenario)
            point = f"{space.scenario.name}: {rel} {mode}"
            v = judge(point, {"exit": 0, "outcome": "damaged"}, resumed, space.refs, before, space.other_run(), [],
                      space.scenario.committed_before, "peers")
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
