"""Where does kvfuse's second hop put the budget, at 2K and at 4K? kvfuse step 18's diagnosis (results/kvfuse.md):
step 17's hop (hop_rows=16, seeded by the locate band, ranking alone) with the located sinks held out at RULER 2K
0.825 against the located sinks' 0.775, and at 4K 0.500 against their 0.588.

    python -m kvf.scripts.hop_probe --data work/ruler-2048-s99 work/ruler-4096-s99 \
        --runs results/kvfuse/runs/dev-ruler-2048.jsonl.gz results/kvfuse/runs/dev-ruler-4096.jsonl.gz \
        --methods kvfuse:sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85 ... \
        --out results/kvfuse/hop-probe.md                      # .csv and .png beside it
    python -m kvf.scripts.hop_probe --replot --out results/kvfuse/hop-probe.md   # the .png again, from the .csv

Per sample of each prepared RULER-style dataset (built) and per kvfuse entry of --methods (as `kvf run -m` takes
them), kvfuse runs its passes over the stored `fusion` variant up to the first token and keeps what ranked its
budget. Per sample it counts, against the sample's fact chunks (`fact_chunks`: the needle's, or the two a fact is
cut or linked across):
  band_hit          the band's most attended chunk (attention summed over its rows) is a fact's (step 10's hit);
  seeds_in_facts    the share of the hop's seed rows (the band's top hop_rows rows) that lie in a fact's chunk;
  hop_on_facts      the share of the hop's attention (over chunk rows) that falls on the fact chunks;
  budget_in_facts   the share of the budget's rows (the rows pass 2 recomputes, sinks included) in the fact chunks;
  chance            the fact chunks' share of all chunk rows (what a budget spread evenly would give);
  value_recomputed  the share of the rows that spell the gold number (its first occurrence) that the budget
                    recomputes; `split` when some are and some are not (step 13: the shift then moves the kept
                    digits by their chunk's mean move, and a copy of the number can stop short).
With --runs (one run file per dataset), each sample's answer under the same entry is joined: its accuracy
(`correct`) and whether it is a cut copy (`cut`: a strict prefix of the gold number, scripts/copy_probe.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import pandas as pd
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvf.errors import KvfError  # noqa: E402
from kvf.eval.metrics import accuracy  # noqa: E402
from kvf.pipeline.data.datasets import load_prepared  # noqa: E402
from kvf.pipeline.fusion.methods.base import all_chunk_rows, chunk_attention  # noqa: E402
from kvf.pipeline.fusion.methods.kvfuse import KvFuse, chunk_of  # noqa: E402
from kvf.pipeline.records import read_records  # noqa: E402
from kvf.pipeline.workflows.api import WorkspaceSession  # noqa: E402
from kvf.pipeline.workflows.run import MethodSpec, parse_method_spec  # noqa: E402
from kvf.pipeline.workflows.workspace import Workspace  # noqa: E402
from kvf.scripts.copy_probe import cut_copy, value_rows  # noqa: E402
from kvf.scripts.locate_probe import (all_built, fact_prompts, files_beside, made_by, probe_parser,  # noqa: E402
                                      replotted, saved)

ROOT = Path(__file__).resolve().parent.parent


class Tracing(KvFuse):
    """kvfuse that keeps, for the last prompt, what ranked its budget: the band's attention [n] (the question's
    pass), the hop's seed rows [h] and their attention [n] (with hop_rows), and the budget's rows [b]."""

    def next_pass_rows(self, engine, state):
        if state.pass_index == 0:
            self.band = self.recorded_mean(state, self.locate_layers(state.cache.kv.shape[0])).float().cpu()   # [n]
            self.hop = None
        rows = super().next_pass_rows(engine, state)
        if state.pass_index == 0:
            seeds = state.scratch.get("hop_seeds")                                   # [h], with or without a pass
            self.seeds = None if seeds is None else seeds.cpu()
        if state.pass_index == self.recompute_pass - 1:
            self.selected = rows.cpu()                                               # [b]
        return rows

    def end_hop(self, state):
        self.hop = super().end_hop(state)
        return self.hop


def in_facts(rows: torch.Tensor, prompt, facts: set[int]) -> float:
    """The share of chunk rows [r] that lie in one of the chunks at positions `facts`."""
    chunks = chunk_of(prompt, rows)
    return float(sum(int(c) in facts for c in chunks.tolist())) / max(len(rows), 1)


def mass_on(scores: torch.Tensor, prompt, facts: set[int]) -> float:
    """The share of the attention [n] over chunk rows that falls on the chunks at positions `facts`."""
    mass = chunk_attention(scores.float().cpu(), prompt)                             # [C]
    return float(mass[sorted(facts)].sum() / mass.sum())


def answers(records: list) -> dict:
    """(qid, method, label) -> (accuracy, cut copy), from a run file's records (the last record of each)."""
    return {(r.qid, r.method, r.label): (accuracy(r.answer, r.gold, r.gold_mode), cut_copy(r.answer, r.gold))
            for r in records}


