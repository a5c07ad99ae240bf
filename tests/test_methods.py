"""The fusion methods beyond the baselines: pcw, epic, fusionrag, prophetkv, cachefocus, cachecraft.

Oracles on the embedded model (every method at its recompute-everything setting equals `full`),
exact accounting of recomputed tokens, the selection rules on hand-made tensors, and a check that
the query-attention passes only ever form Q's rows of attention.
"""
import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import tiny_model
from kvf.errors import KvfError
from kvf.pipeline.fusion.engine import FusionEngine, FusionPlan, recompute_budget
from kvf.pipeline.fusion.sources import InMemoryKV
from kvf.pipeline.model.forward import Transformer
from kvf.pipeline.fusion.methods import get_method, method_names
from kvf.pipeline.fusion.methods.cachecraft import (ChunkSummary, cache_context_impact, calibrate_alpha,
                                             chunk_kv_with_summaries, focused_chunks, kendall_tau_distance,
                                             most_contextualised_rows, order_penalty, prefix_overlap, segment_key)
from kvf.pipeline.fusion.methods.cachefocus import allocation_order, assign_positions, chunks_to_keep, position_groups
from kvf.pipeline.fusion.methods.base import all_chunk_rows, chunk_attention, top_rows
from kvf.pipeline.fusion.methods.epic import chunk_initial_rows, spread_budget
from kvf.pipeline.fusion.methods.fusionrag import last_layer_scores, select_chunk_rows
from kvf.pipeline.fusion.methods.pcw import parallel_positions
from kvf.pipeline.fusion.methods.prophetkv import layer_averaged_scores
from kvf.pipeline.model.prompt import FusedPrompt, encode
from kvf.pipeline.model.rope import apply_rope

TOL = 1e-3


def logits_gap(a, b) -> float:
    return (a.logits - b.logits).abs().max().item()


def prefix_kvs_with_summaries(engine, prompt):
    """Each chunk's `prefix` KV and its Cache-Craft summaries, from one prefill after S."""
    kvs, extras = [], []
    for seg in prompt.chunk_segments:
        kv, ex = chunk_kv_with_summaries(engine, seg, prompt.prefix_ids)
        kvs.append(kv)
        extras.append(ex)
    return InMemoryKV(kvs, extras)


def fusion_kvs_with_summaries(engine, prompt, prefix_source):
    """The `fusion` variant: chunk i prefilled after S + the other chunks in reverse prompt order (their
    prefix KVs), so every chunk's build-time context differs from its prompt prefix."""
    s = engine.prefix_kv(prompt.prefix_ids)
    kvs, extras = [], []
    for i, seg in enumerate(prompt.chunk_segments):
        others = [j for j in reversed(range(len(prompt.chunk_segments))) if j != i]
        context_ids = list(prompt.prefix_ids) + [t for j in others for t in prompt.chunk_segments[j]]
        context_kvs = [s] + [prefix_source.chunk_kvs[j] for j in others]
        kv, ex = chunk_kv_with_summaries(engine, seg, context_ids, context_kvs)
        assert (kv - engine.chunk_kv(seg, context_ids, context_kvs)).abs().max().item() <= 1e-5
        kvs.append(kv)
        extras.append(ex)
    return InMemoryKV(kvs, extras)


@pytest.fixture(scope="module")
def case(answerer, short_docs):
    prompt = answerer.prompt([encode(answerer.tokenizer, d) for d in short_docs],
                             "In which province was Zorvan Pellick born?")
    full = get_method("full").prefill(answerer.engine, prompt)
    return prompt, prefix_kvs_with_summaries(answerer.engine, prompt), full


@pytest.fixture(scope="module")
def fusion_source(answerer, case):
    prompt, prefix_source, _ = case
    return fusion_kvs_with_summaries(answerer.engine, prompt, prefix_source)


# ---- oracles on the embedded model -------------------------------------------------------------
def test_summaries_come_with_the_same_kv_as_chunk_kv(answerer, case):
    prompt, source, _ = case
    for seg, kv, ex in zip(prompt.chunk_segments, source.chunk_kvs, source.chunk_extras):
        assert (kv - answerer.engine.chunk_kv(seg, prompt.prefix_ids, None)).abs().max().item() <= 1e-5
        t = len(seg)
        assert ex["cc_inter"].shape == (1, t) and ex["cc_intra"].shape == (t,)
        assert ex["cc_context_keys"].shape == (0,) and list(ex["cc_context_lengths"]) == [prompt.n_prefix]
        # every token's attention is split between S and the chunk's own tokens (itself included)
        assert np.all(ex["cc_inter"][0] + ex["cc_intra"] <= 1 + 1e-5)


@pytest.mark.parametrize("name", ["fusionrag", "cachecraft"])
def test_ratio_one_on_fusion_variant_equals_full(answerer, case, fusion_source, name):
    prompt, _, full = case
    got = get_method(name, recompute_ratio=1.0).prefill(answerer.engine, prompt, fusion_source)
    assert logits_gap(got, full) <= TOL
    assert got.recomputed_tokens == prompt.n_chunk_tokens


def test_fusion_variant_really_differs_from_prefix_variant(case, fusion_source):
    _, prefix_source, _ = case
    for a, b in zip(prefix_source.chunk_kvs, fusion_source.chunk_kvs):
        assert (a - b).abs().max().item() > 1e-2


def test_cachefocus_without_pruning_equals_reuse(answerer, case):
    prompt, source, _ = case
    reuse = get_method("reuse").prefill(answerer.engine, prompt, source)
    for knobs in ({"prune_every": 0}, {"prune_every": 4, "keep_chunks": len(prompt.chunk_segments)}):
        got = get_method("cachefocus", allocation="align", **knobs).prefill(answerer.engine, prompt, source)
        assert logits_gap(got, reuse) <= 1e-5
        assert got.recomputed_tokens == 0 and got.recomputed_token_layers == 0
        assert got.cache.length == prompt.n_tokens


def test_single_chunk_pcw_and_cachefocus_equal_full(answerer, short_docs):
    prompt = answerer.prompt([encode(answerer.tokenizer, short_docs[0])], "Where was Zorvan Pellick born?")
    full = get_method("full").prefill(answerer.engine, prompt)
    source = prefix_kvs_with_summaries(answerer.engine, prompt)
    for name in ("pcw", "cachefocus"):
        got = get_method(name).prefill(answerer.engine, prompt, source)
        assert logits_gap(got, full) <= TOL, name
        assert got.recomputed_tokens == 0


def test_pcw_differs_from_reuse_on_several_chunks(answerer, case):
    prompt, source, _ = case
    reuse = get_method("reuse").prefill(answerer.engine, prompt, source)
    pcw = get_method("pcw").prefill(answerer.engine, prompt, source)
    assert logits_gap(pcw, reuse) > 1e-3
    longest = max(len(c) for c in prompt.chunk_segments)
    assert pcw.next_position == prompt.n_prefix + longest + len(prompt.question_ids)


# ---- accounting and budgets ----------------------------------------------------------------------
def test_epic_spreads_its_budget_over_chunks(case):
    prompt, _, _ = case
    rows = get_method("epic", recompute_ratio=0.2).initial_chunk_rows(prompt)
    per_chunk = [int(((rows >= s) & (rows < e)).sum()) for s, e in prompt.chunk_spans()]
    assert sum(per_chunk) == recompute_budget(0.2, prompt.n_chunk_tokens)
    assert max(per_chunk) - min(per_chunk) <= 1
    for (s, _), c in zip(prompt.chunk_spans(), per_chunk):  # chunk-initial tokens
        assert torch.equal(rows[(rows >= s) & (rows < s + c)], torch.arange(s, s + c))


@pytest.mark.parametrize("ratio", [0.15, 0.3, 0.5])
def test_cachecraft_budget_within_one_token_per_chunk(answerer, case, fusion_source, ratio):
    prompt, _, _ = case
    got = get_method("cachecraft", recompute_ratio=ratio).prefill(answerer.engine, prompt, fusion_source)
    k = len(prompt.chunk_segments)
    assert abs(got.recomputed_tokens - ratio * prompt.n_chunk_tokens) <= k
    assert got.recomputed_tokens == sum(got.info["tokens_per_chunk"])
    assert got.recomputed_token_layers == got.recomputed_tokens * answerer.transformer.n_layers
    for count, cfo, (s, e) in zip(got.info["tokens_per_chunk"], got.info["cfo"], prompt.chunk_spans()):
        assert count == math.ceil(cfo * (e - s) - 1e-9)


def test_cachecraft_alpha_knob_and_focus_window(answerer, case, fusion_source):
    prompt, _, _ = case
    n_layers = answerer.transformer.n_layers
    fixed = get_method("cachecraft", alpha=0.5).prefill(answerer.engine, prompt, fusion_source)
    assert fixed.info["alpha"] == 0.5
    assert all(0 <= c <= 0.5 for c in fixed.info["cfo"])
    focus = get_method("cachecraft", recompute_ratio=0.3, focus_window=2).prefill(answerer.engine, prompt, fusion_source)
    cut = focus.info["focus_cutoff_layer"]
    assert cut is not None and cut >= 1
    kept = sum(n for i, n in enumerate(focus.info["tokens_per_chunk"]) if i in focus.info["focused_chunks"])
    assert focus.recomputed_token_layers == focus.recomputed_tokens * (cut + 1) + kept * (n_layers - cut - 1)


def test_cachefocus_prunes_and_decodes_from_the_kept_chunks(answerer, case):
    prompt, source, _ = case
    method = get_method("cachefocus", prune_every=4, keep_chunks=2, allocation="sort")
    got = answerer.answer(prompt, method, source, max_new_tokens=6)
    kept = got.fused.info["kept_chunks"]
    assert len(kept) == 2 and got.fused.recomputed_tokens == 0
    pruned_rows = sum(len(prompt.chunk_segments[i]) for i in range(3) if i not in kept)
    generated = got.fused.cache.length - (prompt.n_tokens - pruned_rows)  # the pruned rows are gone for decoding
    assert 0 <= generated < 6
    assert got.fused.next_position <= prompt.n_tokens
    assert get_method("cachefocus").kept_count(5) == 3  # default keeps ceil(k / 2)


def test_cachecraft_without_summaries_is_refused(answerer, case):
    prompt, source, _ = case
    with pytest.raises(KvfError, match="--extras-for cachecraft"):
        get_method("cachecraft").prefill(answerer.engine, prompt, InMemoryKV(source.chunk_kvs))


# ---- selection rules on hand-made tensors --------------------------------------------------------
def toy_prompt(prefix=2, chunks=(3, 4, 5), question=2) -> FusedPrompt:
    ids = iter(range(1000))
    return FusedPrompt([next(ids) for _ in range(prefix)], [[next(ids) for _ in range(t)] for t in chunks],
                       [next(ids) for _ in range(question)])


def test_kvfuse_sinks_after_top_go_to_the_chunks_after_the_most_attended_ones():
    """sinks_after_top = N: the first tokens of the chunk right after each of the N chunks whose rows hold the most
    question attention (where a fact the question reads runs on past the boundary), not of every chunk."""
    from kvf.pipeline.fusion.methods.kvfuse import sink_rows
    prompt = toy_prompt(prefix=2, chunks=(3, 4, 5, 3), question=2)   # chunk rows 2-4, 5-8, 9-13, 14-16
    scores = torch.zeros(prompt.n_tokens)
    scores[5:9] = 0.5                                                 # chunk 1 the most attended
    scores[14:17] = 0.2                                               # chunk 3 (the last: nothing after it) next
    assert sink_rows(prompt, 2, budget=100).tolist() == [2, 3, 5, 6, 9, 10, 14, 15]      # every chunk
    assert sink_rows(prompt, 2, 100, after_top=1, scores=scores).tolist() == [9, 10]     # after chunk 1
    assert sink_rows(prompt, 2, 100, after_top=2, scores=scores).tolist() == [9, 10]     # chunk 3 has no successor
    assert sink_rows(prompt, 2, 100, after_top=3, scores=scores).tolist() == [5, 6, 9, 10]  # ties: the earlier, chunk 0
    assert sink_rows(prompt, 2, 1, after_top=1, scores=scores).tolist() == [9]          # cut to the budget


