"""Which layers' question attention finds the chunk that holds a RULER-style sample's fact? kvfuse step 10's
diagnosis (results/kvfuse.md): the layer average that ranks kvfuse's rows does not point at that chunk, so sinks
put "after the most attended chunk" (sinks_after_top) missed the cut needle; a band of deep layers does.

    python -m kvf.scripts.locate_probe --data work/ruler-2048-s99 --out results/kvfuse/locate.md   # .csv, .png
    python -m kvf.scripts.locate_probe --replot --out results/kvfuse/locate.md   # the .png again, from the .csv

Per sample of each prepared RULER-style dataset (`kvf data ruler`, built by `kvf run`): kvfuse's pass 1 (the
question's rows over the stored `fusion` variant, as `kvf run -m kvfuse` reads it) records the question's mean
attention to every row at every layer. Per layer, and for the layer average and for the band kvfuse's
locate_from / locate_to pick, it counts the samples whose most attended chunk (attention summed over its rows) is
one of the sample's fact chunks (`fact_chunks`: the needle, or for boundary the two chunks the needle is cut
across). The more samples the better a layer finds where the question's answer sits.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib
import pandas as pd
import torch
from rich.progress import track

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvf.errors import KvfError, counted  # noqa: E402
from kvf.pipeline.data.datasets import load_prepared  # noqa: E402
from kvf.pipeline.files import write_atomic  # noqa: E402
from kvf.pipeline.fusion.methods.base import chunk_attention  # noqa: E402
from kvf.pipeline.fusion.methods.kvfuse import KvFuse, band_layers  # noqa: E402
from kvf.pipeline.workflows.api import WorkspaceSession  # noqa: E402
from kvf.pipeline.workflows.provenance import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BAND = {"locate_from": 0.6, "locate_to": 0.85}      # kvfuse step 10's band (layers 18-24 of 30)


class Recording(KvFuse):
    """kvfuse (defaults) that keeps what its pass 1 saw: the question's attention at every layer, [L, n]
    (score_layers=all), and the rows pass 2 recomputes (`recomputed`, a set)."""

    def next_pass_rows(self, engine, state):
        if state.pass_index == 0:
            self.attention = torch.stack(state.query_attention).float().cpu()     # [L, n]
        rows = super().next_pass_rows(engine, state)
        if state.pass_index == 0:
            self.recomputed = set(rows.tolist())
        return rows


def question_chunk_ids(question, doc_chunks: dict) -> list[str]:
    """A prepared question's chunk ids in prompt order (its passages' chunks), as `kvf run` lays them out."""
    return [cid for d in question.context_ids for cid in doc_chunks[d]]


def fact_chunk_positions(chunk_ids: list[str], doc_chunks: dict, context_ids: list[str], facts: list[int]) -> set[int]:
    """The prompt positions of the chunks cut from the sample's fact passages (a passage may be several chunks)."""
    fact_chunks = {cid for i in facts for cid in doc_chunks[context_ids[i]]}
    return {pos for pos, cid in enumerate(chunk_ids) if cid in fact_chunks}


def fact_prompts(data: Path, session, questions, description: str, need_facts: bool = True,
                 layout: dict[str, list[str]] | None = None):
    """Each prepared RULER-style question of `data` as `kvf run` lays it out: (question, its chunks, its prompt, the
    prompt positions of its fact chunks), with a progress bar; a question without fact_chunks is an error unless
    need_facts is False (any prepared dataset: its facts are then an empty set). layout (qid -> chunk ids, as a run
    file's records name them) lays out those questions as that run did, and only those."""
    doc_chunks = session.ws.doc_chunks()
    if layout is not None:
        questions = [q for q in questions if q.qid in layout]
    for q in track(questions, description=description):
        if need_facts and not q.fact_chunks:
            raise KvfError(f"{data}: question {q.qid} has no fact_chunks; make the data with kvf data ruler")
        chunk_ids = question_chunk_ids(q, doc_chunks) if layout is None else layout[q.qid]
        chunks = session.chunks(chunk_ids, "retrieval")
        yield (q, chunks, session.prompt(chunks, q.question),
               fact_chunk_positions(chunk_ids, doc_chunks, q.context_ids, q.fact_chunks or []))


