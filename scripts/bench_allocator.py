"""Why `kvf bench` times requests with the allocator's defaults: the same bench, twice, with and without
glibc's mmap threshold fixed at 1 MiB before the timings (the setting the bench needs to read peak
memory from the resident set, and used during the timings until 4fe4fb3).

    python -m kvf.scripts.bench_allocator [--length 4096 --rounds 8 -m full,prophetkv,kvfuse]

Each setting runs in its own process (the threshold cannot be unset once set), each one the bench's
balanced rounds. Prints and writes results/bench_allocator.md (and .csv): per method, TTFT and the
ratio to full prefill under both settings.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from rich.console import Console

from kvf.errors import KvfError
from kvf.pipeline.files import write_atomic
from kvf.pipeline.workflows.provenance import git_commit

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"defaults": "glibc's defaults (the bench now)", "fixed-1MiB": "mmap threshold fixed at 1 MiB (the bench until 4fe4fb3)"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("-m", "--methods", default="full,prophetkv,kvfuse")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_allocator.md")
    p.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    p.add_argument("--csv", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag, value in (("--length", args.length), ("--rounds", args.rounds)):
        if value < 1:
            raise SystemExit(f"bench_allocator: {flag} {value}: must be at least 1")
    try:  # the same entries as kvf bench -m takes, refused here before either process starts
        from kvf.pipeline.workflows.run import parse_methods
        parse_methods(args.methods)
    except KvfError as error:
        raise SystemExit(f"bench_allocator: {error}") from None
    return args


def child(args) -> None:
    """One setting: fix the threshold first (or not), then the bench's rounds; the table to args.csv."""
    from kvf.pipeline.workflows.bench import BenchOptions, bench, fixed_mmap_threshold
    if args.child == "fixed-1MiB":
        fixed_mmap_threshold()
    opts = BenchOptions(lengths=[args.length], methods=args.methods.split(","), ratios=[0.15], repeats=args.rounds,
                        modes=("warm",), compare_no_pipeline=False, auto_ratio=False)
    bench(opts, Console(stderr=True)).to_csv(args.csv, index=False)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        return child(args)
    tables = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setting in SETTINGS:
            csv = Path(tmp) / f"{setting}.csv"
            subprocess.run([sys.executable, "-m", "kvf.scripts.bench_allocator", "--child", setting, "--csv", str(csv),
                            "--length", str(args.length), "--rounds", str(args.rounds), "-m", args.methods], check=True)
            tables[setting] = pd.read_csv(csv).set_index("label")
    both = pd.concat([t.reset_index().assign(setting=s) for s, t in tables.items()])
    columns = ["setting", "length", "label", "ttft_ms", "ttft_ratio", "ttft_ratio_min", "ttft_ratio_max"]
    write_atomic(args.out.with_suffix(".csv"), both[columns].to_csv(index=False))
    labels = list(tables["defaults"].index)
    lines = [f"# TTFT under two allocator settings ({args.length} tokens, SmolLM2-135M-Instruct on cpu)", "",
             f"Made by `python -m kvf.scripts.bench_allocator --length {args.length} --rounds {args.rounds} -m {args.methods}` "
             f"at commit {git_commit() or 'unknown'}. Each setting in its own process, one after the other, each "
             f"{args.rounds} balanced rounds of `kvf bench` (store warm, ratio 0.15). TTFT in ms (median over rounds); "
             "ratio = median over rounds of TTFT / full prefill's TTFT in the same round [lowest-highest].", "",
             "| method | " + " | ".join(f"TTFT, {SETTINGS[s]}" for s in SETTINGS) + " | "
             + " | ".join(f"ratio, {s}" for s in SETTINGS) + " |",
             "|---|" + "---|" * (2 * len(SETTINGS))]
    for label in labels:
        rows = [tables[s].loc[label] for s in SETTINGS]
        lines.append(f"| {label} | " + " | ".join(f"{r.ttft_ms:.0f}" for r in rows) + " | "
                     + " | ".join(f"{r.ttft_ratio:.3f} [{r.ttft_ratio_min:.3f}-{r.ttft_ratio_max:.3f}]" for r in rows) + " |")
    text = "\n".join(lines) + "\n"
    write_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
