"""`cacheblend` (CacheBlend, seed 001 §4.3; defaults from its code).

Layer 0 is recomputed for every chunk token (its K/V are cheap to compare only after one real
layer). At the check layer (default 1) we compute every chunk token's fresh K (or V), compare it
with the stored, re-positioned one, and keep recomputing only the top-r tokens by squared L2
deviation over heads and dims. Choices: deviation on K by default (LMCache; the paper's code uses
V: `--deviation v`); gradual filtering (§4.3) is off by default as in the authors' code — when on,
the first check layer keeps `gradual_first` (default 2r) and the next layer shrinks it to r.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvf.pipeline.fusion.engine import FusionEngine, FusionState, recompute_budget
from kvf.pipeline.fusion.methods.base import FusionMethod, KnobError, all_chunk_rows, knob, register, top_rows
from kvf.pipeline.model.prompt import FusedPrompt


@dataclass
class CacheBlendKnobs:
    check_layer: int = knob(1, "layer where the K/V deviation is measured (layer 0 keys equal the stored ones)", min=1)
    deviation: str = knob("k", "compare fresh and stored K or V", choices=("k", "v"))
    gradual: bool = knob(False, "gradual filtering (§4.3): keep --gradual-first at the check layer, r from the next layer on")
    gradual_first: float | None = knob(None, "with --gradual, the fraction kept at the check layer (default 2r)",
                                       min=0.0, max=1.0)


@register
class CacheBlend(FusionMethod):
    name = "cacheblend"
    summary = ("layer 0 fully, then the top-r tokens by K (or V) deviation at the check layer (`--gradual`: 2r "
               "there, r from the next layer)")
    Knobs = CacheBlendKnobs
    reuse_at_ratio_zero = True

    def is_reuse(self) -> bool:
        return super().is_reuse() and not (self.knobs.gradual and self.knobs.gradual_first)

    def check_model(self, n_layers: int) -> None:
        if self.knobs.check_layer >= n_layers:
            raise KnobError("check_layer", str(self.knobs.check_layer),
                            f"the model has {n_layers} layers; use 1..{n_layers - 1}")

    def initial_chunk_rows(self, prompt: FusedPrompt) -> torch.Tensor:
        if self.is_reuse():  # nothing will be kept at the check layer: recomputing layer 0 would be waste
            return super().initial_chunk_rows(prompt)
        return all_chunk_rows(prompt)

    def before_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        k = self.knobs
        first = min(1.0, 2 * self.recompute_ratio) if k.gradual_first is None else k.gradual_first
        if layer == k.check_layer:
            ratio = first if k.gradual else self.recompute_ratio
        elif k.gradual and layer == k.check_layer + 1:
            ratio = self.recompute_ratio
        else:
            return
        self.keep_most_deviating(engine, state, layer, recompute_budget(ratio, state.prompt.n_chunk_tokens))

    def keep_most_deviating(self, engine: FusionEngine, state: FusionState, layer: int, budget: int) -> None:
        deviation = engine.kv_deviation(state, layer, on=self.knobs.deviation)   # [a]
        is_chunk = state.chunk_row_mask()[state.rows]
        engine.keep_rows(state, top_rows(deviation[is_chunk], state.rows[is_chunk], budget))
