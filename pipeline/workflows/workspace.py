"""A workspace: what `kvf build-cache` writes for one corpus and model, and `kvf run` reads.

    workspace/
      manifest.json      model, fingerprints, chunking, store location (and S3 endpoint) and format
      chunks.parquet     every chunk: id, doc, title, text, token ids
      doc_chunks.json    doc id -> its chunk ids in order (per-question contexts)
      corpus_stamp.json  how many corpus files were chunked, and a digest of their paths, sizes and times
      bm25/              Lucene index (pyserini)
      dense/             faiss index + embeddings
      neighbours.npz     each chunk's top-n similar chunks (FusionRAG's offline input; .json before)
      kv.zarr            the KV store, unless --store points elsewhere

It also names store entries: the key of a chunk's KV says which model computed it and in which dtype,
which offline variant, what it attended to (S, and for `fusion` its neighbours), and its token ids.
"""
from __future__ import annotations

import difflib
import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvf.errors import KvfError, shown
from kvf.cachestore import FORMATS, entry_key
from kvf.cachestore.dtypes import STORE_DTYPES
from kvf.pipeline.files import other_files, write_atomic
from kvf.pipeline.retrieval.corpus import SUPPORTED_EXTENSIONS, corpus_stamp, holds_documents
from kvf.pipeline.workflows.devices import COMPUTE_DTYPES

VARIANTS = ("prefix", "fusion")
SYSTEM_VARIANT = "system"  # the entry holding S's own KV


STAMP_CHECK_FILES = 10_000   # a corpus of more files is not listed again on every run to tell whether it changed


def ids_digest(ids: list) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


@dataclass
class EntryKeys:
    """Store keys of S and of chunks, for one model computing in one dtype, and one system prefix."""
    model_fingerprint: str
    prefix_ids: list[int]
    compute_dtype: str = "float32"

    @property
    def computed_by(self) -> str:
        """The model, and the dtype its weights computed in: bfloat16 arithmetic gives other bytes than
        float32's, so its entries are others (float32's keys are those of stores built before dtypes)."""
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype {self.compute_dtype!r}: not one of {', '.join(COMPUTE_DTYPES)}")
        return self.model_fingerprint + ("" if self.compute_dtype == "float32" else f"@{self.compute_dtype}")

    def system(self) -> str:
        return entry_key(self.computed_by, SYSTEM_VARIANT, "", self.prefix_ids)

    def chunk(self, variant: str, segment_ids: list[int], neighbour_ids: list[str] = ()) -> str:
        """prefix: attended to S. fusion: attended to S then the neighbours (by chunk id, in order)."""
        if variant not in VARIANTS:
            raise KvfError(f"--variant {variant}: unknown; use one of {', '.join(VARIANTS)}")
        context = [ids_digest(self.prefix_ids)] + (list(neighbour_ids) if variant == "fusion" else [])
        return entry_key(self.computed_by, variant, ids_digest(context), segment_ids)


def document_meant(doc_id: str, doc_chunks: dict[str, list[str]]) -> str | None:
    """The workspace document an id not among doc_chunks most likely means: its file name with the extension left
    off (ids of text files' documents are file names), else one spelt alike (small workspaces only)."""
    if doc_id in doc_chunks:
        return None
    for extension in SUPPORTED_EXTENSIONS:
        if doc_id + extension in doc_chunks:
            return doc_id + extension
    if len(doc_chunks) > 100_000:   # difflib compares with every id: a slow error on a large corpus
        return None
    return next(iter(difflib.get_close_matches(doc_id, doc_chunks, n=1)), None)