def check_same_neighbours(data: Path, runs: Path, records: list) -> None:
    """A run file made over a workspace with other neighbours read other fusion KVs: probing its questions over this
    workspace would compare another cache with its answers, so it is refused, naming the fix."""
    built = Workspace(data / "workspace").manifest().get("n_neighbours")     # the one checked reader
    other = {r.settings.get("n_neighbours") for r in records} - {None, built}
    if built is not None and other:
        ran = min(other)
        raise KvfError(f"--runs {runs}: made with --neighbours {ran}, but {data}/workspace was built with {built}; "
                       f"remove {data}/workspace and run `kvf run -d {data} --neighbours {ran} -m kvfuse` first, or "
                       "pass a run file made over this workspace")


def probed_samples(data: Path, runs: Path | None, description: str, need_facts: bool = True,
                   questions: slice = slice(None), layout: dict[str, list[str]] | None = None):
    """Each sample of a prepared, built RULER-style dataset as `kvf run` lays it out, with the open session and the
    run file's answers (answers()): (session, answered, question, its chunks, its prompt, its fact chunks). With
    need_facts False any prepared dataset (facts empty); `questions` picks some of them, in file order; `layout`
    (qid -> chunk ids) lays them out as a run did (fact_prompts)."""
    prepared, _ = load_prepared(data)
    records = read_records(runs) if runs is not None else []                   # read once: answers and the check
    if runs is not None:
        check_same_neighbours(data, runs, records)
    answered = answers(records)
    with WorkspaceSession(data / "workspace") as ws:
        for q, chunks, prompt, facts in fact_prompts(data, ws.session, prepared[questions], description, need_facts,
                                                     layout):
            yield ws.session, answered, q, chunks, prompt, facts


def gold_value_rows(session, data: Path, q, prompt) -> torch.Tensor:
    """[v] the prompt rows that spell question q's gold value (copy_probe.value_rows); a prompt that does not spell it
    is an error naming the question."""
    rows = value_rows([session.model_ref.tokenizer.decode([t]) for t in prompt.all_ids().tolist()], q.answers[0])
    if rows is None:
        raise KvfError(f"{data}: question {q.qid}: its prompt does not spell its gold value {q.answers[0]}")
    return torch.tensor(rows)


