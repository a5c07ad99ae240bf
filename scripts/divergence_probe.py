"""Where does an entry's greedy answer first leave full prefill's, and how sure was full prefill there? kvfuse step
26's diagnosis (results/kvfuse.md): at 4K step 19's lost answers part from full's before the value as often as at it.

    python -m kvf.scripts.divergence_probe --data work/ruler-4096-s99 work/ruler-4096 work/ruler-4096-s1 \\
        --methods kvfuse:sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85:... \\
        --out results/kvfuse/divergence-probe.md                # .csv and .png beside it
    python -m kvf.scripts.divergence_probe --replot --out results/kvfuse/divergence-probe.md

Per sample of a prepared dataset (built; RULER-style or QA, --offset and -n pick questions in file order), full prefill (kvfuse at ratio 1) and each kvfuse entry answer
greedily (32 new tokens; with --runs, each question's prompt laid out and its new tokens as that run did). Full's answer is then fed, teacher-forced, over full's own cache: at each of its steps
full's margin is the probability of its token less that of the runner-up. Where an entry's answer first takes
another token, full's answer up to there is fed over the entry's cache too, and the probe keeps both tokens'
probabilities under each cache, and where that step lies against the gold value (same_answers.where_it_leaves).
A sample whose answers agree token for token is one row with `step` empty.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from kvf.errors import KvfError  # noqa: E402
from kvf.eval.metrics import accuracy  # noqa: E402
from kvf.pipeline.data.datasets import load_prepared  # noqa: E402
from kvf.pipeline.fusion.methods.kvfuse import KvFuse  # noqa: E402
from kvf.pipeline.model.decode import first_difference  # noqa: E402
from kvf.pipeline.records import read_records  # noqa: E402
from kvf.pipeline.workflows.run import resolve_setting  # noqa: E402
from kvf.scripts.hop_probe import kvfuse_probe_main, probed_samples  # noqa: E402
from kvf.scripts.locate_probe import files_beside, made_by, table_lines  # noqa: E402
from kvf.scripts.read_probe import FULL  # noqa: E402
from kvf.scripts.same_answers import where_it_leaves  # noqa: E402

NEW_TOKENS = 32
LOW = 0.2          # a margin below this is a near tie: the report counts the steps that full decides by less


@torch.inference_mode()
def forced_probs(session, fused, tokens: list[int]) -> torch.Tensor:
    """[T, vocab] the probabilities with which fused's cache predicts each of `tokens`, given the ones before it."""
    return session.answerer.predictions(fused, tokens).float().softmax(dim=-1)


def margins(probs: torch.Tensor) -> torch.Tensor:
    """[T] the top token's probability less the runner-up's, per step (full's greedy token is its top one)."""
    top2 = probs.topk(2, dim=-1).values                                          # [T, 2]
    return top2[:, 0] - top2[:, 1]


def run_layout(data: Path, runs: Path | None) -> tuple[dict[str, list[str]] | None, int]:
    """(qid -> chunk ids, new tokens) as the run file laid out and answered its questions; without one, each
    question's own passages and NEW_TOKENS, refused where `kvf run` would retrieve instead (NQ-open's one passage)."""
    if runs is not None:
        records = read_records(runs)
        return {r.qid: r.chunk_ids for r in records}, int(records[0].settings.get("max_new_tokens") or NEW_TOKENS)
    questions, _ = load_prepared(data)
    setting, why = resolve_setting("auto", questions)
    if setting == "shared":
        raise KvfError(f"--data {data}: kvf run answers these questions from shared retrieval ({why}); pass --runs "
                       "with a run file of them, so that each prompt is laid out as that run did")
    return None, NEW_TOKENS


