"""Turn run files (kvf.pipeline.records.RunRecord, one JSON line each) into a summary table and plots.

One summary row per (dataset, method, label, variant, ratio). Choices the metrics leave open:
- Gold metrics: EM, token F1, substring accuracy, and `acc`, the RULER score: the fraction of the
  gold values present in the answer. For QA datasets the gold list holds aliases (any one is
  right), so `acc` is substring accuracy; for RULER-style questions (gold_mode "all") every value
  must appear and `acc` is the share that does. Each dataset's primary metric is `acc` when its
  records need all values, else F1.
- Every row says how it differs from `full` and from `reuse` in the primary metric: the mean
  paired difference over the questions both answered, with a 95% paired bootstrap interval
  (eval/stats.py). Below MIN_QUESTIONS questions it says "too few questions to compare" instead.
- `full` and `reuse` references are looked up per dataset and label (falling back to unlabelled
  runs); if several records hold the same question the first in file order wins. Without a `full`
  run, a row's full reference is the full prefill `kvf run --compare-full` answered and timed in
  its own records (its note says so). For reuse, the
  record of the method's own variant is preferred, then `prefix`, then any.
- Normalized F1 (FusionRAG eq. 11) uses mean F1 over the questions the method, `full` and `reuse`
  share, and is reported only where full beats reuse significantly (the paired interval of
  F1_full - F1_reuse lies above 0, on at least MIN_QUESTIONS questions): otherwise its
  denominator is noise. Above 1 it means the method beat full prefill; the note says so.
- TTFT ratio is a ratio of means over the questions shared with `full` (or, without a `full` run, over those
  whose records carry the full prefill --compare-full timed).
- Fidelity F1 scores the method's answer against `full_answer` in its own record when present
  (same process, --compare-full), else against the `full` run's answer to the same question.
- All quality numbers are fractions in [0, 1].
"""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from kvf.errors import KvfError, warn
from kvf.eval.metrics import (accuracy, exact_match, is_suite_dataset, normalized_f1, scored_by_accuracy,
                              substring_accuracy, token_f1)
from kvf.eval.stats import MIN_QUESTIONS, describe_difference, mean_interval, paired_bootstrap, significant
from kvf.pipeline.files import check_writable_dir, read_listed
from kvf.pipeline.records import RunRecord, cut_answers_line, cut_in_gold, read_records, run_files_of
from kvf.pipeline.workflows.display import fit_table

TIMINGS = ("load", "select", "recompute", "first_token", "decode")
GROUP_KEYS = ["dataset", "method", "label", "variant", "ratio"]
BASELINE_ORDER = {"full": 0, "prefix": 1, "reuse": 2, "pcw": 3}
SUMMARY_COLUMNS = ["dataset", "method", "label", "variant", "ratio", "n", "metric", "em", "f1", "substring", "acc",
                   "vs_full", "vs_full_low", "vs_full_high", "vs_reuse", "vs_reuse_low", "vs_reuse_high",
                   "metric_low", "metric_high", "norm_f1", "fidelity_f1", "fidelity_low", "fidelity_high", "kl_full", "top1_agree", "ttft_ratio", "recomputed_frac", "ttft_s",
                   "load_s", "select_s", "recompute_s", "decode_s", "prompt_tokens", "note"]


# ---------------------------------------------------------------------------------------------
# reading run files

def record_row(rec: RunRecord, path: Path, lineno: int) -> dict:
    """One run record -> one flat row (what the summary needs, nothing model-specific)."""
    s = rec.settings
    commit = rec.provenance.commit if rec.provenance else None
    libraries = rec.provenance.libraries if rec.provenance else None
    row = {"file": str(path), "line": lineno, "qid": rec.qid, "dataset": rec.dataset, "method": rec.method,
           # the run that timed it: one `kvf run` writes one commit; a later session appending to the file, another
           "timed_by": f"{path} at {commit or 'an unrecorded commit'}",
           "label": rec.label or "", "variant": rec.variant, "ratio": rec.ratio, "ratio_mode": s.get("ratio_mode"),
           "question": rec.question,
           "answer": rec.answer,
           "gold": list(rec.gold), "gold_mode": rec.gold_mode, "full_answer": rec.full_answer,
           "kl_full": _number(rec.kl_full), "top1_agree": _number(rec.top1_agree_full),
           "answer_kl": _number(rec.answer_kl_full), "answer_agree": _number(rec.answer_agree_full),
           "t_full_first_token": _number(rec.full_first_token),
           "prompt_tokens": rec.prompt_tokens, "chunk_tokens": rec.chunk_tokens,
           "recomputed_tokens": rec.recomputed_tokens,
           # how the run was set up, for the report's "runs" table
           "setting": s.get("setting"), "retriever": s.get("retriever"), "top_k": s.get("top_k"),
           "chunk_size": s.get("chunk_tokens"), "model": s.get("model"), "settings": settings_key(s),
           "libraries": json.dumps(libraries, sort_keys=True) if libraries else None,
           # the request a question was asked as: compared to full's only where full was asked the same
           "request": json.dumps([list(rec.chunk_ids), s.get("model"), s.get("max_new_tokens")]),
           "max_new_tokens": s.get("max_new_tokens"),
           "cut_in_gold": cut_in_gold(rec.answer, rec.gold, rec.answer_tokens, s.get("max_new_tokens"))}
    for name in TIMINGS:
        row[f"t_{name}"] = float(getattr(rec.timings, name))
    return row


def settings_key(settings: dict) -> str:
    """How a record was run, as comparable text: every setting but the ratio (a summary row's own
    key, or per question under --ratio auto) and where the store lives (it is content-addressed)."""
    return json.dumps({k: v for k, v in settings.items() if k not in ("ratio", "ratio_mode", "store", "pipeline")},
                      sort_keys=True, default=str)


def mixed_settings(group: pd.DataFrame) -> str:
    """'' when every record of a summary row was run alike, else which settings differ."""
    if group.settings.nunique() <= 1:
        return ""
    decoded = [json.loads(text) for text in group.settings.unique()]
    names = sorted({name for settings in decoded for name in settings})
    differing = {name: sorted({json.dumps(settings.get(name)) for settings in decoded}) for name in names}
    return "mixed settings: " + ", ".join(f"{name}={'/'.join(values)}" for name, values in differing.items()
                                          if len(values) > 1)


