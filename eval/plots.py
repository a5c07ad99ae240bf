"""Plots of a summary, the way a paper would show them: labelled axes with units, the number of
questions in the title, 95% bootstrap intervals as error bars, one legend outside the data, and
methods without a ratio knob as their own markers (full and reuse as reference lines)."""
from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd

from kvf.pipeline.workflows.display import wrapped_label

REFERENCE_METHODS = ("full", "reuse")
POINT_MARKERS = ["s", "D", "^", "v", "P", "X", "*", "h"]
METRIC_NAMES = {"f1": "F1 vs gold", "acc": "accuracy vs gold (share of gold values in the answer)"}
NO_GOLD = "no gold answers in these records"
ALL_ZERO = "0 for every row (intervals too)"
NO_FIDELITY = "no fidelity to full prefill: run with --compare-full (or include a full run)"
ONE_ANSWER_KL = "answer KL to full: only one row's records measured it (kvf run --compare-full, since 2026-11-30), so no panel compares it"


def save_figure(fig, path: Path) -> None:
    from kvf.pipeline.files import atomic_path
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=130, format="png", bbox_inches="tight")  # long legend labels stay inside


def shared_knobs(labels: list[str], skip: frozenset[str] = frozenset({""})) -> tuple[list[str], str | None]:
    """Short labels for knob lists (joined by ':'): the knobs that every label outside `skip` starts with are named
    once, returned for a title, and each label shows what it adds to them ("base" when nothing). With fewer than
    two such labels, or none shared, the labels as they are and None."""
    knobbed = [label.split(":") for label in labels if label not in skip]
    shared = 0
    while len(knobbed) > 1 and all(len(k) > shared for k in knobbed) and len({k[shared] for k in knobbed}) == 1:
        shared += 1
    if not shared:
        return labels, None
    short = [label if label in skip else " + ".join(["base", *label.split(":")[shared:]]) for label in labels]
    return short, ":".join(knobbed[0][:shared])


def _label(row: pd.Series, show_variant: bool) -> str:
    text = row.method + (f" [{row.label}]" if row.label else "")
    return f"{text} ({row.variant})" if show_variant and row.variant else text


def _fixed_ratio_methods(rows: pd.DataFrame) -> set[tuple]:
    """(method, label, variant) run at one ratio only (pcw, cachefocus, ...): single points, not lines."""
    counts = rows.groupby(["method", "label", "variant"]).ratio.nunique()
    return {key for key, c in counts.items() if c == 1}


def _palette(labels: list[str]) -> dict[str, tuple]:
    """One colour per label: tab20's ten dark hues first, then their light shades, so that up to
    ten labels never share a hue and neighbours in the legend never get two shades of one."""
    from matplotlib import colormaps
    tab20 = colormaps["tab20"]
    order = list(range(0, 20, 2)) + list(range(1, 20, 2))
    return {label: tab20(order[i % 20]) for i, label in enumerate(sorted(set(labels)))}


def plot_panel(ax, rows: pd.DataFrame, column: str, low: str | None, high: str | None, ylabel: str,
               colours: dict, show_variant: bool) -> bool:
    """`column` vs recompute ratio on one axis; returns False when there is nothing to draw."""
    rows = rows[rows[column].notna()]
    if rows.empty:
        return False
    fixed = _fixed_ratio_methods(rows[~rows.method.isin(REFERENCE_METHODS)])
    for _, row in rows[rows.method.isin(REFERENCE_METHODS)].iterrows():
        style = "--" if row.method == "full" else ":"
        ax.axhline(row[column], linestyle=style, color="black" if row.method == "full" else "dimgray",
                   label=_label(row, show_variant))
    marker = iter(POINT_MARKERS)
    series = list(rows[~rows.method.isin(REFERENCE_METHODS)].groupby(["method", "label", "variant"]))
    for i, ((method, label, variant), line) in enumerate(series):
        line = line.sort_values("ratio")
        name = _label(line.iloc[0], show_variant)
        yerr, where = None, {}
        if low and high:
            yerr = [(line[column] - line[low]).clip(lower=0).fillna(0), (line[high] - line[column]).clip(lower=0).fillna(0)]
            where = {"transform": dodged(ax, i, len(series))}
        if (method, label, variant) in fixed:
            ax.errorbar(line.recomputed_frac.fillna(line.ratio), line[column], yerr=yerr, fmt=next(marker, "o"),
                        markersize=8, capsize=3, color=colours[name], label=name, linestyle="none", clip_on=False,
                        **where)
        else:
            ax.errorbar(line.ratio, line[column], yerr=yerr, marker="o", capsize=3, color=colours[name], label=name,
                        clip_on=False, **where)   # a point at 0 (or at the last ratio) is drawn whole, not cut by the frame
    ax.set(xlabel="recompute ratio (fraction of chunk tokens recomputed)", ylabel=ylabel)
    drawn = [x for _, line in series for x in line.ratio.tolist() + line.recomputed_frac.dropna().tolist()]
    if drawn:   # one ratio alone is not drawn on the frame's edge (dodged artists do not count in ax.dataLim)
        pad = max(0.01, 0.06 * max(drawn))   # room for the outermost dodged points
        ax.set_xlim(-pad, max(drawn) + pad)
    else:                            # reference lines only
        ax.set_xlim(left=-0.01)
    ax.grid(alpha=0.3)
    return True


