"""RoPE re-positioning must equal computing the keys at the new positions."""
import pytest
import torch

from conftest import tiny_config, tiny_model
from kvf.errors import KvfError
from kvf.pipeline.model.forward import Transformer
from kvf.pipeline.model.rope import Rope, apply_rope, reposition_keys


@pytest.mark.parametrize("family", ["llama", "llama3rope", "qwen3"])
def test_reposition_equals_keys_computed_at_new_positions(family):
    T = Transformer(tiny_model(family))
    hidden = torch.randn(20, T.config.hidden_size)
    _, k_pre, _ = T.project_qkv(1, hidden)                        # [KV, 20, d], before RoPE
    old_pos, new_pos = torch.arange(5, 25), torch.arange(300, 320)
    k_old = apply_rope(k_pre, *T.rope.cos_sin(old_pos))
    k_direct = apply_rope(k_pre, *T.rope.cos_sin(new_pos))
    k_moved = reposition_keys(k_old, T.rope, old_pos, new_pos)
    assert (k_moved - k_direct).abs().max().item() <= 1e-5
    assert (k_old - k_direct).abs().max().item() > 1e-2          # the move really changed something


def test_embedded_model_reposition(answerer):
    T = answerer.transformer
    hidden = torch.randn(16, T.config.hidden_size)
    _, k_pre, _ = T.project_qkv(0, hidden)
    old_pos, new_pos = torch.arange(0, 16), torch.arange(4000, 4016)
    moved = reposition_keys(apply_rope(k_pre, *T.rope.cos_sin(old_pos)), T.rope, old_pos, new_pos)
    assert (moved - apply_rope(k_pre, *T.rope.cos_sin(new_pos))).abs().max().item() <= 1e-5


def test_sequence_length_dependent_rope_is_refused():
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(KvfError, match="dynamic"):
        Rope(torch.nn.Identity(), config)
