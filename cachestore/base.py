"""KVStore: the format-independent half of a chunk KV store.

Validation, casting, checksums, the per-key header cache, and the user-facing errors live here; the
zarr and hdf5 subclasses only move bytes (see the "format hooks" at the bottom of KVStore).

An entry is one chunk's KV, [layers, 2, kv_heads, tokens, head_dim], plus small named extras and a JSON
header (shape, dtype, per-layer crc32, user attrs). Entries are immutable once committed.
"""
import dataclasses
import errno
import fcntl
import itertools
import json
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
# zlib-ng's crc32 is zlib's CRC-32, bit for bit (stores written before still verify), with SIMD:
# ~60 GB/s where a plain zlib build gives 2-7, which made the checksum the slowest step of a GPU read.
from zlib_ng.zlib_ng import crc32

from kvf.errors import KvfError, disk_full
from kvf.cachestore.dtypes import byte_view, check_dtype, empty_tensor, extra_to_numpy, itemsize, to_stored, STORE_DTYPES
from kvf.cachestore.errors import BadShape, CorruptEntry, MissingEntry
from kvf.cachestore.keys import check_key

FORMAT_VERSION = 1
STAGING = ".kvf-tmp"
LOCK_FILE = ".kvf-lock"  # readers hold it shared, gc exclusively (local stores)  # temp area inside the store root: same filesystem, so the commit rename is atomic
GRACE_S = 3600.0  # gc leaves younger garbage alone when it cannot tell whether its writer is alive
HEADER_CACHE = 4096  # headers kept in memory; entries are immutable, so caching them is safe
INFO_BATCH = 256     # entries info() asks about at once
VERIFY_BATCH = 64    # entries verify() reads at once
DELETE_BATCH = 256   # entries gc() removes at once
_HOST = socket.gethostname().replace("~", "-").replace("/", "-")


def batched(items: Iterable, n: int) -> Iterator[list]:
    """Lists of n items (the last one shorter), taken lazily, as itertools.batched does from Python 3.12."""
    items = iter(items)
    while batch := list(itertools.islice(items, n)):
        yield batch


class Unreadable(Exception):
    """Internal: a layer's bytes are missing or short. Turned into CorruptEntry with the key and store."""


@dataclass(frozen=True)
class EntryHeader:
    key: str
    shape: tuple  # [layers, 2, kv_heads, tokens, head_dim]
    dtype: str  # store dtype name
    layer_crc32: tuple  # (layers,) crc32 of each layer's stored, uncompressed bytes
    codec: str | None = None  # None: raw bytes on disk; else the compressor name
    data_offset: int | None = None  # hdf5 raw layout: file offset of layer 0 (layers follow back to back)
    data_dir: str | None = None  # zarr on an object store: the entry's folder holding its data (None: the entry's own)
    extras: dict = field(default_factory=dict)  # name -> {"dtype": "<f4", "shape": [...], "crc32": int}
    attrs: dict = field(default_factory=dict)  # caller's JSON attrs (e.g. {"variant": "prefix"})

    @property
    def layers(self) -> int:
        return self.shape[0]

    @property
    def tokens(self) -> int:
        return self.shape[3]

    @property
    def layer_shape(self) -> tuple:  # [2, kv_heads, tokens, head_dim]
        return tuple(self.shape[1:])

    @property
    def layer_nbytes(self) -> int:
        return int(np.prod(self.layer_shape)) * itemsize(self.dtype)

    def to_dict(self) -> dict:
        """The header as stored, with a crc32 of everything else in it (key and shape included), so a
        hand-edited or damaged header is caught before it is trusted."""
        d = dataclasses.asdict(self)
        d["shape"], d["layer_crc32"] = list(self.shape), list(self.layer_crc32)
        if d["data_dir"] is None:   # the header a local entry has always had
            del d["data_dir"]
        d = {"version": FORMAT_VERSION, **d}
        return {**d, "header_crc32": _header_crc(d)}

    @classmethod
    def from_dict(cls, d: dict) -> "EntryHeader":
        """Raises ValueError when the header's own checksum does not match (headers written before
        checksums existed have none and are read as they are)."""
        if "header_crc32" in d and _header_crc({k: v for k, v in d.items() if k != "header_crc32"}) != d["header_crc32"]:
            raise ValueError("header checksum mismatch")
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        d["shape"], d["layer_crc32"] = tuple(d["shape"]), tuple(d["layer_crc32"])
        return cls(**d)


