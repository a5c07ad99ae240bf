"""`kvf bench`: TTFT of each method vs full prefill across context lengths, measured in one process."""
from __future__ import annotations

from pathlib import Path

import typer

from kvf.cli.options import DeviceOption, ModelOption
from rich.console import Console

console = Console(width=max(Console().width, 120))


def _ints(text: str, flag: str) -> list[int]:
    from kvf import KvfError
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvfError(f"{flag} {text}: expected comma-separated integers, e.g. 1024,2048,4096") from None


def bench_command(
    lengths: str = typer.Option("1024,2048,4096,8192", "--lengths", help="Prompt lengths in tokens, comma-separated."),
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", help="Tokens per chunk."),
    methods: str = typer.Option(None, "--methods", help="Methods to time, comma-separated (default: all)."),
    ratios: str = typer.Option("0.05,0.15,0.3", "--ratios", help="Recompute ratios for the selective methods."),
    repeats: int = typer.Option(3, "--repeats", help="Timed repeats per setting (median reported), after one warm-up."),
    cold: bool = typer.Option(True, "--cold/--no-cold", help="Also time with the store's pages dropped from the page cache."),
    compare_no_pipeline: bool = typer.Option(True, "--compare-no-pipeline/--no-compare-no-pipeline", help="Also time 0.15 runs with pipelined loading off, to report the hidden share."),
    auto_ratio: bool = typer.Option(True, "--auto-ratio/--no-auto-ratio", help="Also time cacheblend at the loading controller's ratio (--ratio auto)."),
    model: ModelOption = None,
    random_weights: str = typer.Option(None, "--random-weights", help="Time a randomly initialised model of a real shape instead (llama3-8b, tiny); no download."),
    device: DeviceOption = "cpu",
    out: Path = typer.Option(Path("results"), "--out", help="Directory for ttft.csv, ttft.md and ttft_vs_context.png."),
):
    """Median TTFT, its breakdown, peak memory and the ratio to full prefill, warm and cold store."""
    import torch

    from kvf import KvfError
    from kvf.pipeline.bench import DEFAULT_METHODS, BenchOptions, bench, summary_table, write_results
    from kvf.pipeline.run import parse_ratios
    if device == "cuda" and not torch.cuda.is_available():
        raise KvfError("--device cuda: no CUDA device is visible; run on a GPU machine or use --device cpu")
    opts = BenchOptions(lengths=_ints(lengths, "--lengths"), chunk_tokens=chunk_tokens,
                        methods=[m.strip() for m in methods.split(",")] if methods else list(DEFAULT_METHODS),
                        ratios=parse_ratios(ratios), repeats=repeats, modes=("warm", "cold") if cold else ("warm",),
                        compare_no_pipeline=compare_no_pipeline, auto_ratio=auto_ratio, model=model,
                        random_weights=random_weights, device=device, out=out)
    df = bench(opts, console)
    label = f"{random_weights or model or 'SmolLM2-135M-Instruct'} on {device}"
    written = write_results(df, out, label)
    console.print(summary_table(df, f"TTFT vs full prefill — {label}"))
    console.print("wrote " + ", ".join(str(p) for p in written))
