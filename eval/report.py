"""Turn run files (one JSON line per question, see ARCHITECTURE.md) into a summary table and plots.

One summary row per (dataset, method, variant, ratio). Choices the metrics leave open:
- `full` and `reuse` references are looked up per dataset; if several runs hold the same question
  (e.g. full at two ratios) the first record in the order the files were given wins.
  For normalized F1 a method is compared with the `reuse` run of its own variant when there is
  one, else with the `prefix`-variant reuse, else with any reuse run.
- Normalized F1 (FusionRAG eq. 11) uses mean F1 over the questions the method, `full` and `reuse`
  runs share; `note` says when that is fewer than the method's n, or when it is undefined
  (full must beat reuse by NORMALIZED_F1_MIN_GAP F1, else the 0..1 scale is noise).
- TTFT ratio is a ratio of means over the questions shared with `full`:
  mean(method first_token) / mean(full first_token). A mean of per-question ratios would let a
  few very fast full prefills dominate.
- Fidelity F1 scores the method's answer against `full_answer` in its own record when present
  (same process, --compare-full), else against the `full` run's answer to the same question.
- "Most fidelity at 15%" names the leader and how far it is ahead of the runner-up, with a 95%
  paired bootstrap interval over the questions both answered (questions resampled, fixed seed so a
  report is reproducible): on 50 questions a lead of a few points is often noise, and we say so.
- All quality numbers are fractions in [0, 1].
"""
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from kvf import KvfError
from kvf.eval.metrics import NORMALIZED_F1_MIN_GAP, exact_match, normalized_f1, substring_accuracy, token_f1

REQUIRED_FIELDS = ("qid", "dataset", "method", "answer", "gold")
TIMINGS = ("load", "select", "recompute", "first_token", "decode")
GROUP_KEYS = ["dataset", "method", "variant", "ratio"]
BOOTSTRAP_SAMPLES = 2000
BASELINE_ORDER = {"full": 0, "prefix": 1, "reuse": 2, "pcw": 3}
SUMMARY_COLUMNS = ["dataset", "method", "variant", "ratio", "n", "em", "f1", "substring", "norm_f1",
                   "fidelity_f1", "kl_full", "top1_agree", "ttft_ratio", "recomputed_frac", "ttft_s",
                   "load_s", "select_s", "recompute_s", "decode_s", "prompt_tokens", "note"]


# ---------------------------------------------------------------------------------------------
# reading run files

