"""How close does build-cache's approximate neighbour search come to the exact one, on real passages?

    python -m kvf.scripts.ann_recall [--data-dir DIR] [--probes 1,2,4,8,16,32] [--neighbours 10]

Above 50,000 chunks build-cache finds each chunk's FusionRAG neighbours with a faiss inverted file of about
√n lists, of which a search reads 32 (pipeline/retrieval/neighbours.py). Its recall against the exact search was
tested on clustered random vectors only. Here: every distinct passage of the benchmark files in the data
directory (Wikipedia text), embedded as build-cache embeds chunks (all-MiniLM-L6-v2, unit vectors), each
passage's exact neighbours (a flat index) against those of the inverted file that build-cache makes
(neighbour_index above its exact limit), reading 1, 2, 4, ... of its lists. A corpus of n chunks reads
32 / √n of its lists: 3.2% at 1M chunks, 0.7% at Wikipedia's 21M. This corpus is far smaller, so its rows
with a like fraction of lists read are the nearest it can say about those sizes (each list holds ~√n
passages here, not ~1,000); it cannot say more. Embeddings are kept in --workdir, so a rerun only searches.
Writes results/ann_recall.md, .csv and .png.
"""
from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from kvf.errors import KvfError
from kvf.pipeline.files import atomic_path, write_atomic
from kvf.pipeline.retrieval.neighbours import IVF_PROBES
from kvf.pipeline.workflows.provenance import git_commit

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"1M chunks": 1_000_000, "21M chunks (Wikipedia)": 21_000_000}   # where build-cache reads IVF_PROBES / √n
DEFAULT_PROBES = [1, 2, 4, 8, 16, 32]


def fraction_read(chunks: int) -> float:
    """The share of its about √n lists that build-cache's search reads for a corpus of this many chunks."""
    return min(1.0, IVF_PROBES / chunks ** 0.5)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=None, help="the benchmark files (default: KVF_DATA, else ../shared/data)")
    p.add_argument("--probes", default=",".join(map(str, DEFAULT_PROBES)), help="lists read per search, comma-separated")
    p.add_argument("--neighbours", type=int, default=10, help="neighbours per passage (build-cache's default)")
    p.add_argument("--workdir", type=Path, default=ROOT / "work" / "ann-recall", help="where the embeddings are kept")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "ann_recall.md")
    args = p.parse_args(argv)
    try:
        args.probes = sorted({int(x) for x in args.probes.split(",")})
    except ValueError:
        raise SystemExit(f"--probes {args.probes!r} is not a comma-separated list of whole numbers; e.g. --probes 1,4,32")
    if not args.probes or args.probes[0] < 1:
        raise SystemExit("--probes: every number of lists read must be at least 1")
    if args.neighbours < 1:
        raise SystemExit(f"--neighbours must be at least 1 (got {args.neighbours})")
    return args


def real_passages(data_dir: str | None) -> tuple[list[str], dict[str, int]]:
    """Every distinct passage text of the benchmark files (their order, first seen), and how many each file gave."""
    from kvf.pipeline.data.datasets import DATASET_FILES, find_dataset_file, load_dataset, pool_passages
    texts: dict[str, str] = {}
    per_file = {}
    for name in DATASET_FILES:
        before = len(texts)
        for pid, passage in pool_passages(load_dataset(name, find_dataset_file(name, data_dir))).items():
            texts.setdefault(pid, passage.text)
        per_file[DATASET_FILES[name]] = len(texts) - before
    return list(texts.values()), per_file


def embeddings_of(texts: list[str], workdir: Path, console: Console) -> np.ndarray:
    """[n, 384] unit vectors, computed once and kept in workdir (keyed by the texts, so other texts recompute)."""
    key = hashlib.sha256("\0".join(texts).encode("utf-8")).hexdigest()[:16]
    path = workdir / f"embeddings-{key}.npy"
    if path.exists():
        return np.load(path)
    from rich.progress import Progress
    from kvf.pipeline.retrieval.dense import Embedder
    embedder, batch, parts = Embedder(), 64, []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"embedding {len(texts):,} passages", total=len(texts))
        for start in range(0, len(texts), batch):
            parts.append(embedder.encode(texts[start: start + batch]))
            progress.advance(task, len(parts[-1]))
    vectors = np.concatenate(parts)
    workdir.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, vectors)
    return vectors


