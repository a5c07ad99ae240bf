"""The loading controller (CacheBlend §5.1): pick the recompute ratio at which recomputing a layer
takes about as long as loading the next one, so pipelined loading is hidden and no compute is
wasted waiting; never go below a quality floor.

    load per layer      = bytes of one layer of every chunk / storage bandwidth
    recompute per layer ~ r * chunk_tokens * seconds per (token x layer)
    r_auto              = clamp(load per layer / (chunk_tokens * seconds per token-layer), floor, 1)
"""
from __future__ import annotations

import time

import torch

DEFAULT_QUALITY_FLOOR = 0.15


def choose_ratio(layer_bytes: int, bandwidth_bytes_per_s: float, chunk_tokens: int,
                 token_layer_seconds: float, quality_floor: float = DEFAULT_QUALITY_FLOOR) -> float:
    """The ratio whose per-layer recompute time equals the per-layer load time, at least the floor."""
    if chunk_tokens <= 0 or token_layer_seconds <= 0 or bandwidth_bytes_per_s <= 0:
        return quality_floor
    load_seconds = layer_bytes / bandwidth_bytes_per_s
    balanced = load_seconds / (chunk_tokens * token_layer_seconds)
    return float(min(1.0, max(quality_floor, balanced)))


def measure_bandwidth(store, keys: list[str], layer: int = 0) -> tuple[int, float]:
    """(bytes of one layer of these entries, bytes/s reading them) — one timed read pass."""
    started = time.perf_counter()
    tensors = [store.get_layer(k, layer) for k in keys]
    seconds = max(1e-9, time.perf_counter() - started)
    layer_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return layer_bytes, layer_bytes / seconds


@torch.inference_mode()
def measure_token_layer_seconds(transformer, n_tokens: int = 256) -> float:
    """Seconds to push one token through one layer, from a small timed prefill (after a warm-up)."""
    ids = torch.randint(0, transformer.config.vocab_size, (n_tokens,), device=transformer.device)
    for _ in range(2):
        cache = transformer.new_cache(n_tokens)
        started = time.perf_counter()
        transformer.prefill(ids, cache)
        if transformer.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    return seconds / (n_tokens * transformer.n_layers)
