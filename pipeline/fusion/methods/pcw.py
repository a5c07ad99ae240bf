"""`pcw` (parallel context windows, Ratner et al. 2023; the CacheFocus baseline): full reuse, but every
chunk keeps the positions it had when it was stored right after S.

All chunks share one position range [|S|, |S| + |Ci|); Q continues after the longest chunk, at
|S| + max |Ci|. Only Q is computed (recompute ratio 0 by definition). Rows stay in prompt order, so
Q (and every generated token) still attends to every chunk; only the RoPE positions overlap.
"""
from __future__ import annotations

import torch

from kvf.pipeline.fusion.methods.base import FusionMethod, register
from kvf.pipeline.model.prompt import FusedPrompt


def parallel_positions(n_prefix: int, chunk_lengths: list[int], n_question: int) -> torch.Tensor:
    """[n] positions: S at 0..|S|-1, every chunk restarting at |S|, Q after the longest chunk."""
    parts = [torch.arange(n_prefix)]
    parts += [n_prefix + torch.arange(t) for t in chunk_lengths]
    question_start = n_prefix + max(chunk_lengths, default=0)
    parts.append(question_start + torch.arange(n_question))
    return torch.cat(parts)


@register
class ParallelContextWindows(FusionMethod):
    name = "pcw"
    summary = "only Q; every chunk keeps the positions it had after S"
    ratio_is_knob = False  # nothing is recomputed whatever the ratio says
    fixed_ratio = 0.0

    def positions(self, prompt: FusedPrompt) -> torch.Tensor:
        return parallel_positions(prompt.n_prefix, [len(c) for c in prompt.chunk_segments], len(prompt.question_ids))
