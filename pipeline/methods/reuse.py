"""`reuse` (full reuse, TurboRAG / PromptCache style): every chunk's stored KV, re-positioned to
contiguous positions; only Q is computed. Recompute ratio 0 by definition."""
from __future__ import annotations

from kvf.pipeline.methods.base import FusionMethod, register


@register
class FullReuse(FusionMethod):
    name = "reuse"

    def __init__(self, recompute_ratio: float = 0.0):
        super().__init__(0.0)