def read(data: Path, specs, ratio: float, runs: Path | None, args=None) -> pd.DataFrame:
    """Rows per sample: one per step of full's answer (entry `full prefill`: step, full_margin), and one per entry
    (step where it leaves full's answer, both tokens' probabilities under each cache, place, correctness)."""
    rows = []
    if args and args.offset < 0:
        raise KvfError(f"--offset {args.offset}: the questions to skip, in file order: 0 or more")
    if args and args.n is not None and args.n < 1:
        raise KvfError(f"-n {args.n}: the questions to probe: 1 or more (leave -n out for all)")
    questions = slice(args.offset, None if args.n is None else args.offset + args.n) if args else slice(None)
    layout, new_tokens = run_layout(data, runs)
    for s, _, q, chunks, prompt, _ in probed_samples(data, runs, f"{data.name}: where the answers part",
                                                     need_facts=False, questions=questions, layout=layout):
        decode, keys = s.model_ref.tokenizer.decode, s.entries("fusion", chunks)
        full = s.answer(prompt, KvFuse(1.0), keys, max_new_tokens=new_tokens).answer
        ids = full.token_ids
        under_full = forced_probs(s, full.fused, ids)                            # [T, vocab]
        full_margins = margins(under_full)                                       # [T]
        base = dict(dataset=data.name, model=s.manifest["model"], task=q.task, qid=q.qid)
        full_right = accuracy(full.text, q.answers, q.gold_mode) == 1.0
        rows += [dict(base, entry=FULL, step=t, full_margin=float(m), full_right=full_right)
                 for t, m in enumerate(full_margins.tolist())]
        for spec in specs:
            answer = s.answer(prompt, KvFuse(ratio, **spec.knobs), keys, max_new_tokens=new_tokens).answer
            entry = dict(base, entry=spec.label or spec.name, full_right=full_right,
                         entry_right=accuracy(answer.text, q.answers, q.gold_mode) == 1.0,
                         full_answer=full.text, entry_answer=answer.text)
            step = first_difference(ids, answer.token_ids)
            if step is None or step >= len(ids) or step >= len(answer.token_ids):   # same, or one answer stops first
                rows.append(dict(entry, step=step, place=None if step is None else "one answer stops first"))
                continue
            under_entry = forced_probs(s, answer.fused, ids[:step + 1])[step]    # [vocab]
            mine, theirs = ids[step], answer.token_ids[step]
            place = where_it_leaves(full.text, answer.text, q.answers).replace("--a", "full's answer")
            rows.append(dict(entry, step=step, place=place,
                             full_token=decode([mine]), entry_token=decode([theirs]),
                             full_margin=float(full_margins[step]),
                             full_p_full=float(under_full[step, mine]), full_p_entry=float(under_full[step, theirs]),
                             entry_p_full=float(under_entry[mine]), entry_p_entry=float(under_entry[theirs])))
    return pd.DataFrame(rows)


def parted(table: pd.DataFrame) -> pd.DataFrame:
    """The entries' rows where the answer leaves full's at a step both answers reach."""
    return table[(table.entry != FULL) & table.full_margin.notna()]


