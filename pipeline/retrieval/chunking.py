"""Cut documents into fixed windows of model tokens; a chunk is named by the hash of its token ids."""
import hashlib
import json
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvf.errors import KvfError, warn
from kvf.pipeline.retrieval.corpus import Document


@dataclass
class Chunk:
    chunk_id: str          # sha256(tokenizer fingerprint + token ids), hex
    doc_id: str
    title: str
    text: str              # tokenizer.decode(token_ids), for display and retrieval only
    token_ids: list[int]   # exactly what goes into the prompt; never re-tokenised
    index_in_doc: int      # window number within its document


CHUNKS_SCHEMA = pa.schema([
    ("chunk_id", pa.string()),
    ("doc_id", pa.string()),
    ("title", pa.string()),
    ("text", pa.string()),
    ("token_ids", pa.list_(pa.int32())),
    ("index_in_doc", pa.int32()),
])

WRITE_ROWS = 4096    # chunks a ChunkTableWriter holds before it writes them as one row group
OBJECT_ROWS = 1024   # chunks ChunkTable.chunks makes Python objects of at a time

_fingerprints = weakref.WeakKeyDictionary()  # tokenizer -> fingerprint; hashing a 50k vocab is not free


def tokenizer_fingerprint(tokenizer) -> str:
    """Stable sha256 of what decides token ids: tokenizer class, vocab and special tokens."""
    cached = _fingerprints.get(tokenizer)
    if cached is not None:
        return cached
    identity = {
        "class": type(tokenizer).__name__,
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()),
    }
    fingerprint = hashlib.sha256(json.dumps(identity, ensure_ascii=False).encode("utf-8")).hexdigest()
    _fingerprints[tokenizer] = fingerprint
    return fingerprint


def chunk_id_for(fingerprint: str, token_ids: list[int]) -> str:
    """Content address of a chunk: same tokenizer and same ids give the same id, on any machine."""
    h = hashlib.sha256(fingerprint.encode("ascii"))
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())  # fixed width and byte order
    return h.hexdigest()


def tokenize_document(text: str, tokenizer) -> list[int]:
    """Token ids of one document, no BOS/EOS: the prompt builder adds its own template around chunks."""
    return tokenize_documents([text], tokenizer)[0]   # the build's batched call, so both cut the same ids


def window_starts(n_tokens: int, chunk_tokens: int, overlap: int) -> list[int]:
    """Window start offsets; the last window ends at the document end, none is inside the previous one."""
    stride = chunk_tokens - overlap
    starts = [0]
    while starts[-1] + chunk_tokens < n_tokens:
        starts.append(starts[-1] + stride)
    return starts


def validate_chunking(chunk_tokens: int, overlap: int):
    if chunk_tokens < 1:
        raise KvfError(f"--chunk-tokens must be at least 1 (got {chunk_tokens})")
    if overlap < 0 or overlap >= chunk_tokens:
        raise KvfError(f"--overlap must be in [0, --chunk-tokens) = [0, {chunk_tokens}) (got {overlap})")


def tokenize_documents(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of each text, no BOS/EOS, in one call: a fast tokenizer spreads a batch over the CPU's cores."""
    if not texts:
        return []
    # split_special_tokens: a literal "<|im_end|>" in a document stays text, never a control token
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]]


def split_document(doc: Document, tokenizer, chunk_tokens: int, overlap: int, fingerprint: str,
                   ids: list[int] | None = None) -> list[Chunk]:
    """All windows of one document in order, duplicates included; [] (with a warning) when it has no tokens.
    ids: the document's token ids, when tokenize_documents made them."""
    ids = tokenize_document(doc.text, tokenizer) if ids is None else ids  # once per document; windows cut it
    if not ids:
        warn(f"skipped document {doc.doc_id!r} in {doc.source_file}: it has no tokens")
        return []
    windows = [ids[start:start + chunk_tokens] for start in window_starts(len(ids), chunk_tokens, overlap)]
    return [Chunk(chunk_id=chunk_id_for(fingerprint, window), doc_id=doc.doc_id, title=doc.title,
                  text=tokenizer.decode(window), token_ids=window, index_in_doc=index)
            for index, window in enumerate(windows)]


