"""The functional layer-by-layer forward must match the HF model's own forward (<= 1e-4)."""
import pytest
import torch
import torch.nn.functional as F

from conftest import FAMILIES, tiny_model
from kvf.pipeline.model.forward import Transformer


def hf_last_logits(model, ids):
    with torch.inference_mode():
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_matches_hf(family):
    model = tiny_model(family)
    T = Transformer(model)
    ids = torch.randint(0, 128, (37,))
    cache = T.new_cache(40)
    logits, _ = T.prefill(ids, cache)
    ref = hf_last_logits(model, ids)[-1]
    assert (logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_prefill_in_two_parts_and_decode_match_hf(family):
    """Prefill after a cached prefix, then decode steps, equal the HF logits at each position."""
    model = tiny_model(family, seed=1)
    T = Transformer(model)
    ids = torch.randint(0, 128, (30,))
    ref = hf_last_logits(model, ids)
    cache = T.new_cache(30)
    T.prefill(ids[:12], cache)
    logits, _ = T.prefill(ids[12:25], cache, start=12)
    assert (logits - ref[24]).abs().max().item() <= 1e-4
    for pos in range(25, 30):
        logits = T.decode_step(int(ids[pos]), pos, cache)
        assert (logits - ref[pos]).abs().max().item() <= 1e-4


def test_embedded_model_matches_hf(answerer):
    ids = torch.tensor(answerer.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"])
    cache = answerer.transformer.new_cache(len(ids))
    logits, _ = answerer.transformer.prefill(ids, cache)
    ref = hf_last_logits(answerer.transformer.hf_model, ids)[-1]
    assert (logits - ref).abs().max().item() <= 1e-4


def test_a_pass_places_its_rows_and_rope_tables_once_not_once_per_layer(monkeypatch):
    """On a GPU, a CPU index or position tensor handed to a kernel is first copied, and the copy waits for
    every kernel queued before it: done per layer, the host could never run ahead of the GPU. So a prefill,
    a decoding step and a fusion pass each make their RoPE tables once (not once per layer), a prefill's
    rows go into the cache as a slice, and a fusion pass's scattered rows as one index tensor, reused by
    every layer."""
    from kvf.pipeline.fusion.engine import FusionEngine, FusionPlan
    from kvf.pipeline.model.forward import KVCache
    from kvf.pipeline.model.prompt import FusedPrompt
    T = Transformer(tiny_model("llama"))
    assert T.n_layers > 1
    tables, indexes = [], []
    real_cos_sin, real_write = T.rope.cos_sin, KVCache.write
    monkeypatch.setattr(T.rope, "cos_sin", lambda *a, **k: tables.append(1) or real_cos_sin(*a, **k))
    monkeypatch.setattr(KVCache, "write", lambda self, layer, index, k, v:
                        indexes.append(index) or real_write(self, layer, index, k, v))
    ids = torch.randint(0, 128, (20,))
    cache = T.new_cache(24)
    T.prefill(ids[:12], cache)
    T.prefill(ids[12:], cache, start=12)
    T.decode_step(5, 20, cache)
    assert len(tables) == 3
    assert indexes and all(isinstance(index, slice) for index in indexes)

    engine, prompt = FusionEngine(T), FusedPrompt(ids[:4].tolist(), [ids[4:12].tolist(), ids[12:18].tolist()],
                                                  ids[18:].tolist())
    state = engine.start(prompt, None, FusionPlan(torch.tensor([5, 6, 13]), loaded_chunks=[]))  # rows 5, 6, 13 and Q
    tables.clear(), indexes.clear()
    for layer in range(T.n_layers):
        engine.step(state, layer)
    assert len(tables) == 1                               # the pass's rows: once, for every layer
    scattered = [index for index in indexes if not isinstance(index, slice)]
    assert len(scattered) == T.n_layers and all(index is scattered[0] for index in scattered)



def test_calibrated_attention_leaves_queries_before_queries_from_plain():
    """SpanCalibration (APE): a query at or past queries_from attends to the span [start, end) at temperature T with
    the span's total weight rescaled (softmax over [T * S * lse(span / T), lse(rest)]); one before it attends as
    plain masked attention does, so kvfuse can recompute chunk rows plainly beside a calibrated question."""
    from kvf.pipeline.model.forward import SpanCalibration
    T = Transformer(tiny_model("llama", seed=2))
    g = torch.Generator().manual_seed(0)
    n, t, d = 20, 6, T.head_dim
    q = torch.randn(T.n_heads, t, d, generator=g)
    keys, values = torch.randn(T.n_kv_heads, n, d, generator=g), torch.randn(T.n_kv_heads, n, d, generator=g)
    rows = torch.arange(n - t, n)                                             # the queries' cache rows
    mask = T.causal_mask(rows, n)
    cal = SpanCalibration(3, 16, 0.6, 0.7, queries_from=n - 2)
    got = T.attend(0, q, keys, values, mask, rows=rows, calibration=cal)       # [t, D] after o_proj
    o_proj = lambda out: T.layers[0].self_attn.o_proj(out.transpose(0, 1).reshape(t, -1))   # [H, t, d] -> [t, D]
    group = T.n_heads // T.n_kv_heads
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    plain = o_proj(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=T.scaling)[0])
    before = rows < cal.queries_from
    assert torch.allclose(got[before], plain[before], atol=1e-5)
    scores = (q @ k.transpose(1, 2) * T.scaling).masked_fill(~mask, float("-inf"))     # [H, t, n]
    span = torch.zeros(n, dtype=torch.bool)
    span[3:16] = True
    weights = torch.where(span, torch.exp(scores / 0.6), torch.exp(scores))           # unnormalised, [H, t, n]
    span_sum, rest_sum = (weights * span).sum(-1, keepdim=True), (weights * ~span).sum(-1, keepdim=True)
    span_mass = span_sum ** (0.6 * 0.7)                                                # exp(T S lse_span)
    weights = torch.where(span, weights / span_sum * span_mass, weights)
    expected = o_proj((weights / (span_mass + rest_sum)) @ v)                          # [t, D]
    assert torch.allclose(got[~before], expected[~before], atol=1e-5)
    assert not torch.allclose(got[~before], plain[~before], atol=1e-3)
    everyone = T.attend(0, q, keys, values, mask, rows=rows, calibration=SpanCalibration(3, 16, 0.6, 0.7))
    assert torch.allclose(everyone, expected, atol=1e-5)                       # queries_from 0: every query
    nobody = T.attend(0, q, keys, values, mask, rows=rows, calibration=SpanCalibration(3, 16, 0.6, 0.7, queries_from=n))
    assert torch.allclose(nobody, plain, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forced_logits_are_those_decoding_sees(family):
    """teacher_forced_logits predicts T tokens in one pass over a prefilled cache: row i equals the logits
    decoding has after feeding tokens[:i] one step at a time (<= 1e-4), though other tokens were decoded into
    the rows past the prefill first (they are overwritten, not read)."""
    from kvf.pipeline.model.decode import teacher_forced_logits
    T = Transformer(tiny_model(family, seed=2))
    prompt, tokens = torch.randint(0, 128, (20,)), torch.randint(0, 128, (6,)).tolist()
    stepwise_cache, cache = T.new_cache(28), T.new_cache(28)
    first, _ = T.prefill(prompt, stepwise_cache)
    stepwise = [first] + [T.decode_step(t, 20 + i, stepwise_cache) for i, t in enumerate(tokens[:-1])]
    T.prefill(prompt, cache)
    for i, t in enumerate(torch.randint(0, 128, (7,)).tolist()):   # another answer, decoded into rows 20-26
        T.decode_step(t, 20 + i, cache)
    got = teacher_forced_logits(T, first[None], cache, 20, 20, tokens)              # [6, vocab]
    assert got.shape == (6, 128)
    assert (got - torch.stack(stepwise)).abs().max().item() <= 1e-4
    assert torch.equal(teacher_forced_logits(T, first[None], cache, 20, 20, tokens[:1]), first[None])


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forced_batch_equals_each_cache_teacher_forced_alone(family):
    """teacher_forced_batch runs several caches' fed tokens through each layer's projections and MLP at once and
    attends per cache: each cache's rows equal teacher_forced_logits on it alone (<= 1e-4), for caches of other
    lengths and positions, one whose rows decoding already knew in part, and one whose rows are all known."""
    from kvf.pipeline.model.decode import Forced, teacher_forced_batch, teacher_forced_logits
    T = Transformer(tiny_model(family, seed=2))
    tokens = torch.randint(0, 128, (6,)).tolist()
    items, alone = [], []
    for n, position, known_rows in [(20, 20, 1), (13, 30, 3), (17, 17, 6)]:
        prompt = torch.randint(0, 128, (n,))
        batch_cache, alone_cache = T.new_cache(n + 8), T.new_cache(n + 8)
        first, _ = T.prefill(prompt, batch_cache, positions=torch.arange(position - n, position))
        T.prefill(prompt, alone_cache, positions=torch.arange(position - n, position))
        known = torch.cat([first[None], torch.randn(known_rows - 1, 128)])        # [k, vocab]: rows "decoding" gave
        items.append(Forced(known, batch_cache, n, position))
        alone.append(teacher_forced_logits(T, known, alone_cache, n, position, tokens))   # [6, vocab]
    got = teacher_forced_batch(T, items, tokens)
    for g, want, item in zip(got, alone, items):
        assert g.shape == want.shape == (6, 128)
        assert (g - want).abs().max().item() <= 1e-4
        assert torch.equal(g[:len(item.known)], item.known)   # the known rows are kept, not recomputed
    assert torch.equal(teacher_forced_batch(T, items[2:], tokens)[0], items[2].known)


def test_known_steps_counts_the_rows_decoding_saw_while_its_answer_was_the_forced_one():
    from kvf.pipeline.model.decode import known_steps
    steps = torch.zeros(5, 3)                                                    # 5 steps: 4 tokens, then a stop token
    assert known_steps(steps, [1, 2, 3, 4], [1, 2, 3, 4]) == 4                   # the same answer: every row
    assert known_steps(steps, [1, 2, 3, 4], [1, 2, 9, 4]) == 3                   # rows 0-2: tokens[:2] agree
    assert known_steps(steps, [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]) == 5             # row 4 is the stop token's step
    assert known_steps(steps[:3], [1, 2, 3], [1, 2, 3, 4, 5]) == 3               # stopped by a stop string after 3
    assert known_steps(steps, [1, 2, 3, 4], [7]) == 1                            # row 0: the prefill's own
    assert known_steps(None, [1, 2], [1, 2]) == 0                                # no logits kept


@pytest.mark.parametrize("family", FAMILIES)
def test_attend_every_key_is_grouped_query_attention(family):
    """A decode step's attention, with each KV head's query heads as one block, equals SDPA's GQA (<= 1e-5)."""
    T = Transformer(tiny_model(family, seed=3))
    q = torch.randn(T.n_heads, 2, T.head_dim)                                   # [H, t, d]
    keys, values = torch.randn(2, T.n_kv_heads, 30, T.head_dim).unbind(0)      # [KV, n, d] each
    want = F.scaled_dot_product_attention(q[None], keys[None], values[None], scale=T.scaling, enable_gqa=True)[0]
    assert torch.allclose(T.attend_every_key(q, keys, values), want, atol=1e-5)


def test_decoding_stops_at_the_end_of_turn_that_generation_config_names(tmp_path):
    """Llama-3-Instruct names its end of turn, <|eot_id|>, beside <|end_of_text|> in generation_config.json, where
    its config.json and (early) tokenizer name <|end_of_text|> alone: an answer was decoded past the end of its turn
    until --max-new-tokens. A token named there alone now stops decoding, as transformers' generate() stops."""
    import json
    from conftest import tiny_llama_dir
    from kvf.pipeline.fusion.methods import get_method
    from kvf.pipeline.workflows.weights import load_answerer
    model_dir = tiny_llama_dir(tmp_path / "model")
    question = "In which province was Zorvan Pellick born?"

    def answer():
        answerer = load_answerer(str(model_dir))
        prompt = answerer.prompt([answerer.tokenizer("Quillmarsh is a river town.")["input_ids"]], question)
        return answerer.answer(prompt, get_method("full"), None, max_new_tokens=6)

    free = answer()
    assert len(free.token_ids) == 6
    end_of_turn = free.token_ids[2]   # as if the model ended its turn with its third token
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_of_turn]}))
    stopped = answer()
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(end_of_turn)]