def located(data: Path, ratio: float) -> pd.DataFrame:
    """One row per (sample, layer) -> task, layer (an int, "average" or "band"), whether its top chunk is a fact's,
    and whether it is the prompt's last chunk (the one next to the question)."""
    questions, _ = load_prepared(data)
    rows = []
    with WorkspaceSession(data / "workspace") as ws:
        s = ws.session
        method = Recording(ratio)
        band = band_layers(*BAND.values(), s.n_layers)
        for q, chunks, prompt, facts in fact_prompts(data, s, questions, f"{data.name}: pass 1"):
            s.answer(prompt, method, s.entries("fusion", chunks), max_new_tokens=1)
            per_layer = torch.stack([chunk_attention(a, prompt) for a in method.attention])       # [L, C]
            scored = {**{layer: per_layer[layer] for layer in range(len(per_layer))},
                      "average": chunk_attention(method.attention.mean(0), prompt),
                      "band": chunk_attention(method.attention[band].mean(0), prompt)}
            rows += [dict(dataset=data.name, model=s.manifest["model"], task=q.task, qid=q.qid, layer=str(layer),
                          hit=int(torch.argmax(mass)) in facts, last=int(torch.argmax(mass)) == len(mass) - 1)
                     for layer, mass in scored.items()]
    return pd.DataFrame(rows)


def probe_parser(prog: str, doc: str, data_help: str, out_name: str) -> argparse.ArgumentParser:
    """The arguments kvfuse's pass-1 probes share: --data, --ratio, --out (results/kvfuse/OUT_NAME) and --replot."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("--data", type=Path, nargs="+", help=data_help)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "kvfuse" / out_name)
    p.add_argument("--replot", action="store_true", help="remake the .png from the .csv beside --out, without the model")
    return p


def all_built(prog: str, data: list[Path]) -> bool:
    """Whether every --data folder holds a built workspace; if not, says which (one line on stderr) and how to build it."""
    missing = [d for d in data if not (d / "workspace" / "manifest.json").is_file()]
    if missing:
        print(f"{prog}: error: --data {missing[0]}: no built workspace there; run `kvf run -d {missing[0]} "
              "-m kvfuse` (or the make target that makes it) first", file=sys.stderr)
    return not missing


def replotted(prog: str, args, plot, **read_csv) -> int:
    """--replot: remake the .png beside --out from the .csv there, without the model (plot(table, png)); 0, or 1 with
    one line on stderr when the .csv is missing."""
    table_path = args.out.with_suffix(".csv")
    if not table_path.is_file():
        print(f"{prog}: error: --replot: {table_path} not found; run the probe with --data first", file=sys.stderr)
        return 1
    plot(pd.read_csv(table_path, **read_csv), args.out.with_suffix(".png"))
    return 0


def saved(table: pd.DataFrame, args, plot, report) -> int:
    """A probe's per-row .csv, its .png (plot(table, png)) and its .md (report(table, args)) beside --out, each
    written atomically, and the .md printed; 0."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out.with_suffix(".csv"), table.to_csv(index=False, float_format="%.4f"))
    plot(table, args.out.with_suffix(".png"))
    text = report(table, args)
    write_atomic(args.out, text)
    print(text)
    return 0


def layer_count(table: pd.DataFrame) -> int:
    """How many layers a per-layer table (rows per sample or per task, `layer` a str: an int, "average" or "band") has."""
    return int(table[table.layer.astype(str).str.isdigit()].layer.astype(int).max()) + 1


