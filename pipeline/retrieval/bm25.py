"""Lucene BM25 over chunks, built and searched in-process with pyserini (local indexes only, no downloads)."""
import os
from collections.abc import Iterable
from pathlib import Path

from kvf.errors import KvfError
from kvf.pipeline.files import atomic_dir
from kvf.pipeline.retrieval.chunking import Chunk
from kvf.pipeline.retrieval.java import ensure_java


def chunk_contents(chunk: Chunk) -> str:
    """What BM25 sees: the document title helps short chunks that never repeat their subject."""
    return f"{chunk.title}\n{chunk.text}" if chunk.title else chunk.text


def build_bm25(chunks: Iterable[Chunk], index_dir: str | Path, threads: int | None = None, on_batch=None,
               batch: int = 2000):
    """(Re)build a Lucene index at index_dir with one document per chunk, id = chunk_id. chunks may be a
    stream (ChunkTable.chunks()): they are sent to Lucene a batch at a time."""
    ensure_java(str(Path(index_dir).parent))
    from pyserini.index.lucene import LuceneIndexer
    threads = threads or min(4, os.cpu_count() or 1)
    with atomic_dir(index_dir) as tmp:  # a stale index with other chunk ids must never mix in, nor half a new one
        # Anserini's SimpleIndexer: JsonCollection docs, default English analyzer (Porter stemming, stopwords)
        indexer = LuceneIndexer(str(tmp), threads=threads)
        n_chunks, part = 0, []
        try:
            for chunk in chunks:   # in batches, so a long build shows progress
                part.append({"id": chunk.chunk_id, "contents": chunk_contents(chunk)})
                if len(part) == batch:
                    n_chunks += add_batch(indexer, part, on_batch)
                    part = []
            n_chunks += add_batch(indexer, part, on_batch)
        finally:
            indexer.close()  # commits to disk
        if not n_chunks:
            raise KvfError("no chunks to index for BM25; check the corpus produced documents")
        check_written(tmp, index_dir, n_chunks)


def add_batch(indexer, documents: list[dict], on_batch) -> int:
    if documents:
        indexer.add_batch_dict(documents)
        if on_batch is not None:
            on_batch(len(documents))
    return len(documents)


def check_written(tmp: Path, index_dir: str | Path, n_chunks: int) -> None:
    """Lucene logs a failed commit (disk full) and carries on, leaving segment files but no segments_N
    index of them: such an index must not replace a good one, nor look built."""
    fix = "if the disk is full, free some space there; then re-run the build"
    if not any(Path(tmp).glob("segments_*")):
        raise KvfError(f"BM25 index {index_dir}: Lucene could not commit it (see its log above); {fix}")
    from pyserini.index.lucene import LuceneIndexReader
    documents = LuceneIndexReader(str(tmp)).stats()["documents"]
    if documents != n_chunks:
        raise KvfError(f"BM25 index {index_dir}: Lucene wrote {documents} of {n_chunks} chunks (see its log above); {fix}")


class BM25Searcher:
    """BM25 search over an index built by build_bm25."""

    def __init__(self, index_dir: str | Path):
        index_dir = Path(index_dir)
        if not index_dir.is_dir() or not any(index_dir.glob("segments_*")):
            dense = " (or search its dense index: --retriever dense)" if (index_dir.parent / "dense").is_dir() else ""
            raise KvfError(f"BM25 index {index_dir} does not exist or is incomplete; build it with "
                           f"`kvf build-cache CORPUS --workspace {index_dir.parent} --bm25 --rebuild bm25`{dense}")
        ensure_java(str(index_dir.parent))
        from pyserini.search.lucene import LuceneSearcher
        try:
            self.searcher = LuceneSearcher(str(index_dir))  # BM25 k1=0.9, b=0.4 (Anserini defaults)
        except Exception as e:  # a damaged Lucene file surfaces as a Java exception through pyjnius
            raise KvfError(f"BM25 index {index_dir} is damaged ({str(e).splitlines()[0][:80]}); rebuild it with "
                           f"`kvf build-cache CORPUS --workspace {index_dir.parent} --rebuild bm25`") from None

    def search(self, query: str, k: int = 10) -> list[tuple[str, float]]:
        """Top-k (chunk_id, score), best first."""
        if not query or not query.strip():
            raise KvfError("the search query is empty; pass some words to search for")
        if k < 1:
            raise KvfError(f"-k must be at least 1 (got {k})")
        allow_clauses(len(query))
        try:
            hits = self.searcher.search(query, k=k)
        except Exception as e:  # Java exceptions (a damaged segment) come through pyjnius
            raise KvfError(f"BM25 search failed ({str(e).splitlines()[0][:80]}); the index may be damaged: rebuild it "
                           "with `kvf build-cache CORPUS --workspace WS --rebuild bm25`") from None
        return [(hit.docid, float(hit.score)) for hit in hits]


def allow_clauses(n: int) -> None:
    """Lucene makes one clause per distinct query term and refuses more than 1,024 by default (TooManyClauses):
    a long question failed as if the index were damaged. A term takes at least one character, so a query of n
    characters never needs more than n. The limit is the JVM's, for every searcher."""
    from jnius import autoclass
    searcher_class = autoclass("org.apache.lucene.search.IndexSearcher")
    if searcher_class.getMaxClauseCount() < n:
        searcher_class.setMaxClauseCount(n)
