"""Which methods differ from each other: every pair of summary rows compared on the same questions.

The summary says how each row differs from `full` and `reuse`; a researcher ranking methods also
asks whether method A beats method B. Choices:
- Pairs are formed within one dataset and one ratio. Methods without a ratio knob record ratio 0
  (reuse, pcw, ape, cachefocus) and full records 1: a row at 0 or 1 that is the only ratio of its
  method in the dataset joins every ratio's family.
- Two measures: the dataset's primary metric against gold, and fidelity to full prefill (answer F1
  against full's answer; full itself is left out, its fidelity is 1 by definition). With a weak
  model gold F1 sits near its floor on QA datasets, and fidelity is where methods differ. Where the
  records measured it (`kvf run --compare-full` since 2026-11-30), a third: `answer_agree`, the share of
  full's answer tokens each cache picks when fed full's tokens before them, which still differs between
  two answers that part from full's at different tokens; and a fourth, `answer_kl`, the mean KL divergence per
  token of the cache's next-token distribution from full's along full's answer, which still differs between
  two caches that pick the same tokens with different confidence. Lower is better there: its pairs put the row
  with the lower KL first, and their difference a − b is negative.
- A difference is paired over the questions both answered, with the 95% paired bootstrap interval
  of eval/stats.py.
- Many pairs are tested at once (78 for 13 rows), so a pair counts as different only when its
  Holm-adjusted paired permutation p-value within its (dataset, ratio, measure) family is below 0.05; the
  unadjusted interval is shown beside it. Pairs on fewer than MIN_QUESTIONS questions are not tested.
"""
from __future__ import annotations

import itertools

import pandas as pd

from kvf.eval.report import answers_measured, fidelity_scores, no_progress, reference_rows, summary_group
from kvf.eval.stats import MIN_QUESTIONS, holm, paired_bootstrap, paired_p_value

ALPHA = 0.05
FIDELITY = "fidelity_f1"
AGREEMENT = "answer_agree"
ANSWER_KL = "answer_kl"
LOWER_IS_BETTER = {ANSWER_KL}
AGAINST_FULL = {FIDELITY, AGREEMENT, ANSWER_KL}
MEASURE_WORDS = {FIDELITY: "fidelity to full", AGREEMENT: "full's answer tokens agreed",
                 ANSWER_KL: "full's answer KL per token (lower first)"}
PAIR_COLUMNS = ["dataset", "ratio", "measure", "a", "b", "n", "a_mean", "b_mean", "diff", "low", "high",
                "p", "p_holm", "significant"]


def row_name(row: pd.Series) -> str:
    """method [label] (variant): the name a pair line shows."""
    return row.method + (f" [{row.label}]" if row.label else "") + f" ({row.variant})"


def families(summary: pd.DataFrame):
    """(dataset, ratio, rows) for every ratio a dataset was run at; fixed-ratio rows join each."""
    for dataset, rows in summary.groupby("dataset", sort=True):
        one_ratio = rows.groupby(["method", "label", "variant"]).ratio.transform("nunique") == 1
        fixed = one_ratio & rows.ratio.isin([0.0, 1.0])
        ratios = sorted(rows.ratio[~fixed].unique())
        if not ratios:
            yield dataset, None, rows
        for ratio in ratios:
            yield dataset, ratio, rows[fixed | ((rows.ratio - ratio).abs() < 1e-9)]


def per_question(df: pd.DataFrame, row: pd.Series, measure: str) -> pd.Series:
    """The row's per-question score in `measure` (a metric column, or FIDELITY), indexed by qid."""
    records = summary_group(df, row).drop_duplicates("qid")
    if measure == FIDELITY:
        return fidelity_scores(records, reference_rows(df, row.dataset, "full", label=row.label))
    return records.set_index("qid")[measure].dropna()


def compare_family(df: pd.DataFrame, dataset: str, ratio: float | None, rows: pd.DataFrame,
                   measure: str) -> list[dict]:
    """Every pair of rows in one family, oriented so that `a` is the better row (scores higher, or lower in a
    LOWER_IS_BETTER measure); Holm-adjusted."""
    if measure in AGAINST_FULL:   # full against itself: fidelity and agreement 1, KL 0, by definition
        rows = rows[rows.method != "full"]
    scores = {row_name(r): per_question(df, r, measure) for _, r in rows.iterrows()}
    better = -1 if measure in LOWER_IS_BETTER else 1
    pairs = []
    for (name_a, a), (name_b, b) in itertools.combinations(scores.items(), 2):
        mean, low, high, n = paired_bootstrap(a, b)
        if n < MIN_QUESTIONS:
            continue
        if better * mean < 0:                                   # the better row first
            (name_a, a), (name_b, b), (mean, low, high) = (name_b, b), (name_a, a), (-mean, -high, -low)
        common = a.index.intersection(b.index)
        pairs.append({"dataset": dataset, "ratio": ratio, "measure": measure, "a": name_a, "b": name_b, "n": n,
                      "a_mean": a.loc[common].mean(), "b_mean": b.loc[common].mean(), "diff": mean,
                      "low": low, "high": high, "p": paired_p_value(a, b)})
    for pair, adjusted in zip(pairs, holm([p["p"] for p in pairs])):
        pair["p_holm"] = adjusted
        pair["significant"] = adjusted < ALPHA
    return pairs


def pairwise_differences(df: pd.DataFrame, summary: pd.DataFrame, track=no_progress) -> pd.DataFrame:
    """One row per compared pair: dataset, ratio, measure, a, b, paired difference a - b (>= 0; <= 0 for a
    LOWER_IS_BETTER measure), its 95% interval, the paired permutation p-value and its Holm adjustment, and whether the pair differs."""
    tests = [(dataset, ratio, rows, measure) for dataset, ratio, rows in families(summary)
             for measure in (rows.metric.iloc[0], FIDELITY) + measured_answers(rows)]
    pairs = [pair for dataset, ratio, rows, measure in track(tests, description="testing every pair of methods")
             for pair in compare_family(df, dataset, ratio, rows, measure)]
    return pd.DataFrame(pairs, columns=PAIR_COLUMNS)


def measured_answers(rows: pd.DataFrame) -> tuple[str, ...]:
    """(AGREEMENT, ANSWER_KL) where some row of the family has them (its records measured full's answer), else ()."""
    return (AGREEMENT, ANSWER_KL) if answers_measured(rows) else ()


def pairs_lines(pairs: pd.DataFrame) -> list[str]:
    """Per (dataset, ratio, measure): a line, then one sub-item per pair that differs, largest difference first.
    KL per token runs to thousandths of a nat: its differences keep three significant digits."""
    lines = []
    for (dataset, ratio, measure), family in pairs.groupby(["dataset", "ratio", "measure"], dropna=False, sort=True):
        different = family[family.significant].sort_values("diff", key=abs, ascending=False)
        at = "" if pd.isna(ratio) else f" at ratio {ratio:g}"
        order, digits = ("<", "+.3g") if measure in LOWER_IS_BETTER else (">", "+.3f")
        words = MEASURE_WORDS.get(measure, f"{measure} vs gold")
        lines.append(f"- {dataset}{at}, {words} ({len(family)} pairs tested, "
                     f"n = {int(family.n.max())}): " + (f"{len(different)} differ" if len(different)
                                                        else "no pair differs after Holm adjustment"))
        lines += [f"  - {p.a} {order} {p.b}: {p.diff:{digits}} [{p.low:{digits}}, {p.high:{digits}}], "
                  f"Holm p = {p.p_holm:.3g}" for p in different.itertuples()]
    return lines