def read_run_file(path: Path) -> list[dict]:
    """The records of one run file; KvfError naming the file (and line) when it is unusable."""
    path = Path(path)
    if not path.is_file():
        raise KvfError(f"run file {path} does not exist")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise KvfError(f"run file {path} line {lineno}: malformed JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise KvfError(f"run file {path} line {lineno}: expected a JSON object per line")
            records.append(_record_row(rec, path, lineno))
    if not records:
        raise KvfError(f"run file {path} is empty: re-run `kvf run` or leave it out")
    return records


def _record_row(rec: dict, path: Path, lineno: int) -> dict:
    """One run record -> one flat row (what the summary needs, nothing model-specific)."""
    missing = [k for k in REQUIRED_FIELDS if k not in rec]
    if missing:
        raise KvfError(f"run file {path} line {lineno}: missing field(s) {', '.join(missing)}")
    gold = [rec["gold"]] if isinstance(rec["gold"], str) else rec["gold"]
    if not isinstance(gold, list) or not gold or not all(isinstance(g, str) for g in gold):
        raise KvfError(f"run file {path} line {lineno}: `gold` must be a non-empty list of strings")
    if not isinstance(rec["answer"], str):
        raise KvfError(f"run file {path} line {lineno}: `answer` must be a string")
    settings = rec.get("settings") or {}
    timings = rec.get("timings") or {}
    ratio = settings.get("ratio")
    row = {"file": str(path), "line": lineno, "qid": str(rec["qid"]), "dataset": str(rec["dataset"]),
           "method": str(rec["method"]), "variant": str(settings.get("variant") or ""),
           "ratio": float(ratio) if ratio is not None else math.nan,
           "answer": rec["answer"], "gold": gold, "full_answer": rec.get("full_answer"),
           "kl_full": _number(rec.get("kl_full")), "top1_agree": _number(rec.get("top1_agree_full")),
           "prompt_tokens": _number(rec.get("prompt_tokens")), "chunk_tokens": _number(rec.get("chunk_tokens")),
           "recomputed_tokens": _number(rec.get("recomputed_tokens")),
           # how the run was set up, for the report's "runs" table
           "setting": settings.get("setting"), "retriever": settings.get("retriever"),
           "top_k": settings.get("top_k"), "chunk_size": settings.get("chunk_tokens"), "model": settings.get("model"),
           "settings": settings_key(settings)}
    for name in TIMINGS:
        row[f"t_{name}"] = _number(timings.get(name))
    return row


def settings_key(settings: dict) -> str:
    """How a record was run, as comparable text: every setting but the ratio (a summary row's own
    key, or per question under --ratio auto) and where the store lives (it is content-addressed)."""
    return json.dumps({k: v for k, v in settings.items() if k not in ("ratio", "ratio_mode", "store")},
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


def _number(value) -> float:
    return math.nan if value is None else float(value)


def load_runs(run_files: list[Path]) -> pd.DataFrame:
    """All records of all run files, scored against their gold answers."""
    if not run_files:
        raise KvfError("no run files given: pass one or more JSONL files written by `kvf run`")
    rows = [row for path in run_files for row in read_run_file(path)]
    df = pd.DataFrame(rows)
    df["em"] = [exact_match(a, g) for a, g in zip(df.answer, df.gold)]
    df["f1"] = [token_f1(a, g) for a, g in zip(df.answer, df.gold)]
    df["substring"] = [substring_accuracy(a, g) for a, g in zip(df.answer, df.gold)]
    _check_duplicates(df)
    return df


def complete_questions(df: pd.DataFrame) -> pd.DataFrame:
    """Only the questions that every (method, variant, ratio) of their dataset answered.

    A sweep stopped mid-question (or still running) leaves its last question with some methods
    only; keeping the common questions compares every method on the same questions."""
    kept = []
    for dataset, rows in df.groupby("dataset", sort=False):
        answered = rows.groupby(["method", "variant", "ratio"], dropna=False).qid.apply(set)
        kept.append(rows[rows.qid.isin(set.intersection(*answered))])
    out = pd.concat(kept)
    if out.empty:
        raise KvfError("--complete-only: no question was answered by every method of its dataset; "
                       "let the sweep finish a question, or leave --complete-only out")
    return out


def _check_duplicates(df: pd.DataFrame):
    # the same question twice in one group double-weights it: usually a run file passed twice
    dup = df[df.duplicated(["dataset", "method", "variant", "ratio", "qid"], keep=False)]
    if len(dup):
        first = dup.iloc[0]
        files = sorted(set(dup[dup.qid == first.qid].file))
        raise KvfError(f"question {first.qid} appears more than once for {first.method} "
                       f"(variant {first.variant or '-'}, ratio {first.ratio}) in {', '.join(files)}: "
                       f"pass each run file once")


# ---------------------------------------------------------------------------------------------
# references: what `full` and `reuse` answered

def reference_rows(df: pd.DataFrame, dataset: str, method: str, variant: str | None = None) -> pd.DataFrame:
    """One row per question of a baseline run on a dataset (first record wins), indexed by qid."""
    rows = df[(df.dataset == dataset) & (df.method == method)]
    if variant is not None:
        rows = rows[rows.variant == variant]
    return rows.drop_duplicates("qid").set_index("qid")


def reuse_reference(df: pd.DataFrame, dataset: str, variant: str) -> pd.DataFrame:
    """The reuse run matching the method's variant, else the prefix variant, else any."""
    for v in (variant, "prefix", None):
        rows = reference_rows(df, dataset, "reuse", v)
        if len(rows):
            return rows
    return rows


def _check_overlap(group: pd.DataFrame, ref: pd.DataFrame):
    # same dataset label but no common question: the user mixed up files
    if len(ref) and not set(group.qid) & set(ref.index):
        raise KvfError(f"run file {', '.join(sorted(set(group.file)))} has questions not in "
                       f"{', '.join(sorted(set(ref.file)))} (different dataset?)")


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


def fidelity_f1(group: pd.DataFrame, full: pd.DataFrame) -> float:
    """Mean F1 of the method's answers against full prefill's answers to the same questions."""
    scores = fidelity_scores(group, full)
    return float(scores.mean()) if len(scores) else math.nan


def paired_bootstrap(a: pd.Series, b: pd.Series, samples: int = BOOTSTRAP_SAMPLES,
                     seed: int = 0) -> tuple[float, float, float, int]:
    """Mean of a - b over the questions (index) both have, its 95% percentile-bootstrap interval,
    and how many questions that was: (mean, low, high, n). Questions are resampled with
    replacement; pairing keeps per-question difficulty out of the interval."""
    common = sorted(set(a.index) & set(b.index))
    if not common:
        return math.nan, math.nan, math.nan, 0
    diff = (a.loc[common] - b.loc[common]).to_numpy()                          # [questions]
    picks = np.random.default_rng(seed).integers(0, len(diff), (samples, len(diff)))  # [samples, questions]
    low, high = np.percentile(diff[picks].mean(axis=1), [2.5, 97.5])
    return float(diff.mean()), float(low), float(high), len(common)


def normalized_f1_on_common(group, full, reuse) -> tuple[float, str]:
    """FusionRAG normalized F1 over the questions all three runs share; (value, note)."""
    if not len(full) or not len(reuse):
        return math.nan, "normalized F1 needs full and reuse runs"
    common = sorted(set(group.qid) & set(full.index) & set(reuse.index))
    if not common:
        return math.nan, "no question shared with full and reuse runs"
    f1 = group.set_index("qid").f1.loc[common].mean()
    value = normalized_f1(f1, reuse.f1.loc[common].mean(), full.f1.loc[common].mean())
    if value is None:
        return math.nan, f"normalized F1 undefined (full F1 - reuse F1 < {NORMALIZED_F1_MIN_GAP})"
    note = f"normalized F1 on {len(common)}/{len(group)} questions" if len(common) < len(group) else ""
    return value, note


def ttft_ratio(group: pd.DataFrame, full: pd.DataFrame) -> float:
    """mean(method TTFT) / mean(full TTFT) over the questions both timed."""
    if not len(full):
        return math.nan
    mine = group.set_index("qid").t_first_token.dropna()
    theirs = full.t_first_token.dropna()
    common = sorted(set(mine.index) & set(theirs.index))
    if not common or theirs.loc[common].mean() <= 0:
        return math.nan
    return float(mine.loc[common].mean() / theirs.loc[common].mean())


def recomputed_fraction(group: pd.DataFrame) -> float:
    """Mean per-question recomputed_tokens / chunk_tokens (questions with chunk tokens only)."""
    has_chunks = group.chunk_tokens > 0
    if not has_chunks.any():
        return math.nan
    return float((group.recomputed_tokens[has_chunks] / group.chunk_tokens[has_chunks]).mean())


def summarize_group(df: pd.DataFrame, group: pd.DataFrame) -> dict:
    """One summary row for one (dataset, method, variant, ratio)."""
    first = group.iloc[0]
    full = reference_rows(df, first.dataset, "full")
    reuse = reuse_reference(df, first.dataset, first.variant)
    _check_overlap(group, full)
    _check_overlap(group, reuse)
    norm, note = normalized_f1_on_common(group, full, reuse)
    note = "; ".join(text for text in (note, mixed_settings(group)) if text)
    return {"dataset": first.dataset, "method": first.method, "variant": first.variant, "ratio": first.ratio,
            "n": len(group), "em": group.em.mean(), "f1": group.f1.mean(), "substring": group.substring.mean(),
            "norm_f1": norm, "fidelity_f1": fidelity_f1(group, full), "kl_full": group.kl_full.mean(),
            "top1_agree": group.top1_agree.mean(), "ttft_ratio": ttft_ratio(group, full),
            "recomputed_frac": recomputed_fraction(group), "ttft_s": group.t_first_token.mean(),
            "load_s": group.t_load.mean(), "select_s": group.t_select.mean(),
            "recompute_s": group.t_recompute.mean(), "decode_s": group.t_decode.mean(),
            "prompt_tokens": group.prompt_tokens.mean(), "note": note}


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """The summary table: one row per (dataset, method, variant, ratio), baselines first."""
    rows = [summarize_group(df, g) for _, g in df.groupby(GROUP_KEYS, dropna=False, sort=False)]
    summary = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    order = summary.method.map(lambda m: BASELINE_ORDER.get(m, len(BASELINE_ORDER)))
    summary = summary.assign(_order=order).sort_values(["dataset", "_order", "method", "variant", "ratio"])
    return summary.drop(columns="_order").reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# rendering

def format_cell(row: pd.Series, column: str) -> str:
    value = row[column]
    if column == "norm_f1" and isinstance(value, float) and math.isnan(value):
        return "undefined" if "undefined" in row.note else "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if column == "prompt_tokens":
            return f"{value:.0f}"
        return f"{value:.2f}" if column == "ratio" else f"{value:.3f}"
    return str(value) if value != "" else "-"


# the terminal shows what people compare; summary.csv / summary.md have every column
DISPLAY_COLUMNS = ["dataset", "method", "variant", "ratio", "n", "f1", "substring", "norm_f1",
                   "fidelity_f1", "top1_agree", "ttft_ratio", "recomputed_frac"]


def summary_markdown(summary: pd.DataFrame, columns=None) -> str:
    """The summary as a GitHub markdown table."""
    columns = columns or SUMMARY_COLUMNS
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for _, row in summary.iterrows():
        lines.append("| " + " | ".join(format_cell(row, c) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def summary_table(summary: pd.DataFrame, title: str = "kvf eval"):
    """The summary as a rich Table (for the terminal)."""
    from rich.table import Table
    table = Table(title=title)
    for c in DISPLAY_COLUMNS:
        table.add_column(c, justify="left" if c in ("dataset", "method", "variant", "note") else "right")
    for _, row in summary.iterrows():
        table.add_row(*(format_cell(row, c) for c in DISPLAY_COLUMNS))
    return table


def _safe_name(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def _x_position(row) -> float:
    # methods without a ratio knob (cachefocus) sit at the fraction they actually recomputed
    return row.ratio if not math.isnan(row.ratio) else row.recomputed_frac


def _line_label(method: str, variant: str) -> str:
    """Legend label of one method/variant line (variant is '' for records that name none)."""
    return f"{method} {variant}".strip()


def _line_points(line: pd.DataFrame, column: str) -> list[tuple[float, float]]:
    """(recompute ratio, `column`) of one line's summary rows, in ratio order."""
    return sorted((_x_position(r), r[column]) for _, r in line.iterrows() if not math.isnan(_x_position(r)))


def plot_metric_vs_ratio(ax, rows: pd.DataFrame, column: str, ylabel: str):
    """One panel: `column` vs recompute ratio, one line per method/variant, dashed full and reuse."""
    for _, row in rows[rows.method == "full"].iterrows():
        ax.axhline(row[column], linestyle="--", color="black", label="full")
    # one reuse line per variant: same dashes, told apart by dash pattern and shade
    reuse_styles = [((6, 3), "dimgray"), ((2, 2), "gray"), ((8, 2, 2, 2), "darkgray")]
    for i, (_, row) in enumerate(rows[rows.method == "reuse"].iterrows()):
        dashes, color = reuse_styles[i % len(reuse_styles)]
        ax.axhline(row[column], linestyle=(0, dashes), color=color, label=_line_label("reuse", row.variant))
    for (method, variant), line in rows[~rows.method.isin(["full", "reuse"])].groupby(["method", "variant"]):
        points = _line_points(line, column)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=_line_label(method, variant))
    ax.set(xlabel="recompute ratio", ylabel=ylabel)
    ax.set_xlim(left=-0.02)  # r = 0 (full reuse) is always part of the picture
    ax.grid(alpha=0.3)


def plot_quality(summary: pd.DataFrame, dataset: str, path: Path):
    """Two panels vs recompute ratio: F1 against gold, and fidelity to full prefill (answer F1
    against full's answer). With a small model the gold F1 sits near its floor and is noisy;
    fidelity shows what a method keeps of full prefill's behaviour."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg by default
    fig = Figure(figsize=(12, 4.5))
    gold_ax, fidelity_ax = fig.subplots(1, 2)
    rows = summary[summary.dataset == dataset]
    plot_metric_vs_ratio(gold_ax, rows, "f1", "F1 vs gold")
    plot_metric_vs_ratio(fidelity_ax, rows, "fidelity_f1", "answer F1 vs full prefill")
    gold_ax.set_title("answer quality")
    fidelity_ax.set_title("fidelity to full prefill")
    fidelity_ax.legend(fontsize="small")
    fig.suptitle(f"{dataset}: quality vs recompute ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_ttft(summary: pd.DataFrame, path: Path):
    """TTFT / full TTFT vs recompute ratio: one panel per dataset, one line per method/variant;
    a method keeps its colour in every panel, and one legend serves them all."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    rows = summary[(summary.method != "full") & summary.ttft_ratio.notna()]
    datasets = sorted(rows.dataset.unique()) or ["-"]
    labels = sorted({_line_label(m, v) for m, v in zip(rows.method, rows.variant)})
    palette = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    colour = {label: palette(i % palette.N) for i, label in enumerate(labels)}
    fig = Figure(figsize=(4.2 * len(datasets) + 2.2, 4.5))
    axes = fig.subplots(1, len(datasets), sharey=True, squeeze=False)[0]
    for ax, dataset in zip(axes, datasets):
        ax.axhline(1.0, linestyle="--", color="black", label="full")
        for (method, variant), line in rows[rows.dataset == dataset].groupby(["method", "variant"]):
            label = _line_label(method, variant)
            points = _line_points(line, "ttft_ratio")
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", color=colour[label], label=label)
        ax.set(xlabel="recompute ratio", title=dataset)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TTFT / full TTFT")
    legend = {}  # name -> handle; methods that only some datasets ran still get an entry
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    fig.legend(list(legend.values()), list(legend.keys()), loc="center right", fontsize="small")
    fig.suptitle("TTFT vs recompute ratio (same process, same prompts as full prefill)")
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / (4.2 * len(datasets) + 2.2), 1))
    fig.savefig(path, dpi=120)


def summary_group(df: pd.DataFrame, row: pd.Series) -> pd.DataFrame:
    """The scored records behind one summary row."""
    return df[(df.dataset == row.dataset) & (df.method == row.method) & (df.variant == row.variant)
              & ((df.ratio - row.ratio).abs() < 1e-9)]


def lead_over(df: pd.DataFrame, best: pd.Series, runner_up: pd.Series) -> str:
    """How far `best` is ahead of `runner_up` in fidelity F1, with its paired 95% interval."""
    full = reference_rows(df, best.dataset, "full")
    lead, low, high, n = paired_bootstrap(fidelity_scores(summary_group(df, best), full),
                                          fidelity_scores(summary_group(df, runner_up), full))
    if not n:
        return ""
    verdict = "a clear lead" if low > 0 else "within noise: the interval includes 0"
    return (f"; ahead of {runner_up.method} ({runner_up.variant}, {runner_up.fidelity_f1:.3f}) by {lead:+.3f}, "
            f"95% CI [{low:+.3f}, {high:+.3f}] (paired bootstrap over {n} questions, {verdict})")


def most_faithful(summary: pd.DataFrame, ratio: float = 0.15, df: pd.DataFrame | None = None) -> list[str]:
    """One line per dataset: the selective method with the highest fidelity to full at `ratio`
    (answer F1 against full's answer; ties broken by first-token top-1 agreement). With the
    scored records `df`, the line also says whether its lead over the runner-up is beyond noise."""
    lines = []
    at_ratio = summary[(summary.ratio - ratio).abs() < 1e-9]
    at_ratio = at_ratio[~at_ratio.method.isin(["full", "prefix"])]
    for dataset, rows in at_ratio.groupby("dataset"):
        rows = rows.dropna(subset=["fidelity_f1"])
        if rows.empty:
            continue
        ranked = rows.sort_values(["fidelity_f1", "top1_agree"], ascending=False, na_position="last")
        best = ranked.iloc[0]
        lines.append(f"- {dataset}: **{best.method}** ({best.variant}) keeps the most fidelity to full at "
                     f"{ratio:.0%} recomputation: answer F1 vs full {best.fidelity_f1:.3f}"
                     + (f", top-1 agreement {best.top1_agree:.2f}" if best.top1_agree == best.top1_agree else "")
                     + f" (n = {int(best.n)})"
                     + (lead_over(df, best, ranked.iloc[1]) if df is not None and len(ranked) > 1 else ""))
    return lines


def runs_markdown(df: pd.DataFrame) -> str:
    """What the summary was computed from, per dataset: questions, setting, retrieval, prompt size."""
    lines = ["| dataset | questions | setting | context | chunk tokens | prompt tokens (mean) | model |",
             "|---|---|---|---|---|---|---|"]
    for dataset, rows in df.groupby("dataset", sort=True):
        setting = _one_value(rows.setting)
        if setting == "shared":
            context = f"{_one_value(rows.retriever) or 'bm25'} top-{_one_value(rows.top_k)} of the corpus"
        else:
            context = "the question's own passages" if setting == "per-question" else "-"
        lines.append(f"| {dataset} | {rows.qid.nunique()} | {setting or '-'} | {context} | "
                     f"{_one_value(rows.chunk_size) or '-'} | {rows.prompt_tokens.mean():.0f} | "
                     f"{_one_value(rows.model) or '-'} |")
    return "\n".join(lines) + "\n"


def _one_value(column: pd.Series):
    """The column's value when all rows agree, else the distinct values joined ("a/b")."""
    values = sorted({str(v) for v in column.dropna()})
    return values[0] if len(values) == 1 else "/".join(values) or None


def write_outputs(summary: pd.DataFrame, out_dir: Path, df: pd.DataFrame | None = None) -> list[Path]:
    """summary.csv, summary.md and the PNG plots; returns the paths written.
    df (the scored records) adds the "runs" table to summary.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "summary.csv", out_dir / "summary.md"]
    summary.to_csv(written[0], index=False)
    best = most_faithful(summary, df=df)
    runs = "" if df is None else "Runs:\n\n" + runs_markdown(df) + "\nSummary:\n\n"
    written[1].write_text(runs + summary_markdown(summary)
                          + ("\nMost fidelity to full prefill at 15% recomputation:\n\n" + "\n".join(best) + "\n"
                             if best else ""))
    for dataset in summary.dataset.unique():
        path = out_dir / f"quality_vs_ratio_{_safe_name(dataset)}.png"
        plot_quality(summary, dataset, path)
        written.append(path)
    path = out_dir / "ttft_vs_ratio.png"
    plot_ttft(summary, path)
    written.append(path)
    return written


def evaluate(run_files: list[Path], out_dir: Path, complete_only: bool = False) -> pd.DataFrame:
    """Score run files and write the summary and plots to out_dir; returns the summary.
    complete_only: score only questions every method answered (see complete_questions).
    The written paths are in `summary.attrs["written"]`."""
    df = load_runs([Path(p) for p in run_files])
    if complete_only:
        df = complete_questions(df)
    summary = summarize(df)
    summary.attrs["written"] = [str(p) for p in write_outputs(summary, Path(out_dir), df)]
    return summary
