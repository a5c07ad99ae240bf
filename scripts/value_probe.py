"""Where does decoding read when it writes the answer's value? kvfuse step 23's diagnosis (results/kvfuse.md): by
the first token step 19's question reads the fact chunks as full prefill's does (step 22), and at 4K its answers
still trail full's.

    python -m kvf.scripts.value_probe --data work/ruler-4096-s99 --runs results/kvfuse/runs/dev-ruler-4096.jsonl.gz \\
        --methods kvfuse:sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85:... \\
        --out results/kvfuse/value-probe.md                    # .csv and .png beside it
    python -m kvf.scripts.value_probe --replot --out results/kvfuse/value-probe.md

Per sample of a prepared RULER-style dataset (built), full prefill (kvfuse at ratio 1) answers, and the decoding step
that writes the first token of the gold value in its answer is found. Full's answer up to that step is then fed,
teacher-forced, over full prefill's cache and over each kvfuse entry's (after its work after the first token, as
decoding reads it). At that step the probe keeps, per layer, the share of the step's attention over chunk rows that
falls on the rows spelling the value in the prompt (`value_share`) and on the fact chunks (`fact_share`), and per
sample the probability given to full's token there (`p_value`) and whether it is the top one. A sample whose full
answer does not spell the gold value, or spells it with its first token (that read is read_probe's), is left out
and counted. With --runs, each sample's answer under the entry (and under `full`) is joined as `correct`.

--fact-chunks-whole adds, after each entry, an oracle no request can have: the same entry with the sample's fact
chunks recomputed whole on top of its own rows (so over its budget), its answer decoded here and scored as `correct`.
It asks whether the value's margin is decided by the fact chunks' own rows or by the rows of the other chunks.
--rest-whole adds its complement: the entry with every chunk but the fact chunks recomputed whole on top of its own
rows (step 26). Together they split what full prefill has that the entry lacks between the two sets of chunks.
"""
from __future__ import annotations

import sys
from itertools import chain
from pathlib import Path

import pandas as pd
import torch

from kvf.eval.metrics import accuracy
from kvf.pipeline.fusion.methods.base import chunk_attention
from kvf.pipeline.fusion.methods.kvfuse import KvFuse
from kvf.pipeline.model.decode import teacher_forced_logits
from kvf.scripts.hop_probe import gold_value_rows, kvfuse_probe_main, mass_on, probed_samples
from kvf.scripts.locate_probe import files_beside, made_by, table_lines
from kvf.scripts.read_probe import FULL, share_by_layer


def value_step(token_ids: list[int], decode, value: str) -> int | None:
    """The index of the answer token that writes the first character of `value`; None if the answer does not spell
    it or spells it from its first token."""
    at = decode(token_ids).find(value)
    if at < 0:
        return None
    step = next(i for i in range(len(token_ids)) if len(decode(token_ids[:i + 1])) > at)
    return step or None


@torch.inference_mode()
def read_at(session, fused, forced: list[int], prompt, value: torch.Tensor, facts: set[int]) -> tuple[list, float, bool]:
    """Feed forced[:-1] over fused's cache -> (per layer (value_share, fact_share) of the last fed token's read,
    the probability of forced[-1] next, whether it is the top token)."""
    reads = []                                                                   # per layer [1, n + fed]
    step = len(forced) - 1
    logits = teacher_forced_logits(session.answerer.transformer, fused.logits[None], fused.cache,
                                   fused.prefill_rows, fused.next_position, forced, fused.calibration,
                                   attention_out=reads, attention_rows=slice(step - 1, step))
    p = logits[step].float().softmax(dim=-1)                                     # [vocab]
    shares = []
    for read in reads:
        attention = read[0, :fused.prefill_rows].float().cpu()                  # [n] over the prompt's rows
        shares.append((float(attention[value].sum() / chunk_attention(attention, prompt).sum()),
                       mass_on(attention, prompt, facts)))
    return shares, float(p[forced[-1]]), int(torch.argmax(p)) == forced[-1]


class ChunksWhole(KvFuse):
    """An oracle: kvfuse whose recomputed rows are its own plus every row of the chunks in `whole` (chunk positions),
    set per prompt before it runs."""
    whole: set[int] = set()

    def next_pass_rows(self, engine, state):
        rows = super().next_pass_rows(engine, state)
        if state.pass_index != self.recompute_pass - 1 or not self.whole:       # not the pass that recomputes
            return rows
        spans = state.prompt.chunk_spans()
        whole_rows = torch.cat([torch.arange(*spans[i]) for i in sorted(self.whole)])      # [w]
        state.scratch["selected"] = torch.unique(torch.cat([rows, whole_rows.to(rows.device)]))   # sorted
        return state.scratch["selected"]


