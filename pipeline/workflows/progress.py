"""The progress bar that long work shows (build-cache, run, bench)."""
from __future__ import annotations

from rich.console import Console
from rich.progress import Progress, ProgressColumn


def progress_bar(console: Console, *columns: str | ProgressColumn) -> Progress:
    """A rich progress bar with `columns` (rich's defaults if none), gone once done: the summary tables
    keep the numbers. Off where nothing can draw it (output piped to a file or a CI log), where rich would
    only leave one empty line per bar."""
    return Progress(*columns, console=console, transient=True,
                    disable=not (console.is_terminal or console.is_jupyter))
