"""`prophetkv` (ProphetKV, seed prophetkv.txt §4): query-guided selection fused over all layers.

Stage I is a query-only pass through every layer over the reused KV (like `reuse`), recording at
each layer l the mean attention of Q's tokens to every cache row, alpha_l(t) (softmax over the whole
fused KV per head, then averaged over heads and Q tokens, so each layer's vector is normalised on
its own). Eq. 7 fuses the layers by a plain average, alpha(t) = 1/L * sum_l alpha_l(t); the top
round(r * chunk tokens) chunk tokens, ranked globally, are recomputed in stage II through every
layer together with Q (Q's rows come after every chunk row, so this is "then recompute Q").
Only Q's rows of attention are formed: O(|Q| * n) per layer. Reads the `prefix` variant by default.
The two-pass mechanics are FusionRAG's (fusionrag.py); only the layers scored and the score differ.
"""
from __future__ import annotations

import torch

from kvf.pipeline.fusion.methods.base import register
from kvf.pipeline.fusion.methods.fusionrag import FusionRAG


def layer_averaged_scores(query_attention: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer Q attention, a list of L tensors [n] -> their mean over layers [n] (eq. 7)."""
    return torch.stack(query_attention).mean(dim=0)  # [L, n] -> [n]


@register
class ProphetKV(FusionRAG):
    name = "prophetkv"
    summary = "top-r tokens by layer-averaged Q attention, then recompute"
    offline_variant = "prefix"
    paper_ratio = 0.2

    def scored_layers(self, n_layers: int) -> list[int]:
        return list(range(n_layers))

    def token_scores(self, query_attention: list[torch.Tensor]) -> torch.Tensor:
        return layer_averaged_scores(query_attention)