# the oracles a flag adds: flag's attribute -> (label suffix, the chunks recomputed whole from (facts, chunk count))
ORACLES = {"fact_chunks_whole": (" + fact chunks whole (oracle)", lambda facts, k: set(facts)),
           "rest_whole": (" + other chunks whole (oracle)", lambda facts, k: set(range(k)) - set(facts))}


def answered_oracles(session, prompt, keys, q, specs, ratio: float, facts: set[int], flags: list[str]):
    """Per flag in `flags` and spec, its ChunksWhole oracle for a sample whose fact chunks are `facts`, answered once:
    (label, its cache as decoding left it, which read_at reads as it reads full prefill's, its answer's accuracy)."""
    for flag in flags:
        suffix, chunks_whole = ORACLES[flag]
        for spec in specs:
            oracle = ChunksWhole(ratio, **spec.knobs)
            oracle.whole = chunks_whole(facts, len(prompt.chunk_segments))
            answer = session.answer(prompt, oracle, keys, 32).answer
            yield (spec.label or spec.name) + suffix, answer.fused, accuracy(answer.text, q.answers, q.gold_mode)


HEAD = "# Where decoding reads when it writes the value"
TITLES = {(): f"{HEAD} (kvfuse step 23)",
          ("fact_chunks_whole",): f"{HEAD}, with the fact chunks recomputed whole (kvfuse step 25)",
          ("rest_whole",): f"{HEAD}, with the other chunks recomputed whole (kvfuse step 26)",
          ("fact_chunks_whole", "rest_whole"): f"{HEAD}, with the fact chunks or the other chunks recomputed whole "
                                               "(kvfuse steps 25 and 26)"}
MAKE = {(): "make kvfuse-value-probe", ("fact_chunks_whole",): "make kvfuse-value-probe-facts",
        ("rest_whole",): "make kvfuse-value-probe-rest", ("fact_chunks_whole", "rest_whole"): "make kvfuse-value-probe-rest"}


def oracle_flags(args) -> list[str]:
    """The oracle flags set in args, in ORACLES' order."""
    return [flag for flag in ORACLES if getattr(args, flag, False)]


def read(data: Path, specs, ratio: float, runs: Path | None, args=None) -> pd.DataFrame:
    """One row per (sample, entry or full prefill, layer): value_share, fact_share, p_value, top_is_value, correct;
    a left-out sample is one row with layer -1."""
    rows = []
    oracles = oracle_flags(args)
    for s, answered, q, chunks, prompt, facts in probed_samples(data, runs, f"{data.name}: the step that writes the value"):
        decode, keys = s.model_ref.tokenizer.decode, s.entries("fusion", chunks)
        full = s.answer(prompt, KvFuse(1.0), keys, max_new_tokens=32).answer
        step = value_step(full.token_ids, decode, q.answers[0])
        base = dict(dataset=data.name, model=s.manifest["model"], task=q.task, qid=q.qid)
        if step is None:
            rows.append(dict(base, entry=FULL, layer=-1))
            continue
        value = gold_value_rows(s, data, q, prompt)                              # [v] the value's rows in the prompt
        forced = full.token_ids[:step + 1]                                       # the answer up to the value's token
        answer_in_runs = lambda name, label: answered.get((q.qid, name, label), (float("nan"),))[0]   # noqa: E731
        entries = chain([(FULL, full.fused, answer_in_runs("full", None))],      # lazily: each cache made when read
                        ((spec.label or spec.name, s.prefill(prompt, KvFuse(ratio, **spec.knobs), keys,
                                                             max_new_tokens=32)[0], answer_in_runs(spec.name, spec.label))
                         for spec in specs))
        if oracles:                                                              # answered here: no run file has them
            entries = chain(entries, answered_oracles(s, prompt, keys, q, specs, ratio, facts, oracles))
        for entry, fused, correct in entries:
            shares, p_value, top = read_at(s, fused, forced, prompt, value, facts)
            for layer, (value_share, fact_share) in enumerate(shares):
                rows.append(dict(base, entry=entry, layer=layer, value_share=value_share, fact_share=fact_share,
                                 p_value=p_value, top_is_value=top, correct=correct))
    return pd.DataFrame(rows)