def traced(data: Path, specs: list[MethodSpec], ratio: float, runs: Path | None) -> pd.DataFrame:
    """One row per (sample, entry) of a prepared, built RULER-style dataset: what ranked the budget, see the doc."""
    rows = []
    for s, answered, q, chunks, prompt, facts in probed_samples(data, runs, f"{data.name}: kvfuse to the first token"):
        chance = in_facts(all_chunk_rows(prompt), prompt, facts)
        value = gold_value_rows(s, data, q, prompt)                               # [v] the number's rows
        for spec in specs:
            method = Tracing(ratio, **spec.knobs)
            s.answer(prompt, method, s.entries("fusion", chunks), max_new_tokens=1)
            band_mass = chunk_attention(method.band, prompt)                     # [C]
            hopped = method.seeds is not None
            hop_attention = mass_on(method.hop, prompt, facts) if method.hop is not None else float("nan")
            value_recomputed = float(torch.isin(value, method.selected).float().mean())
            correct, cut = answered.get((q.qid, spec.name, spec.label), (float("nan"), float("nan")))
            rows.append(dict(dataset=data.name, model=s.manifest["model"], task=q.task, qid=q.qid,
                             entry=spec.label or spec.name, chunks=len(chunks),
                             band_hit=int(torch.argmax(band_mass)) in facts,
                             seeds_in_facts=in_facts(method.seeds, prompt, facts) if hopped else float("nan"),
                             hop_on_facts=hop_attention,
                             budget_in_facts=in_facts(method.selected, prompt, facts), chance=chance,
                             value_recomputed=value_recomputed, split=0.0 < value_recomputed < 1.0,
                             correct=correct, cut=cut))
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, out: Path) -> None:
    """Per dataset, one bar per entry: (left) the budget's mean share in the fact chunks, chance marked; (right) the
    share of samples whose gold number the budget recomputes whole. From the per-sample .csv, so --replot remakes it
    without the model."""
    whole = table.assign(whole=table.value_recomputed >= 1.0)
    panels = [("budget_in_facts", "budget rows in the fact chunks\n(share, mean over samples)"),
              ("whole", "samples whose gold number\nis recomputed whole (share)")]
    entries, datasets = list(table.entry.unique()), list(table.dataset.unique())
    n = table.groupby("dataset", sort=False).qid.nunique()
    width = 0.8 / len(entries)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8))
    for ax, (column, label) in zip(axes, panels):
        means = whole.groupby(["dataset", "entry"], sort=False)[column].mean().unstack("entry")
        for i, entry in enumerate(entries):
            ax.bar([d + (i - (len(entries) - 1) / 2) * width for d in range(len(datasets))], means.loc[datasets, entry],
                   width, label=entry, color=f"C{i}")
        if column == "budget_in_facts":
            chance = table.groupby("dataset", sort=False).chance.mean()
            for d, dataset in enumerate(datasets):
                ax.hlines(chance[dataset], d - 0.42, d + 0.42, colors="0.2", linestyles="--", linewidth=1,
                          label="chance (the fact chunks' share of all chunk rows)" if d == 0 else None)
        ax.set_xticks(range(len(datasets)), [f"{d}\n(n = {n[d]})" for d in datasets], fontsize=8)
        ax.set_ylabel(label, fontsize=9)
        ax.set_ylim(0, 1)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=7, frameon=False, ncol=1)
    fig.suptitle(f"{', '.join(sorted(table.model.unique()))}, kvfuse at 15%: where the budget goes, and whether it "
                 "buys the gold number", fontsize=10)
    fig.subplots_adjust(bottom=0.36, top=0.9, wspace=0.3)
    fig.savefig(out, dpi=150)
    plt.close(fig)