def test_prophetkv_uses_the_layer_average_and_fusionrag_the_last_layer():
    prompt = toy_prompt()                                   # chunk rows 2..13, n = 16
    n = prompt.n_tokens
    layers = [torch.zeros(n) for _ in range(3)]
    layers[0][4], layers[1][4] = 0.9, 0.9                   # row 4: strong in the first two layers
    layers[2][10] = 0.5                                     # row 10: strongest in the last layer only
    layers[2][0] = 0.9                                      # S is never selected, however attended
    assert torch.equal(select_chunk_rows(layer_averaged_scores(layers), prompt, 1), torch.tensor([4]))
    assert torch.equal(select_chunk_rows(last_layer_scores(layers), prompt, 1), torch.tensor([10]))
    assert torch.allclose(get_method("prophetkv").token_scores(layers), torch.stack(layers).mean(0))
    assert torch.equal(get_method("fusionrag").token_scores(layers), layers[2])
    assert get_method("fusionrag").scored_layers(30) == [29]
    assert get_method("prophetkv").scored_layers(3) == [0, 1, 2]
    assert get_method("fusionrag").offline_variant == "fusion" and get_method("prophetkv").offline_variant == "prefix"


def test_epic_picks_chunk_initial_tokens():
    assert spread_budget(10, [5, 5, 5]) == [4, 3, 3]          # remainder to the first chunks
    assert spread_budget(10, [1, 8, 8]) == [1, 5, 4]          # a short chunk's leftover goes to the others
    assert spread_budget(99, [2, 3]) == [2, 3]
    assert spread_budget(0, [2, 3]) == [0, 0]
    prompt = toy_prompt()
    assert chunk_initial_rows(prompt, [2, 1, 3]).tolist() == [2, 3, 5, 9, 10, 11]


def test_pcw_positions_restart_at_prefix_for_every_chunk():
    assert parallel_positions(2, [3, 4], 2).tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7]
    pcw = get_method("pcw").positions(toy_prompt())
    assert pcw.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7, 8]


def test_cachefocus_align_closes_gaps_and_sort_puts_the_most_attended_next_to_q():
    prompt = toy_prompt()                                    # S 0-1, C0 rows 2-4, C1 5-8, C2 9-13, Q 14-15
    start = assign_positions(prompt, [0, 1, 2], room=100)
    assert torch.equal(start, torch.arange(16))              # contiguous = reuse
    aligned = assign_positions(prompt, [0, 2], room=100, previous=start)
    assert aligned[2:5].tolist() == [2, 3, 4] and aligned[9:14].tolist() == [5, 6, 7, 8, 9]
    assert aligned[14:].tolist() == [10, 11]                 # Q right after the kept chunks
    assert aligned[5:9].tolist() == [5, 6, 7, 8]             # the pruned chunk is left where it was
    scores = torch.tensor([0.5, 0.1, 0.9])
    assert allocation_order([0, 1, 2], scores, "align") == [0, 1, 2]
    assert allocation_order([0, 1, 2], scores, "sort") == [1, 0, 2]
    assert allocation_order([2, 0], torch.tensor([0.9, 0.0, 0.1]), "sort") == [2, 0]
    ordered = assign_positions(prompt, allocation_order([0, 2], torch.tensor([0.9, 0.0, 0.1]), "sort"), room=100)
    assert ordered[9:14].tolist() == [2, 3, 4, 5, 6] and ordered[2:5].tolist() == [7, 8, 9]  # C0 nearest Q
    assert ordered[14:].tolist() == [10, 11]
    assert chunks_to_keep([0, 1, 2], scores, 2) == [0, 2]


def test_cachefocus_groups_positions_when_the_chunks_exceed_the_range():
    assert position_groups([0, 1, 2], [4, 4, 4], room=12) == [[0, 1, 2]]       # fits: one group
    assert position_groups([0, 1, 2, 3, 4], [4] * 5, room=10) == [[0, 1], [2, 3], [4]]  # ceil(5 / (10 // 4)) = 3
    prompt = toy_prompt(prefix=2, chunks=(4, 4, 4, 4, 4), question=2)
    positions = assign_positions(prompt, list(range(5)), room=10)
    assert positions[2:6].tolist() == [2, 3, 4, 5] and positions[10:14].tolist() == [2, 3, 4, 5]
    assert positions[6:10].tolist() == [6, 7, 8, 9] and positions[14:18].tolist() == [6, 7, 8, 9]
    assert positions[18:22].tolist() == [2, 3, 4, 5]                           # the third group
    assert positions[-2:].tolist() == [10, 11]                                 # after the longest group
    with pytest.raises(KvfError, match="--chunk-tokens"):
        position_groups([0], [11], room=10)


def test_cachecraft_order_penalty_and_prefix_overlap():
    a, b, c = 11, 22, 33
    assert order_penalty([a, b, c], [c, b, a]) == 1.0          # reversed
    assert order_penalty([a, b, c], [a, b, c]) == 0.0          # same order
    assert kendall_tau_distance([a, b, c], [b, a, c]) == pytest.approx(1 / 3)
    assert order_penalty([a, b], [b, 99, a]) == 1.0            # only the common chunks count
    assert order_penalty([a], [a]) == 0.0
    weights = np.array([3.0, 1.0])                             # attention to old context chunks a, b
    assert prefix_overlap(weights, [a, b], [a]) == pytest.approx(0.75)
    assert prefix_overlap(weights, [a, b], [b, a, c]) == pytest.approx(1.0)
    assert prefix_overlap(weights, [a, b], []) == 0.0
    assert prefix_overlap(np.zeros(0), [], []) == 1.0          # prefix variant, first chunk: exact
    assert prefix_overlap(np.zeros(0), [], [a]) == 0.0         # prefix variant, later chunk
    assert segment_key([1, 2, 3]) == segment_key([1, 2, 3]) != segment_key([1, 2, 4])


def test_cachecraft_cci_alpha_and_token_ranking():
    def summary(outside, own):
        return ChunkSummary(np.array([outside], dtype=np.float32), np.array(own, dtype=np.float32),
                            np.array([4]), np.zeros(0, dtype=np.int64))
    self_contained = summary([0.1, 0.1, 0.1], [0.0, 0.9, 0.9])
    contextualised = summary([0.9, 0.8, 0.9], [0.0, 0.1, 0.1])
    assert 0.5 <= cache_context_impact(self_contained) < cache_context_impact(contextualised) <= 1.0
    x, lengths = np.array([0.2, 0.8, 0.0]), np.array([10.0, 10.0, 10.0])
    alpha = calibrate_alpha(x, lengths, 0.25)
    assert (np.minimum(1, alpha * x) * lengths).sum() == pytest.approx(7.5, abs=1e-6)
    assert calibrate_alpha(x, lengths, 1.0) == pytest.approx(5.0)  # x = 0 chunk can never be recomputed
    prompt = toy_prompt(chunks=(3,))
    rows = most_contextualised_rows([contextualised], prompt, [2])
    assert rows.tolist() == [2, 4]                             # the two tokens most attending outside


def test_cachecraft_focused_chunks_change_point():
    assert focused_chunks(torch.tensor([10.0, 1.0, 0.9, 0.8])) == [0]
    assert focused_chunks(torch.tensor([1.0, 10.0, 0.5, 9.0])) == [1, 3]
    assert focused_chunks(torch.tensor([2.0, 1.0])) == [0, 1]        # too few chunks for a change point
    assert focused_chunks(torch.tensor([1.0, 1.0, 1.0])) == [0, 1, 2]


# ---- knobs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,knobs,flag", [
    ("cachefocus", {"prune_every": -1}, "--prune-every"), ("cachefocus", {"keep_chunks": 0}, "--keep-chunks"),
    ("cachefocus", {"allocation": "middle"}, "--allocation"), ("cachecraft", {"alpha": -1.0}, "--alpha"),
    ("cachecraft", {"focus_window": 0}, "--focus-window"), ("epic", {"recompute_ratio": 2.0}, "--ratio"),
    ("fusionrag", {"recompute_ratio": -0.5}, "--ratio"), ("prophetkv", {"recompute_ratio": 1.5}, "--ratio"),
    ("cachecraft", {"recompute_ratio": 1.1}, "--ratio"), ("kvfuse", {"deviation_share": 1.5}, "--deviation-share")])
def test_bad_knobs_are_refused_naming_the_flag(name, knobs, flag):
    with pytest.raises(KvfError, match=flag):
        get_method(name, **knobs)


def test_settings_record_the_knobs():
    assert get_method("cachefocus", prune_every=2, keep_chunks=3, allocation="sort").settings() == {
        "ratio": 0.0, "prune_every": 2, "keep_chunks": 3, "allocation": "sort"}
    assert get_method("cachecraft", recompute_ratio=0.2, alpha=0.7, focus_window=3).settings() == {
        "ratio": 0.2, "alpha": 0.7, "focus_window": 3}
    for name in method_names():
        assert "ratio" in get_method(name).settings()


# ---- tiny models: every family, engine helpers, attention shapes --------------------------------
def tiny_case(family, seed=3):
    engine = FusionEngine(Transformer(tiny_model(family, seed=seed)))
    g = torch.Generator().manual_seed(1)
    prompt = FusedPrompt(prefix_ids=torch.randint(0, 128, (5,), generator=g).tolist(),
                         chunk_segments=[torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 14, 7)],
                         question_ids=torch.randint(0, 128, (6,), generator=g).tolist())
    return engine, prompt, prefix_kvs_with_summaries(engine, prompt)


def test_restart_equals_a_fresh_start_with_the_same_rows():
    """FusionRAG's pass 2 on pass 1's state equals one pass recomputing the selected rows from scratch."""
    engine, prompt, source = tiny_case("llama")
    L = engine.model.n_layers
    budget = recompute_budget(0.3, prompt.n_chunk_tokens)
    state = engine.start(prompt, source, FusionPlan(torch.empty(0, dtype=torch.long)))
    for layer in range(L):
        engine.step(state, layer, record_query_attention=layer == L - 1)
    selected = select_chunk_rows(state.query_attention[-1], prompt, budget)
    fresh = engine.start(prompt, source, FusionPlan(selected))
    for layer in range(L):
        engine.step(fresh, layer)
    got = get_method("fusionrag", recompute_ratio=0.3).prefill(engine, prompt, source)
    expected = engine.model.logits(fresh.hidden[-1:])[0]
    assert (got.logits - expected).abs().max().item() <= 1e-5
    assert torch.allclose(got.cache.kv, fresh.cache.kv, atol=1e-5)


def test_reposition_rotates_every_computed_layer_exactly():
    engine, prompt, source = tiny_case("llama3rope")
    state = engine.start(prompt, source, FusionPlan(torch.empty(0, dtype=torch.long)))
    for layer in range(engine.model.n_layers):
        engine.step(state, layer)
    new_positions = torch.arange(prompt.n_tokens) + 100
    new_positions[: prompt.n_prefix] = torch.arange(prompt.n_prefix)       # S never moves
    engine.reposition(state, new_positions)
    cos, sin = engine.model.rope.cos_sin(new_positions)
    for layer in range(engine.model.n_layers):
        for i, (s, e) in enumerate(prompt.chunk_spans()):
            stored = source.chunk_kvs[i][layer, 0]                          # [KV, t, d] before RoPE
            direct = apply_rope(stored, cos[s:e], sin[s:e])
            assert (state.cache.kv[layer, 0][:, s:e] - direct).abs().max().item() <= 1e-4
    assert torch.equal(state.positions, new_positions)


def test_cachefocus_fits_prompts_longer_than_the_position_range():
    engine, prompt, source = tiny_case("llama")
    engine.model.max_positions = 30                                         # 41 rows, 30 positions
    with pytest.raises(KvfError, match="positions"):
        get_method("reuse").prefill(engine, prompt, source)
    got = get_method("cachefocus", prune_every=0).prefill(engine, prompt, source, max_new_tokens=2)
    assert got.next_position + 2 <= 30 and torch.isfinite(got.logits).all()


class ShapeRecorder(TorchFunctionMode):
    """Records the shape of every tensor an op returns, and of every SDPA query."""

    def __init__(self):
        super().__init__()
        self.shapes, self.attention_queries = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.attention_queries.append(args[0].shape[-2])
        if isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("name,knobs", [("fusionrag", {"recompute_ratio": 0.25}), ("prophetkv", {"recompute_ratio": 0.25}),
                                        ("cachefocus", {"prune_every": 1, "keep_chunks": 2}),
                                        ("cachecraft", {"recompute_ratio": 0.25, "focus_window": 1})])
