"""kvfuse's propagation, probed inside the cache: how near full prefill the fused chunk rows end, and the
first-token KL, for each propagate setting on the same prompts (the measurement behind its defaults).

    python -m kvf.scripts.kvfuse_probe [--dataset work/musique --first 20 --last 26 --passages 5]

Per question: the first --passages passages of a prepared dataset as chunks (prefix variant, as
stored by build-cache), kvfuse at 15% with each setting below. `kv error` is ||fused - full|| /
||full|| over every chunk row's K and V at the layers named; `kl` is KL(full || fused) of the first
token. Writes results/kvfuse/probe.md (dev questions only: the first 50 are kvf's dev split).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from rich.table import Table

from kvf.pipeline.data.datasets import load_prepared
from kvf.pipeline.files import write_atomic
from kvf.pipeline.fusion.methods import get_method
from kvf.pipeline.fusion.sources import InMemoryKV
from kvf.pipeline.model.prompt import encode
from kvf.pipeline.workflows.provenance import git_commit
from kvf.pipeline.workflows.weights import load_answerer
from kvf.pipeline.workflows.display import output_console

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = [("off", 0.0), ("after", 0.0), ("before", 0.0), ("before", 0.33), ("before", 0.5)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", type=Path, default=ROOT / "work" / "musique")
    p.add_argument("--first", type=int, default=20)
    p.add_argument("--last", type=int, default=26)
    p.add_argument("--passages", type=int, default=5)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "kvfuse" / "probe.md")
    return p.parse_args()


def first_passages_prompt(answerer, question, passages, n_passages: int):
    """A prepared question's first n_passages passages as chunks, in order, with its question."""
    chunks = [encode(answerer.tokenizer, passages[i].text) for i in question.context_ids[:n_passages]]
    return answerer.prompt(chunks, question.question)


def prefix_kvs(engine, prompt) -> InMemoryKV:
    """The prompt's chunk KVs as build-cache stores the prefix variant (each chunk after S alone), in memory."""
    return InMemoryKV([engine.chunk_kv(seg, prompt.prefix_ids, None) for seg in prompt.chunk_segments])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def first_token_kl(full_logits: torch.Tensor, logits: torch.Tensor) -> float:
    want, got = torch.log_softmax(full_logits.float(), -1), torch.log_softmax(logits.float(), -1)
    return torch.sum(want.exp() * (want - got)).item()


def probe(answerer, prompt) -> dict:
    """{(propagate, from): (kv error all layers, first third, last two thirds, kl)} for one prompt."""
    engine = answerer.engine
    full = get_method("full").prefill(engine, prompt)
    source = prefix_kvs(engine, prompt)
    rows = torch.arange(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens)
    want = full.cache.kv[:, :, :, rows]                                    # [L, 2, KV, n, d]
    third = round(want.shape[0] / 3)
    out = {}
    for propagate, start in SETTINGS:
        fused = get_method("kvfuse", 0.15, propagate=propagate, propagate_from=start).prefill(engine, prompt, source)
        got = fused.cache.kv[:, :, :, rows]
        out[(propagate, start)] = (relative_error(got, want), relative_error(got[:third], want[:third]),
                                   relative_error(got[third:], want[third:]), first_token_kl(full.logits, fused.logits))
    return out


def main():
    args = parse_args()
    torch.set_num_threads(1)
    console = output_console(140)
    answerer = load_answerer(None)
    questions, passages = load_prepared(args.dataset)
    results = []
    for q in questions[args.first: args.last]:
        results.append(probe(answerer, first_passages_prompt(answerer, q, passages, args.passages)))
        console.print(f"{q.qid}: done")
    columns = ["propagate", "from layer", "kv error (all)", "kv error (first third)", "kv error (rest)",
               "first-token KL", "KL below off"]
    rows = []
    for setting in SETTINGS:
        means = [statistics.mean(r[setting][i] for r in results) for i in range(4)]
        wins = sum(r[setting][3] < r[("off", 0.0)][3] for r in results)
        rows.append([setting[0], f"{setting[1]:.2f}", *(f"{m:.4f}" for m in means),
                     "-" if setting == ("off", 0.0) else f"{wins}/{len(results)}"])
    table = Table(title="kvfuse propagation vs full prefill")
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    md = ["# kvfuse: propagation probed inside the cache\n",
          f"Made by `python -m kvf.scripts.kvfuse_probe --dataset work/{args.dataset.name} --first {args.first} "
          f"--last {args.last} --passages {args.passages}` at commit {git_commit() or 'unknown'}.  \n"
          f"Conditions: SmolLM2-135M-Instruct (embedded, float32, CPU); MuSiQue dev questions {args.first}-"
          f"{args.last - 1} (n = {len(results)}), first {args.passages} passages each as chunks (prefix variant), "
          f"kvfuse at 15% recomputation. Means over questions.\n",
          "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    write_atomic(args.out, "\n".join(md) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
