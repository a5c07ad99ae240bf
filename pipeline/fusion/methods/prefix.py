"""`prefix` (prefix caching): reuse C1's stored KV, which is exact because it was computed right
after S at the same positions; prefill C2..Ck and Q. Output equals full prefill."""
from __future__ import annotations

import torch

from kvf.pipeline.fusion.methods.base import FusionMethod, register
from kvf.pipeline.model.prompt import FusedPrompt


@register
class PrefixCaching(FusionMethod):
    name = "prefix"
    summary = "all but C1, whose stored KV is exact after S"
    ratio_is_knob = False
    fixed_ratio = 1.0
    in_all = False  # its answers equal full prefill's by construction: sweeps run it only when named

    def loaded_chunks(self, prompt: FusedPrompt) -> list[int]:
        return [0] if prompt.chunk_segments else []

    def initial_chunk_rows(self, prompt: FusedPrompt) -> torch.Tensor:
        first_end = prompt.chunk_spans()[0][1] if prompt.chunk_segments else prompt.n_prefix
        return torch.arange(first_end, prompt.n_prefix + prompt.n_chunk_tokens)
