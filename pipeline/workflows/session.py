"""A session: one loaded model over one workspace and its KV store. Chunks in, fused answers out.

`kvf run` answers a dataset through one; the Python API (`kvf.open_workspace`) is one. Missing
store entries are computed on demand (offline work, untimed), with the build-time extras of the
methods that need them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kvf.errors import KvfError, warn
from kvf.pipeline.fusion.answer import Answer, Answerer
from kvf.pipeline.fusion.methods import FusionMethod
from kvf.pipeline.fusion.sources import StoreKVSource
from kvf.pipeline.model.prompt import FusedPrompt
from kvf.pipeline.retrieval.chunking import Chunk, ChunkTable
from kvf.pipeline.workflows.build import EntryBuilder, open_workspace_store, workspace_extras
from kvf.pipeline.workflows.devices import check_device, compute_dtype
from kvf.pipeline.workflows.weights import check_workspace_model, open_model, workspace_model
from kvf.pipeline.workflows.workspace import Workspace


@dataclass
class Fused:
    """One timed answer, and what it read from the store."""
    answer: Answer
    read_seconds: float | None     # total store read time (None: the method read nothing)


def open_run_store(ws: Workspace, manifest: dict, model_ref, store: str | None):
    """The store a run reads (--store, else the workspace's), created when missing. A store this process cannot
    write (a shared read-only copy) is read: only a missing entry needs writing."""
    opened = open_workspace_store(ws, model_ref, store or ws.reach_store(), None, manifest.get("dtype", "float16"),
                                  create=True, readonly=None)
    if opened.created:   # a mistyped --store, or a deleted kv.zarr: everything is recomputed, untimed
        warn(f"no store at {opened.path} yet: created it; every KV this run needs is computed into it "
             "first (untimed), check --store if you meant an existing one")
    return opened


def run_extras(manifest: dict, extras_for) -> tuple[str, ...]:
    """The methods whose build-time extras a run's new entries carry: its own, and the workspace's promise."""
    return tuple(sorted(set(extras_for) | set(workspace_extras(manifest))))


class Session:
    def __init__(self, ws: Workspace, model: str | None = None, device: str = "cpu", dtype: str | None = None,
                 store: str | None = None, extras_for: tuple[str, ...] = ()):
        check_device(device)
        self.ws, self.manifest = ws, ws.manifest()
        self.model_ref = open_model(workspace_model(self.manifest, model, ws.root))
        check_workspace_model(self.manifest, ws.root, self.model_ref, model)
        self.dtype = compute_dtype(device, dtype)
        self.device = device
        self.answerer = Answerer(self.model_ref.load(device, self.dtype).model, self.model_ref.tokenizer)
        self.store = open_run_store(ws, self.manifest, self.model_ref, store)
        self._store_lock = self.store.shared_lock()  # gc refuses while this session may read the store
        self._store_lock.__enter__()
        try:
            self.extras_for = run_extras(self.manifest, extras_for)
            self.builder = EntryBuilder(self.model_ref, self.store, device, self.extras_for, engine=self.answerer.engine)
            self.answerer.engine.remember_prefix_kv(self.builder.template.prefix_ids, self.builder.system_kv())
            self.chunks_by_id = ChunkTable(ws.chunks_path)   # Chunk objects only for the chunks asked for
        except BaseException:   # the store is let go now: a notebook's last traceback holds this half-made object
            self.close()
            raise
        self._neighbours = None

    def close(self) -> None:
        """Let the store go: kvf store gc refuses while any session holds it, and a notebook's session is held
        until the notebook ends unless closed."""
        if self._store_lock is not None:
            self._store_lock.__exit__(None, None, None)   # closes the lock file, which releases the lock
            self._store_lock = None
        self.store.close()

    @property
    def n_layers(self) -> int:
        return self.answerer.transformer.n_layers

    def neighbours(self) -> Mapping[str, list[str]]:
        """The fusion variant's neighbours, checked against this workspace's chunks (loaded once)."""
        if self._neighbours is None:
            from kvf.pipeline.retrieval.neighbours import load_neighbours
            self._neighbours = load_neighbours(self.ws.neighbours_file, self.chunks_by_id)
        return self._neighbours

    def chunks(self, chunk_ids: list[str], index: str = "retrieval") -> list[Chunk]:
        return self.ws.indexed_chunks(self.chunks_by_id, chunk_ids, index)

    def prompt(self, chunks: list[Chunk], question: str) -> FusedPrompt:
        return self.answerer.prompt([c.token_ids for c in chunks], question)

    def serve_extras(self, method: FusionMethod) -> None:
        """Entries computed from now on carry `method`'s build-time extras too, as a run's do for its methods (a
        notebook's first cachecraft answer, in a session opened before it was asked for)."""
        if method.extras_hook is not None and method.name not in self.extras_for:
            self.extras_for = tuple(sorted({*self.extras_for, method.name}))
            self.builder.use_extras(self.extras_for)

    def entries(self, variant: str, chunks: list[Chunk], on_missing=None, on_done=None) -> list[str]:
        """Store keys of these chunks' `variant` KVs, computing missing entries now (offline work, untimed).
        on_missing(n) is told how many will be computed, on_done() after each one."""
        neighbours = self.neighbours() if variant == "fusion" else None
        missing = self.builder.missing(variant, chunks, neighbours)
        if missing and on_missing is not None:
            on_missing(len(missing))
        with self.builder.writing_behind():
            for chunk in missing:
                self.builder.compute(variant, chunk, neighbours, self.chunks_by_id)
                if on_done is not None:
                    on_done()
        return [self.builder.key(variant, c, neighbours) for c in chunks]

    def source(self, method: FusionMethod, keys: list[str] | None, pipeline: bool = True) -> StoreKVSource | None:
        if not method.uses_store:
            return None
        extras = self.store.get_extras_many(keys) if method.extras_names else None
        return StoreKVSource(self.store, keys, self.n_layers, pipeline, extras)

    @torch.inference_mode()
    def answer(self, prompt: FusedPrompt, method: FusionMethod, keys: list[str] | None, max_new_tokens: int,
               pipeline: bool = True) -> Fused:
        """One timed request: load + fuse + first token, then decode."""
        source = self.source(method, keys, pipeline)
        try:
            answer = self.answerer.answer(prompt, method, source, max_new_tokens)
        finally:
            if source is not None:
                source.close()
        return Fused(answer, source.read_seconds if source is not None else None)

    @torch.inference_mode()
    def prefill(self, prompt: FusedPrompt, method: FusionMethod, keys: list[str] | None, max_new_tokens: int,
                pipeline: bool = True, shared: dict | None = None) -> tuple:
        """The timed part of one request -> (FusionResult, timings with first_token and read).
        shared: work shared with other requests on this prompt and variant (FusionEngine.fuse)."""
        source = self.source(method, keys, pipeline)
        try:
            fused, timings = self.answerer.prefill(prompt, method, source, max_new_tokens, shared)
        finally:
            if source is not None:
                source.close()
        if source is not None and not fused.info.get("charged_seconds"):  # (a shared pass read for it elsewhere)
            timings["read"] = source.read_seconds
        return fused, timings

    def warm_up(self, prompt: FusedPrompt, method: FusionMethod, keys: list[str] | None) -> None:
        """One untimed call: one-time kernel set-up stays out of the timed requests."""
        source = self.source(method, keys)
        try:
            method.prefill(self.answerer.engine, prompt, source)
        finally:
            if source is not None:
                source.close()


def check_entries_dtype(ws: Workspace, dtype: str, fix: str = "pass --dtype {built}") -> None:
    """Entries are keyed by the dtype they were computed in: a run in another dtype than the build's
    reads none of the built ones. Say so before it computes them all again. fix: how the caller picks
    the build's dtype ({built} is filled in)."""
    manifest = ws.manifest()
    built = manifest.get("compute_dtype", "float32") if manifest.get("model_fingerprint") else dtype
    if built != dtype:
        warn(f"--workspace {ws.root}'s KVs were built in {built}; this run computes in {dtype}, so it computes its "
             f"own {dtype} entries into the store first (untimed); {fix.format(built=built)} to use the built ones")


def workspace_path(path: str | Path) -> Workspace:
    ws = Workspace(Path(path))
    if ws.root.exists() and not ws.root.is_dir():
        raise KvfError(f"--workspace {ws.root} is a file; pass a directory (build one with `kvf build-cache CORPUS -w DIR`)")
    return ws
