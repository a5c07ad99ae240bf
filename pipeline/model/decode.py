"""Greedy decoding from a fused cache: stop on EOS, a stop string, or --max-new-tokens."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvf.pipeline.model.forward import KVCache, SpanCalibration, Transformer


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    decode_seconds: float


def stop_token_ids(tokenizer, model_config) -> set[int]:
    """EOS from the tokenizer and the generation config (chat models end turns with their own token)."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None:
        ids.add(im_end)
    return ids


@torch.inference_mode()
def greedy_decode(model: Transformer, tokenizer, logits: torch.Tensor, cache: KVCache, next_position: int,
                  max_new_tokens: int = 32, stop_strings: tuple[str, ...] = (),
                  calibration: SpanCalibration | None = None) -> Generation:
    """The first token comes from the prefill's logits [vocab]; each next one from one decode step
    appended to `cache` at RoPE position next_position, next_position + 1, ..."""
    started = time.perf_counter()
    stops = stop_token_ids(tokenizer, model.config)
    token_ids: list[int] = []
    position = next_position
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        if token in stops:
            break
        token_ids.append(token)
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        if any(s in text for s in stop_strings):
            break
        if step + 1 < max_new_tokens:
            logits = model.decode_step(token, position, cache, calibration)
            position += 1
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    for s in stop_strings:
        text = text.split(s)[0]
    return Generation(text.strip(), token_ids, time.perf_counter() - started)
