"""`kvf data ...`: turn benchmark files into prepared directories (corpus + questions)."""
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvf.pipeline.data.datasets import ACCEPTED_FORMATS, find_dataset_file, prepare
from kvf.pipeline.data.synthetic import make_synthetic

data_app = typer.Typer(help="Prepare benchmark data: a corpus of passages plus questions with their context ids.",
                       no_args_is_help=True)


@data_app.command("prepare")
def prepare_command(
    name: Annotated[str, typer.Argument(help=f"Dataset name: {', '.join(ACCEPTED_FORMATS)}.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write corpus/passages.jsonl and questions.jsonl to.")],
    input_file: Annotated[Optional[Path], typer.Option(
        "--input", help="Benchmark file (JSON, JSON Lines, gzip or not; format autodetected). "
                        "Default: the dataset's file in the data directory.")] = None,
    data_dir: Annotated[Optional[str], typer.Option(
        "--data-dir", help="Data directory for the default input (else $KVF_DATA, else ../shared/data).")] = None,
    skip_bad: Annotated[bool, typer.Option(
        "--skip-bad", help="Skip records with no answers or no passages (with a warning) instead of failing.")] = False,
):
    """Convert a QA benchmark file into a prepared directory (passages pooled once, stable ids)."""
    path = input_file or find_dataset_file(name, data_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = prepare(name, path, out, skip_bad=skip_bad)
    for w in caught:
        typer.echo(f"warning: {w.message}", err=True)
    typer.echo(f"{name}: {manifest['questions']} questions, {manifest['passages']} distinct passages "
               f"({manifest['format']} format, {manifest['skipped']} skipped) -> {out}")


@data_app.command("synthetic")
def synthetic_command(
    out: Annotated[Path, typer.Option("--out", help="Directory to write the synthetic prepared corpus to.")],
    n: Annotated[int, typer.Option("--n", help="Number of two-hop questions.")] = 20,
    passages: Annotated[int, typer.Option("--passages", help="Passages per question (two hold the facts).")] = 4,
    seed: Annotated[int, typer.Option("--seed", help="Random seed; the same seed gives the same corpus.")] = 0,
):
    """Generate a small synthetic two-hop corpus (fictional entities) that needs no data directory."""
    questions = make_synthetic(out, n_questions=n, passages_per_question=passages, seed=seed)
    typer.echo(f"synthetic: {len(questions)} questions, {len(questions) * passages} passages (seed {seed}) -> {out}")
