"""Where kvfuse loses on the 4K RULER suite: numbers copied from the needle, cut short. A diagnosis from the
suite's own records (results/kvfuse.md, step 13); it runs no model.

    python -m kvf.scripts.copy_probe --out results/kvfuse/copies.md     # .csv beside it
    python -m kvf.scripts.copy_probe --rerun results/kvfuse/runs/copies-ruler-4096-s*.jsonl --out ...
    python -m kvf.scripts.copy_probe --rows work/ruler-4096-s3 niah_single-4096-s3-001   # prints the needle's rows

An answer is a *cut copy* when it misses a gold value but holds a strict prefix of it, three digits or more
("712472." for 7124722): the model found the needle and began copying it, then stopped. Per RULER length,
method and ratio the table counts wrong answers and cut copies over the suite's samples (the four tasks
pooled), and tests kvfuse's rate of cut copies against every other method's at the same ratio on the same
samples (paired bootstrap, 95%). With --rerun, the run files of `make kvfuse-copies` (the samples kvfuse cut,
answered again by other configurations) add a table of what each configuration answered on each of them.
`--rows DATA QID` runs the model instead: it prints the sample's needle with the tokens kvfuse's pass 2 recomputes
(at 15%) in [brackets], from DATA's workspace (`kvf data ruler`, built by `kvf run`).
"""
from __future__ import annotations

import argparse
import json
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
    """One row per record of the suite's unlabelled runs: suite, method, ratio, qid, wrong (RULER's acc, as
    load_runs scored it, below 1), cut, and the model and new tokens the record was answered with."""
    df = load_runs(run_files)
    df = df[df.label == ""].copy()                       # the suite's runs; a labelled one is a rejected config
    df["suite"] = suite_of(df.dataset)
    df["wrong"] = df.acc < 1
    df["cut"] = [cut_copy(answer, gold) for answer, gold in zip(df.answer, df.gold)]
    df["new_tokens"] = [json.loads(request)[2] for request in df.request]     # [chunk ids, model, max_new_tokens]
    return df[["suite", "dataset", "method", "ratio", "qid", "wrong", "cut", "model", "new_tokens"]]


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


def outcome(acc: float, answer: str, gold: list[str]) -> str:
    """whole (RULER's acc 1: every gold value in the answer), cut (a cut copy) or other."""
    return "whole" if acc == 1 else "cut" if cut_copy(answer, gold) else "other"


RERUN_SUITE = "cut samples again"   # the .csv's suite for the rerun's counts


def rerun_samples(run_files: list[Path]) -> pd.DataFrame:
    """One row per record of make kvfuse-copies' runs: configuration, qid, gold, answer, outcome."""
    df = load_runs(run_files)
    df["configuration"] = [f"kvfuse [{label}]" if label else "kvfuse" for label in df.label]
    df["outcome"] = [outcome(acc, answer, gold) for acc, answer, gold in zip(df.acc, df.answer, df.gold)]
    return df