def test_query_attention_forms_only_the_question_rows(name, knobs):
    engine, prompt, source = tiny_case("llama")
    n, nq, L = prompt.n_tokens, len(prompt.question_ids), engine.model.n_layers
    method = get_method(name, **knobs)
    engine.prefix_kv(prompt.prefix_ids)  # S's KV is computed once per engine; not part of the fusion
    with ShapeRecorder() as rec:
        got = method.prefill(engine, prompt, source)
    assert not any(len(s) >= 2 and s[-2:] == (n, n) for s in rec.shapes)        # never an n x n matrix
    assert (engine.model.n_heads, nq, n) in rec.shapes                          # Q's rows: [H, |Q|, n]
    active = nq + got.recomputed_tokens
    if name in ("fusionrag", "prophetkv"):   # pass 1: Q only; pass 2: the selected rows + Q
        assert rec.attention_queries == [nq] * L + [active] * L
    elif name == "cachefocus":
        assert rec.attention_queries == [nq] * L
    else:
        assert rec.attention_queries[0] == active and max(rec.attention_queries) == active


@pytest.fixture(scope="module")
def long_case(answerer):
    """Three chunks of ~350 tokens (15% of a chunk is then tens of rows, as on real passages), with the
    `prefix` KVs kvfuse reads (no Cache-Craft summaries: kvfuse never reads them)."""
    from kvf.pipeline.data.synthetic import make_synthetic
    texts = [p.text for q in make_synthetic(None, n_questions=3, passages_per_question=2, seed=3) for p in q.contexts]
    chunks = [" ".join(texts[i: i + 2]) for i in range(0, 6, 2)]
    prompt = answerer.prompt([encode(answerer.tokenizer, c) for c in chunks], make_synthetic(None, 1)[0].question)
    source = InMemoryKV([answerer.engine.chunk_kv(seg, prompt.prefix_ids, None) for seg in prompt.chunk_segments])
    return prompt, source, get_method("full").prefill(answerer.engine, prompt)


@pytest.fixture(scope="module")
def kvfuse_long(answerer, long_case):
    """kvfuse at 15% on long_case: one prefill per knob set, however many tests ask for it."""
    prompt, source, _ = long_case
    runs = {}

    def run(**knobs):
        key = tuple(sorted(knobs.items()))
        if key not in runs:
            runs[key] = get_method("kvfuse", 0.15, **knobs).prefill(answerer.engine, prompt, source)
        return runs[key]
    return run


@pytest.mark.parametrize("propagate", ["after", "before"])
def test_kvfuse_propagation_moves_kept_rows_towards_full_prefill(long_case, kvfuse_long, propagate):
    """kvfuse shifts each chunk's kept rows by the mean K/V move of its recomputed rows: the chunk rows
    of the fused cache end nearer full prefill's (all layers together); with `after` the recomputed
    rows are untouched (the shift is seen by decoding only), with `before` they see it too."""
    prompt, source, full = long_case
    rows = torch.arange(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens)
    want = full.cache.kv[:, :, :, rows]                                          # [L, 2, KV, n, d]
    got = {"off": kvfuse_long(propagate="off"), propagate: kvfuse_long(propagate=propagate, propagate_from=0.33)}
    error = {p: ((r.cache.kv[:, :, :, rows] - want).norm() / want.norm()).item() for p, r in got.items()}
    assert error[propagate] < error["off"], error
    first = round(0.33 * want.shape[0])
    assert torch.equal(got["off"].cache.kv[:first], got[propagate].cache.kv[:first])  # propagate_from
    if propagate == "after":
        assert torch.equal(got["off"].logits, got["after"].logits)


@pytest.mark.parametrize("estimate", ["james-stein", "kernel"])
def test_kvfuse_shift_estimates_move_kept_rows_towards_full_prefill(long_case, kvfuse_long, estimate):
    """The other estimates of a kept row's move (the mean shrunk by the rows' spread, the moves weighted
    by stored-key similarity) also bring the chunk rows nearer full prefill than no shift, and are not
    the plain mean."""
    prompt, source, full = long_case
    rows = torch.arange(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens)
    want = full.cache.kv[:, :, :, rows]                                          # [L, 2, KV, n, d]
    runs = {"off": dict(propagate="off"), "mean": dict(), estimate: dict(shift_estimate=estimate)}
    got = {name: kvfuse_long(**knobs) for name, knobs in runs.items()}
    error = {name: ((r.cache.kv[:, :, :, rows] - want).norm() / want.norm()).item() for name, r in got.items()}
    assert error[estimate] < error["off"], error
    assert not torch.equal(got[estimate].cache.kv, got["mean"].cache.kv)


@pytest.mark.parametrize("parts", ["k", "v"])
def test_kvfuse_shift_parts(parts):
    """shift_parts moves only K or only V of the kept rows. With the shift after each layer's attention
    no recomputed row ever reads a shifted row, so the other part of the cache equals no shift exactly."""
    engine, prompt, source = tiny_case("llama")
    got = {p: get_method("kvfuse", 0.3, propagate=p, shift_parts=parts).prefill(engine, prompt, source).cache.kv
           for p in ("off", "after")}                                            # [L, 2, KV, n, d]
    moved, still = (0, 1) if parts == "k" else (1, 0)
    assert torch.equal(got["off"][:, still], got["after"][:, still])
    assert not torch.allclose(got["off"][:, moved], got["after"][:, moved])


def test_kvfuse_key_shift_scale():
    """key_shift_scale = c moves the kept rows' keys by c x the key move (RoPE is linear, so c x the default's key
    change over no shift) and their values by the whole move; 1 is the default bit for bit, 0 leaves the keys as
    no shift has them, and at ratio 1 (no kept row) it is full prefill."""
    engine, prompt, source = tiny_case("llama")
    kv = {c: get_method("kvfuse", 0.3, key_shift_scale=c).prefill(engine, prompt, source).cache.kv
          for c in (0.0, 0.5, 1.0)}                                              # [L, 2, KV, n, d]
    off = get_method("kvfuse", 0.3, propagate="off").prefill(engine, prompt, source).cache.kv
    default = get_method("kvfuse", 0.3).prefill(engine, prompt, source).cache.kv
    assert torch.equal(kv[1.0], default) and torch.equal(kv[0.0][:, 0], off[:, 0])
    assert torch.equal(kv[0.5][:, 1], default[:, 1]) and not torch.equal(default[:, 0], off[:, 0])
    assert torch.allclose(kv[0.5][:, 0] - off[:, 0], 0.5 * (default[:, 0] - off[:, 0]), atol=1e-5)
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(get_method("kvfuse", 1.0, key_shift_scale=0.5).prefill(engine, prompt, source), full) <= TOL


def test_kvfuse_key_shift_by_attention(monkeypatch):
    """key_shift_by_attention: each kept row's key moves by (its attention / the budget's cut, at most 1) x the
    default's key move (RoPE is linear), its value by the whole move; at ratio 1 it is full prefill."""
    import kvf.pipeline.fusion.methods.kvfuse as kvfuse_file
    weights = kvfuse_file.attention_over_cut(torch.tensor([9.0, 4.0, 2.0, 1.0, 0.5]), torch.tensor([1, 2, 3, 4]), 2)
    assert torch.allclose(weights, torch.tensor([1.0, 1.0, 1.0, 0.5, 0.25]))   # cut: the 2nd highest chunk row, 2
    engine, prompt, source = tiny_case("llama")
    seen = {}
    pick = kvfuse_file.KvFuse.next_pass_rows
    def logged(self, engine, state):
        rows = pick(self, engine, state)
        seen.update({k: state.scratch[k] for k in ("key_weight", "selected") if k in state.scratch})
        return rows
    monkeypatch.setattr(kvfuse_file.KvFuse, "next_pass_rows", logged)
    weighted = get_method("kvfuse", 0.3, key_shift_by_attention=True).prefill(engine, prompt, source).cache.kv
    weight = seen["key_weight"]                                                    # [n]
    assert torch.all(weight[seen["selected"]] == 1) and 0 < weight[all_chunk_rows(prompt)].min() < 1
    off = get_method("kvfuse", 0.3, propagate="off").prefill(engine, prompt, source).cache.kv
    default = get_method("kvfuse", 0.3).prefill(engine, prompt, source).cache.kv   # [L, 2, KV, n, d]
    assert torch.equal(weighted[:, 1], default[:, 1]) and not torch.allclose(weighted[:, 0], default[:, 0], atol=1e-5)
    assert torch.allclose(weighted[:, 0] - off[:, 0], weight[None, None, :, None] * (default[:, 0] - off[:, 0]),
                          atol=1e-5)
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(get_method("kvfuse", 1.0, key_shift_by_attention=True).prefill(engine, prompt, source),
                      full) <= TOL


def test_kvfuse_hop_records_the_top_rows_attention_and_leaves_no_trace(monkeypatch):
    """hop_rows: the question's top chunk rows, computed alone over the stored cache, record their attention. With
    one chunk stored after S (its stored KV is full prefill's) that is full prefill's attention of those rows. The
    hop's pass leaves no trace: at hop_weight 0, its pass forced (without hop_after it would have none), kvfuse is the
    default bit for bit, also where the stored rows are copied before pass 2 overwrites them (as on an accelerator).
    At ratio 1 it is full prefill."""
    import kvf.pipeline.fusion.engine as fusion_engine
    import kvf.pipeline.fusion.methods.kvfuse as kvfuse_file
    engine, prompt, source = tiny_case("llama")
    seen = {}
    end = kvfuse_file.KvFuse.end_hop
    def logged(self, state):
        seen["rows"] = state.scratch["hop_seeds"]
        seen["attention"] = end(self, state)
        return seen["attention"]
    monkeypatch.setattr(kvfuse_file.KvFuse, "end_hop", logged)
    one = FusedPrompt(prompt.prefix_ids, prompt.chunk_segments[1:2], prompt.question_ids)
    get_method("kvfuse", 0.3, hop_rows=3, hop_weight=1.0).prefill(engine, one, prefix_kvs_with_summaries(engine, one))
    per_layer = []                                                                 # [n, n] each
    engine.model.prefill(one.all_ids(), engine.model.new_cache(one.n_tokens), attention_out=per_layer)
    expected = torch.stack([attention[seen["rows"]].mean(dim=0) for attention in per_layer]).mean(dim=0)   # [n]
    assert len(seen["rows"]) == 3 and torch.allclose(seen["attention"], expected, atol=1e-5)
    band = {"hop_seeds": "band", "locate_from": 0.6, "locate_to": 0.85}        # seeds ranked by the band's layers
    monkeypatch.setattr(kvfuse_file.KvFuse, "runs_hop", property(lambda self: bool(self.knobs.hop_rows)))
    for copied, seeds in ((False, {}), (True, {}), (False, band)):
        monkeypatch.setattr(fusion_engine, "COPY_STORED_ROWS_ON_CPU", copied)
        hop = get_method("kvfuse", 0.3, hop_rows=4, hop_weight=0.0, **seeds).prefill(engine, prompt, source)
        default = get_method("kvfuse", 0.3).prefill(engine, prompt, source)
        assert torch.equal(hop.logits, default.logits) and torch.equal(hop.cache.kv, default.cache.kv), (copied, seeds)
        assert hop.recomputed_tokens == default.recomputed_tokens
        assert hop.recomputed_token_layers == default.recomputed_token_layers + 4 * engine.model.n_layers
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(get_method("kvfuse", 1.0, hop_rows=4).prefill(engine, prompt, source), full) <= TOL


def test_kvfuse_hop_pass_computes_its_rows_alone(monkeypatch):
    """The hop's pass runs only its rows (a chunk row never attends to Q, and pass 2 computes Q afresh); the passes
    around it run Q's rows too. The test above holds its attention to full prefill's."""
    engine, prompt, source = tiny_case("llama")
    passes = []
    restart = FusionEngine.restart
    def logged(self, state, rows, pass_index, **kwargs):
        restart(self, state, rows, pass_index, **kwargs)
        passes.append(state.rows.clone())
    monkeypatch.setattr(FusionEngine, "restart", logged)
    get_method("kvfuse", 0.3, hop_rows=3).prefill(engine, prompt, source)
    hop, recompute = passes
    question = set(prompt.question_rows().tolist())
    assert len(hop) == 3 and not set(hop.tolist()) & question
    assert question <= set(recompute.tolist())


