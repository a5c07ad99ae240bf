"""How spread is each question's attention over its chunks? kvfuse step 14's diagnosis (results/kvfuse.md): the
shift that helps MuSiQue's questions (step 3) breaks RULER's copies (step 13), and what tells the two apart on the
dev splits is how evenly the question reads the chunks, which `kvfuse:shift_max_spread` gates the shift by.

    python -m kvf.scripts.spread_probe --data work/ruler-2048-s99 work/musique \
        --runs results/kvfuse/runs/dev-ruler-2048.jsonl.gz results/kvfuse/runs/dev-musique.jsonl \
        --out results/kvfuse/spread.md                       # .csv and .png beside it
    python -m kvf.scripts.spread_probe --replot --out results/kvfuse/spread.md   # the .png again, from the .csv

Per question of each run file (its kvfuse records: the prompt's chunk ids and question, so the prompts are the
run's), kvfuse's pass 1 over the stored `fusion` variant in the prepared dataset's workspace records the question's
attention at every layer; the spread is kvfuse's own `chunk_spread` of the layer average (the attention that ranks
its rows): the effective number of chunks the attention falls on, over the number of chunks.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import pandas as pd
import torch
from rich.progress import track

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvf.errors import KvfError  # noqa: E402
from kvf.pipeline.fusion.methods.base import chunk_attention  # noqa: E402
from kvf.pipeline.fusion.methods.kvfuse import chunk_spread  # noqa: E402
from kvf.pipeline.records import read_records  # noqa: E402
from kvf.pipeline.workflows.api import WorkspaceSession  # noqa: E402
from kvf.pipeline.workflows.provenance import git_commit  # noqa: E402
from kvf.scripts.locate_probe import Recording, all_built, files_beside, probe_parser, replotted, saved  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GATE = 0.5      # the dev choice, kvfuse:shift_max_spread=0.5 (step 14)


def spreads(data: Path, runs: Path, ratio: float) -> pd.DataFrame:
    """One row per question of the run file's kvfuse records -> dataset, qid, chunks, spread."""
    prompts = {}
    for rec in read_records(runs):
        if rec.method == "kvfuse":
            prompts.setdefault(rec.qid, (rec.dataset, rec.chunk_ids, rec.question))
    if not prompts:
        raise KvfError(f"--runs {runs}: no kvfuse records; pass a run file with kvfuse in it")
    rows = []
    with WorkspaceSession(data / "workspace") as ws:
        s = ws.session
        method = Recording(ratio)
        for qid, (dataset, chunk_ids, question) in track(prompts.items(), description=f"{data.name}: pass 1"):
            chunks = s.chunks(chunk_ids, "retrieval")
            prompt = s.prompt(chunks, question)
            s.answer(prompt, method, s.entries("fusion", chunks), max_new_tokens=1)
            mass = chunk_attention(method.attention.mean(0), prompt)                  # [C] the layer average's
            rows.append(dict(dataset=dataset, model=s.manifest["model"], qid=qid, chunks=len(chunks),
                             spread=chunk_spread(mass)))
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, out: Path) -> None:
    """Each question's spread, one row of dots per dataset, the gate drawn; from the .csv, so --replot needs no model."""
    datasets = sorted(table.dataset.unique())
    fig, ax = plt.subplots(figsize=(7, 1.0 + 0.45 * len(datasets)))
    labels = []
    for i, dataset in enumerate(datasets):
        rows = table[table.dataset == dataset]
        jitter = torch.linspace(-0.15, 0.15, len(rows)).tolist()
        ax.scatter(rows.spread, [i + j for j in jitter], s=14, alpha=0.8, color="C0")
        labels.append(f"{dataset}\n(n = {len(rows)}, {int(rows.chunks.median())} chunks)")
    ax.axvline(GATE, color="0.3", linestyle="--", linewidth=1)
    ax.text(GATE, len(datasets) - 0.45, f" shift_max_spread = {GATE}", fontsize=7, va="bottom", color="0.3")
    ax.set_yticks(range(len(datasets)), labels, fontsize=7)
    ax.set_ylim(-0.5, len(datasets) - 0.1)
    ax.set_xlim(0, 1)
    ax.set_xlabel("question's attention over the chunks: effective chunks read / chunks")
    ax.set_title(f"{', '.join(sorted(table.model.unique()))}: how evenly each question reads its chunks "
                 "(kvfuse pass 1, layer average)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=150, bbox_inches="tight")
    plt.close(fig)


def report(table: pd.DataFrame, args) -> str:
    """Markdown: per dataset, the spread's range and how many questions the gate shifts."""
    lines = ["# How spread each question's attention is over its chunks (kvfuse step 14)", "",
             f"Made by `make kvfuse-spread-probe` at commit {git_commit() or 'unknown'} "
             "(`python -m kvf.scripts.spread_probe "
             f"--data {' '.join(str(d) for d in args.data)} --runs {' '.join(str(r) for r in args.runs)}`).  ",
             f"Conditions: {', '.join(sorted(table.model.unique()))} (float32, CPU); the questions of the run files "
             f"(n = {len(table)}), their prompts as the runs built them; kvfuse's pass 1 over the stored `fusion` "
             f"variant at {args.ratio:.0%}, attention averaged over every layer. Spread: the effective number of chunks "
             "the attention falls on (1 / the sum of the squared chunk shares) over the number of chunks; 1/C when it "
             f"falls on one chunk, 1 when evenly on all. `kvfuse:shift_max_spread={GATE}` shifts a question at or "
             "below the gate.", "",
             "| data | n | chunks | spread: min | median | max | at or below the gate (shifted) |",
             "|---|---|---|---|---|---|---|"]
    for dataset, rows in table.groupby("dataset"):
        lines.append(f"| {dataset} | {len(rows)} | {int(rows.chunks.median())} | {rows.spread.min():.3f} | "
                     f"{rows.spread.median():.3f} | {rows.spread.max():.3f} | {int((rows.spread <= GATE).sum())} |")
    lines += ["", files_beside(args, "question")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = probe_parser("spread_probe", __doc__, "prepared datasets, built (one per run file)", "spread.md")
    p.add_argument("--runs", type=Path, nargs="+", help="run files with kvfuse records of those datasets, in order")
    args = p.parse_args(argv)
    if args.replot:
        return replotted("spread_probe", args, plot)
    if not args.data or not args.runs or len(args.data) != len(args.runs):
        print("spread_probe: error: pass --data DIR... and --runs FILE..., one run file per dataset, or --replot",
              file=sys.stderr)
        return 2
    if not all_built("spread_probe", args.data):
        return 1
    torch.set_num_threads(1)
    try:
        table = pd.concat([spreads(d, r, args.ratio) for d, r in zip(args.data, args.runs)])
    except KvfError as e:
        print(f"spread_probe: error: {e}", file=sys.stderr)
        return 1
    return saved(table, args, plot, report)


if __name__ == "__main__":
    sys.exit(main())