def rerun_counts(df: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: n, wrong and cut copies, in the table's columns (suite RERUN_SUITE)."""
    return pd.DataFrame([{"suite": RERUN_SUITE, "method": name, "ratio": rows.ratio.iloc[0], "n": len(rows),
                          "wrong": int((rows.outcome != "whole").sum()), "cut_copies": int((rows.outcome == "cut").sum())}
                         for name, rows in df.groupby("configuration", sort=False)])


def rerun_section(df: pd.DataFrame) -> list[str]:
    """The cut samples answered again: per configuration, how many answers are whole, cut or other, then each
    sample's answers (the numbers in it)."""
    configurations = list(dict.fromkeys(df.sort_values("line").configuration))
    counts = df.groupby("configuration").outcome.value_counts().unstack(fill_value=0)
    lines = [f"\n## The cut samples again ({df.qid.nunique()} samples, ratio "
             f"{', '.join(f'{r:g}' for r in sorted(df.ratio.unique()))}; `make kvfuse-copies`)\n",
             "| configuration | whole | cut | other |", "|---|---|---|---|"]
    for name in configurations:
        row = counts.loc[name]
        lines.append(f"| {name} | {row.get('whole', 0)} | {row.get('cut', 0)} | {row.get('other', 0)} |")
    lines += ["", "| sample | gold | " + " | ".join(configurations) + " |", "|---|---|" + "---|" * len(configurations)]
    for qid, rows in df.groupby("qid", sort=True):
        by_name = dict(zip(rows.configuration, rows.answer))
        numbers = [", ".join(re.findall(r"\d{3,}", by_name.get(name, ""))) or "—" for name in configurations]
        lines.append(f"| {qid} | {', '.join(rows.gold.iloc[0])} | " + " | ".join(numbers) + " |")
    return lines


def markdown(counts: pd.DataFrame, samples: pd.DataFrame, command: str, runs: str, rerun: pd.DataFrame | None) -> str:
    lines = ["# Cut copies: where kvfuse loses on the RULER suite (`python -m kvf.scripts.copy_probe`)\n",
             f"Made by `{command}` at commit {git_commit()}, from the records of {runs}: "
             f"{', '.join(sorted(samples.model.unique()))}, CPU, the four kept tasks pooled, "
             f"{'/'.join(map(str, sorted(samples.new_tokens.unique())))} new tokens. A *cut copy* misses a gold value but holds a strict prefix of it, "
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
    if rerun is not None:
        lines += rerun_section(rerun)
    return "\n".join(lines) + "\n"


def needle_rows(data: Path, qid: str, ratio: float = 0.15) -> str:
    """The sample's gold number with the words around it, as kvfuse (defaults) at `ratio` recomputes them: the
    rows its pass 2 recomputes in [brackets]."""
    from kvf.pipeline.data.datasets import load_prepared
    from kvf.pipeline.workflows.api import WorkspaceSession
    from kvf.scripts.locate_probe import Recording, question_chunk_ids

    questions, _ = load_prepared(data)
    question = next((q for q in questions if q.qid == qid), None)
    if question is None:
        raise KvfError(f"--rows {data} {qid}: no such question there; the ids are in {data}/questions.jsonl")
    with WorkspaceSession(data / "workspace") as ws:
        session = ws.session
        doc_chunks = session.ws.doc_chunks()
        chunks = session.chunks(question_chunk_ids(question, doc_chunks), "retrieval")
        prompt = session.prompt(chunks, question.question)
        method = Recording(ratio)
        session.answer(prompt, method, session.entries("fusion", chunks), max_new_tokens=1)
        tokens = [session.model_ref.tokenizer.decode([t]) for t in prompt.all_ids().tolist()]
    rows = value_rows(tokens, question.answers[0])
    if rows is None:
        raise KvfError(f"--rows {data} {qid}: the prompt does not hold its gold value {question.answers[0]}")
    return "".join(f"[{tokens[i]}]" if i in method.recomputed else tokens[i]
                   for i in range(max(0, rows.start - 12), min(len(tokens), rows.start + len(question.answers[0]) + 3)))


def value_rows(tokens: list[str], value: str) -> range | None:
    """The rows (token indices) that spell the first occurrence of `value` in the prompt's decoded tokens; None if
    it does not occur. A token only partly in the value counts."""
    starts = [0]
    for token in tokens:
        starts.append(starts[-1] + len(token))
    found = "".join(tokens).find(value)
    if found < 0:
        return None
    first = next(i for i in range(len(tokens)) if starts[i + 1] > found)
    last = next(i for i in range(first, len(tokens)) if starts[i + 1] >= found + len(value))
    return range(first, last + 1)


def command(args) -> str:
    """The command line that made a report, repo-relative, as anyone re-runs it."""
    rerun = f" --rerun {' '.join(relative(f) for f in args.rerun)}" if args.rerun else ""
    return f"python -m kvf.scripts.copy_probe{rerun} --out {relative(args.out)}"


def relative(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvf.scripts.copy_probe", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, nargs="+", default=sorted(RUNS.glob("ruler-*.jsonl")),
                   help="the RULER suite's run files (default: make ruler's)")
    p.add_argument("--rerun", type=Path, nargs="*", default=[],
                   help="make kvfuse-copies' run files: the cut samples answered again by other configurations")
    p.add_argument("--rows", nargs=2, metavar=("DATA", "QID"),
                   help="print a sample's needle with the tokens kvfuse recomputes at 15% in [brackets] (runs the model)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "kvfuse" / "copies.md")
    args = p.parse_args(argv)
    if args.rows:
        try:
            print(needle_rows(Path(args.rows[0]), args.rows[1]).replace("\n", " "))
        except KvfError as error:
            raise SystemExit(f"copy_probe: {error}") from None
        return
    try:
        samples = per_sample(args.runs)
        if not (samples.method == "kvfuse").any():
            raise SystemExit(f"copy_probe: no unlabelled kvfuse run in {' '.join(map(str, args.runs))}; pass make "
                             "ruler's run files (results/ruler/runs/ruler-*.jsonl)")
        counts = table(samples)
        rerun = rerun_samples(args.rerun) if args.rerun else None
        runs = (f"`make ruler` ({RUNS.relative_to(ROOT)}/ruler-*.jsonl)" if args.runs == sorted(RUNS.glob("ruler-*.jsonl"))
                else ", ".join(relative(f) for f in args.runs))
        text = markdown(counts, samples, command(args), runs, rerun)
        if rerun is not None:
            counts = pd.concat([counts, rerun_counts(rerun)], ignore_index=True)
    except KvfError as error:   # a missing or foreign run file: one line, as kvf's own commands say it
        raise SystemExit(f"copy_probe: {error}") from None
    write_atomic(args.out.with_suffix(".csv"), counts.to_csv(index=False, float_format="%.4f"))
    write_atomic(args.out, text)
    print(f"wrote {args.out} and {args.out.with_suffix('.csv').name}")


if __name__ == "__main__":
    main()