def test_the_hop_probe_traces_the_rows_kvfuse_recomputes():
    """scripts/hop_probe.py counts where kvfuse's budget and the hop's seeds fall: what it traces must be what kvfuse
    does (the seeds are the rows the hop's pass computes, the budget is the rows pass 2 recomputes, the same logits),
    and its shares must place rows in the right chunks."""
    from kvf.pipeline.fusion.methods.base import all_chunk_rows
    from kvf.scripts.hop_probe import Tracing, in_facts, mass_on
    engine, prompt, source = tiny_case("llama")
    knobs = {"hop_rows": 3, "hop_weight": 1.0, "hop_seeds": "band", "locate_from": 0.6, "locate_to": 0.85}
    traced = Tracing(0.3, **knobs)
    result = traced.prefill(engine, prompt, source)
    assert torch.equal(result.logits, get_method("kvfuse", 0.3, **knobs).prefill(engine, prompt, source).logits)
    assert len(traced.seeds) == 3 and len(traced.selected) == result.recomputed_tokens
    assert traced.hop.shape == (prompt.n_tokens,)
    spans, chunk_rows = prompt.chunk_spans(), all_chunk_rows(prompt)          # chunks of 9, 14 and 7 rows
    assert in_facts(chunk_rows, prompt, {1}) == pytest.approx(14 / 30)
    assert in_facts(torch.arange(*spans[2]), prompt, {2}) == 1.0 and in_facts(torch.arange(*spans[2]), prompt, {0, 1}) == 0.0
    scores = torch.zeros(prompt.n_tokens)
    scores[spans[0][0]], scores[spans[2][0] + 1], scores[0] = 1.0, 3.0, 5.0          # the prefix's row is not a chunk's
    assert mass_on(scores, prompt, {2}) == pytest.approx(0.75)


def test_the_read_probe_records_the_last_pass_and_at_ratio_1_it_is_full_prefills_read():
    """scripts/read_probe.py: the question's attention in kvfuse's last pass; at ratio 1 every chunk row is recomputed,
    so it must be what one pass computing every row from scratch (full prefill) records, layer by layer."""
    from kvf.scripts.read_probe import Reading
    engine, prompt, source = tiny_case("llama")
    L = engine.model.n_layers
    full = engine.start(prompt, source, FusionPlan(all_chunk_rows(prompt)))
    for layer in range(L):
        engine.step(full, layer, record_query_attention=True)
    want = torch.stack(full.query_attention)                                    # [L, n]
    at_one = Reading(1.0, sink_tokens=2, sinks_after_top=1, locate_from=0.6, locate_to=0.85)
    at_one.prefill(engine, prompt, source)
    assert at_one.read.shape == (L, prompt.n_tokens)
    torch.testing.assert_close(at_one.read, want.float(), atol=1e-5, rtol=1e-4)
    partial = Reading(0.3)
    partial.prefill(engine, prompt, source)
    assert not torch.allclose(partial.read, want.float(), atol=1e-5, rtol=1e-4)  # 30%: another cache, another read


def test_teacher_forced_reads_are_those_of_one_prefill_of_prompt_and_answer():
    """teacher_forced_logits' attention_out (the value probe's read): feeding an answer over full prefill's cache must
    read, layer by layer, as one ordinary prefill of prompt and answer together does at the same rows."""
    from kvf.pipeline.model.decode import teacher_forced_logits
    engine, prompt, _ = tiny_case("llama")
    model, ids, answer = engine.model, prompt.all_ids(), [7, 99, 3, 41]
    n, k = len(ids), 3                                                           # the read of the 3rd fed token
    whole, want = model.new_cache(n + len(answer)), []
    model.prefill(torch.cat([ids, torch.tensor(answer[:-1])]), whole, attention_out=want)     # per layer [n + 3, n + 3]
    cache = model.new_cache(n + len(answer))
    first, _ = model.prefill(ids, cache)
    got = []
    with torch.inference_mode():
        logits = teacher_forced_logits(model, first[None], cache, n, n, answer, attention_out=got,
                                       attention_rows=slice(k - 1, k))
    assert len(got) == model.n_layers and logits.shape[0] == len(answer)
    for layer in range(model.n_layers):                                         # [1, n + 3] each
        torch.testing.assert_close(got[layer][0], want[layer][n + k - 1], atol=1e-5, rtol=1e-4)


def test_the_value_probe_finds_the_step_that_writes_the_value():
    from kvf.scripts.value_probe import value_step
    pieces = {1: "The number", 2: " is", 3: " 7", 4: "04", 5: "6.", 6: "7"}
    decode = lambda ids: "".join(pieces[i] for i in ids)                         # noqa: E731
    assert value_step([1, 2, 3, 4, 5], decode, "7046") == 2                     # " 7" writes its first character
    assert value_step([1, 2, 5], decode, "7046") is None                         # not spelt
    assert value_step([6, 4, 5], decode, "7046") is None                         # from the first token: read_probe's


def test_the_value_probes_oracles_recompute_the_chunks_they_name_whole_beside_their_own_rows():
    """--fact-chunks-whole and --rest-whole: the entry's own rows and every row of the fact chunks (or of every other
    chunk) are recomputed, over its budget."""
    from kvf.scripts.hop_probe import Tracing
    from kvf.scripts.value_probe import ORACLES, ChunksWhole

    class TracedOracle(Tracing, ChunksWhole):
        pass

    engine, prompt, source = tiny_case("llama")
    spans = prompt.chunk_spans()
    plain = Tracing(0.2)
    plain.prefill(engine, prompt, source)
    for flag, want_chunks in (("fact_chunks_whole", {1}), ("rest_whole", set(range(len(spans))) - {1})):
        oracle = TracedOracle(0.2)
        oracle.whole = ORACLES[flag][1]({1}, len(spans))
        assert oracle.whole == want_chunks, flag
        result = oracle.prefill(engine, prompt, source)
        whole_rows = {r for i in want_chunks for r in range(*spans[i])}
        assert not whole_rows <= set(plain.selected.tolist()), flag              # the entry alone leaves some
        assert set(oracle.selected.tolist()) == set(plain.selected.tolist()) | whole_rows, flag
        assert result.recomputed_tokens == len(oracle.selected), flag


def test_kvfuse_hop_after_buys_the_hop_rows_and_the_rows_after_them():
    """hop_after=N: each of the hop's rows and the N rows after it in its chunk are bought first, after the sinks;
    the window stops at its chunk's end. At ratio 1 it is full prefill."""
    from kvf.pipeline.fusion.methods.kvfuse import rows_after
    from kvf.scripts.hop_probe import Tracing
    two = FusedPrompt([1, 2], [[3] * 5, [4] * 4], [5, 6])                       # chunk rows 2-6 and 7-10
    assert rows_after(torch.tensor([2, 5, 6, 8]), two, 2).tolist() == [2, 3, 4, 5, 6, 8, 9, 10]
    # hop_after_crosses: the window runs on into the next chunk (a value cut off at a chunk's end), never into Q
    assert rows_after(torch.tensor([6]), two, 2).tolist() == [6]
    assert rows_after(torch.tensor([6]), two, 2, crosses=True).tolist() == [6, 7, 8]
    assert rows_after(torch.tensor([2, 5, 6, 8]), two, 2, crosses=True).tolist() == list(range(2, 11))
    assert rows_after(torch.tensor([9]), two, 5, crosses=True).tolist() == [9, 10]          # Q's rows 11-12: no
    engine, prompt, source = tiny_case("llama")
    default = get_method("kvfuse", 0.3).prefill(engine, prompt, source)
    for knobs in ({"hop_weight": 0.0}, {"hop_weight": 1.0, "hop_seeds": "band", "locate_from": 0.6, "locate_to": 0.85}):
        traced = Tracing(0.3, hop_rows=2, hop_after=2, **knobs)
        result = traced.prefill(engine, prompt, source)
        after = rows_after(traced.seeds, prompt, 2)
        assert set(after.tolist()) <= set(traced.selected.tolist()), knobs
        plain = Tracing(0.3, **{k: v for k, v in knobs.items() if k != "hop_weight"},
                        **({"hop_rows": 2} if knobs["hop_weight"] else {}))
        plain.prefill(engine, prompt, source)
        assert not set(after.tolist()) <= set(plain.selected.tolist()), knobs     # bought because of hop_after
        assert result.recomputed_tokens == recompute_budget(0.3, prompt.n_chunk_tokens)
    assert traced.passes == 3 and Tracing(0.3, hop_rows=2, hop_weight=0.0, hop_after=2).passes == 2
    no_pass = get_method("kvfuse", 0.3, hop_rows=2, hop_weight=0.0, hop_after=2).prefill(engine, prompt, source)
    assert no_pass.recomputed_token_layers == default.recomputed_token_layers      # at w = 0 the rows get no pass
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(get_method("kvfuse", 1.0, hop_rows=2, hop_after=3).prefill(engine, prompt, source), full) <= TOL
    crossing = get_method("kvfuse", 1.0, hop_rows=2, hop_after=3, hop_after_crosses=True)
    assert logits_gap(crossing.prefill(engine, prompt, source), full) <= TOL


def test_kvfuse_hop_after_crosses_buys_the_next_chunks_first_rows():
    """hop_after_crosses: a hop row near its chunk's end brings the next chunk's first rows, which hop_after alone
    leaves to the ranking (the tiny case's seeds are rows 24 and 30; chunk 1 ends at row 27)."""
    from kvf.pipeline.fusion.methods.kvfuse import rows_after
    from kvf.scripts.hop_probe import Tracing
    engine, prompt, source = tiny_case("llama")
    next_start = prompt.chunk_spans()[2][0]                                      # row 28
    for knobs in ({"hop_weight": 0.0}, {"hop_weight": 1.0}):
        traced = Tracing(0.5, hop_rows=2, hop_after=4, hop_after_crosses=True, **knobs)
        traced.prefill(engine, prompt, source)
        crossed, within = rows_after(traced.seeds, prompt, 4, crosses=True), rows_after(traced.seeds, prompt, 4)
        assert set(crossed.tolist()) <= set(traced.selected.tolist()), knobs
        assert next_start in crossed.tolist() and next_start not in within.tolist(), knobs
    plain = Tracing(0.5, hop_rows=2, hop_after=4, hop_weight=1.0)
    plain.prefill(engine, prompt, source)
    assert next_start not in plain.selected.tolist()                            # bought because the window crossed


def test_kvfuse_hop_share_caps_the_windows_best_seed_first():
    """hop_share < 1: the hop's windows take at most that share of the budget, a row ranked by the best seed whose
    window holds it (earliest first within a window); the rows they leave are ranked by the question as any other.
    At ratio 1 it is full prefill."""
    from kvf.pipeline.fusion.methods.kvfuse import rows_after, window_scores
    from kvf.scripts.hop_probe import Tracing
    two = FusedPrompt([1, 2], [[3] * 5, [4] * 4], [5, 6])                       # chunk rows 2-6 and 7-10
    got = window_scores(torch.tensor([2, 4, 8]), torch.tensor([0.5, 0.2, 0.9]), two, 2)
    assert got.tolist() == pytest.approx([0.5, 0.5, 0.5, 0.2, 0.2, 0, 0.9, 0.9, 0.9])   # chunk 0 stops row 6's
    engine, prompt, source = tiny_case("llama")
    knobs = dict(hop_rows=4, hop_seeds="band", hop_weight=0.0, hop_after=4, locate_from=0.6, locate_to=0.85)
    budget = recompute_budget(0.5, prompt.n_chunk_tokens)
    traced = Tracing(0.5, hop_share=0.25, **knobs)
    traced.prefill(engine, prompt, source)
    most = recompute_budget(0.25, budget)
    assert len(rows_after(traced.seeds, prompt, 4)) > most                     # the cap binds here
    window = window_scores(traced.seeds, traced.band[traced.seeds], prompt, 4)
    forced = all_chunk_rows(prompt)[torch.argsort(window, descending=True, stable=True)[:most]]
    assert len(forced) == most and set(forced.tolist()) <= set(traced.selected.tolist())
    best = int(traced.seeds[torch.argmax(traced.band[traced.seeds])])
    by_row = dict(zip(all_chunk_rows(prompt).tolist(), window.tolist()))
    left = set(rows_after(traced.seeds, prompt, 4).tolist()) - set(forced.tolist())
    assert best in forced.tolist() and min(by_row[r] for r in forced.tolist()) >= max(by_row[r] for r in left)
    whole = Tracing(0.5, **knobs)                                               # hop_share 1: every window row
    whole.prefill(engine, prompt, source)
    assert set(rows_after(whole.seeds, prompt, 4).tolist()) <= set(whole.selected.tolist())
    dropped = left - set(traced.selected.tolist())                             # capped out, and not ranked in
    assert dropped and dropped <= set(whole.selected.tolist())
    full = get_method("full").prefill(engine, prompt)
    capped = get_method("kvfuse", 1.0, hop_rows=2, hop_weight=0.0, hop_after=3, hop_share=0.5)
    assert logits_gap(capped.prefill(engine, prompt, source), full) <= TOL


