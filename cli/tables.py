"""Tables the CLI prints: the answers of a run (also `kvf demo`'s), and its means as `kvf eval` scores them."""
from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

MAX_ROWS = 40


def answers_rows_table(records: list[dict], title: str) -> Table:
    """method, answer, acc or F1 vs gold, F1 vs full prefill's answer, recomputed tokens, TTFT; one row per record.
    A question's records sit under one heading row (the question, its gold answers) and end with a line, so a
    narrow terminal spends its width on the answers rather than on repeating the question in a column."""
    from kvf.eval.metrics import accuracy, scored_by_accuracy, token_f1
    from kvf.pipeline.records import run_name
    # against gold, as kvf eval scores it: acc on a generated suite's tasks (a sentence around the right value is
    # right), else token F1
    acc = any(scored_by_accuracy(r.get("dataset", ""), r.get("gold_mode", "any")) for r in records)
    score = accuracy if acc else (lambda answer, golds, gold_mode: token_f1(answer, golds))
    table = Table(title=Text(title), expand=True)   # Text: a path's or a document's [brackets] are not markup
    table.add_column("method", max_width=20)   # a long labelled name wraps, and leaves the answers their width
    table.add_column("answer", overflow="fold", ratio=1)
    for col in ("acc" if acc else "F1", "vs full", "recomp.", "TTFT ms"):
        table.add_column(col, justify="right", no_wrap=True)
    shown = records[:MAX_ROWS]
    f1_full = f1_to_full(records)
    for i, r in enumerate(shown):
        if i == 0 or shown[i - 1]["question"] != r["question"]:
            heading = Text(r["question"], style="bold")
            heading.append("\ngold: " + (" / ".join(r["gold"]) or "-"), style="italic")
            table.add_row(Text("question", style="dim"), heading)
        method = run_name(r)                                                    # an ablation row shows its label
        gold = f"{score(r['answer'], r['gold'], r.get('gold_mode', 'any')):.2f}" if r["gold"] else "-"   # none given
        vs_full = f"{f1_full[i]:.2f}" if f1_full[i] is not None else "-"
        last = i == len(shown) - 1 or shown[i + 1]["question"] != r["question"]
        table.add_row(Text(method), Text(r["answer"]), gold, vs_full,
                      f"{r['recomputed_tokens']}/{r['chunk_tokens']}", f"{1000 * r['timings']['first_token']:.0f}",
                      end_section=last)
    against_gold = ("acc: the gold value is in the answer (RULER's score)" if acc else "F1: against gold")
    caption = [f"{against_gold}; vs full: F1 against full prefill's answer (what a fusion method keeps); "
               "recomp.: chunk tokens recomputed / chunk tokens"]
    if len(records) > MAX_ROWS:
        caption.append(f"first {MAX_ROWS} of {len(records)} records; all of them are in the run file (kvf eval scores them)")
    table.caption = Text("; ".join(caption))
    return table


def f1_to_full(records: list[dict]) -> list[float | None]:
    """Each record's answer F1 against full prefill's answer to its question (None where there is none): the
    one the record carries (--compare-full), else that of the full run among the records with the record's
    label, else the unlabelled one (an ablation row `-m kvfuse:propagate=off` is labelled, full is not), as
    kvf eval pairs them."""
    from kvf.eval.metrics import token_f1
    full = {(r["qid"], r.get("label") or ""): r["answer"] for r in records if r["method"] == "full"}
    scores = []
    for r in records:
        answer = r.get("full_answer") or full.get((r["qid"], r.get("label") or ""), full.get((r["qid"], "")))
        scores.append(token_f1(r["answer"], [answer]) if answer is not None else None)
    return scores


def answers_table(path: Path, opts) -> Table:
    """The answers of the questions this run covered, read back from its run file."""
    from kvf.pipeline.records import read_records
    from kvf.pipeline.workflows.run import plan_methods
    records = [r.model_dump(mode="json") for r in read_records(path)]
    if opts.label is not None:   # this run's records among others' in the file: its entries' labels carry --label
        labels = {p.label for p in plan_methods(opts)}   # (`-m NAME:KNOB=V` adds to it: "big check_layer=2")
        records = [r for r in records if r.get("label") in labels]
    return answers_rows_table(records, f"kvf run: {len(records)} answer{'' if len(records) == 1 else 's'} in {path}")


def means_table(path: Path, width: int) -> Table | None:
    """The run file's rows as `kvf eval FILE` scores them (means, 95% intervals against full prefill, TTFT
    ratio), where it holds more than one question: the answers table shows its first records only, and no
    mean. None for one question, whose answers say it all."""
    from kvf.errors import KvfError, warn
    from kvf.eval.report import load_runs, summarize, summary_table, with_pooled_tasks
    records = load_runs([path])
    questions = records.qid.nunique()
    if questions < 2:
        return None
    try:
        summary = summarize(with_pooled_tasks(records))
    except KvfError as e:   # the answers are written; `kvf eval` says the same, with its fix
        warn(f"no means table for {path}: {e}")
        return None
    table = summary_table(summary, f"kvf run: means over {questions} questions", width, full_copy="it")
    note = f"as `kvf eval {path}` scores the file (it also writes every pair's test, plots and summary.md)"
    table.caption = Text(f"{note}; {table.caption}" if table.caption else note)   # the path's [brackets]: not markup
    return table
