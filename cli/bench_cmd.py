"""`kvf bench`: TTFT of each method vs full prefill across context lengths, measured in one process."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from kvf.cli.options import DeviceOption, DtypeOption, ModelOption, S3EndpointOption, use_store_flags, with_method_knobs
from kvf.pipeline.workflows.display import output_console


def _ints(text: str, flag: str) -> list[int]:
    from kvf.errors import KvfError
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        from kvf.cli.options import thousands
        counts = [thousands(x) for x in text.split(",") if x.strip()]
        meant = f"; write {text} as {','.join(map(str, counts))}" if counts and None not in counts else ""
        raise KvfError(f"{flag} {text}: expected comma-separated integers, e.g. 1024,2048,4096{meant}") from None
    if not values or min(values) < 1:
        raise KvfError(f"{flag} {text}: expected positive integers, e.g. 1024,2048,4096")
    return list(dict.fromkeys(values))   # a length named twice was timed twice, as two rows of one length


@with_method_knobs
def bench_command(
    lengths: str = typer.Option("1024,2048,4096,8192", "--lengths", help="Prompt lengths in tokens, comma-separated."),
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", min=1, help="Chunk size: tokens per chunk of the benchmark prompt."),
    method: Optional[str] = typer.Option(None, "--method", "-m", "--methods", help="Methods to time, comma-separated, each NAME, NAME:KNOB=VALUE or NAME:CONFIGURATION as on kvf run [default: all]."),
    ratio: str = typer.Option("0.05,0.15,0.3", "--ratio", "-r", "--ratios", help="Recompute ratios, comma-separated, for methods whose ratio is a knob."),
    repeats: int = typer.Option(3, "--repeats", "--rounds", min=1, help="Timed rounds, each timing every setting once in a balanced order (medians reported), after one warm-up each."),
    cold: bool = typer.Option(True, "--cold/--no-cold", help="Also time with the store's pages dropped from the page cache."),
    compare_no_pipeline: bool = typer.Option(True, "--compare-no-pipeline/--no-compare-no-pipeline", help="Also time 0.15 runs with pipelined loading off, to report the hidden share."),
    auto_ratio: bool = typer.Option(True, "--auto-ratio/--no-auto-ratio", help="Also time --auto-method at the loading controller's ratio (--ratio auto)."),
    auto_method: Optional[str] = typer.Option(None, "--auto-method", help="The method timed at the loading controller's ratio [default: cacheblend]."),
    model: ModelOption = None,
    random_weights: Optional[str] = typer.Option(None, "--random-weights", help="Time a randomly initialised model of a real shape instead (llama3-8b, tiny); no download."),
    device: DeviceOption = "cpu",
    dtype: DtypeOption = None,
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON (one object per row) instead of a table."),
    out: Path = typer.Option(Path("results/bench"), "--out", "-o", help="Directory for ttft.csv, rounds.csv (every timed request), ttft.md and ttft_vs_context.png (and ttft_paired.png with --versus); not results/ itself, whose ttft.md is committed evidence (make ttft)."),
    store: Optional[str] = typer.Option(None, "--store", help="Where the benchmark's store goes: a path or URL (s3://bucket/prefix) [default: a temp dir]."),
    s3_endpoint: S3EndpointOption = None,
    versus: Optional[str] = typer.Option(None, "--versus", help="An -m entry (e.g. prophetkv) that every other entry is also paired with, round by round: TTFT ratio with a 95% bootstrap interval over rounds."),
    **knobs,
):
    """Median TTFT, its breakdown, peak memory and the ratio to full prefill, warm and cold store."""
    from kvf.pipeline.fusion.methods.base import check_knobs_used
    from kvf.pipeline.workflows.bench import BenchOptions, bench, summary_table, write_results
    from kvf.pipeline.workflows.devices import check_device
    from kvf.pipeline.files import check_writable_dir
    from kvf.pipeline.workflows.run import parse_method_spec, parse_methods, parse_ratios
    check_device(device)
    use_store_flags(store or "(a temp dir)", s3_endpoint)
    check_auto_method(auto_method, auto_ratio)
    from kvf.pipeline.workflows.workspace import check_not_made_by_kvf
    check_not_made_by_kvf(out, "--out", "results/bench")
    check_writable_dir(out, "--out", create=False)   # before minutes of timing; made when its files are written
    methods = parse_methods(method) if method else ["all"]
    check_knobs_used([parse_method_spec(m).name for m in parse_methods(method or "all")], knobs)
    opts = BenchOptions(lengths=_ints(lengths, "--lengths"), chunk_tokens=chunk_tokens, methods=methods,
                        ratios=parse_ratios(ratio), repeats=repeats, modes=("warm", "cold") if cold else ("warm",),
                        compare_no_pipeline=compare_no_pipeline, auto_ratio=auto_ratio,
                        auto_method=auto_method or BenchOptions.auto_method,
                        model=model, random_weights=random_weights, device=device, dtype_compute=dtype, out=out,
                        knobs=knobs, store_url=store, versus=versus)
    console = output_console(140, stderr=json_out)   # --json: stdout holds the JSON alone
    if repeats == 1:   # named as typed: --rounds (the README's word) or --repeats
        typed = next((w.split("=")[0] for w in sys.argv[1:] if w.split("=")[0] in ("--rounds", "--repeats")), "--rounds")
        console.print(f"warning: {typed} 1 gives one timing per setting; CPU timings vary by 10-30% run to run, "
                      "so treat single-round ratios as noise", style="yellow")
    df = bench(opts, console)
    label = f"{random_weights or model or 'SmolLM2-135M-Instruct'} on {device}"
    written = write_results(df, out, label, "kvf " + " ".join(sys.argv[1:]), repeats, versus)
    if json_out:
        print(df.to_json(orient="records"))
    else:
        console.print(summary_table(df, f"TTFT vs full prefill — {label}", width=console.width))
    console.print("wrote " + ", ".join(str(p) for p in written), highlight=False, markup=False)


def check_auto_method(auto_method: str | None, auto_ratio: bool) -> None:
    """--auto-method names a method that takes a ratio, checked before any timing (it was built only after the
    first length's set-up); beside --no-auto-ratio it would be unused: refused."""
    from kvf.errors import KvfError
    from kvf.pipeline.fusion.methods.base import METHODS, check_method_name
    if auto_method is None:
        return
    if not auto_ratio:
        raise KvfError(f"--auto-method {auto_method}: --no-auto-ratio times no method at the controller's ratio; "
                       "leave one of them out")
    check_method_name(auto_method, f"--auto-method {auto_method}")
    if not METHODS[auto_method].ratio_is_knob:
        raise KvfError(f"--auto-method {auto_method}: it recomputes a fixed amount, so the controller's ratio would "
                       "not reach it; pick a method with a ratio (kvf methods)")
