"""`cachecraft` (Cache-Craft, seed cachecraft.txt §3): per-chunk recompute budgets from build-time
attention summaries, recomputing each chunk's most context-dependent tokens.

Build time (`build_extras`, the method's build-time hook: `kvf build-cache --extras-for cachecraft`,
and `kvf run` / `kvf bench` ask for it themselves). The chunk's own prefill after its build-time
context (S, then for the `fusion` variant its neighbour chunks) hands us its tokens' attention
weights per layer (engine.chunk_kv's attention_out: no second forward pass); we average them over
heads and layers,
a[k, l] = 1/(L*H) sum_{layer, head} softmax(q_k . K)_l, and keep:
  cc_inter            [m+1, t] float32  attention mass from each chunk token to each context segment
                                        (row 0 = S, rows 1..m = the context chunks, in context order)
  cc_intra            [t]      float32  attention mass from each chunk token to *earlier* tokens of
                                        the chunk (eq. 4: l < k, the token itself excluded)
  cc_context_lengths  [m+1]    int64    |S|, |N1|, ..., |Nm|
  cc_context_keys     [m]      int64    segment_key() of each context chunk: which chunks preceded it
Averaging the attention over layers first is exact for eq. 10, because a_l and b_l are linear in
the layer's attention weights. For the `prefix` variant m = 0: only S preceded the chunk.

Run time, per chunk C_i of the prompt (its new prefix = the chunks before it in the prompt):
- CCI (eq. 9-11): a = sum_j inter(C_j, C_i) / (|C_i| |C_j|) over every build-time context segment,
  S included (S is the "always repeated chunk" of the paper's footnote, and for the prefix variant
  the only outside context the chunk had); b = intra(C_i) / |C_i|^2; CCI = sigmoid(a / b).
- beta (eq. 6): the share of the chunk's inter-attention to its build-time context *chunks* that
  went to chunks which precede it again now. S is left out: it precedes every chunk in every
  prompt, so counting it would make every prefix-variant cache look perfectly matched. With no
  build-time context chunks (prefix variant), beta = 1 if the chunk has no preceding chunk now
  either (C1: its cache is exact) and 0 otherwise.
- gamma (eq. 7): normalised Kendall tau distance between the common chunks' build-time order and
  their order now (0 when fewer than two are common); beta' = beta (1 - gamma) (eq. 8).
- CFO = alpha * CCI * (1 - beta') (eq. 12), capped at 1. Unless `alpha` is given it is calibrated
  per prompt so that the token-weighted mean of CFO equals recompute_ratio, i.e. about
  r * chunk tokens in total (the paper tunes alpha offline on a validation set, eq. 13; we put
  every method on the same ratio axis instead). Chunks with beta' = 1 get CFO = 0 whatever alpha:
  Cache-Craft judges them reusable as they are. With the prefix variant that is only C1, whose
  cache is exact, so r = 1 equals `full`; with the fusion variant it is a chunk whose whole
  build-time context precedes it again in the same order, and then r = 1 reuses it (not exact).
- Recompute the top ceil(CFO |C_i|) tokens of each chunk (so at most one token per chunk above the
  budget), ranked by their build-time inter-attention to everything before the chunk (eq. 14).
- Optional focused-chunk early termination (Algorithm 1, `focus_window` w): at each layer the mean
  attention of Q's tokens to each chunk is accumulated (Q's rows of attention only); the focused
  set F is the top i* chunks by that score, i* = argmax over i in 1..k-2 of h_{i+1} - h_i, the
  entropy increments of the normalised gaps of the sorted scores (lines 4-9, 1-based; fewer than 3
  chunks: every chunk is focused). Once F is the same for w consecutive layers, the tokens of the
  other chunks stop being recomputed: later layers keep their stored KV.
recomputed_tokens counts every selected token (early-terminated ones were recomputed in the layers
before the cut; recomputed_token_layers shows the saving).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from kvf.errors import KvfError
from kvf.pipeline.fusion.engine import FusionEngine, FusionPlan, FusionResult, FusionState, LayerKVSource
from kvf.pipeline.fusion.methods.base import FusionMethod, chunk_attention, knob, register
from kvf.pipeline.model.prompt import FusedPrompt

EXTRAS = ("cc_inter", "cc_intra", "cc_context_lengths", "cc_context_keys")
MISSING_META = ("cachecraft needs per-chunk attention summaries, but the store's entries carry none; "
                "rebuild them with `kvf build-cache --extras-for cachecraft` (kvf run and the Python API add them to "
                "entries they compute)")


# ---- build time: attention summaries ------------------------------------------------------------
def segment_key(segment_ids: list[int]) -> int:
    """A chunk's identity from its token ids as placed in the prompt: 8 bytes of their sha256, as int64."""
    digest = hashlib.sha256(np.asarray(segment_ids, dtype="<i8").tobytes()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def summarise_attention(attention: torch.Tensor, context_lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """attention [t, c+t] (chunk tokens over context + chunk) -> inter [m+1, t] per context segment,
    intra [t] to earlier tokens of the chunk."""
    t = attention.shape[0]
    c = attention.shape[1] - t
    bounds = np.cumsum([0] + list(context_lengths))
    inter = torch.stack([attention[:, b0:b1].sum(dim=-1) for b0, b1 in zip(bounds[:-1], bounds[1:])]) \
        if context_lengths else torch.zeros(0, t)
    intra = torch.tril(attention[:, c:], diagonal=-1).sum(dim=-1)  # l < k only
    return inter, intra


def summaries_from_attention(attention: list[torch.Tensor], context_lengths: list[int],
                             context_ids: list[int]) -> dict[str, np.ndarray]:
    """The build-time hook: per-layer head-averaged attention [L][t, c+t] of a chunk's own prefill ->
    the extras Cache-Craft stores with the entry (see the module docstring).

    context_ids = S followed by the context chunks; context_lengths = [|S|, |N1|, ...] cuts it into
    segments. Averaging over layers first is exact for eq. 10 (a_l and b_l are linear in the weights).
    """
    context_lengths = [int(n) for n in context_lengths]
    if sum(context_lengths) != len(context_ids):
        raise ValueError(f"context_lengths {context_lengths} do not add up to the {len(context_ids)} context tokens")
    mean = torch.stack(attention).mean(dim=0).float().cpu()                   # [t, c+t], over heads and layers
    inter, intra = summarise_attention(mean, context_lengths)
    starts = np.cumsum([0] + context_lengths)
    keys = [segment_key(context_ids[starts[j]: starts[j + 1]]) for j in range(1, len(context_lengths))]
    return {"cc_inter": inter.numpy(), "cc_intra": intra.numpy(),
            "cc_context_lengths": np.asarray(context_lengths, dtype=np.int64),
            "cc_context_keys": np.asarray(keys, dtype=np.int64)}


def chunk_kv_with_summaries(engine: FusionEngine, segment_ids: list[int], context_ids: list[int],
                            context_kvs: list[torch.Tensor] | None = None,
                            context_lengths: list[int] | None = None) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """engine.chunk_kv's KV [L, 2, KV, t, d] (keys before RoPE) and Cache-Craft's summaries, from one prefill.

    context_lengths defaults to the token counts of context_kvs (S's KV first, then one per context
    chunk); without context_kvs all of the context is S.
    """
    c = len(context_ids)
    if context_lengths is None:
        context_lengths = [kv.shape[3] for kv in context_kvs] if context_kvs is not None else ([c] if c else [])
    attention: list[torch.Tensor] = []
    kv = engine.chunk_kv(segment_ids, context_ids, context_kvs, attention_out=attention)
    return kv, summaries_from_attention(attention, context_lengths, context_ids)


# ---- run time: how much of each chunk to recompute ----------------------------------------------
@dataclass
class ChunkSummary:
    inter: np.ndarray            # [m+1, t]
    intra: np.ndarray            # [t]
    context_lengths: np.ndarray  # [m+1]
    context_keys: np.ndarray     # [m]


def read_summaries(source: LayerKVSource | None, prompt: FusedPrompt) -> list[ChunkSummary]:
    extras = getattr(source, "chunk_extras", None)
    k = len(prompt.chunk_segments)
    if extras is None or len(extras) != k or any(e is None or not all(n in e for n in EXTRAS) for e in extras):
        raise KvfError(MISSING_META)
    out = []
    for i, (e, seg) in enumerate(zip(extras, prompt.chunk_segments)):
        s = ChunkSummary(*(np.asarray(e[n]) for n in EXTRAS))
        if s.inter.ndim != 2 or s.inter.shape[1] != len(seg) or s.intra.shape != (len(seg),):
            raise KvfError(f"cachecraft summaries of chunk {i} do not match its {len(seg)} tokens; "
                           f"rebuild them with `kvf build-cache --extras-for cachecraft`")
        out.append(s)
    return out


def cache_context_impact(s: ChunkSummary) -> float:
    """CCI (eq. 9-11) = sigmoid(a / b): outside vs own influence on the chunk's KV."""
    t = s.intra.shape[0]
    a = sum(float(s.inter[j].sum()) / (t * int(s.context_lengths[j])) for j in range(len(s.context_lengths)))
    b = float(s.intra.sum()) / (t * t)
    ratio = a / b if b > 0 else (math.inf if a > 0 else 0.0)  # a one-token chunk has no intra-attention
    return 1.0 / (1.0 + math.exp(-ratio)) if ratio != math.inf else 1.0


def prefix_overlap(inter_per_chunk: np.ndarray, old_keys: list[int], new_prefix_keys: list[int]) -> float:
    """beta (eq. 6): share of inter-attention to the build-time context chunks that precede the chunk now.
    inter_per_chunk [m] = the chunk's attention mass to each build-time context chunk."""
    if not old_keys:  # prefix variant: only S came before; exact iff nothing else comes before now
        return 0.0 if new_prefix_keys else 1.0
    now = set(new_prefix_keys)
    shared = np.array([key in now for key in old_keys])
    total = float(inter_per_chunk.sum())
    if total <= 0:
        return float(shared.mean())
    return float(inter_per_chunk[shared].sum()) / total


def kendall_tau_distance(old_order: list[int], new_order: list[int]) -> float:
    """Discordant pairs / C(m, 2) between two orders of the same m items; 0 when m < 2."""
    m = len(old_order)
    if m < 2:
        return 0.0
    rank = {key: r for r, key in enumerate(new_order)}
    ranks = [rank[key] for key in old_order]
    discordant = sum(1 for p in range(m) for q in range(p + 1, m) if ranks[p] > ranks[q])
    return discordant / (m * (m - 1) / 2)


def order_penalty(old_keys: list[int], new_prefix_keys: list[int]) -> float:
    """gamma (eq. 7): Kendall tau distance between the common chunks' build-time and current orders."""
    common = set(old_keys) & set(new_prefix_keys)
    old_order = list(dict.fromkeys(key for key in old_keys if key in common))
    new_order = list(dict.fromkeys(key for key in new_prefix_keys if key in common))
    return kendall_tau_distance(old_order, new_order)


def calibrate_alpha(x: np.ndarray, lengths: np.ndarray, recompute_ratio: float) -> float:
    """alpha with sum_i min(1, alpha x_i) |C_i| = r * sum_i |C_i| (bisection; the lower end, so the
    ceil per chunk overshoots by at most one token per chunk). Chunks with x_i = 0 cannot be
    recomputed, so the largest reachable budget is every other chunk in full."""
    target = recompute_ratio * float(lengths.sum())
    positive = x > 0
    if target <= 0 or not positive.any():
        return 0.0
    recomputed = lambda alpha: float((np.minimum(1.0, alpha * x) * lengths).sum())  # noqa: E731
    high = 1.0 / float(x[positive].min())  # every chunk with x > 0 fully recomputed
    if recomputed(high) <= target:
        return high
    low = 0.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if recomputed(mid) <= target else (low, mid)
    return low


@dataclass
class RecomputePlan:
    counts: list[int]     # tokens recomputed per chunk, ceil(CFO_i |C_i|)
    cfo: list[float]
    cci: list[float]
    beta: list[float]
    gamma: list[float]
    alpha: float


def plan_recompute(summaries: list[ChunkSummary], prompt: FusedPrompt, recompute_ratio: float,
                   alpha: float | None = None) -> RecomputePlan:
    """Eq. 6-12 for every chunk of the prompt, and the tokens each one recomputes."""
    keys = [segment_key(seg) for seg in prompt.chunk_segments]
    cci, beta, gamma = [], [], []
    for i, s in enumerate(summaries):
        old_keys = [int(key) for key in s.context_keys]
        cci.append(cache_context_impact(s))
        beta.append(prefix_overlap(s.inter[1:].sum(axis=-1), old_keys, keys[:i]))
        gamma.append(order_penalty(old_keys, keys[:i]))
    beta_adjusted = np.array(beta) * (1 - np.array(gamma))                   # eq. 8
    x = np.array(cci) * (1 - beta_adjusted)                                  # CFO / alpha
    lengths = np.array([len(seg) for seg in prompt.chunk_segments], dtype=np.float64)
    alpha = calibrate_alpha(x, lengths, recompute_ratio) if alpha is None else alpha
    cfo = np.minimum(1.0, alpha * x)
    counts = [min(int(t), math.ceil(c * t - 1e-9)) for c, t in zip(cfo, lengths)]
    return RecomputePlan(counts, cfo.tolist(), cci, beta, gamma, float(alpha))


def most_contextualised_rows(summaries: list[ChunkSummary], prompt: FusedPrompt, counts: list[int]) -> torch.Tensor:
    """Eq. 14: in each chunk, the counts[i] tokens with the most build-time attention to what preceded
    the chunk (every context segment, S included) -> sorted cache rows."""
    rows = []
    for s, (start, _), n in zip(summaries, prompt.chunk_spans(), counts):
        if n > 0:
            outside = torch.from_numpy(np.asarray(s.inter, dtype=np.float32).sum(axis=0))  # [t]
            rows.append(start + torch.topk(outside, n).indices)
    return torch.sort(torch.cat(rows)).values if rows else torch.empty(0, dtype=torch.long)


# ---- focused chunks (Algorithm 1) ---------------------------------------------------------------
def focused_chunks(cumulative: torch.Tensor) -> list[int]:
    """Algorithm 1 lines 4-9: cumulative [k] Q->chunk attention -> the focused chunks (sorted indices)."""
    k = len(cumulative)
    if k < 3:  # no entropy increment to compare: keep every chunk
        return list(range(k))
    order = torch.sort(cumulative, descending=True, stable=True).indices
    ranked = cumulative[order].double()
    gaps = ranked[:-1] - ranked[1:]                                           # [k-1], diff_1..diff_{k-1}
    if gaps.sum() <= 0:
        return list(range(k))
    p = gaps / gaps.sum()
    entropy_terms = torch.where(p > 0, -p * torch.log(p.clamp_min(1e-300)), torch.zeros_like(p))  # h_i - h_{i-1}
    best = int(torch.argmax(entropy_terms[1:]))  # h_{i+1} - h_i for i = 1..k-2 is term i+1 (1-based)
    focus = best + 1                             # i* (1-based)
    return sorted(order[:focus].tolist())


@dataclass
class CacheCraftKnobs:
    alpha: float | None = knob(None, "CFO scale alpha (default: calibrated so the mean recomputed fraction is --ratio)",
                               min=0.0)
    focus_window: int | None = knob(None, "focused-chunk early termination window W in layers (default off)", min=1)


@register
class CacheCraft(FusionMethod):
    name = "cachecraft"
    summary = "per chunk ⌈CFO·|Ci|⌉ tokens by inter-attention (needs build-time summaries, computed automatically)"
    Knobs = CacheCraftKnobs
    paper_ratio = 0.3
    extras_names = EXTRAS
    exact_budget = False  # ceil(CFO_i |C_i|) per chunk: within one token per chunk of r * n
    reuse_at_ratio_zero = True

    def is_reuse(self) -> bool:
        return super().is_reuse() and self.knobs.alpha is None  # a given alpha sets the budget, not the ratio

    @staticmethod
    def extras_hook(attention: list[torch.Tensor], context_lengths: list[int], context_ids: list[int]) -> dict:
        return summaries_from_attention(attention, context_lengths, context_ids)

    def plan(self, engine: FusionEngine, prompt: FusedPrompt, source: LayerKVSource | None,
             max_new_tokens: int) -> FusionPlan:
        summaries = read_summaries(source, prompt)
        plan = plan_recompute(summaries, prompt, self.recompute_ratio, self.knobs.alpha)
        selected = most_contextualised_rows(summaries, prompt, plan.counts)     # [sum(counts)]
        k = len(prompt.chunk_segments)
        scratch = {"plan": plan, "selected": selected, "watching": self.knobs.focus_window is not None and k > 0,
                   "cumulative": torch.zeros(k), "history": [], "cutoff": None, "focus": list(range(k))}
        return FusionPlan(selected, self.positions(prompt), scratch=scratch)

    def records_query_attention(self, state: FusionState, layer: int) -> bool:
        return state.scratch["watching"]

    def after_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        """Algorithm 1: once the focused chunks stay the same for w layers, stop recomputing the others."""
        scratch, prompt = state.scratch, state.prompt
        if not scratch["watching"]:
            return
        scratch["cumulative"] += chunk_attention(state.query_attention[-1], prompt)   # eq. 15
        history, w = scratch["history"], self.knobs.focus_window
        history.append(focused_chunks(scratch["cumulative"]))
        if len(history) >= w and all(f == history[-1] for f in history[-w:]):
            scratch.update(watching=False, cutoff=layer, focus=history[-1])
            if layer + 1 < engine.model.n_layers:  # later layers recompute the focused chunks' tokens only
                spans = prompt.chunk_spans()
                in_focus = torch.zeros(prompt.n_tokens, dtype=torch.bool)
                for i in history[-1]:
                    in_focus[spans[i][0]: spans[i][1]] = True
                active = state.active_chunk_rows()
                engine.keep_rows(state, active[in_focus[active]])

    def finish(self, engine: FusionEngine, state: FusionState, result: FusionResult) -> None:
        plan, scratch = state.scratch["plan"], state.scratch
        result.recomputed_tokens = len(scratch["selected"])
        result.info.update(alpha=plan.alpha, cfo=plan.cfo, cci=plan.cci, beta=plan.beta, gamma=plan.gamma,
                           tokens_per_chunk=plan.counts, focused_chunks=scratch["focus"],
                           focus_cutoff_layer=scratch["cutoff"])
