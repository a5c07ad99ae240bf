"""`cachefocus` (CacheFocus, seed cachefocus.txt §2): query-only prefill over cached chunks, with
adaptive re-positioning, layer-adaptive chunk pruning and positional re-allocation.

- Offline (§2.2): the `prefix` variant, every chunk prefilled right after S.
- Adaptive re-positioning (§2.3.1, eq. 6): chunks get contiguous positions after S when they fit
  the model's positional range; when they do not (k * chunk length > room), the chunks are split, in
  order, into N_reuse = ceil(k / floor(room / l_C)) groups of near-equal size, and every group
  restarts at |S| (chunks inside a group are sequential). `room` = max positions - |S| - |Q| -
  max_new_tokens, l_C = the longest chunk. Q follows the longest group. With short contexts this
  is the plain contiguous layout, i.e. `reuse`.
- Query-only prefill: no chunk token is recomputed (recomputed_tokens = 0); only Q runs.
- Layer-adaptive pruning (§2.4, Algorithm 2): at every layer the mean attention of Q's tokens to each
  chunk (summed over the chunk's rows; only Q's rows of attention are formed) is accumulated; after
  every `prune_every`-th layer (1-based l with l mod n = 0, the last layer included, which then only
  shapes the decoding cache) the chunks outside the top `keep_chunks` by accumulated score are
  dropped from every later attention (engine.drop_rows_from_context). Choice: each pruning keeps
  the top m of the chunks still in play, so the first one cuts to m and later ones only re-rank
  (which matters for `sort`); `--prune-every 0` turns pruning off.
- Re-allocation (§2.5), after every pruning: `align` closes the gaps (remaining chunks contiguous
  after S, in their prompt order); `sort` orders them by accumulated attention, the most attended
  last, i.e. nearest to Q. Q moves to right after them. Both go through the eq. 6 grouping.
- Layers already computed (choice; the paper re-positions every layer's cache before decoding,
  Algorithm 2 phase 2): engine.reposition re-rotates the stored keys of the moved chunks *and* Q's
  keys in every layer computed so far, and later layers are loaded at the new positions, so the
  final cache is consistent for decoding. Q's hidden states keep what they computed at the old
  positions (as in the paper, which re-positions between layers too).
- Decoding sees only the kept chunks: the pruned rows are removed from the returned cache
  (the paper's final cache is "concat(remaining caches, Q)").
With no pruning and contiguous positions it equals `reuse` exactly (and `full` for one chunk).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvf.errors import KvfError
from kvf.pipeline.fusion.engine import FusionEngine, FusionPlan, FusionResult, FusionState, LayerKVSource
from kvf.pipeline.fusion.methods.base import FusionMethod, chunk_attention, knob, register
from kvf.pipeline.model.forward import KVCache, Transformer
from kvf.pipeline.model.prompt import FusedPrompt

ALLOCATIONS = ("align", "sort")


# ---- positions (eq. 6 and §2.5) ------------------------------------------------------------------
def position_groups(order: list[int], chunk_lengths: list[int], room: int) -> list[list[int]]:
    """Split the chunks in `order` into the fewest consecutive groups that each fit `room` positions (eq. 6).

    N_reuse = ceil(k / floor(room / l_C)), l_C = the longest chunk; groups are near-equal in size.
    One group (no position reuse) whenever all chunks fit one after another.
    """
    lengths = [chunk_lengths[i] for i in order]
    if sum(lengths) <= room:
        return [list(order)] if order else []
    longest = max(lengths)
    if longest > room:
        raise KvfError(f"a chunk of {longest} tokens does not fit the model's positions left after S, Q and the new "
                       f"tokens ({room}); use smaller --chunk-tokens or a lower --max-new-tokens")
    n_groups = math.ceil(len(order) / (room // longest))
    size, extra = divmod(len(order), n_groups)
    groups, start = [], 0
    for g in range(n_groups):
        end = start + size + (1 if g < extra else 0)
        groups.append(list(order[start:end]))
        start = end
    return groups


def assign_positions(prompt: FusedPrompt, order: list[int], room: int,
                     previous: torch.Tensor | None = None) -> torch.Tensor:
    """[n] RoPE positions: S at 0..|S|-1, the chunks in `order` grouped by eq. 6 (each group restarts at
    |S|, sequential inside), Q after the longest group. Chunks not in `order` (pruned) keep `previous`."""
    n_prefix, spans = prompt.n_prefix, prompt.chunk_spans()
    lengths = [e - s for s, e in spans]
    positions = torch.arange(prompt.n_tokens) if previous is None else previous.clone()
    question_start = n_prefix
    for group in position_groups(order, lengths, room):
        at = n_prefix
        for i in group:
            positions[spans[i][0]: spans[i][1]] = at + torch.arange(lengths[i])
            at += lengths[i]
        question_start = max(question_start, at)
    positions[prompt.question_rows()] = question_start + torch.arange(len(prompt.question_ids))
    return positions


def allocation_order(kept: list[int], chunk_scores: torch.Tensor, allocation: str) -> list[int]:
    """Order of the kept chunks from S towards Q: `align` keeps prompt order; `sort` puts the most
    attended chunk last, nearest Q (ties keep prompt order)."""
    kept = sorted(kept)
    if allocation == "align":
        return kept
    return sorted(kept, key=lambda i: (float(chunk_scores[i]), i))  # ascending score: the most attended last


def position_room(max_positions: int, prompt: FusedPrompt, max_new_tokens: int) -> int:
    """Positions left for the chunks once S, Q and the generated tokens have theirs."""
    return max_positions - prompt.n_prefix - len(prompt.question_ids) - max_new_tokens


# ---- pruning ------------------------------------------------------------------------------------
def chunks_to_keep(kept: list[int], chunk_scores: torch.Tensor, keep: int) -> list[int]:
    """The `keep` chunks of `kept` with the highest accumulated scores (ties: the earlier chunk), sorted."""
    ranked = sorted(kept, key=lambda i: (-float(chunk_scores[i]), i))
    return sorted(ranked[:keep])


def compact_cache(model: Transformer, cache: KVCache, keep_rows: torch.Tensor) -> KVCache:
    """Keep only `keep_rows` [m] of `cache` (in order) at its front, in place, layer by layer: a
    second full-size cache would double the peak memory of a long prompt. The room behind stays
    free for decoding."""
    m = len(keep_rows)
    for layer in range(cache.kv.shape[0]):
        cache.kv[layer, :, :, :m] = cache.kv[layer, :, :, keep_rows]  # [2, KV, m, d]; rows only move forward
    cache.length = m
    return cache


@dataclass
class CacheFocusKnobs:
    prune_every: int = knob(4, "prune chunks after every N-th layer (0 = never)", min=0)
    keep_chunks: int | None = knob(None, "chunks kept after pruning (default ceil(k/2))", min=1)
    allocation: str = knob("align", "re-positioning after pruning: align (close gaps) or sort (most attended nearest Q)",
                           choices=ALLOCATIONS)


@register
class CacheFocus(FusionMethod):
    name = "cachefocus"
    summary = "no chunk tokens; Q-only prefill with chunk pruning and re-positioning"
    Knobs = CacheFocusKnobs
    ratio_is_knob = False  # query-only prefill: no chunk token is recomputed whatever the ratio says
    fixed_ratio = 0.0
    oracle_knobs = {"prune_every": 0}  # no pruning: contiguous positions, i.e. `reuse`
    repositions = True     # after pruning (engine.reposition): each layer is rotated where its rows are by then

    def kept_count(self, k: int) -> int:
        """How many chunks survive pruning: --keep-chunks, default ceil(k / 2)."""
        return min(k, math.ceil(k / 2) if self.knobs.keep_chunks is None else self.knobs.keep_chunks)

    def prunes_after(self, layer: int) -> bool:
        every = self.knobs.prune_every
        return every > 0 and (layer + 1) % every == 0

    def plan(self, engine: FusionEngine, prompt: FusedPrompt, source: LayerKVSource | None,
             max_new_tokens: int) -> FusionPlan:
        room = position_room(engine.model.max_positions, prompt, max_new_tokens)
        k = len(prompt.chunk_segments)
        scratch = {"room": room, "kept": list(range(k)), "chunk_scores": torch.zeros(k)}  # accumulated Q -> chunk attention
        return FusionPlan(torch.empty(0, dtype=torch.long), assign_positions(prompt, list(range(k)), room),
                          scratch=scratch)

    def records_query_attention(self, state: FusionState, layer: int) -> bool:
        return self.knobs.prune_every > 0 and len(state.prompt.chunk_segments) > 0

    def after_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        if not self.records_query_attention(state, layer):
            return
        scratch = state.scratch
        scratch["chunk_scores"] += chunk_attention(state.query_attention[-1], state.prompt)
        if self.prunes_after(layer):
            scratch["kept"] = self.prune(engine, state, scratch["kept"], scratch["chunk_scores"], scratch["room"])

    def finish(self, engine: FusionEngine, state: FusionState, result: FusionResult) -> None:
        prompt, kept = state.prompt, state.scratch["kept"]
        if len(kept) < len(prompt.chunk_segments):  # decoding sees S, the kept chunks and Q only
            result.cache = compact_cache(engine.model, result.cache, torch.nonzero(state.key_keep).flatten())
        result.recomputed_tokens = 0
        result.info.update(kept_chunks=kept, chunk_positions=[int(state.positions[s]) for s, _ in prompt.chunk_spans()])

    def prune(self, engine: FusionEngine, state: FusionState, kept: list[int], chunk_scores: torch.Tensor,
              room: int) -> list[int]:
        """Drop the lowest-scoring chunks from later attention, then re-allocate the survivors' positions."""
        prompt = state.prompt
        survivors = chunks_to_keep(kept, chunk_scores, self.kept_count(len(prompt.chunk_segments)))
        spans = prompt.chunk_spans()
        dropped = [i for i in kept if i not in survivors]
        if dropped:
            engine.drop_rows_from_context(state, torch.cat([torch.arange(*spans[i]) for i in dropped]))
        order = allocation_order(survivors, chunk_scores, self.knobs.allocation)
        engine.reposition(state, assign_positions(prompt, order, room, previous=state.positions))
        return survivors
