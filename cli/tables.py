"""Tables the CLI prints: the answers of a run (also `kvf demo`'s)."""
from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

MAX_ROWS = 40


def answers_rows_table(records: list[dict], title: str) -> Table:
    """question, gold, method, answer, F1 vs gold, recomputed tokens, TTFT; one row per record."""
    from kvf.eval.metrics import token_f1
    table = Table(title=title)
    for col in ("question", "gold", "method", "answer", "F1", "recomputed", "TTFT ms"):
        table.add_column(col, overflow="fold", justify="right" if col in ("F1", "recomputed", "TTFT ms") else "left")
    for r in records[:MAX_ROWS]:
        method = r["method"] + (f"@{r['settings']['ratio']:g}" if r["method"] not in ("full", "reuse") else "")
        f1 = f"{token_f1(r['answer'], r['gold']):.2f}" if r["gold"] else "-"
        table.add_row(Text(r["question"]), Text(" / ".join(r["gold"]) or "-"), method, Text(r["answer"]), f1,
                      f"{r['recomputed_tokens']}/{r['chunk_tokens']}", f"{1000 * r['timings']['first_token']:.0f}")
    if len(records) > MAX_ROWS:
        table.caption = f"first {MAX_ROWS} of {len(records)} records; all of them are in the run file (kvf eval scores them)"
    return table


def answers_table(path: Path, opts) -> Table:
    """The answers of the questions this run covered, read back from its run file."""
    from kvf.pipeline.records import read_records
    records = [r.model_dump(mode="json") for r in read_records(path)]
    if opts.label is not None:
        records = [r for r in records if r.get("label") == opts.label]
    return answers_rows_table(records, f"kvf run: {len(records)} answers in {path}")
