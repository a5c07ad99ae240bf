"""The functional layer-by-layer forward must match the HF model's own forward (<= 1e-4)."""
import pytest
import torch

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
