"""bench/soak.py in the suite: one round of every fault against the uninterrupted reference.

The soak itself is the test (real torchrun, real gloo ranks, a real tmpfs filled up); this file
runs a short one and checks its verdict. SOAK_MINUTES is its time budget: the first round always
runs (reference + 4 launches + 2 exports: ~125-140 s of CPU on 2 cores), and each further round that
fits adds ~100 s. SOAK_KINDS can leave kinds out: each but corrupt saves one launch (~20 s of CPU).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_resume import make_data

pytestmark = pytest.mark.e2e

SOAK_MINUTES = 1.0
"""The soak's time budget here; raise it for more rounds (more random fault timings)."""

SOAK_SEED = 3
"""The fault plan (timings still vary), fixed so that the suite is deterministic: kill, enospc,
term, then corrupt before the last launch. A corrupted *only* checkpoint (a fall-back to a fresh
start) is covered by test_ckpt_layout's fork-based test; `bench/soak.py --kinds enospc,corrupt
--seed 759616109` replays such a plan. `bench/soak.py` alone draws a random plan each time."""

SOAK_KINDS = "kill,term,corrupt,enospc"
"""The fault kinds of each round: each but corrupt costs one launch (~20 s of CPU)."""


def _can_mount() -> bool:
    """The soak mounts a tmpfs in a private mount namespace: root, or unprivileged user namespaces."""
    unshare = shutil.which("unshare")
    flags = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
    return unshare is not None and subprocess.run([unshare, *flags, "true"], capture_output=True,
                                                  timeout=30).returncode == 0


@pytest.mark.skipif("enospc" in SOAK_KINDS and not _can_mount(),
                    reason="the disk-full fault needs a mount namespace (root or user namespaces)")
def test_soak_every_fault_survived_and_weights_bit_identical(repo, tmp_path):
    figures_path = tmp_path / "soak.json"
    data = make_data(tmp_path / "data")
    done = subprocess.run([sys.executable, str(repo / "bench/soak.py"), "--minutes", str(SOAK_MINUTES),
                           "--data", str(data), "--kinds", SOAK_KINDS, "--seed", str(SOAK_SEED),
                           "--json", str(figures_path), "--attempt-timeout", "240"],
                          cwd=repo, capture_output=True, text=True, timeout=900)
    assert figures_path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(figures_path.read_text())
    assert sorted(figures["by_kind"]) == sorted(SOAK_KINDS.split(","))
    for kind, counts in figures["by_kind"].items():
        assert counts["occurred"] >= 1, f"no {kind} fault occurred: {done.stdout[-3000:]}"
        assert counts["survived"] == counts["occurred"], f"{kind}: {figures['problems']}"
    assert figures["rounds"] and all(r["weights"] == "identical" and r["losses"] == "identical"
                                     for r in figures["rounds"]), figures["rounds"]
    # The corrupt fault fell back to an older checkpoint and redid steps; a SIGTERM redoes none.
    faults = figures["faults"]
    assert all(f["resumed"] < f["at_step"] for f in faults if f["kind"] == "corrupt"), faults
    assert all(f["redone"] == 0 for f in faults if f["kind"] == "term"), faults
    assert done.returncode == 0 and "soak: PASSED" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