def other_requests(group: pd.DataFrame, ref: pd.DataFrame, name: str) -> str:
    """'' when the reference run (full, reuse) was asked every common question as this row was; else how many
    questions it answered from other chunks, another model or another --max-new-tokens (e.g. `full` run
    with -k 5 and a method with -k 3: fidelity and TTFT ratio would compare different requests)."""
    if not len(ref):
        return ""
    mine = group.drop_duplicates("qid").set_index("qid").request
    common = mine.index.intersection(ref.index)
    differ = int((mine.loc[common] != ref.request.loc[common]).sum())
    return f"{name} was asked {differ} of {len(common)} questions with other chunks, model or --max-new-tokens" \
        if differ else ""


def _number(value) -> float:
    return math.nan if value is None else float(value)


def score(df: pd.DataFrame) -> pd.DataFrame:
    """Gold metrics per record (NaN for questions without gold answers)."""
    def per(fn):
        return [fn(a, g) if g else math.nan for a, g in zip(df.answer, df.gold)]
    df["em"], df["f1"], df["substring"] = per(exact_match), per(token_f1), per(substring_accuracy)
    df["acc"] = [accuracy(a, g, mode) if g else math.nan for a, g, mode in zip(df.answer, df.gold, df.gold_mode)]
    return df


def no_progress(items, description: str = ""):
    """evaluate()'s default `track`: the items as they are (the CLI passes a rich progress bar's track)."""
    return items


def load_runs(run_files: list[Path], track=no_progress) -> pd.DataFrame:
    """All records of all run files, scored against their gold answers."""
    if not run_files:
        raise KvfError("no run files given: pass one or more JSONL files written by `kvf run`")
    rows = [record_row(rec, path, i + 1) for path in track(run_files_of(run_files), description="reading run files")
            for i, rec in enumerate(read_records(path))]
    df = one_run_per_auto_ratio(score(pd.DataFrame(rows)))
    _check_duplicates(df)
    return df


def auto_label(label: str) -> str:
    """The label of a --ratio auto run: 'auto', after a label of its own."""
    return f"{label}-auto" if label else "auto"


def label_before_auto(label: str) -> str | None:
    """A --ratio auto run's own label ('' for none), from its auto_label; None for any other run's label."""
    if label == "auto":
        return ""
    return label.removesuffix("-auto") if label.endswith("-auto") else None


def run_selector(method: str, ratio: float, label: str) -> str:
    """How a summary row is named where a reader may pass it on to `kvf compare --a/--b`: method@ratio[:label]
    (method@auto for a --ratio auto run, named by the mode, not by its mean ratio)."""
    own = label_before_auto(label)
    if own is not None:
        return f"{method}@auto" + (f":{own}" if own else "")
    return f"{method}@{ratio:g}" + (f":{label}" if label else "")


def one_run_per_auto_ratio(df: pd.DataFrame) -> pd.DataFrame:
    """`--ratio auto` picks each question's own ratio, so its records made one run of n = 1 per question (and
    `kvf compare` could not name them). They are one run: labelled 'auto' (after a label of their own), at the
    mean ratio chosen; recomputed_frac says what each question recomputed."""
    auto = df.ratio_mode == "auto"
    if not auto.any():
        return df
    df = df.copy()
    df.loc[auto, "label"] = [auto_label(label) for label in df.label[auto]]
    df.loc[auto, "ratio"] = df[auto].groupby(["dataset", "method", "label", "variant"]).ratio.transform("mean")
    return df


def complete_questions(df: pd.DataFrame) -> pd.DataFrame:
    """Only the questions that every (method, label, variant, ratio) of their dataset answered.

    A sweep stopped mid-question (or still running) leaves its last question with some methods
    only; keeping the common questions compares every method on the same questions."""
    kept = []
    for dataset, rows in df.groupby("dataset", sort=False):
        answered = rows.groupby(["method", "label", "variant", "ratio"], dropna=False).qid.apply(set)
        kept.append(rows[rows.qid.isin(set.intersection(*answered))])
    out = pd.concat(kept)
    if out.empty:
        raise KvfError("--complete-only: no question was answered by every method of its dataset; "
                       "let the sweep finish a question, or leave --complete-only out")
    return out


def read_question_ids(path: Path, flag: str = "--exclude-questions") -> set[str]:
    """Question ids, one per line (blank lines and `#` comments ignored), e.g. a method's dev split."""
    qids = read_listed(path, flag, "question id")
    if not qids:
        raise KvfError(f"{flag}: {path} names no question id; write one id per line")
    return qids


def excluded_ids(listed, flag: str) -> tuple[set[str], str]:
    """What --exclude-questions (a file) or kvf.evaluate's exclude_questions (a file, or the ids themselves)
    names -> (the ids, where they came from, as the lines about them say it)."""
    if isinstance(listed, str) and not flag.startswith("--") and listed.strip() and not Path(listed).exists():
        # from Python a lone id reads as a file's name: say both readings
        raise KvfError(f"{flag}={listed!r}: no such file; pass a file of question ids (one per line), or the ids as a "
                       f"list: {flag}=[{listed!r}]")
    if isinstance(listed, (str, Path)) and str(listed).strip():
        return read_question_ids(Path(listed), flag), f"in {listed}"
    qids = set(listed) if isinstance(listed, (list, tuple, set, frozenset)) else None
    if not qids or not all(isinstance(q, str) and q.strip() for q in qids):
        raise KvfError(f"{flag}={listed!r}: pass a file of question ids (one per line), or a list of the ids")
    return qids, "given"


