"""The demo flow, kept out of the CLI so tests can call it: synthetic corpus -> build-cache -> run."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kvf.pipeline.data.synthetic import make_synthetic
from kvf.pipeline.records import read_records
from kvf.pipeline.workflows.build import BuildOptions, build_cache, summary_table
from kvf.pipeline.workflows.run import RunOptions, run

DEMO_METHODS = ["full", "reuse", "cacheblend"]


def run_demo(model: str | None, n_questions: int, ratio: float, max_new_tokens: int, workspace: Path,
             console: Console) -> list[dict]:
    data = workspace / "synthetic"
    make_synthetic(data, n_questions=n_questions, passages_per_question=4, seed=0)
    console.print(f"synthetic two-hop corpus: {n_questions} questions -> {data}", markup=False)
    summary = build_cache(BuildOptions(corpus=data / "corpus", workspace=workspace / "ws", model=model,
                                       variants=("prefix",), n_neighbours=3), console)
    console.print(summary_table(summary))
    out = workspace / "runs" / "demo.jsonl"
    run(RunOptions(dataset=data, methods=DEMO_METHODS, ratios=[ratio], out=out, workspace=workspace / "ws",
                   model=model, max_new_tokens=max_new_tokens, compare_full=False, overwrite=True), console)
    return [r.model_dump(mode="json") for r in read_records(out)]