def report(table: pd.DataFrame, args) -> str:
    """Markdown: per dataset, task and entry, the means of the per-sample counts; and per dataset and entry."""
    def share(values: pd.Series) -> str:
        return "—" if values.isna().all() else f"{values.mean():.2f}"

    def row(keys, group) -> str:
        answered = group.correct.notna().all()
        split = group[group.split]
        return (f"| {' | '.join(str(k) for k in keys)} | {group.qid.nunique()} | {int(group.band_hit.sum())} | "
                f"{share(group.seeds_in_facts)} | {share(group.hop_on_facts)} | {group.budget_in_facts.mean():.2f} | "
                f"{group.chance.mean():.2f} | {int(group.split.sum())} | "
                + (f"{int(split.cut.sum())} of {int(group.cut.sum())} | {group.correct.mean():.2f} |" if answered else "— | — |"))
    header = ["| data | task | entry | n | band hits | seeds in facts | hop's attention on facts | budget in facts | "
              "chance | number split | cut copies: split of all | accuracy |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines = ["# Where kvfuse's hop rows put the budget (kvfuse steps 18 and 20)", "",
             made_by("hop_probe", args, "the entries below as --methods; `make kvfuse-hop-probe` or "
                     "`make kvfuse-crosses-probe`") + "  ",
             f"Conditions: {', '.join(sorted(table.model.unique()))} (float32, CPU); RULER-style samples "
             f"({', '.join(table.dataset.unique())}; n = {table.qid.nunique()}); each entry's passes over the stored "
             f"`fusion` variant at {args.ratio:.0%}, to the first token. Shares are means over samples; `band hits` "
             "counts samples whose band's most attended chunk is a fact's; `number split` counts samples whose gold number's "
             "rows the budget recomputes in part; `cut copies` counts the entry's answers (in the run files, `--runs`) "
             "that stop short inside the gold number, and how many of them had it split; `accuracy` is the entry's. "
             "What each column counts: the docstring of `scripts/hop_probe.py`.", "",
             "By dataset:", "", *header]
    for (dataset, entry), group in table.groupby(["dataset", "entry"], sort=False):
        lines.append(row((dataset, "all", entry), group))
    lines += ["", "By task:", "", *header]
    for (dataset, task, entry), group in table.groupby(["dataset", "task", "entry"], sort=False):
        lines.append(row((dataset, task, entry), group))
    lines += ["", files_beside(args, "sample")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return kvfuse_probe_main("hop_probe", __doc__, "hop-probe.md", Tracing, traced, plot, report, argv)


def kvfuse_probe_main(prog: str, doc: str, out_name: str, method_cls, run_one, plot, report,
                      argv: list[str] | None = None, options=None) -> int:
    """A probe of kvfuse entries over prepared RULER-style datasets: --data, --methods, --runs (one per dataset) and
    --replot checked (one line each), then run_one(data, specs, ratio, runs) per dataset, the table saved as
    .csv, .png (plot) and .md (report); 0, or 1 / 2 with one line on stderr. options(parser): the probe's own flags,
    then passed to run_one as its last argument."""
    p = probe_parser(prog, doc, "prepared RULER-style datasets, built", out_name)
    if options:
        options(p)
    p.add_argument("--methods", nargs="+", help="kvfuse entries as kvf run -m takes them (kvfuse:KNOB=VALUE...)")
    p.add_argument("--runs", type=Path, nargs="+", help="run files of those datasets, in order (accuracy joined)")
    args = p.parse_args(argv)
    if args.replot:
        return replotted(prog, args, plot)
    if not args.data or not args.methods:
        print(f"{prog}: error: pass --data DIR... and --methods ENTRY..., or --replot", file=sys.stderr)
        return 2
    if args.runs and len(args.runs) != len(args.data):
        print(f"{prog}: error: --runs: {len(args.runs)} files for {len(args.data)} --data folders; give one run "
              "file per dataset, in the same order", file=sys.stderr)
        return 2
    if not all_built(prog, args.data):
        return 1
    torch.set_num_threads(1)
    try:
        specs = [parse_method_spec(text) for text in args.methods]
        for spec in specs:
            if spec.name != "kvfuse" or spec.variant not in (None, "fusion"):
                raise KvfError(f"--methods {spec.text}: the probe traces kvfuse on the fusion variant; give kvfuse:KNOB=VALUE...")
            with spec.names_its_knobs():
                method_cls(args.ratio, **spec.knobs)                  # a refused knob: one line, before any work
        runs = args.runs or [None] * len(args.data)
        extra = (args,) if options else ()
        table = pd.concat([run_one(d, specs, args.ratio, r, *extra) for d, r in zip(args.data, runs)])
        if table.empty:   # nothing to report: say so, not a KeyError in the report
            raise KvfError(f"--data {' '.join(map(str, args.data))}: no sample was probed; the questions that --runs "
                           "and the probe's own flags select are none")
    except KvfError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return saved(table, args, plot, report)

if __name__ == "__main__":
    sys.exit(main())
