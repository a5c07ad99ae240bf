"""Could a correction of the kept rows reach full prefill's answers? Issue 17's last open direction: at 15%,
85% of chunk rows keep their stored, context-free KV, and kvfuse's shift moves them by their chunk's mean.
Here those rows are corrected with what only full prefill knows: what any correction aims at.

    python -m kvf.scripts.correction_probe --first 50 --last 65 --records DIR/50-64.jsonl   # answer
    python -m kvf.scripts.correction_probe --report DIR/*.jsonl --out results/kvfuse/correction.md   # and .csv

Per question, as scripts/selection_probe.py (the first --passages passages as chunks, prefix variant in
memory, full prefill's greedy answer), every configuration recomputes the rows ProphetKV's ranking picks
(kvfuse with propagate=off) and then, after the first token as kvfuse's shift does, changes the kept rows:
- `question`: nothing (ProphetKV's ranking, kvfuse without its shift);
- `kvfuse`: kvfuse's default, each chunk's mean move estimated from its recomputed rows;
- `true chunk-mean move`: each chunk's mean move of K and V taken from full prefill instead (the nearest to
  full any per-chunk shift brings the rows, learned or not);
- `true linear map of K`: per layer and KV head, the least-squares affine map from the kept rows' stored keys
  to full's, fitted on those very rows (the nearest to full's keys any linear correction of them gets);
- `exact V` / `exact K` / `exact K and V`: full prefill's values, keys, or both, for every kept row.
Keys are compared before RoPE and re-rotated at each row's position, as kvfuse's shift does.
"""
from __future__ import annotations

import sys

import torch

from kvf.pipeline.fusion.methods import get_method
from kvf.pipeline.fusion.methods.kvfuse import KvFuse, chunk_means, kept_chunk_rows
from kvf.pipeline.model.rope import apply_rope, unapply_rope
from kvf.pipeline.files import write_atomic
from kvf.scripts.kvfuse_probe import prefix_kvs
from kvf.scripts.selection_probe import ROOT, conditions, fidelity_table, main as probe_main, read_records

CORRECTIONS = ["true chunk-mean move", "true linear map of K", "exact V", "exact K", "exact K and V"]
CONFIGS = ["question", "kvfuse", *CORRECTIONS]


class CorrectedWith(KvFuse):
    """kvfuse's rows without its shift; after the first token the kept rows get `correction` from full's KV."""

    def __init__(self, recompute_ratio: float, full_kv: torch.Tensor, correction: str):
        super().__init__(recompute_ratio, propagate="off")
        self.full_kv, self.correction = full_kv, correction                     # [L, 2, KV, n, d]

    def finish(self, engine, state, result) -> None:
        result.after_first_token = lambda: self.correct(engine, state)

    def correct(self, engine, state) -> None:
        kept, chunk_of_kept = kept_chunk_rows(state, state.scratch["selected"])     # [m], [m]
        cos, sin, scaling = state.cos[kept], state.sin[kept], engine.model.rope.scaling
        for layer in range(state.cache.kv.shape[0]):
            stored, full = state.cache.kv[layer][:, :, kept], self.full_kv[layer][:, :, kept]   # [2, KV, m, d]
            stored_k, full_k = unapply_rope(stored[0], cos, sin, scaling), unapply_rope(full[0], cos, sin, scaling)
            k, v = corrected(self.correction, stored_k, full_k, stored[1], full[1], chunk_of_kept)
            state.cache.kv[layer, 0][:, kept] = apply_rope(k, cos, sin)
            state.cache.kv[layer, 1][:, kept] = v


def corrected(correction: str, stored_k, full_k, stored_v, full_v, chunk_of_kept) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's kept rows, [KV, m, d] each (keys before RoPE) -> their K and V after `correction`."""
    if correction == "true chunk-mean move":
        return chunk_mean_moved(stored_k, full_k, stored_v, full_v, chunk_of_kept)
    if correction == "true linear map of K":
        return affine_fit(stored_k, full_k), stored_v
    if correction == "exact V":
        return stored_k, full_v
    if correction == "exact K":
        return full_k, stored_v
    return full_k, full_v                                                            # exact K and V


def chunk_mean_moved(stored_k, full_k, stored_v, full_v, chunk_of_kept) -> tuple[torch.Tensor, torch.Tensor]:
    """[KV, m, d] each -> stored K and V moved by their chunk's mean (full - stored)."""
    heads = stored_k.shape[0]
    means = chunk_means(torch.cat([full_k - stored_k, full_v - stored_v]), chunk_of_kept, int(chunk_of_kept.max()) + 1)
    move_k, move_v = means[:, chunk_of_kept].split(heads)                        # [KV, m, d] each
    return stored_k + move_k, stored_v + move_v


def affine_fit(stored_k: torch.Tensor, full_k: torch.Tensor) -> torch.Tensor:
    """[KV, m, d] -> per head the least-squares [stored_k, 1] @ W nearest full_k, on these rows (in-sample)."""
    x = torch.cat([stored_k, torch.ones_like(stored_k[..., :1])], dim=-1).double()   # [KV, m, d + 1]
    w = torch.linalg.lstsq(x, full_k.double()).solution                              # [KV, d + 1, d]
    return (x @ w).to(stored_k.dtype)


def answers_with(methods_of):
    """answers(answerer, prompt, ratio, max_new_tokens) -> {config: answer text}, full prefill's under "full",
    for the configurations methods_of(ratio, full_kv) names (full_kv: full prefill's cache, [L, 2, KV, n, d])."""
    def answers(answerer, prompt, ratio: float, max_new_tokens: int) -> dict:
        engine = answerer.engine
        source = prefix_kvs(engine, prompt)
        full = answerer.answer(prompt, get_method("full"), None, max_new_tokens)
        full_kv = get_method("full").prefill(engine, prompt).cache.kv.clone()      # [L, 2, KV, n, d]
        got = {name: answerer.answer(prompt, method, source, max_new_tokens).text
               for name, method in methods_of(ratio, full_kv).items()}
        return {"full": full.text, **got}
    return answers


def corrections(ratio: float, full_kv: torch.Tensor) -> dict:
    return {"question": get_method("kvfuse", ratio, propagate="off"), "kvfuse": get_method("kvfuse", ratio),
            **{c: CorrectedWith(ratio, full_kv, c) for c in CORRECTIONS}}


def write_report(args, title: str, configs: list[str], prog: str, header: str) -> None:
    """The fidelity table of the records in args.report -> args.out (.md, and .csv beside it)."""
    df = read_records(args.report)
    lines = [f"# {title}", "", *conditions(args, df, prog, "kvfuse-" + prog.removesuffix("_probe")), "",
             *fidelity_table(df, configs, args.out, header)]
    write_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


def report(args) -> None:
    write_report(args, "Could a correction of the kept rows reach full prefill? The kept rows corrected from full prefill",
                 CONFIGS, "correction_probe",
                 "| the 85% kept rows, after the first token | fidelity [95%] | − `question`, paired [95%] |")


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, doc=__doc__, answers_of=answers_with(corrections), report_of=report, prog="correction_probe",
                      default_out=ROOT / "results" / "kvfuse" / "correction.md")


if __name__ == "__main__":
    sys.exit(main())