def workspaces_meant(folder: Path) -> list[Path]:
    """The workspace a folder that is no store was likely named for: a prepared dataset's (DIR/workspace, named
    as DIR or DIR/corpus), or the workspace it is a folder of (its bm25/ or dense/); else the workspaces inside
    it (`kvf store verify .` where a workspace was built)."""
    folder = folder.absolute()
    for candidate in (folder / "workspace", folder.parent, folder.parent / "workspace"):
        if (candidate / "manifest.json").is_file():
            return [candidate]
    try:
        return sorted(d for d in folder.iterdir() if d.is_dir() and (d / "manifest.json").is_file())
    except OSError:   # not a folder, or one we may not list
        return []


def folder_kind(path: Path) -> str | None:
    """What a path the user gave is, for the line that says so when another kind was meant: "file", "workspace"
    (kvf build-cache made it: manifest.json), "dataset" (kvf data prepare made it: questions.jsonl),
    "documents" (files build-cache reads), or None."""
    if path.is_file():
        return "file"
    if (path / "manifest.json").is_file():
        return "workspace"
    if (path / "questions.jsonl").is_file():
        return "dataset"
    return "documents" if holds_documents(path) else None


def as_given(path: Path, given: Path) -> Path:
    """`path` in a line about `given`, the way the user wrote `given`: relative to here when it was relative."""
    return path if given.is_absolute() else Path(os.path.relpath(path))


def check_not_made_by_kvf(folder: Path, flag: str, example: str) -> None:
    """An output folder (kvf eval's, kvf bench's) is no workspace nor prepared dataset: the summary and plots went
    among their files. Nor is it among the documents a workspace beside it was built from: the next build-cache
    read summary.md as a document."""
    kind = folder_kind(folder) if folder.is_dir() else None
    if kind in ("workspace", "dataset"):
        made = "a workspace (kvf build-cache made it)" if kind == "workspace" else "a prepared dataset (kvf data made it)"
        raise KvfError(f"{flag} {folder} is {made}; pass a folder of its own for the results, e.g. {flag} {example}")
    here = folder.resolve()
    for ws in workspaces_beside(here):
        documents = Workspace(ws).documents()
        if documents is not None and here.is_relative_to(documents):   # the folder itself, or one inside it
            ws, documents = as_given(ws, folder), as_given(documents, folder)
            raise KvfError(f"{flag} {folder} is among the documents workspace {ws} was built from ({documents}): the "
                           f"next `kvf build-cache -w {ws}` would read the results as documents; pass a folder of its "
                           f"own, e.g. {flag} {example}")


def workspaces_beside(folder: Path) -> list[Path]:
    """The workspaces next to a folder or to the two folders above it (docs/ and workspace/ side by side; a
    dataset's corpus/ and workspace/): where one built from documents in `folder` would be."""
    found = []
    for level in (folder, folder.parent, folder.parent.parent):
        try:
            found += [d for d in sorted(level.parent.iterdir()) if (d / "manifest.json").is_file()]
        except OSError:   # not there, or not ours to list
            continue
    return list(dict.fromkeys(found))


def instead_of_documents(path: Path) -> tuple[str, str | None] | None:
    """Where a folder of documents was meant (build-cache's CORPUS, data prepare's --corpus) and a workspace or a
    prepared dataset was given, their own files would be read as documents: ("workspace", the documents it was
    built from, None where its manifest does not say) or ("dataset", its corpus folder); else None."""
    kind = folder_kind(path)
    if kind == "workspace":
        return "workspace", Workspace(path).manifest().get("corpus")
    if kind == "dataset" and (path / "corpus").is_dir():
        return "dataset", str(path / "corpus")
    return None


def check_corpus_folder(corpus: Path) -> None:
    """`data prepare custom --corpus` names documents: a workspace or a prepared dataset there had its own files
    read as documents (a questions file among them), after a warning about the rest."""
    found = instead_of_documents(corpus)
    if found is None:
        return
    kind, documents = found
    if kind == "workspace":
        fix = f"pass the documents it was built from: --corpus {documents}" if documents else "pass your documents"
        raise KvfError(f"--corpus {corpus} is a workspace (kvf build-cache made it); {fix}")
    raise KvfError(f"--corpus {corpus} is a prepared dataset; pass its documents: --corpus {documents}")


