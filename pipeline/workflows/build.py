"""`kvf build-cache`: corpus -> chunks -> BM25 + dense indexes -> neighbours -> chunk KV store.

Every stage can be re-run: the chunks table and indexes are rebuilt only when the chunk set
changed, and a KV entry is computed only when the store has no committed entry for its key, so a
killed build resumes where it stopped and an unchanged corpus costs no model work at all.
"""
from __future__ import annotations

import os
import shutil
import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from kvf.errors import KvfError, counted, did_you_mean, disk_full
from kvf.cachestore import FORMATS, StoreMismatch, open_store
from kvf.cachestore.base import batched
from kvf.cachestore.dtypes import STORE_DTYPES
from kvf.pipeline.retrieval.chunking import (Chunk, ChunkTable, ChunkTableWriter, split_document, tokenize_documents,
                                             tokenizer_fingerprint, validate_chunking)
from kvf.pipeline.retrieval.corpus import corpus_stamp, iter_corpus, list_corpus_files
from kvf.pipeline.retrieval.neighbours import EXACT_UP_TO, IVF_PROBES
from kvf.pipeline.files import atomic_path, check_writable_dir
from kvf.pipeline.fusion.methods import METHODS
from kvf.pipeline.fusion.methods.base import methods_with_extras
from kvf.pipeline.model.prompt import make_template
from kvf.pipeline.workflows.devices import compute_dtype, driver_device, dtype_meant, dtype_name, warn_if_slow
from kvf.pipeline.workflows.display import description_column, notice, progress_bar, size_text
from kvf.pipeline.workflows.weights import ModelRef, check_workspace_model, open_model, recorded_model, workspace_model
from kvf.pipeline.workflows.workspace import VARIANTS, EntryKeys, Workspace, ids_digest, instead_of_documents


DEFAULT_NEIGHBOURS = 10   # FusionRAG's top-n similar chunks per chunk


@dataclass
class BuildOptions:
    corpus: Path
    workspace: Path
    store: str | None = None           # path or fsspec URL; default workspace/kv.zarr (or kv.h5)
    format: str | None = None          # zarr or hdf5; None: the workspace's existing store, else zarr
    # None (a flag left out): the workspace's own setting, else WORKSPACE_SETTINGS' default (settle_settings)
    dtype: str | None = None
    chunk_tokens: int | None = None
    overlap: int | None = None
    variants: tuple[str, ...] | None = None
    n_neighbours: int | None = None
    neighbour_probes: int | None = None   # lists an approximate neighbour search reads (above EXACT_UP_TO chunks)
    exact_neighbours_up_to: int | None = None   # chunks searched exactly; above, approximately (EXACT_UP_TO)
    embedder: str | None = None
    model: str | None = None
    shard: tuple[int, int] = (0, 1)    # (I, N): build only chunks whose id hashes to shard I
    extras_for: tuple[str, ...] = ()   # methods whose build-time hook adds extras to every entry
    bm25: bool | None = None
    dense: bool | None = None
    device: str = "cpu"
    compute_dtype: str | None = None     # the model's dtype while computing KVs (None: float32 on cpu, bfloat16 on cuda)
    rebuild: tuple[str, ...] = ()        # stages to rebuild whatever the manifest says (a damaged index)
    indexes_only: bool = False           # chunks and indexes, no KVs (a run computes those its questions need)
    ray: str | None = None               # Ray address for the KV stage ("local": start one here); None: this process
    workers: int | None = None           # Ray actors (default: one per CPU, or per GPU with --device cuda)
    threads: int = 1                     # torch threads per Ray actor
    batch: int = 16                      # chunks per Ray task


# field: (flag, default for a new workspace, what giving another value than the workspace's costs)
WORKSPACE_SETTINGS = {
    "chunk_tokens": ("--chunk-tokens", 256, "every document is cut anew, and each new chunk's KV computed"),
    "overlap": ("--overlap", 0, "every document is cut anew, and each new chunk's KV computed"),
    "n_neighbours": ("--neighbours", DEFAULT_NEIGHBOURS, "neighbours are searched again, and fusion KVs computed again"),
    "neighbour_probes": ("--neighbour-probes", IVF_PROBES, "neighbours are searched again, and the fusion KVs of "
                         "chunks whose neighbours change computed again"),
    "exact_neighbours_up_to": ("--exact-neighbours-up-to", EXACT_UP_TO, "neighbours are searched again, and the fusion "
                               "KVs of chunks whose neighbours change computed again"),
    "embedder": ("--embedder", None, "every chunk is embedded again"),
    "dtype": ("--dtype", "float16", None),   # a store holds one dtype: another one is another store
    "variants": ("--variant", ("prefix",), None),   # another one adds its entries; none is recomputed
    "bm25": ("--bm25", True, None),                 # --no-bm25 once: a grown corpus does not start one
    "dense": ("--dense", True, None),
}


def settle_settings(opts: BuildOptions, previous: dict, console: Console) -> BuildOptions:
    """A flag left out keeps the workspace's setting, so a grown corpus is chunked, embedded and stored as
    before (it was cut at the defaults instead: every KV computed again, without a word). A flag that
    changes one is said in one line with what it costs; --dtype cannot change under a kept store."""
    settled = {}
    for name, (flag, default, cost) in WORKSPACE_SETTINGS.items():
        given, before = getattr(opts, name), previous.get(name)
        if isinstance(before, list):   # the variants built ahead: none when a run made the workspace
            before = tuple(before) or None
        if given is None:
            settled[name] = before if before is not None else default
        elif before is not None and given != before and cost is not None:
            console.print(f"warning: {flag} {given}: workspace {opts.workspace} was built with {before}; {cost} "
                          f"(leave {flag} out to keep {before})", style="yellow", markup=False, highlight=False,
                          soft_wrap=True)
    return replace(opts, **settled)


def check_store_dtype(opts: BuildOptions, previous: dict, same_store: bool) -> None:
    """The workspace's store holds one dtype; --dtype naming another would be refused by the store, naming no flag."""
    before = previous.get("dtype")
    if same_store and before is not None and opts.dtype != before:
        raise KvfError(f"--dtype {opts.dtype}: workspace {opts.workspace}'s store holds {before} KVs; leave --dtype "
                       f"out to keep adding {before} ones, or pass another --store for {opts.dtype}")


