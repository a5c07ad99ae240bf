"""`oracle`: the most fidelity a deviation-ranked selector can keep at a given ratio. A reference, not
a fusion method: it pays a full prefill to choose its rows.

CacheBlend ranks chunk rows by how far their stored KV lies from what recomputation would give, but
measures it at one early layer on a partial recomputation. `oracle` knows the answer: it runs full
prefill first and ranks every chunk row by how far its stored KV lies from full prefill's, over every
layer, then recomputes the top round(r * chunk tokens) of them exactly as the selective methods do.
- Pass 1 is reuse's query-only pass (every layer's stored KV loaded, Q computed); its cache holds
  the stored rows at their positions.
- Between the passes: full prefill of the whole prompt into a separate cache; per chunk row, the
  squared distance of its stored K and V from full prefill's at each layer, divided by that layer's
  mean squared full-prefill K (resp. V) norm over chunk rows (layers differ in scale by orders of
  magnitude), summed over layers, K and V.
- Pass 2 recomputes the chosen rows and Q from layer 0 over the stored rest (engine.restart).
What it cannot say: a row far from full prefill is not always one the answer needs, so this is the
ceiling of *deviation* ranking, not of every selector. Its TTFT includes a full prefill: compare its
fidelity, never its speed.
"""
from __future__ import annotations

import torch

from kvf.pipeline.fusion.engine import FusionEngine, FusionState, recompute_budget
from kvf.pipeline.fusion.methods.base import FusionMethod, all_chunk_rows, register, top_rows


def distance_to_full(stored: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """stored, full [L, 2, KV, c, d] chunk rows (keys rotated at the same positions) -> [c] each row's
    squared distance, per layer and K/V scaled by that layer's mean squared norm, summed."""
    squared = (stored - full).pow(2).sum(dim=(2, 4))                      # [L, 2, c]
    scale = full.pow(2).sum(dim=(2, 4)).mean(dim=2, keepdim=True)          # [L, 2, 1]
    return (squared / scale.clamp_min(1e-12)).sum(dim=(0, 1))              # [c]


@register
class Oracle(FusionMethod):
    name = "oracle"
    summary = ("a reference, not a fusion method: the top-r chunk tokens whose stored KV lies farthest from full "
               "prefill's (which it computes first, over every layer): the most fidelity a deviation-ranked selector "
               "can keep (results/ceiling.md)")
    passes = 2                # pass 1: reuse's query pass; pass 2: the chosen rows recomputed
    query_pass = True         # pass 1 is reuse's plain pass: a sweep runs it once per question
    reuse_at_ratio_zero = True
    in_all = False            # a reference: sweeps run it only when named

    def next_pass_rows(self, engine: FusionEngine, state: FusionState) -> torch.Tensor:
        prompt, model = state.prompt, engine.model
        full = model.new_cache(prompt.n_tokens)
        model.prefill(prompt.all_ids(), full)
        chunk_rows = all_chunk_rows(prompt)                                # [c]
        distance = distance_to_full(state.cache.kv[:, :, :, chunk_rows], full.kv[:, :, :, chunk_rows])
        return top_rows(distance, chunk_rows, recompute_budget(self.recompute_ratio, prompt.n_chunk_tokens))
