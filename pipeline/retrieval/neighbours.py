"""Each chunk's most similar other chunks: the input of FusionRAG's offline stage."""
import json
from pathlib import Path

import numpy as np

from kvf.errors import KvfError
from kvf.pipeline.files import write_atomic


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
    write_atomic(path, json.dumps(neighbours))


def load_neighbours(path: str | Path, known_ids: set[str] | None = None) -> dict[str, list[str]]:
    """The neighbours file, checked: a damaged one, or one naming chunks the workspace does not
    have (another corpus's), is a one-line error with the fix."""
    path = Path(path)
    fix = f"rebuild the workspace's neighbours with `kvf build-cache CORPUS --workspace {path.parent} --variant fusion`"
    if not path.exists():
        raise KvfError(f"neighbours file {path} does not exist; {fix}")
    try:
        neighbours = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise KvfError(f"neighbours file {path} is damaged (not JSON); {fix}") from None
    if not isinstance(neighbours, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v) for k, v in neighbours.items()):
        raise KvfError(f"neighbours file {path} is damaged (expected chunk id -> list of chunk ids); {fix}")
    if known_ids is not None:
        foreign = next((x for k, v in neighbours.items() for x in [k, *v] if x not in known_ids), None)
        if foreign is not None:
            raise KvfError(f"neighbours file {path} names chunk {foreign[:12]}, which is not in this workspace; {fix}")
    return neighbours
