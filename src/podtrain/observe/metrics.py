"""metrics.jsonl: one JSON object per log interval, written by rank 0 and durable line by line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl (rank 0 only).

    Each line is flushed and fsynced on its own so a killed run keeps every interval it logged.
    """

    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled
        self._fh = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (rank 0; a no-op elsewhere)."""
        if self._fh is None:
            return
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        """Close the file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
