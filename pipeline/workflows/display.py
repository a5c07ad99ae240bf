"""What long work and its results look like on screen: progress bars, consoles, tables that fit."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table


def description_column() -> TextColumn:
    """A task's description as plain text: it holds dataset and file names, whose "[v2]" markup would swallow."""
    return TextColumn("{task.description}", style="progress.description", markup=False)


def progress_bar(console: Console, *columns: str | ProgressColumn) -> Progress:
    """A rich progress bar with `columns` (rich's defaults if none, the description as plain text), gone once
    done: the summary tables keep the numbers. Off where nothing can draw it (output piped to a file or a CI
    log), where rich would only leave one empty line per bar."""
    columns = columns or (description_column(), BarColumn(), TaskProgressColumn(), TimeRemainingColumn())
    # the ETA's speed over the last 10 minutes, not rich's 30 s: a stage that advances in big slices (the
    # dense index: 1,024 chunks per ~35 s on a 2-core CPU) would otherwise never show one
    return Progress(*columns, console=console, transient=True, speed_estimate_period=600,
                    disable=not (console.is_terminal or console.is_jupyter))


def size_text(nbytes: float | None) -> str:
    """A byte count as people read it: "512 B", "22.5 KiB", "3.4 GiB" ("-" for unknown)."""
    if nbytes is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024


def notice(console: Console) -> Callable[[str], None]:
    """A printer for plain notices in yellow (e.g. "waiting for another build"): the text as given, no markup."""
    return lambda message: console.print(message, style="yellow", markup=False, highlight=False)


def output_console(log_width: int, stderr: bool = False) -> Console:
    """A terminal keeps its own width (tables are fitted to it); a file or pipe gets `log_width`, wide
    enough that every table row stays on one line in a log. stderr: for what --json output must not mix with."""
    return Console(width=None if Console(stderr=stderr).is_terminal else log_width, stderr=stderr)


def fit_table(build: Callable[[list[str]], Table], columns: Sequence[str], droppable: Sequence[str],
              width: int, full_copy: str) -> Table:
    """build(columns), leaving out `droppable` columns in that order until the table's natural width fits
    `width`; a caption then names what was left out and where `full_copy` has every column. Rich would
    otherwise squeeze every column to a few letters and wrap each number over three lines."""
    shown = list(columns)
    table = build(shown)
    for name in droppable:
        if natural_width(table) <= width:
            break
        if name in shown:
            shown.remove(name)
            table = build(shown)
    if natural_width(table) > width:   # a few columns short still: one space between cells, not two,
        table.collapse_padding = True   # rather than every row wrapped over two lines
    left_out = [c for c in columns if c not in shown]
    if left_out:
        note = f"not shown at this width: {', '.join(left_out)} ({full_copy} has them)"
        table.caption = f"{table.caption}; {note}" if table.caption else note
    return table


def natural_width(table: Table) -> int:
    """The width a table takes when nothing limits it."""
    return Console(width=10_000).measure(table).maximum


def wrapped_label(label: str, width: int) -> str:
    """A plot's label of a run with knobs in lines of at most `width` characters, broken after the ':' between
    knobs, never inside one (a label with step 19's five knobs ran past both edges of a figure). A knob longer
    than `width` keeps its own line."""
    lines = [""]
    for part in label.split(":"):
        piece = part if lines == [""] else ":" + part
        if lines[-1] and len(lines[-1]) + len(piece) + 1 > width:   # + 1: the ":" a broken line ends with
            lines[-1] += ":"
            lines.append(part)
        else:
            lines[-1] += piece
    return "\n".join(lines)
