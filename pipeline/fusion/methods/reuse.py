"""`reuse` (full reuse, TurboRAG / PromptCache style): every chunk's stored KV, re-positioned to
contiguous positions; only Q is computed. Recompute ratio 0 by definition."""
from __future__ import annotations

from kvf.pipeline.fusion.methods.base import FusionMethod, register


@register
class FullReuse(FusionMethod):
    name = "reuse"
    summary = "only Q; chunks re-positioned contiguously (TurboRAG / PromptCache)"
    ratio_is_knob = False
    fixed_ratio = 0.0
    query_pass = True  # the whole request is the query-only pass

    def is_reuse(self) -> bool:
        return True
