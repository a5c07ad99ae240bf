"""Each chunk's most similar other chunks: the input of FusionRAG's offline stage."""
import json
import zipfile
from collections.abc import Container, Mapping
from pathlib import Path

import numpy as np

from kvf.errors import KvfError
from kvf.pipeline.files import atomic_path
from kvf.pipeline.retrieval.chunking import ChunkRows


EXACT_UP_TO = 50_000   # chunks searched exactly; above, every pair (n² work) is days at Wikipedia's 21M passages
IVF_PROBES = 32        # lists an approximate search reads of its about √n
QUERY_BLOCK = 65_536   # chunks a search asks for at once: bounds its [block, k] answers and paces the progress bar


def neighbour_index(embeddings: np.ndarray, exact_up_to: int = EXACT_UP_TO, probes: int = IVF_PROBES):
    """A faiss inner-product index over embeddings [n, dim]: flat (exact) up to exact_up_to rows; above, an
    inverted file of about √n lists, of which a search reads `probes`: about n^1.5 work instead of n². Reading
    a fixed number finds fewer of the exact neighbours as n grows (results/ann_recall.md).

    Not HNSW, as the dense index is: its graph depends on the order threads insert, and neighbours key the
    fusion entries, so a rebuild must find the same ones. k-means (faiss's fixed seed) and the lists do not.
    """
    import faiss
    n, dim = embeddings.shape
    if n <= exact_up_to:
        index = faiss.IndexFlatIP(dim)
    else:
        n_lists = int(round(n ** 0.5))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, n_lists, faiss.METRIC_INNER_PRODUCT)
        index.train(embeddings)     # faiss samples 256 rows a list, by its fixed seed
        index.nprobe = min(probes, n_lists)
    index.add(embeddings)
    return index


class Neighbours(ChunkRows):
    """Each chunk's most similar other chunks, as a map chunk id -> [neighbour ids, best first].

    Held as one int32 matrix of rows into ids (-1: no more neighbours), lists made only when a chunk is
    asked for: as JSON lists of strings, a million chunks' 10 neighbours were a 750 MB file and about a
    GB of Python strings.
    """

    def __init__(self, ids: list[str], rows: np.ndarray):
        super().__init__(ids)
        self.rows = rows                                          # [chunks, n] int32, -1 padded

    @classmethod
    def from_dict(cls, neighbours: Mapping[str, list[str]]) -> "Neighbours":
        if isinstance(neighbours, Neighbours):
            return neighbours
        width = max((len(v) for v in neighbours.values()), default=0)
        table = cls(list(neighbours), np.full((len(neighbours), width), -1, dtype=np.int32))
        for i, found in enumerate(neighbours.values()):
            table.rows[i, :len(found)] = [table._row[nid] for nid in found]
        return table

    def __getitem__(self, chunk_id: str) -> list[str]:
        return [self.ids[j] for j in self.rows[self._row[chunk_id]].tolist() if j >= 0]


def top_neighbours(embeddings: np.ndarray, chunk_ids: list[str], n_neighbours: int = 10,
                   exact_up_to: int | None = None, on_block=None, probes: int | None = None) -> Neighbours:
    """For every chunk, its n most similar other chunks (not itself, not exact duplicates of it), best first:
    exactly up to exact_up_to chunks (default EXACT_UP_TO), approximately above (neighbour_index, reading
    `probes` lists, default IVF_PROBES). The chunks ask in blocks of QUERY_BLOCK; on_block(m) after each (a progress
    bar's advance)."""
    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    n = len(chunk_ids)
    if embeddings.ndim != 2 or embeddings.shape[0] != n:
        raise ValueError(f"embeddings shape {embeddings.shape} does not match {n} chunk ids")
    if n_neighbours < 1:
        raise KvfError(f"--neighbours must be at least 1 (got {n_neighbours})")
    result = np.full((n, min(n_neighbours, max(0, n - 1))), -1, dtype=np.int32)   # [chunks, n]
    probes = IVF_PROBES if probes is None else probes
    if probes < 1:
        raise KvfError(f"--neighbour-probes must be at least 1 (got {probes})")
    index = neighbour_index(embeddings, EXACT_UP_TO if exact_up_to is None else exact_up_to, probes)
    for start in range(0, n, QUERY_BLOCK):
        rows = np.arange(start, min(n, start + QUERY_BLOCK))
        fill_neighbours(index, embeddings, rows, result, n_neighbours)
        if on_block is not None:
            on_block(len(rows))
    return Neighbours(list(chunk_ids), result)