def test_a_base_models_answer_is_its_first_line(tmp_path):
    """A model with no chat template (a base model) gets the plain layout, "... Question: Q\\nAnswer:", and has no end
    of turn: its answer ran on past its line ("Paris\\nQuestion: ...") until --max-new-tokens, and scored against
    gold as wrong. Its answer is now its first line (after any line break it opens with), decoded alone or in a
    batch; a chat model's template stops nothing but its end-of-turn tokens."""
    from transformers import AutoTokenizer
    from conftest import tiny_llama_dir
    from kvf.pipeline.fusion.methods import get_method
    from kvf.pipeline.model.decode import answer_text
    from kvf.pipeline.workflows.weights import load_answerer, open_model
    tokenizer = AutoTokenizer.from_pretrained(open_model(None).model_dir)
    assert answer_text(tokenizer, tokenizer.encode("\nParis\nQuestion: x"), ("\n",)) == ("Paris", True)
    assert answer_text(tokenizer, tokenizer.encode(" Paris"), ("\n",)) == ("Paris", False)
    chat = load_answerer(str(tiny_llama_dir(tmp_path / "chat")))
    assert chat.template.stop_strings == ()
    tokenizer.chat_template = None
    answerer = load_answerer(str(tiny_llama_dir(tmp_path / "base", tokenizer)))
    assert answerer.template.stop_strings == ("\n",)
    prompt = answerer.prompt([tokenizer("Quillmarsh is a river town.")["input_ids"]], "Where is Quillmarsh?")
    full = get_method("full")
    answerer.template.stop_strings = ("\u2603",)   # stops nothing: the random model's free answer
    free = answerer.answer(prompt, full, None, max_new_tokens=8)
    # the random model writes no line break on cue: a piece of its own answer stands in for one
    end = tokenizer.decode(free.token_ids[3:4])
    answerer.template.stop_strings = (end,)
    alone = answerer.answer(prompt, full, None, max_new_tokens=8)
    batched = answerer.decode_many(prompt, [answerer.prefill(prompt, full, None, 8)] * 2, max_new_tokens=8)
    expected = answer_text(tokenizer, free.token_ids, (end,))[0]
    assert len(alone.token_ids) < len(free.token_ids) and alone.text == expected
    assert [a.text for a in batched] == [expected, expected]