class KVStore:
    """A directory (or bucket prefix) of content-addressed chunk KV entries. Use `open_store` to get one."""

    format = ""

    def __init__(self, fs, root: str, path: str, identity: dict, readonly: bool, compressor: str | None):
        self.fs = fs  # LocalFS or FsspecFS
        self.root = root  # filesystem path of the store root
        self.path = path  # what the user passed, for messages
        self.meta = identity["meta"]  # the store's identity: model, tokenizer, dtype, layers, ...
        self.dtype = check_dtype(self.meta.get("dtype", "float16"))
        self.readonly = readonly
        self.created = False   # open_store sets it when it made the store just now
        self.compressor = self.check_compressor(compressor if compressor is not None else identity.get("compressor"))
        self._headers: OrderedDict[str, EntryHeader] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self):
        return f"<{type(self).__name__} {self.path} dtype={self.dtype}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._headers.clear()

    def __contains__(self, key: str) -> bool:
        return self.has(key)

    # ------------------------------------------------------------------ writing

    def has(self, key: str) -> bool:
        """True only for committed entries; half-written or crashed writes never count."""
        return self._is_committed(check_key(key))

    def put(self, key: str, kv, attrs: dict | None = None, extras: dict | None = None) -> bool:
        """Store kv [layers, 2, kv_heads, tokens, head_dim] under key, cast to the store dtype.

        Atomic: readers see the whole entry or nothing. Returns False (and writes nothing) when the key is
        already committed, so re-running a build is cheap.
        """
        self._check_writable()
        check_key(key)
        if self._is_committed(key):
            return False
        stored = to_stored(kv, self.dtype)  # [layers, 2, kv_heads, tokens, head_dim], on-disk bits
        self._check_shape(stored.shape)
        extras_np = {self._check_extra_name(name): extra_to_numpy(x) for name, x in (extras or {}).items()}
        header = EntryHeader(
            key=key, shape=tuple(stored.shape), dtype=self.dtype,
            layer_crc32=tuple(crc32(stored[layer]) for layer in range(stored.shape[0])),
            codec=self.compressor,
            extras={name: {"dtype": a.dtype.str, "shape": list(a.shape), "crc32": crc32(a.tobytes())}
                    for name, a in extras_np.items()},
            attrs=_json_clean(attrs or {}, "attrs"),
        )
        try:
            return self._write_entry(header, stored, extras_np)
        except OSError as e:
            raise self._write_error(key, e) from e

    def delete(self, key: str) -> bool:
        """Remove a committed entry. Returns False if there was none."""
        self._check_writable()
        self._forget(check_key(key))
        return self._delete_entry(key)

    # ------------------------------------------------------------------ reading

    def get(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """[layers, 2, kv_heads, tokens, head_dim] in the store dtype, checksums verified."""
        header = self._header(key)
        out = self._out_tensor(out, header.shape, header.dtype)
        self._read_verified(key, list(range(header.layers)), out)
        return out

    def get_layer(self, key: str, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """[2, kv_heads, tokens, head_dim] of one layer: one contiguous read plus a crc32.

        out: optional preallocated tensor (e.g. pinned memory) to read into.
        """
        header = self._header(key)
        if not 0 <= layer < header.layers:
            raise IndexError(f"layer {layer} out of range: entry {key} has {header.layers} layers")
        out = self._out_tensor(out, header.layer_shape, header.dtype)
        self._read_verified(key, [layer], out)
        return out

    def get_extras(self, key: str) -> dict[str, np.ndarray]:
        header = self._header(key)
        if not header.extras:
            return {}
        try:
            arrays = self._read_extras(header)
        except (Unreadable, OSError, KeyError, ValueError) as e:
            raise self._corrupt(key, f"extras unreadable ({e})") from e
        for name, info in header.extras.items():
            if name not in arrays or crc32(arrays[name].tobytes()) != info["crc32"]:
                raise self._corrupt(key, f"extra {name!r} checksum mismatch")
        return arrays

    def get_extras_many(self, keys: list[str]) -> list[dict[str, np.ndarray]]:
        """get_extras of each key, in order: side by side on an object store (a prompt's chunks at once)."""
        return self.fs.each(self.get_extras, list(keys))

    def attrs(self, key: str) -> dict:
        return json.loads(json.dumps(self._header(key).attrs))  # a copy: cached headers stay untouched

    def header(self, key: str) -> EntryHeader:
        """Shape, dtype, checksums and attrs of an entry, without reading its data."""
        return self._header(key)

    def headers(self, keys: Iterable[str], unreadable: list[str] | None = None, cache: bool = True) -> dict[str, EntryHeader]:
        """key -> header of those of `keys` that are committed (the others are left out), each checked as
        header() checks it. On an object store the requests go out side by side: planning a build asks
        about every chunk's entry, and asked one after another each costs a network round trip.
        unreadable: where given, the keys of damaged headers are added to it instead of raising CorruptEntry."""
        keys = [check_key(key) for key in keys]
        with self._lock:
            found = {key: self._headers[key] for key in keys if key in self._headers}
        unknown = [key for key in keys if key not in found]
        for key, header in zip(unknown, self._read_headers(unknown)):
            if header is None:
                continue
            try:
                if isinstance(header, CorruptEntry):
                    raise header
                self._check_header(key, header)
            except CorruptEntry:
                if unreadable is None:
                    raise
                unreadable.append(key)
                continue
            found[key] = header
            if cache:
                self._remember(key, header)
        return found

    @property
    def remote(self) -> bool:
        """Whether every read is a network request (an object store): readers then ask side by side."""
        return not self.fs.local

    def free_bytes(self) -> int | None:
        """Bytes free on the disk that holds a local store (to the user, not to root's reserve); None on an
        object store, which does not fill up."""
        if not self.fs.local:
            return None
        disk = os.statvfs(self.root if os.path.isdir(self.root) else os.path.dirname(self.root))
        return disk.f_bavail * disk.f_frsize

    def kv_nbytes(self, tokens: int) -> int:
        """Bytes the KV of `tokens` tokens takes in this store's layout, uncompressed (a compressed store takes
        at most this): layers x [2, kv_heads, tokens, head_dim] x the store dtype's size."""
        meta = self.meta
        return meta["layers"] * 2 * meta["kv_heads"] * tokens * meta["head_dim"] * itemsize(self.dtype)

    def keys(self) -> list[str]:
        """Committed keys, sorted."""
        return sorted(self._committed_keys())

    def __len__(self) -> int:
        return len(self.keys())

    # ------------------------------------------------------------------ maintenance

    def info(self, track=lambda keys: keys) -> dict:
        """Entries, tokens, bytes on disk (apparent file sizes), bytes per token and its overhead, variants.
        track: wraps the list of keys, as a progress bar does (each entry's header is one read, on S3 a request)."""
        entries = tokens = disk = payload = 0
        variants: dict[str, int] = {}
        unreadable: list[str] = []
        with self._walked_once():
            committed = sorted(self._committed_keys())
            temp = self._garbage(grace_s=0.0, include_live=True)  # in-progress writes and crash leftovers
        for batch in batched(track(committed), INFO_BATCH):   # asked side by side on an object store
            found = self.headers(batch, unreadable=unreadable, cache=False)
            disk += sum(self._entries_bytes(list(found)))
            for h in found.values():
                entries += 1
                tokens += h.tokens
                payload += h.layers * h.layer_nbytes
                variant = h.attrs.get("variant")
                if variant is not None:
                    variants[str(variant)] = variants.get(str(variant), 0) + 1
        return {
            "path": self.path, "format": self.format, "dtype": self.dtype, "compressor": self.compressor,
            "meta": dict(self.meta), "entries": entries, "unreadable_entries": len(unreadable), "tokens": tokens,
            "bytes": disk, "payload_bytes": payload,
            "bytes_per_token": disk / tokens if tokens else None,
            "payload_bytes_per_token": payload / tokens if tokens else None,
            "overhead": disk / payload - 1.0 if payload else None,
            "variants": variants,
            "temp_items": len(temp), "temp_bytes": sum(self.fs.size(p) for p in temp),
            "free_bytes": self.free_bytes(),
        }

    def bytes_per_token(self) -> float | None:
        """Bytes on disk per stored token (data plus all metadata)."""
        return self.info()["bytes_per_token"]

    def verify(self, track=lambda keys: keys) -> list[tuple[str, str]]:
        """Re-read every entry and check every checksum and its identity (the key and shape its header
        names). Returns [(key, problem)] for the bad ones, entry directories without metadata included.
        track: wraps the list of keys, as a progress bar does (a large store takes minutes to re-read)."""
        with self._walked_once():
            unfinished, committed = self._unfinished_entries(), self.keys()
        problems = [(name, "entry directory without its metadata (an interrupted copy or write): "
                           "`kvf build-cache` rebuilds the entry, `kvf store gc --yes` removes it")
                    for name in unfinished]
        for batch in batched(track(committed), VERIFY_BATCH):   # entries side by side on an object store
            problems += [(key, problem) for key, problem in zip(batch, self.fs.each(self._verify_entry, batch)) if problem]
        return problems

    def _verify_entry(self, key: str) -> str | None:
        """What is wrong with this entry as stored now, or None."""
        self._forget(key)  # verify what is on disk now, not a cached header
        try:
            header = self._header(key)  # cached: each get_layer below reads it again otherwise (a request on S3)
            for layer in range(header.layers):  # one layer buffer, not the whole entry
                self.get_layer(key, layer)
            self.get_extras(key)
        except MissingEntry:
            return None  # deleted while we were verifying: nothing wrong with it
        except CorruptEntry as e:
            return e.problem
        return None

    def gc(self, keep: set[str] | None = None, grace_s: float = GRACE_S) -> dict:
        """Remove crashed/abandoned writes, and when keep is given, every committed entry not in keep.

        Temp data of a writer that is still running on this host is left alone; temp data from another
        host is removed only once it is older than grace_s.
        """
        self._check_writable()
        freed = {"garbage_removed": 0, "entries_removed": 0, "bytes_freed": 0}
        garbage, entries = self.gc_plan(keep, grace_s)
        for path in garbage:
            freed["bytes_freed"] += self.fs.size(path)
            self.fs.remove(path)
            freed["garbage_removed"] += 1
        for batch in batched(entries, DELETE_BATCH):   # removed side by side on an object store
            for nbytes in self.fs.each(self._delete_sized, batch):
                if nbytes is not None:
                    freed["entries_removed"] += 1
                    freed["bytes_freed"] += nbytes
        return freed

    def _delete_sized(self, key: str) -> int | None:
        """Remove a committed entry: its bytes on disk, or None when there was none (another gc was first)."""
        nbytes = self._entry_bytes(key)
        return nbytes if self.delete(key) else None

    def gc_plan(self, keep: set[str] | None = None, grace_s: float = GRACE_S) -> tuple[list[str], list[str]]:
        """What gc would remove: (temp/garbage paths, committed keys not in keep; none when keep is None)."""
        with self._walked_once():
            garbage = self._garbage(grace_s=grace_s)
            entries = [] if keep is None else sorted(k for k in self._committed_keys() if k not in set(keep))
        return garbage, entries

    # ------------------------------------------------------------------ shared helpers

    def _header(self, key: str, cache: bool = True) -> EntryHeader:
        check_key(key)
        with self._lock:
            header = self._headers.get(key)
            if header is not None:
                self._headers.move_to_end(key)
                return header
        header = self._read_header(key)  # MissingEntry / CorruptEntry
        self._check_header(key, header)  # before anything is allocated or read from it
        if cache:
            self._remember(key, header)
        return header

    def _remember(self, key: str, header: EntryHeader) -> None:
        with self._lock:
            self._headers[key] = header
            while len(self._headers) > HEADER_CACHE:
                self._headers.popitem(last=False)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._headers.pop(key, None)

    def _read_verified(self, key: str, layers: list[int], out: torch.Tensor) -> None:
        """Read layers into out and check their crc32. A cached header may be stale if the entry was deleted
        and rebuilt by another process: on failure, re-read the header once before calling it corrupt."""
        for attempt in range(2):
            header = self._header(key)
            problem = self._read_and_check(header, layers, out)
            if problem is None:
                return
            self._forget(key)
            if not self._is_committed(key):
                raise MissingEntry(f"entry {key} was deleted from store {self.path} while being read")
            if attempt == 0:
                fresh = self._header(key)
                if fresh != header and fresh.shape == header.shape:
                    continue  # the entry was replaced under us: read the new one
            raise self._corrupt(key, problem)

    def _read_and_check(self, header: EntryHeader, layers: list[int], out: torch.Tensor) -> str | None:
        """None if all good, else what is wrong."""
        rows = byte_view(out).reshape(len(layers), header.layer_nbytes)  # (n_layers, layer_nbytes) uint8
        try:
            self._read_layers_into(header, layers, rows)
        except Unreadable as e:
            return str(e)
        except FileNotFoundError:
            return "data file missing"
        except OSError as e:
            return f"read failed ({e})"
        for row, layer in zip(rows, layers):
            if crc32(row) != header.layer_crc32[layer]:
                return f"layer {layer} checksum mismatch"
        return None

    def _out_tensor(self, out, shape: tuple, dtype: str) -> torch.Tensor:
        if out is None:
            return empty_tensor(shape, dtype)
        if tuple(out.shape) != tuple(shape) or out.dtype != STORE_DTYPES[dtype][0]:
            raise ValueError(f"out= must be {STORE_DTYPES[dtype][0]} {list(shape)}, got {out.dtype} {list(out.shape)}")
        return out

    def _corrupt(self, key: str, problem: str) -> CorruptEntry:
        error = CorruptEntry(f"entry {key} in store {self.path} is corrupt: {problem}; "
                             f"run `kvf store verify --store {self.path} --delete-bad` and rebuild the missing entries")
        error.problem = problem  # the short form, for verify's report
        return error

    def _write_error(self, key: str, e: OSError) -> KvfError:
        if disk_full(e):
            return KvfError(f"disk full while writing entry {key} in store {self.path}; "
                            f"free space and re-run (committed entries are intact)")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return KvfError(f"store {self.path} is not writable ({e.strerror}); fix its permissions or use another --store path")
        return KvfError(f"could not write entry {key} in store {self.path}: {e}; committed entries are intact")

    def _check_header(self, key: str, header: EntryHeader) -> None:
        """An entry's header must name this key and a shape and dtype this store can hold."""
        if header.key != key:
            raise self._corrupt(key, f"it holds the entry of key {header.key[:16]}... (a misplaced copy)")
        shape = header.shape
        if len(shape) != 5 or shape[1] != 2 or min(shape) < 1 or len(header.layer_crc32) != shape[0]:
            raise self._corrupt(key, f"damaged header (shape {list(shape)})")
        for dim, name in ((0, "layers"), (2, "kv_heads"), (4, "head_dim")):
            want = self.meta.get(name)
            if want is not None and shape[dim] != want:
                raise self._corrupt(key, f"damaged header: {name}={shape[dim]} but the store holds {name}={want}")
        if header.dtype != self.dtype:
            raise self._corrupt(key, f"damaged header: dtype {header.dtype} but the store holds {self.dtype}")

    def _check_writable(self) -> None:
        if self.readonly:
            raise KvfError(f"store {self.path} is read-only here (opened for reading, or not writable by this "
                           "process) and cannot take new entries; build them where it is writable (kvf build-cache), "
                           "or pass a writable --store")

    def _check_shape(self, shape: tuple) -> None:
        if len(shape) != 5 or shape[1] != 2 or min(shape) < 1:
            raise BadShape(f"KV must be [layers, 2, kv_heads, tokens, head_dim] with tokens >= 1, got {list(shape)}")
        for dim, name in ((0, "layers"), (2, "kv_heads"), (4, "head_dim")):
            want = self.meta.get(name)
            if want is not None and shape[dim] != want:
                raise BadShape(f"KV has {name}={shape[dim]} (shape {list(shape)}) but store {self.path} holds {name}={want}")

    @staticmethod
    def _check_extra_name(name: str) -> str:
        if not isinstance(name, str) or not name[:1].isalnum() or not all(c.isalnum() or c in "_-" for c in name):
            raise ValueError(f"invalid extras name {name!r}: use letters, digits, _ and -")
        return name

    # staging: local writes go to <root>/.kvf-tmp/<key>~<host>~<pid>~<rand>, then are renamed into place

    def _staging_path(self, key: str, suffix: str = "") -> str:
        return self.fs.join(self.root, STAGING, f"{key}~{_HOST}~{os.getpid()}~{uuid.uuid4().hex[:8]}{suffix}")

    @contextmanager
    def _staged(self, path: str):
        """Remove the temp data if anything goes wrong (ENOSPC, Ctrl-C, ...) before it is committed."""
        try:
            yield path
        except BaseException:
            self.fs.remove(path)
            raise

    def _garbage(self, grace_s: float, include_live: bool = False) -> list[str]:
        """Temp data of dead or stale writers, plus the format's own uncommitted leftovers."""
        staging = self.fs.join(self.root, STAGING)
        found = []
        for name in self.fs.listdir(staging):
            if name == "zarr.json":  # makes the staging dir a valid (empty) zarr group
                continue
            path = self.fs.join(staging, name)
            if include_live or not self._writer_alive(name, path, grace_s):
                found.append(path)
        return found + self._uncommitted(grace_s)

    def _writer_alive(self, name: str, path: str, grace_s: float) -> bool:
        parts = name.split("~")
        if len(parts) == 4 and parts[1] == _HOST and parts[2].isdigit():
            pid = int(parts[2])
            try:
                os.kill(pid, 0)
                return True
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
        return _younger_than(self.fs, path, grace_s)  # another host (or unknown): judge by age

    # ------------------------------------------------------------------ format hooks

    @staticmethod
    def check_compressor(compressor: str | None) -> str | None:
        raise NotImplementedError

    def _is_committed(self, key: str) -> bool:
        raise NotImplementedError

    def _write_entry(self, header: EntryHeader, stored: np.ndarray, extras: dict[str, np.ndarray]) -> bool:
        raise NotImplementedError

    def _read_header(self, key: str) -> EntryHeader:
        raise NotImplementedError

    def _read_headers(self, keys: list[str]) -> list[EntryHeader | CorruptEntry | None]:
        """Each key's header as stored: None where no entry is committed, the CorruptEntry where it cannot be
        parsed. Formats on object stores ask side by side."""
        headers = []
        for key in keys:
            try:
                headers.append(self._read_header(key))
            except MissingEntry:
                headers.append(None)
            except CorruptEntry as e:
                headers.append(e)
        return headers

    def _entries_bytes(self, keys: list[str]) -> list[int]:
        """Bytes of each entry (asked side by side on an object store)."""
        return [self._entry_bytes(key) for key in keys]

    def _read_layers_into(self, header: EntryHeader, layers: list[int], rows: np.ndarray) -> None:
        """Fill rows[i] (uint8, layer_nbytes) with layer layers[i]'s raw stored bytes; raise Unreadable."""
        raise NotImplementedError

    def _read_extras(self, header: EntryHeader) -> dict[str, np.ndarray]:
        raise NotImplementedError

    @contextmanager
    def _walked_once(self):
        """Within: one walk of the entries answers every question about them. info, gc and verify each ask for the
        committed entries and the uncommitted ones; on an object store a walk is a listing per fan-out directory
        and a request per commit marker. A format whose walk is one file read needs nothing here."""
        yield

    def _committed_keys(self):
        raise NotImplementedError

    def _entry_bytes(self, key: str) -> int:
        raise NotImplementedError

    def _delete_entry(self, key: str) -> bool:
        raise NotImplementedError

    def _uncommitted(self, grace_s: float) -> list[str]:
        return []

    def _unfinished_entries(self) -> list[str]:
        """Names of entry directories in place but without metadata (reported by verify)."""
        return []

    # ------------------------------------------------------------------ locking (local stores)

    @contextmanager
    def shared_lock(self):
        """Held by every process that reads or writes entries; gc waits for none of them: it refuses."""
        with self._flock(fcntl.LOCK_SH):
            yield self

    @contextmanager
    def exclusive_lock(self):
        """gc's: refused with a one-line error while another kvf process holds the store."""
        try:
            with self._flock(fcntl.LOCK_EX | fcntl.LOCK_NB):
                yield self
        except BlockingIOError:
            raise KvfError(f"store {self.path} is in use by another kvf process (a run, a build, or a notebook's "
                           "kvf.open_workspace: ws.close() lets it go); run gc when it has finished") from None

    @contextmanager
    def _flock(self, mode: int):
        if not self.fs.local:  # object stores have no locks: gc there must not overlap readers
            yield
            return
        try:
            fd = os.open(os.path.join(self.root, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            # a read-only copy (a read-only mount, another user's store): nobody can gc it from here,
            # so a reader needs no lock; flock also works on a descriptor opened for reading
            if not (self.readonly and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)):
                raise
            try:
                fd = os.open(os.path.join(self.root, LOCK_FILE), os.O_RDONLY)
            except OSError:
                yield
                return
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # releases the lock


def _header_crc(d: dict) -> int:
    return crc32(json.dumps(d, sort_keys=True, separators=(",", ":")).encode())


def _json_clean(obj: dict, what: str) -> dict:
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serialisable: {e}") from e


def _younger_than(fs, path: str, seconds: float) -> bool:
    mtime = fs.mtime(path)
    return mtime is not None and time.time() - mtime < seconds


def write_once(fs, root: str, path: str, data: bytes) -> bool:
    """Create a small file (store marker, group metadata) atomically; never replace an existing one.

    Local: written under <root>/.kvf-tmp then linked into place, so two processes creating the same
    store race safely (the loser reads the winner's file). Object stores: check, then write.
    """
    if fs.exists(path):
        return False
    if not fs.local:
        fs.write_file(path, data)
        return True
    staging = fs.join(root, STAGING)
    fs.makedirs(staging)
    tmp = fs.join(staging, f"meta~{_HOST}~{os.getpid()}~{uuid.uuid4().hex[:8]}")
    try:
        fs.write_file(tmp, data)
        return fs.publish(tmp, path)
    except BaseException:
        fs.remove(tmp)
        raise


def group_json(attributes: dict) -> bytes:
    """zarr v3 group metadata (zarr.json of a group)."""
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes}, indent=1).encode()
