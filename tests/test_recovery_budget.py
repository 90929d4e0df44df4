"""The recovery budget of a restart: the goodput ledger's phases (pure and through the clock),
its line in ``podtrain report``, and the checkpointer's restore figures by source."""

from __future__ import annotations

import json
import time

from podtrain.plan.report import measured_split
from podtrain.train.goodput import GoodputClock, process_start_time, recovery_budget, recovery_line


def test_recovery_budget_phases_and_line():
    restore = {"restore_s": 1.5, "tier": "local", "bytes": {"local_disk": 4e6, "peers": 2e6, "durable": 0}}
    budget = recovery_budget(100.0, 108.0, 111.0, 115.0, 116.25, restore)
    assert budget == {"lost_at": 100.0, "lost_to_start_s": 8.0, "start_to_group_s": 3.0, "startup_s": 4.0,
                      "restore_s": 1.5, "restore_bytes": restore["bytes"], "restore_tier": "local",
                      "first_step_s": 1.25, "total_s": 16.25}
    line = recovery_line(budget)
    assert line.startswith("recovery 16.2 s: lost -> process start (detection, relaunch, rendezvous) 8.0 s")
    assert "of which restore 1.5 s" in line and "2.0 MB peers, 0.0 MB durable" in line
    # no /proc (or a clock that disagrees): one span up to the process group, no restore split
    assert recovery_budget(100.0, None, 111.0, 115.0, 116.0, None) == {
        "lost_at": 100.0, "lost_to_group_s": 11.0, "startup_s": 4.0, "first_step_s": 1.0, "total_s": 16.0}
    start = process_start_time()
    assert start is not None and start <= time.time()


def test_the_clock_writes_a_restarts_budget_once_and_report_lists_it(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lost_at = process_start_time() - 5.0  # a killed attempt's last line: no closing goodput line
    metrics.write_text(json.dumps({"kind": "train", "step": 7, "time": lost_at}) + "\n")
    clock = GoodputClock(time.time())
    clock.load_history(metrics)
    clock.note_restore({"restore_s": 0.25, "tier": "local", "bytes": {"local_disk": 10, "peers": 4, "durable": 0}})
    clock.start_steps()
    clock.step_done(8)
    first, second = clock.record(), clock.record()
    budget = first["recovery"]
    assert "recovery" not in second
    assert 5.0 <= budget["total_s"] and budget["lost_to_start_s"] == 5.0 and budget["restore_bytes"]["peers"] == 4
    assert abs(budget["lost_to_start_s"] + budget["start_to_group_s"] + budget["startup_s"]
               + budget["first_step_s"] - budget["total_s"]) < 0.01
    # an attempt after a finished one recovers from nothing
    done = GoodputClock(time.time())
    metrics.write_text(json.dumps({"kind": "goodput", "step": 7, "time": lost_at, "ended": "finished"}) + "\n")
    done.load_history(metrics)
    done.start_steps()
    done.step_done(8)
    assert "recovery" not in done.record()
    records = [{"kind": "train", "step": 7, "step_time_s": 0.1, "data_wait_s": 0.0},
               {"kind": "train", "step": 8, "step_time_s": 0.1, "data_wait_s": 0.0, **first}]
    assert measured_split(records)["recoveries"] == [{"step": 8, **budget}]
