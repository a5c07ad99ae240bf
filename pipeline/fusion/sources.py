"""LayerKVSources: chunk KVs already in memory, or read from a KV store one layer at a time.

With pipelining on (CacheBlend §5, Cache-Craft Algorithm 2), a background thread reads the next
layers while the engine recomputes the current one, so loading is hidden whenever a layer's read
is shorter than its recompute. File reads and crc32 release the GIL, so a thread is enough.

`load_seconds` is the time the engine actually waited for data (exposed load); `read_seconds` is
the total time spent reading. hidden fraction = 1 - load_seconds / read_seconds.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

PREFETCH_LAYERS = 2  # how many layers ahead the reader may run (L_p)


class InMemoryKV:
    """A LayerKVSource over tensors already in memory: chunk_kvs[i] is [L, 2, KV, t_i, d];
    chunk_extras[i] (optional) is chunk i's dict of named arrays."""

    def __init__(self, chunk_kvs: list[torch.Tensor], chunk_extras: list[dict] | None = None):
        self.chunk_kvs = chunk_kvs
        self.chunk_extras = chunk_extras
        self.token_counts = [kv.shape[3] for kv in chunk_kvs]
        self.load_seconds = 0.0

    def layer(self, layer: int, chunks: list[int]) -> list[torch.Tensor]:
        return [self.chunk_kvs[i][layer] for i in chunks]


class StoreKVSource:
    """The store is duck-typed (get_layer, header): this module never imports kvf.cachestore."""

    def __init__(self, store, keys: list[str], n_layers: int, pipeline: bool = True,
                 chunk_extras: list[dict] | None = None):
        self.store = store
        self.keys = keys                      # store key of each chunk, in prompt order
        self.token_counts = [store.header(key).tokens for key in keys]  # checked against the chunks
        self.n_layers = n_layers
        self.pipeline = pipeline
        self.chunk_extras = chunk_extras
        self.load_seconds = 0.0
        self.read_seconds = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-reader") if pipeline else None
        self._pending: dict[int, Future] = {}
        self._chunks: list[int] | None = None

    def _read_layer(self, layer: int, chunks: list[int]) -> list[torch.Tensor]:
        """-> per chunk [2, KV, t, d] in the store dtype (the engine converts to float32)."""
        started = time.perf_counter()
        out = [self.store.get_layer(self.keys[i], layer) for i in chunks]
        self.read_seconds += time.perf_counter() - started
        return out

    def _prefetch(self, first_layer: int) -> None:
        for layer in range(first_layer, min(self.n_layers, first_layer + PREFETCH_LAYERS)):
            if layer not in self._pending:
                self._pending[layer] = self._pool.submit(self._read_layer, layer, self._chunks)

    def start(self, chunks: list[int]) -> None:
        """Begin reading layer 0.. of these chunks now (call before recomputation starts)."""
        if self.pipeline:
            self._chunks = list(chunks)
            self._prefetch(0)

    def layer(self, layer: int, chunks: list[int]) -> list[torch.Tensor]:
        started = time.perf_counter()
        if not self.pipeline:
            result = self._read_layer(layer, chunks)
        else:
            if self._chunks != list(chunks):  # a new chunk set: drop what was read ahead for the old one
                self._pending.clear()
                self._chunks = list(chunks)
            self._prefetch(layer)
            result = self._pending.pop(layer).result()
            self._prefetch(layer + 1)
        self.load_seconds += time.perf_counter() - started
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
