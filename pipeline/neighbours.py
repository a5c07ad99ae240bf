"""Each chunk's most similar other chunks: the input of FusionRAG's offline stage."""
import json
from pathlib import Path

import numpy as np

from kvf import KvfError


def search_rows(embeddings: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k of each query row among all embeddings, best first."""
    import faiss
    index = faiss.IndexFlatIP(embeddings.shape[1])
    index.add(embeddings)
    return index.search(queries, k)


def top_neighbours(embeddings: np.ndarray, chunk_ids: list[str], n_neighbours: int = 10) -> dict[str, list[str]]:
    """For every chunk, its n most similar other chunks (not itself, not exact duplicates of it), best first."""
    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    n = len(chunk_ids)
    if embeddings.ndim != 2 or embeddings.shape[0] != n:
        raise ValueError(f"embeddings shape {embeddings.shape} does not match {n} chunk ids")
    if n_neighbours < 1:
        raise KvfError(f"--neighbours must be at least 1 (got {n_neighbours})")
    result, pending = {}, np.arange(n)
    k = min(n, n_neighbours + 1)  # +1: a chunk finds itself first
    while len(pending):
        _, rows = search_rows(embeddings, embeddings[pending], k)
        short = []
        for i, found in zip(pending, rows):
            # exact duplicates (same vector) carry no new information for the chunk
            others = [j for j in found if j >= 0 and j != i and not np.array_equal(embeddings[j], embeddings[i])]
            if len(others) < n_neighbours and k < n:
                short.append(i)  # duplicates ate some of the k slots; look further for this chunk
            result[chunk_ids[i]] = [chunk_ids[j] for j in others[:n_neighbours]]
        pending, k = np.array(short, dtype=np.int64), min(n, 2 * k)
    return {cid: result[cid] for cid in chunk_ids}


def save_neighbours(neighbours: dict[str, list[str]], path: str | Path):
    """JSON {chunk_id: [neighbour chunk ids, best first]}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(neighbours))


def load_neighbours(path: str | Path) -> dict[str, list[str]]:
    path = Path(path)
    if not path.exists():
        raise KvfError(f"neighbours file {path} does not exist; "
                       f"build it with `kvf build-cache CORPUS --workspace {path.parent}`")
    return json.loads(path.read_text())