def test_kvfuse_hop_if_fits_buys_the_windows_only_where_the_budget_holds_them_all():
    """hop_if_fits: step 19's windows are bought where the budget left after the sinks holds every one at its longest
    (hop_rows x (1 + hop_after) rows); elsewhere the budget's rows are the located sinks' own. At ratio 1 it is full
    prefill."""
    from kvf.scripts.hop_probe import Tracing
    engine, prompt, source = tiny_case("llama")
    sinks = dict(sink_tokens=2, sinks_after_top=1, locate_from=0.6, locate_to=0.85)     # at most 2 sink rows
    windows = dict(hop_rows=2, hop_seeds="band", hop_weight=0.0, hop_after=3)            # 8 rows at their longest

    def selected(ratio, **knobs) -> list[int]:
        traced = Tracing(ratio, **knobs)
        traced.prefill(engine, prompt, source)
        return traced.selected.tolist()

    for ratio, fits in ((0.2, False), (0.6, True)):            # budgets of 6 and 18 rows of the 30
        located, step19 = selected(ratio, **sinks), selected(ratio, **sinks, **windows)
        assert located != step19, ratio                        # the windows move the budget here: the check can fail
        assert selected(ratio, **sinks, **windows, hop_if_fits=True) == (step19 if fits else located), ratio
    full = get_method("full").prefill(engine, prompt)
    gated = get_method("kvfuse", 1.0, **windows, hop_if_fits=True)
    assert logits_gap(gated.prefill(engine, prompt, source), full) <= TOL


def test_kvfuse_seam_tokens_buys_every_chunks_first_tokens():
    """seam_tokens=s: the first s rows of every chunk are recomputed first, inside the budget (its size unchanged),
    beside the located sinks; at ratio 1 it is full prefill."""
    from kvf.scripts.hop_probe import Tracing
    engine, prompt, source = tiny_case("llama")
    seams = {start + i for start, _ in prompt.chunk_spans() for i in range(2)}
    budget = recompute_budget(0.5, prompt.n_chunk_tokens)
    plain = Tracing(0.5, sink_tokens=2, sinks_after_top=1, locate_from=0.6, locate_to=0.85)
    plain.prefill(engine, prompt, source)
    assert not seams <= set(plain.selected.tolist())                            # the ranking alone leaves some
    seamed = Tracing(0.5, seam_tokens=2, sink_tokens=2, sinks_after_top=1, locate_from=0.6, locate_to=0.85)
    seamed.prefill(engine, prompt, source)
    assert seams <= set(seamed.selected.tolist()) and len(seamed.selected) == budget
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(get_method("kvfuse", 1.0, seam_tokens=2).prefill(engine, prompt, source), full) <= TOL


@pytest.mark.parametrize("estimate", ["mean", "james-stein", "kernel"])
@pytest.mark.parametrize("parts", ["kv", "k"])
def test_kvfuse_shift_of_all_chunks_at_once_equals_chunk_by_chunk(long_case, answerer, estimate, parts):
    """shift_kept_rows moves every chunk's kept rows in a few tensor ops per layer (a GPU pays per op);
    it must give, bit for bit, what the plain loop over chunks gives (the loop kvfuse's committed records
    were made with): each chunk's kept rows get its recomputed rows' move, re-rotated at their positions.
    Recomputed rows: some chunks get many, one gets a single row, one none at all."""
    from kvf.pipeline.fusion.methods.kvfuse import KvFuseKnobs, chunk_mean_move, key_similarity, shift_kept_rows
    from kvf.pipeline.model.rope import keys_at, keys_before_rope
    prompt, source, _ = long_case
    engine, layer = answerer.engine, 2
    spans = prompt.chunk_spans()
    g = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.randperm(spans[0][1] - spans[0][0], generator=g)[:40] + spans[0][0],
                      torch.tensor([spans[1][0] + 7])]).sort().values            # 40 rows, 1 row, none
    state = engine.start(prompt, source, FusionPlan(rows))
    engine.load_layer(state, layer)
    stored = state.cache.kv[layer][:, :, rows].clone()                             # [2, KV, a, d]
    fresh = stored + 0.1 * torch.randn(stored.shape, generator=g)
    before = state.cache.kv.clone()
    shift_kept_rows(engine, state, layer, rows, stored, fresh, KvFuseKnobs(shift_estimate=estimate, shift_parts=parts))

    want, rope, positions = before.clone(), engine.model.rope, state.positions    # the loop, chunk by chunk
    delta_k = keys_before_rope(fresh[0] - stored[0], rope, positions[rows])
    delta_v = fresh[1] - stored[1]
    for start, end in spans:
        mine = (rows >= start) & (rows < end)
        kept = torch.tensor([r for r in range(start, end) if r not in set(rows.tolist())])
        if not mine.any() or len(kept) == 0:
            continue
        if estimate == "kernel":
            weights = key_similarity(keys_before_rope(want[layer, 0][:, kept], rope, positions[kept]),
                                     keys_before_rope(stored[0][:, mine], rope, positions[rows[mine]]))
            move_k, move_v = weights @ delta_k[:, mine], weights @ delta_v[:, mine]
        else:
            move_k = chunk_mean_move(delta_k[:, mine], estimate).expand(-1, len(kept), -1)
            move_v = chunk_mean_move(delta_v[:, mine], estimate)
        want[layer, 0][:, kept] += keys_at(move_k, rope, positions[kept])
        if parts == "kv":
            want[layer, 1][:, kept] += move_v
    assert torch.equal(state.cache.kv[layer, :, :, spans[2][0]: spans[2][1]],      # no recomputed row: no move
                       before[layer, :, :, spans[2][0]: spans[2][1]])
    assert not torch.equal(state.cache.kv[layer, 0], before[layer, 0])            # something moved
    assert torch.equal(state.cache.kv, want)


def test_kvfuse_shift_guard_keeps_the_rows_after_a_read_row_as_stored(long_case, answerer):
    """shift_guard = N: a kept row within N rows after a recomputed row of its own chunk keeps its stored K/V (a
    needle's digits after its recomputed words); every other kept row gets the move it gets without the guard."""
    from kvf.pipeline.fusion.methods.kvfuse import KvFuseKnobs, shift_kept_rows, unguarded
    rows, chunk_of_row = torch.tensor([2, 9, 12, 20]), torch.tensor([0, 0, 0, 1])
    kept = torch.tensor([0, 3, 4, 5, 6, 10, 11, 18, 19, 21, 24])
    chunk_of_kept = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    left, _ = unguarded(rows, chunk_of_row, kept, chunk_of_kept, 3)
    assert left.tolist() == [0, 6, 18, 19, 24]   # 3-5 after 2, 10-11 after 9, 21 after 20; 19 is chunk 1's, before 20
    closed, _ = unguarded(rows, chunk_of_row, kept, chunk_of_kept, 3, closed=True)
    assert closed.tolist() == [0, 3, 4, 5, 6, 18, 19, 21, 24]   # 10-11 alone lie between recomputed rows 9 and 12
    prompt, source, _ = long_case
    engine, layer = answerer.engine, 2
    spans = prompt.chunk_spans()
    g = torch.Generator().manual_seed(0)
    rows = (torch.randperm(spans[0][1] - spans[0][0], generator=g)[:20] + spans[0][0]).sort().values
    moved = {}
    for guard in (0, 3):
        state = engine.start(prompt, source, FusionPlan(rows))
        engine.load_layer(state, layer)
        stored = state.cache.kv[layer][:, :, rows].clone()                         # [2, KV, a, d]
        fresh = stored + 0.1 * torch.randn(stored.shape, generator=torch.Generator().manual_seed(1))
        before = state.cache.kv[layer].clone()
        shift_kept_rows(engine, state, layer, rows, stored, fresh, KvFuseKnobs(shift_guard=guard))
        moved[guard] = state.cache.kv[layer]
    chunk = torch.arange(*spans[0])
    kept = chunk[~torch.isin(chunk, rows)]
    near = torch.tensor([bool(((r - rows > 0) & (r - rows <= 3)).any()) for r in kept.tolist()])
    assert near.any() and (~near).any()
    assert torch.equal(moved[3][:, :, kept[near]], before[:, :, kept[near]])      # guarded: as stored
    assert torch.equal(moved[3][:, :, kept[~near]], moved[0][:, :, kept[~near]])  # the rest: the unguarded move
    assert not torch.equal(moved[0][:, :, kept[near]], before[:, :, kept[near]])


def test_kvfuse_shift_guard_ranked_leaves_the_rows_ranked_next_as_stored(monkeypatch):
    """shift_guard_ranked = N: the chunk rows the question's attention ranks next after the budget (the top (1 + N) x
    budget less the recomputed ones) keep their stored K/V, as with no shift; every other kept row gets the shift it
    gets without the guard, and the first token is the same (the shift comes after it)."""
    import kvf.pipeline.fusion.methods.kvfuse as kvfuse_file
    engine, prompt, source = tiny_case("llama")
    seen = {}
    pick = kvfuse_file.KvFuse.next_pass_rows
    def logged(self, engine, state):
        rows = pick(self, engine, state)
        if state.pass_index == 0:
            seen["attention"] = torch.stack(state.query_attention).mean(dim=0)   # [n]
            seen["rows"], seen["guarded"] = rows, state.scratch.get("guarded")
        return rows
    monkeypatch.setattr(kvfuse_file.KvFuse, "next_pass_rows", logged)
    fused = {knobs: get_method("kvfuse", 0.2, **dict(knobs)).prefill(engine, prompt, source)
             for knobs in [(("propagate", "off"),), (), (("shift_guard_ranked", 0.5),)]}
    off, shifted, guarded = fused.values()
    budget, chunk_rows = recompute_budget(0.2, prompt.n_chunk_tokens), all_chunk_rows(prompt)
    nearly = top_rows(seen["attention"][chunk_rows], chunk_rows, budget + int(0.5 * budget + 0.5))
    assert torch.equal(seen["guarded"], nearly[~torch.isin(nearly, seen["rows"])]) and len(seen["guarded"]) > 0
    kept = chunk_rows[~torch.isin(chunk_rows, seen["rows"])]
    left = kept[~torch.isin(kept, seen["guarded"])]
    kv = lambda r, rows: r.cache.kv[:, :, :, rows]                                 # [L, 2, KV, rows, d]
    assert torch.equal(kv(guarded, seen["guarded"]), kv(off, seen["guarded"]))      # as stored
    assert not torch.equal(kv(shifted, seen["guarded"]), kv(off, seen["guarded"]))  # which the shift would move
    assert torch.equal(kv(guarded, left), kv(shifted, left))                        # the rest: the plain shift
    assert torch.equal(guarded.logits, shifted.logits)
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(get_method("kvfuse", 1.0, shift_guard_ranked=0.5).prefill(engine, prompt, source), full) <= TOL


def test_kvfuse_shift_max_spread_shifts_only_a_question_that_reads_few_chunks(monkeypatch):
    """shift_max_spread = s: the shift runs when the question's attention over the chunks (effective number of chunks
    over C) is at most s; just above the question's own spread kvfuse is the default bit for bit, just below it is
    propagate=off bit for bit."""
    import kvf.pipeline.fusion.methods.kvfuse as kvfuse_file
    one, even = torch.tensor([0.0, 3.0, 0.0, 0.0]), torch.ones(4)
    assert kvfuse_file.chunk_spread(one) == 0.25 and abs(kvfuse_file.chunk_spread(even) - 1.0) < 1e-12
    assert abs(kvfuse_file.chunk_spread(torch.tensor([1.0, 1.0, 0.0, 0.0])) - 0.5) < 1e-12
    engine, prompt, source = tiny_case("llama")
    seen = {}
    pick = kvfuse_file.KvFuse.next_pass_rows
    def logged(self, engine, state):
        rows = pick(self, engine, state)
        seen["attention"] = torch.stack(state.query_attention).mean(dim=0)       # [n]
        return rows
    monkeypatch.setattr(kvfuse_file.KvFuse, "next_pass_rows", logged)
    shifted = get_method("kvfuse", 0.3).prefill(engine, prompt, source).cache.kv
    spread = kvfuse_file.chunk_spread(chunk_attention(seen["attention"], prompt))
    assert 1 / len(prompt.chunk_segments) < spread < 1
    off = get_method("kvfuse", 0.3, propagate="off").prefill(engine, prompt, source).cache.kv
    assert not torch.equal(shifted, off)
    above = get_method("kvfuse", 0.3, shift_max_spread=spread + 1e-6).prefill(engine, prompt, source).cache.kv
    below = get_method("kvfuse", 0.3, shift_max_spread=spread - 1e-6).prefill(engine, prompt, source).cache.kv
    assert torch.equal(above, shifted) and torch.equal(below, off)
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(get_method("kvfuse", 1.0, shift_max_spread=0.5).prefill(engine, prompt, source), full) <= TOL


