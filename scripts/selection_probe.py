"""How much answer fidelity is left to gain by choosing *which* rows to recompute? Issue 17's question:
selection by the question's attention (ProphetKV's ranking, kvfuse's), against the same ranking told
more than a real request knows.

    python -m kvf.scripts.selection_probe --first 50 --last 65 --records DIR/50-64.jsonl   # answer
    python -m kvf.scripts.selection_probe --report DIR/*.jsonl --out results/kvfuse/selection.md   # and .csv

Per question: the first --passages passages of a prepared dataset as chunks (prefix variant, computed in
memory as build-cache stores it), full prefill's greedy answer, then at --ratio:
- `question`: kvfuse without its shift (propagate=off), i.e. the rows ProphetKV's ranking picks: Q's
  attention averaged over layers;
- `question + first token`: the same ranking with the first answer token (pass 1's own greedy token) as
  one more query row, what a method could afford before its first token;
- `question + full's answer` (an oracle): the ranking with full prefill's whole answer appended to Q,
  teacher-forced, so the rows are those the answer itself reads;
- `kvfuse`: kvfuse's default (the `question` rows, then each chunk's kept rows shifted).
Fidelity is the answer's token F1 against full's. --report prints each mean with its 95% bootstrap
interval and each paired difference to `question`. Questions 50-99 of MuSiQue are in no other run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch
from rich.progress import track

from kvf.errors import KvfError
from kvf.eval.metrics import token_f1
from kvf.eval.stats import mean_interval, paired_bootstrap
from kvf.pipeline.data.datasets import load_prepared
from kvf.pipeline.files import write_atomic
from kvf.pipeline.fusion.methods import get_method
from kvf.pipeline.fusion.methods.kvfuse import KvFuse
from kvf.pipeline.model.prompt import FusedPrompt, encode
from kvf.pipeline.workflows.provenance import git_commit
from kvf.pipeline.workflows.run import dataset_name
from kvf.pipeline.workflows.weights import load_answerer
from kvf.scripts.kvfuse_probe import first_passages_prompt, prefix_kvs

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["question", "question + first token", "question + full's answer", "kvfuse"]


class RankedBy(KvFuse):
    """kvfuse whose pass 2 ranks rows by the given per-layer attention [n_ext] (cut to the prompt's n rows)
    instead of what its own pass 1 recorded."""

    def __init__(self, recompute_ratio: float, attention: list[torch.Tensor], **knobs):
        super().__init__(recompute_ratio, **knobs)
        self.attention = attention

    def next_pass_rows(self, engine, state):
        state.query_attention = [a[: state.n] for a in self.attention]
        return super().next_pass_rows(engine, state)


def attention_with(engine, prompt: FusedPrompt, source, extra_ids: list[int]) -> tuple[list[torch.Tensor], int]:
    """Pass 1 (Q's rows over the stored cache) with extra_ids appended to Q -> per layer the mean attention
    of Q's rows and the extra rows [n + extra], and the greedy token after them."""
    extended = FusedPrompt(prefix_ids=prompt.prefix_ids, chunk_segments=prompt.chunk_segments,
                           question_ids=list(prompt.question_ids) + list(extra_ids))
    done = engine.query_pass(extended, source, 0)
    return done.query_attention, int(torch.argmax(engine.model.logits(done.hidden[-1:])[0]))


def answers(answerer, prompt: FusedPrompt, ratio: float, max_new_tokens: int) -> dict:
    """{config: answer text} for one prompt, full prefill's under "full"."""
    engine = answerer.engine
    source = prefix_kvs(engine, prompt)
    full = answerer.answer(prompt, get_method("full"), None, max_new_tokens)
    _, first_token = attention_with(engine, prompt, source, [])
    with_first, _ = attention_with(engine, prompt, source, [first_token])
    full_ids = encode(answerer.tokenizer, full.text)           # full's answer, as the tokenizer splits its text
    with_answer, _ = attention_with(engine, prompt, source, full_ids)
    methods = {"question": get_method("kvfuse", ratio, propagate="off"),
               "question + first token": RankedBy(ratio, with_first, propagate="off"),
               "question + full's answer": RankedBy(ratio, with_answer, propagate="off"),
               "kvfuse": get_method("kvfuse", ratio)}
    got = {name: answerer.answer(prompt, method, source, max_new_tokens).text for name, method in methods.items()}
    return {"full": full.text, **got}


def answer_questions(args, answers_of=answers) -> None:
    """Append one record per question of [--first, --last) to --records: {qid, prompt_tokens, full, config...}
    from answers_of(answerer, prompt, ratio, max_new_tokens) (this probe's `answers` by default)."""
    torch.set_num_threads(1)
    questions, passages = load_prepared(args.dataset)     # first: a wrong --dataset fails before the model loads
    answerer = load_answerer(None)
    done = set()
    if args.records.exists():  # resumable: a question already written is not answered again
        done = {json.loads(line)["qid"] for line in args.records.read_text().splitlines() if line.strip()}
    args.records.parent.mkdir(parents=True, exist_ok=True)
    with args.records.open("a") as out:
        for q in track(questions[args.first: args.last], description="questions"):
            if q.qid in done:
                continue
            prompt = first_passages_prompt(answerer, q, passages, args.passages)
            record = {"qid": q.qid, "prompt_tokens": prompt.n_tokens,
                      **answers_of(answerer, prompt, args.ratio, args.max_new_tokens)}
            out.write(json.dumps(record) + "\n")
            out.flush()


def read_records(paths: list[Path]) -> pd.DataFrame:
    records = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    return pd.DataFrame(records).drop_duplicates("qid").set_index("qid")


def fidelity_table(df: pd.DataFrame, configs: list[str], out: Path, header: str) -> list[str]:
    """Each config's fidelity (answer F1 against full's) with its 95% interval and its paired difference to
    configs[0] -> markdown rows under `header`; the same numbers to out's .csv."""
    base = configs[0]
    fidelity = pd.DataFrame({c: [token_f1(a, [f]) for a, f in zip(df[c], df["full"])] for c in configs}, index=df.index)
    lines, table = [header, "|---|---|---|"], []
    for c in configs:
        low, high = mean_interval(fidelity[c])
        diff = paired_bootstrap(fidelity[c], fidelity[base])[:3]                       # (mean, low, high)
        table.append(dict(config=c, n=len(df), fidelity=fidelity[c].mean(), low=low, high=high,
                          vs_question=diff[0], vs_question_low=diff[1], vs_question_high=diff[2]))
        shown = "—" if c == base else "{:+.3f} [{:+.3f}, {:+.3f}]".format(*diff)
        lines.append(f"| {c} | {fidelity[c].mean():.3f} [{low:.3f}, {high:.3f}] | {shown} |")
    write_atomic(out.with_suffix(".csv"), pd.DataFrame(table).to_csv(index=False))
    return lines


DATASET_NAMES = {"musique": "MuSiQue", "2wikimqa": "2WikiMQA", "nq": "NQ-open", "hotpotqa": "HotpotQA"}


def source_of(dataset: Path) -> str:
    """A prepared dataset -> its name and source file as the conditions line shows them, e.g.
    MuSiQue (`musique/musique_s.json`)."""
    name = dataset_name(dataset)                       # as kvf run names it (prepared.json, else the folder)
    manifest = dataset / "prepared.json"
    source = json.loads(manifest.read_text()).get("source") if manifest.is_file() else None
    return DATASET_NAMES.get(name, name) + (f" (`{Path(source).parent.name}/{Path(source).name}`)" if source else "")


def conditions(args, df: pd.DataFrame, script: str, target: str) -> list[str]:
    return [f"Made by `make {args.target or target}` at commit {git_commit() or 'unknown'} (`python -m kvf.scripts.{script}`; "
            f"records in `{args.report[0].parent}/`).  ",
            f"Conditions: SmolLM2-135M-Instruct (embedded, float32, CPU); {source_of(args.dataset)} questions "
            f"{args.first_label}, n = {len(df)}, the first {args.passages} passages of each as chunks (prefix variant, "
            f"{df.prompt_tokens.mean():,.0f} prompt tokens on average), {args.ratio:.0%} recomputation, "
            f"{args.max_new_tokens} new tokens; every configuration, kvfuse included, reads the same prefix-variant KVs. Fidelity: answer token F1 against full prefill's answer; 95% "
            "percentile-bootstrap intervals over questions (paired for differences)."]


def report(args) -> None:
    df = read_records(args.report)
    lines = ["# Which rows to recompute: how much the ranking can still gain", "",
             *conditions(args, df, "selection_probe", "kvfuse-selection"), "",
             *fidelity_table(df, CONFIGS, args.out, "| rows recomputed (15%) chosen by | fidelity [95%] | − `question`, paired [95%] |")]
    same = int((df["question + first token"] == df["question"]).sum())
    lines += ["", f"`question + first token` gives the same answer as `question` on {same} of {len(df)} questions."]
    write_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None, *, doc: str = __doc__, answers_of=answers, report_of=report,
         default_out: Path = ROOT / "results" / "kvfuse" / "selection.md", prog: str = "selection_probe") -> int:
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("--dataset", type=Path, default=ROOT / "work" / "musique")
    p.add_argument("--first", type=int, default=50)
    p.add_argument("--last", type=int, default=80)
    p.add_argument("--passages", type=int, default=4)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--records", type=Path, help="run file to append this range's answers to")
    p.add_argument("--report", type=Path, nargs="+", help="run files to score")
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--target", help="the make target the report says made it [default: this probe's own]")
    args = p.parse_args(argv)
    if bool(args.records) == bool(args.report):
        print(f"{prog}: error: pass --records FILE (answer questions) or --report FILE... (score them)", file=sys.stderr)
        return 2
    missing = [path for path in args.report or () if not path.is_file()]
    if missing:
        print(f"{prog}: error: --report {missing[0]}: no such file; make it with --records first", file=sys.stderr)
        return 1
    try:
        if args.records:
            answer_questions(args, answers_of)
        else:
            args.first_label = f"{args.first}–{args.last - 1}"
            report_of(args)
    except KvfError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