DODGE_POINTS = 2.5   # sideways step between methods' points at one ratio, in points (1/72 inch)
DODGE_SPAN_POINTS = 36.0   # the widest the set spreads: 60 configurations 2.5 points apart ran out of the panel


def dodged(ax, i: int, n: int):
    """Series i of n drawn DODGE_POINTS apart from its neighbours at every ratio (closer when the set would spread
    wider than DODGE_SPAN_POINTS), the whole set centred on the ratio: at one ratio the methods' intervals
    overlapped into one bar. A shift on the page, not in the data, so it is the same at any axis range."""
    from matplotlib.transforms import ScaledTranslation
    step = min(DODGE_POINTS, DODGE_SPAN_POINTS / max(1, n - 1))
    shift = (i - (n - 1) / 2) * step / 72
    return ax.transData + ScaledTranslation(shift, 0, ax.figure.dpi_scale_trans)


def _annotate_empty(ax, text: str, shared_y: bool = False) -> None:
    """Why a panel has nothing to draw, in its middle, with no ticks; shared_y: its y ticks are another panel's
    too (a ranking's method names), so they stay."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="gray", wrap=True)
    ax.set_xticks([])
    if not shared_y:
        ax.set_yticks([])


LEGEND_LABEL_CHARS = 44     # a legend entry is broken after a knob's ":" into lines no longer than this
LEGEND_POINTS = 8.33        # fontsize "small" at matplotlib's default 10
LEGEND_ROOM_INCHES = 1.0    # above and below the legend: the title and the axes' labels


def _legend_outside(fig, axes) -> None:
    """One legend for every panel, right of them; a configuration's long knob list in lines (on one line, four
    of kvfuse's knobs made the legend wider than both panels together). A figure shorter than its legend grows
    to hold it (seventeen entries, six of them broken, ran over the title)."""
    handles = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    if not handles:
        return
    labels = [wrapped_label(name, LEGEND_LABEL_CHARS) for name in handles]
    fig.legend(list(handles.values()), labels, loc="center left", bbox_to_anchor=(0.86, 0.5), fontsize="small",
               frameon=False)
    lines = sum(label.count("\n") + 1 for label in labels)
    legend_inches = LEGEND_POINTS / 72 * (1.25 * lines + 0.5 * len(labels))   # text lines, then the gap after each
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, max(height, legend_inches + LEGEND_ROOM_INCHES))


def plot_quality(summary: pd.DataFrame, dataset: str, path: Path):
    """Two panels vs recompute ratio: the primary gold metric, and fidelity to full prefill (answer F1
    against full's answer), each with 95% bootstrap intervals over questions."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg by default
    rows = summary[summary.dataset == dataset]
    metric = rows.metric.iloc[0]
    show_variant = rows[~rows.method.isin(["full"])].variant.nunique() > 1
    colours = _palette([_label(r, show_variant) for _, r in rows.iterrows() if r.method not in REFERENCE_METHODS])
    panels = [(metric, "metric_low", "metric_high", METRIC_NAMES.get(metric, metric), "answer quality vs gold",
               NO_GOLD),
              ("fidelity_f1", "fidelity_low", "fidelity_high", "answer F1 vs full prefill's answer",
               "fidelity to full prefill", NO_FIDELITY)]
    drawn, notes = measured_panels(rows, panels)
    fig = Figure(figsize=(6.5 * len(drawn), 4.8))
    axes = np.atleast_1d(fig.subplots(1, len(drawn)))
    for ax, (column, low, high, ylabel, title, empty) in zip(axes, drawn):
        if plot_panel(ax, rows, column, low, high, ylabel, colours, show_variant):
            top = axis_top(rows, column, high)
            ax.set_ylim(-0.02 * top, top)   # a score of 0 (reuse's line, often) drawn above the frame, not under it
            ax.set_title(title + gold_count(rows) if column == metric else title)
        else:
            _annotate_empty(ax, empty)
    fig.suptitle(f"{dataset}: quality vs recompute ratio ({count_questions(rows)}; bars: 95% bootstrap intervals; "
                 "methods set side by side at each ratio)" + notes)
    _legend_outside(fig, list(axes))
    fig.tight_layout(rect=(0, 0, 0.85, 0.95 - 0.04 * notes.count("\n")))
    save_figure(fig, path)


def measured_panels(rows: pd.DataFrame, panels: list[tuple]) -> tuple[list[tuple], str]:
    """panels (column first, why-it-is-empty last) -> those some row has a value in (the first alone if none has:
    it says why), and a title's extra lines naming each measure left out and how to get it. A measure no row has
    is not drawn as an empty frame."""
    drawn = [panel for panel in panels if rows[panel[0]].notna().any()] or panels[:1]
    missing = dict.fromkeys(panel[-1] for panel in panels if panel not in drawn)   # once each
    return drawn, "".join(f"\n{why}" for why in missing)


def count_questions(rows) -> str:
    """'n = 50 questions'; where the points count different numbers of questions (runs of other questions pooled,
    e.g. held-out runs beside a sweep), the range, so that no figure reads as one set of questions when it is not."""
    low, high = int(rows.n.min()), int(rows.n.max())
    if low != high:
        return f"n = {low} to {high} questions, by point"
    return f"n = {high} question" + ("" if high == 1 else "s")


def gold_count(rows: pd.DataFrame) -> str:
    """The gold panel's own n, when some questions have no gold answers (the figure's n counts them all)."""
    if "n_gold" not in rows or (rows.n_gold == rows.n).all():
        return ""
    return f" (n = {int(rows.n_gold.max())} with gold answers)"


def axis_top(rows: pd.DataFrame, column: str, high: str) -> float:
    """Where a quality axis ends: fidelity spans [0, 1] with full at 1; gold scores of a small model may all
    sit below 0.1, where a [0, 1] axis would flatten every method into the floor, so theirs follows the data."""
    if column == "answer_kl":   # a divergence: unbounded, nearer full is lower
        values = rows[[column, high]].to_numpy(dtype=float)
        return float(1.15 * np.nanmax(values)) if np.isfinite(values).any() and np.nanmax(values) > 0 else 1.0
    return 1.02 if column == "fidelity_f1" else data_top(rows, [column, high])


def data_top(rows: pd.DataFrame, columns: list[str]) -> float:
    """An axis top a little above the highest value or interval end of `columns` (a multiple of 0.05), at most 1.02."""
    values = [v for c in columns if c in rows for v in rows[c].to_numpy(dtype=float) if not math.isnan(v)]
    return min(1.02, max(0.05, math.ceil(1.15 * max(values) * 20) / 20)) if values else 1.02   # to 0.05


TTFT_COLUMNS = 3        # panels a row: RULER's tasks at two lengths in one row made a figure 44 inches wide
NOTE_NAMES_AT_MOST = 6  # rows left out of the TTFT plot named under it; more are counted


def plot_ttft(summary: pd.DataFrame, path: Path):
    """TTFT / full TTFT vs recompute ratio: one panel per dataset; a method keeps its colour in every
    panel, and one legend serves them all. A row whose full prefill another run timed is not drawn (a
    line under the figure names it): its ratio mixes two runs' conditions."""
    from matplotlib.figure import Figure
    rows = summary[(summary.method != "full") & summary.ttft_ratio.notna()]
    elsewhere = rows._ttft_mixed.astype(bool) if "_ttft_mixed" in rows else pd.Series(False, index=rows.index)
    left_out = ratios_left_out(rows[elsewhere])
    rows = rows[~elsewhere]
    datasets = sorted(rows.dataset.unique())
    n = max(1, len(datasets))
    columns = min(n, TTFT_COLUMNS)
    fig = Figure(figsize=(4.4 * columns + 2.6, 4.0 * math.ceil(n / columns) + 0.6))
    grid = fig.subplots(math.ceil(n / columns), columns, sharey=True, squeeze=False)
    axes = grid.ravel()[:n]
    for spare in grid.ravel()[n:]:   # the last row's empty places
        fig.delaxes(spare)
    if not datasets:
        _annotate_empty(axes[0], "no TTFT ratios: include a full run of the same questions")
    show_variant = rows.variant.nunique() > 1
    colours = _palette([_label(r, show_variant) for _, r in rows.iterrows() if r.method not in REFERENCE_METHODS])
    for ax, dataset in zip(axes, datasets):
        ax.axhline(1.0, linestyle="--", color="black", label="full")
        part = rows[rows.dataset == dataset]
        plot_panel(ax, part, "ttft_ratio", None, None, "", colours, show_variant)
        full_s = summary[(summary.dataset == dataset) & (summary.method == "full")].ttft_s
        absolute = f"; full TTFT {full_s.iloc[0]:.2f} s" if len(full_s) and not math.isnan(full_s.iloc[0]) else ""
        ax.set_title(f"{dataset} ({count_questions(part)}{absolute})", fontsize=10)
        ax.set_ylim(bottom=0)
    for row in grid:
        row[0].set_ylabel("TTFT / full prefill TTFT (same questions)")
    fig.suptitle("Time to first token vs recompute ratio")
    _legend_outside(fig, axes)
    bottom = 0.0
    if left_out:   # in lines as wide as the figure (on one line, kvfuse's dev ablations made it 263 inches wide)
        width, height = fig.get_size_inches()
        named = (", ".join(left_out) if len(left_out) <= NOTE_NAMES_AT_MOST
                 else f"{len(left_out)} rows (summary.md's notes name them)")
        note = textwrap.fill("not drawn, their full prefill timed by another run: " + named,
                             int(width * 72 / (0.6 * LEGEND_POINTS)), break_long_words=False, break_on_hyphens=False)
        note_inches = LEGEND_POINTS / 72 * 1.3 * (note.count("\n") + 1) + 0.15
        fig.set_size_inches(width, height + note_inches)
        fig.text(0.01, 0.01, note, fontsize="small", color="dimgray", va="bottom")
        bottom = note_inches / (height + note_inches)
    fig.tight_layout(rect=(0, bottom, 0.85, 1 - 0.3 / fig.get_figheight()))   # 0.3 inch: the title
    save_figure(fig, path)


def ratios_left_out(rows: pd.DataFrame) -> list[str]:
    """Each label's rows left out of a figure, with their ratios ('kvfuse (fusion) at 0, 0.05'): a label may be
    drawn at other ratios, and the note must not read as if the whole line were missing."""
    ratios = defaultdict(set)
    for _, r in rows.iterrows():
        ratios[_label(r, True)].add(float(r.ratio))
    return [f"{label} at {', '.join(f'{ratio:g}' for ratio in sorted(ratios[label]))}" for label in sorted(ratios)]


RANKING_INCHES_PER_CHAR = 0.085   # a row name's width at the tick labels' font size, generously
RANKING_NAME_CHARS = 60           # a row name is broken after a knob's ":" into lines no longer than this


def plot_ranking(rows: pd.DataFrame, title: str, path: Path):
    """One family of rows (a dataset at one ratio, with the methods that have no ratio knob) as two
    ranked bar panels: the primary gold metric and fidelity to full, with 95% bootstrap intervals.
    Reads better than a ratio axis when a sweep ran at one ratio."""
    from matplotlib.figure import Figure
    from kvf.eval.report import answers_measured   # report draws with this module: imported where used
    metric = rows.metric.iloc[0]
    labelled = rows[rows.label != ""]
    base = None
    if labelled.method.nunique() == 1:   # one method's configurations: the knobs they all start with, named once
        short, base = shared_knobs(list(rows.label.where(rows.method == labelled.method.iloc[0], "")))
        rows = rows.assign(label=short)
    rows = rows.assign(name=[wrapped_label(_label(r, rows.variant.nunique() > 1), RANKING_NAME_CHARS)
                             for _, r in rows.iterrows()])
    # ranked by gold accuracy where it discriminates (generated suites), else by fidelity to full:
    # a weak model's gold F1 on QA sits near its floor; best at the top
    rows = rows.sort_values(metric if metric == "acc" else "fidelity_f1")
    # the row names take what they need (~0.085 inch a character) and each panel keeps ~3.5 inches
    lines = [name.split("\n") for name in rows.name]
    names_inches = RANKING_INCHES_PER_CHAR * max(len(line) for name in lines for line in name)
    row_inches = 0.22 + 0.16 * max(map(len, lines))   # rows are evenly spaced: each has room for the most lines
    panels = [(metric, "metric_low", "metric_high", METRIC_NAMES.get(metric, metric), NO_GOLD),
              ("fidelity_f1", "fidelity_low", "fidelity_high", "answer F1 vs full prefill's answer", NO_FIDELITY)]
    # records that measured full's answer: its KL, a third panel, unless one row alone has it beside rows that do
    # not (a sweep resumed with a new method: one bar among n/a's, nothing to compare)
    methods = rows[rows.method != "full"]
    answer_kl_rows = int(methods.answer_kl.notna().sum()) if answers_measured(rows) else 0
    lone_answer_kl = answer_kl_rows == 1 and len(methods) > 1
    if answer_kl_rows and not lone_answer_kl:
        panels.append(("answer_kl", "answer_kl_low", "answer_kl_high",
                       "KL from full prefill per answer token (nats; lower = nearer)", NO_FIDELITY))
    drawn, notes = measured_panels(rows, panels)
    if lone_answer_kl:
        notes += f"\n{ONE_ANSWER_KL}"
    if base is not None:
        notes += f"\nbase = {labelled.method.iloc[0]}:{base}"
    fig = Figure(figsize=(max(12.0, names_inches + 3.8 * len(drawn)), row_inches * len(rows) + 1.8))
    axes = np.atleast_1d(fig.subplots(1, len(drawn), sharey=True))
    for ax, (column, low, high, xlabel, empty) in zip(axes, drawn):
        missing = rows[column].isna().to_numpy()   # no score: no bar, never a bar of 0
        values = rows[column].fillna(0)
        xerr = [(values - rows[low]).clip(lower=0).fillna(0), (rows[high] - values).clip(lower=0).fillna(0)]
        xerr = [side.mask(missing) for side in xerr]   # NaN: no whisker drawn
        colours = ["black" if m == "full" else "dimgray" if m == "reuse" else "tab:blue" for m in rows.method]
        ax.barh(rows.name, values, xerr=xerr, color=colours, capsize=2, height=0.6)
        ax.set_xlabel(xlabel)
        if missing.all():
            _annotate_empty(ax, empty, shared_y=True)
            continue
        top = axis_top(rows, column, high)
        for position in missing.nonzero()[0]:   # bars go bottom to top in row order
            ax.text(0.01 * top, position, "n/a", va="center", fontsize=8, color="gray")
        ax.set_xlim(0, top)
        ax.grid(axis="x", alpha=0.3)
        if not values[~missing].any() and not rows[high][~missing].fillna(0).any():
            # a weak model's gold F1, often: bars of no width read as a panel that failed to draw
            ax.text(0.5, 0.5, ALL_ZERO, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="gray")
    # the colour key names only the reference rows this figure has
    key = [f"{colour}: {name}" for method, colour, name in (("full", "black", "full prefill"), ("reuse", "grey", "reuse"))
           if method in set(rows.method)]
    fig.suptitle(f"{title} ({'; '.join([count_questions(rows), 'bars: 95% bootstrap intervals', *key])})"
                 + notes, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95 - 0.03 * notes.count("\n")), w_pad=3)   # room between the panels
    save_figure(fig, path)