def ecdf(values: pd.Series) -> tuple[list[float], list[float]]:
    """(sorted values, the share of values at or below each): an empirical distribution to draw as steps."""
    ordered = values.sort_values().tolist()
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def plot(table: pd.DataFrame, out: Path) -> None:
    """Full prefill's margin: over every step of its answers (grey), and at the steps where each entry leaves them."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    every = table[table.entry == FULL].full_margin
    ax.step(*ecdf(every), where="post", color="0.5", linestyle="--",
            label=f"every step of full prefill's answers (n = {len(every)})")
    one_entry = table.entry.nunique() == 2
    for (dataset, entry), rows in parted(table).groupby(["dataset", "entry"], sort=False):
        ax.step(*ecdf(rows.full_margin), where="post",
                label=f"{dataset}: where {'the entry' if one_entry else entry[:40]} leaves them (n = {len(rows)})")
    ax.set_xlabel("full prefill's margin at the step (p(its token) − p(runner-up))")
    ax.set_ylabel("share of steps at or below the margin")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_title("Answers part where full prefill itself is unsure", fontsize=10)
    ax.legend(fontsize=8, loc="center right", frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def lost_count(rows: pd.DataFrame) -> int:
    """How many of an entry's rows lose full prefill's right answer."""
    return int((rows.full_right.astype(bool) & ~rows.entry_right.astype(bool)).sum())


def report(table: pd.DataFrame, args) -> str:
    """Markdown: per entry, how many answers part from full's and where, full's margin there against at every step;
    then each sample where the entry loses full's right answer."""
    every = table[table.entry == FULL]
    entries = table[table.entry != FULL]
    lines = ["# Where the answers part from full prefill's, and how sure full was there (kvfuse step 26)", "",
             made_by("divergence_probe", args, "the entries below as --methods, with --runs; "
                     "`make kvfuse-divergence-probe` or `make kvfuse-divergence-probe-qa`") + "  ",
             f"Conditions: {', '.join(sorted(table.model.unique()))} (float32, CPU); prepared samples "
             f"({', '.join(table.dataset.unique())}; n = {table.qid.nunique()}); each entry at {args.ratio:.0%} and "
             f"`{FULL}` (kvfuse at ratio 1) over the stored `fusion` variant, greedy, as many new tokens as --runs "
             f"gave (else {NEW_TOKENS}). "
             "`margin`: full prefill's probability of its own token less the runner-up's at a step of its answer "
             "(teacher-forced over its own cache). `parted`: samples whose answer leaves full's at a step both reach; "
             "`place`: where, against the gold value full's answer spells.", "",
             f"| data | entry | samples | same answer | one stops first | parted | full's median margin where parted | "
             f"margin < {LOW} where parted | margin < {LOW} at every step of full's answers | lost where parted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (dataset, entry), rows in entries.groupby(["dataset", "entry"], sort=False):
        part = parted(rows)
        low_every = (every[every.dataset == dataset].full_margin < LOW).mean()
        lines.append(f"| {dataset} | {entry} | {len(rows)} | {int(rows.step.isna().sum())} | "
                     f"{len(rows) - len(part) - int(rows.step.isna().sum())} | {len(part)} | "
                     f"{part.full_margin.median():.2f} | {(part.full_margin < LOW).mean():.2f} | {low_every:.2f} | "
                     f"{lost_count(part)} |")
    lines += ["", "Where they part (parted samples; `lost`: full's answer right, the entry's wrong):", "",
              "| data | entry | place | parted | lost | full's median margin |", "|---|---|---|---|---|---|"]
    for (dataset, entry, place), rows in parted(table).groupby(["dataset", "entry", "place"], sort=False):
        lines.append(f"| {dataset} | {entry} | {place} | {len(rows)} | {lost_count(rows)} | "
                     f"{rows.full_margin.median():.2f} |")
    lost = parted(table)[lambda t: t.full_right.astype(bool) & ~t.entry_right.astype(bool)]
    lines += ["", "Each lost answer: the step where it parts, full's token and the entry's, and their probabilities under "
              "full prefill's cache and under the entry's:", ""]
    lines += table_lines(["sample", "entry", "place", "step", "full's token", "entry's token",
                          "under full: p(full's), p(entry's)", "under the entry: p(full's), p(entry's)"],
                         [f"| {r.qid} | {r.entry} | {r.place} | {int(r.step)} | {r.full_token!r} | {r.entry_token!r} | "
                          f"{r.full_p_full:.2f}, {r.full_p_entry:.2f} | {r.entry_p_full:.2f}, {r.entry_p_entry:.2f} |"
                          for _, r in lost.iterrows()])
    lines += ["", files_beside(args, "step of full's answers and per entry")]
    return "\n".join(lines) + "\n"


def options(p) -> None:
    p.add_argument("--offset", type=int, default=0, help="skip this many questions of each dataset (file order)")
    p.add_argument("-n", type=int, default=None, help="probe this many questions of each dataset (default: all)")


def main(argv: list[str] | None = None) -> int:
    return kvfuse_probe_main("divergence_probe", __doc__, "divergence-probe.md", KvFuse, read, plot, report, argv,
                             options)


if __name__ == "__main__":
    sys.exit(main())