def test_kvfuse_chunk_moves():
    """The estimates on hand-made moves [KV, r, d]: rows that move together give their mean under every
    estimate; rows that scatter around 0, or a single row, give no move under james-stein; kernel weights
    are a distribution over the recomputed rows, so one recomputed row gives its own move."""
    from kvf.pipeline.fusion.methods.kvfuse import chunk_mean_move, key_similarity
    together = torch.ones(2, 5, 4) * torch.tensor([1.0, -2.0, 0.5, 3.0])        # [KV=2, r=5, d=4]
    assert torch.allclose(chunk_mean_move(together, "james-stein"), together[:, :1])
    assert torch.allclose(chunk_mean_move(together, "mean"), together[:, :1])
    scattered = torch.cat([together, -together], dim=1)                          # mean 0, large spread
    assert torch.equal(chunk_mean_move(scattered, "james-stein"), torch.zeros(2, 1, 4))
    assert torch.equal(chunk_mean_move(together[:, :1], "james-stein"), torch.zeros(2, 1, 4))
    noisy = together + 0.1 * torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    factor = chunk_mean_move(noisy, "james-stein") / chunk_mean_move(noisy, "mean")
    assert ((factor > 0.9) & (factor < 1)).all()                                 # shrunk a little, not zeroed
    weights = key_similarity(torch.randn(2, 7, 4), torch.randn(2, 3, 4))         # [KV, m=7, r=3]
    assert weights.shape == (2, 7, 3) and torch.allclose(weights.sum(-1), torch.ones(2, 7))
    assert torch.equal(key_similarity(torch.randn(2, 7, 4), torch.randn(2, 1, 4)), torch.ones(2, 7, 1))


def test_kvfuse_layer_counts_spend_the_budget_early_and_never_grow():
    from kvf.pipeline.fusion.methods.kvfuse import layer_counts
    assert layer_counts(15, 100, 30, 0.0) == [15] * 30
    assert layer_counts(15, 100, 3, 1.0) == [30, 15, 0]                      # 2r, r, 0: (1 + s(1 - 2l/(L-1))) r
    assert layer_counts(100, 100, 30, 1.0) == [100] * 30                     # ratio 1: every row at every layer
    for budget, rows, layers, slope in [(15, 100, 30, 1.0), (60, 100, 30, 1.0), (900, 6000, 30, 0.5), (1, 100, 30, 1.0),
                                        (99, 100, 30, 0.7), (2, 3, 2, 1.0)]:
        counts = layer_counts(budget, rows, layers, slope)
        assert sum(counts) == budget * layers and max(counts) <= rows
        assert all(a >= b for a, b in zip(counts, counts[1:]))
    assert layer_counts(60, 100, 30, 1.0)[:5] == [100] * 5                 # capped early, the cut spread below


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kvfuse_budget_slope_recomputes_nested_rows_layer_by_layer(family, monkeypatch):
    """budget_slope: layer l recomputes the top layer_counts[l] rows of the one ranking, each layer's among the
    layer before's, budget x L token-layers in all; at ratio 1 that is every row at every layer: full prefill."""
    from kvf.pipeline.fusion.methods.kvfuse import layer_counts
    engine, prompt, source = tiny_case(family)
    seen = {}
    step = FusionEngine.step
    def logged(self, state, layer, **kw):
        if state.pass_index == 1:
            seen[layer] = set(state.active_chunk_rows().tolist())
        return step(self, state, layer, **kw)
    monkeypatch.setattr(FusionEngine, "step", logged)
    fused = get_method("kvfuse", 0.3, budget_slope=1.0).prefill(engine, prompt, source)
    budget, L = recompute_budget(0.3, prompt.n_chunk_tokens), engine.model.n_layers
    counts = layer_counts(budget, prompt.n_chunk_tokens, L, 1.0)
    assert [len(seen[layer]) for layer in range(L)] == counts and counts[0] > counts[-1]
    assert all(seen[layer + 1] <= seen[layer] for layer in range(L - 1))
    assert fused.recomputed_token_layers == budget * L and fused.recomputed_tokens == budget
    full = get_method("full").prefill(engine, prompt)
    everything = get_method("kvfuse", 1.0, budget_slope=1.0).prefill(engine, prompt, source)
    assert logits_gap(everything, full) <= TOL


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kvfuse_select_unit_chunks_recomputes_whole_chunks_most_attended_first(family, monkeypatch):
    """select_unit=chunks: the budget goes to whole chunks in the order of the question's attention mass on them
    (pass 1, layer-averaged), the last one it reaches by its most attended rows; exactly the budget; ratio 1 is full."""
    from kvf.pipeline.fusion.methods.kvfuse import KvFuse
    engine, prompt, source = tiny_case(family)
    seen = {}
    pick = KvFuse.next_pass_rows
    def logged(self, engine, state):
        seen["attention"] = torch.stack(state.query_attention).mean(dim=0)     # [n]
        seen["rows"] = pick(self, engine, state)
        return seen["rows"]
    monkeypatch.setattr(KvFuse, "next_pass_rows", logged)
    fused = get_method("kvfuse", 0.5, select_unit="chunks").prefill(engine, prompt, source)
    budget, spans = recompute_budget(0.5, prompt.n_chunk_tokens), prompt.chunk_spans()
    expected, left = [], budget
    for chunk in torch.argsort(chunk_attention(seen["attention"], prompt), descending=True).tolist():
        start, end = spans[chunk]
        by_attention = start + torch.argsort(seen["attention"][start:end], descending=True)
        expected += by_attention[:left].tolist()
        left -= min(left, end - start)
    assert sorted(expected) == seen["rows"].tolist() and fused.recomputed_tokens == budget
    whole = [c for c, (s, e) in enumerate(spans) if set(range(s, e)) <= set(expected)]
    assert 0 < len(whole) < len(spans)                                      # the case does cut a chunk
    plain = get_method("kvfuse", 0.5).prefill(engine, prompt, source)
    assert plain.recomputed_tokens == budget and not torch.equal(plain.logits, fused.logits)
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(get_method("kvfuse", 1.0, select_unit="chunks").prefill(engine, prompt, source), full) <= TOL


