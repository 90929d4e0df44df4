"""The durable checkpoint writer's gloo group is made at its first use, not when the job starts.

Each gloo group runs a thread (``gloo_tcp_loop``) that wakes every 10 ms; on a CPU host with a
rank per core it preempts the ranks' compute (``bench/train_throughput.py`` measured ~3% of a
step for this one idle group). A job that has not saved or restored must not hold it; the first
save makes it on every rank at once, and a restore that loads a checkpoint makes it too. Real
ranks: 2 forked processes over gloo.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from multirank import gloo_context, run_ranks
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.config_sections import CkptSection


def gloo_loops() -> int:
    """Threads of this process that are a gloo device's event loop."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:
            pass
    return sum(name.startswith("gloo_tcp_loop") for name in names)


def _lifecycle(rank, world, run_dir):
    ctx = gloo_context()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    counts = {"start": gloo_loops()}
    ck = Checkpointer(Path(run_dir), CkptSection(), ctx)
    fresh = ck.restore(model, opt, None)
    counts["fresh_restore"] = gloo_loops()
    ck.save(1, model, opt, None, {"step": 1})
    ck.wait()
    counts["saved"] = gloo_loops()
    ck.close()
    ck2 = Checkpointer(Path(run_dir), CkptSection(), ctx)
    counts["reopened"] = gloo_loops()
    state = ck2.restore(model, opt, None)
    counts["restored"] = gloo_loops()
    ck2.close()
    return counts, fresh is None, state.step


def test_the_checkpoint_group_is_made_at_the_first_save_or_load(tmp_path):
    for counts, fresh, step in run_ranks(_lifecycle, 2, str(tmp_path / "run")):
        assert fresh and step == 1
        base = counts["start"]  # the default group's own loop
        assert counts["fresh_restore"] == base, f"a job that has neither saved nor loaded holds a gloo group: {counts}"
        assert counts["saved"] == base + 1, counts
        assert counts["reopened"] == base, f"the group outlived its writer, or was made before use: {counts}"
        assert counts["restored"] == base + 1, counts
