"""Where does the question read when the first token is made? kvfuse step 22's diagnosis (results/kvfuse.md): at 4K
step 19's budget finds the fact's chunk and buys its number (steps 20a and 21), and its answers still trail full
prefill's.

    python -m kvf.scripts.read_probe --data work/ruler-4096-s99 --runs results/kvfuse/runs/dev-ruler-4096.jsonl.gz \\
        --methods kvfuse:sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85:... \\
        --out results/kvfuse/read-probe.md                     # .csv and .png beside it
    python -m kvf.scripts.read_probe --replot --out results/kvfuse/read-probe.md

Per sample of a prepared RULER-style dataset (built) and per kvfuse entry of --methods, kvfuse runs to the first
token and records the question's attention in its last pass, over the cache that makes the first token (stored rows
and recomputed rows together). The same at ratio 1 is full prefill's (tests: ratio 1 equals full prefill). Per
layer it keeps the share of the question's attention over chunk rows that falls on the sample's fact chunks
(`fact_share`), and whether its most-read chunk is a fact's (`top_is_fact`). With --runs, each sample's answer
under the entry (and under `full`) is joined as `correct`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import pandas as pd
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvf.eval.plots import shared_knobs  # noqa: E402
from kvf.pipeline.fusion.methods.base import chunk_attention  # noqa: E402
from kvf.pipeline.fusion.methods.kvfuse import KvFuse  # noqa: E402
from kvf.pipeline.workflows.display import wrapped_label  # noqa: E402
from kvf.scripts.hop_probe import kvfuse_probe_main, mass_on, probed_samples  # noqa: E402
from kvf.scripts.locate_probe import files_beside, made_by  # noqa: E402

FULL = "full prefill"


class Reading(KvFuse):
    """kvfuse that records the question's attention at every layer of every pass, and keeps its last pass's [L, n]."""

    def records_query_attention(self, state, layer):
        return True

    def recorded_layers(self, n_layers: int) -> list[int]:
        return list(range(n_layers))                                  # pass 1 records every layer, in order

    def finish(self, engine, state, result):
        self.read = torch.stack([a.float().cpu() for a in state.query_attention])   # [L, n] the last pass's
        super().finish(engine, state, result)


def read(data: Path, specs, ratio: float, runs: Path | None) -> pd.DataFrame:
    """One row per (sample, entry or full prefill, layer): fact_share, top_is_fact, correct."""
    rows = []
    for s, answered, q, chunks, prompt, facts in probed_samples(data, runs, f"{data.name}: the last pass's read"):
        entries = [(FULL, 1.0, {}, ("full", None))] + [(spec.label or spec.name, ratio, spec.knobs,
                                                        (spec.name, spec.label)) for spec in specs]
        for entry, at, knobs, key in entries:
            method = Reading(at, **knobs)
            s.answer(prompt, method, s.entries("fusion", chunks), max_new_tokens=1)
            correct = answered.get((q.qid, *key), (float("nan"),))[0]
            for layer, attention in enumerate(method.read):                          # [n] per layer
                mass = chunk_attention(attention, prompt)                              # [C]
                rows.append(dict(dataset=data.name, model=s.manifest["model"], task=q.task, qid=q.qid,
                                 entry=entry, layer=layer, fact_share=mass_on(attention, prompt, facts),
                                 top_is_fact=int(torch.argmax(mass)) in facts, correct=correct))
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, out: Path) -> None:
    """The question's mean attention share on the fact chunks per layer, one line per entry (full prefill dashed)."""
    share_by_layer(table, out, "fact_share", "question's attention on the\nfact chunks (share, mean)",
                   "the read that makes the first token")


def share_by_layer(table: pd.DataFrame, out: Path, column: str, ylabel: str, what: str) -> None:
    """A per-layer share (`column`, mean over samples), one line per entry, full prefill dashed in black."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    groups = list(table.groupby("entry", sort=False))
    labels, common = shared_knobs([entry for entry, _ in groups], skip=frozenset({FULL}))
    for i, ((entry, rows), label) in enumerate(zip(groups, labels)):
        share = rows.groupby("layer")[column].mean()
        ax.plot(share.index, share.values, marker="o", ms=3, label=label, color="black" if entry == FULL else f"C{i}",
                linestyle="--" if entry == FULL else "-")
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.set_title(f"{', '.join(sorted(table.model.unique()))}, {', '.join(table.dataset.unique())} "
                 f"(n = {table.qid.nunique()}): {what}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False,
              title=None if common is None else wrapped_label(f"base = kvfuse:{common}", 80), title_fontsize=7)
    fig.savefig(out, dpi=130, bbox_inches="tight")                # the figure grows to hold the legend below
    plt.close(fig)


def report(table: pd.DataFrame, args) -> str:
    """Markdown: per task and entry, the fact share at layer 18 and over the band (18-24), the samples whose most-read
    chunk is a fact's there, and accuracy."""
    band = table[table.layer.between(18, 24)]
    lines = ["# Where the question reads at the first token (kvfuse step 22)", "",
             made_by("read_probe", args, "the entries below as --methods; `make kvfuse-read-probe`") + "  ",
             f"Conditions: {', '.join(sorted(table.model.unique()))} (float32, CPU); RULER-style samples "
             f"({', '.join(table.dataset.unique())}; n = {table.qid.nunique()}); each entry at {args.ratio:.0%} and "
             f"`{FULL}` (kvfuse at ratio 1), their last pass over the stored `fusion` variant. `fact share`: the share "
             "of the question's attention over chunk rows on the fact chunks (mean over samples); `top is fact`: "
             "samples whose most-read chunk is a fact's; `accuracy`: the entry's answers in --runs.", "",
             "| task | entry | n | fact share, layer 18 | top is fact, layer 18 | fact share, layers 18-24 | "
             "top is fact, layers 18-24 (mean attention) | accuracy |", "|---|---|---|---|---|---|---|---|"]
    for (task, entry), rows in pd.concat([table.assign(task="all"), table]).groupby(["task", "entry"], sort=False):
        at18, in_band = rows[rows.layer == 18], band[(band.entry == entry) & (band.qid.isin(rows.qid))]
        band_top = in_band.groupby("qid").fact_share.mean()
        lines.append(f"| {task} | {entry} | {rows.qid.nunique()} | {at18.fact_share.mean():.2f} | "
                     f"{int(at18.top_is_fact.sum())} | {band_top.mean():.2f} | "
                     f"{int(in_band.groupby('qid').top_is_fact.mean().ge(0.5).sum())} | {at18.correct.mean():.2f} |")
    lines += ["", files_beside(args, "sample and layer")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return kvfuse_probe_main("read_probe", __doc__, "read-probe.md", Reading, read, plot, report, argv)

if __name__ == "__main__":
    sys.exit(main())
