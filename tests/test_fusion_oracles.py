"""Oracle tests of the fused-prefill engine: whenever a method recomputes everything (or reuses
only what is exact), its first-token logits and greedy answer equal full prefill."""
import pytest
import torch

from kvf.errors import KvfError
from kvf.pipeline.fusion.engine import FusionPlan, recompute_budget
from kvf.pipeline.fusion.sources import InMemoryKV
from kvf.pipeline.fusion.methods import get_method, method_names
from kvf.pipeline.model.prompt import encode

TOL = 1e-3


def stored_kvs(engine, prompt):
    """Each chunk's `prefix`-variant KV: prefilled right after S."""
    return InMemoryKV([engine.chunk_kv(seg, prompt.prefix_ids, None) for seg in prompt.chunk_segments])


@pytest.fixture(scope="module")
def embedded_case(answerer, short_docs):
    prompt = answerer.prompt([encode(answerer.tokenizer, d) for d in short_docs],
                             "In which province was Zorvan Pellick born?")
    full = answerer.answer(prompt, get_method("full"), None, max_new_tokens=12)
    return prompt, stored_kvs(answerer.engine, prompt), full


def test_cacheblend_v_deviation_and_later_check_layer_at_ratio_one(answerer, embedded_case):
    prompt, source, full = embedded_case
    method = get_method("cacheblend", recompute_ratio=1.0, deviation="v", check_layer=3)
    got = method.prefill(answerer.engine, prompt, source)
    assert (got.logits - full.fused.logits).abs().max().item() <= TOL


def test_reuse_of_single_chunk_equals_full(answerer, short_docs):
    prompt = answerer.prompt([encode(answerer.tokenizer, short_docs[0])], "Where was Zorvan Pellick born?")
    full = answerer.answer(prompt, get_method("full"), None, max_new_tokens=10)
    got = answerer.answer(prompt, get_method("reuse"), stored_kvs(answerer.engine, prompt), max_new_tokens=10)
    assert (got.fused.logits - full.fused.logits).abs().max().item() <= TOL
    assert got.text == full.text


def test_reuse_of_several_chunks_differs_from_full(answerer, embedded_case):
    """Guards the oracles: cross-chunk attention really is missing in full reuse."""
    prompt, source, full = embedded_case
    got = get_method("reuse").prefill(answerer.engine, prompt, source)
    assert (got.logits - full.fused.logits).abs().max().item() > 1e-2


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.15, 0.3, 0.5, 0.77])
def test_cacheblend_recomputes_exactly_round_r_n(answerer, embedded_case, ratio):
    prompt, source, _ = embedded_case
    got = get_method("cacheblend", recompute_ratio=ratio).prefill(answerer.engine, prompt, source)
    expected = int(ratio * prompt.n_chunk_tokens + 0.5)
    assert got.recomputed_tokens == expected == recompute_budget(ratio, prompt.n_chunk_tokens)
    # Layer 0 recomputes every chunk token; later layers only the selected ones. At ratio 0 none is
    # kept, so nothing is recomputed at all: CacheBlend is reuse (FusionMethod.is_reuse).
    n_layers = answerer.transformer.n_layers
    layer0 = prompt.n_chunk_tokens if ratio > 0 else 0
    assert got.recomputed_token_layers == layer0 + (n_layers - 1) * expected


@pytest.mark.parametrize("ratio,first", [(0.2, None), (0.1, 0.5)])
def test_cacheblend_gradual_filtering_narrows_over_two_layers(answerer, embedded_case, ratio, first):
    """Gradual filtering (§4.3): every chunk token at layer 0, r1 (default 2r) from the check layer,
    r from the next layer on; the final budget is still round(r * n)."""
    prompt, source, _ = embedded_case
    n, n_layers = prompt.n_chunk_tokens, answerer.transformer.n_layers
    got = get_method("cacheblend", recompute_ratio=ratio, gradual=True, gradual_first=first).prefill(
        answerer.engine, prompt, source)
    r1 = recompute_budget(2 * ratio if first is None else first, n)
    r = recompute_budget(ratio, n)
    assert r1 > r and got.recomputed_tokens == r
    assert got.recomputed_token_layers == n + r1 + (n_layers - 2) * r


def test_cacheblend_gradual_filtering_at_ratio_one_equals_full(answerer, embedded_case):
    prompt, source, full = embedded_case
    got = get_method("cacheblend", recompute_ratio=1.0, gradual=True).prefill(answerer.engine, prompt, source)
    assert (got.logits - full.fused.logits).abs().max().item() <= TOL


def test_cacheblend_picks_the_most_deviating_tokens(answerer, embedded_case):
    """With a poisoned stored chunk (its KV replaced by noise), CacheBlend's selection lands there."""
    prompt, source, _ = embedded_case
    poisoned = [kv.clone() for kv in source.chunk_kvs]
    poisoned[1] = poisoned[1] + 5 * torch.randn_like(poisoned[1])
    budget_ratio = len(prompt.chunk_segments[1]) / prompt.n_chunk_tokens
    method = get_method("cacheblend", recompute_ratio=budget_ratio)
    engine = answerer.engine
    state = engine.start(prompt, InMemoryKV(poisoned), FusionPlan(torch.arange(
        prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens)))
    engine.step(state, 0)
    method.before_layer(engine, state, 1)
    start, end = prompt.chunk_spans()[1]
    assert torch.equal(state.active_chunk_rows(), torch.arange(start, end))


def test_unknown_method_lists_known_ones():
    with pytest.raises(KvfError) as err:
        get_method("nope")
    for name in ("full", "reuse", "prefix", "cacheblend"):
        assert name in str(err.value)
    assert set(method_names()) >= {"full", "reuse", "prefix", "cacheblend"}


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_ratio_out_of_range_is_refused(ratio):
    with pytest.raises(KvfError, match="--ratio"):
        get_method("cacheblend", recompute_ratio=ratio)


def test_prompt_longer_than_model_positions_is_refused(answerer):
    long_chunk = list(range(100, 200)) * 90  # 9000 tokens > 8192 positions
    prompt = answerer.prompt([long_chunk], "why?")
    with pytest.raises(KvfError, match="positions"):
        answerer.answer(prompt, get_method("full"), None)


def test_empty_question_is_refused(answerer):
    with pytest.raises(KvfError, match="empty question"):
        answerer.prompt([[1, 2, 3]], "   ")
