"""Answering one question: build the prompt, fuse with a method, decode. Times every stage.

TTFT (`first_token`) runs from the request start to the first generated token and includes
loading stored KVs, selection and recomputation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvf.pipeline.model.decode import (Forced, Generation, Pending, greedy_decode, greedy_decode_batch, known_steps,
                                       teacher_forced_batch)
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
    decoded_with: int = 1  # answers decoded in the same batch (decode seconds are the batch's, shared)
    token_ids: list[int] = field(default_factory=list)   # the answer's tokens, as generated
    step_logits: torch.Tensor | None = None   # [steps, vocab] decoding's logits, when kept (decode_many's keep_logits)

    def record(self) -> dict:
        return {"answer": self.text, "prompt_tokens": self.prompt.n_tokens,
                "chunk_tokens": self.prompt.n_chunk_tokens, "recomputed_tokens": self.fused.recomputed_tokens,
                "recomputed_token_layers": self.fused.recomputed_token_layers, "answer_tokens": len(self.token_ids),
                "timings": {k: round(v, 6) for k, v in self.timings.items()}}


def decode_timings(timings: dict, fused: FusionResult, generation: Generation) -> dict:
    """A request's timings with decoding's: decode includes the work its method put off until after the
    first token (fused.after_first_token_seconds, run when decoding first read the cache), also shown
    on its own as after_first_token."""
    decode = dict(timings, decode=generation.decode_seconds + fused.after_first_token_seconds)
    if fused.after_first_token_seconds:
        decode["after_first_token"] = fused.after_first_token_seconds
    return decode


def forced(fused: FusionResult, tokens: list[int], decoded: Answer | None) -> Forced:
    """Teacher forcing of `tokens` over fused's cache, with the rows decoding already computed as known."""
    known = known_steps(decoded.step_logits, decoded.token_ids, tokens) if decoded is not None else 0
    rows = decoded.step_logits[:known] if known else fused.logits[None]                   # [k, vocab]
    return Forced(rows, fused.cache, fused.prefill_rows, fused.next_position, fused.calibration)


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
        """One request: the fused prefill (TTFT), then greedy decoding."""
        fused, timings = self.prefill(prompt, method, source, max_new_tokens)
        generation = greedy_decode(self.transformer, self.tokenizer, fused.logits, fused.cache, fused.next_position,
                                   max_new_tokens, stop_strings or self.template.stop_strings, fused.calibration)
        return Answer(generation.text, prompt, fused, decode_timings(timings, fused, generation),
                      token_ids=generation.token_ids)

    @torch.inference_mode()
    def predictions(self, fused: FusionResult, tokens: list[int], decoded: Answer | None = None) -> torch.Tensor:
        """[T, vocab]: how fused's cache predicts each of `tokens` (e.g. full prefill's answer) from the ones
        before it, after decoding (its kept-until-after-the-first-token work included, as decoding reads it).
        decoded: fused's own answer, decoded with its logits kept: the rows its decoding already computed
        (while its tokens were `tokens`') are taken from it, and only the rest is computed."""
        return teacher_forced_batch(self.transformer, [forced(fused, tokens, decoded)], tokens)[0]

    @torch.inference_mode()
    def predictions_many(self, answers: list[Answer], tokens: list[int]) -> list[torch.Tensor]:
        """predictions(a.fused, tokens, a) for each of a question's answers (decoded with their logits kept),
        in one batched pass (teacher_forced_batch). -> per answer, [T, vocab]."""
        return teacher_forced_batch(self.transformer, [forced(a.fused, tokens, a) for a in answers], tokens)

    @torch.inference_mode()
    def prefill(self, prompt: FusedPrompt, method: FusionMethod, source: LayerKVSource | None,
                max_new_tokens: int = 32, shared: dict | None = None) -> tuple[FusionResult, dict]:
        """The timed part of a request: load + fuse + first token. -> (result, timings incl. first_token).
        shared: see FusionEngine.fuse; work taken from it is charged at its full cost."""
        started = time.perf_counter()
        fused = method.prefill(self.engine, prompt, source, max_new_tokens, shared)
        int(torch.argmax(fused.logits))  # TTFT ends when the first token exists (on CUDA this also syncs)
        elapsed = time.perf_counter() - started + fused.info.get("charged_seconds", 0.0)
        return fused, dict(fused.timings, first_token=elapsed)

    @torch.inference_mode()
    def decode_many(self, prompt: FusedPrompt, prefilled: list[tuple[FusionResult, dict]], max_new_tokens: int = 32,
                    stop_strings: tuple[str, ...] = (), keep_logits: bool = False) -> list[Answer]:
        """Decode several prefilled answers of one prompt together (greedy_decode_batch); answers whose
        decoding needs its own attention (a calibration) are decoded alone. keep_logits: keep each step's
        logits on the answers (for predictions)."""
        stop_strings = stop_strings or self.template.stop_strings
        batched = [i for i, (f, _) in enumerate(prefilled) if f.calibration is None and not self.transformer.sliding_window]
        generations = dict(zip(batched, greedy_decode_batch(
            self.transformer, self.tokenizer, [Pending(prefilled[i][0].logits, prefilled[i][0].cache,
                                                       prefilled[i][0].next_position) for i in batched],
            max_new_tokens, stop_strings, keep_logits))) if batched else {}
        answers = []
        for i, (fused, timings) in enumerate(prefilled):
            generation = generations.get(i) or greedy_decode(
                self.transformer, self.tokenizer, fused.logits, fused.cache, fused.next_position, max_new_tokens,
                stop_strings, fused.calibration, keep_logits)
            answer = Answer(generation.text, prompt, fused, decode_timings(timings, fused, generation),
                            token_ids=generation.token_ids, step_logits=generation.step_logits)
            answer.decoded_with = len(batched) if i in generations else 1
            answers.append(answer)
        return answers
