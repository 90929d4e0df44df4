"""The progress bar of ``podtrain prepare`` (over input bytes; only on a terminal)."""

from __future__ import annotations

from typing import Any


class Progress:
    """A rich progress bar over input bytes on a terminal; silent otherwise."""

    def __init__(self, enabled: bool, total: int | None) -> None:
        """A bar over ``total`` bytes when ``enabled`` (``None``: not known beforehand, as for
        compressed inputs: the bar counts bytes and speed without an end); otherwise every call
        does nothing."""
        self.bar: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn
            from rich.progress import Progress as RichProgress
            from rich.progress import TextColumn, TimeRemainingColumn, TransferSpeedColumn
            self.bar = RichProgress(TextColumn("prepare"), BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("prepare", total=total)
            self.bar.start()

    def advance(self, n: int) -> None:
        """Count ``n`` more input bytes done."""
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def stop(self) -> None:
        """Remove the bar (it is transient) and give the terminal back."""
        if self.bar is not None:
            self.bar.stop()
