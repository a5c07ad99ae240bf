"""`kvf run`: answer questions with one or more fusion methods at one or more recompute ratios."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvf.cli.options import (DeviceOption, DtypeOption, RayOption, S3EndpointOption, ThreadsOption, WorkspaceModelOption,
                             WorkersOption, check_ray_flags, use_store_flags, with_method_knobs)

console = Console(stderr=True)


@with_method_knobs
def run_command(
    out: Path = typer.Option(..., "--out", "-o", help="Run file (JSON lines); re-running skips questions already in it."),
    method: str = typer.Option(..., "--method", "-m", "--methods", help="Fusion method(s), comma-separated, or all (see `kvf methods`); an entry NAME:KNOB=VALUE "
                                "or NAME:CONFIGURATION (kvfuse:tuned) runs with its own knobs, labelled by them."),
    dataset: Optional[Path] = typer.Option(None, "--dataset", "-d", help="Prepared dataset dir (corpus/ + questions.jsonl), see `kvf data`."),
    questions: Optional[Path] = typer.Option(None, "--questions", "-q", help="Your own questions, JSON Lines {question, answers?, id?, passages?}, answered from --workspace."),
    ratio: Optional[str] = typer.Option(None, "--ratio", "-r", "--ratios", show_default=False, help="Recompute ratio in [0, 1], a comma list to sweep (0,0.05,0.15,0.3,1), or auto (loading controller) [default: 0.15]."),
    quality_floor: Optional[float] = typer.Option(None, "--quality-floor", min=0.0, max=1.0, show_default=False, help="With --ratio auto: never recompute less than this [default: 0.15]."),
    workspace: Optional[Path] = typer.Option(None, "--workspace", "-w", help="Workspace from build-cache [default: DATASET/workspace with --dataset, else ./workspace]."),
    variant: Optional[str] = typer.Option(None, "--variant", help="Stored KV variant: prefix or fusion [default: each method's own]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", "-k", "--k", min=1, show_default=False, help="Chunks retrieved per question in the shared setting [default: 5]."),
    limit: Optional[int] = typer.Option(None, "--limit", "-n", "--n", min=1, help="Answer only the first N questions [default: all]."),
    offset: int = typer.Option(0, "--offset", min=0, help="Skip the first N questions (with -n: a held-out slice, e.g. --offset 100 -n 50)."),
    setting: str = typer.Option("auto", "--setting", help="per-question (the question's own passages), shared (retrieve from the workspace), or auto: per-question where the questions name several passages, or are your own (-q, or `kvf data prepare custom`) and name any; else shared."),
    retriever: Optional[str] = typer.Option(None, "--retriever", show_default=False, help="bm25 or dense, in the shared setting [default: bm25, or dense in a workspace without a BM25 index]."),
    compare_full: bool = typer.Option(False, "--compare-full/--no-compare-full", help="Also run full prefill; record its answer, its TTFT, and the first-token KL and top-1 agreement."),
    model: WorkspaceModelOption = None,
    neighbours: Optional[int] = typer.Option(None, "--neighbours", min=1, show_default=False, help="FusionRAG's top-n similar chunks, when run creates the workspace [default: 10; an existing workspace keeps its own]."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1, help="Longest answer to generate."),
    pipeline: bool = typer.Option(True, "--pipeline/--no-pipeline", help="Read the next layers from the store while computing this one."),
    label: Optional[str] = typer.Option(None, "--label", help="Name this run, to compare runs of one method with other models or settings."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out instead of resuming it."),
    show_answers: bool = typer.Option(True, "--show-answers/--no-show-answers", help="Print a table of the answers at the end, then (several questions) each row's means as kvf eval scores them."),
    qid: Optional[str] = typer.Option(None, "--qid", help="Answer only these question ids, comma-separated."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Run each method once untimed first, so TTFT leaves out one-time set-up."),
    share: bool = typer.Option(True, "--share/--no-share", help="Do each piece of a question's work once for all methods (the query-only pass and its loaded cache per variant, batched decoding; each record still pays its full cost). --no-share: every request alone."),
    device: DeviceOption = "cpu",
    dtype: DtypeOption = None,
    store: Optional[str] = typer.Option(None, "--store", help="KV store path or URL (s3://bucket/prefix) [default: the workspace's]."),
    s3_endpoint: S3EndpointOption = None,
    ray: RayOption = None,
    workers: WorkersOption = None,
    threads: ThreadsOption = None,
    **knobs,
):
    """Answer every question with each method and ratio; one JSON line per question, method and ratio."""
    from kvf.errors import KvfError
    from kvf.pipeline.workflows.run import RunOptions, parse_methods, parse_ratios, run
    from kvf.pipeline.fusion.controller import DEFAULT_QUALITY_FLOOR
    from kvf.pipeline.fusion.methods.base import DEFAULT_RATIO
    use_store_flags(store, s3_endpoint)   # store None: the workspace's, which may be on S3
    check_ray_flags(ray, workers, threads)
    methods = parse_methods(method)
    check_ratio_used(ratio, quality_floor, methods)
    ratio = f"{DEFAULT_RATIO:g}" if ratio is None else ratio
    quality_floor = DEFAULT_QUALITY_FLOOR if quality_floor is None else quality_floor
    auto = ratio.strip() == "auto"
    if auto:
        ratios = [quality_floor]
    else:
        ratios = parse_ratios(ratio)
    if (dataset is None) == (questions is None):
        raise KvfError("pass either --dataset DIR (a prepared directory) or --questions FILE (with --workspace)")
    check_not_a_question(questions, workspace)
    opts = RunOptions(dataset=dataset, questions=questions, methods=methods, ratios=ratios, out=out,
                      workspace=workspace, variant=variant, top_k=top_k, limit=limit, offset=offset, setting=setting,
                      retriever=retriever, compare_full=compare_full, model=model, max_new_tokens=max_new_tokens,
                      pipeline=pipeline, knobs=knobs, device=device, dtype=dtype, n_neighbours=neighbours,
                      auto_ratio=auto, quality_floor=quality_floor, label=label, overwrite=overwrite,
                      qids=[q.strip() for q in qid.split(",") if q.strip()] if qid else None, warmup=warmup,
                      share=share, store=store, ray=ray, workers=workers, threads=threads or RunOptions.threads)
    path = run(opts, console)
    if show_answers:
        from kvf.cli.tables import answers_table, means_table
        Console().print(answers_table(path, opts))
        if (means := means_table(path, Console().width)) is not None:
            Console().print(means)
    console.print(f"runs written to {path}", highlight=False, markup=False)


def check_ratio_used(ratio: str | None, quality_floor: float | None, methods) -> None:
    """A --ratio (or --quality-floor) given for methods that recompute a fixed amount would be dropped
    without a word (`-m full -r 0.3` is full prefill): refused, as a knob no listed method takes is."""
    from kvf.errors import KvfError
    from kvf.pipeline.fusion.methods import METHODS
    from kvf.pipeline.workflows.run import parse_method_spec
    if quality_floor is not None and (ratio or "").strip() != "auto":
        raise KvfError(f"--quality-floor {quality_floor:g} is used with --ratio auto only; add -r auto, or leave it out")
    names = sorted({parse_method_spec(entry).name for entry in methods})
    if ratio is not None and not any(METHODS[name].ratio_is_knob for name in names):
        they = f"{names[0]} recomputes a fixed amount and takes" if len(names) == 1 else \
            f"{', '.join(names)} recompute a fixed amount and take"
        raise KvfError(f"--ratio {ratio}: {they} no ratio; leave --ratio out, or add a method that takes one "
                       "(see `kvf methods`)")


def check_not_a_question(questions: Path | None, workspace: Path | None) -> None:
    """`kvf run -q "Who founded Acme?"`: the question itself where its file goes; kvf ask takes one question."""
    from kvf.errors import KvfError
    text = str(questions)
    a_file_name = text.lower().endswith((".jsonl", ".json", ".gz", ".txt", ".csv"))   # a missing file: said later
    if questions is not None and not questions.exists() and not a_file_name and (text.endswith("?") or len(text.split()) > 2):
        raise KvfError(f"--questions {text!r}: no such file; -q takes a JSON Lines file of questions; to ask one "
                       f"question without a file: kvf ask {text!r} -w {workspace or 'workspace'}")
