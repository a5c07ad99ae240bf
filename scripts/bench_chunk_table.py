"""What holding a workspace's chunks costs: every chunk as Python objects against ChunkTable (columnar; a
Chunk only for the chunks asked for).

    python -m kvf.scripts.bench_chunk_table [--chunks 100000 --tokens 256]
    python -m kvf.scripts.bench_chunk_table --driver [--chunks 100000]
    python -m kvf.scripts.bench_chunk_table --neighbours 10 [--chunks 100000]

Default (a run, each Ray worker): writes a chunks.parquet of random token ids (and ~4 characters of
text per token) into a temp dir, then opens it each way in a fresh process, side by side, and prints
the seconds to open it and the memory it added (resident set, after the open).

--driver (build-cache's driver, stage 1 and what stages 2-3 hold): writes a JSONL corpus of random
words, 4 chunks of 256 tokens a document, and chunks it each way in a fresh process: reading every
document, then every chunk, as Python objects and keeping both (how build-cache did it before), against
stage_chunks (a document at a time into chunks.parquet, then a ChunkTable). Prints the seconds and the
peak memory it added (the process's peak resident set over its resident set before).

--neighbours N (the fusion variant's neighbours file): writes N random neighbours of every chunk as the
JSON an older kvf wrote and as kvf's neighbours.npz, and loads each way in a fresh process (file size,
seconds, memory added).

Nothing is asserted: the ratios are the result.
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
DRIVER = {  # how each way chunks a corpus and holds the result: (label, code run with corpus, ws, tokenizer set)
    "chunk objects": "from kvf.pipeline.retrieval.chunking import chunk_documents, write_chunks_table\n"
                     "from kvf.pipeline.retrieval.corpus import read_corpus\n"
                     "docs = read_corpus(corpus)\n"
                     "held = chunk_documents(docs, tokenizer, 256)\n"
                     "write_chunks_table(held, ws / 'chunks.parquet')",
    "streamed, ChunkTable": "from kvf.pipeline.workflows.build import BuildOptions, stage_chunks\n"
                            "from kvf.pipeline.workflows.workspace import Workspace\n"
                            "held, _ = stage_chunks(BuildOptions(corpus=corpus, workspace=ws, chunk_tokens=256, overlap=0), "
                            "Workspace(ws), tokenizer)",
}
NEIGHBOURS = {  # how each way loads the neighbours file: (label, file name, code run with `path` set)
    "JSON (older kvf)": ("neighbours.json", "held = json.loads(open(path, encoding='utf-8').read())"),
    "neighbours.npz": ("neighbours.npz", "held = load_neighbours(path)"),
}
# what each mode imports (before the baseline, as the library is there in both ways) and names from argv
SETUP = {
    "table": "import pyarrow.parquet\nimport kvf.pipeline.retrieval.chunking\npath = sys.argv[1]",
    "neighbours": "from kvf.pipeline.retrieval.neighbours import load_neighbours\npath = sys.argv[1]",
    "driver": "import pathlib\nfrom kvf.pipeline.workflows.weights import open_model\nimport kvf.pipeline.workflows.build, pyarrow.parquet\n"
              "tokenizer = open_model(None).tokenizer\ntokenizer.encode('warm up', add_special_tokens=False)\n"
              "corpus, ws = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])",
}
CHILD = """
import json, resource, sys, time
{setup}
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before, started = rss_mb(), time.perf_counter()
{code}
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if {peak} else rss_mb()   # peak or now
print(json.dumps({{"seconds": time.perf_counter() - started, "mb": after - before, "chunks": len(held)}}))
"""


def write_table(path, n: int, tokens: int) -> None:
    import numpy as np
    from kvf.pipeline.retrieval.chunking import Chunk, write_chunks_table
    rng = np.random.default_rng(0)
    write_chunks_table([Chunk(chunk_id=f"{i:064x}", doc_id=f"doc{i // 4}", title=f"Document {i // 4}",
                              text="word " * (tokens * 4 // 5), token_ids=rng.integers(0, 49152, tokens).tolist(),
                              index_in_doc=i % 4) for i in range(n)], path)


def write_corpus(path, chunks: int) -> None:
    """A JSONL corpus of random lower-case words, about 4 chunks of 256 tokens a document."""
    import numpy as np
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, rng.integers(3, 9))) for _ in range(5000)]
    with open(path, "w") as f:
        for doc in range(-(-chunks // 4)):
            words = rng.choice(vocabulary, 270)   # ~3.6 tokens a random word: ~970 tokens, 4 chunks
            f.write(json.dumps({"id": f"doc{doc}", "title": f"Document {doc}", "text": " ".join(words)}) + "\n")


def in_child(mode: str, code: str, *args) -> dict:
    child = CHILD.format(setup=SETUP[mode], code=code, peak=mode == "driver")
    out = subprocess.run([sys.executable, "-c", child, *map(str, args)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def write_neighbours(work, chunks: int, n: int) -> None:
    """Random neighbours of every chunk, each way NEIGHBOURS loads."""
    import numpy as np
    from kvf.pipeline.retrieval.neighbours import Neighbours, save_neighbours
    ids = [f"{i:064x}" for i in range(chunks)]
    rows = np.random.default_rng(0).integers(0, chunks, (chunks, n)).astype(np.int32)   # [chunks, n]
    (work / "neighbours.json").write_text(json.dumps({cid: [ids[j] for j in row] for cid, row in zip(ids, rows.tolist())}))
    save_neighbours(Neighbours(ids, rows), work / "neighbours.npz")


def times(value: float, base: float) -> str:
    """value as a multiple of base; a base that measured nothing (a tiny run adds no resident page) has none."""
    return f"{value / base:.2f}x" if base > 0 else "n/a"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=100_000)
    p.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    p.add_argument("--driver", action="store_true", help="build-cache's driver: chunk a corpus each way")
    p.add_argument("--neighbours", type=int, default=None, metavar="N", help="load N neighbours of every chunk each way")
    args = p.parse_args(argv)
    if args.chunks < 1 or args.tokens < 1 or (args.neighbours is not None and args.neighbours < 1):
        raise SystemExit("bench_chunk_table: --chunks, --tokens and --neighbours must be at least 1")
    console = output_console(100)
    sizes = {}
    with work_dir(None, "kvf-bench-chunk-table-") as work:
        if args.driver:
            write_corpus(work / "corpus.jsonl", args.chunks)
            results = {label: in_child("driver", code, work / "corpus.jsonl", work / label.replace(" ", "-"))
                       for label, code in DRIVER.items()}
        elif args.neighbours is not None:
            write_neighbours(work, args.chunks, args.neighbours)
            results = {label: in_child("neighbours", code, work / name) for label, (name, code) in NEIGHBOURS.items()}
            sizes = {label: (work / name).stat().st_size / 1e6 for label, (name, _) in NEIGHBOURS.items()}
        else:
            write_table(work / "chunks.parquet", args.chunks, args.tokens)
            results = {label: in_child("table", code, work / "chunks.parquet") for label, code in OPEN.items()}
    base_label = next(iter(results))
    n = results[base_label]["chunks"]
    if args.driver:
        title = f"build-cache's driver chunking a corpus into {n:,} chunks of up to 256 tokens (one process each)"
    elif args.neighbours is not None:
        title = f"loading {args.neighbours} neighbours of each of {n:,} chunks (one process each)"
    else:
        title = f"opening a chunks table of {args.chunks:,} chunks x {args.tokens} tokens (one process each)"
    table = Table(title=title)
    columns = ["held as", "seconds", "peak memory added (MB)" if args.driver else "memory added (MB)",
               *(["file (MB)"] if sizes else []), f"vs {base_label}"]
    for column in columns:
        table.add_column(column, justify="left" if column == "held as" else "right")
    base = results[base_label]
    for label, r in results.items():
        table.add_row(label, f"{r['seconds']:.2f}", f"{r['mb']:,.0f}", *([f"{sizes[label]:,.0f}"] if sizes else []),
                      f"{times(r['mb'], base['mb'])} memory, {times(r['seconds'], base['seconds'])} time")
    console.print(table)
    return results


if __name__ == "__main__":
    main()
