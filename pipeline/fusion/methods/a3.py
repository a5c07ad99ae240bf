"""`a3`: A^3, Attention-Aware Accurate KV Cache Fusion (Zhou et al., 2025, arXiv 2511.17560).

Why this one: of the 2025-26 training-free recompute methods (KVShare, A^3, SamKV, QCFuse) it has
the clearest published algorithm: its authors' code (the `debug` reuse mode of their evaluation
scripts, github.com/yczhounlp/ragkv, models/reuse_utils.py) pins every step, and it asks a question
kvf's harness can answer: does choosing tokens by the question's attention at the *first* layer,
smoothed over neighbours, beat the later-layer selectors (FusionRAG: last layer, ProphetKV: all
layers) at the same budget?

The algorithm (paper §3; reference code `get_topindices(..., 'debug')` and
`compute_attention_sum_wo_head`):
- chunks are precomputed after the system prompt (our `prefix` variant) and re-positioned with RoPE;
- at layer 0, before any chunk token is recomputed, the question's tokens attend to the chunks and
  to themselves (causally; S is left out of this softmax). The score is computed with every head
  concatenated into one (q and k flattened to H*d, scaled by 1/sqrt(H*d)), summed over the question's
  tokens, then smoothed with a moving average over `pool` neighbouring tokens (kernel 5);
- the top round(r * chunk tokens) chunk tokens by that score, ranked globally, plus the question,
  are recomputed through every layer from layer 0 on.
What the paper leaves open, and our choices:
- The reference code runs layer 0 for every token before filtering (a CacheBlend-style check
  layer); the selection only reads layer-0 keys, which for stored chunks equal their fresh keys up
  to the store's float16 rounding, so we select before layer 0 and recompute only the selected rows
  from layer 0 on (cheaper, same selection up to that rounding).
- Its budget is int(r * all tokens but the question); kvf's ratio counts chunk tokens only, so
  every method recomputes the same number of tokens.
- The eviction extension (SnapKV-style cache dropping for decoding) is orthogonal to fusion: not included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvf.pipeline.fusion.engine import FusionEngine, FusionState, recompute_budget
from kvf.pipeline.fusion.methods.base import FusionMethod, all_chunk_rows, knob, register, top_rows
from kvf.pipeline.model.prompt import FusedPrompt
from kvf.pipeline.model.rope import apply_rope


def head_concatenated_scores(q: torch.Tensor, keys: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """q [H, |Q|, d] and keys [H, m, d] (both rotated) as one head of H*d dims -> [m] summed softmax weight.
    causal [|Q|, m] bool says which keys each question token sees."""
    h, nq, d = q.shape
    flat_q = q.transpose(0, 1).reshape(nq, h * d)                          # [|Q|, H*d]
    flat_k = keys.transpose(0, 1).reshape(keys.shape[1], h * d)             # [m, H*d]
    scores = (flat_q @ flat_k.T) / math.sqrt(h * d)                         # [|Q|, m]
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1).sum(dim=0).float()  # [m]


def smooth(scores: torch.Tensor, pool: int) -> torch.Tensor:
    """Moving average over `pool` neighbours (odd kernel, zero padding, as avg_pool1d does)."""
    if pool <= 1:
        return scores
    return F.avg_pool1d(scores[None, None], kernel_size=pool, stride=1, padding=pool // 2)[0, 0, : len(scores)]


@dataclass
class A3Knobs:
    pool: int = knob(5, "moving-average window over neighbouring tokens' scores (1 = none)", min=1)


@register
class A3(FusionMethod):
    name = "a3"
    summary = "top-r tokens by Q's layer-0 attention (heads concatenated, smoothed over neighbours) (A³, 2025)"
    Knobs = A3Knobs
    reuse_at_ratio_zero = True

    def initial_chunk_rows(self, prompt: FusedPrompt) -> torch.Tensor:
        return all_chunk_rows(prompt)  # hidden states exist for every row; layer 0 keeps the selected ones

    def before_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        if layer != 0:
            return
        prompt, model = state.prompt, engine.model
        engine.load_layer(state, 0)
        q_rows = prompt.question_rows()
        question = state.hidden[-len(q_rows):]                                    # [|Q|, D] embeddings
        q, k, _ = model.project_qkv(0, question)
        cos, sin = state.cos[q_rows], state.sin[q_rows]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)                   # [H, |Q|, d], [KV, |Q|, d]
        chunk_rows = all_chunk_rows(prompt)
        group = model.n_heads // model.n_kv_heads
        keys = torch.cat([state.cache.kv[0, 0][:, chunk_rows], k], dim=1).repeat_interleave(group, dim=0)  # [H, m, d]
        m, nq = len(chunk_rows) + len(q_rows), len(q_rows)
        causal = torch.ones(nq, m, dtype=torch.bool, device=keys.device)
        causal[:, len(chunk_rows):] = torch.tril(torch.ones(nq, nq, dtype=torch.bool, device=keys.device))
        scores = smooth(head_concatenated_scores(q, keys, causal)[: len(chunk_rows)].cpu(), self.knobs.pool)  # [chunk tokens]
        budget = recompute_budget(self.recompute_ratio, prompt.n_chunk_tokens)
        engine.keep_rows(state, top_rows(scores, chunk_rows, budget))
