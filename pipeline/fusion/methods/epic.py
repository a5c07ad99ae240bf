"""`epic` (EPIC / LegoLink, Hu et al. 2024): recompute the first tokens of every chunk.

A chunk's first tokens are where full reuse goes most wrong: prefilled right after S they became
attention sinks of their own, and in the fused prompt they are the tokens that should instead read
the chunks before them. EPIC's selection is static: the budget round(r * chunk tokens) is spread
evenly over the chunks (sizes differ by at most one token; the remainder goes to the first chunks;
a chunk never gets more than its length, and what it cannot take goes to the others), and those
rows are recomputed from layer 0 through every layer.
"""
from __future__ import annotations

import torch

from kvf.pipeline.fusion.engine import recompute_budget
from kvf.pipeline.fusion.methods.base import FusionMethod, register
from kvf.pipeline.model.prompt import FusedPrompt


def spread_budget(budget: int, chunk_lengths: list[int]) -> list[int]:
    """Tokens per chunk summing to min(budget, total): even shares, remainder to the first chunks,
    capped at each chunk's length with the excess handed on to the chunks that still have room."""
    counts = [0] * len(chunk_lengths)
    left = min(budget, sum(chunk_lengths))
    while left > 0:
        open_chunks = [i for i, t in enumerate(chunk_lengths) if counts[i] < t]
        share, extra = divmod(left, len(open_chunks))
        for rank, i in enumerate(open_chunks):
            take = min(chunk_lengths[i] - counts[i], share + (1 if rank < extra else 0))
            counts[i] += take
            left -= take
    return counts


def chunk_initial_rows(prompt: FusedPrompt, counts: list[int]) -> torch.Tensor:
    """[sum(counts)] cache rows: the first counts[i] rows of every chunk i."""
    spans = prompt.chunk_spans()
    rows = [torch.arange(start, start + c) for (start, _), c in zip(spans, counts)]
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)


@register
class Epic(FusionMethod):
    name = "epic"
    summary = "the first tokens of every chunk, budget spread evenly"
    reuse_at_ratio_zero = True

    def initial_chunk_rows(self, prompt: FusedPrompt) -> torch.Tensor:
        lengths = [len(c) for c in prompt.chunk_segments]
        counts = spread_budget(recompute_budget(self.recompute_ratio, sum(lengths)), lengths)
        return chunk_initial_rows(prompt, counts)
