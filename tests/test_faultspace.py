"""The checkpoint layer under a fault at each storage call that loses work when mishandled.

A reduced form of ``bench/faultspace.py`` (``tests/faultspace.py`` has the harness and the
invariants I1-I5): one POSIX scenario (``keep_last=1``: retention deletes the only older
checkpoint), the calls of the save's commit, publish and retain phases and of the restore's
metadata, each failed in the modes that broke the promise before (a transient fault past the retry
budget, access denied, a kill just before or after), and each file of the newest checkpoint
damaged. Every point runs the job in a forked process, then resumes it in another and checks every
invariant. The whole enumeration (every call, every mode, S3 too) is ``bench/faultspace.py``.
"""

from __future__ import annotations

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
