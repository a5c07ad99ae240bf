"""`cacheblend` (CacheBlend, seed 001 §4.3; defaults from its code).

Layer 0 is recomputed for every chunk token (its K/V are cheap to compare only after one real
layer). At the check layer (default 1) we compute every chunk token's fresh K (or V), compare it
with the stored, re-positioned one, and keep recomputing only the top-r tokens by squared L2
deviation over heads and dims. Choices: deviation on K by default (LMCache; the paper's code uses
V: `--deviation v`); gradual filtering (§4.3) is off by default as in the authors' code — when on,
the first check layer keeps `gradual_first` (default 2r) and the next layer shrinks it to r.
"""
from __future__ import annotations

import torch

from kvf import KvfError
from kvf.pipeline.engine import FusionEngine, FusionState, recompute_budget
from kvf.pipeline.methods.base import FusionMethod, all_chunk_rows, register, top_rows
from kvf.pipeline.prompt import FusedPrompt


@register
class CacheBlend(FusionMethod):
    name = "cacheblend"

    def __init__(self, recompute_ratio: float = 0.15, check_layer: int = 1, deviation: str = "k",
                 gradual: bool = False, gradual_first: float | None = None):
        super().__init__(recompute_ratio)
        if check_layer < 1:
            raise KvfError(f"--check-layer {check_layer}: must be >= 1 (layer 0 keys equal the stored ones)")
        if deviation not in ("k", "v"):
            raise KvfError(f"--deviation {deviation}: must be 'k' or 'v'")
        self.check_layer, self.deviation, self.gradual = check_layer, deviation, gradual
        self.gradual_first = min(1.0, 2 * recompute_ratio) if gradual_first is None else gradual_first

    def settings(self) -> dict:
        return {"ratio": self.recompute_ratio, "check_layer": self.check_layer, "deviation": self.deviation,
                "gradual": self.gradual}

    def initial_chunk_rows(self, prompt: FusedPrompt) -> torch.Tensor:
        return all_chunk_rows(prompt)

    def before_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        n_chunk = state.prompt.n_chunk_tokens
        if layer == self.check_layer:
            ratio = self.gradual_first if self.gradual else self.recompute_ratio
        elif self.gradual and layer == self.check_layer + 1:
            ratio = self.recompute_ratio
        else:
            return
        self.keep_most_deviating(engine, state, layer, recompute_budget(ratio, n_chunk))

    def keep_most_deviating(self, engine: FusionEngine, state: FusionState, layer: int, budget: int) -> None:
        engine.load_layer(state, layer)
        fresh_k, fresh_v = engine.project_kv(state, layer)           # [KV, a, d]
        fresh = fresh_k if self.deviation == "k" else fresh_v
        stored = state.cache.kv[layer, 0 if self.deviation == "k" else 1][:, state.rows]  # [KV, a, d]
        deviation = ((fresh - stored) ** 2).sum(dim=(0, 2))            # [a]
        is_chunk = state.chunk_row_mask()[state.rows]
        engine.keep_rows(state, top_rows(deviation[is_chunk], state.rows[is_chunk], budget))
