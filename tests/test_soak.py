"""bench/soak.py in the suite: one short round of the faults no other end-to-end test covers.

The soak itself is the test (real torchrun, real gloo ranks, a real tmpfs filled up); this file
runs a short one and checks its verdict: a full disk during a save (ENOSPC: exit 2, one line) and a
corrupted newest checkpoint (resume falls back to the one before), against an uninterrupted
reference, bit for bit. kill -9 and SIGTERM have their own exact-resume tests (test_resume.py,
test_launch_local_exit.py); `bench/soak.py --minutes M` covers all four kinds in every round.
Both kinds here are injected between launches (the disk is filled before the enospc launch, the
checkpoint corrupted before the final one), so no race with the run decides the outcome. The
reference is test_resume's uninterrupted run (conftest's ``resume_golden``, one per session, same
config): two launches (enospc, final) and two exports here.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_resume import OVERRIDES, STEPS

pytestmark = pytest.mark.e2e

SOAK_MINUTES = 0.1
"""The soak's time budget here: one round (the first always runs)."""

SOAK_STEPS, SOAK_CKPT_EVERY = STEPS, 3
"""test_resume's run (10 steps, ckpt.every=3): the fresh enospc launch saves step 3 and fails the
save of step 6; step 3 is then corrupted, so the final launch starts fresh (the fall-back path)."""

SOAK_SEED = 3
"""The fault plan (free-space fraction, corrupted bytes), fixed so that the suite is deterministic;
`bench/soak.py` alone draws a random plan each time."""

SOAK_KINDS = "enospc,corrupt"
"""The kinds only this test covers end to end (each kind but corrupt costs one launch, ~20 s CPU)."""


def _can_mount() -> bool:
    """The soak mounts a tmpfs in a private mount namespace: root, or unprivileged user namespaces."""
    unshare = shutil.which("unshare")
    flags = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
    return unshare is not None and subprocess.run([unshare, *flags, "true"], capture_output=True,
                                                  timeout=30).returncode == 0


@pytest.mark.skipif("enospc" in SOAK_KINDS and not _can_mount(),
                    reason="the disk-full fault needs a mount namespace (root or user namespaces)")
def test_soak_every_fault_survived_and_weights_bit_identical(repo, tmp_path, resume_golden):
    figures_path = tmp_path / "soak.json"
    data = resume_golden["data"]
    same_config = [arg for o in OVERRIDES for arg in ("--set", o)]
    done = subprocess.run([sys.executable, str(repo / "bench/soak.py"), "--minutes", str(SOAK_MINUTES),
                           "--steps", str(SOAK_STEPS), "--ckpt-every", str(SOAK_CKPT_EVERY),
                           "--data", str(data), "--kinds", SOAK_KINDS, "--seed", str(SOAK_SEED),
                           "--json", str(figures_path), "--attempt-timeout", "240", "--s3-outage-s", "0",
                           "--reference", str(resume_golden["run_dir"]), *same_config],
                          cwd=repo, capture_output=True, text=True, timeout=900)
    assert figures_path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(figures_path.read_text())
    assert sorted(figures["by_kind"]) == sorted(SOAK_KINDS.split(","))
    for kind, counts in figures["by_kind"].items():
        assert counts["occurred"] >= 1, f"no {kind} fault occurred: {done.stdout[-3000:]}"
        assert counts["survived"] == counts["occurred"], f"{kind}: {figures['problems']}"
    assert figures["rounds"] and all(r["weights"] == "identical" and r["losses"] == "identical"
                                     for r in figures["rounds"]), figures["rounds"]
    # The corrupt fault fell back to an older checkpoint (here: none) and redid steps; a SIGTERM redoes none.
    faults = figures["faults"]
    assert all(f["resumed"] < f["at_step"] for f in faults if f["kind"] == "corrupt"), faults
    assert all(f["redone"] == 0 for f in faults if f["kind"] == "term"), faults
    assert len(figures["rounds"]) == 1 and figures["rounds"][0]["attempts"] == 2, figures["rounds"]
    assert done.returncode == 0 and "soak: PASSED" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
