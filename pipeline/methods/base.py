"""The common interface of fusion methods, and the registry that maps names to them.

A method is one file under pipeline/methods/ that subclasses FusionMethod and decorates it with
@register. It decides (a) where chunks sit (positions), (b) which chunk rows are recomputed from
layer 0, and (c) how that set shrinks between layers. The engine does the rest. Methods whose
control flow differs (two passes, pruning) override `prefill`.
"""
from __future__ import annotations

import time

import torch

from kvf import KvfError
from kvf.pipeline.engine import FusionEngine, FusionResult, FusionState, LayerKVSource, recompute_budget
from kvf.pipeline.prompt import FusedPrompt

METHODS: dict[str, type["FusionMethod"]] = {}


def register(cls):
    METHODS[cls.name] = cls
    return cls


def get_method(name: str, **knobs) -> "FusionMethod":
    from kvf.pipeline import methods  # noqa: F401  (importing the package registers every method)
    if name not in METHODS:
        raise KvfError(f"--method {name}: unknown method; known methods: {', '.join(sorted(METHODS))}")
    return METHODS[name](**knobs)


def build_method(name: str, recompute_ratio: float, knobs: dict | None = None) -> "FusionMethod":
    """get_method with only the knobs this method takes (CLI flags of other methods are ignored)."""
    import inspect
    get_method(name)  # validates the name
    accepted = inspect.signature(METHODS[name].__init__).parameters
    return get_method(name, recompute_ratio=recompute_ratio,
                      **{k: v for k, v in (knobs or {}).items() if k in accepted and v is not None})


class FusionMethod:
    name = ""
    offline_variant = "prefix"   # which stored variant it reads by default
    uses_store = True            # False for `full`: it never reads chunk KVs

    def __init__(self, recompute_ratio: float = 0.0):
        recompute_budget(recompute_ratio, 0)  # validates the range
        self.recompute_ratio = recompute_ratio

    def settings(self) -> dict:
        """Knobs recorded with every run."""
        return {"ratio": self.recompute_ratio}

    # ---- the three decisions ------------------------------------------------------------
    def positions(self, prompt: FusedPrompt) -> torch.Tensor:
        """[n] RoPE positions; contiguous from 0 unless a method says otherwise."""
        return torch.arange(prompt.n_tokens)

    def initial_chunk_rows(self, prompt: FusedPrompt) -> torch.Tensor:
        """Chunk rows recomputed from layer 0 (Q's rows always are). Default: none (full reuse)."""
        return torch.empty(0, dtype=torch.long)

    def before_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        """Hook to shrink the recomputed set (engine.keep_rows) before `layer` runs."""

    def loaded_chunks(self, prompt: FusedPrompt) -> list[int] | None:
        """Chunks whose stored KV is read; None = all."""
        return None

    # ---- the default control flow ---------------------------------------------------------
    def prefill(self, engine: FusionEngine, prompt: FusedPrompt, source: LayerKVSource | None,
                max_new_tokens: int = 0) -> FusionResult:
        started = time.perf_counter()
        load_before = source.load_seconds if source is not None else 0.0
        state = engine.start(prompt, source, recompute_chunk_rows=self.initial_chunk_rows(prompt),
                             loaded_chunks=self.loaded_chunks(prompt), positions=self.positions(prompt),
                             max_new_tokens=max_new_tokens)
        for layer in range(engine.model.n_layers):
            t0 = time.perf_counter()
            self.before_layer(engine, state, layer)
            state.select_seconds += time.perf_counter() - t0
            engine.step(state, layer)
        load = (source.load_seconds - load_before) if source is not None else 0.0
        return engine.finish(state, load, started)


def all_chunk_rows(prompt: FusedPrompt) -> torch.Tensor:
    return torch.arange(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens)


def top_rows(scores: torch.Tensor, rows: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` rows with the highest scores (scores[i] belongs to rows[i]), sorted by row."""
    if budget <= 0:
        return rows[:0]
    picked = torch.topk(scores.float().cpu(), min(budget, len(rows))).indices  # rows live on the CPU
    return torch.sort(rows[picked]).values
