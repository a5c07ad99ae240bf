"""`kvfuse`: kvf's own method. Design, ablation and held-out numbers: results/kvfuse.md.

What the harness showed on MuSiQue dev questions (the first ones of the file; held-out numbers use
later questions, results/kvfuse/runs/):
- at 15%, ProphetKV's layer-averaged question attention keeps more fidelity than FusionRAG's
  last-layer attention on the same similarity-enhanced (`fusion`) stored variant (dev: 0.90 vs 0.83);
  kvfuse ranks tokens by the layer average (score_layers=all) on the `fusion` variant. Scoring with
  the early layers only, or forcing EPIC's first tokens of every chunk into the budget, changed
  little (0.90, 0.91).
- what no method repairs is the 85% of rows it keeps: they still miss the cross-chunk context. The
  recomputed rows of the same chunk show, layer by layer, how that context moves K and V (fresh -
  stored). After each layer kvfuse adds each chunk's mean move to the chunk's kept rows (keys
  compared before RoPE and re-rotated at each kept row's position, so the move does not depend on
  where rows sit). The layer's own attention has already run, so the first token is ProphetKV's on
  the fusion variant; decoding reads the shifted rows (dev fidelity 0.94 vs 0.90 without).
  Cost: two means and one add per chunk and layer, no extra forward work.
- shifting before the layer's attention (propagate=before), so the recomputed rows and the question
  see the shifted rows too, halved the first-token KL on dev prompts (results/kvfuse/probe.md) but
  lost answer fidelity on held-out questions (0.55): a closer cache is not a closer answer.

- what the shift should carry (step 5): shrinking the mean by its rows' spread (james-stein) or
  per-row moves by stored-key similarity (kernel) did not help; shifting K only (shift_parts=k) led
  both dev splits (MuSiQue 0.976, RULER 0.675 vs the default's 0.944 / 0.600) but not held out
  (MuSiQue 11-49 0.841 vs 0.855, RULER 2K 0.725 vs 0.670; results/kvfuse.md): not the default.

Two passes, as ProphetKV: (1) the question's rows over the stored cache, recording their attention
at every layer; (2) recompute the top-budget chunk rows by the layer-averaged attention, shifting
each chunk's kept rows after every layer from propagate_from on. Knobs for the ablation:
score_layers, sink_tokens, propagate (off / after / before), propagate_from and deviation_share
(part of the budget by CacheBlend's layer-1 deviation, measured between the passes; not kept: no
gain on either dev split), shift_estimate and shift_parts. Budget: exactly round(ratio x chunk tokens), sinks included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvf.pipeline.fusion.engine import FusionEngine, FusionState, recompute_budget
from kvf.pipeline.fusion.methods.base import FusionMethod, all_chunk_rows, knob, register, top_rows
from kvf.pipeline.fusion.methods.epic import chunk_initial_rows
from kvf.pipeline.model.prompt import FusedPrompt
from kvf.pipeline.model.rope import keys_at, keys_before_rope


@dataclass
class KvFuseKnobs:
    score_layers: str = knob("all", "layers whose question attention ranks tokens: all (averaged) or last",
                             choices=("all", "last", "early", "late"))
    sink_tokens: int = knob(0, "first tokens of every chunk always recomputed, inside the budget", min=0)
    propagate: str = knob("after", "shift each chunk's kept rows by the mean K/V change of its recomputed rows: "
                               "off, after (seen by decoding) or before (seen by this layer too)",
                          choices=("off", "after", "before"))
    propagate_from: float = knob(0.0, "first layer shifted, as a fraction of the layers (early layers barely move)",
                                 min=0.0, max=1.0)
    deviation_share: float = knob(0.0, "fraction of the budget given first to the rows whose layer-1 K moves most "
                                       "when layer 0 sees the other chunks (CacheBlend's deviation); the rest by attention",
                                  min=0.0, max=1.0)
    shift_estimate: str = knob("mean", "the move a kept row gets from its chunk's recomputed rows: their mean, "
                                       "james-stein (the mean shrunk by their spread; one row: none) or kernel "
                                       "(weighted by stored-key similarity)", choices=("mean", "james-stein", "kernel"))
    shift_parts: str = knob("kv", "what the shift moves: kv (both), k only (where rows are attended) or v only "
                                  "(what they carry)", choices=("kv", "k", "v"))


@register
class KvFuse(FusionMethod):
    name = "kvfuse"
    Knobs = KvFuseKnobs
    offline_variant = "fusion"
    passes = 2
    query_pass = True
    reuse_at_ratio_zero = True  # no recomputed row: nothing to propagate

    def records_query_attention(self, state: FusionState, layer: int) -> bool:
        return state.pass_index == 0 and layer in self.scored_layers(state.cache.kv.shape[0])

    def scored_layers(self, n_layers: int) -> list[int]:
        return {"all": list(range(n_layers)), "last": [n_layers - 1], "early": list(range(n_layers // 2)),
                "late": list(range(n_layers // 2, n_layers))}[self.knobs.score_layers]

    def next_pass_rows(self, engine: FusionEngine, state: FusionState) -> torch.Tensor:
        prompt = state.prompt
        budget = recompute_budget(self.recompute_ratio, prompt.n_chunk_tokens)
        scores = torch.stack(state.query_attention).mean(dim=0)          # [L', n] -> [n]
        sinks = sink_rows(prompt, self.knobs.sink_tokens, budget)          # [s] first tokens of every chunk
        chunk_rows = all_chunk_rows(prompt)
        scores = scores[chunk_rows].clone()
        scores[sinks - prompt.n_prefix] = float("inf")                     # sinks first, then by attention
        if self.knobs.deviation_share > 0:                                  # then the most moved rows
            share = recompute_budget(self.knobs.deviation_share, budget)
            moved = top_rows(cross_chunk_deviation(engine, state), chunk_rows, share)
            scores[moved - prompt.n_prefix] = float("inf")
        selected = top_rows(scores, chunk_rows, budget)
        state.scratch["selected"] = selected
        return selected

    # ---- propagation: the rows kept from the store move with their chunk's recomputed rows ----
    def propagates(self, state: FusionState, layer: int) -> bool:
        n_layers = state.cache.kv.shape[0]
        return (state.pass_index == 1 and self.knobs.propagate != "off"
                and layer >= round(self.knobs.propagate_from * n_layers))

    def before_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        if not self.propagates(state, layer):
            return
        rows = state.active_chunk_rows()
        if self.knobs.propagate == "after":
            state.scratch["stored"] = state.cache.kv[layer][:, :, rows].clone()   # [2, KV, a, d] before overwrite
            return
        is_chunk = state.chunk_row_mask()[state.rows]
        fresh_k, fresh_v = engine.project_kv(state, layer)                      # [KV, a', d] all active rows
        fresh = torch.stack([fresh_k[:, is_chunk], fresh_v[:, is_chunk]])       # [2, KV, a, d]
        shift_kept_rows(engine, state, layer, rows, state.cache.kv[layer][:, :, rows], fresh, self.knobs)

    def after_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        if not self.propagates(state, layer) or self.knobs.propagate != "after":
            return
        rows = state.active_chunk_rows()
        shift_kept_rows(engine, state, layer, rows, state.scratch.pop("stored"), state.cache.kv[layer][:, :, rows],
                        self.knobs)


def shift_kept_rows(engine: FusionEngine, state: FusionState, layer: int, rows: torch.Tensor,
                    stored: torch.Tensor, fresh: torch.Tensor, knobs: KvFuseKnobs) -> None:
    """Add to every kept (not recomputed) row of a chunk the change fresh - stored [2, KV, a, d] of that
    chunk's recomputed `rows` at this layer, as knobs.shift_estimate carries it over (keys compared
    before RoPE), to the parts in knobs.shift_parts."""
    if len(rows) == 0:
        return
    rope, positions = engine.model.rope, state.positions
    delta_k = keys_before_rope(fresh[0] - stored[0], rope, positions[rows])         # [KV, a, d]
    delta_v = fresh[1] - stored[1]
    active = torch.zeros(state.n, dtype=torch.bool)
    active[rows] = True
    for start, end in state.prompt.chunk_spans():
        mine = (rows >= start) & (rows < end)
        kept = torch.arange(start, end)[~active[start:end]]
        if not mine.any() or len(kept) == 0:
            continue
        if knobs.shift_estimate == "kernel":                                         # [KV, m, r] by stored keys
            weights = key_similarity(keys_before_rope(state.cache.kv[layer, 0][:, kept], rope, positions[kept]),
                                     keys_before_rope(stored[0][:, mine], rope, positions[rows[mine]]))
            move_k, move_v = weights @ delta_k[:, mine], weights @ delta_v[:, mine]  # [KV, m, d]
        else:                                                                        # [KV, 1, d]
            move_k = chunk_mean_move(delta_k[:, mine], knobs.shift_estimate)
            move_v = chunk_mean_move(delta_v[:, mine], knobs.shift_estimate)
        if "k" in knobs.shift_parts:
            state.cache.kv[layer, 0][:, kept] += keys_at(move_k.expand(-1, len(kept), -1), rope, positions[kept])
        if "v" in knobs.shift_parts:
            state.cache.kv[layer, 1][:, kept] += move_v


def chunk_mean_move(delta: torch.Tensor, estimate: str) -> torch.Tensor:
    """[KV, r, d] moves of a chunk's r recomputed rows -> [KV, 1, d] the move every kept row gets.
    james-stein: the mean scaled by max(0, 1 - noise / |mean|^2) per head, noise being the trace of the
    mean's covariance (spread / r). Rows that move together give the whole mean; rows that scatter
    (or a single row: no spread to judge by) leave the kept rows where they were."""
    mean = delta.mean(dim=1, keepdim=True)                                           # [KV, 1, d]
    if estimate == "mean":
        return mean
    r = delta.shape[1]
    if r < 2:
        return torch.zeros_like(mean)
    noise = (delta - mean).pow(2).sum(dim=(1, 2)) / ((r - 1) * r)                     # [KV]
    factor = (1 - noise / mean.pow(2).sum(dim=(1, 2)).clamp_min(1e-12)).clamp_min(0)  # [KV]
    return mean * factor[:, None, None]


def key_similarity(kept_keys: torch.Tensor, recomputed_keys: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """[KV, m, d], [KV, r, d] stored keys before RoPE -> [KV, m, r]: each kept row's softmax weights over
    its chunk's recomputed rows by cosine similarity, so a kept row takes the move of the rows whose stored
    keys point its way. Cosine, not q.k: stored keys' norms make the scaled dot product near one-hot (one
    row's move, noisier than the mean); 0.1 was the best of 0.02-0.3 on the chunk-rows error to full
    on the synthetic prompt of tests/test_methods.py's long_case as it was at a85a809 (three ~1,070-token
    chunks; it is shorter now)."""
    kept_keys = torch.nn.functional.normalize(kept_keys, dim=-1)
    recomputed_keys = torch.nn.functional.normalize(recomputed_keys, dim=-1)
    return torch.softmax(kept_keys @ recomputed_keys.transpose(1, 2) / temperature, dim=-1)


def cross_chunk_deviation(engine: FusionEngine, state: FusionState) -> torch.Tensor:
    """[c] per chunk row: how far its layer-1 K moves when layer 0 runs over the whole cache, i.e.
    sees the other chunks (CacheBlend's deviation). One engine step of layer 0 with every chunk row
    active: layer 0's K/V depend on the token and its position only, so the rows it writes equal the
    stored ones. The pass that follows restarts from layer 0 with the rows chosen."""
    engine.restart(state, all_chunk_rows(state.prompt), state.pass_index)
    engine.step(state, 0)
    return engine.kv_deviation(state, 1)[state.chunk_row_mask()[state.rows]]


def sink_rows(prompt: FusedPrompt, per_chunk: int, budget: int) -> torch.Tensor:
    """The first `per_chunk` rows of every chunk, cut to the budget (earlier chunks first)."""
    counts = [min(per_chunk, len(c)) for c in prompt.chunk_segments]
    rows = chunk_initial_rows(prompt, counts)
    return rows[:budget]
