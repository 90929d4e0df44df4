"""The checkpoint layer under a fault at each storage call that loses work when mishandled.

A reduced form of ``bench/faultspace.py`` (``tests/faultspace.py`` has the harness and the
invariants I1-I5): one POSIX scenario (``keep_last=1``: retention deletes the only older
checkpoint), the calls of the save's commit, publish and retain phases and of the restore's
metadata, each failed in the modes that broke the promise before (a transient fault past the retry
budget, access denied, a kill just before or after), and each file of the newest checkpoint
damaged. Every point runs the job in a forked process, then resumes it in another and checks every
invariant. The whole enumeration (every call, every mode, S3 too) is ``bench/faultspace.py``.

Then one point or two of each of the harness's other scenarios, the ones their property rests on:
the lease's first renewal round (both locations) failed, while a second job tries to open the run;
the stop path's commit never answering after SIGTERM, and the process killed right after it; the
restore from a peer's replica after a node's disk is lost, its reads of the replica refused.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

import faultspace as fs

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("faultspace")]

# (a pattern of the call, as the harness names it; the modes it is failed in)
POINTS = [
    (r"write_bytes\(step_000003/manifest\.json\)", ("kill_before", "kill_after", "transient")),  # the commit
    (r"write_bytes\(latest\)", ("transient", "denied", "kill_after")),                             # publish
    (r"delete\(step_000002/manifest\.json\)", ("transient", "denied")),                            # retain
    (r"delete_prefix\(step_000002/\)", ("transient", "denied", "kill_before")),
    (r"read_bytes\(step_000002/meta_00000\.json\)", ("transient", "denied")),                      # restore
]
"""The job resumes step 2 (``fs.START``), saves step 3 and, with ``keep_last=1``, deletes step 2."""


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    scenario = fs.Scenario("posix keep_last=1", lambda root: str(root / "shared"), keep_last=1)
    return fs.prepare_space(scenario, tmp_path_factory.mktemp("faultspace") / "work")


@pytest.fixture(scope="module")
def calls(space) -> list[str]:
    return fs.count_calls(space)["calls"]


def _index(calls: list[str], pattern: str) -> int:
    """The 1-based number of the first call matching ``pattern``."""
    return next(i for i, c in enumerate(calls) if re.fullmatch(pattern, c)) + 1


def test_the_job_makes_the_calls_the_points_name(calls):
    # the harness counts the real protocol: resume (the lease, the newest step), save, publish, retain
    for pattern, _ in POINTS:
        assert any(re.fullmatch(pattern, c) for c in calls), (pattern, calls)
    names = [c.split("(")[0] for c in calls]
    assert names.index("write_bytes") < len(names) - 1
    commit = _index(calls, r"write_bytes\(step_000003/manifest\.json\)")
    assert _index(calls, r"write_bytes\(latest\)") == commit + 1  # published right after the commit
    assert _index(calls, r"delete\(step_000002/manifest\.json\)") > commit  # retention only after


@pytest.mark.parametrize("pattern,modes", POINTS, ids=[p for p, _ in POINTS])
def test_a_fault_at_this_call_loses_nothing(space, calls, pattern, modes):
    index = _index(calls, pattern)
    n, verdicts = fs.enumerate_calls(space, modes=modes, points=[index])
    broken = [f"{v.point}: {'; '.join(v.broken)}" for v in verdicts if not v.held]
    assert not broken, broken
    assert len(verdicts) == len(modes) and n == len(calls)


def test_a_damaged_file_of_the_newest_checkpoint_falls_back_whole(tmp_path_factory):
    # keep_last=2: the step before the damaged one is there to fall back to (a damaged sidecar used
    # to crash the resume with a traceback)
    scenario = fs.Scenario("posix keep_last=2", lambda root: str(root / "shared"), keep_last=2)
    space = fs.prepare_space(scenario, tmp_path_factory.mktemp("damage") / "work")
    files, verdicts = fs.enumerate_damage(space, modes=("flip",))
    broken = [f"{v.point}: {'; '.join(v.broken)}" for v in verdicts if not v.held]
    assert not broken, broken
    assert files >= 6 and any("meta_00000.json" in v.point for v in verdicts)


def test_a_refused_read_of_a_local_marker_falls_back_to_the_durable_tier(tmp_path_factory):
    # it used to read as "not held here" and clear the rank's own local files, then crash
    scenario = fs.Scenario("posix + local tier", lambda root: str(root / "shared"), keep_last=1, local=True)
    space = fs.prepare_space(scenario, tmp_path_factory.mktemp("local") / "work")
    calls = fs.count_calls(space)["calls"]
    markers = [i for i, c in enumerate(calls, 1) if c == "read_bytes(step_000002/rank_00000.json)"]
    assert len(markers) >= 2  # the restore reads rank 0's marker more than once
    n, verdicts = fs.enumerate_calls(space, modes=("denied",), points=markers)
    broken = [f"{v.point}: {'; '.join(v.broken)}" for v in verdicts if not v.held]
    assert not broken, broken


# -- the lease, the stop path, restore from peers (tests/faultspace.py's lease, stop, peers kinds) --
def _held(verdicts) -> None:
    broken = [f"{v.point}: {'; '.join(v.broken)}" for v in verdicts if not v.held]
    assert not broken, broken


def test_a_failed_lease_renewal_neither_stops_the_job_nor_lets_a_second_job_in(space):
    # ckpt.lease_timeout_s=2 (a renewal every 0.5 s); the job holds until its lease was renewed 4
    # times, a second job then tries to open the run, and the job saves. Points: the first renewal
    # round, both locations (the run directory's lease, then ckpt.dir's), each failed once
    # (past the retry budget; refused). The judge asks: the second job refused in one line and
    # nothing of the run changed (I3), the job saved and did not count the lease as lost (I4).
    lease = dataclasses.replace(space, scenario=fs.Scenario("posix lease", space.scenario.ckpt_dir, 1, kind="lease"))
    job = fs.count_calls(lease)
    assert job["lease_calls"][:2] == ["replace_if(lease)", "replace_if(lease)"], job["lease_calls"]
    verdicts = []
    for point, mode in ((("lease", 1), "transient"), (("lease", 2), "denied")):
        verdicts += fs.enumerate_calls(lease, modes=(mode,), points=[point], counted=job)[1]
    _held(verdicts)
    assert [v.point.split(": ", 1)[1] for v in verdicts] == [
        "renewal call 1 replace_if(lease) in mode transient", "renewal call 2 replace_if(lease) in mode denied"]


def test_sigterm_the_stop_path_ends_within_the_grace_period_with_the_newest_step_or_the_previous_one_whole(space):
    # The job commits step 3, trains step 4, gets SIGTERM and runs the loop's stop path
    # (ckpt.grace_s=4). Points: step 4's commit (its manifest) never answering (the bound: exit
    # 143 within the grace, step 3 whole), and the process killed right after it (step 4 whole).
    stop = dataclasses.replace(space, scenario=fs.Scenario("posix stop", space.scenario.ckpt_dir, 1, kind="stop"))
    job = fs.count_calls(stop)
    assert job["exit"] == fs.REQUEUE and job["saved"] == fs.START + 2 and job["stop_s"] < fs.GRACE_S, job
    index = _index(job["calls"], r"write_bytes\(step_000004/manifest\.json\)")
    assert index > job["signal_call"]  # a call of the stop path
    n, verdicts = fs.enumerate_calls(stop, modes=(fs.HANG, "kill_after"), points=[index], counted=job)
    _held(verdicts)
    assert len(verdicts) == 2 and n == job["count"] - job["signal_call"]


def test_restore_from_a_peer_replica_after_a_node_is_lost_is_one_save_whatever_fails(tmp_path_factory):
    # 2 forked gloo ranks as 2 nodes, K=1: durable step 1, local step 2 replicated, node 1's disk
    # lost; the resume takes rank 1's share from node 0's replica (count_calls checks it did).
    # Points, each refused: node 0's read of that replica's piece file, and its read of the
    # replica's marker as the repair plans its transfers (the enumeration found that one leaving
    # node 1 waiting to receive until the process group's timeout: a hang, I4). Both ranks must
    # fall back to durable step 1 together, and the resume after it restore exactly one save, bit
    # for bit (I2). The other calls of the restore, every mode, the damaged replica files:
    # bench/faultspace.py.
    scenario = fs.Scenario("posix peers", lambda root: str(root / "shared"), keep_last=1, kind="peers")
    space = fs.prepare_space(scenario, tmp_path_factory.mktemp("peers") / "work")
    job = fs.count_calls(space)
    restore = [i for _, i in fs.fault_points(space, job)]
    read = _index(job["calls"], r"rank0: open_read\(step_000002/replica_of_rank_00001/rank_00001\.safetensors\)")
    marker = [i for i in restore if job["calls"][i - 1] ==
              "rank0: read_bytes(step_000002/replica_of_rank_00001/rank_00001.json)"]
    assert read in restore and len(marker) >= 2  # read as the local steps are scanned, then by the repair
    verdicts = fs.enumerate_calls(space, modes=("denied",), points=[read, marker[-1]], counted=job)[1]
    _held(verdicts)
    assert len(verdicts) == 2
