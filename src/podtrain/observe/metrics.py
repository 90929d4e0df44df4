"""metrics.jsonl: one JSON object per log interval, written by rank 0 and durable line by line,
then forwarded to the experiment trackers (``observe/trackers.py``) so they show the same numbers."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from podtrain.fsutil import naming
from podtrain.observe.records import METRICS_FILE, segment_record
from podtrain.observe.trackers import Tracker, open_trackers


class MetricsWriter:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl (rank 0 only).

    Each line is flushed and fsynced on its own so a killed run keeps every interval it logged.
    Each record then goes to ``trackers`` (TensorBoard, W&B, MLflow: see ``open_trackers``).
    """

    def __init__(self, path: Path, enabled: bool, trackers: Sequence[Tracker] = ()):
        self.path = path
        self.enabled = enabled
        self._fh = None
        self._trackers = list(trackers) if enabled else []
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (rank 0; a no-op elsewhere)."""
        if self._fh is None:
            return
        try:
            with naming(self.path):
                self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
                self._fh.flush()
                os.fsync(self._fh.fileno())
        except OSError:
            # A full or read-only disk: drop the file (its unflushed line with it) so that the
            # clean-up's close() cannot fail again and skip the rest of the run's teardown.
            fh, self._fh = self._fh, None
            with contextlib.suppress(OSError):
                fh.close()
            raise
        for tracker in self._trackers:
            tracker.log(record)

    def close(self) -> None:
        """Close the file and finish the trackers."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()


def open_run_metrics(run_dir: Path, enabled: bool, trackers: list[str], run_id: str,
                     config: dict[str, Any], step: int, tokens_seen: int) -> MetricsWriter:
    """The run's writer for an attempt continuing after ``step``: on rank 0 (``enabled``) with the
    trackers of ``log.trackers`` started, and the attempt's segment marker written first, so
    readers drop what a resumed attempt replaces (``observe/records.py``)."""
    writer = MetricsWriter(run_dir / METRICS_FILE, enabled,
                           open_trackers(trackers, run_dir, run_id, config, step) if enabled else ())
    writer.write(segment_record(step, tokens_seen, step > 0, run_id, time.time()))
    return writer
