"""The fused-prefill engine: stored chunk KVs in, fused KV cache and first-token logits out.

How one prompt `S | C1..Ck | Q` is fused (CacheBlend §4.2 mechanics, shared by every method):
- every cache row is, at every layer, either *loaded* (stored KV of S or of a chunk, its keys
  rotated to the row's position) or *recomputed* (an active row: its hidden state runs through
  the layer, its fresh K/V overwrite the loaded ones, and it attends over the whole cache);
- Q's rows are always recomputed; a method decides which chunk rows are recomputed, and may
  shrink that set between layers (never grow it: a row's hidden state must exist);
- a recomputed row at cache row i sees rows <= i (causal by prompt order).
Compute per layer is proportional to the active rows: projections and MLP run on those rows
only, attention is [active, n]. At ratio 1.0 every chunk row is active from layer 0, which is
exactly a prefill of C1..Ck Q after S: the oracle tests check this against `full`.

`FusionEngine.fuse` is the one layer loop every method runs through; a method only answers its
questions (see methods/base.py): where chunks sit, which rows start recomputed, what to do before
and after each layer, how many passes, and whose attention to record. The engine owns all timing.

The engine knows layers and attention, never files: chunk KVs come from a LayerKVSource.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from kvf.errors import KvfError
from kvf.pipeline.model.forward import ActiveRows, KVCache, SpanCalibration, Transformer
from kvf.pipeline.model.prompt import FusedPrompt
from kvf.pipeline.model.rope import apply_rope, reposition_keys

if TYPE_CHECKING:
    from kvf.pipeline.fusion.methods.base import FusionMethod


class LayerKVSource(Protocol):
    """Stored KVs of the prompt's chunks, one layer at a time (keys before RoPE).

    chunk_extras: per chunk (prompt order) the small named arrays stored with its entry, e.g.
    Cache-Craft's build-time attention summaries; None when the store holds none.
    """

    load_seconds: float
    chunk_extras: list[dict] | None

    def layer(self, layer: int, chunks: list[int]) -> list[torch.Tensor]:
        """-> for each chunk index asked for, its [2, KV, t_i, d] at this layer."""
        ...

    def read_again(self, layer: int, chunks: list[int]) -> list[torch.Tensor]:
        """The same as layer(), read once more after the prefill (also once the source is closed),
        neither timed as loading nor disturbing any reading ahead."""
        ...


def recompute_budget(recompute_ratio: float, n_tokens: int) -> int:
    """round(r * n), rounding halves up (Python's round() would round halves to even)."""
    if not 0.0 <= recompute_ratio <= 1.0:
        raise KvfError(f"--ratio {recompute_ratio}: must be within [0, 1]")
    return min(n_tokens, int(math.floor(recompute_ratio * n_tokens + 0.5)))


@dataclass
class FusionPlan:
    """What a method decides before layer 0 (methods/base.py: FusionMethod.plan)."""
    recompute_chunk_rows: torch.Tensor           # [r] chunk rows recomputed from layer 0 (Q's always are)
    positions: torch.Tensor | None = None        # [n] RoPE positions; None = contiguous from 0
    loaded_chunks: list[int] | None = None       # chunks whose stored KV is read; None = all
    scratch: dict = field(default_factory=dict)  # the method's working data for this request
    calibration: SpanCalibration | None = None   # recomputed rows (and decoding) re-weight a span (APE)


@dataclass
class FusionState:
    """Everything about one prompt's fusion in flight."""
    prompt: FusedPrompt
    positions: torch.Tensor          # [n] RoPE position of every cache row
    cache: KVCache                   # [L, 2, KV, cap, d], rows [0, n) in use
    rows: torch.Tensor               # [a] cache rows recomputed at the current layer, sorted
    hidden: torch.Tensor             # [a, D] their hidden states
    loaded_chunks: list[int]         # chunks whose stored KV fills their rows
    source: "LayerKVSource | None"   # where the loaded chunks' stored KVs come from, layer by layer
    prefix_kv: torch.Tensor          # [L, 2, KV, s, d] S's KV, keys before RoPE
    cos: torch.Tensor                # [n, d] RoPE tables at `positions`, shared by all layers
    sin: torch.Tensor                # [n, d]
    max_new_tokens: int = 0
    calibration: SpanCalibration | None = None
    scratch: dict = field(default_factory=dict)   # the method's working data (FusionPlan.scratch)
    info: dict = field(default_factory=dict)      # what the method reports (FusionResult.info)
    pass_index: int = 0
    key_keep: torch.Tensor | None = None   # [n] bool, False = row dropped from the context
    loaded_layers: set = field(default_factory=set)
    mask: torch.Tensor | None = None       # [a, n] cached until rows change
    active: ActiveRows | None = None       # the rows placed for every layer, cached until rows or positions change
    # accounting
    chunk_rows_recomputed: int = 0         # chunk rows active at the last layer (what a method "recomputes")
    token_layers: int = 0                  # sum over layers of active chunk rows (real compute spent)
    select_seconds: float = 0.0
    query_attention: list = field(default_factory=list)  # per recorded layer [n] (methods that ask for it)
    recorded_rows: slice | None = None    # the active rows whose mean attention step records (None: Q's rows)

    @property
    def n(self) -> int:
        return self.prompt.n_tokens

    def chunk_row_mask(self) -> torch.Tensor:
        """[n] bool: True on chunk rows."""
        is_chunk = torch.zeros(self.n, dtype=torch.bool)
        is_chunk[self.prompt.n_prefix: self.prompt.n_prefix + self.prompt.n_chunk_tokens] = True
        return is_chunk

    def active_chunk_rows(self) -> torch.Tensor:
        return self.rows[self.chunk_row_mask()[self.rows]]


@dataclass
class QueryPass:
    """A query-only pass over every loaded chunk (reuse's whole request, and FusionRAG's and ProphetKV's
    first pass), kept so a sweep runs it once per question and stored variant (`shared`, see fuse)."""
    cache: KVCache                   # after the pass: stored KVs loaded at every layer, Q's rows written
    hidden: torch.Tensor             # [|Q|, D] Q's hidden states after the last layer
    query_attention: list            # per layer [n]: Q's mean attention to every row (all layers recorded)
    token_layers: int
    seconds: float                   # the pass, as a lone request pays it
    load_seconds: float              # of which waiting for the store
    loading_seconds: float           # of which filling the cache from the store (waiting, copying, rotating keys)


@dataclass
class StoredRows:
    """The stored KV of chunk rows a pass recomputes, from layer `first` on (FusionEngine.keep_stored_rows)."""
    first: int
    rows: torch.Tensor                  # [a] sorted chunk rows
    copy: torch.Tensor | None           # [L', 2, KV, a, d] kept in memory, or None: read from the source again


COPY_STORED_ROWS_ON_CPU = False  # tests set it to hold the two ways of keeping stored rows to each other


@dataclass
class Charge:
    """What a request is charged for shared work beyond its own wall time: the work as a lone request of it pays
    it, less what its wall time already holds (nothing, when it ran the work itself: Charge())."""
    seconds: float = 0.0
    load_seconds: float = 0.0        # of which waiting for the store


@dataclass
class FusionResult:
    logits: torch.Tensor             # [vocab] first-token logits
    _cache: KVCache                  # fused cache, length n, room for decoding (read it as .cache)
    next_position: int               # RoPE position of the first generated token
    recomputed_tokens: int           # chunk tokens recomputed (the method's budget)
    recomputed_token_layers: int     # chunk token x layer products actually computed
    timings: dict                    # seconds: load, select, recompute
    info: dict = field(default_factory=dict)
    calibration: SpanCalibration | None = None   # decoding keeps the method's attention calibration
    after_first_token: Callable[[], None] | None = None  # work only decoding reads (kvfuse's shift), not yet run
    after_first_token_seconds: float = 0.0              # what that work took, once run
    prefill_rows: int = field(init=False)               # cache rows the prefill filled (decoding appends after)

    def __post_init__(self) -> None:
        self.prefill_rows = self._cache.length

    @property
    def cache(self) -> KVCache:
        """The fused cache as decoding reads it. Work a method put off until after the first token (it
        changes only rows no later layer of the prefill reads, e.g. kvfuse's shift) runs here, once, on
        first access, timed in after_first_token_seconds: TTFT leaves it out, decoding pays it."""
        if self.after_first_token is not None:
            work, self.after_first_token = self.after_first_token, None
            started = time.perf_counter()
            with torch.inference_mode():  # the cache is an inference tensor, wherever it is read from
                work()
            if self._cache.kv.is_cuda:  # the work is done when the GPU says so
                torch.cuda.synchronize()
            self.after_first_token_seconds += time.perf_counter() - started
        return self._cache

    @cache.setter
    def cache(self, cache: KVCache) -> None:
        self._cache = cache
        self.prefill_rows = cache.length


class FusionEngine:
    def __init__(self, transformer: Transformer):
        self.model = transformer
        self._prefix_kv_cache: dict[tuple, torch.Tensor] = {}

    # ---- offline: computing KVs to store ------------------------------------------------------
    @torch.inference_mode()
    def prefix_kv(self, prefix_ids: list[int]) -> torch.Tensor:
        """S's own KV [L, 2, KV, s, d], keys before RoPE. Computed once per distinct S."""
        key = tuple(prefix_ids)
        if key not in self._prefix_kv_cache:
            self._prefix_kv_cache[key] = self.chunk_kv(prefix_ids, [], None)
        return self._prefix_kv_cache[key]

    def remember_prefix_kv(self, prefix_ids: list[int], kv: torch.Tensor) -> None:
        """Seed S's KV from a store, so it is loaded rather than recomputed (S is shared by every prompt)."""
        self._prefix_kv_cache[tuple(prefix_ids)] = kv.to(self.model.device, self.model.dtype)

    @torch.inference_mode()
    def chunk_kv(self, segment_ids: list[int], context_ids: list[int], context_kvs: list[torch.Tensor] | None,
                 attention_out: list | None = None) -> torch.Tensor:
        """KV [L, 2, KV, t, d] (keys before RoPE) of `segment_ids` prefilled after a context.

        The context is `context_ids` whose KVs are given (S, then for the fusion variant the
        neighbours' stored KVs: context_kvs[i] is [L, 2, KV, t_i, d], pre-RoPE) at contiguous
        positions. With context_kvs None the context is prefilled exactly. attention_out, when
        given, receives per layer the segment's head-averaged attention weights [t, c + t]
        (what build-time hooks such as Cache-Craft's summaries read), from the same prefill.
        """
        m = self.model
        c, t = len(context_ids), len(segment_ids)
        cache = m.new_cache(c + t)
        if context_kvs is None:
            if c:
                m.prefill(torch.tensor(context_ids), cache)
        else:
            cos, sin = m.rope.cos_sin(torch.arange(c), m.dtype)
            kv = torch.cat([x.to(m.device, m.dtype) for x in context_kvs], dim=3)  # [L, 2, KV, c, d]
            for layer in range(m.n_layers):
                cache.write(layer, slice(0, c), apply_rope(kv[layer, 0], cos, sin), kv[layer, 1])
            cache.length = c
        _, pre_rope_keys = m.prefill(torch.tensor(segment_ids), cache, start=c, keep_pre_rope_keys=True,
                                     attention_out=attention_out)
        keys = torch.stack(pre_rope_keys)                    # [L, KV, t, d]
        values = cache.kv[:, 1, :, c: c + t]                 # [L, KV, t, d]
        return torch.stack([keys, values], dim=1).clone()    # [L, 2, KV, t, d]

    # ---- online: the one fused prefill ----------------------------------------------------------
    @torch.inference_mode()
    def fuse(self, method: "FusionMethod", prompt: FusedPrompt, source: LayerKVSource | None,
             max_new_tokens: int = 0, shared: dict | None = None) -> FusionResult:
        """S | C1..Ck | Q -> fused cache and first-token logits, the way `method` says.

        Timing: time in the method's hooks is `select`; so is a whole selection pass (every pass but
        the last, e.g. FusionRAG's query-only pass) less the store loading it waited for; `load` is
        the time spent waiting for the store; `recompute` is the rest.

        shared: work done once for several requests on one prompt and stored variant (a sweep's
        methods x ratios). A method whose first pass is the plain query-only pass (`query_pass`)
        takes it from there, run by the first such request; each request is still charged the
        pass's full time, as a lone request would pay it, and says so in result.info["shared"]. Any other
        method whose plan loads every chunk at contiguous positions starts from a copy of that pass's cache
        (from_loaded_cache), charged the loading a lone request would pay.
        """
        started = time.perf_counter()
        load_before = source.load_seconds if source is not None else 0.0
        if not method.uses_store:
            return self.full_prefill(prompt, max_new_tokens, started)
        first_pass = 0
        if shared is not None and method.query_pass:
            state, charged = self.from_query_pass(method, prompt, source, max_new_tokens, shared)
            started -= charged.seconds            # the pass run by an earlier request: charged in full
            load_before -= charged.load_seconds
            first_pass = 1
        else:
            t0 = time.perf_counter()
            plan = method.plan(self, prompt, source, max_new_tokens)
            plan_seconds = time.perf_counter() - t0
            if shared is not None and self.loads_everything(method, plan, prompt):
                state, charged = self.from_loaded_cache(plan, prompt, source, max_new_tokens, shared)
                started -= charged.seconds
                load_before -= charged.load_seconds
            else:
                state = self.start(prompt, source, plan, max_new_tokens)
            state.select_seconds += plan_seconds
        for pass_index in range(first_pass, method.passes):
            pass_started, load_at_pass = time.perf_counter(), self._loaded(source)
            select_at_pass = state.select_seconds
            if pass_index > 0:  # what the last pass found decides what this one recomputes
                t0 = time.perf_counter()
                rows = method.next_pass_rows(self, state)
                state.select_seconds += time.perf_counter() - t0
                self.restart(state, rows, pass_index, with_question=method.pass_computes_question(pass_index))
            for layer in range(self.model.n_layers):
                t0 = time.perf_counter()
                method.before_layer(self, state, layer)
                state.select_seconds += time.perf_counter() - t0
                self.step(state, layer, record_query_attention=method.records_query_attention(state, layer))
                t0 = time.perf_counter()
                method.after_layer(self, state, layer)
                state.select_seconds += time.perf_counter() - t0
            if pass_index == 0 and method.passes > 1:  # the selection pass: all of it is `select`, but its loading
                waited = self._loaded(source) - load_at_pass
                state.select_seconds = select_at_pass + max(0.0, time.perf_counter() - pass_started - waited)
        result = self.finish(state, self._loaded(source) - load_before, started)
        method.finish(self, state, result)
        return result

    def query_pass(self, prompt: FusedPrompt, source: LayerKVSource | None, max_new_tokens: int) -> QueryPass:
        """Every chunk loaded at contiguous positions, only Q computed, Q's attention recorded at every layer."""
        started, load_before = time.perf_counter(), self._loaded(source)
        state = self.start(prompt, source, FusionPlan(torch.empty(0, dtype=torch.long)), max_new_tokens)
        loading = time.perf_counter() - started   # the cache's allocation and the reader's start
        for layer in range(self.model.n_layers):
            t0 = time.perf_counter()
            self.load_layer(state, layer)   # (step would load it first thing): timed apart, for from_loaded_cache
            loading += time.perf_counter() - t0
            self.step(state, layer, record_query_attention=True)
        return QueryPass(state.cache, state.hidden, state.query_attention, state.token_layers,
                         time.perf_counter() - started, self._loaded(source) - load_before, loading)

    def from_query_pass(self, method: "FusionMethod", prompt: FusedPrompt, source: LayerKVSource | None,
                        max_new_tokens: int, shared: dict) -> tuple[FusionState, Charge]:
        """The state a lone request of `method` would be in after its first pass, from the shared pass
        (run now if it is not there yet), on a copy of its cache; and what this request is charged for
        the pass beyond its own wall time (the whole pass when an earlier request ran it)."""
        done, ran_here = self.shared_query_pass(prompt, source, max_new_tokens, shared)
        charged = Charge() if ran_here else Charge(done.seconds, done.load_seconds)
        cache = self.copy_of(done.cache)
        positions = torch.arange(prompt.n_tokens)
        cos, sin = self.model.rope.cos_sin(positions, self.model.dtype)
        state = FusionState(prompt, positions, cache, prompt.question_rows(), done.hidden.clone(),
                            list(range(len(prompt.chunk_segments))), source, self.prefix_kv(prompt.prefix_ids),
                            cos, sin, max_new_tokens=max_new_tokens, loaded_layers=set(range(self.model.n_layers)),
                            token_layers=done.token_layers)
        state.query_attention = [a for layer, a in enumerate(done.query_attention)
                                 if method.records_query_attention(state, layer)]
        if method.passes > 1:  # the shared pass was this method's selection pass
            state.select_seconds = max(0.0, done.seconds - done.load_seconds)
        state.info.update(shared=["query-pass"], charged_seconds=charged.seconds)
        return state, charged

    def shared_query_pass(self, prompt: FusedPrompt, source: LayerKVSource | None, max_new_tokens: int,
                          shared: dict) -> tuple[QueryPass, bool]:
        """The question's query-only pass on this variant, run now if no request has yet; and whether it ran now."""
        ran_here = "query-pass" not in shared
        if ran_here:
            shared["query-pass"] = self.query_pass(prompt, source, max_new_tokens)
        return shared["query-pass"], ran_here

    def copy_of(self, cache: KVCache) -> KVCache:
        copy = self.model.new_cache(cache.kv.shape[3])
        copy.kv.copy_(cache.kv)
        copy.length = cache.length
        return copy

    @staticmethod
    def loads_everything(method: "FusionMethod", plan: FusionPlan, prompt: FusedPrompt) -> bool:
        """Whether a request's loading writes what the query pass's did: every chunk, at contiguous positions that
        stay (a method that re-positions rows mid-fusion rotates each layer's keys where they are by then)."""
        contiguous = plan.positions is None or torch.equal(plan.positions, torch.arange(prompt.n_tokens))
        return plan.loaded_chunks is None and contiguous and not method.repositions

    def from_loaded_cache(self, plan: FusionPlan, prompt: FusedPrompt, source: LayerKVSource | None,
                          max_new_tokens: int, shared: dict) -> tuple[FusionState, Charge]:
        """start(plan) without loading: a copy of the shared query pass's cache, whose every layer holds what
        this request's own loading would write there, bit for bit, S and every chunk at contiguous positions.
        It differs only on Q's rows, which every layer recomputes (Q is always active), and each active row
        writes its fresh K/V before any row attends. Charged the pass's loading, as a lone request pays it;
        where this request ran the pass, its wall time holds Q's computing there too, which it is not charged."""
        done, ran_here = self.shared_query_pass(prompt, source, max_new_tokens, shared)
        charged = Charge(done.loading_seconds - (done.seconds if ran_here else 0.0),
                         0.0 if ran_here else done.load_seconds)
        state = self.start(prompt, source, plan, max_new_tokens, cache=self.copy_of(done.cache))
        state.info.update(shared=["loaded-kv"], charged_seconds=charged.seconds)
        return state, charged

    @staticmethod
    def _loaded(source: LayerKVSource | None) -> float:
        return source.load_seconds if source is not None else 0.0

    def full_prefill(self, prompt: FusedPrompt, max_new_tokens: int, started: float) -> FusionResult:
        """Ordinary prefill of the whole prompt, S included (`full`: the reference every method is held to)."""
        self.check_fits(prompt, max_new_tokens)
        cache = self.model.new_cache(prompt.n_tokens + max_new_tokens)
        logits, _ = self.model.prefill(prompt.all_ids(), cache)
        timings = {"load": 0.0, "select": 0.0, "recompute": time.perf_counter() - started}
        n_chunk = prompt.n_chunk_tokens
        return FusionResult(logits, cache, prompt.n_tokens, n_chunk, n_chunk * self.model.n_layers, timings)

    def check_fits(self, prompt: FusedPrompt, max_new_tokens: int, positions: torch.Tensor | None = None) -> None:
        """The prompt's RoPE positions (contiguous unless `positions` is given) plus the new tokens must fit."""
        limit = self.model.max_positions
        used = prompt.positions_used(positions)
        if used + max_new_tokens > limit:
            why, fix = prompt.overflow_fix(limit, "use fewer chunks (--top-k), smaller --chunk-tokens")
            raise KvfError(f"prompt of {prompt.n_tokens} tokens ({used} positions){why} + {max_new_tokens} new tokens "
                           f"exceeds the model's {limit} positions; {fix}")

    def check_source(self, prompt: FusedPrompt, source: LayerKVSource | None, chunks: list[int]) -> None:
        """A stored KV must have exactly its chunk's tokens: anything else is someone else's entry."""
        lengths = getattr(source, "token_counts", None)
        if lengths is None:
            return
        for i in chunks:
            want = len(prompt.chunk_segments[i])
            if lengths[i] != want:
                raise KvfError(f"the stored KV of chunk {i + 1} has {lengths[i]} tokens but the chunk has {want}: "
                               "the store holds a misplaced entry; run `kvf store verify --delete-bad` and rebuild")

    def start(self, prompt: FusedPrompt, source: LayerKVSource | None, plan: FusionPlan,
              max_new_tokens: int = 0, prefix_kv: torch.Tensor | None = None, cache: KVCache | None = None) -> FusionState:
        """Set up the cache and the rows recomputed from layer 0 (the plan's chunk rows plus Q). A given cache has
        every layer loaded already (from_loaded_cache): nothing is read into it."""
        self.check_fits(prompt, max_new_tokens, plan.positions)
        n = prompt.n_tokens
        positions = torch.arange(n) if plan.positions is None else plan.positions
        preloaded = cache is not None
        cache = cache if preloaded else self.model.new_cache(n + max_new_tokens)
        cache.length = n
        rows = torch.unique(torch.cat([plan.recompute_chunk_rows.long(), prompt.question_rows()]))  # sorted
        hidden = self.model.embed(prompt.all_ids()[rows])
        loaded = list(range(len(prompt.chunk_segments))) if plan.loaded_chunks is None else plan.loaded_chunks
        self.check_source(prompt, source, loaded)
        prefix_kv = self.prefix_kv(prompt.prefix_ids) if prefix_kv is None else prefix_kv
        cos, sin = self.model.rope.cos_sin(positions, self.model.dtype)  # [n, d]
        state = FusionState(prompt, positions, cache, rows, hidden, loaded, source, prefix_kv, cos, sin,
                            max_new_tokens=max_new_tokens, calibration=plan.calibration, scratch=plan.scratch)
        if preloaded:
            state.loaded_layers = set(range(self.model.n_layers))
        elif source is not None and hasattr(source, "start"):
            source.start(loaded, self.model.device)  # a pipelined source starts reading layer 0 now
        return state

    def load_layer(self, state: FusionState, layer: int) -> None:
        """Fill S's rows and the loaded chunks' rows of this layer, keys rotated to their positions."""
        if layer in state.loaded_layers:
            return
        state.loaded_layers.add(layer)
        self._write_rotated(state, layer, 0, state.prefix_kv[layer])
        if state.loaded_chunks:
            spans = state.prompt.chunk_spans()
            chunk_kvs = state.source.layer(layer, state.loaded_chunks)
            for i, kv in zip(state.loaded_chunks, chunk_kvs):
                self._write_rotated(state, layer, spans[i][0], kv)

    def _write_rotated(self, state: FusionState, layer: int, start: int, kv: torch.Tensor) -> None:
        """kv [2, KV, t, d] (keys before RoPE) -> cache rows [start, start + t) at their positions."""
        t = kv.shape[2]
        kv = kv.to(self.model.device, self.model.dtype, non_blocking=True)
        cos, sin = state.cos[start: start + t], state.sin[start: start + t]
        state.cache.write(layer, slice(start, start + t), apply_rope(kv[0], cos, sin), kv[1])

    def keep_stored_rows(self, state: FusionState, first: int, rows: torch.Tensor) -> "StoredRows":
        """Before a pass overwrites these sorted chunk rows from layer `first` on, keep what loading wrote
        there, for work after the first token (stored_rows). On an accelerator: a copy, at memory bandwidth
        (microseconds). On the CPU the copy is what the first token would wait for, so nothing is copied and
        the rows are read from the source again when they are needed."""
        kv = state.cache.kv
        copy = None
        if kv.device.type != "cpu" or COPY_STORED_ROWS_ON_CPU:
            copy = kv[first:].index_select(3, rows.to(kv.device))                     # [L', 2, KV, a, d]
        return StoredRows(first, rows, copy)

    def stored_rows(self, state: FusionState, kept: "StoredRows", layer: int) -> torch.Tensor:
        """[2, KV, a, d]: what load_layer wrote at kept.rows of this layer, bit for bit (keys rotated at their
        positions): from the copy, or read from the source again (which works once it is closed)."""
        if kept.copy is not None:
            return kept.copy[layer - kept.first]
        rows, spans, parts = kept.rows, state.prompt.chunk_spans(), []
        chunks = sorted(state.loaded_chunks)                                 # rows are sorted: so are their chunks
        for i, kv in zip(chunks, state.source.read_again(layer, chunks)):
            start, end = spans[i]
            mine = rows[(rows >= start) & (rows < end)] - start            # [a_i] rows of chunk i, from 0
            parts.append(kv[:, :, mine.to(kv.device)])                      # [2, KV, a_i, d]
        kv = torch.cat(parts, dim=2).to(self.model.device, self.model.dtype)  # [2, KV, a, d]
        if kv.shape[2] != len(rows):
            raise ValueError("stored_rows: some rows are not rows of a loaded chunk")
        return torch.stack([apply_rope(kv[0], state.cos[rows], state.sin[rows]), kv[1]])

    def keep_rows(self, state: FusionState, keep_chunk_rows: torch.Tensor) -> None:
        """Shrink the recomputed set to keep_chunk_rows (plus Q). They must already be active."""
        new_rows = torch.unique(torch.cat([keep_chunk_rows.long(), state.prompt.question_rows()]))
        where = torch.searchsorted(state.rows, new_rows)
        if not torch.equal(state.rows[where.clamp(max=len(state.rows) - 1)], new_rows):
            raise ValueError("a method tried to recompute rows that are not active (no hidden state for them)")
        state.rows, state.hidden, state.mask, state.active = new_rows, state.hidden[where], None, None

    def drop_rows_from_context(self, state: FusionState, rows: torch.Tensor) -> None:
        """Mask rows out of every later attention (pruned chunks)."""
        if state.key_keep is None:
            state.key_keep = torch.ones(state.n, dtype=torch.bool)
        state.key_keep[rows] = False
        state.mask = None

    @torch.inference_mode()
    def project_kv(self, state: FusionState, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh K (rotated) and V [KV, a, d] of the active rows at this layer, without writing them."""
        _, k, v = self.model.project_qkv(layer, state.hidden)
        cos, sin = state.cos[state.rows], state.sin[state.rows]
        return apply_rope(k, cos, sin), v

    @torch.inference_mode()
    def kv_deviation(self, state: FusionState, layer: int, on: str = "k") -> torch.Tensor:
        """[a] how far each active row's fresh K (on="k") or V at this layer lies from what the cache
        holds there: squared L2 over heads and dims (CacheBlend's deviation)."""
        self.load_layer(state, layer)
        fresh_k, fresh_v = self.project_kv(state, layer)                          # [KV, a, d]
        held = state.cache.kv[layer, 0 if on == "k" else 1][:, state.rows]         # [KV, a, d]
        return (((fresh_k if on == "k" else fresh_v) - held) ** 2).sum(dim=(0, 2))

    @torch.inference_mode()
    def step(self, state: FusionState, layer: int, record_query_attention: bool = False) -> None:
        """Run one layer for the active rows over the (loaded + recomputed) cache.

        record_query_attention appends to state.query_attention the mean attention of Q's tokens to
        every cache row at this layer, [n]: only Q's rows of attention are formed, [H, |Q|, n]. A method
        may name other active rows to record instead (state.recorded_rows).
        """
        self.load_layer(state, layer)
        if state.mask is None:
            state.mask = self.model.causal_mask(state.rows, state.n, state.key_keep)
        if state.active is None:
            state.active = self.model.active_rows(state.rows, state.positions[state.rows])
        recorded = state.recorded_rows                                            # Q's rows: the last active rows
        if recorded is None:
            recorded = slice(len(state.rows) - len(state.prompt.question_ids), None)
        attention = [] if record_query_attention else None
        state.hidden = self.model.layer_step(layer, state.hidden, state.active, state.cache, state.mask,
                                             attention_out=attention, attention_rows=recorded,
                                             calibration=state.calibration)
        n_chunk_active = int(state.chunk_row_mask()[state.rows].sum())
        state.token_layers += n_chunk_active
        if n_chunk_active or state.pass_index == 0:   # a later pass of Q alone keeps the count of the pass before
            state.chunk_rows_recomputed = n_chunk_active
        if attention is not None:
            state.query_attention.append(attention[0].mean(dim=0).cpu())          # [|Q|, n] -> [n]

    # ---- a new pass, or new positions, on an existing state (two-pass and pruning methods) -------
    @torch.inference_mode()
    def restart(self, state: FusionState, recompute_chunk_rows: torch.Tensor, pass_index: int,
                with_question: bool = True) -> None:
        """Begin a new pass from layer 0 over an already-run state, recomputing `recompute_chunk_rows` (plus Q,
        unless with_question is False: a pass that only records what chunk rows attend to).

        Used by two-pass methods (FusionRAG, ProphetKV): pass 1 loaded every layer and ran Q only;
        pass 2 reuses that cache instead of loading again. The restarted rows get fresh hidden states
        (their embeddings); the cache keeps what it holds, which is exact because every layer writes
        the active rows' fresh K/V before they attend, so no row ever reads its own pass-1 values,
        and rows not restarted still hold their stored KV (pass 1 wrote only Q's rows).
        """
        question = state.prompt.question_rows() if with_question else torch.empty(0, dtype=torch.long)
        rows = torch.unique(torch.cat([recompute_chunk_rows.long(), question]))  # sorted
        state.rows, state.hidden = rows, self.model.embed(state.prompt.all_ids()[rows])
        state.mask, state.active = None, None
        state.query_attention, state.pass_index = [], pass_index

    @torch.inference_mode()
    def reposition(self, state: FusionState, positions: torch.Tensor) -> None:
        """Move cache rows to new RoPE positions [n] mid-fusion (CacheFocus re-positioning).

        Keys already in the cache (every loaded layer, Q's recomputed keys included) are re-rotated
        exactly; layers loaded later are rotated at the new positions, and active rows use them from
        the next step on. Rows whose position does not change are not touched.
        """
        moved = torch.nonzero(positions != state.positions).flatten()   # [m]
        if len(moved):
            old, new = state.positions[moved], positions[moved]
            for layer in sorted(state.loaded_layers):
                keys = state.cache.kv[layer, 0][:, moved]                   # [KV, m, d], rotated at `old`
                state.cache.kv[layer, 0][:, moved] = reposition_keys(keys, self.model.rope, old, new)
        state.positions, state.active = positions.clone(), None
        state.cos, state.sin = self.model.rope.cos_sin(state.positions, self.model.dtype)

    def finish(self, state: FusionState, load_seconds: float, started: float) -> FusionResult:
        logits = self.model.logits(state.hidden[-1:])[0]
        total = time.perf_counter() - started
        timings = {"load": load_seconds, "select": state.select_seconds,
                   "recompute": max(0.0, total - load_seconds - state.select_seconds)}
        return FusionResult(logits, state.cache, int(state.positions[-1]) + 1, state.chunk_rows_recomputed,
                            state.token_layers, timings, dict(state.info), state.calibration)