def fill_neighbours(index, embeddings: np.ndarray, rows: np.ndarray, result: np.ndarray, n_neighbours: int) -> None:
    """result[rows] <- each row's nearest other rows, best first; a row whose exact duplicates (the same
    vector: no new information) took some of the k slots asks again with twice k."""
    n = len(embeddings)
    pending, k = rows, min(n, n_neighbours + 1)  # +1: a chunk finds itself first
    while len(pending):
        _, found_rows = index.search(embeddings[pending], k)                     # [pending, k], -1 padded
        short = []
        for i, found in zip(pending, found_rows):
            others = [j for j in found if j >= 0 and j != i and not np.array_equal(embeddings[j], embeddings[i])]
            if len(others) < n_neighbours and k < n and found[-1] >= 0:
                short.append(i)  # -1 at the end: nothing further to find
            others = others[:result.shape[1]]
            result[i, :len(others)] = others
            result[i, len(others):] = -1
        pending, k = np.array(short, dtype=np.int64), min(n, 2 * k)


def save_neighbours(neighbours: Mapping[str, list[str]], path: str | Path):
    """An .npz of chunk_ids (bytes) and rows [chunks, n] (int32 rows into chunk_ids, -1 padded)."""
    neighbours = Neighbours.from_dict(neighbours)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, chunk_ids=np.array([cid.encode("utf-8") for cid in neighbours.ids], dtype=bytes),
                 rows=neighbours.rows)


def load_neighbours(path: str | Path, known_ids: Container[str] | None = None) -> Mapping[str, list[str]]:
    """The neighbours file, checked: a damaged one, or one naming chunks the workspace does not have
    (another corpus's), is a one-line error with the fix. A .json one is an older kvf's."""
    path = Path(path)
    # not --variant fusion: that computes every chunk's fusion KV, where a run computes those its questions need
    fix = f"rebuild the workspace's neighbours with `kvf build-cache CORPUS --workspace {path.parent} --dense --rebuild neighbours`"
    if not path.exists():
        raise KvfError(f"neighbours file {path} does not exist; {fix}")
    neighbours = _read_json(path, fix) if path.suffix == ".json" else _read_npz(path, fix)
    if known_ids is not None:
        foreign = next((x for x in neighbours.ids if x not in known_ids), None)
        if foreign is not None:
            raise KvfError(f"neighbours file {path} names chunk {foreign[:12]}, which is not in this workspace; {fix}")
    return neighbours


def _read_npz(path: Path, fix: str) -> Neighbours:
    try:
        with np.load(path, allow_pickle=False) as f:
            raw_ids, rows = f["chunk_ids"], f["rows"]
        chunk_ids = [cid.decode("utf-8") for cid in raw_ids.tolist()]
    except (OSError, ValueError, KeyError, EOFError, AttributeError, UnicodeDecodeError, zipfile.BadZipFile):
        raise KvfError(f"neighbours file {path} is damaged (not a neighbours .npz); {fix}") from None
    if rows.ndim != 2 or rows.shape[0] != len(chunk_ids) or rows.dtype.kind != "i" or (
            rows.size and not -1 <= rows.min() <= rows.max() < len(chunk_ids)):
        raise KvfError(f"neighbours file {path} is damaged (its rows do not index its chunk ids); {fix}")
    return Neighbours(chunk_ids, rows.astype(np.int32, copy=False))


def _read_json(path: Path, fix: str) -> Neighbours:
    try:
        neighbours = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise KvfError(f"neighbours file {path} is damaged (not JSON); {fix}") from None
    if not isinstance(neighbours, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v) for k, v in neighbours.items()):
        raise KvfError(f"neighbours file {path} is damaged (expected chunk id -> list of chunk ids); {fix}")
    foreign = next((x for v in neighbours.values() for x in v if x not in neighbours), None)
    if foreign is not None:   # every neighbour is a chunk of the same table
        raise KvfError(f"neighbours file {path} names chunk {foreign[:12]}, which is not in this workspace; {fix}")
    return Neighbours.from_dict(neighbours)
