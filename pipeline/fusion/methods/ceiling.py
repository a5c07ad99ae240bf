"""`ceiling`: the most fidelity to full prefill that any method reading the store can keep. A
reference, not a fusion method: it pays a full prefill.

A selective-recompute method can at best end with a cache whose chunk rows are exactly what full
prefill computes, as the store holds them: in the store's dtype, keys before RoPE. `ceiling` builds
that cache on purpose, in two passes:
- pass 1 recomputes every chunk row from layer 0 over S's exact KV, i.e. full prefill of S | C1..Ck
  (and Q); after each layer the chunk rows are rounded to `round_to` (keys un-rotated, rounded,
  rotated back: the store keeps them before RoPE);
- pass 2 recomputes Q alone from layer 0 over that cache, so Q's rows and every decoded token read
  the rounded chunk rows.
No cross-chunk attention is approximated, so whatever fidelity it loses is what the store's rounding
and float summation order cost on that data (a greedy near-tie flips, and the answer parts from
full's). `round_to=float32` rounds nothing: Q is still computed apart from the context, so only
the summation order differs from full prefill. float16 is what `kvf build-cache` stores by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvf.pipeline.fusion.engine import FusionEngine, FusionResult, FusionState
from kvf.pipeline.fusion.methods.base import FusionMethod, all_chunk_rows, knob, register
from kvf.pipeline.model.prompt import FusedPrompt
from kvf.pipeline.model.rope import keys_at, keys_before_rope

ROUND_DTYPES = ("float32", "float16", "bfloat16")   # torch dtype names, as the store names its dtype


@dataclass
class CeilingKnobs:
    round_to: str = knob("float16", "dtype the chunk rows pass through (what the store holds)",
                         choices=ROUND_DTYPES)


def round_rows(engine: FusionEngine, state: FusionState, layer: int, rows: slice, dtype: torch.dtype) -> None:
    """Round the cache rows `rows` of `layer` through `dtype`, keys before RoPE, in place."""
    kv = state.cache.kv[layer]                                                 # [2, KV, cap, d]
    positions = state.positions[rows]                                          # [t]
    keys = keys_before_rope(kv[0][:, rows], engine.model.rope, positions)      # [KV, t, d]
    kv[0][:, rows] = keys_at(keys.to(dtype).to(kv.dtype), engine.model.rope, positions)
    kv[1][:, rows] = kv[1][:, rows].to(dtype).to(kv.dtype)


@register
class Ceiling(FusionMethod):
    name = "ceiling"
    summary = ("a reference, not a fusion method: every chunk token (full prefill of S and C1..Ck), then Q alone "
               "over the chunk rows rounded as the store holds them: the most fidelity any method reading the store "
               "can keep (results/ceiling.md)")
    Knobs = CeilingKnobs
    ratio_is_knob = False     # every chunk row is recomputed (pass 1)
    fixed_ratio = 1.0
    passes = 2                # pass 1: full prefill of the context, rounded; pass 2: Q over it
    in_all = False            # a reference: sweeps run it only when named
    oracle_knobs = {"round_to": "float32"}

    def loaded_chunks(self, prompt: FusedPrompt) -> list[int]:
        return []             # nothing is read from the store: every chunk row is computed here

    def initial_chunk_rows(self, prompt: FusedPrompt) -> torch.Tensor:
        return all_chunk_rows(prompt)

    def after_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        dtype = getattr(torch, self.knobs.round_to)
        if state.pass_index == 0 and dtype != torch.float32:  # float32 kept as computed (no round trip)
            chunks = slice(state.prompt.n_prefix, state.prompt.n_prefix + state.prompt.n_chunk_tokens)
            round_rows(engine, state, layer, chunks, dtype)

    def next_pass_rows(self, engine: FusionEngine, state: FusionState) -> torch.Tensor:
        return all_chunk_rows(state.prompt)[:0]   # Q alone

    def finish(self, engine: FusionEngine, state: FusionState, result: FusionResult) -> None:
        result.recomputed_tokens = state.prompt.n_chunk_tokens  # all of them, in pass 1