def split_documents(docs: list[Document], tokenizer, chunk_tokens: int = 256,
                    overlap: int = 0) -> dict[str, list[Chunk]]:
    """doc_id -> all its windows in order, duplicates included (what a per-document context needs)."""
    validate_chunking(chunk_tokens, overlap)
    fingerprint = tokenizer_fingerprint(tokenizer)
    per_doc = {}
    for doc in docs:
        chunks = split_document(doc, tokenizer, chunk_tokens, overlap, fingerprint)
        if chunks:
            per_doc[doc.doc_id] = chunks
    return per_doc


def unique_chunks(per_doc: dict[str, list[Chunk]]) -> list[Chunk]:
    """Every distinct chunk once, first occurrence wins: identical token ids share one stored KV."""
    chunks, seen = [], set()
    for doc_chunks in per_doc.values():
        for chunk in doc_chunks:
            if chunk.chunk_id not in seen:
                seen.add(chunk.chunk_id)
                chunks.append(chunk)
    return chunks


def chunk_documents(docs: list[Document], tokenizer, chunk_tokens: int = 256, overlap: int = 0) -> list[Chunk]:
    """Tokenise each document once, cut it into windows, keep identical chunks once (first wins)."""
    return unique_chunks(split_documents(docs, tokenizer, chunk_tokens, overlap))


