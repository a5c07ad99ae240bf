"""Per-question comparison of two runs: what each answered, against gold and against full prefill."""
from __future__ import annotations

import math
import re

import pandas as pd

from kvf.errors import KvfError, counted, percent_as_fraction
from kvf.eval.metrics import token_f1
from kvf.eval.stats import describe_difference, paired_bootstrap
from kvf.eval.report import (ADD_FULL, POOLED, auto_label, compare_full_records, primary_metric,
                             reference_rows, run_selector, suite_of)


def select(df: pd.DataFrame, selector: str, flag: str = "--compare") -> pd.DataFrame:
    """Records matching 'method[@ratio][:label]' (e.g. cacheblend@0.15, fusionrag@0.3:big-model, cacheblend@auto); `flag` is
    the option the selector came from, for the errors. The forms tables, plots and progress lines print a labelled
    run in, 'method@ratio [label]' and 'method [label]@ratio' (kvf bench, the ranking), name it too."""
    df = per_task(df)
    shown = re.fullmatch(r"(\S+) \[(.+)\](@\S+)?", selector.strip())
    text, _, label = (shown[1] + (shown[3] or ""), None, shown[2]) if shown else selector.partition(":")
    if not shown and "@" in label and "@" not in text and label not in set(df.label):   # -m's NAME:KNOB=VALUE@RATIO
        label, _, ratio = label.rpartition("@")
        text = f"{text}@{ratio}"
    method, _, ratio = text.partition("@")
    rows = df[df.method == method]
    if method == "full" and rows.empty:   # a sweep run with --compare-full alone holds full prefill's answers
        rows = compare_full_records(df)
    if ratio == "auto":   # as tables name a --ratio auto run: it is the run labelled auto
        label, ratio = auto_label(label or ""), ""
    if ratio:
        try:
            value = float(ratio)
        except ValueError:
            raise KvfError(f"{flag} {selector}: the ratio after @ must be a number, e.g. cacheblend@0.15") from None
        if fraction := percent_as_fraction(ratio):   # it would match no run
            raise KvfError(f"{flag} {selector}: the ratio after @ is a fraction of the chunk tokens, "
                           f"e.g. {method}@{fraction} for {value:g}%")
        rows = rows[(rows.ratio - value).abs() < 1e-9]
    if label:
        rows = rows[rows.label == label]
    elif (rows.label == "").any():   # a name without a label is the unlabelled run's, as run_names prints it
        rows = rows[rows.label == ""]
    if rows.empty:   # say what there is to choose from
        raise KvfError(f"{flag} {selector}: no records match; the runs there are {', '.join(run_names(df)[:8])}")
    return one_group(rows, f"{flag} {selector}", "narrow it with @ratio or :label")


def per_task(df: pd.DataFrame) -> pd.DataFrame:
    """The records without eval's pooled copies ("ruler-2048 (all tasks)"): a run over a suite's tasks is compared
    task by task, and each question counts once."""
    return df[~df.dataset.str.endswith(POOLED)]


def run_names(rows: pd.DataFrame) -> list[str]:
    """The selectors (method@ratio[:label]) of the runs in `rows`, sorted."""
    return sorted({run_selector(m, r, lab) for m, r, lab in zip(rows.method, rows.ratio, rows.label)})


def one_group(rows: pd.DataFrame, what: str, narrow: str) -> pd.DataFrame:
    """rows -> themselves if they are one run (method, label, variant, ratio; over one dataset or several, as a
    RULER suite's tasks are); else a one-line error naming the runs found and how to `narrow` the choice."""
    if rows.empty:
        raise KvfError(f"{what}: no records match; selectors look like method@ratio[:label], e.g. cacheblend@0.15")
    groups = rows.groupby(["method", "label", "variant", "ratio"]).ngroups
    if groups > 1:
        raise KvfError(f"{what} matches {groups} runs ({', '.join(run_names(rows)[:6])}); {narrow}")
    return rows


