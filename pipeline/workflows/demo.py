"""The demo flow, kept out of the CLI so tests can call it: RULER-style samples -> build-cache -> run.

The demo asks what the embedded 135M model answers right with full prefill: RULER's `boundary` task, a magic
number whose sentence is cut by a chunk boundary ("... for kernel is:" ends one chunk, "6682266." opens the
next). Full prefill reads it; plain reuse, whose chunks never saw each other, does not; a fusion method that
recomputes the right tokens does. (On the two-hop questions of `kvf data synthetic`, the demo's set before, the
model misses gold with full prefill too.) `results/ruler.md` measures this task at 2K with intervals."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kvf.pipeline.data.ruler import make_ruler
from kvf.pipeline.records import read_records
from kvf.pipeline.workflows.build import BuildOptions, build_cache, summary_table
from kvf.pipeline.workflows.run import RunOptions, run
from kvf.pipeline.workflows.weights import open_model

DEMO_METHODS = ["full", "reuse", "cacheblend"]
DEMO_TASK, DEMO_LENGTH, DEMO_SEED = "boundary", 1024, 0   # 4 chunks of 256 tokens a question: ~1.2 s of full prefill


def run_demo(model: str | None, n_questions: int, ratio: float, max_new_tokens: int, workspace: Path,
             console: Console) -> list[dict]:
    data = workspace / "ruler"
    make_ruler(data, open_model(model).tokenizer, [DEMO_TASK], DEMO_LENGTH, n_questions, DEMO_SEED)
    console.print(f"RULER-style {DEMO_TASK} task, {DEMO_LENGTH} tokens: {n_questions} question"
                  f"{'s' if n_questions > 1 else ''} -> {data}", markup=False)
    summary = build_cache(BuildOptions(corpus=data / "corpus", workspace=workspace / "ws", model=model,
                                       variants=("prefix",), n_neighbours=3), console)
    console.print(summary_table(summary))
    out = workspace / "runs" / "demo.jsonl"
    run(RunOptions(dataset=data, methods=DEMO_METHODS, ratios=[ratio], out=out, workspace=workspace / "ws",
                   model=model, max_new_tokens=max_new_tokens, compare_full=False, overwrite=True), console)
    return [r.model_dump(mode="json") for r in read_records(out)]