def plot(table: pd.DataFrame, band: list[int], out: Path) -> None:
    """Share of samples whose top chunk holds the fact, per layer, one line per task (pooled over the datasets),
    the band shaded; from the per-layer table the .csv holds, so --replot remakes it without the model."""
    per_layer = table[table.layer.astype(str).str.isdigit()].assign(layer=lambda t: t.layer.astype(int))
    n_layers, n = layer_count(table), int(table[table.layer.astype(str) == "average"].samples.sum())
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for task, rows in per_layer.groupby("task"):
        pooled = rows.groupby("layer")[["hits", "samples"]].sum().reindex(range(n_layers))
        ax.plot(range(n_layers), pooled.hits / pooled.samples, marker="o", ms=3, label=task)
    ax.axvspan(band[0] - 0.5, band[-1] + 0.5, color="0.85", zorder=0, label="locate band")
    ax.set_xlabel("layer")
    ax.set_ylabel("samples whose most attended\nchunk holds the fact (share)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{', '.join(sorted(table.model.unique()))}, RULER-style samples of {counted(table.dataset.nunique(), 'set')} "
                 f"(n = {n}):\n"
                 "where the question's attention points, layer by layer", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper left", frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def made_by(prog: str, args, targets: str) -> str:
    """A probe report's provenance line: the command that made it (with the make targets that run it) and the commit."""
    return (f"Made by `python -m kvf.scripts.{prog} --data {' '.join(str(d) for d in args.data)} --out {args.out}` "
            f"at commit {git_commit() or 'unknown'} ({targets}).")


def table_lines(header: list[str], rows: list[str]) -> list[str]:
    """A markdown table: its header, rule and rows, or one `(none)` row where there are none."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *(rows or ["| (none) |" + " |" * (len(header) - 1)])]


def files_beside(args, per: str) -> str:
    """A probe report's last line: where its rows (`per` one of them) and its plot lie, beside the report."""
    return f"Per {per}: `{args.out.with_suffix('.csv').name}`; plot: `{args.out.with_suffix('.png').name}`."


def report(hits: pd.DataFrame, band: list[int], n_layers: int, args) -> str:
    """Markdown: per dataset and task, hits of the layer average, the band, and the best single layers."""
    lines = ["# Which layers find the fact's chunk (kvfuse steps 10 and 21)", "",
             made_by("locate_probe", args, "`make kvfuse-locate-probe` or `make kvfuse-locate-probe-4096`") + "  ",
             f"Conditions: {', '.join(sorted(hits.model.unique()))} (float32, CPU); RULER-style samples "
             f"({', '.join(sorted(hits.dataset.unique()))}; n = {hits.qid.nunique()}); kvfuse's pass 1 over the stored "
             f"`fusion` variant at {args.ratio:.0%}. A hit: the chunk with the most question attention (summed over its "
             f"rows) is one of the sample's fact chunks. The band: layers {band[0]}-{band[-1]} of {n_layers} "
             f"(locate_from={BAND['locate_from']}, locate_to={BAND['locate_to']}).", "",
             "| data | task | n | hits: layer average | hits: band | best single layers (hits) | top chunk is the last: average / band |",
             "|---|---|---|---|---|---|---|"]
    for (dataset, task), group in hits.groupby(["dataset", "task"]):
        by_layer = group.groupby("layer")[["hit", "last"]].sum()
        n = group.qid.nunique()
        single = by_layer.loc[[str(layer) for layer in range(n_layers)], "hit"].sort_values(ascending=False, kind="stable")
        best = ", ".join(f"{layer} ({int(h)})" for layer, h in single.head(4).items())
        lines.append(f"| {dataset} | {task} | {n} | {int(by_layer.hit['average'])} | {int(by_layer.hit['band'])} | {best} | "
                     f"{int(by_layer['last']['average'])} / {int(by_layer['last']['band'])} |")
    totals = hits.groupby("layer")[["hit", "last"]].sum()
    n = hits.qid.nunique()
    lines += ["", f"All {n} samples: the layer average finds the fact's chunk in {int(totals.hit['average'])}, the band in "
                  f"{int(totals.hit['band'])}; the layer average's most attended chunk is the last one, next to the question, "
                  f"in {int(totals['last']['average'])} (the band's in {int(totals['last']['band'])}). "
                  + files_beside(args, "layer")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = probe_parser("locate_probe", __doc__, "prepared RULER-style datasets, built", "locate.md").parse_args(argv)
    table_path = args.out.with_suffix(".csv")
    if args.replot:
        if not table_path.is_file():
            print(f"locate_probe: error: --replot: {table_path} not found; run the probe with --data first", file=sys.stderr)
            return 1
        table = pd.read_csv(table_path, dtype={"layer": str})
        plot(table, band_layers(*BAND.values(), layer_count(table)), args.out.with_suffix(".png"))
        return 0
    if not args.data:
        print("locate_probe: error: pass --data DIR... (prepared RULER-style datasets, built), or --replot", file=sys.stderr)
        return 2
    if not all_built("locate_probe", args.data):
        return 1
    torch.set_num_threads(1)
    try:
        hits = pd.concat([located(d, args.ratio) for d in args.data])
    except KvfError as e:
        print(f"locate_probe: error: {e}", file=sys.stderr)
        return 1
    n_layers = layer_count(hits)
    band = band_layers(*BAND.values(), n_layers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table = hits.groupby(["dataset", "model", "task", "layer"]).agg(samples=("hit", "size"), hits=("hit", "sum"),
                                                           top_is_last=("last", "sum")).reset_index()
    write_atomic(table_path, table.to_csv(index=False))
    plot(table, band, args.out.with_suffix(".png"))
    text = report(hits, band, n_layers, args)
    write_atomic(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