@dataclass
class StageStat:
    name: str
    items: int = 0
    tokens: int = 0
    seconds: float = 0.0
    note: str = ""


@dataclass
class BuildSummary:
    chunks: int = 0
    tokens: int = 0
    entries_written: int = 0
    entries_skipped: int = 0
    entries_found: int = 0      # planned, then stored by another writer first (another build, or a killed Ray batch's
                                # first try; found before computing, or lost the race)
    bytes_written: int = 0
    store: str = ""
    stages: list[StageStat] = field(default_factory=list)


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return (0, 1)
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise KvfError(f"--shard {text}: expected I/N, e.g. 0/4") from None
    if n >= 1 and i == n:   # counted from 1, as a scheduler's array index often is
        raise KvfError(f"--shard {text}: shards count from 0; the {n} shards are 0/{n} .. {n - 1}/{n}")
    if n < 1 or not 0 <= i < n:
        raise KvfError(f"--shard {text}: need 0 <= I < N")
    return (i, n)


def in_shard(chunk_id: str, shard: tuple[int, int]) -> bool:
    return int(chunk_id[:8], 16) % shard[1] == shard[0]


def shard_ids(chunks: ChunkTable, shard: tuple[int, int]) -> list[str]:
    """The ids of the chunks this build (--shard I/N) computes, in table order."""
    return [cid for cid in chunks.ids if in_shard(cid, shard)]


def build_progress(console: Console) -> Progress:
    return progress_bar(console, description_column(), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn())


@contextmanager
def stage(console: Console | None, name: str, total: int | None):
    """A named progress bar with an ETA for one build stage; yields advance(n). Quiet without a console."""
    if console is None:
        yield lambda n=1: None
        return
    with build_progress(console) as progress:
        task = progress.add_task(name, total=total, rate="")
        yield lambda n=1: progress.advance(task, n)
        progress.update(task, completed=total if total is not None else 1, total=total or 1)


