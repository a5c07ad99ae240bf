"""`kvf demo`: end to end on the embedded model with generated RULER-style questions (no data needed)."""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import typer

from kvf.cli.options import ModelOption
from kvf.cli.tables import answers_rows_table
from rich.console import Console
from rich.table import Table

console = Console()


def demo_command(
    model: ModelOption = None,
    questions: int = typer.Option(3, "--limit", "-n", "--n", "--questions", min=1, help="How many questions to answer."),
    ratio: float = typer.Option(0.15, "--ratio", "-r", min=0.0, max=1.0, help="Recompute ratio for cacheblend, in [0, 1]."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens", min=1, help="Longest answer to generate."),
    workspace: Path = typer.Option(None, "--workspace", "-w", help="Where to build the demo store [default: a temp dir]."),
):
    """Build a chunk KV store for generated questions whose answer spans two chunks; answer with full, reuse, cacheblend."""
    from kvf.pipeline.files import check_writable_dir
    from kvf.pipeline.workflows.demo import DEMO_TASK, run_demo
    if workspace is not None:
        check_writable_dir(workspace, "--workspace", create=False)   # made when its questions are written, after the model loads
        check_demo_folder(workspace)
    with tempfile.TemporaryDirectory(prefix="kvf-demo-") as tmp:
        rows = run_demo(model, questions, ratio, max_new_tokens, workspace or Path(tmp), console)
    asked = f"{questions} RULER-style {DEMO_TASK} question{'s' if questions > 1 else ''}"
    console.print(answers_rows_table(rows, f"kvf demo: {asked} (the number's sentence is cut by a chunk boundary)"))
    console.print("TTFT = load + select + recompute + first token, stored KVs read from the store on disk.")
    from kvf.cli.tables import f1_to_full
    from kvf.eval.metrics import accuracy
    ttfts: dict[str, list] = {}
    vs_full: dict[str, list] = {}
    right: dict[str, list] = {}
    for r, f1 in zip(rows, f1_to_full(rows)):
        ttfts.setdefault(r["method"], []).append(r["timings"]["first_token"])
        vs_full.setdefault(r["method"], []).append(f1)
        right.setdefault(r["method"], []).append(accuracy(r["answer"], r["gold"], r["gold_mode"]))
    full_ttft = statistics.median(ttfts["full"])
    summary = Table(title="each method against full prefill, over the questions above")
    for column in ("method", "median TTFT (ms)", "TTFT / full", "right", "F1 vs full"):
        summary.add_column(column, justify="left" if column == "method" else "right")
    for method, times in ttfts.items():
        summary.add_row(method, f"{1000 * statistics.median(times):.0f}", f"{statistics.median(times) / full_ttft:.2f}",
                        f"{sum(right[method]):.0f} of {len(right[method])}", f"{statistics.mean(vs_full[method]):.2f}")
    console.print(summary)
    console.print("These answers illustrate the idea; they are not a measurement: results/ruler.md measures this task "
                  "(50 samples at 2K, 95% intervals; `make ruler`)", markup=False)


DEMO_FOLDERS = {"ruler", "ws", "runs", "synthetic"}   # what kvf demo keeps in its --workspace (synthetic: before)


def check_demo_folder(folder: Path) -> None:
    """The demo's folder is its own (or an earlier demo's): given a workspace or a folder of documents, it put
    its corpus, workspace and runs among the user's files."""
    from kvf.errors import KvfError
    from kvf.pipeline.files import other_files
    others = other_files(folder, DEMO_FOLDERS)
    if others:
        raise KvfError(f"--workspace {folder} holds other files ({', '.join(others[:3])}); kvf demo keeps its "
                       f"questions, workspace and runs in a folder of its own: pass a new or empty folder, or an earlier demo's")