def per_question(df: pd.DataFrame, a: pd.DataFrame, b: pd.DataFrame, names: tuple[str, str] = ("A", "B")) -> pd.DataFrame:
    """One row per question both answered: gold, both answers, full's answer, each one's scores. A run may span
    several datasets (a RULER suite's tasks): each question is scored by its dataset's metric and full run.
    names: how the user named A and B (file and selector), for the line that refuses two runs with no question in
    common."""
    df = per_task(df)   # eval's records hold pooled copies; a and b come through select() or a run file, without them
    metric = {d: primary_metric(df[df.dataset == d]) for d in a.dataset.unique()}
    full = {d: reference_rows(df, d, "full", label=a.label.iloc[0]) for d in metric}
    a, b = a.set_index(["dataset", "qid"]), b.set_index(["dataset", "qid"])
    common = [key for key in a.index if key in b.index]
    if not common:   # said without the runs' names, it left the user to guess which file was the wrong one
        answered = [f"{name} ({counted(len(side), 'question')} of {', '.join(sorted(set(side.index.get_level_values(0))))})"
                    for name, side in zip(names, (a, b))]
        raise KvfError(f"{answered[0]} and {answered[1]} share no question; compare runs of the same questions")
    full_side = "A" if (a.method == "full").all() else "B" if (b.method == "full").all() else None
    rows = []
    for dataset, qid in common:
        ra, rb = a.loc[(dataset, qid)], b.loc[(dataset, qid)]
        full_answer = ra.full_answer if isinstance(ra.full_answer, str) else full[dataset].answer.get(qid)
        rows.append({"dataset": dataset, "qid": qid, "question": ra.question, "gold": " / ".join(ra.gold),
                     "answer_a": ra.answer, "answer_b": rb.answer, "full_answer": full_answer or "",
                     "metric": metric[dataset], "score_a": ra[metric[dataset]], "score_b": rb[metric[dataset]],
                     "fidelity_a": token_f1(ra.answer, [full_answer]) if full_answer else math.nan,
                     "fidelity_b": token_f1(rb.answer, [full_answer]) if full_answer else math.nan,
                     "kl_a": ra.kl_full, "kl_b": rb.kl_full, "answer_kl_a": ra.answer_kl, "answer_kl_b": rb.answer_kl,
                     "answer_agree_a": ra.answer_agree, "answer_agree_b": rb.answer_agree})
    table = pd.DataFrame(rows)
    table.attrs["full_side"] = full_side   # "A" or "B" when that run is full prefill: one fact of the table
    # the score column's name: the one metric of the datasets compared, else "gold" (each question its dataset's)
    used = {metric[d] for d, _ in common}
    table.attrs["metric"] = used.pop() if len(used) == 1 else "gold"
    return table


def comparison_table(table: pd.DataFrame, name_a: str, name_b: str):
    """Per question a heading row (qid, question, gold), then A's, B's and full prefill's answers with
    their scores: the answers get the width, so a narrow terminal keeps them readable."""
    from rich.table import Table
    from rich.text import Text
    metric = table.attrs["metric"]
    # Text, not markup: a labelled run's name ends in "[label]", which markup would swallow as a style tag
    out = Table(title=Text(f"{name_a} (A) vs {name_b} (B): {counted(len(table), 'question')}"), expand=True,
                caption=Text(f"A = {name_a}, B = {name_b}; {metric}: against gold"
                             + (" (each question by its dataset's metric)" if metric == "gold" else "") + "; "
                             "vs full: answer F1 against full prefill's answer"))
    out.add_column("", no_wrap=True)
    out.add_column("answer", overflow="fold", ratio=1)
    out.add_column(metric, justify="right", no_wrap=True)
    out.add_column("vs full", justify="right", no_wrap=True)
    full_is_a_side = table.attrs.get("full_side") is not None   # A or B is full prefill: its answer is already there
    for _, r in table.iterrows():
        heading = Text(str(r.qid), style="dim")
        if r.question:
            heading.append("  " + r.question, style="bold")
        heading.append("\ngold: " + (r.gold or "-"), style="italic")
        out.add_row(Text("question", style="dim"), heading)
        out.add_row("A", Text(r.answer_a), _fmt(r.score_a), _fmt(r.fidelity_a))
        out.add_row("B", Text(r.answer_b), _fmt(r.score_b), _fmt(r.fidelity_b), end_section=full_is_a_side)
        if not full_is_a_side:
            out.add_row(Text("full", style="dim"), Text(r.full_answer or "-", style="dim"), "", "", end_section=True)
    return out


def comparison_summary(table: pd.DataFrame) -> str:
    """The two runs over the questions compared, as eval's rows give them: each one's mean against gold and
    against full prefill, and A - B with its paired 95% bootstrap interval."""
    index = table.dataset + "/" + table.qid                  # a qid may recur across the datasets of a run
    parts = []
    measures = [(table.attrs["metric"], "score"), ("vs full", "fidelity"),
                # where both runs measured them (kvf run --compare-full since 2026-11-30)
                ("full's answer KL", "answer_kl"), ("full's answer tokens agreed", "answer_agree")]
    for measure, a, b in ((m, table[f"{c}_a"], table[f"{c}_b"]) for m, c in measures if f"{c}_a" in table):
        a, b = pd.Series(a.to_numpy(float), index=index).dropna(), pd.Series(b.to_numpy(float), index=index).dropna()
        if len(a) and len(b):
            diff = describe_difference(*paired_bootstrap(a, b))
            parts.append(f"{measure}: A {a.mean():.3f}, B {b.mean():.3f}, A - B {diff}")
    if table.attrs.get("full_side") is None and "full_answer" in table and not (table.full_answer != "").any():
        parts.append(f"vs full: - (no full prefill answered these questions: {ADD_FULL})")
    differ = int((table.answer_a != table.answer_b).sum())
    return (f"over {counted(len(table), 'question')}{pooled_over(table.dataset)} ({differ} answered differently): "
            + "; ".join(parts) + " (95% paired bootstrap intervals)")


def pooled_over(datasets: pd.Series) -> str:
    """'' for one dataset (or one suite's tasks, "ruler-2048/..."); else which ones the summary pools and how many
    questions each gave, e.g. ' of ruler-2048 (200) and ruler-4096 (200)' for `kvf compare results/ruler/runs/`."""
    counts = suite_of(datasets).value_counts(sort=False).sort_index()
    if len(counts) < 2:
        return ""
    named = [f"{name} ({n})" for name, n in counts.items()]
    return " of " + ", ".join(named[:-1]) + " and " + named[-1]


def _fmt(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"