def recall_per_passage(found: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """found, exact [n, k] rows of neighbours (-1 padded) -> [n]: the share of each row's exact neighbours found."""
    hits = [len(set(f[f >= 0].tolist()) & set(e[e >= 0].tolist())) / max(1, int((e >= 0).sum()))
            for f, e in zip(found, exact)]
    return np.asarray(hits, dtype=np.float64)


def measure(vectors: np.ndarray, probes: list[int], k: int) -> tuple[pd.DataFrame, int]:
    """The exact search, then build-cache's inverted file reading each number of lists -> one row per setting."""
    from kvf.eval.stats import mean_interval
    from kvf.pipeline.retrieval.neighbours import fill_neighbours, neighbour_index
    n = len(vectors)
    rows = np.arange(n)
    exact = np.full((n, k), -1, dtype=np.int32)
    started = time.perf_counter()
    fill_neighbours(neighbour_index(vectors, exact_up_to=n), vectors, rows, exact, k)
    exact_seconds = time.perf_counter() - started
    index = neighbour_index(vectors, exact_up_to=0)                              # the inverted file, as above 50K
    n_lists = index.nlist
    table = []
    for probe in [p for p in probes if p <= n_lists]:
        index.nprobe = probe
        found = np.full((n, k), -1, dtype=np.int32)
        started = time.perf_counter()
        fill_neighbours(index, vectors, rows, found, k)
        seconds = time.perf_counter() - started
        recall = recall_per_passage(found, exact)
        low, high = mean_interval(pd.Series(recall))
        table.append({"lists_read": probe, "lists": n_lists, "fraction_read": probe / n_lists,
                      "recall": recall.mean(), "recall_low": low, "recall_high": high,
                      "all_found": float((recall == 1).mean()), "seconds": seconds,
                      "seconds_over_exact": seconds / exact_seconds})
    return pd.DataFrame(table), n_lists


def plot(table: pd.DataFrame, n: int, k: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    x = table["fraction_read"] * 100
    ax.errorbar(x, table["recall"], yerr=[table["recall"] - table["recall_low"], table["recall_high"] - table["recall"]],
                marker="o", capsize=3, label=f"inverted file, {n:,} real passages")
    for name, size in SIZES.items():
        ax.axvline(100 * fraction_read(size), linestyle=":", color="grey")
        ax.text(100 * fraction_read(size), 0.02, f" build-cache\n at {name}", fontsize=7, color="grey", va="bottom",
                transform=ax.get_xaxis_transform())
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
    ax.set_xlabel("lists read per search (% of all lists, log scale)")
    ax.set_ylabel(f"recall@{k} against exact search")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Approximate neighbour search on real passages")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def report(table: pd.DataFrame, n: int, n_lists: int, per_file: dict, k: int, args, console: Console) -> str:
    command = "python -m kvf.scripts.ann_recall" + (f" --probes {','.join(map(str, args.probes))}"
                                                    if args.probes != DEFAULT_PROBES else "") + \
        (f" --neighbours {k}" if k != 10 else "")
    files = ", ".join(f"`{f}` ({m:,})" for f, m in per_file.items())
    lines = ["# Approximate neighbours against exact ones, on real passages", "",
             f"Made by `{command}` at commit {git_commit()}.  ",
             f"Conditions: every distinct passage text of the benchmark files, n = {n:,} ({files}; new texts per file, "
             "in that order); embedder all-MiniLM-L6-v2 (unit vectors, as build-cache embeds chunks); faiss "
             f"{faiss_version()}, one thread. Exact: a flat inner-product index. Approximate: build-cache's inverted file "
             f"(`neighbour_index` above its exact limit: √n = {n_lists} lists by k-means with faiss's seed), reading the "
             f"number of lists in each row. {k} neighbours per passage, itself and exact duplicates left out, as "
             "build-cache asks. Recall: the share of a passage's exact neighbours the search finds, its mean over the "
             "passages with a 95% bootstrap interval.", "",
             "| lists read | of all lists | recall@%d [95%% CI] | passages with all %d found | seconds / exact search |" % (k, k),
             "|---|---|---|---|---|"]
    for r in table.itertuples():
        lines.append(f"| {r.lists_read} of {r.lists} | {100 * r.fraction_read:.1f}% | {r.recall:.3f} "
                     f"[{r.recall_low:.3f}, {r.recall_high:.3f}] | {100 * r.all_found:.1f}% | {r.seconds_over_exact:.2f} |")
    at = {name: fraction_read(size) for name, size in SIZES.items()}
    lines += ["", f"Build-cache reads {IVF_PROBES} of √n lists: " + ", ".join(f"{100 * f:.1f}% at {name}" for name, f in at.items())
              + f". Here (n = {n:,}) its {IVF_PROBES} lists are {100 * min(1, IVF_PROBES / n_lists):.0f}% of them. Each list here holds about "
              f"{n // n_lists} passages, against about 1,000 at 1M chunks: recall at a like fraction of lists read is the "
              "nearest this corpus can say about those sizes, not a measurement at them. The seconds compare one thread's "
              "searches at this size, where the exact search is cheap; at 1M chunks it would be some "
              f"{1_000_000 / n:.0f}× slower per query and the inverted file about {(1_000_000 / n) ** 0.5:.0f}× (lists grow as √n).",
              "", "![recall](ann_recall.png)", ""]
    text = "\n".join(lines)
    rich_table = Table(title=f"recall@{k}, n = {n:,} real passages")
    for column in ("lists read", "% of lists", "recall [95% CI]", "all found"):
        rich_table.add_column(column)
    for r in table.itertuples():
        rich_table.add_row(f"{r.lists_read}/{r.lists}", f"{100 * r.fraction_read:.1f}%",
                           f"{r.recall:.3f} [{r.recall_low:.3f}, {r.recall_high:.3f}]", f"{100 * r.all_found:.1f}%")
    console.print(rich_table)
    return text


def faiss_version() -> str:
    import faiss
    return faiss.__version__


def main(argv=None):
    args = parse_args(argv)
    console = Console()
    import faiss
    faiss.omp_set_num_threads(1)
    try:
        texts, per_file = real_passages(args.data_dir)
    except KvfError as e:
        raise SystemExit(f"error: {e}")
    vectors = embeddings_of(texts, args.workdir, console)
    table, n_lists = measure(vectors, args.probes, args.neighbours)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out.with_suffix(".csv"), table.round(6).to_csv(index=False))
    plot(table, len(texts), args.neighbours, args.out.with_suffix(".png"))
    write_atomic(args.out, report(table, len(texts), n_lists, per_file, args.neighbours, args, console))
    console.print(f"wrote {args.out}, {args.out.with_suffix('.csv').name}, {args.out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
