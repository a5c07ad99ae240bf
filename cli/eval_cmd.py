"""`kvf eval RUN.jsonl ...`: score run files, print the summary, write CSV/markdown/plots."""
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvf.eval.report import evaluate, summary_table


def eval_command(
    run_files: Annotated[list[Path], typer.Argument(
        help="Run files (JSON Lines) written by `kvf run`; include the `full` and `reuse` runs "
             "for normalized F1 and TTFT ratio.")],
    out: Annotated[Path, typer.Option(
        "--out", help="Directory for summary.csv, summary.md and the plots.")] = Path("results"),
    complete_only: Annotated[bool, typer.Option(
        "--complete-only", help="Score only the questions every method/ratio of their dataset answered "
                                "(a sweep stopped mid-question then compares all methods on the same questions).")] = False,
):
    """Score runs: EM, F1, substring accuracy, normalized F1, fidelity to full, TTFT ratio."""
    summary = evaluate(run_files, out, complete_only)
    console = Console(width=max(Console().width, 140))  # wide enough for the table in logs too
    console.print(summary_table(summary))
    console.print(f"wrote {', '.join(Path(p).name for p in summary.attrs['written'])} to {out}/")
