"""What holding a workspace's chunks table costs a run: every chunk as Python objects (how kvf run read
it before ChunkTable) against ChunkTable (columnar; a Chunk only for the chunks asked for).

    python -m kvf.scripts.bench_chunk_table [--chunks 100000 --tokens 256]

Writes a chunks.parquet of random token ids (and ~4 characters of text per token) into a temp dir,
then opens it each way in a fresh process, side by side, and prints the seconds to open it and the
memory it added (resident set, after the open). Nothing is asserted: the ratios are the result.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from rich.table import Table

from kvf.pipeline.files import work_dir
from kvf.pipeline.workflows.display import output_console

OPEN = {  # how each way opens the table: (label, code run in the child with `path` set)
    "chunk objects": "from kvf.pipeline.retrieval.chunking import read_chunks_table\n"
                     "held = {c.chunk_id: c for c in read_chunks_table(path)}",
    "ChunkTable": "from kvf.pipeline.retrieval.chunking import ChunkTable\nheld = ChunkTable(path)",
}
CHILD = """
import json, sys, time
import pyarrow.parquet  # imported before the baseline, as the library is in both ways
import kvf.pipeline.retrieval.chunking
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
path = sys.argv[1]
before, started = rss_mb(), time.perf_counter()
{code}
print(json.dumps({{"seconds": time.perf_counter() - started, "mb": rss_mb() - before, "chunks": len(held)}}))
"""


def write_table(path, n: int, tokens: int) -> None:
    import numpy as np
    from kvf.pipeline.retrieval.chunking import Chunk, write_chunks_table
    rng = np.random.default_rng(0)
    write_chunks_table([Chunk(chunk_id=f"{i:064x}", doc_id=f"doc{i // 4}", title=f"Document {i // 4}",
                              text="word " * (tokens * 4 // 5), token_ids=rng.integers(0, 49152, tokens).tolist(),
                              index_in_doc=i % 4) for i in range(n)], path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=100_000)
    p.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    args = p.parse_args(argv)
    if args.chunks < 1 or args.tokens < 1:
        raise SystemExit("bench_chunk_table: --chunks and --tokens must be at least 1")
    console = output_console(100)
    with work_dir(None, "kvf-bench-chunk-table-") as work:
        path = work / "chunks.parquet"
        write_table(path, args.chunks, args.tokens)
        results = {}
        for label, code in OPEN.items():
            out = subprocess.run([sys.executable, "-c", CHILD.format(code=code), str(path)], capture_output=True,
                                 text=True, check=True)
            results[label] = json.loads(out.stdout.splitlines()[-1])
    table = Table(title=f"opening a chunks table of {args.chunks:,} chunks x {args.tokens} tokens (one process each)")
    for column in ("held as", "seconds", "memory added (MB)", "vs chunk objects"):
        table.add_column(column, justify="left" if column == "held as" else "right")
    base = results["chunk objects"]
    for label, r in results.items():
        table.add_row(label, f"{r['seconds']:.2f}", f"{r['mb']:,.0f}", f"{r['mb'] / base['mb']:.2f}x memory, "
                      f"{r['seconds'] / base['seconds']:.2f}x time")
    console.print(table)
    return results


if __name__ == "__main__":
    main()