class ChunkTableWriter:
    """chunks.parquet written a batch of rows at a time, so a corpus's chunks are never all in memory."""

    def __init__(self, path: str | Path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(path, CHUNKS_SCHEMA)
        self._pending = []
        self.chunks = self.tokens = 0

    def add(self, chunk: Chunk) -> None:
        self._pending.append(chunk)
        self.chunks += 1
        self.tokens += len(chunk.token_ids)
        if len(self._pending) >= WRITE_ROWS:
            self._flush()

    def _flush(self) -> None:
        columns = {name: [getattr(c, name) for c in self._pending] for name in CHUNKS_SCHEMA.names}
        self._writer.write_table(pa.table(columns, schema=CHUNKS_SCHEMA))
        self._pending = []

    def __enter__(self) -> "ChunkTableWriter":
        return self

    def __exit__(self, *exc) -> None:
        if self._pending and exc[0] is None:
            self._flush()
        self._writer.close()


def write_chunks_table(chunks: list[Chunk], path: str | Path):
    """Save chunks as one Parquet table, token ids as an int32 list column."""
    with ChunkTableWriter(path) as writer:
        for chunk in chunks:
            writer.add(chunk)


def read_chunks_table(path: str | Path) -> list[Chunk]:
    """Load chunks written by write_chunks_table, in the same order."""
    return [Chunk(**row) for row in _checked_table(path).to_pylist()]


def iter_chunk_tokens(path: str | Path, rows: int = 4096):
    """(chunk id, token ids) of every chunk in table order, read a batch of rows at a time."""
    _check_table(path)
    for batch in pq.ParquetFile(path).iter_batches(batch_size=rows, columns=["chunk_id", "token_ids"]):
        yield from zip(batch.column("chunk_id").to_pylist(), batch.column("token_ids").to_pylist())


def read_chunk_ids(path: str | Path) -> list[str]:
    """The chunks' ids only, in table order (no token ids or texts as Python objects)."""
    return read_chunk_columns(path, ["chunk_id"])[0]


def read_chunk_columns(path: str | Path, columns: list[str]) -> list[list]:
    """Those columns of the chunks table only, each a list in table order."""
    table = _checked_table(path, columns)
    return [table.column(name).to_pylist() for name in columns]


class ChunkRows(Mapping):
    """A map keyed by chunk id over rows kept in table order: `ids` (that order) and each id's row."""

    def __init__(self, ids: list[str]):
        self.ids = ids                                        # table order
        self._row = {cid: i for i, cid in enumerate(ids)}     # id -> row

    def __contains__(self, chunk_id) -> bool:
        return chunk_id in self._row

    def __iter__(self):
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


class ChunkTable(ChunkRows):
    """chunks.parquet as a read-only map chunk id -> Chunk, for building entries and answering questions.

    The table stays columnar (Arrow) and only the chunks asked for become Chunk objects: 100K
    256-token chunks as Python lists hold a Python int per token, 1.6 GB; columnar, 0.3 GB
    (scripts/bench_chunk_table.py), and a run or a Ray worker asks for a few chunks per question.
    """

    def __init__(self, path: str | Path):
        self._table = _checked_table(path)
        super().__init__(self._table.column("chunk_id").to_pylist())
        self._lengths = pc.list_value_length(self._table.column("token_ids")).to_numpy()   # [chunks] tokens each
        self.texts = _TextColumn(self._table.column("text"))
        self.titles = _TextColumn(self._table.column("title"))
        pa.default_memory_pool().release_unused()   # the reader's decompression buffers: half again the table

    def __getitem__(self, chunk_id: str) -> Chunk:
        return Chunk(**self._table.slice(self._row[chunk_id], 1).to_pylist()[0])

    def chunks(self, ids: list[str] | None = None) -> Iterator[Chunk]:
        """Chunk objects of `ids` (every chunk by default) in that order, made OBJECT_ROWS at a time."""
        for batch in self.batches(ids):
            yield from batch

    def batches(self, ids: list[str] | None = None) -> Iterator[list[Chunk]]:
        """Lists of at most OBJECT_ROWS Chunk objects of `ids` (every chunk by default), in that order."""
        ids = self.ids if ids is None else ids
        for start in range(0, len(ids), OBJECT_ROWS):
            rows = self._table.take([self._row[cid] for cid in ids[start:start + OBJECT_ROWS]])
            yield [Chunk(**row) for row in rows.to_pylist()]

    def tokens(self, ids: list[str] | None = None) -> int:
        """How many tokens `ids` (every chunk by default) hold."""
        if ids is None:
            return int(self._lengths.sum())
        return int(self._lengths[[self._row[cid] for cid in ids]].sum())


class _TextColumn(Sequence):
    """The text column as a sequence of str, a row made a str only when it is read."""

    def __init__(self, column: pa.ChunkedArray):
        self._column = column

    def __getitem__(self, row: int) -> str:
        return self._column[row].as_py()

    def __len__(self) -> int:
        return len(self._column)


def _checked_table(path: str | Path, columns: list[str] | None = None) -> pa.Table:
    """The chunks table's columns (all of CHUNKS_SCHEMA by default), checked first."""
    _check_table(path)
    columns = columns or CHUNKS_SCHEMA.names
    try:   # a row group at a time, one thread, no read-ahead: read_table's buffers cost as much again as the table
        table = pq.ParquetFile(path, pre_buffer=False)
        schema = pa.schema([table.schema_arrow.field(name) for name in columns])
        return pa.Table.from_batches(table.iter_batches(columns=columns, use_threads=False), schema=schema)
    except (pa.ArrowInvalid, OSError) as e:
        raise KvfError(f"chunks table {path} is not a readable Parquet file ({e}); rebuild the workspace") from e


def _check_table(path: str | Path) -> None:
    """A missing chunks table, a damaged one or one without CHUNKS_SCHEMA's columns is one line (its schema
    only is read)."""
    path = Path(path)
    if not path.exists():
        raise KvfError(f"chunks table {path} does not exist; "
                       f"build it with `kvf build-cache CORPUS --workspace {path.parent}`")
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowInvalid, OSError) as e:
        raise KvfError(f"chunks table {path} is not a readable Parquet file ({e}); rebuild the workspace") from e
    missing = [name for name in CHUNKS_SCHEMA.names if name not in names]
    if missing:
        raise KvfError(f"chunks table {path} lacks columns {missing}; rebuild the workspace")
