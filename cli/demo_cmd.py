"""`kvf demo`: end to end on the embedded model with a synthetic multi-hop corpus (no data needed)."""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import typer

from kvf.cli.options import ModelOption
from rich.console import Console
from rich.table import Table

console = Console()


def demo_command(
    model: ModelOption = None,
    questions: int = typer.Option(3, "--questions", "-n", help="How many synthetic questions to answer."),
    ratio: float = typer.Option(0.15, "--ratio", help="Recompute ratio for cacheblend, in [0, 1]."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens", help="Longest answer to generate."),
    workspace: Path = typer.Option(None, "--workspace", help="Where to build the demo store (default: a temp dir)."),
):
    """Build a chunk KV store for a synthetic corpus, then answer with full, reuse and cacheblend."""
    from kvf.pipeline.demo import run_demo
    with tempfile.TemporaryDirectory(prefix="kvf-demo-") as tmp:
        rows = run_demo(model, questions, ratio, max_new_tokens, workspace or Path(tmp), console)
    table = Table(title=f"kvf demo: {questions} synthetic two-hop questions")
    for col in ("question", "gold", "method", "answer", "recomputed", "TTFT ms"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["question"], " / ".join(r["gold"]), r["method"], r["answer"],
                      f'{r["recomputed_tokens"]}/{r["chunk_tokens"]}', f'{1000 * r["timings"]["first_token"]:.0f}')
    console.print(table)
    console.print(f"TTFT = load + select + recompute + first token, stored KVs read from the store on disk "
                  f"(recomputed = chunk tokens recomputed / chunk tokens).")
    by_method: dict[str, list] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r["timings"]["first_token"])
    full_ttft = statistics.median(by_method["full"])
    for method, ttfts in by_method.items():
        console.print(f"{method:>16}: median TTFT {1000 * statistics.median(ttfts):.0f} ms "
                      f"({statistics.median(ttfts) / full_ttft:.2f} x full)")
