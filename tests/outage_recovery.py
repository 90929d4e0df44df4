"""The storage-outage recovery scenario of issue 34 (defect 7), shared by tests/test_stop_deadline.py
(a few seconds of outage) and bench/outage_recovery.py (the full 150 s form).

Two real ranks (forked, gloo: ``multirank.run_ranks``) train with checkpoints on the real S3 server
(moto) behind the tests' fault proxy (``s3_fault_proxy``). A director thread in this process:

1. waits for a committed checkpoint and a save of a newer step in flight, then turns on an outage
   (503 SlowDown on every request) for ``outage_s`` seconds;
2. turns it off and notes the step the run had logged then (``end_step``);
3. waits for the first checkpoint committed after that (asked of the server directly, not through
   the proxy): the newest state wins when its step is within ``ckpt.every`` of ``end_step`` (or
   it is the save in flight as the outage began, committed at once after it: ``newest_state_won``),
   not a stale save still backing off after the end, nor a due save held back by one;
4. ``after_steps`` steps later sends SIGTERM to both ranks (as torchrun's agent relays it).

``run_once`` returns what happened: steps trained during the outage, steps from its end to the
first committed save, each rank's exit code and the step it stopped at, the newest committed step.
Every wait has a deadline; a run that misses one ends with an ``AssertionError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

from multirank import run_ranks
from s3_fault_proxy import S3FaultProxy

STEP_KEY = re.compile(r"step_(\d+)/manifest\.json$")


def overrides(data: Path, run_dir: Path, url: str, every: int, grace_s: float) -> list[str]:
    """The runs' config: a tiny model, every step logged, saves every ``every`` steps to ``url``."""
    return [f"data.path={data}", f"run.dir={run_dir}", f"ckpt.dir={url}", "data.seq_len=32",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=1000000", "log.every=1",
            "eval.every=0", f"ckpt.every={every}", "ckpt.keep_last=2", f"ckpt.grace_s={grace_s:g}",
            # The step loop's bound at a due save: a cancelled save's try in flight (the CRT's own
            # retries of a 503) usually ends within it once the storage is back.
            "ckpt.save_wait_s=2", "monitor.watchdog=false", "monitor.straggler_every=0", "log.progress=off",
            "log.trackers=none", "optim.warmup_steps=2", "data.verify=false",
            # Hundreds of steps of a tiny model over 187 samples spike now and then; the guard's
            # rollback (to the last commit: step 3 at an outage's end) would measure the guard,
            # not the storage. Non-finite steps are still skipped.
            "guard.spike_factor=0"]


def _train_rank(rank: int, world: int, repo: str, run_dir: str, options: list[str]):
    """One rank: its pid where the director finds it, then ``podtrain train`` as under srun (a
    stopped torchrun worker would SIGTERM its parent: pytest here)."""
    from podtrain.config import load_config
    from podtrain.distributed.env import ClusterEnv
    from podtrain.train import loop

    pids = Path(run_dir) / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"rank_{rank}").write_text(str(os.getpid()))
    env = dataclasses.replace(ClusterEnv.detect(), launcher="srun")
    result = loop.train(load_config(os.path.join(repo, "configs/demo.yaml"), options), env)
    return result.step, result.exit_code


def records(run_dir: Path, kind: str) -> list[dict]:
    """The run's metrics records of ``kind`` (a line being written is skipped)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == kind:
            out.append(record)
    return out


def last_step(run_dir: Path) -> int:
    """The newest step the run has logged (0: none yet)."""
    return max([0] + [r["step"] for r in records(run_dir, "train")])


def committed(server, bucket: str) -> list[int]:
    """Steps with a manifest on the server (asked directly, not through the proxy), oldest first."""
    return sorted(int(m.group(1)) for key in server.keys(bucket) if (m := STEP_KEY.search(key)))


@dataclasses.dataclass
class Outcome:
    outage_steps: int = 0
    """Steps logged while the outage was on."""
    start_step: int = 0
    end_step: int = 0
    """The newest step logged when the outage ended."""
    first_commit: int | None = None
    """The step of the first checkpoint committed after the outage's end."""
    commit_s: float | None = None
    """Seconds from the outage's end to that commit being seen on the server."""
    commit_at: int | None = None
    """The newest step logged when that commit was seen."""
    signal_step: int | None = None
    """The newest step logged when SIGTERM was sent."""
    results: list = dataclasses.field(default_factory=list)
    """Each rank's (step stopped at, exit code)."""
    newest: int | None = None
    """The newest committed step after the run."""
    stop_s: float | None = None
    """Seconds from SIGTERM to the ranks' results."""
    problem: str | None = None
    """What the director could not see happen within its deadline (None: all of it)."""

    @property
    def steps_to_commit(self) -> int | None:
        """Steps trained from the outage's end until the first commit after it was seen."""
        return None if self.commit_at is None else self.commit_at - self.end_step

    def newest_state_won(self, every: int, prompt_s: float = 10.0) -> bool:
        """The first commit after the outage is of a step within ``every`` of its end, or it is the
        save that was in flight as the outage began, committed at once (within ``prompt_s``, about
        one save's time here) because its try in flight rode the outage out. A stale save still
        backing off after the end, or a due save held back by one, fails it."""
        if self.first_commit is None:
            return False
        if self.first_commit > self.end_step + every:
            return False
        return self.first_commit >= self.end_step - every or (
            self.first_commit >= self.start_step - every and self.commit_s is not None and self.commit_s <= prompt_s)