# each field build-cache writes into manifest.json, by kind (any may be null): [str] a list of strings,
# {str} an object of strings
MANIFEST_KINDS = {"store": str, "s3_endpoint": str, "corpus": str, "corpus_absolute": str, "model": str, "model_arg": str,
                  "model_fingerprint": str, "tokenizer_fingerprint": str, "embedder": str, "format": str, "dtype": str,
                  "compute_dtype": str, "chunk_tokens": int, "overlap": int, "n_neighbours": int, "bm25": bool,
                  "dense": bool, "indexes": {str}, "variants": [str], "extras_for": [str]}

# the values kvf writes there: another (a hand edit) is the manifest's damage, not a flag the user never gave
MANIFEST_VALUES = {"dtype": lambda v, m: v in STORE_DTYPES, "format": lambda v, m: v in FORMATS,
                   "compute_dtype": lambda v, m: v in COMPUTE_DTYPES, "variants": lambda v, m: set(v) <= set(VARIANTS),
                   "chunk_tokens": lambda v, m: v >= 1, "overlap": lambda v, m: 0 <= v < (m.get("chunk_tokens") or v + 1),
                   "n_neighbours": lambda v, m: v >= 1, "extras_for": lambda v, m: stores_extras(v)}


def stores_extras(names: list[str]) -> bool:
    """Each name is a method with build-time extras (what `--extras-for` accepts, resolved as build-cache writes
    it); the registry is read only for a manifest that names some."""
    if not names:
        return True
    from kvf.pipeline.fusion.methods.base import methods_with_extras
    return set(names) <= set(methods_with_extras())


def of_kind(value, kind) -> bool:
    """A manifest field's value is None or of its MANIFEST_KINDS kind (true/false is not a number)."""
    if value is None:
        return True
    if isinstance(kind, list):
        return isinstance(value, list) and all(of_kind(v, kind[0]) and v is not None for v in value)
    if isinstance(kind, set):
        return isinstance(value, dict) and all(of_kind(v, next(iter(kind))) for v in value.values())
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


