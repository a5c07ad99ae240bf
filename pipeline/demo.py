"""The demo flow, kept out of the CLI so tests can call it."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from kvf.eval.synthetic import make_synthetic
from kvf.pipeline.answer import Answerer
from kvf.pipeline.engine import InMemoryKV
from kvf.pipeline.methods import get_method
from kvf.pipeline.prompt import encode

DEMO_METHODS = (("full", 1.0), ("reuse", 0.0), ("cacheblend", None))


def run_demo(model: str | None, n_questions: int, ratio: float, max_new_tokens: int, workspace: Path,
             console: Console) -> list[dict]:
    questions = make_synthetic(None, n_questions=n_questions, passages_per_question=4, seed=0)
    with console.status("loading the model (the first run converts the embedded GGUF once, ~20 s)"):
        answerer = Answerer.load(model)
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("answering", total=n_questions * len(DEMO_METHODS))
        for q in questions:
            chunks = [encode(answerer.tokenizer, p.text) for p in q.contexts]
            prompt = answerer.prompt(chunks, q.question)
            source = InMemoryKV([answerer.engine.chunk_kv(seg, prompt.prefix_ids, None) for seg in prompt.chunk_segments])
            for name, method_ratio in DEMO_METHODS:
                method = get_method(name, recompute_ratio=ratio if method_ratio is None else method_ratio)
                answer = answerer.answer(prompt, method, source if method.uses_store else None, max_new_tokens)
                rows.append({"question": q.question, "gold": q.answers, "method": name, **answer.record()})
                progress.advance(task)
    return rows