class Director(threading.Thread):
    """Runs steps 1-4 of the module doc against one run (a daemon; every wait has a deadline)."""

    def __init__(self, proxy: S3FaultProxy, server, bucket: str, run_dir: Path, outage_s: float,
                 after_steps: int, deadline_s: float):
        super().__init__(daemon=True, name="outage-recovery-director")
        self.proxy, self.server, self.bucket, self.run_dir = proxy, server, bucket, run_dir
        self.outage_s, self.after_steps, self.deadline_s = outage_s, after_steps, deadline_s
        self.outcome = Outcome()
        self.signalled_at: float | None = None
        self._halt = threading.Event()

    def _until(self, what: str, ready, limit_s: float):
        end = time.monotonic() + limit_s
        while not self._halt.is_set():
            value = ready()
            if value:
                return value
            if time.monotonic() > end:
                raise TimeoutError(f"not within {limit_s:.0f} s: {what}")
            time.sleep(0.05)
        raise TimeoutError(f"halted before: {what}")

    def run(self) -> None:
        out = self.outcome
        try:
            base = self._until("a first committed checkpoint", lambda: committed(self.server, self.bucket),
                               self.deadline_s)[-1]
            # The outage begins while the save of a newer step is in flight (it retries through it).
            self._until("a newer save in flight", lambda: any(
                r["step"] > base and not r["skipped"] for r in records(self.run_dir, "save")), self.deadline_s)
            self.proxy.outage(True)
            began, out.start_step = time.time(), last_step(self.run_dir)
            self._halt.wait(self.outage_s)
            self.proxy.outage(False)
            ended, out.end_step = time.time(), last_step(self.run_dir)
            t_end, before = time.monotonic(), set(committed(self.server, self.bucket))
            out.outage_steps = len({r["step"] for r in records(self.run_dir, "train") if began <= r["time"] <= ended})
            out.first_commit = self._until("a committed save after the outage", lambda: next(
                (s for s in committed(self.server, self.bucket) if s not in before), None), self.deadline_s)
            out.commit_s, out.commit_at = time.monotonic() - t_end, last_step(self.run_dir)
            target = max(out.first_commit, last_step(self.run_dir)) + self.after_steps
            self._until(f"step {target}", lambda: last_step(self.run_dir) >= target, self.deadline_s)
        except TimeoutError as exc:
            out.problem = str(exc)
        finally:
            self.proxy.outage(False)
            out.signal_step = last_step(self.run_dir)
            self.signalled_at = time.monotonic()
            for pid_file in sorted((self.run_dir / "pids").glob("rank_*")):
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except (OSError, ValueError):  # a rank already gone: run_ranks reports it
                    pass

    def halt(self) -> None:
        self._halt.set()
        self.join(10)


def run_once(repo: Path, data: Path, run_dir: Path, server, bucket: str, proxy: S3FaultProxy, outage_s: float,
             every: int = 3, after_steps: int = 3, grace_s: float = 30.0, deadline_s: float = 120.0) -> Outcome:
    """One run of the scenario on 2 forked ranks (see the module doc); the proxy must be the one
    ``AWS_ENDPOINT_URL`` names."""
    url = f"s3://{bucket}/ckpt"
    director = Director(proxy, server, bucket, run_dir, outage_s, after_steps, deadline_s)
    director.start()
    try:
        director.outcome.results = run_ranks(_train_rank, 2, str(repo), str(run_dir),
                                             overrides(data, run_dir, url, every, grace_s),
                                             timeout=outage_s + 3 * deadline_s + grace_s)
    finally:
        director.halt()
    out = director.outcome
    if director.signalled_at is not None:
        out.stop_s = time.monotonic() - director.signalled_at
    steps = committed(server, bucket)
    out.newest = steps[-1] if steps else None
    return out
