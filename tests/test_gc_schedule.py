"""Garbage collection on an agreed schedule (``train.gc_every``, train/gc_schedule.py).

Real ``podtrain train`` runs in this process (one rank, hand-made data): the collector's state and
every collection are observed through ``gc.isenabled`` and ``gc.callbacks`` (Python's own hooks),
the step number through a wrapper around ``Stepper.step`` that only records and calls the real one.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from podtrain.cli import main
from podtrain.train import step as step_module
from synthetic_data import make_data_dir

BASE = ["data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2", "log.progress=off",
        "monitor.watchdog=false", "eval.every=0", "log.every=5", "optim.warmup_steps=2",
        "monitor.straggler_every=0"]


class Cycle:
    """A reference cycle made per step: only the cycle collector frees it."""

    def __init__(self):
        self.me = self
        self.payload = bytearray(1 << 20)  # 1 MiB each: what an unbounded pile would cost


@pytest.fixture
def observed(monkeypatch):
    """Records, per step: whether automatic collection was on and how many of the cycles made so
    far were still alive; and every collection as (generation, steps done when it ran)."""
    seen = {"steps": [], "collections": [], "cycles": []}
    real_step = step_module.Stepper.step

    def step(self, micro_batches):
        alive = sum(ref() is not None for ref in seen["cycles"])
        seen["steps"].append((gc.isenabled(), alive))
        seen["cycles"].append(weakref.ref(Cycle()))  # unreachable at once, except through itself
        return real_step(self, micro_batches)

    def on_gc(phase, info):
        if phase == "stop":
            seen["collections"].append((info["generation"], len(seen["steps"])))

    monkeypatch.setattr(step_module.Stepper, "step", step)
    gc.callbacks.append(on_gc)
    yield seen
    gc.callbacks.remove(on_gc)


def _train(monkeypatch, repo, tmp_path, *overrides):
    monkeypatch.chdir(repo)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    return main(["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={tmp_path / 'run'}", *BASE,
                 *overrides])


def test_collections_run_at_the_scheduled_steps_only_and_cycles_stay_bounded(observed, monkeypatch, repo,
                                                                             tmp_path):
    enabled_before, thresholds = gc.isenabled(), gc.get_threshold()
    assert _train(monkeypatch, repo, tmp_path, "train.steps=11", "train.gc_every=3", "ckpt.every=8") == 0
    steps = observed["steps"]
    assert len(steps) == 11
    assert [enabled for enabled, _ in steps] == [False] * 11  # the automatic collector is off in steps
    # Set-up's one full collection before step 1; then generation 1 after steps 3, 6 and 9, a full
    # one at the save of step 8 and at the last step's save (11): nothing else while steps ran.
    during = [(gen, done) for gen, done in observed["collections"] if 1 <= done < 11]
    assert during == [(1, 3), (1, 6), (2, 8), (1, 9)], observed["collections"]
    assert (2, 0) in observed["collections"] and (2, 11) in observed["collections"]
    # The cycles made per step are freed at the scheduled collections, never piling up: at the
    # start of step k, those made since the last collection (after steps 3, 6, 8, 9) are alive.
    assert [alive for _, alive in steps] == [0, 1, 2, 0, 1, 2, 0, 1, 0, 0, 1]
    # Python's collector is back as it was: automatic collection on, nothing left frozen.
    assert (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()) == (enabled_before, thresholds, 0)


def test_gc_every_zero_leaves_pythons_automatic_collector(observed, monkeypatch, repo, tmp_path):
    assert gc.isenabled()
    assert _train(monkeypatch, repo, tmp_path, "train.steps=3", "train.gc_every=0", "ckpt.every=0") == 0
    assert [enabled for enabled, _ in observed["steps"]] == [True] * 3
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_negative_gc_every_is_one_line_and_exit_2(monkeypatch, repo, tmp_path, capsys):
    assert _train(monkeypatch, repo, tmp_path, "train.steps=3", "train.gc_every=-1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.gc_every" in err[0] and "-1" in err[0], err


def test_a_cycle_that_outlives_a_young_collection_is_freed_by_the_next_full_one():
    from podtrain.train.gc_schedule import GcSchedule

    schedule = GcSchedule(every=2, full_every=3)
    schedule.start()
    try:
        kept = Cycle()
        ref = weakref.ref(kept)
        schedule.after_step(2)  # a young collection while the cycle is alive: it moves to the oldest
        del kept
        schedule.after_step(3)  # not a scheduled step
        schedule.after_step(4)  # young: the oldest generation is not looked at
        assert ref() is not None
        schedule.after_step(6)  # the third scheduled collection is a full one
        assert ref() is None
        assert schedule.collections == 3
    finally:
        schedule.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0
