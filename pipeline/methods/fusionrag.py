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

import time

import torch

from kvf.pipeline.engine import FusionEngine, FusionResult, LayerKVSource, recompute_budget
from kvf.pipeline.methods.base import FusionMethod, all_chunk_rows, register, top_rows
from kvf.pipeline.prompt import FusedPrompt


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
    offline_variant = "fusion"

    def __init__(self, recompute_ratio: float = 0.15):
        super().__init__(recompute_ratio)

    # ---- what differs between FusionRAG and ProphetKV --------------------------------------
    def scored_layers(self, n_layers: int) -> list[int]:
        """Layers whose Q attention pass 1 records: FusionRAG reads the last layer only."""
        return [n_layers - 1]

    def token_scores(self, query_attention: list[torch.Tensor]) -> torch.Tensor:
        """Recorded per-layer [n] Q attention -> [n] score per cache row."""
        return last_layer_scores(query_attention)

    # ---- the two passes ---------------------------------------------------------------------
    def prefill(self, engine: FusionEngine, prompt: FusedPrompt, source: LayerKVSource | None,
                max_new_tokens: int = 0) -> FusionResult:
        started = time.perf_counter()

        def loaded_seconds() -> float:  # store reading so far (kept out of `select`)
            return source.load_seconds if source is not None else 0.0

        load_before = loaded_seconds()
        n_layers = engine.model.n_layers
        state = engine.start(prompt, source, recompute_chunk_rows=torch.empty(0, dtype=torch.long),
                             positions=self.positions(prompt), max_new_tokens=max_new_tokens)
        # pass 1: Q only over the reused KV, recording Q's attention where the score needs it
        pass_started, load_at_pass = time.perf_counter(), loaded_seconds()
        scored = set(self.scored_layers(n_layers))
        for layer in range(n_layers):
            engine.step(state, layer, record_query_attention=layer in scored)  # appends [n] per scored layer
        budget = recompute_budget(self.recompute_ratio, prompt.n_chunk_tokens)
        selected = select_chunk_rows(self.token_scores(state.query_attention), prompt, budget)  # [budget]
        state.select_seconds += max(0.0, (time.perf_counter() - pass_started) - (loaded_seconds() - load_at_pass))
        # pass 2: the selected rows and Q, from fresh embeddings, through every layer
        engine.restart(state, selected)
        for layer in range(n_layers):
            engine.step(state, layer)
        result = engine.finish(state, loaded_seconds() - load_before, started)
        result.recomputed_tokens = len(selected)
        return result
