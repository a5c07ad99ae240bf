"""Rotary position embeddings: rotate keys to any positions, and move stored keys between positions.

We reuse the model's own HF rotary module for the frequencies, so every RoPE variant the family
ships (default, llama3, linear, yarn) gets exactly the model's numbers. Variants whose frequencies
depend on the sequence length (dynamic NTK, longrope) cannot be re-positioned exactly: refused.
"""
from __future__ import annotations

import torch

from kvf.errors import KvfError

POSITION_INDEPENDENT_ROPE = ("default", "llama3", "linear", "yarn")


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


class Rope:
    def __init__(self, rotary_emb: torch.nn.Module, config):
        kind = rope_type(config)
        if kind not in POSITION_INDEPENDENT_ROPE:
            raise KvfError(f"rope_scaling type '{kind}' of this model depends on sequence length, so stored keys "
                           f"cannot be re-positioned exactly; kvf supports {', '.join(POSITION_INDEPENDENT_ROPE)}")
        self.rotary_emb = rotary_emb
        self.scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))

    def cos_sin(self, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [t] -> cos, sin [t, head_dim] (attention scaling folded in, as HF does)."""
        device = self.rotary_emb.inv_freq.device
        dummy = torch.empty(1, dtype=dtype, device=device)
        cos, sin = self.rotary_emb(dummy, positions.to(device)[None, :])  # [1, t, head_dim]
        return cos[0], sin[0]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, t, head_dim] (before RoPE), cos/sin [t, head_dim] -> x rotated to those positions."""
    return x * cos + rotate_half(x) * sin


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """Inverse of apply_rope: the rotation is orthogonal, so rotate by -angle and undo the scale."""
    return (x * cos - rotate_half(x) * sin) / (scaling * scaling)


def keys_before_rope(keys: torch.Tensor, rope: Rope, positions: torch.Tensor) -> torch.Tensor:
    """keys [heads, t, head_dim] rotated at positions -> the same keys before RoPE."""
    cos, sin = rope.cos_sin(positions, keys.dtype)
    return unapply_rope(keys, cos, sin, rope.scaling)


def keys_at(keys: torch.Tensor, rope: Rope, positions: torch.Tensor) -> torch.Tensor:
    """keys [heads, t, head_dim] before RoPE -> rotated at positions."""
    cos, sin = rope.cos_sin(positions, keys.dtype)
    return apply_rope(keys, cos, sin)


def reposition_keys(keys: torch.Tensor, rope: Rope, from_positions: torch.Tensor,
                    to_positions: torch.Tensor) -> torch.Tensor:
    """keys [heads, t, head_dim] rotated at from_positions -> the same keys rotated at to_positions."""
    return keys_at(keys_before_rope(keys, rope, from_positions), rope, to_positions)