def probed(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of samples whose value step was read (left-out samples dropped)."""
    return table[table.layer >= 0]


def plot(table: pd.DataFrame, out: Path) -> None:
    """The value step's mean attention share on the value's rows per layer, one line per entry (full prefill dashed)."""
    share_by_layer(probed(table), out, "value_share", "attention on the value's rows\n(share of chunk rows, mean)",
                   "the step that writes the value")


def copy_layer(table: pd.DataFrame) -> int:
    """The layer at which full prefill's value step reads the value's rows most (mean over samples)."""
    full = probed(table)[lambda t: t.entry == FULL]
    return int(full.groupby("layer").value_share.mean().idxmax())


def share(values: pd.Series) -> str:
    """A mean to two places, or "—" where nothing was joined (an entry with no answers in --runs)."""
    return "—" if values.isna().all() else f"{values.mean():.2f}"


def report(table: pd.DataFrame, args) -> str:
    """Markdown: per task and entry, the value share at full's copy layer and its most over layers, the probability of
    full's value token and the samples that put it first, and accuracy; then the samples where an entry does not."""
    left_out = table[table.layer < 0].qid.nunique()
    read_rows, copy = probed(table), copy_layer(table)
    flags = oracle_flags(args)
    lines = [TITLES[tuple(flags)], "",
             made_by("value_probe", args, "the entries below as --methods"
                     + "".join(f", and --{flag.replace('_', '-')}" for flag in flags) + f"; `{MAKE[tuple(flags)]}`") + "  ",
             f"Conditions: {', '.join(sorted(table.model.unique()))} (float32, CPU); RULER-style samples "
             f"({', '.join(table.dataset.unique())}; n = {read_rows.qid.nunique()} read, {left_out} left out: full "
             f"prefill's answer does not spell the gold value); each entry at {args.ratio:.0%} and `{FULL}` (kvfuse at "
             "ratio 1) over the stored `fusion` variant, full prefill's answer teacher-forced up to the token that "
             f"writes the value's first character. `value share`: the share of that step's attention over chunk rows "
             f"on the rows that spell the value in the prompt (mean over samples), at layer {copy} (where full prefill's "
             "reads it most) and at each sample's most; `p(value)`: the probability given to full's token there; `top`: "
             "samples that put it first; `accuracy`: the entry's answers in --runs (—: none there)"
             + (", and for an oracle row (" + " or ".join(f"`{ORACLES[f][0].split(' (')[0].strip()}`" for f in flags)
                + ") its own answer, decoded by the probe" if flags else "")
             + ".", "",
             f"| task | entry | n | value share, layer {copy} | value share, most over layers | p(value) | top | accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for (task, entry), rows in pd.concat([read_rows.assign(task="all"), read_rows]).groupby(["task", "entry"], sort=False):
        per_sample = rows.groupby("qid")
        lines.append(f"| {task} | {entry} | {per_sample.ngroups} | {rows[rows.layer == copy].value_share.mean():.2f} | "
                     f"{per_sample.value_share.max().mean():.2f} | {per_sample.p_value.first().mean():.2f} | "
                     f"{int(per_sample.top_is_value.first().sum())} | {share(per_sample.correct.first())} |")
    missed = read_rows[(read_rows.layer == copy) & ~read_rows.top_is_value.astype(bool)]
    lines += ["", f"Samples where an entry does not put full's value token first (value share at layer {copy}, "
              "p(value); full prefill's beside it):", ""]
    full_at = read_rows[(read_rows.layer == copy) & (read_rows.entry == FULL)].set_index("qid")
    lines += table_lines(["sample", "entry", "value share", "p(value)", "full prefill's value share",
                          "full prefill's p(value)"],
                         [f"| {r.qid} | {r.entry} | {r.value_share:.2f} | {r.p_value:.2f} | "
                          f"{full_at.value_share[r.qid]:.2f} | {full_at.p_value[r.qid]:.2f} |" for _, r in missed.iterrows()])
    lines += ["", files_beside(args, "sample and layer")]
    return "\n".join(lines) + "\n"


def options(p) -> None:
    p.add_argument("--fact-chunks-whole", action="store_true",
                   help="after each entry, an oracle: the same entry with the fact chunks recomputed whole (see the doc)")
    p.add_argument("--rest-whole", action="store_true",
                   help="after each entry, an oracle: the same entry with every other chunk recomputed whole (see the doc)")


def main(argv: list[str] | None = None) -> int:
    return kvfuse_probe_main("value_probe", __doc__, "value-probe.md", KvFuse, read, plot, report, argv, options)


if __name__ == "__main__":
    sys.exit(main())