def test_kvfuse_locate_band_picks_the_sinks_chunks_and_the_layer_average_the_rest(monkeypatch):
    """locate_from/locate_to: the chunks sinks_after_top puts sinks after are found by the question's attention
    averaged over that band of layers only; the rest of the budget is still ranked by every layer's average, unless
    score_layers=band ranks it by the band too, or band_weight mixes the two."""
    import kvf.pipeline.fusion.methods.kvfuse as kvfuse_file
    engine = FusionEngine(Transformer(tiny_model("llama", seed=4)))
    g = torch.Generator().manual_seed(0)
    prompt = FusedPrompt(prefix_ids=torch.randint(0, 128, (5,), generator=g).tolist(),   # four equal chunks, so
                         chunk_segments=[torch.randint(0, 128, (8,), generator=g).tolist() for _ in range(4)],
                         question_ids=torch.randint(0, 128, (6,), generator=g).tolist())  # length sets no mass
    source = prefix_kvs_with_summaries(engine, prompt)
    L = engine.model.n_layers
    per_layer = engine.query_pass(prompt, source, 0).query_attention           # L x [n]
    band = kvfuse_file.KvFuse(0.3, sink_tokens=2, sinks_after_top=1, locate_from=0.5).locate_layers(L)
    assert band == list(range(L // 2, L)) and 0 < len(band) < L
    located = torch.stack([per_layer[layer] for layer in band]).mean(0)       # [n]
    everything = torch.stack(per_layer).mean(0)                               # [n]
    seen = {}
    sinks_of, rows_of = kvfuse_file.sink_rows, kvfuse_file.KvFuse.next_pass_rows
    def sinks_logged(prompt, per_chunk, budget, after_top=0, scores=None):
        seen["scores"] = scores
        return sinks_of(prompt, per_chunk, budget, after_top, scores)
    def rows_logged(self, engine, state):
        seen["rows"] = rows_of(self, engine, state)
        return seen["rows"]
    monkeypatch.setattr(kvfuse_file, "sink_rows", sinks_logged)
    monkeypatch.setattr(kvfuse_file.KvFuse, "next_pass_rows", rows_logged)
    budget = recompute_budget(0.3, prompt.n_chunk_tokens)
    fused = get_method("kvfuse", 0.3, sink_tokens=2, sinks_after_top=1, locate_from=0.5, propagate="off"
                       ).prefill(engine, prompt, source)
    assert torch.allclose(seen["scores"], located, atol=1e-6) and fused.recomputed_tokens == budget
    chunk_rows = all_chunk_rows(prompt)
    ranked = everything[chunk_rows].clone()                                   # [c] every layer's average
    ranked[sinks_of(prompt, 2, budget, after_top=1, scores=located) - prompt.n_prefix] = float("inf")
    assert torch.equal(seen["rows"], top_rows(ranked, chunk_rows, budget))
    moved = int(torch.argmax(chunk_attention(located, prompt))) != int(torch.argmax(chunk_attention(everything, prompt)))
    get_method("kvfuse", 0.3, sink_tokens=2, sinks_after_top=1, propagate="off").prefill(engine, prompt, source)
    assert torch.allclose(seen["scores"], everything, atol=1e-6)              # no band: every layer finds them
    assert moved    # in this case the band finds another chunk than every layer's average does
    assert kvfuse_file.KvFuse(0.15, sink_tokens=8, sinks_after_top=1, locate_from=0.6, locate_to=0.85
                              ).locate_layers(30) == list(range(18, 25))
    assert kvfuse_file.KvFuse(0.15, sink_tokens=8, sinks_after_top=1, locate_from=0.61, locate_to=0.62
                              ).locate_layers(30) == [18]                       # a band between layers: its nearest
    ranks_by_band = get_method("kvfuse", 0.3, score_layers="band", locate_from=0.5, propagate="off")
    ranks_by_band.prefill(engine, prompt, source)                             # no sinks: every row by the band
    assert ranks_by_band.scored_layers(L) == band and seen["rows"].tolist() == \
        top_rows(located[chunk_rows], chunk_rows, budget).tolist()
    by_band = seen["rows"]
    get_method("kvfuse", 0.3, band_weight=1.0, locate_from=0.5, propagate="off").prefill(engine, prompt, source)
    assert torch.equal(seen["rows"], by_band)                                 # all of the weight: the band's ranking
    get_method("kvfuse", 0.3, band_weight=0.5, locate_from=0.5, propagate="off").prefill(engine, prompt, source)
    mixed = (0.5 * everything + 0.5 * located)[chunk_rows]                    # [c] half each
    assert torch.equal(seen["rows"], top_rows(mixed, chunk_rows, budget))
    get_method("kvfuse", 0.3, band_weight=0.5, score_layers="last", locate_from=0.5, propagate="off"
               ).prefill(engine, prompt, source)                               # the band mixed into the last layer's
    mixed = (0.5 * per_layer[L - 1] + 0.5 * located)[chunk_rows]
    assert torch.equal(seen["rows"], top_rows(mixed, chunk_rows, budget))


def test_kvfuse_span_after_brings_the_rows_after_each_read_row_within_its_chunk(monkeypatch):
    """span_after = N: a chunk row ranks as the best of itself and the N rows before it in its chunk, so the budget
    buys spans that start at the rows the question attends to and never run into the next chunk."""
    import kvf.pipeline.fusion.methods.kvfuse as kvfuse_file
    scores = torch.tensor([0.0, 5.0, 0.0, 0.0, 1.0, 0.0, 9.0, 0.0])
    chunk_of_row = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    assert kvfuse_file.spread_after(scores, chunk_of_row, 2).tolist() == [0, 5, 5, 5, 1, 0, 9, 9]   # 5: a new chunk
    assert kvfuse_file.spread_after(scores, chunk_of_row, 0).tolist() == scores.tolist()
    engine, prompt, source = tiny_case("llama")
    seen = {}
    pick = kvfuse_file.KvFuse.next_pass_rows
    def logged(self, engine, state):
        seen["attention"] = torch.stack(state.query_attention).mean(dim=0)     # [n]
        seen["rows"] = pick(self, engine, state)
        return seen["rows"]
    monkeypatch.setattr(kvfuse_file.KvFuse, "next_pass_rows", logged)
    budget = recompute_budget(0.3, prompt.n_chunk_tokens)
    fused = get_method("kvfuse", 0.3, span_after=3, propagate="off").prefill(engine, prompt, source)
    chunk_rows = all_chunk_rows(prompt)
    spread = kvfuse_file.spread_after(seen["attention"][chunk_rows], kvfuse_file.chunk_of(prompt, chunk_rows), 3)
    assert torch.equal(seen["rows"], top_rows(spread, chunk_rows, budget)) and fused.recomputed_tokens == budget
    plain = seen["rows"]
    get_method("kvfuse", 0.3, propagate="off").prefill(engine, prompt, source)
    assert not torch.equal(plain, seen["rows"])                                # the spans are other rows
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(get_method("kvfuse", 1.0, span_after=3).prefill(engine, prompt, source), full) <= TOL


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kvfuse_calibration_reweights_the_question_and_decoding_and_leaves_chunk_rows_plain(family):
    """ape_temperature/ape_scale: APE's calibration of the chunks' attention for the question's rows and decoding
    only. At ratio 1 every chunk row is recomputed plainly, so the result is full prefill of S and the chunks, then the
    question's rows over it with the calibration: computed here layer by layer with the model alone."""
    from kvf.pipeline.model.forward import SpanCalibration
    engine, prompt, source = tiny_case(family)
    T, n, q_start = engine.model, prompt.n_tokens, prompt.n_tokens - len(prompt.question_ids)
    cal = SpanCalibration(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens, 0.7, 0.8, queries_from=q_start)
    ids = prompt.all_ids()
    cache = T.new_cache(n)
    T.prefill(ids[:q_start], cache)                                           # S | C1..Ck, plain
    cache.length = n
    rows = torch.arange(q_start, n)
    hidden, active, mask = T.embed(ids[rows]), T.active_rows(rows, rows), T.causal_mask(rows, n)
    with torch.inference_mode():
        for layer in range(T.n_layers):                                       # Q's rows, calibrated
            hidden = T.layer_step(layer, hidden, active, cache, mask, calibration=cal)
    expected = T.logits(hidden[-1:])[0]
    fused = get_method("kvfuse", 1.0, ape_temperature=0.7, ape_scale=0.8).prefill(engine, prompt, source)
    assert (fused.logits - expected).abs().max().item() <= TOL and fused.calibration == cal   # decoding keeps it
    full = get_method("full").prefill(engine, prompt)
    assert logits_gap(fused, full) > 10 * TOL                                 # the calibration does change Q
    for ratio in (1.0, 0.3):   # in a sweep pass 1 is the shared plain query pass: the same answer as alone
        alone = get_method("kvfuse", ratio, ape_temperature=0.7, ape_scale=0.8).prefill(engine, prompt, source)
        swept = get_method("kvfuse", ratio, ape_temperature=0.7, ape_scale=0.8).prefill(engine, prompt, source, shared={})
        assert torch.equal(alone.logits, swept.logits) and swept.calibration == cal
        plain = get_method("kvfuse", ratio).prefill(engine, prompt, source, shared={})
        assert plain.calibration is None and not torch.allclose(plain.logits, swept.logits, atol=TOL)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kvfuse_all_budget_by_deviation_equals_cacheblend(family):
    """With the whole budget given to the layer-1 deviation (and no shift), kvfuse recomputes CacheBlend's
    rows: CacheBlend recomputes layer 0 everywhere and keeps the most deviating rows from layer 1; kvfuse
    measures the same deviation between its passes, then recomputes those rows from layer 0, where a
    row's fresh K/V equal its stored ones. So the fused caches and first-token logits agree."""
    engine, prompt, source = tiny_case(family)
    blend = get_method("cacheblend", 0.3).prefill(engine, prompt, source)
    fused = get_method("kvfuse", 0.3, deviation_share=1.0, propagate="off").prefill(engine, prompt, source)
    assert fused.recomputed_tokens == blend.recomputed_tokens == recompute_budget(0.3, prompt.n_chunk_tokens)
    assert (fused.logits - blend.logits).abs().max().item() <= 1e-4
    assert torch.allclose(fused.cache.kv[:, :, :, :prompt.n_tokens], blend.cache.kv[:, :, :, :prompt.n_tokens], atol=1e-4)
    plain = get_method("kvfuse", 0.3, propagate="off").prefill(engine, prompt, source)
    assert not torch.allclose(plain.logits, fused.logits, atol=1e-4)   # the share does change the rows


@pytest.mark.parametrize("copied,slope", [(False, 0.0), (True, 0.0), (False, 1.0)],
                         ids=["read-again", "copied", "budget-slope"])
def test_kvfuse_shifts_after_the_first_token_and_decoding_pays_for_it(long_case, answerer, copied, slope, monkeypatch):
    """propagate=after shifts a layer's kept rows once its attention has run, and no later layer reads
    them: so kvfuse puts all shifts off until decoding first reads the cache. Oracle: a kvfuse that shifts
    right after each layer (as kvfuse did before) gives the same first-token logits and, once decoding
    has read it, the same cache, bit for bit; before that read the cache is the unshifted one (TTFT
    leaves the shift out), and the read is timed in after_first_token_seconds. The same whether the engine
    keeps the overwritten rows' stored KV as a copy (as on a GPU) or reads them again (as on the CPU), and
    with fewer rows at every layer (budget_slope), where each layer's move comes from that layer's rows."""
    from kvf.pipeline.fusion import engine as fusion_engine
    monkeypatch.setattr(fusion_engine, "COPY_STORED_ROWS_ON_CPU", copied)
    from kvf.pipeline.fusion.methods.kvfuse import KvFuse, shift_kept_rows

    class ShiftAfterEachLayer(KvFuse):  # copies each layer's rows just before it runs, shifts right after
        def before_layer(self, engine, state, layer):
            self.keep_layer_rows(engine, state, layer)
            if self.propagates(state, layer):
                rows = state.active_chunk_rows()
                state.scratch.setdefault("eager", {})[layer] = (rows, state.cache.kv[layer][:, :, rows])

        def after_layer(self, engine, state, layer):
            if layer in state.scratch.get("eager", {}):
                rows, before = state.scratch["eager"].pop(layer)
                shift_kept_rows(engine, state, layer, rows, before, state.cache.kv[layer][:, :, rows], self.knobs)

    prompt, source, _ = long_case
    reads = []
    read_again = source.read_again
    monkeypatch.setattr(source, "read_again", lambda layer, chunks: reads.append(layer) or read_again(layer, chunks))
    engine = answerer.engine
    eager = ShiftAfterEachLayer(0.15, budget_slope=slope).prefill(engine, prompt, source)
    assert eager.after_first_token is None                       # nothing left to do
    deferred = get_method("kvfuse", 0.15, budget_slope=slope).prefill(engine, prompt, source)
    unshifted = get_method("kvfuse", 0.15, propagate="off", budget_slope=slope).prefill(engine, prompt, source)
    assert deferred.after_first_token is not None
    assert torch.equal(deferred.logits, eager.logits)
    assert torch.equal(deferred._cache.kv, unshifted.cache.kv)   # what the first token was computed over
    assert torch.equal(deferred.cache.kv, eager.cache.kv)        # what decoding reads
    assert deferred.after_first_token is None and deferred.after_first_token_seconds > 0
    assert not torch.equal(deferred.cache.kv, unshifted.cache.kv)
    assert bool(reads) != copied                                   # the rows were read again, or copied


def test_decoding_counts_the_work_put_off_past_the_first_token(long_case, answerer):
    """A request's decode time includes kvfuse's shift, also shown as timings.after_first_token."""
    prompt, source, _ = long_case
    answer = answerer.answer(prompt, get_method("kvfuse", 0.15), source, max_new_tokens=2)
    shift = answer.timings["after_first_token"]
    assert shift > 0 and answer.timings["decode"] >= shift
    plain = answerer.answer(prompt, get_method("prophetkv", 0.15), source, max_new_tokens=2)
    assert "after_first_token" not in plain.timings


@pytest.mark.parametrize("round_to, dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_ceiling_is_full_prefill_of_the_context_as_the_store_holds_it_then_q(round_to, dtype):
    """Oracle: prefill S | C1..Ck, round the chunk rows (keys before RoPE) through the store's dtype,
    then prefill Q over that cache. `ceiling` must give the same first-token logits and cache."""
    from kvf.pipeline.model.rope import keys_at, keys_before_rope
    model = Transformer(tiny_model("llama", seed=3))
    engine = FusionEngine(model)
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, 128, (n,), generator=g).tolist()  # noqa: E731
    prompt = FusedPrompt(ids(5), [ids(n) for n in (9, 14, 7)], ids(6))
    n_context = prompt.n_prefix + prompt.n_chunk_tokens
    cache = model.new_cache(prompt.n_tokens)
    model.prefill(prompt.all_ids()[:n_context], cache)
    chunks, positions = slice(prompt.n_prefix, n_context), torch.arange(prompt.n_prefix, n_context)
    for layer in range(model.n_layers):
        kv = cache.kv[layer]                                                           # [2, KV, cap, d]
        keys = keys_before_rope(kv[0][:, chunks], model.rope, positions).to(dtype).float()
        kv[0][:, chunks] = keys_at(keys, model.rope, positions)
        kv[1][:, chunks] = kv[1][:, chunks].to(dtype).float()
    expected, _ = model.prefill(prompt.all_ids()[n_context:], cache, start=n_context)

    got = get_method("ceiling", round_to=round_to).prefill(engine, prompt, InMemoryKV([]))
    full = get_method("full").prefill(engine, prompt)
    assert torch.allclose(got.logits, expected, atol=1e-5)
    # A value that lands between two store-dtype values may round either way when the two prefills sum in
    # another order (several threads do): up to one store-dtype step apart, in a handful of values.
    got_kv, want_kv = got.cache.kv[:, :, :, :prompt.n_tokens], cache.kv[:, :, :, :prompt.n_tokens]
    assert torch.allclose(got_kv, want_kv, atol=1e-5, rtol=torch.finfo(dtype).eps)
    assert ((got_kv - want_kv).abs() > 1e-5).float().mean() < 0.01
    assert (got.logits - full.logits).abs().max() > 1e-6   # the rounding reached Q
    assert got.recomputed_tokens == prompt.n_chunk_tokens


def test_oracle_keeps_the_stored_rows_nearest_full_prefill():
    """`oracle` recomputes the chunk rows whose stored KV lies farthest from full prefill's, so the rows it
    keeps from the store are, in sum, nearer full prefill than those any other selector of the same
    budget keeps (here CacheBlend's and ProphetKV's), and its recomputed count is exact."""
    from conftest import stored_prefix_kvs
    from kvf.pipeline.fusion.methods.oracle import distance_to_full
    engine = FusionEngine(Transformer(tiny_model("llama", seed=3)))
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, 128, (n,), generator=g).tolist()  # noqa: E731
    prompt = FusedPrompt(ids(5), [ids(n) for n in (19, 24, 17)], ids(6))
    source = stored_prefix_kvs(engine, prompt)
    chunk_rows = torch.arange(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens)
    full = get_method("full").prefill(engine, prompt).cache.kv[:, :, :, chunk_rows]
    stored = get_method("reuse").prefill(engine, prompt, source).cache.kv[:, :, :, chunk_rows]
    distance = distance_to_full(stored, full)                                   # [c]

    def kept_distance(name):
        result = get_method(name, 0.3).prefill(engine, prompt, source)
        assert result.recomputed_tokens == recompute_budget(0.3, prompt.n_chunk_tokens)
        # rows still holding their stored KV at every layer (a recomputed row of the first chunk may hold the
        # same values, being exact after S: its distance is 0 and changes no sum)
        kept = (result.cache.kv[:, :, :, chunk_rows] == stored).flatten(0, 2).all(dim=(0, 2))  # [c]
        return float(distance[kept].sum())

    oracle = kept_distance("oracle")
    assert oracle < kept_distance("cacheblend") and oracle < kept_distance("prophetkv")


def test_selection_probe_ranks_by_the_attention_it_is_given():
    """scripts/selection_probe.py: ranked by the attention kvfuse's own pass 1 records, RankedBy is kvfuse
    (same rows, logits and cache); ranked by the attention of Q with extra rows appended, it picks other rows.
    Its attention_with() cuts nothing: per layer [n + extra]."""
    from kvf.scripts.selection_probe import RankedBy, attention_with
    engine, prompt, source = tiny_case("llama")
    own, _ = attention_with(engine, prompt, source, [])
    plain = get_method("kvfuse", 0.3, propagate="off").prefill(engine, prompt, source)
    same = RankedBy(0.3, own, propagate="off").prefill(engine, prompt, source)
    assert torch.equal(same.logits, plain.logits) and torch.equal(same.cache.kv, plain.cache.kv)
    extra, _ = attention_with(engine, prompt, source, [7, 8, 9, 10, 11, 12])
    assert all(a.shape == (prompt.n_tokens + 6,) for a in extra)
    uniform = [torch.ones(prompt.n_tokens) for _ in own]          # every row alike: the earliest rows win ties
    other = RankedBy(0.3, uniform, propagate="off").prefill(engine, prompt, source)
    assert other.recomputed_tokens == plain.recomputed_tokens
    assert not torch.equal(other.cache.kv, plain.cache.kv)


def test_requery_probe_changes_the_kept_rows_then_computes_q_again_over_them():
    """scripts/requery_probe.py: the third pass recomputes Q alone. Over an unchanged cache (kept rows
    "corrected" to what they already hold) it gives kvfuse-without-shift's first token again; with full
    prefill's rows, every kept row is full's and the recomputed rows stay as pass 2 left them while Q's
    rows and the first token change; kvfuse's shift before it leaves the chunk rows as kvfuse's own shift
    after the first token leaves them."""
    from kvf.scripts.requery_probe import CorrectedQAgain
    engine, prompt, source = tiny_case("llama")
    plain = get_method("kvfuse", 0.3, propagate="off").prefill(engine, prompt, source)
    same = CorrectedQAgain(0.3, plain.cache.kv.clone(), "exact K and V").prefill(engine, prompt, source)
    torch.testing.assert_close(same.logits, plain.logits, atol=1e-4, rtol=1e-4)
    chunk_rows = torch.arange(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens)
    question_rows = prompt.question_rows()
    reused = get_method("reuse").prefill(engine, prompt, source).cache.kv[:, :, :, chunk_rows]
    kept = (plain.cache.kv[:, :, :, chunk_rows] == reused).flatten(0, 2).all(dim=(0, 2))     # [c] not recomputed
    full_kv = get_method("full").prefill(engine, prompt).cache.kv             # [L, 2, KV, n, d]
    exact = CorrectedQAgain(0.3, full_kv, "exact K and V").prefill(engine, prompt, source)
    kv = exact.cache.kv[:, :, :, chunk_rows]
    torch.testing.assert_close(kv[:, :, :, kept], full_kv[:, :, :, chunk_rows[kept]], atol=1e-5, rtol=1e-5)
    assert torch.equal(kv[:, :, :, ~kept], plain.cache.kv[:, :, :, chunk_rows[~kept]])
    assert not torch.allclose(exact.cache.kv[:, :, :, question_rows], plain.cache.kv[:, :, :, question_rows], atol=1e-4)
    assert not torch.allclose(exact.logits, plain.logits, atol=1e-4)
    shifted = get_method("kvfuse", 0.3).prefill(engine, prompt, source).cache.kv[:, :, :, chunk_rows]
    requeried = get_method("kvfuse", 0.3, requery=True).prefill(engine, prompt, source)
    assert requeried.recomputed_tokens == recompute_budget(0.3, prompt.n_chunk_tokens)   # Q's pass adds no chunk row
    assert requeried.recomputed_token_layers == plain.recomputed_token_layers   # chunk token-layers: Q adds none
    before = requeried.cache.kv[:, :, :, chunk_rows]
    unshifted = get_method("kvfuse", 0.3, propagate="off", requery=True).prefill(engine, prompt, source)
    torch.testing.assert_close(unshifted.logits, plain.logits, atol=1e-4, rtol=1e-4)   # Q again over the same rows
    assert torch.equal(unshifted.cache.kv[:, :, :, chunk_rows], plain.cache.kv[:, :, :, chunk_rows])
    everything = get_method("kvfuse", 1.0, requery=True).prefill(engine, prompt, source)       # the contract
    torch.testing.assert_close(everything.logits, get_method("full").prefill(engine, prompt).logits, atol=1e-3, rtol=0)
    torch.testing.assert_close(before, shifted, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(before, plain.cache.kv[:, :, :, chunk_rows], atol=1e-4)   # the shift moved them


def test_correction_probe_corrects_the_kept_rows_from_full_prefill_after_the_first_token():
    """scripts/correction_probe.py: every correction leaves the first token (logits) as kvfuse without its
    shift gives it and the recomputed rows as they were; `exact K and V` makes every kept row full prefill's
    (RoPE undone and redone), `exact K` its keys only; the true chunk-mean move brings the kept rows nearer
    full than none; the affine fit recovers an affine map exactly."""
    from kvf.scripts.correction_probe import CorrectedWith, affine_fit
    engine, prompt, source = tiny_case("llama")
    full_kv = get_method("full").prefill(engine, prompt).cache.kv             # [L, 2, KV, n, d]
    plain = get_method("kvfuse", 0.3, propagate="off").prefill(engine, prompt, source)
    chunk_rows = torch.arange(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens)

    def corrected(correction):
        result = CorrectedWith(0.3, full_kv, correction).prefill(engine, prompt, source)
        assert torch.equal(result.logits, plain.logits)
        kv = result.cache.kv                                                  # runs the correction (decoding's first read)
        changed = (kv != plain.cache.kv).flatten(0, 2).any(dim=(0, 2))      # [n] rows any layer changed
        assert not changed[: prompt.n_prefix].any() and not changed[prompt.n_prefix + prompt.n_chunk_tokens:].any()
        assert not changed[chunk_rows][~kept].any()                           # the recomputed rows stay
        return kv[:, :, :, chunk_rows]

    reused = get_method("reuse").prefill(engine, prompt, source).cache.kv[:, :, :, chunk_rows]
    kept = (plain.cache.kv[:, :, :, chunk_rows] == reused).flatten(0, 2).all(dim=(0, 2))     # [c] not recomputed
    assert 0 < int((~kept).sum()) < len(kept)
    want = full_kv[:, :, :, chunk_rows[kept]]
    torch.testing.assert_close(corrected("exact K and V")[:, :, :, kept], want, atol=1e-5, rtol=1e-5)
    exact_k = corrected("exact K")[:, :, :, kept]
    torch.testing.assert_close(exact_k[:, 0], want[:, 0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(exact_k[:, 1], want[:, 1], atol=1e-3)
    error = lambda kv: ((kv[:, :, :, kept] - want).norm() / want.norm()).item()
    assert error(corrected("true chunk-mean move")) < error(plain.cache.kv[:, :, :, chunk_rows])
    x = torch.randn(2, 50, 8)
    w, b = torch.randn(2, 8, 8), torch.randn(2, 1, 8)
    torch.testing.assert_close(affine_fit(x, x @ w + b), x @ w + b, atol=1e-4, rtol=1e-4)


def test_kvf_methods_takes_names_as_kvf_run_does(capsys, monkeypatch):
    """`kvf methods cacheblend,prophetkv` and `kvf methods all` said "unknown method"; they name the methods as
    `kvf run -m` takes them."""
    from conftest import run_cli
    from kvf.pipeline.fusion.methods.base import method_names
    assert run_cli(["methods", "cacheblend,prophetkv", "full", "--names"], capsys, monkeypatch)[1].strip() == \
        "cacheblend,prophetkv,full"
    assert run_cli(["methods", "all", "--names"], capsys, monkeypatch)[1].strip() == ",".join(method_names())


def test_kvfuse_sinks_after_top_without_sinks_is_refused_in_one_line():
    """sinks_after_top only says which chunks get sink_tokens' sinks; alone it would change nothing without a word."""
    with pytest.raises(KvfError, match=r"^--sinks-after-top 2: places the sinks that sink_tokens asks for; give sink_tokens"):
        get_method("kvfuse", 0.15, sinks_after_top=2)
    assert get_method("kvfuse", 0.15, sinks_after_top=2, sink_tokens=8).knobs.sinks_after_top == 2
    with pytest.raises(KvfError, match=r"^--locate-from 0.6: a band of layers for sinks_after_top, score_layers=band, band_weight or hop_seeds=band, and none is given; add"):
        get_method("kvfuse", 0.15, sink_tokens=8, locate_from=0.6)
    with pytest.raises(KvfError, match=r"^--locate-to 0.5: must be above locate_from \(0.6\)"):
        get_method("kvfuse", 0.15, sink_tokens=8, sinks_after_top=1, locate_from=0.6, locate_to=0.5)


@pytest.mark.parametrize("name, knobs", [("kvfuse", {}), ("ape", {}), ("cachefocus", {"prune_every": 4}),
                                         ("cacheblend", {})])
def test_a_cache_teacher_forced_on_its_own_answer_gives_decodings_logits(answerer, long_case, name, knobs):
    """Answerer.predictions (kvf run's answer_kl_full / answer_agree_full) reads a fused cache as decoding
    reads it: given the method's own greedy answer, each row is the logits decoding had there (<= 1e-3),
    so it picks every token of it. kvfuse's shift runs after the first token, APE decodes with its
    calibration, CacheFocus decodes from a compacted cache."""
    prompt, source, _ = long_case
    method = get_method(name, 0.0 if name in ("ape", "cachefocus") else 0.15, **knobs)
    decoded = method.prefill(answerer.engine, prompt, source, 10)
    model, cache, position = answerer.transformer, decoded.cache, decoded.next_position
    stepwise, tokens = [decoded.logits], []
    for _ in range(8):   # greedy decoding, one step at a time, keeping each step's logits
        tokens.append(int(stepwise[-1].argmax()))
        stepwise.append(model.decode_step(tokens[-1], position, cache, decoded.calibration))
        position += 1
    fused = method.prefill(answerer.engine, prompt, source, 10)
    steps = answerer.predictions(fused, tokens)                                  # [8, vocab]
    assert (steps - torch.stack(stepwise[:-1])).abs().max().item() <= 1e-3
    assert steps.argmax(-1).tolist() == tokens


@pytest.mark.parametrize("name, knobs", [("kvfuse", {}), ("ape", {}), ("cachefocus", {"prune_every": 4}),
                                         ("cacheblend", {})])
def test_predictions_that_start_from_decodings_own_logits_equal_a_whole_teacher_forced_pass(answerer, long_case,
                                                                                              name, knobs):
    """kvf run's answer_kl_full takes the rows decoding already computed while its answer was full's from
    decoding (kept with keep_logits) and feeds only full's later tokens over the decoded cache: the same
    logits (<= 1e-3) as feeding them all over a fresh prefill. Batched decoding (kvfuse, CacheFocus,
    CacheBlend) and decoding alone with a calibration (APE) both keep them."""
    from kvf.pipeline.model.decode import known_steps
    prompt, source, _ = long_case
    method = get_method(name, 0.0 if name in ("ape", "cachefocus") else 0.15, **knobs)
    answer = answerer.decode_many(prompt, [answerer.prefill(prompt, method, source, 12)], 12, keep_logits=True)[0]
    same = min(4, len(answer.token_ids))
    assert same >= 2 and answer.step_logits.shape[0] >= len(answer.token_ids)
    after = answer.token_ids[same] if len(answer.token_ids) > same else None   # full's next token is another
    tokens = answer.token_ids[:same] + [t for t in range(200, 210) if t != after][:4]
    assert known_steps(answer.step_logits, answer.token_ids, tokens) == same + 1
    got = answerer.predictions(answer.fused, tokens, answer)                     # [same + 4, vocab]
    want = answerer.predictions(method.prefill(answerer.engine, prompt, source, 12), tokens)
    assert got.shape == want.shape == (same + 4, want.shape[1])
    assert (got - want).abs().max().item() <= 1e-3


def test_predictions_of_a_questions_answers_in_one_batch_equal_each_alone(answerer, long_case):
    """kvf run's answer_kl_full teacher-forces full's answer over every answer's cache in one batched pass
    (Answerer.predictions_many): each answer's rows equal Answerer.predictions on it alone (<= 1e-3), for caches
    decoded in a batch (kvfuse's shift, CacheFocus' compacted cache, CacheBlend) and alone with APE's calibration,
    and for full prefill's own cache, whose first rows decoding already knew."""
    prompt, source, full = long_case
    methods = [get_method("full"), get_method("kvfuse", 0.15), get_method("cachefocus", 0.0, prune_every=4),
               get_method("cacheblend", 0.15), get_method("ape", 0.0)]
    prefilled = [answerer.prefill(prompt, m, None if m.name == "full" else source, 12) for m in methods]
    answers = answerer.decode_many(prompt, prefilled, 12, keep_logits=True)
    full_ids = answers[0].token_ids
    assert len(full_ids) >= 5
    tokens = full_ids[:4] + [t for t in range(200, 210) if t != full_ids[4]][:4]   # every answer parts at 4 or before
    alone = [answerer.predictions(a.fused, tokens, a) for a in answers]          # per answer [T, vocab]
    batched = answerer.predictions_many(answers, tokens)
    for got, want in zip(batched, alone):
        assert got.shape == want.shape == (len(tokens), want.shape[1])
        assert (got - want).abs().max().item() <= 1e-3
    assert torch.equal(batched[0][:5], answers[0].step_logits[:5])                # known rows: decoding's own
