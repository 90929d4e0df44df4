"""Soak: a 2-rank run survives kill -9, SIGTERM, a corrupted checkpoint, a full disk and an S3
outage, bit-exactly.

    python bench/soak.py --minutes 10

First an uninterrupted reference run, then rounds until the time is up (the first always runs).
Each round is the same config in a fresh run directory on its own small tmpfs, relaunched after
every fault (`podtrain launch local CONFIG --nproc 2`, auto-resume) until it finishes:

* kill    SIGKILL of one random rank's worker at a random step (mid-step or mid-save);
* term    SIGTERM to the launcher at a random step: podtrain checkpoints that step and exits 143;
* enospc  before the launch the tmpfs is filled so that its first save (its second on a fresh
          run) finds a random fraction of one checkpoint file free and runs out of space mid-file:
          one line naming the culprit, exit 2; the soak frees the space;
* corrupt before a relaunch, bytes in the second half of the newest checkpoint's largest data file
          are inverted: resume must detect it and fall back to the checkpoint before.

After the rounds, the S3 round (``bench/soak_s3.py``, ``--s3-outage-s``, 150 s by default):
checkpoints on a local S3 server behind a fault proxy, throttled, through an outage the run must
train through, then an outage past ``ckpt.max_outage_s`` that must end with exit 203 and a rerun
that must resume; both must end with the reference's weights and losses.

Every round has each fault once (``--kinds``), in random order (corrupt before a random relaunch).
The plan is drawn when the round starts, so ``--seed`` replays it whatever the machine's speed; kill
and term are sent when metrics.jsonl shows their planned step (ckpt.every to 2 x ckpt.every - 1 steps
past the launch's resume point, so a checkpoint was written, and at least 2 x ckpt.every steps before
the end, so a soak slowed down by load still lands them before the run finishes); the disk is full
before the enospc launch starts, so no race with the run decides whether its save fails. A fault is
survived when its attempt ended as documented (README's exit codes), the next launch resumed from
the expected checkpoint (the newest one; for corrupt, the one before) and went past it. At the end
`podtrain export` of the round and of the reference must hold bit-identical weights, and every
logged loss (redone steps included) must equal the reference's at that step.

Only podtrain's public surface is used: the CLI, RUN_DIR/ckpt/step_*/, RUN_DIR/ckpt/latest and
metrics.jsonl. Exit status 0 when every fault kind occurred and was survived and every round
matched the reference; 1 otherwise. Every wait has a timeout; processes and mounts are cleaned up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import soak_procs as procs
from soak_args import parse_args
from soak_verdict import (KINDS, metrics_lines, outcome_problem, print_table, read_metrics, summary,
                          weights_verdict)

REPO = Path(__file__).resolve().parents[1]
PODTRAIN = [sys.executable, "-m", "podtrain.cli"]


@dataclass
class Fault:
    """One injected fault and what became of it."""

    kind: str
    round: int
    at_step: int  # the last step logged before it (corrupt: the checkpoint's step)
    detail: str
    expected_resume: int | None = None
    resumed: int | None = None
    redone: int = 0
    survived: bool | None = None  # None: not judged yet
    reason: str = ""


@dataclass
class Attempt:
    """One launch of a round: how it ended and which steps it logged."""

    fault: str | None
    code: int
    wall_s: float
    steps: list[int] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    output: str = ""

    @property
    def resumed(self) -> int | None:
        """The step it resumed from (the step before its first logged one)."""
        return self.steps[0] - 1 if self.steps else None


class Soak:
    """The reference run, the rounds and the verdict (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.faults: list[Fault] = []
        self.rounds: list[dict] = []
        self.active: list[subprocess.Popen] = []
        self.mounts: list[Path] = []
        self.ckpt_bytes = 0  # one checkpoint's size, from the reference run
        self.file_bytes = 0  # its largest data file's (one rank's tensors)
        self.plan: dict = {}  # this round's random choices, drawn when it starts
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    # -- launching ---------------------------------------------------------------------------
    def overrides(self, run_dir: Path, data: Path) -> list[str]:
        """The config of every run: tiny, few steps, a checkpoint every few steps, one log line
        per step (so redone steps and their losses are all visible)."""
        a = self.args
        return [f"run.dir={run_dir}", f"data.path={data}", f"train.steps={a.steps}",
                "data.seq_len=64", "train.micro_batch_size=2", f"train.global_batch_size={2 * a.nproc}",
                "optim.warmup_steps=2", "eval.every=0", f"ckpt.every={a.ckpt_every}", "ckpt.keep_last=2",
                "log.every=1", "log.progress=plain", "monitor.straggler_every=0", *a.set]

    def launch(self, run_dir: Path, data: Path, name: str) -> tuple[subprocess.Popen, Path]:
        """Start ``podtrain launch local`` in its own session, output to a log file."""
        out = self.logs / f"{name}.log"
        cmd = [*PODTRAIN, "launch", "local", str(REPO / "configs/demo.yaml"), "--nproc", str(self.args.nproc),
               *self.overrides(run_dir, data)]
        fh = open(out, "w")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        fh.close()
        self.active.append(proc)
        return proc, out

    def wait(self, proc: subprocess.Popen, what: str) -> int:
        """The launcher's exit code; a launcher still running after the timeout is killed with its
        whole tree and counts as a hang (code -1)."""
        try:
            code = proc.wait(timeout=self.args.attempt_timeout)
        except subprocess.TimeoutExpired:
            print(f"soak: {what} still running after {self.args.attempt_timeout} s: killed", flush=True)
            procs.kill_tree(proc.pid)
            proc.wait(timeout=30)
            code = -1
        self.active.remove(proc)
        procs.sweep({p.pid for p in self.active})  # a worker a dead agent left behind
        return code

    def start_export(self, run_dir: Path, out: Path) -> subprocess.Popen:
        """Start ``podtrain export RUN_DIR OUT``."""
        proc = subprocess.Popen([*PODTRAIN, "export", str(run_dir), str(out), "--force"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        self.active.append(proc)
        return proc

    def finish_export(self, proc: subprocess.Popen) -> str | None:
        """Wait for an export; returns its error output, None on success."""
        try:
            out, _ = proc.communicate(timeout=self.args.attempt_timeout)
        except subprocess.TimeoutExpired:
            procs.kill_tree(proc.pid)
            proc.communicate(timeout=30)
            out = "export timed out"
        self.active.remove(proc)
        return None if proc.returncode == 0 else out[-2000:]

    # -- the reference -----------------------------------------------------------------------
    def reference(self, data: Path) -> dict:
        """The uninterrupted run: its wall time, losses, checkpoint size and export."""
        run_dir = self.args.reference or self.work / "reference"
        t0 = time.monotonic()
        if self.args.reference is None:
            proc, log = self.launch(run_dir, data, "reference")
            code = self.wait(proc, "the reference run")
            if code != 0:
                raise RuntimeError(f"the reference run failed (exit {code}); see {log}:\n"
                                   f"{log.read_text()[-3000:]}")
        wall = time.monotonic() - t0
        steps, losses = read_metrics(run_dir, 0)
        if sorted(set(steps)) != list(range(1, self.args.steps + 1)) or not procs.latest_step(run_dir):
            raise RuntimeError(f"the reference run {run_dir} did not log steps 1-{self.args.steps} "
                               "and checkpoint: not a finished run of this config")
        if self.args.reference is not None:  # its wall time is unknown: "lost" counts the whole round
            wall = 0.0
        newest = procs.step_dirs(run_dir)[procs.latest_step(run_dir)]
        # Exported while the first round starts up (mostly one process importing at a time).
        exporting = self.start_export(run_dir, self.work / "export_reference")
        return {"wall_s": wall, "losses": losses, "ckpt_bytes": procs.dir_bytes(newest),
                "file_bytes": max(procs.data_file_sizes(newest)),
                "export": self.work / "export_reference", "exporting": exporting}

    # -- one round ---------------------------------------------------------------------------
    def round(self, index: int, data: Path, ref: dict) -> dict:
        """A fresh faulted run to the end, then its export compared with the reference's."""
        run_dir = self.work / f"round{index}"
        self.ckpt_bytes = ckpt = ref["ckpt_bytes"]
        self.file_bytes = ref["file_bytes"]
        if "enospc" in self.args.kinds:
            procs.mount_tmpfs(run_dir, ckpt * 5 + (32 << 20))  # keep_last=2, one being written, room
            self.mounts.append(run_dir)
        started = time.monotonic()
        ending = [k for k in KINDS if k != "corrupt" and k in self.args.kinds]
        plan = self.rng.sample(ending, len(ending)) + [None]
        # Before the relaunch after a random one of the other faults (never: not selected).
        corrupt_before = self.rng.randrange(1, len(plan)) if "corrupt" in self.args.kinds else len(plan)
        # Every other random choice is drawn now, whatever happens later: a seed replays the plan.
        c = self.args.ckpt_every
        self.plan = {"hold": {k: self.rng.randint(c, 2 * c - 1) for k in ("kill", "term")},
                     "leave": self.rng.uniform(0.2, 0.8), "kill_delay": self.rng.uniform(0.0, 0.3),
                     "kill_rank": self.rng.randrange(self.args.nproc), "corrupt": self.rng.randrange(1 << 31)}
        pending: list[Fault] = []
        attempts: list[Attempt] = []
        for n, kind in enumerate(plan):
            if n >= corrupt_before and not any(f.kind == "corrupt" and f.round == index for f in self.faults):
                pending += self.corrupt(run_dir, index)
            attempt, fault = self.attempt(run_dir, data, index, n, kind, pending)
            attempts.append(attempt)
            (run_dir / "filler").unlink(missing_ok=True)
            if fault is not None:
                self.faults.append(fault)
                fault.at_step = max(attempt.steps, default=fault.at_step)
                latest = procs.latest_step(run_dir)
                if fault.survived is None:
                    fault.expected_resume = latest
                    if kind == "term" and latest != max(attempt.steps, default=0):
                        fault.survived, fault.reason = False, (f"latest names step {latest}, but the run "
                                                               f"stopped at step {max(attempt.steps)}")
            # This launch's resume judged the faults before it; the fault that ended it is next.
            pending = [fault] if fault is not None and fault.survived is None else []
            if attempt.code == -1 or (kind is None and attempt.code != 0):
                break  # a hang or a failed final launch: the round cannot finish
        wall = time.monotonic() - started
        for f in pending:
            f.survived, f.reason = False, "the round ended before a relaunch could resume"
        result = self.compare(index, run_dir, attempts, ref)
        if run_dir in self.mounts:
            procs.unmount(run_dir)
            self.mounts.remove(run_dir)
        result.update(wall_s=wall, job_s=sum(a.wall_s for a in attempts), attempts=len(attempts),
                      launches=[{"ended_by": a.fault or "end", "code": a.code, "wall_s": round(a.wall_s, 1),
                                 "steps": [a.steps[0], a.steps[-1]] if a.steps else []} for a in attempts])
        result["lost_s"] = result["job_s"] - ref["wall_s"]
        return result

    def corrupt(self, run_dir: Path, index: int) -> list[Fault]:
        """Corrupt the newest checkpoint; the next launch must resume from the one before."""
        latest = procs.latest_step(run_dir)
        dirs = procs.step_dirs(run_dir)
        if latest == 0 or latest not in dirs:
            return []  # nothing saved yet: corrupt before the next relaunch instead
        target, offset = procs.corrupt_largest_data_file(dirs[latest], random.Random(self.plan["corrupt"]))
        fault = Fault("corrupt", index, latest, f"{target.relative_to(run_dir)} at byte {offset}",
                      expected_resume=max([s for s in dirs if s < latest], default=0))
        self.faults.append(fault)
        return [fault]

    def attempt(self, run_dir: Path, data: Path, index: int, n: int, kind: str | None,
                pending: list[Fault]) -> tuple[Attempt, Fault | None]:
        """One launch: inject ``kind`` into it (None: let it finish), then judge the faults that
        this launch's resume decides (``pending``)."""
        offset = metrics_lines(run_dir)
        fault = self.fill_disk(run_dir, index, pending) if kind == "enospc" else None
        t0 = time.monotonic()
        proc, log = self.launch(run_dir, data, f"round{index}_attempt{n}_{kind or 'final'}")
        if kind in ("kill", "term"):
            fault = self.fault_at_planned_step(proc, run_dir, offset, index, kind)
        code = self.wait(proc, f"round {index} attempt {n}")
        wall = time.monotonic() - t0
        steps, losses = read_metrics(run_dir, offset)
        output = log.read_text(errors="replace")
        attempt = Attempt(kind, code, wall, steps, losses, output)
        if fault is not None and fault.survived is None:
            fault.survived, fault.reason = outcome_problem(kind, code, output)
        self.judge(pending, attempt)
        if kind is None and code != 0:
            print(f"soak: round {index}: the final launch exited {code}; see {log}", flush=True)
        return attempt, fault

    def fill_disk(self, run_dir: Path, index: int, pending: list[Fault]) -> Fault:
        """Before an enospc launch: fill the tmpfs so that the launch's first save (on a fresh run
        its second, so that a checkpoint exists to corrupt) finds a random fraction of one rank's
        tensor file free. Done before the launch, not at a watched step: a run that outpaces a loaded soak
        could otherwise finish its saves before the disk is full. Until that save, retention
        deletes nothing (keep_last=2), so every earlier save fits in what is left."""
        latest, dirs = procs.latest_step(run_dir), procs.step_dirs(run_dir)
        corrupt = next((f for f in pending if f.kind == "corrupt"), None)
        resume = corrupt.expected_resume if corrupt is not None else latest
        fitting = 1 if not dirs else 0
        # Unfinished saves (newer than ``latest``) are removed when the launch starts: fill their room too.
        unfinished = sum(procs.dir_bytes(d) for s, d in dirs.items() if s > latest)
        # The save that must fit also needs room for the logs, metrics and tmpfs page rounding.
        room = fitting * (self.ckpt_bytes + (1 << 20))
        leave = room + int(self.file_bytes * self.plan["leave"])
        procs.fill(run_dir / "filler", max(64 << 10, leave - unfinished))
        failing = resume + (fitting + 1) * self.args.ckpt_every
        return Fault("enospc", index, failing, f"disk filled before the launch from step {resume}: the save "
                     f"of step {failing} finds {leave - room >> 10} KiB free")

    def fault_at_planned_step(self, proc: subprocess.Popen, run_dir: Path, offset: int, index: int,
                              kind: str) -> Fault:
        """Wait until metrics.jsonl shows the planned step past the resume point, then kill -9 a
        random rank or SIGTERM the launcher."""
        # At least ckpt.every steps past the resume point, so the launch saves at least once; at
        # least 2 x ckpt.every before the end, so a soak that lags the run still lands it.
        last = self.args.steps - 2 * self.args.ckpt_every
        target: list[int] = []

        def reached() -> bool:
            steps, _ = read_metrics(run_dir, offset)
            if steps and not target:
                target.append(min(last, steps[0] - 1 + self.plan["hold"][kind]))
            return proc.poll() is not None or (bool(steps) and max(steps) >= target[0])

        if not procs.wait_for(reached, self.args.attempt_timeout) or proc.poll() is not None:
            seen = max(read_metrics(run_dir, offset)[0], default=0)
            return Fault(kind, index, seen, "the run ended or stalled before the fault", survived=False,
                         reason=f"never reached the planned step {target[0] if target else '?'} "
                                f"(last logged step {seen}, exit {proc.poll()})")
        at = max(read_metrics(run_dir, offset)[0])
        if kind == "term":
            proc.send_signal(signal.SIGTERM)
            return Fault(kind, index, at, f"SIGTERM to the launcher at step {at} (planned {target[0]})")
        time.sleep(self.plan["kill_delay"])  # anywhere in a step, or in a save
        rank = self.plan["kill_rank"]
        pid = procs.worker_pids(proc.pid).get(rank)
        if pid is None:
            return Fault(kind, index, at, f"rank {rank} not found", survived=False, reason="no worker to kill")
        os.kill(pid, signal.SIGKILL)
        return Fault(kind, index, at, f"SIGKILL to rank {rank} (pid {pid})")

    def judge(self, pending: list[Fault], attempt: Attempt) -> None:
        """The faults before this launch are survived when it resumed where expected and went on."""
        resumed = attempt.resumed
        corrupt = next((f for f in pending if f.kind == "corrupt"), None)
        for f in pending:
            if corrupt is not None:  # the checkpoint this fault would resume from was corrupted
                f.expected_resume = corrupt.expected_resume
            f.resumed = resumed
            if resumed is None:
                f.survived, f.reason = False, f"the next launch logged no step (exit {attempt.code})"
            elif resumed != f.expected_resume:
                f.survived, f.reason = False, f"resumed from step {resumed}, expected {f.expected_resume}"
            elif max(attempt.steps) <= resumed:
                f.survived, f.reason = False, "the next launch made no progress"
            else:
                f.survived = True
        for f in pending:
            # Steps run twice: the fault that ended the last launch redoes back to the newest
            # checkpoint; a corruption costs the steps between that and the one before.
            if f.kind == "corrupt" and resumed is not None:
                f.redone = max(0, f.at_step - resumed)
            elif resumed is not None:
                back_to = corrupt.at_step if corrupt is not None else resumed
                f.redone = max(0, f.at_step - back_to)

    # -- comparison --------------------------------------------------------------------------
    def compare(self, index: int, run_dir: Path, attempts: list[Attempt], ref: dict) -> dict:
        """Weights (via ``podtrain export``) and every logged loss against the reference."""
        result = {"round": index, "weights": "not compared", "losses": "not compared"}
        if not attempts or attempts[-1].code != 0:
            return result
        out = self.work / f"export_round{index}"
        error = self.finish_export(self.start_export(run_dir, out))
        if ref["exporting"] is not None:
            ref_error, ref["exporting"] = self.finish_export(ref["exporting"]), None
            if ref_error:
                raise RuntimeError(f"export of the reference failed: {ref_error}")
        result["weights"] = f"export failed: {error}" if error else weights_verdict(ref["export"], out)
        mismatched = [(s, loss, ref["losses"].get(s)) for a in attempts for s, loss in a.losses.items()
                      if ref["losses"].get(s) != loss]
        logged = sum(len(a.losses) for a in attempts)
        result["losses"] = ("identical" if not mismatched else
                            f"{len(mismatched)}/{logged} differ, first at step {mismatched[0][0]}: "
                            f"{mismatched[0][1]!r} vs reference {mismatched[0][2]!r}")
        result["logged_steps"] = logged
        return result

    def cleanup(self) -> None:
        """Kill whatever is still running, unmount what is mounted."""
        for proc in list(self.active):
            procs.kill_tree(proc.pid)
            proc.wait(timeout=30)
        procs.sweep(set())
        for path in list(self.mounts):
            procs.unmount(path)


def prepare_data(work: Path, timeout: float) -> Path:
    """A small byte-level corpus from `podtrain prepare builtin`."""
    out = work / "data"
    done = subprocess.run([*PODTRAIN, "prepare", "builtin", "--out", str(out), "--builtin-bytes", "300000",
                    "--val-fraction", "0.1", "--workers", "1", "--no-progress"], cwd=REPO, capture_output=True,
                   text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"podtrain prepare failed: {(done.stdout + done.stderr)[-2000:]}")
    return out


def _stop(signum, _frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 when it passed."""
    args = parse_args(argv)
    if "enospc" in args.kinds:
        procs.reexec_in_mount_namespace()
    procs.become_subreaper()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, _stop)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    work = Path(tempfile.mkdtemp(prefix="podtrain-soak-"))
    soak = Soak(args, work)
    try:
        data = args.data or prepare_data(work, args.attempt_timeout)
        ref = soak.reference(data)
        print(f"soak: reference run {args.reference} reused" if args.reference else
              f"soak: reference run of {args.steps} steps took {ref['wall_s']:.1f} s", flush=True)
        while True:
            t0 = time.monotonic()
            result = soak.round(len(soak.rounds) + 1, data, ref)
            soak.rounds.append(result)
            print(f"soak: round {result['round']}: {result['attempts']} launches, {result['job_s']:.1f} s, "
                  f"weights {result['weights']}", flush=True)
            if time.monotonic() + (time.monotonic() - t0) > deadline:
                break
        figures, problems = summary(soak, ref, time.monotonic() - start)
        if args.s3_outage_s > 0:
            from soak_s3 import s3_round

            s3 = s3_round(soak, data, ref, args.s3_outage_s)
            print("soak: S3 round: " + ", ".join(f"{k} {v}" for k, v in s3.items() if k != "problems"), flush=True)
            for problem in s3["problems"]:
                print(f"soak: S3 round: {problem}", flush=True)
            figures["s3"] = s3
            figures["ok"] = figures["ok"] and not s3["problems"]
            problems = [*problems, *s3["problems"]]
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        print(f"soak: error: {err}", file=sys.stderr)
        return 2
    finally:
        soak.cleanup()
        if args.keep:
            print(f"soak: work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
