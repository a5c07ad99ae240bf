"""`fusionrag` (FusionRAG, seed fusionrag.txt §3): the `fusion` offline variant plus query-guided selection.

Offline (§3.1, eq. 10), each chunk was prefilled after S and its most similar chunks, so its stored
KV already carries some cross-chunk attention. Online (§3.2), two passes over the reused KV:
- pass 1 (selection): a query-only pass through every layer, exactly like `reuse`; at the last
  layer we take Q's attention to every cache row (softmax over the whole fused KV, averaged over
  heads and Q tokens: only Q's rows of attention are formed, [H, |Q|, n]); the top round(r * chunk
  tokens) chunk tokens, ranked globally, are selected. The paper sums Q's attention columns; we
  average, which ranks identically.
- pass 2 (recompute): the selected rows plus Q are recomputed from layer 0 through every layer,
  on the cache pass 1 left behind (engine.restart: it is already loaded, and only Q's rows were
  overwritten, which pass 2 overwrites again before anyone reads them).
Timing: pass 1 counts as `select` (minus any store loading it did), pass 2 as `recompute`.
ProphetKV (prophetkv.py) is the same two passes with a different score; it subclasses this.
"""
from __future__ import annotations

import torch

from kvf.pipeline.fusion.engine import FusionEngine, FusionState, recompute_budget
from kvf.pipeline.fusion.methods.base import FusionMethod, all_chunk_rows, register, top_rows
from kvf.pipeline.model.prompt import FusedPrompt


def last_layer_scores(query_attention: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer Q attention, a list of [n] (last entry = last layer) -> [n] score of the last layer."""
    return query_attention[-1]


def select_chunk_rows(scores: torch.Tensor, prompt: FusedPrompt, budget: int) -> torch.Tensor:
    """The `budget` chunk rows with the highest scores [n], chosen globally over all chunks, sorted."""
    chunk_rows = all_chunk_rows(prompt)
    return top_rows(scores[chunk_rows], chunk_rows, budget)


@register
class FusionRAG(FusionMethod):
    name = "fusionrag"
    summary = "`fusion` variant + top-r tokens by the last layer's Q attention"
    offline_variant = "fusion"
    passes = 2  # pass 1 (Q only) selects, pass 2 recomputes
    query_pass = True  # pass 1 is reuse's pass: a sweep runs it once per question and variant
    reuse_at_ratio_zero = True

    # ---- what differs between FusionRAG and ProphetKV --------------------------------------
    def scored_layers(self, n_layers: int) -> list[int]:
        """Layers whose Q attention pass 1 records: FusionRAG reads the last layer only."""
        return [n_layers - 1]

    def token_scores(self, query_attention: list[torch.Tensor]) -> torch.Tensor:
        """Recorded per-layer [n] Q attention -> [n] score per cache row."""
        return last_layer_scores(query_attention)

    # ---- the two passes ---------------------------------------------------------------------
    def records_query_attention(self, state: FusionState, layer: int) -> bool:
        return state.pass_index == 0 and layer in self.scored_layers(state.cache.kv.shape[0])

    def next_pass_rows(self, engine: FusionEngine, state: FusionState) -> torch.Tensor:
        budget = recompute_budget(self.recompute_ratio, state.prompt.n_chunk_tokens)
        selected = select_chunk_rows(self.token_scores(state.query_attention), state.prompt, budget)  # [budget]
        state.scratch["selected"] = selected
        return selected
