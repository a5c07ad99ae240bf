"""Content-addressed on-disk store of per-chunk KV caches. Knows bytes, hashes and layouts, never models.

    store = open_store("kv.zarr", meta={"model": fp, "dtype": "float16", "layers": 30, ...}, create=True)
    key = entry_key(model_fp, "prefix", context_key, token_ids)
    store.put(key, kv)                  # kv: [layers, 2, kv_heads, tokens, head_dim]
    store.get_layer(key, 3)             # [2, kv_heads, tokens, head_dim], one contiguous read
"""
from kvf.cachestore.base import EntryHeader, KVStore
from kvf.cachestore.errors import BadShape, CorruptEntry, MissingEntry, NotAStore, StoreMismatch
from kvf.cachestore.keys import entry_key
from kvf.cachestore.open import FORMATS, check_url, is_endpoint_url, open_store, remote_failure

__all__ = ["open_store", "check_url", "is_endpoint_url", "remote_failure", "entry_key", "KVStore", "EntryHeader",
           "StoreMismatch", "CorruptEntry", "MissingEntry", "NotAStore", "BadShape", "FORMATS"]
