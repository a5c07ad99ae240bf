"""`kvf search`: query a workspace's BM25 or dense index and show the top chunks."""
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvf.errors import KvfError


class SearchMode(str, Enum):
    bm25 = "bm25"
    dense = "dense"


def snippet(text: str, width: int = 120) -> str:
    """First `width` characters on one line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 1] + "…"


def doc_label(chunk) -> str:
    """The chunk's document: its id, and its title where the id does not say it (a prepared benchmark's
    passages have hashed ids and Wikipedia titles; a folder's documents are named by their file)."""
    title = " ".join((chunk.title or "").split())
    return chunk.doc_id if not title or title in (chunk.doc_id, Path(chunk.doc_id).stem) else f"{chunk.doc_id} · {title}"


def hits_table(hits, chunks, title: str, snippet_width: int) -> Table:
    table = Table(title=Text(title))  # Text, not str: corpus text may contain [brackets] rich reads as markup
    table.add_column("rank", justify="right", no_wrap=True, min_width=4)
    table.add_column("score", justify="right", no_wrap=True, min_width=6)
    table.add_column("chunk", no_wrap=True, min_width=12)
    table.add_column("doc", overflow="fold", min_width=8, max_width=30)
    table.add_column("text")
    for rank, ((_, score), chunk) in enumerate(zip(hits, chunks), start=1):
        table.add_row(str(rank), f"{score:.3f}", chunk.chunk_id[:12], Text(doc_label(chunk)),
                      Text(snippet(chunk.text, snippet_width)))
    return table


def check_not_a_workspace(text: str, what: str, fix: str) -> None:
    """`kvf search WORKSPACE` (or `kvf ask WORKSPACE`): the query left out, the workspace in its place."""
    from kvf.pipeline.workflows.workspace import folder_kind
    if folder_kind(Path(text)) == "workspace":
        raise KvfError(f"{text} is a workspace, given where the {what} goes; pass it with -w and {fix} -w {text}")


def search_command(
    query: Annotated[str, typer.Argument(help="What to search for, in plain words.")],
    workspace: Annotated[Path, typer.Option(
        "--workspace", "-w", help="Workspace folder holding chunks.parquet, bm25/ and dense/.")] = Path("workspace"),
    k: Annotated[int, typer.Option("--top-k", "-k", "--k", min=1, help="How many chunks to show.")] = 5,
    mode: Annotated[Optional[SearchMode], typer.Option(
        "--retriever", "--mode", show_default=False,
        help="Retriever: bm25 (Lucene keyword) or dense (embedding cosine) [default: bm25, or dense in a workspace "
             "without a BM25 index].")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the hits as JSON.")] = False,
):
    """Search the workspace's chunks and print the top hits."""
    import json
    from kvf.pipeline.retrieval.chunking import ChunkTable
    from kvf.pipeline.workflows.run import check_index_fresh, warn_corpus_changed
    from kvf.pipeline.workflows.workspace import Workspace
    ws = Workspace(workspace)
    if not ws.chunks_path.is_file():   # no build reached its indexes (a first build stopped in stage 1 may leave the folder)
        check_not_a_workspace(query, "query", 'the words to search for: kvf search "WORDS"')
        raise ws.not_built()
    mode = SearchMode(mode or ws.default_retriever())
    if ws.manifest_path.is_file():   # an index of an older chunk set would miss every newer document, silently
        check_index_fresh(ws, mode.value)
        warn_corpus_changed(ws)
    hits = ws.open_searcher(mode.value).search(query, k)
    chunks = ws.indexed_chunks(ChunkTable(ws.chunks_path), [cid for cid, _ in hits], mode.value)
    if json_out:
        print(json.dumps([{"rank": rank, "score": score, "chunk_id": c.chunk_id, "doc_id": c.doc_id, "title": c.title,
                           "text": c.text} for rank, ((_, score), c) in enumerate(zip(hits, chunks), start=1)]))
        return
    console = Console()
    if not hits:
        other = ("; BM25 matches words, `--retriever dense` matches meaning" if mode.value == "bm25" and ws.dense_dir.is_dir()
                 else "")   # dense always finds k: only BM25 comes back empty
        console.print(f"no {mode.value} hits for {query!r}{other}", markup=False)
        return
    # snippets sized to what the other columns leave, so each hit stays on one line and the table is scannable
    snippet_width = max(30, console.width - 60)
    console.print(hits_table(hits, chunks, f"{mode.value} top {len(hits)} for {query!r}", snippet_width))
