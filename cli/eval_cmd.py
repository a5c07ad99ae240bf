"""`kvf eval RUN.jsonl ...` and `kvf compare A.jsonl B.jsonl`: score runs, compare them question by question."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvf.pipeline.workflows.display import output_console


def _command_line() -> str:
    return "kvf " + " ".join(sys.argv[1:])


def eval_command(
    run_files: Annotated[list[Path], typer.Argument(
        help="Run files (JSON Lines, or .jsonl.gz) written by `kvf run`, or a directory of them; include the "
             "`full` and `reuse` runs for the vs_full / vs_reuse intervals and normalized F1 (vs_full and the TTFT "
             "ratio also come from records run with --compare-full).")],
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="Directory for summary.csv, summary.md, pairs.csv (every pair of methods tested per "
                            "dataset and ratio) and the plots (a folder of its own: the "
                            "repository's results/ holds committed evidence).")] = Path("results/eval"),
    complete_only: Annotated[bool, typer.Option(
        "--complete-only/--all-questions", help="Score only the questions every method/ratio of their dataset "
        "answered (a sweep stopped mid-question then compares all methods on the same questions).")] = False,
    compare: Annotated[Optional[tuple[str, str]], typer.Option(
        "--compare", help="Also print per-question answers of two runs: A B as method@ratio[:label], "
                          "e.g. --compare cacheblend@0.15 fusionrag@0.15.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON instead of a table.")] = False,
    exclude_questions: Annotated[Optional[Path], typer.Option(
        "--exclude-questions", help="File of question ids (one per line) to leave out, e.g. the split a "
                                    "method was tuned on, so the table reports held-out questions only.")] = None,
):
    """Score runs against gold and full prefill (F1, EM, 95% intervals, TTFT), test method pairs; write tables, plots."""
    from kvf.eval.compare import comparison_summary, comparison_table, per_question, select
    from kvf.eval.report import evaluate, summary_csv, summary_table
    from kvf.pipeline.workflows.display import progress_bar

    from kvf.errors import KvfError
    if compare and any(selector.startswith("-") for selector in compare):   # it took the next flag for run B
        raise KvfError(f"--compare {' '.join(compare)}: --compare takes two runs, A and B, e.g. --compare "
                       f"{compare[0]} full; put them both right after it")
    picked = []   # --compare's two runs, picked before the tables are written: a run not in the files is said first

    def check_compare(records):
        picked[:] = [select(records, selector) for selector in compare or ()]
    with progress_bar(output_console(160, stderr=True)) as progress:
        summary = evaluate(run_files, out, complete_only, command=_command_line(),
                           exclude_questions=exclude_questions, track=progress.track, check_records=check_compare)
    console = output_console(160, stderr=json_out)   # --json: stdout holds the JSON alone
    if json_out:
        print(summary_csv(summary).to_json(orient="records"))
    else:
        console.print(summary_table(summary, width=console.width))
    if compare:
        table = per_question(summary.attrs["records"], *picked, names=tuple(compare))
        console.print(comparison_table(table, *compare))
        console.print(comparison_summary(table), highlight=False)
    console.print(f"wrote {', '.join(Path(p).name for p in summary.attrs['written'])} to {out}/", highlight=False, markup=False)
    if summary.attrs["removed"]:
        console.print(f"removed {', '.join(Path(p).name for p in summary.attrs['removed'])} from {out}/: an earlier "
                      "kvf eval drew them, and these runs do not", highlight=False, markup=False)


def compare_command(
    run_a: Annotated[Path, typer.Argument(help="First run file (A).")],
    run_b: Annotated[Optional[Path], typer.Argument(help="Second run file (B); leave it out (or give A's file again) "
                                                    "to compare two runs of A's file, with --a and --b.")] = None,
    a: Annotated[Optional[str], typer.Option("--a", help="Which of A's runs, when its file holds several: "
                                             "method[@ratio][:label], e.g. cacheblend@0.15.")] = None,
    b: Annotated[Optional[str], typer.Option("--b", help="Which of B's runs, as --a, e.g. full.")] = None,
    method: Annotated[Optional[str], typer.Option("--method", "-m", help="Which method's records in both files, when they hold several.")] = None,
    ratio: Annotated[Optional[float], typer.Option("--ratio", "-r", help="Which ratio's records in both files, when they hold several.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the questions as JSON (one object per question) "
                                                          "instead of a table; the summary line goes to stderr.")] = False,
):
    """Per question: gold, A's and B's answers, full prefill's answer, and each one's scores."""
    from kvf.errors import KvfError
    from kvf.eval.compare import comparison_summary, comparison_table, one_group, per_question, run_names, select
    from kvf.eval.report import load_runs
    if run_b is not None and not run_b.exists() and run_a.is_file():
        check_b_is_a_file(run_a, str(run_b), a)
    if run_b is None:   # two runs of one file
        if not (a and b):
            names = run_names(load_runs([run_a]))
            if len(names) < 2:
                raise KvfError(f"kvf compare {run_a}: it holds one run ({names[0]}); pass a second run file to compare it with")
            if a or b:   # one side named: said as the generic line, it read as if --a had not been seen
                given, other_flag = ("--a", "--b") if a else ("--b", "--a")
                other = next(name for name in names if name != (a or b))
                raise KvfError(f"kvf compare {run_a} {given} {a or b}: pass {other_flag} too, the run to compare it with "
                               f"(e.g. {other_flag} {other}), or a second run file")
            raise KvfError(f"kvf compare {run_a}: pass a second run file, or --a and --b to compare two runs of this "
                           f"one, e.g. --a {names[0]} --b {names[1]}")
        run_b = run_a
    frames, loaded = [], []
    for path, selector, flag in ((run_a, a, "--a"), (run_b, b, "--b")):
        df = load_runs([path])
        loaded.append(df)
        filters = ([(f"--method {method}", lambda d: d.method == method)] if method else []) + \
                  ([(f"--ratio {ratio:g}", lambda d: (d.ratio - ratio).abs() < 1e-9)] if ratio is not None else [])
        for given, keep in filters:
            kept = df[keep(df)]
            if kept.empty:   # say which flag matched nothing, not that the selector after it did
                raise KvfError(f"{given}: no records in {path} match; the runs there are {', '.join(run_names(df)[:8])}")
            df = kept
        if selector:
            frames.append(select(df, selector, flag))
        else:
            example = f"{df.method.iloc[0]}@{df.ratio.iloc[0]:g}" if len(df) else "cacheblend@0.15"
            frames.append(one_group(df, f"run file {path}", f"pick one with {flag} METHOD@RATIO, e.g. {flag} {example}"))
    import pandas as pd
    names = [f"{path}" + (f" {selector}" if selector else "") for path, selector in ((run_a, a), (run_b, b))]
    table = per_question(pd.concat(loaded), frames[0], frames[1], names)   # full's answers from either file, if it has them
    console = output_console(160, stderr=json_out)   # --json: stdout holds the JSON alone
    if json_out:
        print(table.to_json(orient="records"))
    else:
        console.print(comparison_table(table, *names))
    console.print(comparison_summary(table), highlight=False)


def check_b_is_a_file(run_a: Path, word: str, a: str | None) -> None:
    """`kvf compare RUN kvfuse`: a run of A's file given where B's file goes. It read as "run file kvfuse does not
    exist", or as A's file holding several runs; said as what it is, with the flags that pick runs of one file.
    Any other word there is a file that does not exist, said before A's file is looked into."""
    from kvf.errors import KvfError
    from kvf.eval.compare import run_names
    from kvf.eval.report import load_runs
    names = run_names(load_runs([run_a]))
    method = word.partition(":")[0].partition("@")[0]
    matching = [name for name in names if name.partition("@")[0] == method]
    if not matching:
        load_runs([Path(word)])   # its own line for a file that does not exist, before A's file is looked into
        return
    other = a or next((name for name in names if name not in matching), "full")
    raise KvfError(f"{word} is no file but a run of {run_a} ({', '.join(matching[:4])}); runs of one file go by --a and "
                   f"--b: kvf compare {run_a} --a {other} --b {matching[0] if word == method else word}")