def store_meta(model_ref: ModelRef, dtype: str) -> dict:
    config = model_ref.config
    return {"model": model_ref.fingerprint, "tokenizer": tokenizer_fingerprint(model_ref.tokenizer),
            "dtype": dtype, "layers": config.num_hidden_layers,
            "kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads}


def store_location(ws: Workspace, store: str | None, fmt: str | None) -> str:
    """Where the store lives; local paths made absolute, since the manifest is read from other cwds."""
    location = store or ws.default_store(fmt)
    return location if "://" in location else str(Path(location).expanduser().resolve())


def keep_workspace_store(opts: BuildOptions, ws: Workspace, previous: dict, console: Console) -> tuple[BuildOptions, bool]:
    """A rebuild (new documents, say) writes into the store the workspace already uses, wherever it lies
    (--store elsewhere, s3://), not into a new WORKSPACE/kv.zarr that recomputes every entry. --store or
    --format naming another store switches to it: said on stderr, and the previous store is left untouched.
    Returns the options with the store settled, and whether it is the workspace's previous one."""
    if not previous.get("store"):
        return opts, False
    current, current_format = ws.store_location(), previous.get("format")
    if opts.store is None and opts.format in (None, current_format):
        return replace(opts, store=ws.reach_store(), format=current_format), True
    wanted = store_location(ws, opts.store, opts.format)
    if wanted == current:
        return opts, True
    console.print(f"warning: --workspace {ws.root} switches from its store {current} to {wanted}, which must hold its "
                  f"own entries; the previous store is left as it was (delete it if unused, or pass --store {current} "
                  "to keep building into it)", style="yellow", markup=False, highlight=False, soft_wrap=True)
    return opts, False


def open_workspace_store(ws: Workspace, model_ref: ModelRef, store: str | None, fmt: str | None, dtype: str,
                         create: bool, readonly: bool | None = False):
    """A store keyed by this model's identity as an earlier kvf computed it is opened under that identity."""
    location = store_location(ws, store, fmt)
    try:
        return open_store(location, fmt, meta=store_meta(model_ref, dtype), create=create, readonly=readonly)
    except StoreMismatch as mismatch:
        if not model_ref.adopt(mismatch.stored.get("model")):
            raise
    return open_store(location, fmt, meta=store_meta(model_ref, dtype), create=create, readonly=readonly)


# ---- stage 1: chunks --------------------------------------------------------------------------
TOKENIZE_DOCS = 256   # documents tokenized in one call


def stage_chunks(opts: BuildOptions, ws: Workspace, tokenizer, console: Console | None = None,
                 files: list[Path] | None = None) -> tuple[ChunkTable, StageStat]:
    """Documents to chunks.parquet (each distinct chunk once, first occurrence wins) and doc_chunks.json, a
    document at a time: the corpus and its chunks are never all in memory as Python objects."""
    started = time.perf_counter()
    files = list_corpus_files(Path(opts.corpus)) if files is None else files
    stamp = corpus_stamp(Path(opts.corpus), files)   # before reading: an edit made while it reads is noticed later
    fingerprint = tokenizer_fingerprint(tokenizer)
    seen, doc_chunks, n_docs = set(), {}, 0
    megabytes = max(1, -(-sum(f.stat().st_size for f in files) // 2**20))
    with stage(console, "chunking (MiB read)", megabytes) as advance, \
            atomic_path(ws.chunks_path) as tmp, ChunkTableWriter(tmp) as table:   # temp: shards may share a workspace
        for docs in batched(iter_corpus(opts.corpus, files, on_bytes=lambda n: advance(n / 2**20)), TOKENIZE_DOCS):
            n_docs += len(docs)
            for doc, ids in zip(docs, tokenize_documents([d.text for d in docs], tokenizer)):
                chunks = split_document(doc, tokenizer, opts.chunk_tokens, opts.overlap, fingerprint, ids)  # duplicates kept
                if chunks:
                    doc_chunks[doc.doc_id] = [c.chunk_id for c in chunks]
                for chunk in chunks:
                    if chunk.chunk_id not in seen:   # identical token ids share one stored KV
                        seen.add(chunk.chunk_id)
                        table.add(chunk)
        if not table.chunks:
            raise KvfError(f"corpus {opts.corpus}: no chunk came out of it (every document was empty or skipped)")
    ws.write_doc_chunks(doc_chunks)
    ws.write_corpus_stamp(stamp)
    return ChunkTable(ws.chunks_path), StageStat("chunk", table.chunks, table.tokens, time.perf_counter() - started,
                                                 counted(n_docs, "document"))


# ---- stage 2: indexes and neighbours ----------------------------------------------------------
REBUILDABLE = ("bm25", "dense", "neighbours")


def index_digests(manifest: dict, chunk_ids: list[str], titles: list[str]) -> dict[str, str]:
    """What each index's entry in manifest["indexes"] must be for the current chunks table."""
    chunk_set = ids_digest(chunk_ids)
    return {"bm25": bm25_digest(chunk_set, titles),
            "dense": dense_digest(chunk_set, manifest.get("embedder"), manifest.get("n_neighbours"),
                                  manifest.get("neighbour_probes"), manifest.get("exact_neighbours_up_to"))}


def bm25_digest(chunk_set: str, titles: list[str]) -> str:
    """What the BM25 index was made from: the chunks and their documents' titles, which it indexes with their text
    (a title edited in the corpus changes no chunk id). A workspace built before titles were in it recorded the
    chunk set alone; kvf run takes that as fresh, and its next build indexes BM25 once more."""
    return ids_digest(["bm25", chunk_set, ids_digest(titles)])


def dense_digest(chunk_set: str, embedder: str | None, n_neighbours: int | None, probes: int | None,
                 exact_up_to: int | None = None) -> str:
    """What the dense index and the neighbours were made from. The search's settings are in it only when not
    the defaults, so workspaces made before --neighbour-probes and --exact-neighbours-up-to keep their neighbours."""
    made_from = [chunk_set, embedder or "default", n_neighbours]
    if probes not in (None, IVF_PROBES):
        made_from.append(probes)
    if exact_up_to not in (None, EXACT_UP_TO):
        made_from.append(["exact_up_to", exact_up_to])   # tagged: a probes-only digest must not equal it
    return ids_digest(made_from)


def record_index(ws: Workspace, state: dict, index: str, digest: str | None) -> None:
    """indexes.json as an index starts (digest None: what is on disk is not to be trusted) and ends: a build
    stopped after it resumes without building it again, one stopped inside it builds it again."""
    if digest is None:
        state.pop(index, None)
    else:
        state[index] = digest
    with _writing(ws):
        ws.write_index_state(state)


def stage_indexes(opts: BuildOptions, ws: Workspace, chunks: ChunkTable, previous: dict,
                  console: Console | None = None) -> list[StageStat]:
    """BM25, dense and neighbours, each rebuilt only when the chunk set (or its settings) changed.
    previous: what the indexes on disk were built from (updated here, and in indexes.json)."""
    from kvf.pipeline.retrieval.neighbours import save_neighbours, top_neighbours
    stats = []
    chunk_set = ids_digest(chunks.ids)
    bm25_key = bm25_digest(chunk_set, list(chunks.titles))
    tokens = chunks.tokens()
    if opts.bm25 and ("bm25" in opts.rebuild or not (previous.get("bm25") == bm25_key and ws.bm25_dir.is_dir())):
        from kvf.pipeline.retrieval.bm25 import build_bm25
        record_index(ws, previous, "bm25", None)
        started = time.perf_counter()
        with stage(console, "BM25 index", len(chunks)) as advance:
            build_bm25(chunks.chunks(), ws.bm25_dir, on_batch=advance)
        record_index(ws, previous, "bm25", bm25_key)
        stats.append(StageStat("bm25 index", len(chunks), tokens, time.perf_counter() - started))
    need_dense = opts.dense or "fusion" in opts.variants
    dense_key = dense_digest(chunk_set, opts.embedder, opts.n_neighbours, opts.neighbour_probes,
                             opts.exact_neighbours_up_to)
    fresh = previous.get("dense") == dense_key and ws.neighbours_path.is_file() and ws.dense_dir.is_dir()
    if need_dense and (not fresh or {"dense", "neighbours"} & set(opts.rebuild)):
        from kvf.pipeline.retrieval.dense import Embedder, build_dense, known_embeddings
        record_index(ws, previous, "dense", None)
        started = time.perf_counter()
        device = driver_device(opts.device, opts.ray)
        if device != opts.device and console is not None:
            console.print(f"note: --device {opts.device} is the Ray workers'; this driver sees no GPU, so it embeds the "
                          "dense index on its CPU", markup=False, highlight=False, soft_wrap=True)
        embedder = Embedder(opts.embedder, device=device)
        # a chunk embedded before (an earlier build of fewer documents, or one interrupted) is not embedded again
        known = known_embeddings(ws.dense_dir, embedder.name, embedder.dim, from_index="dense" not in opts.rebuild)
        new = [cid for cid in chunks.ids if cid not in known]
        with stage(console, "dense index", len(chunks)) as advance:
            embeddings = build_dense(chunks.texts, chunks.ids, ws.dense_dir, embedder, on_batch=advance, known=known)
        stats.append(StageStat("dense index", len(new), chunks.tokens(new),
                               time.perf_counter() - started, f"{len(chunks) - len(new)} reused" if len(new) < len(chunks) else ""))
        started = time.perf_counter()
        exact_up_to = EXACT_UP_TO if opts.exact_neighbours_up_to is None else opts.exact_neighbours_up_to
        if len(chunks) <= exact_up_to and opts.neighbour_probes not in (None, IVF_PROBES) and console is not None:
            console.print(f"note: --neighbour-probes {opts.neighbour_probes} reads lists of the approximate search, and "
                          f"these {len(chunks):,} chunks are searched exactly (up to --exact-neighbours-up-to "
                          f"{exact_up_to:,})", markup=False, highlight=False, soft_wrap=True)
        with stage(console, "neighbours", len(chunks)) as advance:
            save_neighbours(top_neighbours(embeddings, chunks.ids, opts.n_neighbours, on_block=advance,
                                           exact_up_to=opts.exact_neighbours_up_to, probes=opts.neighbour_probes),
                            ws.neighbours_path)
            ws.legacy_neighbours_path.unlink(missing_ok=True)
        record_index(ws, previous, "dense", dense_key)
        stats.append(StageStat("neighbours", len(chunks), 0, time.perf_counter() - started))
    previous.update({"bm25": bm25_key if opts.bm25 else previous.get("bm25"),
                     "dense": dense_key if need_dense else previous.get("dense")})
    return stats


# ---- stage 3: KV entries ----------------------------------------------------------------------
WRITES_BEHIND = 2   # entries computed but not yet stored, at most (each is a whole chunk's KV in host memory)


class EntryBuilder:
    """Computes and stores the KVs a set of chunks needs; loads the model only if something is missing."""

    def __init__(self, model_ref: ModelRef, store, device: str = "cpu", extras_for: tuple[str, ...] = (), engine=None,
                 dtype: torch.dtype = torch.float32):
        self.model_ref = model_ref
        self.store = store
        # given an engine, its model's dtype is the one entries are computed in
        self.device, self.dtype = device, engine.model.dtype if engine is not None else dtype
        self.use_extras(extras_for)
        self.template = make_template(model_ref.tokenizer)
        self.keys = EntryKeys(model_ref.fingerprint, self.template.prefix_ids, dtype_name(self.dtype))
        self._engine = engine
        self._system_kv: torch.Tensor | None = None
        self._writer: ThreadPoolExecutor | None = None   # the writing-behind thread, inside writing_behind()
        self._writes: deque[Future] = deque()            # its entries not yet known stored, oldest first
        self._write_failed = False                       # a write behind failed: the rest queued are dropped
        self.model_seconds = 0.0
        self.entries_written = 0   # every entry this builder committed (neighbours' included)
        self.entries_found = 0     # planned here, but another writer stored it first
        self.bytes_written = 0     # their KV payload bytes

    def use_extras(self, extras_for: Iterable[str]) -> None:
        """The methods whose build-time extras every entry computed from now on carries; an entry without them
        is missing to this builder."""
        self.extras_methods = [METHODS[name] for name in extras_methods(tuple(extras_for))]
        self.extras_names = {n for m in self.extras_methods for n in m.extras_names}

    @property
    def engine(self):
        if self._engine is None:
            from kvf.pipeline.fusion.engine import FusionEngine
            from kvf.pipeline.model.forward import Transformer
            self._engine = FusionEngine(Transformer(self.model_ref.load(self.device, self.dtype).model))
        return self._engine

    def key(self, variant: str, chunk: Chunk, neighbours: Mapping[str, list[str]] | None) -> str:
        segment = self.template.chunk_segment(chunk.token_ids)
        return self.keys.chunk(variant, segment, neighbours.get(chunk.chunk_id, []) if variant == "fusion" else ())

    def system_kv(self) -> torch.Tensor:
        """S's KV [L, 2, KV, s, d] as stored: from the store, else computed once and stored.

        Always the stored bits (read back, not the float32 just computed), so a chunk's KV does not
        depend on whether this process or an earlier one computed S: resumed == one-go build.
        Kept in memory: every chunk attends to it.
        """
        if self._system_kv is None:
            key = self.keys.system()
            if not self.store.has(key):
                kv = self.engine.prefix_kv(self.template.prefix_ids)
                self.store.put(key, kv, attrs={"variant": "system", "tokens": len(self.template.prefix_ids)})
            self._system_kv = self.store.get(key).float()
        return self._system_kv

    def needs(self, key: str) -> bool:
        return self.unserved([key]) == [key]

    def unserved(self, keys: list[str]) -> list[str]:
        """The keys with no entry, or with one built without a method's build-time extras (which does not serve
        that method). The store is asked about all of them at once: on S3, side by side."""
        held = self.store.headers(keys)
        return [key for key in keys if key not in held or not self.extras_names <= set(held[key].extras)]

    def missing(self, variant: str, chunks: Iterable[Chunk], neighbours) -> list[Chunk]:
        chunks = list(chunks)
        keys = [self.key(variant, c, neighbours) for c in chunks]
        unserved = set(self.unserved(keys))
        return [c for c, key in zip(chunks, keys) if key in unserved]

    def missing_ids(self, variant: str, chunks: ChunkTable, ids: list[str], neighbours) -> list[str]:
        """The ids among `ids` whose entries are missing; the chunks are made objects, and the store asked, a batch at a time."""
        return [c.chunk_id for batch in chunks.batches(ids) for c in self.missing(variant, batch, neighbours)]

    @torch.inference_mode()
    def compute(self, variant: str, chunk: Chunk, neighbours, by_id: Mapping[str, Chunk]) -> None:
        """Compute one chunk's KV for this variant and store it (inside writing_behind(), on the writer's thread)."""
        started = time.perf_counter()
        engine, template = self.engine, self.template
        segment = template.chunk_segment(chunk.token_ids)
        context_ids, context_kvs = list(template.prefix_ids), [self.system_kv()]
        neighbour_ids = neighbours.get(chunk.chunk_id, []) if variant == "fusion" else []
        for nid in neighbour_ids:  # FusionRAG eq. 10: the chunk attends to its neighbours' prefix KVs
            neighbour = by_id[nid]
            context_ids += template.chunk_segment(neighbour.token_ids)
            context_kvs.append(self.prefix_kv_of(neighbour, by_id))
        limit = engine.model.max_positions
        if len(context_ids) + len(segment) > limit:   # past the model's positions RoPE extrapolates: not its KV
            raise KvfError(f"chunk {chunk.chunk_id[:12]}: after S and its {len(neighbour_ids)} neighbours it would sit at "
                           f"positions {len(context_ids):,}-{len(context_ids) + len(segment):,}, past the model's "
                           f"{limit:,}; build with fewer --neighbours or smaller --chunk-tokens")
        attention = [] if self.extras_methods else None  # one prefill gives the KV and what the hooks read
        kv = engine.chunk_kv(segment, context_ids, context_kvs, attention_out=attention)   # [L, 2, KV, t, d]
        extras = {}
        context_lengths = [kv_.shape[3] for kv_ in context_kvs]
        for method in self.extras_methods:
            extras.update(method.extras_hook(attention, context_lengths, context_ids))
        self.model_seconds += time.perf_counter() - started
        key = self.keys.chunk(variant, segment, neighbour_ids)
        attrs = {"variant": variant, "chunk_id": chunk.chunk_id, "tokens": len(segment), "neighbours": neighbour_ids}
        if self._writer is None:
            self._store(key, kv, attrs, extras)
            return
        # copied here: on the writer's thread a copy would wait behind the next chunk's kernels
        kv = kv.cpu()
        extras = {name: x.cpu() if isinstance(x, torch.Tensor) else x for name, x in extras.items()}
        self._wait_for_writes(WRITES_BEHIND - 1)
        self._writes.append(self._writer.submit(self._store_behind, key, kv, attrs, extras))

    def _store(self, key: str, kv: torch.Tensor, attrs: dict, extras: dict) -> None:
        """One computed entry into the store, counted unless another writer committed it first."""
        if extras and self.store.has(key):  # replace an entry stored without summaries (see needs)
            self.store.delete(key)
        if self.store.put(key, kv, attrs=attrs, extras=extras):
            self.entries_written += 1
            self.bytes_written += self.store.kv_nbytes(kv.shape[3])   # kv: [L, 2, KV, t, d]
        else:
            self.entries_found += 1

    @torch.inference_mode()
    def _store_behind(self, key: str, kv: torch.Tensor, attrs: dict, extras: dict) -> None:
        """_store on the writer's thread. After a failed write the writes still queued are dropped: the build
        stops at its first failure, as it does when writing inline."""
        if self._write_failed:
            return
        try:
            self._store(key, kv, attrs, extras)
        except BaseException:
            self._write_failed = True
            raise

    def writes_behind(self) -> bool:
        """Whether writing_behind() overlaps writes with computing by default: on a GPU, which computes an
        entry in about the time the host takes to copy, checksum and write it, and on an object store, whose
        writes are mostly waits on the network. On a CPU writing to a local store, both would share the same
        cores, so entries are stored as they are computed."""
        return self.device.startswith("cuda") or self.store.remote

    @contextmanager
    def writing_behind(self, enabled: bool | None = None):
        """Within: each entry computed is stored by one background thread while the next chunk is computed, with
        at most WRITES_BEHIND entries waiting. On leaving, every computed entry is stored (also when the body
        raised, whose error then wins), and a failed write raises its error. enabled: default writes_behind()."""
        if not (self.writes_behind() if enabled is None else enabled) or self._writer is not None:
            yield
            return
        self._writer, self._write_failed = ThreadPoolExecutor(1, thread_name_prefix="kvf-entry-writer"), False
        try:
            yield
        except BaseException:
            self._wait_for_writes(0, raise_errors=False)
            raise
        else:
            self._wait_for_writes(0)
        finally:
            self._writer.shutdown(wait=True)
            self._writer, self._writes = None, deque()

    def _wait_for_writes(self, left: int, raise_errors: bool = True) -> None:
        """Wait until at most `left` writes are pending, oldest first; the first failed one raises (after all
        that were waited for have finished, so no write is left running unseen)."""
        error = None
        while len(self._writes) > left:
            write = self._writes.popleft()
            if write.exception() is not None and error is None:
                error = write.exception()
        if error is not None and raise_errors:
            raise error

    def prefix_kv_of(self, chunk: Chunk, by_id: Mapping[str, Chunk]) -> torch.Tensor:
        key = self.key("prefix", chunk, None)
        self._wait_for_writes(0)   # the neighbour's entry may be among the writes still pending
        if not self.store.has(key):  # another shard's chunk not built yet: build it here (idempotent)
            self.compute("prefix", chunk, None, by_id)
            self._wait_for_writes(0)
        return self.store.get(key).float()


RECHECK_EVERY = 16   # chunks a build computes on its plan before asking the store about the next ones again


def stage_kv(opts: BuildOptions, builder: EntryBuilder, chunks: ChunkTable, neighbours, console: Console,
             summary: BuildSummary, todo: dict[str, list[str]], first: bool = True) -> list[StageStat]:
    """Each variant's missing entries (`todo`: missing_entries, the plan the room check sized), in build order,
    or in reverse when another build computes KVs into this workspace now (`first` False): two builds of one
    corpus (a second terminal) then meet in the middle, each skipping what the other has stored, where in the
    same order they computed every entry twice."""
    stats = []
    for variant, missing in todo.items():
        stat = StageStat(f"kv {variant}", len(missing), chunks.tokens(missing))
        if missing:
            builder.system_kv()
            started = time.perf_counter()
            with build_progress(console) as progress, builder.writing_behind():
                task = progress.add_task(f"KV {variant}", total=len(missing), rate="")
                done_tokens = 0
                order = missing if first else missing[::-1]

                def done(chunk: Chunk) -> None:
                    nonlocal done_tokens
                    done_tokens += len(chunk.token_ids)
                    rate = done_tokens / max(1e-9, time.perf_counter() - started)
                    progress.update(task, advance=1, rate=f"{rate:,.0f} tok/s")
                for batch in chunks.batches(order):   # Chunk objects a table batch at a time
                    for start in range(0, len(batch), RECHECK_EVERY):
                        compute_unstored(builder, variant, batch[start:start + RECHECK_EVERY], neighbours, chunks, done)
            stat.seconds = time.perf_counter() - started
        stat.note = kv_stage_note(variant, opts.variants, missing)
        stats.append(stat)
    # counted by the builder: a neighbour's prefix entry another shard had not built yet counts too
    summary.entries_written, summary.bytes_written = builder.entries_written, builder.bytes_written
    summary.entries_found = builder.entries_found
    return stats


def compute_unstored(builder: EntryBuilder, variant: str, group: list[Chunk], neighbours, by_id, done) -> None:
    """The group's entries the store still lacks, computed; done(chunk) after each chunk. Another build (or
    another shard, for fusion entries' neighbours) may have stored some since the plan: asked about side by side,
    once a group, they are counted as found instead."""
    keys = [builder.key(variant, chunk, neighbours) for chunk in group]
    unserved = set(builder.unserved(keys))
    for chunk, key in zip(group, keys):
        if key in unserved:
            builder.compute(variant, chunk, neighbours, by_id)
        else:
            builder.entries_found += 1
        done(chunk)


def kv_stage_note(variant: str, variants, missing: list[str]) -> str:
    """The note of a KV stage's summary row. A fusion build plans its fusion entries' neighbours' prefix entries
    as a prefix stage even when prefix is not a variant asked for: its row says so."""
    if variant not in variants:
        return "for fusion" + ("" if missing else ", all present")   # short: the table is 80 columns wide
    return "" if missing else "all entries present"


def build_order(variants) -> list[str]:
    """prefix before fusion: fusion entries read their neighbours' prefix entries."""
    return ["prefix"] + [v for v in variants if v != "prefix"] if "fusion" in variants else list(variants)


def neighbour_chunk_ids(ids: list[str], neighbours: Mapping | None, chunks) -> list[str]:
    """The chunks whose prefix entries the fusion entries of `ids` read (what a one-process build
    computes on demand)."""
    wanted = {nid for cid in ids for nid in (neighbours or {}).get(cid, [])}
    return [nid for nid in sorted(wanted) if nid in chunks]


def missing_entries(variants, builder: EntryBuilder, chunks: ChunkTable, neighbours,
                    mine: list[str]) -> dict[str, list[str]]:
    """variant -> the ids of the chunks (`mine`: this shard's, or a run's questions') whose entries are missing, in
    build order. The fusion entries' neighbours' prefix entries count as prefix work even when prefix is not a
    variant asked for."""
    todo = {}
    for variant in build_order(variants):
        wanted = mine if variant in variants else neighbour_chunk_ids(mine, neighbours, chunks)
        todo[variant] = builder.missing_ids(variant, chunks, wanted, neighbours)
    return todo


def check_room(builder: EntryBuilder, chunks: ChunkTable, todo: dict[str, list[str]], fixes: list[str],
               what: str = "entries still to build") -> None:
    """A build its disk cannot hold stopped with "disk full" after hours of computing: the entries still to store
    (`todo`, from missing_entries: a resumed build counts only those, and a fusion build its neighbours' prefix
    entries too) are sized from the store's layout and compared with the free space first. Uncompressed sizes, so
    a compressed store needs at most this; an object store is not checked. fixes: besides freeing space and a
    larger disk, what the caller's flags can change."""
    free = builder.store.free_bytes()
    if free is None:
        return
    entries = sum(len(ids) for ids in todo.values())
    wrapper = len(builder.template.chunk_segment([]))   # the tokens an entry holds around its chunk's own
    tokens = sum(chunks.tokens(ids) for ids in todo.values()) + entries * wrapper
    needed = builder.store.kv_nbytes(tokens)
    if needed <= free:
        return
    fixes = ["free space", "pass --store on a larger disk", *fixes]
    raise KvfError(f"--store {builder.store.path}: the {entries:,} {what} need about {size_text(needed)} "
                   f"({tokens:,} tokens x {size_text(builder.store.kv_nbytes(1))}), and its disk has {size_text(free)} "
                   f"free; {', '.join(fixes[:-1])}, or {fixes[-1]}")


def build_fixes(store, variants) -> list[str]:
    """What build-cache's flags can do for a store its disk cannot hold."""
    fixes = ["store float16 (--dtype float16, half the bytes)"] if store.dtype == "float32" else []
    if len(variants) > 1:
        fixes.append(f"build one --variant ({' and '.join(variants)} each take the same bytes)")
    return fixes


# the least room a prompt needs beside S and one chunk: a short question and answer (`kvf run` checks
# every real prompt in full; this only catches a chunk that can never fit)
QUESTION_ROOM = 32


def check_chunk_fits(opts: BuildOptions, model_ref: ModelRef) -> None:
    """A chunk longer than the model's positions leave beside S, a question and an answer would be
    computed and stored (minutes, GBs) only for every prompt holding it to be refused at run time; a
    fusion entry is computed after its neighbours, so they must fit beside it too (past the model's
    positions RoPE extrapolates and the stored KV is not the model's)."""
    limit = model_ref.config.max_position_embeddings
    room = limit - len(make_template(model_ref.tokenizer).prefix_ids) - QUESTION_ROOM
    if opts.chunk_tokens > room:
        raise KvfError(f"--chunk-tokens {opts.chunk_tokens}: a chunk must fit the model's {limit:,} positions with "
                       f"the system prompt and room for a question and its answer; use at most {room:,} (256-512 is usual)")
    if "fusion" in opts.variants and (opts.n_neighbours + 1) * opts.chunk_tokens > room:
        most = room // opts.chunk_tokens - 1   # 0 when not even one neighbour fits beside a chunk this long
        fix = (f"use at most {counted(most, 'neighbour')} (or smaller --chunk-tokens)" if most >= 1 else
               f"use --chunk-tokens {room // (opts.n_neighbours + 1)} or fewer (or --variant prefix)")
        raise KvfError(f"--neighbours {opts.n_neighbours}: a fusion entry is computed after its neighbours, and "
                       f"{opts.n_neighbours + 1} chunks of up to {opts.chunk_tokens} tokens exceed the model's {limit:,} "
                       f"positions; {fix}")


def check_corpus_kind(corpus: Path) -> None:
    """CORPUS is a folder of documents: a workspace or a prepared dataset given there is said to be what it
    is (their own files would be read as documents, or none found), with what to pass instead."""
    found = instead_of_documents(corpus)
    if found is None:
        return
    kind, documents = found
    if kind == "workspace":
        raise KvfError(f"corpus {corpus} is a workspace (kvf build-cache made it); to update it pass the documents it "
                       f"was built from: kvf build-cache {documents or 'YOUR_DOCS'} -w {corpus}")
    raise KvfError(f"corpus {corpus} is a prepared dataset; `kvf run -d {corpus}` builds its workspace, or pass its "
                   f"documents: kvf build-cache {documents} -w WS")


def documents_built_from(workspace: Path) -> Path:
    """build-cache's CORPUS when it is left out: the documents the workspace was last built from, wherever the
    command runs (a grown corpus is then chunked, embedded and stored for its new documents only)."""
    ws = Workspace(workspace)
    if not ws.manifest_path.is_file():
        raise KvfError(f"CORPUS is missing: pass the documents to build from, e.g. kvf build-cache my_docs/ -w {workspace}")
    manifest = ws.manifest()
    built_from = manifest.get("corpus_absolute")
    if built_from and Path(built_from).exists():
        return Path(built_from)
    if built_from:
        raise KvfError(f"CORPUS is missing, and the documents {workspace} was built from, {built_from}, are not there "
                       f"any more; pass them: kvf build-cache DOCS -w {workspace}")
    raise KvfError(f"CORPUS is missing, and {workspace} (built by an older kvf) names its documents only as "
                   f"{manifest.get('corpus')}, from where that build ran; pass them once: kvf build-cache DOCS -w {workspace}")


def check_apart_from_corpus(opts: BuildOptions) -> None:
    """The workspace and a local store live outside the corpus folder: inside it, the next build would walk
    their files as documents (its index files, its entries), and a document added there would sit beside them."""
    corpus = Path(opts.corpus).resolve()
    if not corpus.is_dir():
        return
    for flag, place in (("--workspace", opts.workspace), ("--store", opts.store)):
        if place is None or "://" in str(place):
            continue
        resolved = Path(place).resolve()
        if resolved.is_relative_to(corpus):
            where = "is the corpus folder" if resolved == corpus else f"is inside the corpus folder {opts.corpus}"
            beside = corpus.parent / f"{corpus.name}-{'workspace' if flag == '--workspace' else 'store'}"
            raise KvfError(f"{flag} {place} {where}; pass a {flag} outside it, e.g. {flag} {os.path.relpath(beside)}")


def check_kv_flags_absent(opts: BuildOptions) -> None:
    """--indexes-only computes no KV: a flag that only shapes the KV stage would be silently ignored."""
    for flag, given, what in (("--extras-for", opts.extras_for, "is stored with each KV"),
                              ("--ray", opts.ray is not None, "spreads the KV stage over Ray workers"),
                              ("--shard", opts.shard != (0, 1), "picks the chunks whose KVs this build computes")):
        if given:
            raise KvfError(f"{flag} {what}, and --indexes-only computes none; leave one of them out")


# ---- the whole build --------------------------------------------------------------------------
def build_cache(opts: BuildOptions, console: Console) -> BuildSummary:
    # cheap checks first: bad flags, a missing corpus or a store that cannot be used fail in seconds,
    # before the workspace is touched or minutes go into indexes (a bad corpus row fails in stage 1, which
    # replaces nothing until the whole corpus is read)
    ws = Workspace(opts.workspace)
    previous = previous_manifest(ws, console)
    given_model = opts.model
    opts = replace(settle_settings(opts, previous, console), model=workspace_model(previous, opts.model, ws.root))
    for v in opts.variants:
        if v not in VARIANTS:
            both = " (for both, --variant prefix,fusion)" if v.lower() in ("both", "all") or "+" in v else ""
            raise KvfError(f"--variant {v}: unknown{both or did_you_mean(v, list(VARIANTS))}; use one of "
                           f"{', '.join(VARIANTS)} (comma-separated)")
    if opts.dtype not in STORE_DTYPES:
        raise KvfError(f"--dtype {opts.dtype}: unknown{dtype_meant(opts.dtype)}; use one of {', '.join(STORE_DTYPES)}")
    if opts.format not in (None, *FORMATS):   # here, not when the store opens: by then a new workspace's folder is made
        raise KvfError(f"--format {opts.format}: unknown{did_you_mean(opts.format, list(FORMATS))}; use one of "
                       f"{', '.join(FORMATS)}")
    if str(opts.store or "").startswith("memory://"):   # fsspec's filesystem in this process's memory (a Ray worker: its own)
        raise KvfError(f"--store {opts.store}: an in-memory store ends with this process, and a build's entries are "
                       "for the runs after it; pass a folder, or an s3:// URL")
    model_dtype = compute_dtype(opts.device, opts.compute_dtype, "--compute-dtype")
    warn_if_slow(opts.device, model_dtype, "--compute-dtype")
    validate_chunking(opts.chunk_tokens, opts.overlap)
    if opts.batch < 1 or opts.threads < 1:
        raise KvfError(f"--batch {opts.batch} / --threads {opts.threads}: both must be >= 1")
    if opts.indexes_only:
        check_kv_flags_absent(opts)
    extras_methods(opts.extras_for)   # a misspelt method: refused here, not after the indexes of a new workspace
    for stage_name in opts.rebuild:
        if stage_name not in REBUILDABLE:
            raise KvfError(f"--rebuild {stage_name}: use one of {', '.join(REBUILDABLE)} (comma-separated)")
    if opts.ray is not None:
        from kvf.pipeline.workflows.distributed import check_ray
        check_ray(opts)
    check_corpus_kind(Path(opts.corpus))
    files = list_corpus_files(Path(opts.corpus))   # its documents are read (and checked) a file at a time, in stage 1
    check_apart_from_corpus(opts)
    ws.check_own_folder("--workspace", opts.store)
    model_ref = open_model(opts.model)
    check_workspace_model(previous, ws.root, model_ref, given_model)
    check_chunk_fits(opts, model_ref)
    fresh = not ws.root.exists()
    check_writable_dir(ws.root, "--workspace")
    with removed_on_failure(ws, fresh):   # a store refused (--store a file, another format) leaves no new folder
        opts, same_store = keep_workspace_store(opts, ws, previous, console)
        check_store_dtype(opts, previous, same_store)
        store = open_workspace_store(ws, model_ref, opts.store, opts.format, opts.dtype, create=True)
    summary = BuildSummary(store=store_location(ws, opts.store, opts.format))
    waiting = notice(console)
    with ws.files_lock(waiting), _writing(ws):
        with removed_on_failure(ws, fresh):
            chunks, stat = stage_chunks(opts, ws, model_ref.tokenizer, console, files)
        summary.chunks, summary.tokens = len(chunks), stat.tokens
        summary.stages.append(stat)
        recorded = ws.index_state()   # newer than the manifest's copy when a build stopped after its indexes
        index_state = dict(previous.get("indexes", {}) if recorded is None else recorded)
        summary.stages += stage_indexes(opts, ws, chunks, index_state, console)
    if opts.indexes_only:   # the variants' KVs are not built ahead: the manifest promises only those it did before
        with ws.files_lock(waiting):
            write_workspace_manifest(ws, opts, model_ref, store, index_state,
                                     variants=sorted(previous.get("variants", []) if same_store else ()),
                                     extras_for=list(workspace_extras(previous)))
        summary.stages.append(StageStat("kv", 0, 0, 0.0, "--indexes-only"))   # kvf run computes those it needs
        return summary
    neighbours = _load_neighbours(ws) if "fusion" in opts.variants else None
    # sticky: once a workspace promises a method's extras, every later entry must carry them
    extras_for = extras_methods(tuple(opts.extras_for) + tuple(workspace_extras(previous)))
    builder = EntryBuilder(model_ref, store, opts.device, extras_for, dtype=model_dtype)
    mine = shard_ids(chunks, opts.shard)
    todo = missing_entries(opts.variants, builder, chunks, neighbours, mine)
    summary.entries_skipped += sum(len(mine) - len(todo[variant]) for variant in opts.variants)   # on either path
    check_room(builder, chunks, todo, build_fixes(store, opts.variants))
    with store.shared_lock():  # gc refuses while a build writes
        with ws.kv_stage_turn() as first:
            if opts.ray is not None:
                from kvf.pipeline.workflows.distributed import build_kv_with_ray
                summary.stages += build_kv_with_ray(opts, builder, chunks, neighbours, console, summary, todo, first)
            else:
                summary.stages += stage_kv(opts, builder, chunks, neighbours, console, summary, todo, first)
    with ws.files_lock(waiting):
        ws.check_chunks_are(chunks.ids)
        write_workspace_manifest(ws, opts, model_ref, store, index_state,
                                 variants=sorted(set(opts.variants) | set(previous.get("variants", []) if same_store else ())),
                                 extras_for=extras_for)
    return summary


def write_workspace_manifest(ws: Workspace, opts: BuildOptions, model_ref: ModelRef, store, index_state: dict,
                             variants: list[str], extras_for: list[str]) -> None:
    """The one writer of manifest.json: build-cache, and `kvf run` on a dataset that has no workspace yet.
    variants lists the offline variants whose KVs were built ahead (a run builds them as questions need them)."""
    location = store_location(ws, opts.store, store.format)
    with _writing(ws):
        ws.write_manifest({"model": model_ref.name, "model_fingerprint": model_ref.fingerprint,
                           "tokenizer_fingerprint": tokenizer_fingerprint(model_ref.tokenizer),
                           "chunk_tokens": opts.chunk_tokens, "overlap": opts.overlap,
                           "store": ws.relative_store(location), "format": store.format,
                           "s3_endpoint": os.environ.get("AWS_ENDPOINT_URL") if location.startswith("s3://") else None,
                           "model_arg": recorded_model(opts.model),
                           "dtype": opts.dtype, "corpus": str(opts.corpus), "variants": variants,
                           "corpus_absolute": str(Path(opts.corpus).resolve()),
                           "compute_dtype": dtype_name(compute_dtype(opts.device, opts.compute_dtype)),
                           "n_neighbours": opts.n_neighbours, "neighbour_probes": opts.neighbour_probes,
                           "exact_neighbours_up_to": opts.exact_neighbours_up_to,
                           "embedder": opts.embedder, "indexes": index_state,
                           "bm25": opts.bm25, "dense": opts.dense,
                           "extras_for": list(extras_for)})


@contextmanager
def removed_on_failure(ws: Workspace, fresh: bool):
    """A workspace folder this build created goes again if the build fails before its chunks are written (a
    store that cannot be opened, an unreadable corpus): nothing there is worth resuming, and the folder would pass for a workspace. Not on
    Ctrl-C: that stops one shard of a build (--shard I/N) while another may be working in the folder."""
    try:
        yield
    except Exception:
        if fresh:
            shutil.rmtree(ws.root, ignore_errors=True)
        raise


@contextmanager
def _writing(ws: Workspace):
    """Workspace files (chunks table, indexes, manifest): an OSError becomes a one-line KvfError."""
    try:
        yield
    except OSError as e:
        problem = "disk full" if disk_full(e) else (e.strerror or str(e))
        raise KvfError(f"--workspace {ws.root}: cannot write {e.filename or 'its files'} ({problem}); "
                       "free space or fix permissions and re-run (stored KV entries are intact)") from None


def previous_manifest(ws: Workspace, console: Console) -> dict:
    """The workspace's manifest, or {} when there is none; a damaged one is rebuilt (said on stderr)."""
    if not ws.manifest_path.is_file():
        return {}
    try:
        return ws.manifest()
    except KvfError:
        console.print(f"warning: {ws.manifest_path} is damaged; rebuilding every stage of the workspace", style="yellow",
                      markup=False, highlight=False, soft_wrap=True)  # one line, whatever the path's length
        return {}


def extras_methods(names) -> list[str]:
    """The methods named (comma lists allowed; "all" = every method with a build-time hook), checked."""
    with_hook = methods_with_extras()
    out = []
    for name in (n.strip() for item in names for n in str(item).split(",")):
        if not name:
            continue
        picked = with_hook if name == "all" else [name]
        for n in picked:
            if n not in METHODS:
                raise KvfError(f"--extras-for {n}: unknown method{did_you_mean(n, list(METHODS))}; methods with build-time "
                               f"extras: {', '.join(with_hook) or 'none'}")
            if METHODS[n].extras_hook is None:
                raise KvfError(f"--extras-for {n}: {n} stores nothing at build time; methods that do: {', '.join(with_hook)}")
            if n not in out:
                out.append(n)
    return sorted(out)


def workspace_extras(manifest: dict) -> list[str]:
    """The methods whose extras a workspace's entries carry (older manifests said cachecraft_meta)."""
    return list(manifest.get("extras_for") or (["cachecraft"] if manifest.get("cachecraft_meta") else []))


def _load_neighbours(ws: Workspace) -> Mapping[str, list[str]]:
    from kvf.pipeline.retrieval.neighbours import load_neighbours
    return load_neighbours(ws.neighbours_file)


def summary_table(summary: BuildSummary) -> Table:
    table = Table(title=Text(f"build-cache: {counted(summary.chunks, 'chunk')}, {summary.tokens:,} tokens; store {summary.store}"))
    for col in ("stage", "items", "tokens", "seconds", "items/s", "tokens/s", "note"):
        table.add_column(col, justify="right" if col not in ("stage", "note") else "left")
    for s in summary.stages:
        rate = lambda x: f"{x / s.seconds:,.1f}" if s.seconds > 0 and x else "-"  # noqa: E731
        table.add_row(s.name, f"{s.items:,}", f"{s.tokens:,}", f"{s.seconds:.2f}", rate(s.items), rate(s.tokens), s.note)
    table.caption = (f"entries written {summary.entries_written:,} ({summary.bytes_written / 2**20:,.1f} MiB), "
                     f"already present {summary.entries_skipped:,}"
                     + (f", stored meanwhile by another writer {summary.entries_found:,}" if summary.entries_found else ""))
    return table
