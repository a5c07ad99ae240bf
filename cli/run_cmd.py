"""`kvf run`: answer a prepared dataset with one fusion method at one or more recompute ratios."""
from __future__ import annotations

from pathlib import Path

import typer

from kvf.cli.options import DeviceOption, ModelOption
from rich.console import Console

console = Console(stderr=True)


def run_command(
    dataset: Path = typer.Option(..., "--dataset", "-d", help="Prepared dataset dir (corpus/ + questions.jsonl), see `kvf data`."),
    method: str = typer.Option(..., "--method", "-m", help="Fusion method(s), comma-separated: full, prefix, reuse, pcw, epic, cacheblend, cachecraft, fusionrag, prophetkv, cachefocus."),
    ratio: str = typer.Option("0.15", "--ratio", "-r", help="Recompute ratio in [0, 1], a comma list to sweep (0,0.05,0.15,0.3,1), or auto (loading controller)."),
    quality_floor: float = typer.Option(0.15, "--quality-floor", help="With --ratio auto: never recompute less than this."),
    out: Path = typer.Option(..., "--out", "-o", help="Run file (JSON lines); re-running skips questions already in it."),
    workspace: Path = typer.Option(None, "--workspace", "-w", help="Workspace from build-cache (default: DATASET/workspace, built if absent)."),
    variant: str = typer.Option(None, "--variant", help="Stored KV variant: prefix or fusion (default: the method's own)."),
    top_k: int = typer.Option(5, "--top-k", "-k", help="Chunks retrieved per question in the shared-corpus setting."),
    limit: int = typer.Option(None, "--limit", "-n", help="Answer only the first N questions."),
    setting: str = typer.Option("auto", "--setting", help="per-question (the question's own passages), shared (retrieve from the pooled corpus), or auto."),
    retriever: str = typer.Option("bm25", "--retriever", help="bm25 or dense (shared-corpus setting)."),
    compare_full: bool = typer.Option(False, "--compare-full", help="Also run full prefill; record its answer, first-token KL and top-1 agreement."),
    model: ModelOption = None,
    neighbours: int = typer.Option(10, "--neighbours", help="FusionRAG's top-n similar chunks, used when run creates the workspace (build-cache sets it otherwise)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Longest answer to generate."),
    no_pipeline: bool = typer.Option(False, "--no-pipeline", help="Load each layer synchronously (no read-ahead)."),
    check_layer: int = typer.Option(None, "--check-layer", help="cacheblend: layer where K/V deviation is measured (default 1)."),
    deviation: str = typer.Option(None, "--deviation", help="cacheblend: compare K or V (default k)."),
    gradual: bool = typer.Option(None, "--gradual", help="cacheblend: gradual filtering (§4.3): keep 2r tokens at the check layer, r from the next layer on (default off, as in the authors' code)."),
    prune_every: int = typer.Option(None, "--prune-every", help="cachefocus: prune chunks every N layers (0 = never; default 4)."),
    keep_chunks: int = typer.Option(None, "--keep-chunks", help="cachefocus: chunks kept after pruning (default ceil(k/2))."),
    allocation: str = typer.Option(None, "--allocation", help="cachefocus: re-positioning after pruning, align or sort."),
    alpha: float = typer.Option(None, "--alpha", help="cachecraft: CFO scale α (default: calibrated so the mean recomputed fraction is --ratio)."),
    focus_window: int = typer.Option(None, "--focus-window", help="cachecraft: focused-chunk early termination window W (default off)."),
    device: DeviceOption = "cpu",
):
    """Answer every question of a dataset with one method; one JSON line per question and ratio."""
    from kvf.pipeline.run import RunOptions, parse_ratios, run
    knobs = {"check_layer": check_layer, "deviation": deviation, "gradual": gradual, "prune_every": prune_every,
             "keep_chunks": keep_chunks, "allocation": allocation, "alpha": alpha, "focus_window": focus_window}
    opts = RunOptions(dataset=dataset, methods=[m.strip() for m in method.split(",") if m.strip()], ratios=parse_ratios(ratio), out=out, workspace=workspace,
                      variant=variant, top_k=top_k, limit=limit, setting=setting, retriever=retriever,
                      compare_full=compare_full, model=model, max_new_tokens=max_new_tokens,
                      pipeline=not no_pipeline, knobs=knobs, device=device, n_neighbours=neighbours)
    path = run(opts, console)
    console.print(f"runs written to {path}")