class Workspace:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    # paths
    manifest_path = property(lambda self: self.root / "manifest.json")
    chunks_path = property(lambda self: self.root / "chunks.parquet")
    doc_chunks_path = property(lambda self: self.root / "doc_chunks.json")
    corpus_stamp_path = property(lambda self: self.root / "corpus_stamp.json")   # what the chunks were read from
    bm25_dir = property(lambda self: self.root / "bm25")
    dense_dir = property(lambda self: self.root / "dense")
    neighbours_path = property(lambda self: self.root / "neighbours.npz")          # what a build writes
    legacy_neighbours_path = property(lambda self: self.root / "neighbours.json")  # what kvf wrote before
    index_state_path = property(lambda self: self.root / "indexes.json")

    def default_retriever(self) -> str:
        """bm25, or dense in a workspace with only a dense index (built --no-bm25, e.g. to skip Java): the
        bm25 default refused such a workspace, and told to build the index it was built without."""
        return "dense" if self.dense_dir.is_dir() and not self.bm25_dir.is_dir() else "bm25"

    def open_searcher(self, retriever: str):
        """The workspace's BM25 or dense index, opened to search (kvf search, kvf run, the Python API)."""
        if retriever == "bm25":
            from kvf.pipeline.retrieval.bm25 import BM25Searcher
            return BM25Searcher(self.bm25_dir)
        if retriever == "dense":
            from kvf.pipeline.retrieval.dense import DenseSearcher
            return DenseSearcher(self.dense_dir)
        raise KvfError(f"retriever {retriever!r}: use bm25 or dense")

    def own_files(self) -> set[str]:
        """The names build-cache and kvf run put in a workspace folder (the default store in either format)."""
        paths = (self.manifest_path, self.chunks_path, self.doc_chunks_path, self.corpus_stamp_path, self.bm25_dir,
                 self.dense_dir, self.neighbours_path, self.legacy_neighbours_path, self.index_state_path,
                 Path(self.default_store("zarr")), Path(self.default_store("hdf5")))
        return {p.name for p in paths}

    def check_own_folder(self, flag: str, store: str | None = None) -> None:
        """A workspace not built yet goes in a new or empty folder, or one a stopped first build left. Given a
        folder of other files (`-w .`, or `-w "$WS"` with WS unset), a build scattered its files among them."""
        if self.manifest_path.is_file():
            return
        ours, root = self.own_files(), self.root.resolve()
        if store is not None and "://" not in store and Path(store).resolve().is_relative_to(root):
            ours.update(Path(store).resolve().relative_to(root).parts[:1])   # --store inside the workspace
        others = other_files(self.root, ours)
        if others:
            raise KvfError(f"{flag} {self.root} holds other files ({', '.join(others[:3])}) and is not a kvf "
                           "workspace; pass a new or empty folder")

    @property
    def neighbours_file(self) -> Path:
        """The neighbours a reader uses: the .npz, else an older kvf's .json (until a build replaces it)."""
        legacy = self.legacy_neighbours_path
        return legacy if legacy.is_file() and not self.neighbours_path.is_file() else self.neighbours_path

    @contextmanager
    def files_lock(self, waiting: Callable[[str], None]):
        """Held while a build writes the workspace's files (chunks table, indexes, manifest): two builds at
        once take turns there, so neither interleaves its files with the other's. The KV stage runs
        outside it: shards of one build (--shard I/N) compute KVs side by side into the shared store."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".kvf-build.lock", "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waiting(f"another build is writing workspace {self.root}'s files; waiting for it")
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield   # closing the file releases the lock

    @contextmanager
    def kv_stage_turn(self):
        """Held by a build while it computes KVs: yields True to the first build, False to one that finds
        another computing KVs into this workspace now (it then builds in reverse; see stage_kv)."""
        with open(self.root / ".kvf-kv.lock", "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True   # closing the file releases the lock

    def check_chunks_are(self, chunk_ids: list[str]) -> None:
        """Before a build writes the manifest: the chunks table must still be the one it built, not one
        that a build with other settings wrote while this one computed KVs."""
        from kvf.pipeline.retrieval.chunking import read_chunk_ids
        on_disk = read_chunk_ids(self.chunks_path)
        if on_disk != chunk_ids:
            raise KvfError(f"--workspace {self.root}: another build-cache with other settings rewrote its chunks "
                           f"while this one ran ({len(on_disk)} chunks there, {len(chunk_ids)} here); its KVs are "
                           "stored, but the workspace is now the other build's: re-run this build on its own")

    def default_store(self, fmt: str | None = "zarr") -> str:
        if fmt is None and (self.root / "kv.h5").exists():
            fmt = "hdf5"
        return str(self.root / ("kv.h5" if fmt == "hdf5" else "kv.zarr"))

    def indexed_chunks(self, table, chunk_ids: list[str], index: str) -> list:
        """The chunks an index named, from the workspace's chunk table; an id the table lacks means the index was
        built over other chunks than chunks.parquet holds."""
        unknown = [cid for cid in chunk_ids if cid not in table]
        if unknown:
            raise KvfError(f"the {index} index of workspace {self.root} names chunk {unknown[0][:12]} missing from "
                           f"chunks.parquet: the index is stale; rebuild it with `kvf build-cache CORPUS -w {self.root}`")
        return [table[cid] for cid in chunk_ids]

    def not_built(self, named: str = "--workspace ", pass_as: str = "-w {}") -> KvfError:
        """The error for a folder without a manifest: none is written until a build's last stage ends, so a
        first build stopped midway (chunks and indexes there) is told apart from no build at all. pass_as: how the
        caller takes a workspace (`-w {}`, `--keep-workspace {}`, open_workspace's `path='{}'`), for the fix."""
        if self.chunks_path.is_file():
            return KvfError(f"{named}{self.root}: its first build-cache has not finished (no manifest.json yet); re-run "
                            f"the same `kvf build-cache CORPUS -w {self.root}` to finish it: it resumes where it stopped")
        if (self.root / "workspace" / "manifest.json").is_file():   # a prepared dataset that kvf run -d answered
            return KvfError(f"{named}{self.root}: a prepared dataset, not a workspace; its workspace is "
                            f"{self.root / 'workspace'}: pass {pass_as.format(self.root / 'workspace')}")
        meant = [m for m in workspaces_meant(self.root) if m != self.root.absolute()]
        if meant:   # a workspace's own folder (its kv.zarr, dense/), or a folder that holds workspaces
            shown_meant = [as_given(m, self.root) for m in meant]
            if meant[0] == self.root.absolute().parent:
                # its kv.zarr or dense/, its manifest.json, or a path not there (dense/ of a --no-dense build)
                inside = "a folder" if self.root.is_dir() else "a file" if self.root.is_file() else "a path"
                return KvfError(f"{named}{self.root}: {inside} inside workspace {shown_meant[0]}, not a workspace; "
                                f"pass {pass_as.format(shown_meant[0])}")
            if meant[0].parent == self.root.absolute().parent:   # a prepared dataset's corpus/, beside its workspace
                what = "not a workspace" if self.root.exists() else "no workspace there"   # a typo: -w ws3
                return KvfError(f"{named}{self.root}: {what}; the workspace beside it is {shown_meant[0]}: "
                                f"pass {pass_as.format(shown_meant[0])}")
            others = f" (or {', '.join(map(str, shown_meant[1:4]))})" if len(meant) > 1 else ""
            return KvfError(f"{named}{self.root}: it holds workspaces but is not one; pass one of them: "
                            f"{pass_as.format(shown_meant[0])}{others}")
        kind = folder_kind(self.root)
        if kind == "dataset":   # kvf data prepare's folder: its workspace is inside it
            return KvfError(f"{named}{self.root}: a prepared dataset, not a workspace; `kvf run -d {self.root}` builds "
                            f"its workspace in {self.root / 'workspace'}: pass {pass_as.format(self.root / 'workspace')} after that")
        if kind == "documents":   # a workspace is built from them, beside them
            return KvfError(f"{named}{self.root}: it holds documents, not a workspace; build one from them with "
                            f"`kvf build-cache {self.root} -w {self.root.name}-workspace`, then pass "
                            f"{pass_as.format(self.root.name + '-workspace')}")
        return KvfError(f"{named}{self.root}: no workspace there; build one first with "
                        f"`kvf build-cache YOUR_DOCS -w {self.root}`")

    def documents(self) -> Path | None:
        """The documents this workspace was built from, as its manifest records them (corpus_absolute); None where
        it does not (not built yet, built by an older kvf, or its manifest damaged: the callers' checks say so)."""
        if not self.manifest_path.is_file():
            return None
        try:
            found = self.manifest().get("corpus_absolute")   # the one reader of manifest.json, which checks its fields
        except (KvfError, OSError):
            return None
        return Path(found).resolve() if found else None

    def manifest(self) -> dict:
        if not self.manifest_path.is_file():
            raise self.not_built()
        manifest = self._read_json(self.manifest_path)
        if not isinstance(manifest, dict):
            raise self.damaged(self.manifest_path)
        wrong = next((name for name, kind in MANIFEST_KINDS.items() if not of_kind(manifest.get(name), kind)), None)
        if wrong is None:
            wrong = next((name for name, fits in MANIFEST_VALUES.items()
                          if manifest.get(name) is not None and not fits(manifest[name], manifest)), None)
        if wrong is not None:   # a hand edit: named here, not a TypeError wherever the field is next read
            raise self.damaged(self.manifest_path, f"its \"{wrong}\" is {shown(manifest[wrong])}")
        return manifest

    def damaged(self, path: Path, why: str = "") -> KvfError:
        return KvfError(f"{path} is damaged{f' ({why})' if why else ''}; rebuild it with `kvf build-cache CORPUS "
                        f"--workspace {self.root}` (stored KV entries are kept)")

    def _read_json(self, path: Path):
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self.damaged(path) from None

    def store_location(self) -> str:
        """The workspace's store: a URL, an absolute path, or a path relative to the workspace (so a
        moved workspace keeps using its own store, never the old location)."""
        location = self.manifest().get("store") or os.path.abspath(self.default_store(None))   # none named: its own
        if "://" in location or Path(location).is_absolute():
            return location
        return str((self.root / location).resolve())

    def reach_store(self) -> str:
        """store_location(), for opening: an s3:// store is reached at the endpoint its build used (the
        manifest's s3_endpoint), unless --s3-endpoint or AWS_ENDPOINT_URL names one; botocore, s3fs and
        Ray workers all read that variable."""
        location, endpoint = self.store_location(), self.manifest().get("s3_endpoint")
        if location.startswith("s3://") and endpoint and not os.environ.get("AWS_ENDPOINT_URL"):
            os.environ["AWS_ENDPOINT_URL"] = endpoint
        return location

    def relative_store(self, location: str) -> str:
        """What the manifest records for a store: relative to the workspace when it lies inside it."""
        if "://" in location:
            return location
        try:
            return str(Path(location).resolve().relative_to(self.root.resolve()))
        except ValueError:
            return str(Path(location).resolve())

    def write_manifest(self, manifest: dict) -> None:
        write_atomic(self.manifest_path, json.dumps(manifest, indent=1, sort_keys=True))

    def index_state(self) -> dict | None:
        """What each index on disk was built from, written as each one starts and ends (the manifest's copy
        is written only when a whole build ends); None when there is no such record or it is damaged."""
        try:
            state = json.loads(self.index_state_path.read_text())
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def write_index_state(self, state: dict) -> None:
        write_atomic(self.index_state_path, json.dumps(state, sort_keys=True))

    def doc_chunks(self) -> dict[str, list[str]]:
        if not self.doc_chunks_path.is_file():
            raise KvfError(f"{self.doc_chunks_path} is missing; rebuild it with `kvf build-cache CORPUS --workspace {self.root}`")
        doc_chunks = self._read_json(self.doc_chunks_path)
        if not isinstance(doc_chunks, dict) or not all(isinstance(v, list) for v in doc_chunks.values()):
            raise self.damaged(self.doc_chunks_path)
        return doc_chunks

    def write_doc_chunks(self, doc_chunks: dict[str, list[str]]) -> None:
        write_atomic(self.doc_chunks_path, json.dumps(doc_chunks))

    def write_corpus_stamp(self, stamp: dict) -> None:
        write_atomic(self.corpus_stamp_path, json.dumps(stamp))

    def corpus_changed(self, corpus: Path | None = None) -> Path | None:
        """The corpus this workspace was chunked from, when its files changed since (a document edited, added or
        removed: the workspace still answers from them as they were); else None, and None when that cannot be told
        cheaply: no stamp (built before kvf kept one), the corpus gone or moved, or more files than a check should
        list on every run. corpus: where it is now, when not where the manifest says."""
        try:
            recorded = json.loads(self.corpus_stamp_path.read_text())
            corpus = Path(corpus or self.manifest().get("corpus_absolute") or "")
        except (OSError, ValueError, KvfError):
            return None
        if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), int) \
                or recorded["files"] > STAMP_CHECK_FILES or not corpus.name or not corpus.exists():
            return None
        try:
            return corpus if corpus_stamp(corpus) != recorded else None
        except OSError:   # a file removed while it was listed
            return corpus