def without_questions(df: pd.DataFrame, listed, flag: str = "--exclude-questions") -> pd.DataFrame:
    """The records of every question but those listed (a split used to tune a method): a file of ids, or
    from Python the ids themselves."""
    (qids, where), scored = excluded_ids(listed, flag), set(df.qid)
    if not qids & scored:
        raise KvfError(f"{flag}: none of the {len(qids)} ids {where} is in the run files; "
                       f"check the ids (e.g. {sorted(qids)[0]!r}) against the records' qid")
    unknown = sorted(qids - scored)
    if unknown:   # a typo would leave a tuned-on question in the held-out scores without a word
        warn(f"{flag}: {len(unknown)} of the {len(qids)} ids {where} are in no run file "
             f"(e.g. {unknown[0]!r}); check them against the records' qid")
    out = df[~df.qid.isin(qids)]
    if out.empty:
        raise KvfError(f"{flag}: the ids {where} name every question of the run files; nothing is left to score")
    return out


# how to give rows a full prefill to compare with, where none answered their questions
ADD_FULL = "add -m full to the run, or re-run it with --compare-full"


def warn_timed_elsewhere(summary: pd.DataFrame) -> None:
    """Rows whose ttft_ratio divides by a full prefill that another run timed: said once, since the terminal's
    table shows no notes and such a ratio can read faster or slower than the method is."""
    odd = summary[summary._ttft_mixed & ~summary.dataset.str.endswith(POOLED)]
    if len(odd):
        first = odd.iloc[0]
        warn(f"{len(odd)} row(s) divide their TTFT by a full prefill another run timed (another file or commit; e.g. {first.dataset} "
             f"{run_selector(first.method, first.ratio, first.label)}), so their ttft_ratio mixes two runs' conditions: time both in one "
             "`kvf run` (-m full,... or --compare-full), or compare speed with `kvf bench`")


def warn_other_requests(summary: pd.DataFrame) -> None:
    """Rows compared with a full or reuse run that was asked other requests: said once per dataset, since
    their vs_full / vs_reuse, fidelity and TTFT ratio then compare different prompts."""
    for dataset, rows in summary.groupby("dataset", sort=True):
        odd = rows[rows._other_requests != ""]
        if len(odd):
            first = odd.iloc[0]
            warn(f"{dataset}: {len(odd)} row(s) are compared with runs asked other requests (e.g. "
                 f"{run_selector(first.method, first.ratio, first.label)}: {first._other_requests}); their comparisons with full and reuse mix different "
                 "prompts: run every method with the same -k, chunks, model and --max-new-tokens (or --compare-full)")


def warn_cut_answers(df: pd.DataFrame) -> None:
    """Answers that stopped at their run's --max-new-tokens partway through a gold answer score as wrong for a
    reason no method has (a RULER run with too few new tokens scored full prefill 0): say how many, and the fix."""
    cut = df[df.cut_in_gold.notna()]
    if cut.empty:
        return
    first = cut.iloc[0]
    warn(cut_answers_line(len(cut), len(df), sorted(set(cut.max_new_tokens.astype(int))),
                          (first.qid, run_selector(first.method, first.ratio, first.label), first.answer, first.cut_in_gold),
                          where=f" in {', '.join(sorted(set(cut.file)))}"))


def warn_unscored(summary: pd.DataFrame) -> None:
    """A dataset with neither gold answers nor full prefill's answers scores no quality at all (a user's own
    questions run without --compare-full): say so, and how to score it, rather than print a table of dashes."""
    for dataset, rows in summary.groupby("dataset", sort=True):
        gold = rows.apply(lambda r: r[r.metric], axis=1)
        if gold.isna().all() and rows.fidelity_f1.isna().all():
            warn(f"{dataset}: no question has gold answers and no record has full prefill's answer, so no quality is "
                 f"scored (TTFT and recompute fractions only); give the questions answers, or {ADD_FULL}")


def warn_no_full_reference(summary: pd.DataFrame) -> None:
    """Datasets scored against gold whose questions no full prefill answered: their vs_full, fidelity and TTFT
    ratio columns are dashes, which the terminal's table (it shows no notes) does not explain. Said once."""
    rows = summary[(summary.method != "full") & ~summary.dataset.str.endswith(POOLED)]
    gold = rows.apply(lambda r: r[r.metric], axis=1) if len(rows) else rows.dataset
    bare = rows.fidelity_f1.isna().groupby(rows.dataset).all() & gold.notna().groupby(rows.dataset).any()
    if bare.any():
        names = sorted(set(suite_of(pd.Series(bare[bare].index))))   # a suite's tasks by the suite's name
        warn(f"no full prefill answered the questions of {', '.join(names)}, so vs_full, fidelity_f1 and ttft_ratio are "
             f"'-' there: {ADD_FULL}")


def suite_of(datasets: pd.Series) -> pd.Series:
    """Each generated suite task's suite ("ruler-2048/alias" -> "ruler-2048"); any other dataset, itself."""
    return datasets.str.split("/").str[0]


def with_pooled_tasks(df: pd.DataFrame) -> pd.DataFrame:
    """A generated suite's records ("ruler-2048/alias", ...) once more under "ruler-2048 (all tasks)":
    per task n is small, pooled over tasks the paired intervals can separate methods."""
    tasks = df[df.dataset.map(is_suite_dataset)]
    suites = suite_of(tasks.dataset)
    many = tasks.groupby(suites).dataset.transform("nunique") > 1
    pooled = tasks[many].assign(dataset=suites[many] + POOLED)
    return pd.concat([df, pooled], ignore_index=True) if len(pooled) else df


def _check_duplicates(df: pd.DataFrame):
    # the same question twice in one group double-weights it: usually a run file passed twice
    dup = df[df.duplicated(GROUP_KEYS + ["qid"], keep=False)]
    if len(dup):
        first = dup.iloc[0]
        files = sorted(set(dup[dup.qid == first.qid].file))
        raise KvfError(f"question {first.qid} appears more than once for {first.method} "
                       f"(label {first.label or '-'}, variant {first.variant or '-'}, ratio {first.ratio}) in "
                       f"{', '.join(files)}: pass each run file once, or give runs of other settings a --label")


# ---------------------------------------------------------------------------------------------
# references: what `full` and `reuse` answered

def reference_rows(df: pd.DataFrame, dataset: str, method: str, variant: str | None = None,
                   label: str = "") -> pd.DataFrame:
    """One row per question of a baseline run on a dataset (first record wins), indexed by qid:
    the run with the same label when there is one, else the unlabelled one."""
    rows = df[(df.dataset == dataset) & (df.method == method)]
    if variant is not None:
        rows = rows[rows.variant == variant]
    same_label = rows[rows.label == label]
    rows = same_label if len(same_label) else rows[rows.label == ""]
    return rows.drop_duplicates("qid").set_index("qid")


