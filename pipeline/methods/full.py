"""`full`: ordinary prefill of the whole prompt, S included. The quality ceiling and TTFT reference."""
from __future__ import annotations

import time

import torch

from kvf.pipeline.engine import FusionEngine, FusionResult
from kvf.pipeline.methods.base import FusionMethod, register
from kvf.pipeline.prompt import FusedPrompt


@register
class FullPrefill(FusionMethod):
    name = "full"
    uses_store = False

    def __init__(self, recompute_ratio: float = 1.0):
        super().__init__(1.0)  # full prefill recomputes everything whatever the ratio says

    @torch.inference_mode()
    def prefill(self, engine: FusionEngine, prompt: FusedPrompt, source=None, max_new_tokens: int = 0) -> FusionResult:
        started = time.perf_counter()
        engine.check_fits(prompt, max_new_tokens)
        cache = engine.model.new_cache(prompt.n_tokens + max_new_tokens)
        logits, _ = engine.model.prefill(prompt.all_ids(), cache)
        timings = {"load": 0.0, "select": 0.0, "recompute": time.perf_counter() - started}
        n_chunk = prompt.n_chunk_tokens
        return FusionResult(logits, cache, prompt.n_tokens, n_chunk, n_chunk * engine.model.n_layers, timings)
