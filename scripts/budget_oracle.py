"""How far a per-question budget could go: issue 17's direction "choose the budget per question from how
much the question's attention is spread across chunks", bounded from the methods sweep's own records.

Any rule that gives each question its own ratio (from attention spread or anything else) and spends 15%
on average is at most as good as the best such allocation chosen with hindsight: per question, one of the
ratios the sweep ran, the mean at most `--mean`, the sum of fidelities to full prefill as high as it can be
(a knapsack over the questions, solved exactly by dynamic programming in budget units of the ratios' common
step). If that bound stays below the targets, no per-question budget reaches them with those ratios.

    python -m kvf.scripts.budget_oracle --runs results/methods/runs/musique.jsonl.gz ... \
        --exclude-questions results/kvfuse/dev-questions.txt --methods kvfuse,fusionrag,prophetkv \
        --out results/kvfuse/budget-oracle.md
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

from kvf.errors import KvfError
from kvf.eval.report import fidelity_scores, load_runs, reference_rows, without_questions
from kvf.eval.stats import mean_interval
from kvf.pipeline.files import write_atomic
from kvf.pipeline.workflows.provenance import git_commit


def fidelity_table(df: pd.DataFrame, dataset: str, method: str) -> pd.DataFrame:
    """[questions, ratios] the unlabelled run's fidelity to full, on the questions answered at every ratio."""
    rows = df[(df.dataset == dataset) & (df.method == method) & (df.label == "")]
    full = reference_rows(df, dataset, "full")
    columns = {round(ratio, 4): fidelity_scores(group, full) for ratio, group in rows.groupby("ratio")}
    return pd.DataFrame(columns).dropna()


def best_allocation(fidelity: pd.DataFrame, mean_ratio: float) -> pd.Series:
    """Per question, the ratio (a column of `fidelity`) that maximises the summed fidelity with the mean ratio
    at most mean_ratio, by dynamic programming over budget units; returns the chosen ratio per question."""
    ratios = list(fidelity.columns)
    step = math.gcd(*[round(r * 1000) for r in ratios if r > 0]) / 1000       # the ratios' common unit
    units = [round(r / step) for r in ratios]
    budget = int(mean_ratio * len(fidelity) / step + 1e-9)
    best = {0: (0.0, [])}                                                     # units spent -> (sum, choices)
    for _, scores in fidelity.iterrows():
        grown = {}
        for spent, (total, choices) in best.items():
            for ratio, unit in zip(ratios, units):
                if spent + unit <= budget and (spent + unit not in grown or grown[spent + unit][0] < total + scores[ratio]):
                    grown[spent + unit] = (total + scores[ratio], choices + [ratio])
        best = grown
    _, choices = max(best.values(), key=lambda pair: pair[0])
    return pd.Series(choices, index=fidelity.index)


def bound_rows(df: pd.DataFrame, methods: list[str], mean_ratio: float) -> list[dict]:
    rows = []
    for dataset in sorted(df.dataset.unique()):
        for method in methods:
            fidelity = fidelity_table(df, dataset, method)
            if fidelity.empty or mean_ratio not in fidelity.columns:
                continue
            chosen = best_allocation(fidelity, mean_ratio)
            oracle = pd.Series({q: fidelity.loc[q, r] for q, r in chosen.items()})
            flat = fidelity[mean_ratio]
            rows.append({"dataset": dataset, "method": method, "n": len(fidelity),
                         "ratios": ", ".join(f"{r:g}" for r in fidelity.columns),
                         "flat": flat.mean(), "flat_ci": mean_interval(flat),
                         "oracle": oracle.mean(), "oracle_ci": mean_interval(oracle), "mean_ratio": chosen.mean(),
                         "mix": ", ".join(f"{r:g}: {(chosen == r).sum()}" for r in fidelity.columns)})
    return rows


def markdown(rows: list[dict], mean_ratio: float, command: str) -> str:
    def ci(pair):
        return f"[{pair[0]:.3f}, {pair[1]:.3f}]"
    lines = [f"# A per-question budget, bounded: the best allocation of the swept ratios at a mean of {mean_ratio:g}",
             "", f"Made by `{command}` at commit {git_commit() or 'unknown'}. Model: SmolLM2-135M-Instruct (embedded GGUF, float32 on CPU); records: the "
             "methods sweep's (`results/methods.md`), fidelity = answer F1 against full prefill's answer.", "",
             f"Per question one of the ratios the sweep ran, chosen with hindsight so that the mean ratio stays at "
             f"most {mean_ratio:g} and the mean fidelity is as high as it can be: an upper bound on any rule that "
             "sets a question's budget from what it knows before answering (the spread of its attention over the "
             "chunks, or anything else), with these ratios. Intervals: 95% bootstrap over questions (for the "
             "oracle, of the allocation it chose).", "",
             f"| dataset | method | n | ratios | flat {mean_ratio:g} | best allocation, mean ≤ {mean_ratio:g} | "
             "its mean ratio | questions per ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['method']} | {r['n']} | {r['ratios']} | {r['flat']:.3f} {ci(r['flat_ci'])} "
                     f"| **{r['oracle']:.3f}** {ci(r['oracle_ci'])} | {r['mean_ratio']:.3f} | {r['mix']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", type=Path, required=True, help="the methods sweep's run files")
    parser.add_argument("--methods", default="kvfuse", help="comma-separated")
    parser.add_argument("--mean", type=float, default=0.15, help="the mean ratio the allocation may spend")
    parser.add_argument("--exclude-questions", type=Path, help="ids to leave out (a dev split)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not 0 < args.mean <= 1:
        raise SystemExit(f"budget_oracle: --mean {args.mean:g}: a mean ratio within (0, 1]")
    try:
        df = load_runs(args.runs)
        if args.exclude_questions:
            df = without_questions(df, args.exclude_questions)
    except KvfError as error:   # a missing or foreign run file: one line, as kvf's own commands say it
        raise SystemExit(f"budget_oracle: {error}") from None
    rows = bound_rows(df, args.methods.split(","), args.mean)
    if not rows:
        raise SystemExit(f"budget_oracle: no run of {args.methods} at ratio {args.mean:g} in {' '.join(map(str, args.runs))}")
    command = "python -m kvf.scripts.budget_oracle " + " ".join(
        [f"--runs {' '.join(map(str, args.runs))}", f"--methods {args.methods}", f"--mean {args.mean:g}"]
        + ([f"--exclude-questions {args.exclude_questions}"] if args.exclude_questions else []) + [f"--out {args.out}"])
    text = markdown(rows, args.mean, command)
    write_atomic(args.out, text)
    write_atomic(args.out.with_suffix(".csv"), pd.DataFrame(rows).drop(columns=["flat_ci", "oracle_ci"]).to_csv(index=False))
    print(text)


if __name__ == "__main__":
    main()
