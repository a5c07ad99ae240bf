"""`kvf data ...`: turn benchmark files into prepared directories (corpus + questions)."""
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from kvf.cli.options import command_group
from kvf.errors import counted
from kvf.pipeline.workflows.display import progress_bar
from kvf.pipeline.data.datasets import ACCEPTED_FORMATS, find_dataset_file, prepare
from kvf.pipeline.data.synthetic import make_synthetic

data_app = command_group("Prepare benchmark data: a corpus of passages plus questions with their context ids.")


@data_app.command("prepare")
def prepare_command(
    name: Annotated[str, typer.Argument(help=f"Dataset name: {', '.join(ACCEPTED_FORMATS)}, or custom (your own questions).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write corpus/passages.jsonl and questions.jsonl to.")],
    input_file: Annotated[Optional[Path], typer.Option(
        "--input", help="Benchmark file (JSON, JSON Lines, gzip or not; format autodetected). "
                        "[default: the dataset's file in the data directory]")] = None,
    data_dir: Annotated[Optional[str], typer.Option(
        "--data-dir", help="Data directory for the default input [default: $KVF_DATA, else ../shared/data].")] = None,
    corpus: Annotated[Optional[Path], typer.Option(
        "--corpus", help="custom: documents whose ids your questions' passages name (a folder or file, as for build-cache).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", "-n", "--n", min=1, help="Keep only the first N questions.")] = None,
    skip_bad: Annotated[bool, typer.Option(
        "--skip-bad/--no-skip-bad", help="Skip records with no answers or no passages (with a warning) instead of failing.")] = False,
):
    """Convert a QA benchmark file (or your own questions) into a prepared directory (passages pooled once, stable ids)."""
    check_prepare_flags(name, input_file, data_dir, corpus, skip_bad)
    if name == "custom":
        from kvf.errors import KvfError
        from kvf.pipeline.data.datasets import prepare_custom
        from kvf.pipeline.workflows.workspace import check_corpus_folder
        if input_file is None:
            raise KvfError("kvf data prepare custom needs --input FILE (JSON Lines of {question, answers, passages})")
        if corpus is not None:
            check_corpus_folder(corpus)
        manifest = prepare_custom(input_file, out, corpus, limit)
    else:
        path = input_file or find_dataset_file(name, data_dir)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manifest = prepare(name, path, out, skip_bad=skip_bad, limit=limit)
        for w in caught:
            typer.echo(f"warning: {w.message}", err=True)
    short = f" (-n {limit} asked: that is all there are)" if limit is not None and manifest["questions"] < limit else ""
    typer.echo(f"{name}: {counted(manifest['questions'], 'question')}{short}, {counted(manifest['passages'], 'distinct passage')} "
               f"({manifest['format']} format, {manifest['skipped']} skipped) -> {out}")


def check_prepare_flags(name: str, input_file, data_dir, corpus, skip_bad: bool) -> None:
    """Flags the chosen dataset does not use would be dropped without a word: refused."""
    from kvf.errors import KvfError
    if name == "custom":
        unused = [("--data-dir", data_dir, "custom reads --input only"),
                  ("--skip-bad", skip_bad or None, "custom refuses a bad line, naming it, instead of skipping it")]
    else:
        unused = [("--corpus", corpus, f"--corpus is for `custom`; {name}'s passages come with its questions"),
                  ("--data-dir", data_dir if input_file is not None else None, "--input names the file")]
    for flag, value, why in unused:
        if value is not None:
            given = flag if value is True else f"{flag} {value}"
            raise KvfError(f"{given}: unused here ({why}); leave it out")


@data_app.command("synthetic")
def synthetic_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the synthetic prepared corpus to.")],
    n: Annotated[int, typer.Option("--n", "--limit", "-n", min=1, help="Number of two-hop questions.")] = 20,
    passages: Annotated[int, typer.Option("--passages", help="Passages per question (two hold the facts).")] = 4,
    seed: Annotated[int, typer.Option("--seed", help="Random seed; the same seed gives the same corpus.")] = 0,
):
    """Generate a small synthetic two-hop corpus (fictional entities) that needs no data directory."""
    with progress_bar(Console(stderr=True)) as progress:
        questions = make_synthetic(out, n_questions=n, passages_per_question=passages, seed=seed,
                                   track=lambda items, total: progress.track(items, total, description="synthetic"))
    typer.echo(f"synthetic: {counted(len(questions), 'question')}, {counted(len(questions) * passages, 'passage')} (seed {seed}) -> {out}")


@data_app.command("ruler")
def ruler_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the prepared RULER-style suite to.")],
    tasks: Annotated[str, typer.Option("--tasks", help="Comma-separated tasks, or all.")] = "all",
    length: Annotated[int, typer.Option("--length", help="Sample length in model tokens (1024, 2048, 4096, 8192).")] = 2048,
    n: Annotated[int, typer.Option("--n", "--limit", "-n", help="Samples per task.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Random seed; the same seed gives the same suite.")] = 0,
    chunk_tokens: Annotated[int, typer.Option("--chunk-tokens", help="Passage size in model tokens: build the workspace with the same --chunk-tokens.")] = 256,
    model: Annotated[Optional[str], typer.Option("--model", help="Model whose tokenizer measures lengths (default: the embedded one).")] = None,
):
    """Generate a RULER-style long-context suite (needles, variable tracking, frequent words, two-hop, cross-chunk tasks)."""
    from kvf.pipeline.data.ruler import TASKS, make_ruler
    from kvf.pipeline.workflows.weights import open_model
    names = list(TASKS) if tasks.strip() == "all" else [t.strip() for t in tasks.split(",") if t.strip()]
    names = list(dict.fromkeys(names))   # a task named twice wrote each of its samples twice, under one id (as -m does: once)
    model_ref = open_model(model)
    with progress_bar(Console(stderr=True)) as progress:
        questions = make_ruler(out, model_ref.tokenizer, names, length, n, seed, chunk_tokens,
                               model_ref.config.max_position_embeddings,
                               track=lambda samples, total: progress.track(samples, total, description=f"ruler-{length}"))
    typer.echo(f"ruler-{length}: {counted(len(questions), 'sample')} ({n} per task: {', '.join(names)}; seed {seed}) -> {out}")
