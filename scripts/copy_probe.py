"""Where kvfuse loses on the 4K RULER suite: numbers copied from the needle, cut short. A diagnosis from the
suite's own records (results/kvfuse.md, step 13); it runs no model.

    python -m kvf.scripts.copy_probe --out results/kvfuse/copies.md     # .csv beside it

An answer is a *cut copy* when it misses a gold value but holds a strict prefix of it, three digits or more
("712472." for 7124722): the model found the needle and began copying it, then stopped. Per RULER length,
method and ratio the table counts wrong answers and cut copies over the suite's samples (the four tasks
pooled), and tests kvfuse's rate of cut copies against every other method's at the same ratio on the same
samples (paired bootstrap, 95%).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from kvf.errors import KvfError
from kvf.eval.report import load_runs, suite_of
from kvf.eval.stats import paired_bootstrap
from kvf.pipeline.files import write_atomic
from kvf.pipeline.workflows.provenance import git_commit

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "results" / "ruler" / "runs"
MIN_DIGITS = 3      # a shorter prefix of a 7-digit value is as likely a different number as a cut copy


def cut_copy(answer: str, gold: list[str]) -> bool:
    """The answer misses a gold value but holds a strict prefix of it (MIN_DIGITS digits or more)."""
    numbers = re.findall(r"\d+", answer)
    return any(value not in answer and any(len(n) >= MIN_DIGITS and value.startswith(n) and n != value
                                           for n in numbers) for value in gold)


def per_sample(run_files: list[Path]) -> pd.DataFrame:
    """One row per record of the suite's unlabelled runs: suite, method, ratio, qid, wrong, cut."""
    df = load_runs(run_files)
    df = df[df.label == ""].copy()                       # the suite's runs; a labelled one is a rejected config
    df["suite"] = suite_of(df.dataset)
    df["wrong"] = [any(value not in answer for value in gold) for answer, gold in zip(df.answer, df.gold)]
    df["cut"] = [cut_copy(answer, gold) for answer, gold in zip(df.answer, df.gold)]
    return df[["suite", "dataset", "method", "ratio", "qid", "wrong", "cut"]]


def table(samples: pd.DataFrame) -> pd.DataFrame:
    """Per suite, method and ratio: n, wrong, cut copies, and kvfuse's cut-copy rate minus the method's [95%]."""
    rows = []
    for (suite, method, ratio), group in samples.groupby(["suite", "method", "ratio"]):
        kvfuse = samples[(samples.suite == suite) & (samples.method == "kvfuse") & (samples.ratio == ratio)]
        mean, low, high, _ = paired_bootstrap(kvfuse.set_index("qid").cut.astype(float),
                                              group.set_index("qid").cut.astype(float))
        rows.append({"suite": suite, "method": method, "ratio": ratio, "n": len(group), "wrong": int(group.wrong.sum()),
                     "cut_copies": int(group.cut.sum()), "kvfuse_minus": mean, "low": low, "high": high})
    return pd.DataFrame(rows).sort_values(["suite", "ratio", "method"], ignore_index=True)


def markdown(counts: pd.DataFrame, samples: pd.DataFrame, command: str) -> str:
    lines = ["# Cut copies: where kvfuse loses on the RULER suite (`python -m kvf.scripts.copy_probe`)\n",
             f"Made by `{command}` at commit {git_commit()}, from the records of `make ruler` "
             f"({RUNS.relative_to(ROOT)}/ruler-*.jsonl: SmolLM2-135M-Instruct, CPU, the four kept tasks pooled, "
             "32 new tokens). A *cut copy* misses a gold value but holds a strict prefix of it, "
             f"{MIN_DIGITS} digits or more. `kvfuse − method` is the difference in the rate of cut copies, paired "
             "over the same samples [95% bootstrap].\n"]
    for suite, rows in counts.groupby("suite", sort=True):
        lines += [f"\n## {suite}\n", "| method | ratio | n | wrong | cut copies | kvfuse − method [95%] |",
                  "|---|---|---|---|---|---|"]
        for r in rows.itertuples():
            versus = "—" if r.method == "kvfuse" or r.ratio in (0.0, 1.0) else \
                f"{r.kvfuse_minus:+.3f} [{r.low:+.3f}, {r.high:+.3f}]"
            lines.append(f"| {r.method} | {r.ratio:g} | {r.n} | {r.wrong} | {r.cut_copies} | {versus} |")
        tasks = samples[(samples.suite == suite) & (samples.method == "kvfuse") & samples.cut]
        by_task = ", ".join(f"{d.rpartition('/')[2]} {c}" for d, c in tasks.groupby("dataset").size().items())
        lines.append(f"\nkvfuse's cut copies by task (all ratios): {by_task or 'none'}.\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvf.scripts.copy_probe", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, nargs="+", default=sorted(RUNS.glob("ruler-*.jsonl")),
                   help="the RULER suite's run files (default: make ruler's)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "kvfuse" / "copies.md")
    args = p.parse_args(argv)
    try:
        samples = per_sample(args.runs)
    except KvfError as error:   # a missing or foreign run file: one line, as kvf's own commands say it
        raise SystemExit(f"copy_probe: {error}") from None
    if not (samples.method == "kvfuse").any():
        raise SystemExit(f"copy_probe: no unlabelled kvfuse run in {' '.join(map(str, args.runs))}; pass make ruler's "
                         "run files (results/ruler/runs/ruler-*.jsonl)")
    counts = table(samples)
    write_atomic(args.out.with_suffix(".csv"), counts.to_csv(index=False, float_format="%.4f"))
    write_atomic(args.out, markdown(counts, samples, "python -m kvf.scripts.copy_probe"))
    print(f"wrote {args.out} and {args.out.with_suffix('.csv').name}")


if __name__ == "__main__":
    main()