def reuse_reference(df: pd.DataFrame, dataset: str, variant: str, label: str = "") -> pd.DataFrame:
    """The reuse run matching the method's variant, else the prefix variant, else any."""
    for v in (variant, "prefix", None):
        rows = reference_rows(df, dataset, "reuse", v, label)
        if len(rows):
            return rows
    return rows


def mixed_up_files(group: pd.DataFrame, ref: pd.DataFrame, fix: str) -> KvfError:
    """A row that shares no question with its reference run though both carry one dataset's name: the one line
    both references refuse it with."""
    return KvfError(f"run file {', '.join(sorted(set(group.file)))} has questions not in "
                    f"{', '.join(sorted(set(ref.file)))} (different dataset?): {fix}")


def _check_overlap(group: pd.DataFrame, full: pd.DataFrame):
    # same dataset label but no question in common with full: the user mixed up files, or ran no full on them
    if len(full) and not set(group.qid) & set(full.index):
        first = group.iloc[0]
        raise mixed_up_files(group, full, f"its {run_selector(first.method, first.ratio, first.label)} answers share "
                                          "no question with that full run; pass the full run of the same questions "
                                          "(or run them with -m full,... or --compare-full)")


def reuse_on_common(group: pd.DataFrame, reuse: pd.DataFrame, full: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The reuse reference, or none of it (with a note) where it answered none of the group's questions while full
    did: a later run pooled with a sweep (more questions, other ratios) need not run reuse again. With no full
    answers to vouch for the questions, a reuse run that shares none of them means mixed-up files: refused."""
    if not len(reuse) or set(group.qid) & set(reuse.index):
        return reuse, ""
    if not len(full):
        raise mixed_up_files(group, reuse, "pass the runs of one question set, or a full run of these questions")
    return reuse.iloc[:0], "vs_reuse: the reuse run answered none of these questions"


POOLED = " (all tasks)"


def primary_metric(rows: pd.DataFrame) -> str:
    """acc (RULER: share of gold values present) for a generated suite's tasks ("suite/task", and their
    pooled rows) and wherever answers need all gold values; else F1."""
    by_accuracy = [scored_by_accuracy(d, mode) for d, mode in zip(rows.dataset, rows.gold_mode)]
    return "acc" if any(by_accuracy) or rows.dataset.str.endswith(POOLED).any() else "f1"


# ---------------------------------------------------------------------------------------------
# per-group statistics

def fidelity_scores(group: pd.DataFrame, full: pd.DataFrame) -> pd.Series:
    """Per-question F1 of the method's answer against full prefill's answer, indexed by qid."""
    scores = {}
    for qid, answer, own_full in zip(group.qid, group.answer, group.full_answer):
        reference = own_full if isinstance(own_full, str) else (full.answer.get(qid) if len(full) else None)
        if isinstance(reference, str):
            scores[qid] = token_f1(answer, [reference])
    return pd.Series(scores, dtype=float)


def difference(group: pd.DataFrame, ref: pd.DataFrame, metric: str) -> tuple[float, float, float, int]:
    """Paired difference group - ref in `metric`, its 95% interval and n (questions with gold)."""
    if not len(ref):
        return math.nan, math.nan, math.nan, 0
    mine = group.set_index("qid")[metric].dropna()
    return paired_bootstrap(mine, ref[metric].dropna())


def normalized_f1_on_common(group, full, reuse) -> tuple[float, str]:
    """FusionRAG normalized F1 over the questions all three runs share; (value, note)."""
    if not len(full) or not len(reuse):
        missing = [name for name, ref in (("full", full), ("reuse", reuse)) if not len(ref)]
        return math.nan, f"normalized F1 needs {' and '.join(missing)} run{'s' if len(missing) > 1 else ''}"
    common = sorted(set(group.qid) & set(full.f1.dropna().index) & set(reuse.f1.dropna().index))
    if len(common) < MIN_QUESTIONS:
        return math.nan, f"normalized F1 undefined (too few questions: {len(common)})"
    gap, low, high, _ = paired_bootstrap(full.f1.loc[common], reuse.f1.loc[common])
    if not (low > 0):
        return math.nan, "normalized F1 undefined (full does not beat reuse significantly)"
    f1 = group.set_index("qid").f1.loc[common].mean()
    value = normalized_f1(f1, reuse.f1.loc[common].mean(), full.f1.loc[common].mean())
    notes = []
    if len(common) < len(group):
        notes.append(f"normalized F1 on {len(common)}/{len(group)} questions")
    if value is not None and value > 1:
        notes.append("normalized F1 > 1: F1 above full's")
    return (math.nan if value is None else value), "; ".join(notes)


def ttft_ratio(group: pd.DataFrame, full: pd.DataFrame) -> tuple[float, str, bool]:
    """mean(method TTFT) / mean(full TTFT) over the questions both timed, a note, and whether the ratio mixes two
    runs. Full's TTFT comes from the full prefill `kvf run --compare-full` timed beside the record, or else from the
    `full` run's record of the question. A run is a run file at a commit (a later session's records appended to a sweep's file
    carry a later one), and another run may have timed full on a busier or a quieter machine. So the ratio is taken
    over the questions full was timed by the row's own run, when those are at least MIN_QUESTIONS (or all of them);
    else over every question, and the note says that another run timed full on some."""
    own = group.drop_duplicates("qid").set_index("qid")
    mine = own.t_first_token.dropna()
    # full's TTFT per question and the run that timed it: --compare-full's, timed by this very run, first
    reference = own[["t_full_first_token", "timed_by"]].set_axis(["t", "timed_by"], axis=1).dropna()
    if len(full):
        others = full[["t_first_token", "timed_by"]].set_axis(["t", "timed_by"], axis=1).dropna()
        reference = pd.concat([reference, others.drop(reference.index, errors="ignore")])
    theirs = reference.t
    common = mine.index.intersection(theirs.index).sort_values()   # in qid order: the same sums as before
    same = common[(own.timed_by.loc[common] == reference.timed_by.loc[common]).to_numpy()]
    note, mixed = "", False
    if len(same) < len(common) and len(same) >= min(MIN_QUESTIONS, len(common)):
        note, common = f"ttft_ratio over the {len(same)} of {len(common)} questions full was timed by this run", same
    elif len(same) < len(common):
        note, mixed = f"ttft_ratio: full timed by another run on {len(common) - len(same)} of {len(common)} questions", True
    if not len(common) or theirs.loc[common].mean() <= 0:
        return math.nan, note, mixed
    return float(mine.loc[common].mean() / theirs.loc[common].mean()), note, mixed


def recomputed_fraction(group: pd.DataFrame) -> float:
    """Mean per-question recomputed_tokens / chunk_tokens (questions with chunk tokens only)."""
    has_chunks = group.chunk_tokens > 0
    if not has_chunks.any():
        return math.nan
    return float((group.recomputed_tokens[has_chunks] / group.chunk_tokens[has_chunks]).mean())


def compare_full_records(records: pd.DataFrame) -> pd.DataFrame:
    """The full prefill `kvf run --compare-full` answered and timed beside each record (same prompt, same process),
    as the records of a `full` run, scored: one per dataset and question, the first in file order."""
    rows = records[records.full_answer.map(lambda answer: isinstance(answer, str))].drop_duplicates(["dataset", "qid"])
    full = rows.assign(method="full", label="", variant="prefix", ratio=1.0, answer=rows.full_answer,
                       t_first_token=rows.t_full_first_token, kl_full=0.0, top1_agree=1.0,
                       # full against itself, where the records measured the answer (else they stay unmeasured)
                       answer_kl=rows.answer_kl.where(rows.answer_kl.isna(), 0.0),
                       answer_agree=rows.answer_agree.where(rows.answer_agree.isna(), 1.0),
                       recomputed_tokens=rows.chunk_tokens)
    return score(full)


def summarize_group(df: pd.DataFrame, group: pd.DataFrame) -> dict:
    """One summary row for one (dataset, method, label, variant, ratio)."""
    first = group.iloc[0]
    full = reference_rows(df, first.dataset, "full", label=first.label)
    from_records = not len(full) and first.method != "full"
    if from_records:   # no full run: the full prefill --compare-full answered beside each of this row's records
        full = compare_full_records(group).set_index("qid")
    _check_overlap(group, full)
    reuse, reuse_note = reuse_on_common(group, reuse_reference(df, first.dataset, first.variant, first.label), full)
    metric = primary_metric(df[df.dataset == first.dataset])
    norm, note = normalized_f1_on_common(group, full, reuse)
    note = reuse_note or note   # without common reuse answers normalized F1 is undefined for that reason
    vs_full = difference(group, full, metric) if first.method != "full" else (math.nan,) * 3 + (0,)
    vs_reuse = difference(group, reuse, metric) if first.method not in ("full", "reuse") else (math.nan,) * 3 + (0,)
    n_gold = int(group[metric].notna().sum())   # a user's own questions may leave some answers out
    partial_gold = f"gold metrics over the {n_gold} of {len(group)} questions with answers" \
        if 0 < n_gold < len(group) else ""
    other = "; ".join(text for text in (other_requests(group, full, "full") if first.method != "full" else "",
                                        other_requests(group, reuse, "reuse") if first.method not in ("full", "reuse")
                                        else "") if text)
    own = "full: its --compare-full answers" if from_records and len(full) else ""
    ttft, ttft_note, ttft_mixed = ttft_ratio(group, full)   # full against itself: one run, no note
    note = "; ".join(text for text in (note, mixed_settings(group), partial_gold, other, own, ttft_note) if text)
    fidelity = fidelity_scores(group, full)
    metric_low, metric_high = mean_interval(group.set_index("qid")[metric])
    fidelity_low, fidelity_high = mean_interval(fidelity)
    answer_kl_low, answer_kl_high = mean_interval(group.set_index("qid").answer_kl)   # NaN where unmeasured
    return {"dataset": first.dataset, "method": first.method, "label": first.label, "variant": first.variant,
            "ratio": first.ratio, "n": len(group), "n_gold": n_gold, "metric": metric, "em": group.em.mean(), "f1": group.f1.mean(),
            "substring": group.substring.mean(), "acc": group.acc.mean(),
            "vs_full": vs_full[0], "vs_full_low": vs_full[1], "vs_full_high": vs_full[2], "_vs_full_n": vs_full[3],
            "vs_reuse": vs_reuse[0], "vs_reuse_low": vs_reuse[1], "vs_reuse_high": vs_reuse[2],
            "_vs_reuse_n": vs_reuse[3],
            "metric_low": metric_low, "metric_high": metric_high, "fidelity_low": fidelity_low,
            "fidelity_high": fidelity_high,
            "norm_f1": norm, "fidelity_f1": _mean(fidelity), "kl_full": group.kl_full.mean(),
            "top1_agree": group.top1_agree.mean(), "answer_kl": group.answer_kl.mean(),
            "answer_kl_low": answer_kl_low, "answer_kl_high": answer_kl_high,
            "answer_agree": group.answer_agree.mean(), "ttft_ratio": ttft,
            "recomputed_frac": recomputed_fraction(group), "ttft_s": group.t_first_token.mean(),
            "load_s": group.t_load.mean(), "select_s": group.t_select.mean(),
            "recompute_s": group.t_recompute.mean(), "decode_s": group.t_decode.mean(),
            "prompt_tokens": group.prompt_tokens.mean(), "note": note, "_other_requests": other,
            "_ttft_mixed": ttft_mixed}


def _mean(series: pd.Series) -> float:
    return float(series.mean()) if len(series) else math.nan


def summarize(df: pd.DataFrame, track=no_progress) -> pd.DataFrame:
    """The summary table: one row per (dataset, method, label, variant, ratio), baselines first."""
    # each row reads its own dataset's records only (its full and reuse references): handing it just
    # those saves filtering every record again for every row
    groups = [(part, g) for _, part in df.groupby("dataset", sort=False)
              for _, g in part.groupby(GROUP_KEYS, dropna=False, sort=False)]
    rows = [summarize_group(part, g) for part, g in track(groups, description="scoring each method and ratio")]
    summary = pd.DataFrame(rows)
    order = summary.method.map(lambda m: BASELINE_ORDER.get(m, len(BASELINE_ORDER)))
    summary = summary.assign(_order=order).sort_values(["dataset", "_order", "method", "label", "variant", "ratio"])
    return summary.drop(columns="_order").reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# rendering

def format_cell(row: pd.Series, column: str) -> str:
    if column in ("vs_full", "vs_reuse"):
        return describe_difference(row[column], row[f"{column}_low"], row[f"{column}_high"], int(row[f"_{column}_n"]))
    value = row[column]
    if column == "n" and 0 < row.get("n_gold", value) < value:   # gold columns average fewer questions
        return f"{value} ({row.n_gold} with gold)"
    if column == "norm_f1" and isinstance(value, float) and math.isnan(value):
        return "undefined" if "undefined" in row.note else "-"
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            return "-"
        if column == "prompt_tokens":
            return f"{value:.0f}"
        return f"{value:.2f}" if column == "ratio" else f"{value:.3f}"
    return str(value) if value != "" else "-"


# the terminal shows what people compare; summary.csv / summary.md have every column
DISPLAY_COLUMNS = ["dataset", "method", "label", "variant", "ratio", "n", "f1", "acc", "vs_full", "vs_reuse",
                   "fidelity_f1", "top1_agree", "ttft_ratio", "recomputed_frac"]
MARKDOWN_COLUMNS = [c for c in SUMMARY_COLUMNS if not c.endswith(("_low", "_high"))]
ANSWER_COLUMNS = ["answer_kl", "answer_kl_low", "answer_kl_high", "answer_agree"]   # runs since 2026-11-30


def answers_measured(frame: pd.DataFrame) -> bool:
    """Whether some record (or summary row) of `frame` measured full's answer teacher-forced (answer_kl and
    answer_agree, recorded together by kvf run --compare-full since 2026-11-30)."""
    return bool(frame.get("answer_kl", pd.Series(dtype=float)).notna().any())


def summary_csv(summary: pd.DataFrame) -> pd.DataFrame:
    """summary.csv's rows and columns (`kvf eval --json` prints the same): eval's own bookkeeping left out, the
    answer columns in where records measured them."""
    return summary[with_answer_columns(summary, SUMMARY_COLUMNS)]


def with_answer_columns(summary: pd.DataFrame, columns: list[str]) -> list[str]:
    """columns, with answer_kl (its interval too where the columns hold intervals) and answer_agree after
    top1_agree where some record measured them (a table made from older records stays as it was)."""
    if not answers_measured(summary):
        return columns
    at = columns.index("top1_agree") + 1
    intervals = "fidelity_low" in columns
    return columns[:at] + [c for c in ANSWER_COLUMNS if intervals or not c.endswith(("_low", "_high"))] + columns[at:]


def _columns(summary: pd.DataFrame, columns: list[str]) -> list[str]:
    """Leave out the label column when no run has a label."""
    return [c for c in columns if c != "label" or (summary.label != "").any()]


def summary_markdown(summary: pd.DataFrame, columns=None) -> str:
    """The summary as a GitHub markdown table; vs_full / vs_reuse as 'mean [low, high]'."""
    columns = _columns(summary, columns or with_answer_columns(summary, MARKDOWN_COLUMNS))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for _, row in summary.iterrows():
        lines.append("| " + " | ".join(format_cell(row, c) for c in columns) + " |")
    return "\n".join(lines) + "\n"


# left out first when a terminal is narrow (summary.md keeps them); the variant and the dataset only
# where the rows stay distinct without them
DISPLAY_DROPPABLE = ["vs_reuse", "answer_kl", "top1_agree", "answer_agree", "recomputed_frac", "acc", "n"]


def summary_table(summary: pd.DataFrame, title: str = "kvf eval", width: int = 10_000, full_copy: str = "summary.md"):
    """The summary as a rich Table (for the terminal), no wider than `width` if leaving out columns
    (DISPLAY_DROPPABLE, in that order) can make it so; a caption then says that `full_copy` has them."""
    from rich.table import Table
    from rich.text import Text
    droppable = list(DISPLAY_DROPPABLE)
    if not summary.duplicated(["dataset", "method", "label", "ratio"]).any():
        droppable.append("variant")
    if summary.dataset.nunique() == 1:
        title = f"{title}: {summary.dataset.iloc[0]}"
        droppable.append("dataset")

    def build(columns: list[str]) -> Table:
        table = Table(title=Text(title))   # a dataset named by its file, "[v2]", is not markup
        for c in columns:
            table.add_column(c, justify="left" if c in ("dataset", "method", "label", "variant", "note") else "right")
        for _, row in summary.iterrows():
            table.add_row(*(Text(format_cell(row, c)) for c in columns))   # a label "[v2]" is not markup
        return table
    return fit_table(build, _columns(summary, with_answer_columns(summary, DISPLAY_COLUMNS)), droppable, width,
                     full_copy)


def summary_group(df: pd.DataFrame, row: pd.Series) -> pd.DataFrame:
    """The scored records behind one summary row."""
    return df[(df.dataset == row.dataset) & (df.method == row.method) & (df.label == row.label)
              & (df.variant == row.variant) & ((df.ratio - row.ratio).abs() < 1e-9)]


def _name(row: pd.Series) -> str:
    return row.method + (f" [{row.label}]" if row.label else "")


def lead_over(df: pd.DataFrame, best: pd.Series, runner_up: pd.Series) -> str:
    """How far `best` is ahead of `runner_up` in fidelity F1, with its paired 95% interval."""
    full = reference_rows(df, best.dataset, "full", label=best.label)
    lead, low, high, n = paired_bootstrap(fidelity_scores(summary_group(df, best), full),
                                          fidelity_scores(summary_group(df, runner_up), full))
    if not n:
        return ""
    if n < MIN_QUESTIONS:
        return f"; too few questions to compare with {_name(runner_up)} (n = {n})"
    verdict = "a clear lead" if significant(low, high) else "within noise: the interval includes 0"
    return (f"; ahead of {_name(runner_up)} ({runner_up.variant}, {runner_up.fidelity_f1:.3f}) by {lead:+.3f}, "
            f"95% CI [{low:+.3f}, {high:+.3f}] (paired bootstrap over {n} questions, {verdict})")


def most_faithful(summary: pd.DataFrame, ratio: float = 0.15, df: pd.DataFrame | None = None) -> list[str]:
    """One line per dataset: the method with the highest fidelity to full at `ratio` (answer F1
    against full's answer; ties broken by first-token top-1 agreement). With the scored records
    `df`, the line also says whether its lead over the runner-up is beyond noise."""
    lines = []
    at_ratio = summary[(summary.ratio - ratio).abs() < 1e-9]
    at_ratio = at_ratio[~at_ratio.method.isin(["full", "prefix"])]
    for dataset, rows in at_ratio.groupby("dataset"):
        rows = rows.dropna(subset=["fidelity_f1"])
        if rows.empty:
            continue
        ranked = rows.sort_values(["fidelity_f1", "top1_agree"], ascending=False, na_position="last")
        best = ranked.iloc[0]
        lines.append(f"- {dataset}: **{_name(best)}** ({best.variant}) keeps the most fidelity to full at "
                     f"{ratio:.0%} recomputation: answer F1 vs full {best.fidelity_f1:.3f}"
                     + (f", top-1 agreement {best.top1_agree:.2f}" if best.top1_agree == best.top1_agree else "")
                     + f" (n = {int(best.n)})"
                     + (lead_over(df, best, ranked.iloc[1]) if df is not None and len(ranked) > 1 else ""))
    return lines


# the runs table's columns: committed summary.md files must carry the same (tests/test_results.py), since one added
# here leaves every committed folder stale for `make verify` until it is remade
RUNS_COLUMNS = ("dataset", "questions", "setting", "context", "chunk tokens", "prompt tokens (mean)", "model",
                "libraries")
RUNS_HEADER = "| " + " | ".join(RUNS_COLUMNS) + " |"


def runs_markdown(df: pd.DataFrame) -> str:
    """What the summary was computed from, per dataset: questions, setting, retrieval, prompt size, model, and
    the torch and transformers releases that computed the records (several, '/'-joined, where runs differ)."""
    lines = [RUNS_HEADER, "|" + "---|" * len(RUNS_COLUMNS)]
    for dataset, rows in df.groupby("dataset", sort=True):
        setting = _one_value(rows.setting)
        if setting == "shared":
            context = f"{_one_value(rows.retriever) or 'bm25'} top-{_one_value(rows.top_k)} of the corpus"
        else:
            context = "the question's own passages" if setting == "per-question" else "-"
        lines.append(f"| {dataset} | {rows.qid.nunique()} | {setting or '-'} | {context} | "
                     f"{_one_value(rows.chunk_size) or '-'} | {rows.prompt_tokens.mean():.0f} | "
                     f"{_one_value(rows.model) or '-'} | {libraries_cell(rows.libraries)} |")
    return "\n".join(lines) + "\n"


def libraries_cell(column: pd.Series) -> str:
    """Each recorded library's releases ("torch 2.13.0+cpu, transformers 5.24.0/5.25.0"), and how many
    records name none (written before kvf recorded them)."""
    releases = defaultdict(set)
    for text in column.dropna():
        for name, release in json.loads(text).items():
            releases[name].add(release)
    cell = ", ".join(f"{name} {'/'.join(sorted(found))}" for name, found in sorted(releases.items()))
    unrecorded = int(column.isna().sum())
    if not unrecorded:
        return cell
    return f"{cell} ({unrecorded} records: not recorded)" if cell else "not recorded"


def _one_value(column: pd.Series):
    """The column's value when all rows agree, else the distinct values joined ("a/b")."""
    values = sorted({str(v) for v in column.dropna()})
    return values[0] if len(values) == 1 else "/".join(values) or None


def significance_lines(summary: pd.DataFrame) -> list[str]:
    """Which rows differ significantly from full and from reuse (95% paired intervals)."""
    lines = []
    for dataset, rows in summary.groupby("dataset", sort=True):
        metric = rows.metric.iloc[0]
        lines.append(f"- {dataset} ({metric}): significantly below full: {significant_rows(rows, 'full', -1)}; "
                     f"significantly above reuse: {significant_rows(rows, 'reuse', +1)}")
    return lines


def significant_rows(rows: pd.DataFrame, baseline: str, sign: int) -> str:
    """The rows whose paired interval against `baseline` lies wholly below it (sign -1) or above it (+1), 'none',
    or why none was tested: "none" alone read as "no method is below full" where no full run was there to test."""
    column = f"vs_{baseline}"
    references = ("full",) if baseline == "full" else ("full", "reuse")    # rows never compared with the baseline
    rows = rows[~rows.method.isin(references)]
    if not len(rows):
        return f"no method besides {' and '.join(references)} to test"
    tested = rows[rows[f"_{column}_n"] >= MIN_QUESTIONS]
    if not len(tested):
        most = int(rows[f"_{column}_n"].max())
        return (f"not tested (no {baseline} run on these questions)" if most == 0
                else f"not tested (at most {most} questions in common with {baseline}; {MIN_QUESTIONS} are needed)")
    found = [run_selector(r.method, r.ratio, r.label) for _, r in tested.iterrows()
             if significant(r[f"{column}_low"], r[f"{column}_high"]) and sign * r[column] > 0]
    return ", ".join(found) or "none"


def write_outputs(summary: pd.DataFrame, out_dir: Path, df: pd.DataFrame | None = None,
                  command: str | None = None, track=no_progress) -> list[Path]:
    """summary.csv, summary.md and the PNG plots; returns the paths written. df (the scored
    records) adds the "runs" table to summary.md; command goes in its header with the commit."""
    from kvf.eval.pairs import ALPHA, families, pairs_lines, pairwise_differences  # pairs builds on this module
    from kvf.eval.plots import plot_quality, plot_ranking, plot_ttft
    from kvf.pipeline.files import write_atomic
    from kvf.pipeline.workflows.provenance import git_commit
    written = [out_dir / "summary.csv", out_dir / "summary.md"]
    write_atomic(written[0], summary_csv(summary).to_csv(index=False))
    best = most_faithful(summary, df=df)
    header = (f"Made by `{command or 'kvf eval'}` at commit {git_commit() or 'unknown'}.\n\n")
    runs = "" if df is None else "Runs:\n\n" + runs_markdown(df) + "\nSummary:\n\n"
    body = (header + runs + summary_markdown(summary)
            + "\n`vs_full` / `vs_reuse`: mean paired difference in the dataset's primary metric (`metric`), with its "
              "95% paired bootstrap interval over the questions both answered. `fidelity_f1`: answer F1 against full "
              "prefill's answer to the same question. `kl_full` / `top1_agree`: KL divergence of the first-token "
              "distribution from full prefill's, and the share of first tokens equal to full's; recorded only by "
              "`kvf run --compare-full` (`-` without it). "
            + ("`answer_kl` / `answer_agree`: the same over full prefill's whole answer, each token predicted from "
               "full's tokens before it (teacher-forced): the mean KL divergence per token, and the share of tokens "
               "the method's cache would pick itself; they tell how far apart answers are where answer F1 only "
               "says that they differ. " if answers_measured(summary) else "")
            + "`ttft_ratio`: mean TTFT over full prefill's on the same "
              "questions, from the `full` run, or else from the full prefill `--compare-full` timed with each record.\n"
            + "\nSignificant differences (95% interval excludes 0):\n\n" + "\n".join(significance_lines(summary)) + "\n"
            + ("\nMost fidelity to full prefill at 15% recomputation:\n\n" + "\n".join(best) + "\n" if best else ""))
    if df is not None:
        pairs = pairwise_differences(df, summary, track)
        written.append(out_dir / "pairs.csv")
        write_atomic(written[-1], pairs.to_csv(index=False))
        measures = ("the primary metric vs gold, in fidelity to full, in full's answer tokens agreed (`answer_agree`) "
                    "and in full's answer KL per token (`answer_kl`, lower first)"
                    if (pairs.measure == "answer_agree").any() else "the primary metric vs gold and in fidelity to full")
        body += (f"\nMethod pairs that differ (`pairs.csv`), in {measures}: "
                 "paired difference with its 95% interval, listed when the Holm-adjusted permutation p-value within "
                 f"the dataset, ratio and measure is below {ALPHA}; "
                 f"pairs on fewer than {MIN_QUESTIONS} common questions are not tested.\n\n"
                 + ("\n".join(pairs_lines(pairs)) if len(pairs) else "- no pair has enough common questions") + "\n")
    write_atomic(written[1], body)
    # ranked bars per ratio: where the paired tests run (n >= MIN_QUESTIONS), and for a dataset run at one ratio
    # (an ablation), whose points on a ratio axis all sit on one vertical line
    per_ratio = [(dataset, ratio, rows) for dataset, ratio, rows in families(summary) if ratio is not None]
    ratios_of = Counter(dataset for dataset, _, _ in per_ratio)
    plots = [(out_dir / f"ranking_{_safe_name(dataset)}_ratio{ratio:g}.png",
              partial(plot_ranking, rows, f"{dataset} at recompute ratio {ratio:g}"))
             for dataset, ratio, rows in per_ratio if rows.n.max() >= MIN_QUESTIONS or ratios_of[dataset] == 1]
    plots += [(out_dir / f"quality_vs_ratio_{_safe_name(dataset)}.png", partial(plot_quality, summary, dataset))
              for dataset in summary.dataset.unique()]
    plots.append((out_dir / "ttft_vs_ratio.png", partial(plot_ttft, summary)))
    for path, draw in track(plots, description="drawing plots"):
        draw(path)
        written.append(path)
    return written


def _safe_name(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


PLOT_PATTERNS = ("ranking_*_ratio*.png", "quality_vs_ratio_*.png", "ttft_vs_ratio.png")   # write_outputs' names


def remove_stale_plots(out_dir: Path, written: list[Path]) -> list[Path]:
    """The plots an earlier eval into out_dir drew that this one did not (a dataset or ratio no longer among the
    runs) are removed: beside this summary they would pass for its own. Only kvf eval's own plot names."""
    stale = sorted({p for pattern in PLOT_PATTERNS for p in out_dir.glob(pattern)} - set(written))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def evaluate(run_files: list[Path], out_dir: Path, complete_only: bool = False, command: str | None = None,
             exclude_questions=None, track=no_progress, exclude_flag: str = "--exclude-questions",
             check_records=None) -> pd.DataFrame:
    """Score run files and write the summary and plots to out_dir; returns the summary.
    complete_only: score only questions every method answered (see complete_questions).
    exclude_questions: a file of question ids left out, or the ids (see without_questions), named as exclude_flag.
    The written paths are in `summary.attrs["written"]`. track(items, description=...) -> items shows
    progress (rich's Progress.track; a large eval takes a minute). check_records(records), when given, is the
    caller's check of the records to score, before anything is scored or written (kvf eval --compare's runs)."""
    from kvf.pipeline.workflows.workspace import check_not_made_by_kvf
    check_not_made_by_kvf(Path(out_dir), "--out", "results/eval")
    check_writable_dir(out_dir, "--out", create=False)   # a refused eval (no such run file) makes no folder
    df = load_runs([Path(p) for p in run_files], track)
    if exclude_questions is not None:
        df = without_questions(df, exclude_questions, exclude_flag)
    if complete_only:
        df = complete_questions(df)
    warn_cut_answers(df)
    df = with_pooled_tasks(df)
    if check_records is not None:
        check_records(df)
    summary = summarize(df, track)
    warn_unscored(summary)
    warn_no_full_reference(summary)
    warn_other_requests(summary)
    warn_timed_elsewhere(summary)
    written = write_outputs(summary, Path(out_dir), df, command, track)
    summary.attrs["written"] = [str(p) for p in written]
    summary.attrs["removed"] = [str(p) for p in remove_stale_plots(Path(out_dir), written)]
    summary.attrs["records"] = df
    return summary
