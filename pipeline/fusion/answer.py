"""Answering one question: build the prompt, fuse with a method, decode. Times every stage.

TTFT (`first_token`) runs from the request start to the first generated token and includes
loading stored KVs, selection and recomputation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvf.pipeline.model.decode import greedy_decode
from kvf.pipeline.fusion.engine import FusionEngine, FusionResult, LayerKVSource
from kvf.pipeline.model.forward import Transformer
from kvf.pipeline.fusion.methods import FusionMethod
from kvf.pipeline.model.prompt import FusedPrompt, PromptTemplate, build_prompt, make_template


@dataclass
class Answer:
    text: str
    prompt: FusedPrompt
    fused: FusionResult
    timings: dict          # load, select, recompute, first_token, decode (seconds)

    def record(self) -> dict:
        return {"answer": self.text, "prompt_tokens": self.prompt.n_tokens,
                "chunk_tokens": self.prompt.n_chunk_tokens, "recomputed_tokens": self.fused.recomputed_tokens,
                "recomputed_token_layers": self.fused.recomputed_token_layers,
                "timings": {k: round(v, 6) for k, v in self.timings.items()}}


class Answerer:
    """A loaded model with its engine and prompt template, ready to answer many questions."""

    def __init__(self, hf_model, tokenizer):
        self.tokenizer = tokenizer
        self.transformer = Transformer(hf_model)
        self.engine = FusionEngine(self.transformer)
        self.template: PromptTemplate = make_template(tokenizer)

    def prompt(self, chunks: list[list[int]], question: str) -> FusedPrompt:
        return build_prompt(self.template, chunks, question)

    @torch.inference_mode()
    def answer(self, prompt: FusedPrompt, method: FusionMethod, source: LayerKVSource | None,
               max_new_tokens: int = 32, stop_strings: tuple[str, ...] = ()) -> Answer:
        started = time.perf_counter()
        fused = method.prefill(self.engine, prompt, source, max_new_tokens)
        int(torch.argmax(fused.logits))  # TTFT ends when the first token exists (on CUDA this also syncs)
        ttft = time.perf_counter() - started
        generation = greedy_decode(self.transformer, self.tokenizer, fused.logits, fused.cache, fused.next_position,
                                   max_new_tokens, stop_strings, fused.calibration)
        timings = dict(fused.timings, first_token=ttft, decode=generation.decode_seconds)
        return Answer(generation.text, prompt, fused, timings)
