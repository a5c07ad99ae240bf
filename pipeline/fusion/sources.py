"""LayerKVSources: chunk KVs already in memory, or read from a KV store one layer at a time.

With pipelining on (CacheBlend §5, Cache-Craft Algorithm 2), a background thread reads the next
layers while the engine recomputes the current one, so loading is hidden whenever a layer's read
is shorter than its recompute. File reads and crc32 release the GIL, so threads are enough.

On a GPU the read is the whole trip to the device: each chunk's layer is read (by `readers` threads
side by side) into pinned host memory and copied on a side CUDA stream, so the engine receives
device tensors and neither the read nor the copy runs on the compute stream. On an H100 (Llama-3-8B
shape, 16K tokens, 2.1 GB of KV; results/gpu.md) one reader and a pageable copy on the compute
stream made reuse 2.8x slower than full prefill; this path makes it 0.9x. On the CPU nothing
changes: one reader, tensors handed over as read. On an object store (S3) every read is a request that
mostly waits on the network, so REMOTE_READERS threads ask side by side (results/s3.md).

`load_seconds` is the time the engine actually waited for data (exposed load); `read_seconds` is
the total time spent reading. hidden fraction = 1 - load_seconds / read_seconds.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

PREFETCH_LAYERS = 2  # how many layers ahead the reader may run (L_p)
GPU_READERS = 2      # chunk reads side by side on a GPU: more contend with the engine's thread for the GIL
REMOTE_READERS = 8   # on an object store each read is a network round trip: threads mostly wait, so ask side by side


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

    read_again = layer


class StoreKVSource:
    """The store is duck-typed (get_layer, header, headers): this module never imports kvf.cachestore."""

    def __init__(self, store, keys: list[str], n_layers: int, pipeline: bool = True,
                 chunk_extras: list[dict] | None = None, readers: int | None = None):
        self.store = store
        self.keys = keys                      # store key of each chunk, in prompt order
        headers = store.headers(keys)          # one round of requests on an object store, not one per chunk
        # checked against the chunks; header() of an absent key raises the store's one-line MissingEntry
        self.token_counts = [(headers[key] if key in headers else store.header(key)).tokens for key in keys]
        self.n_layers = n_layers
        self.pipeline = pipeline
        self.chunk_extras = chunk_extras
        self.readers = readers                # None: 1 on the CPU, GPU_READERS on a GPU (set in start)
        self.device: torch.device | None = None  # the engine's, from start()
        self.load_seconds = 0.0
        self.read_seconds = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-reader") if pipeline else None
        self._chunk_pool: ThreadPoolExecutor | None = None
        self._again_pool: ThreadPoolExecutor | None = None   # read_again's threads, on an object store
        self._copy_stream = None              # on a GPU: host -> device copies run here
        self._compute_stream = None
        self._pending: dict[int, Future] = {}
        self._chunks: list[int] | None = None

    def _read_chunk(self, layer: int, i: int) -> torch.Tensor:
        """Chunk i's [2, KV, t, d] at this layer, in the store dtype, on self.device."""
        if self._copy_stream is None:
            return self.store.get_layer(self.keys[i], layer)
        header = self.store.header(self.keys[i])
        # store dtype names are torch's (float16, bfloat16, float32); torch caches pinned blocks for reuse
        pinned = torch.empty(header.layer_shape, dtype=getattr(torch, header.dtype), pin_memory=True)
        self.store.get_layer(self.keys[i], layer, out=pinned)
        with torch.cuda.stream(self._copy_stream):
            on_device = pinned.to(self.device, non_blocking=True)
        self._copy_stream.synchronize()                                # copied before the engine sees it
        on_device.record_stream(self._compute_stream)                 # freed only after compute used it
        return on_device

    def _read_layer(self, layer: int, chunks: list[int]) -> list[torch.Tensor]:
        """-> per chunk [2, KV, t, d] in the store dtype (the engine converts to its dtype)."""
        started = time.perf_counter()
        if self._chunk_pool is None:
            out = [self._read_chunk(layer, i) for i in chunks]
        else:
            out = list(self._chunk_pool.map(lambda i: self._read_chunk(layer, i), chunks))
        self.read_seconds += time.perf_counter() - started
        return out

    def _prefetch(self, first_layer: int) -> None:
        for layer in range(first_layer, min(self.n_layers, first_layer + PREFETCH_LAYERS)):
            if layer not in self._pending:
                self._pending[layer] = self._pool.submit(self._read_layer, layer, self._chunks)

    def start(self, chunks: list[int], device: torch.device | str = "cpu") -> None:
        """Begin reading layer 0.. of these chunks for an engine on `device` (call before recomputation starts)."""
        self._use_device(torch.device(device))
        if self.pipeline:
            self._chunks = list(chunks)
            self._prefetch(0)

    def _use_device(self, device: torch.device) -> None:
        """Reader threads, and on a GPU a copy stream, for an engine on `device` (set up once)."""
        if self.device == device:
            return
        self.device = device
        on_gpu = device.type == "cuda"
        if on_gpu:
            self._copy_stream = torch.cuda.Stream(device)
            self._compute_stream = torch.cuda.current_stream(device)  # the engine's (this is its thread)
        readers = self.readers or (REMOTE_READERS if getattr(self.store, "remote", False) else
                                   GPU_READERS if on_gpu else 1)
        if readers > 1 and self._chunk_pool is None:
            self._chunk_pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="kv-chunk-reader")

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

    def read_again(self, layer: int, chunks: list[int]) -> list[torch.Tensor]:
        """The chunks' [2, KV, t, d] at this layer once more, after the prefill, outside load_seconds and
        read_seconds. Locally in this thread; on an object store side by side, in threads of its own (the
        reader threads may be shut down by now): one request after another, kvfuse's re-read of 29 layers of 20
        chunks was 580 round trips before its second token."""
        if not getattr(self.store, "remote", False) or len(chunks) < 2:
            return [self._read_chunk(layer, i) for i in chunks]
        if self._again_pool is None:
            self._again_pool = ThreadPoolExecutor(max_workers=REMOTE_READERS, thread_name_prefix="kv-again-reader")
            weakref.finalize(self, self._again_pool.shutdown, wait=False)   # it outlives close(): ends with the source
        return list(self._again_pool.map(lambda i: self._read_chunk(layer, i), chunks))

    def close(self) -> None:
        for pool in (self._pool, self._chunk_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
