"""kvf.cachestore: round trips, on-disk validity, atomic commits, integrity, concurrency, CLI."""
import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import h5py
import numpy as np
import pytest
import torch
import zarr
from typer.testing import CliRunner

from kvf.errors import KvfError
from kvf.cachestore import BadShape, CorruptEntry, MissingEntry, StoreMismatch, entry_key, open_store
from kvf.cachestore.base import _HOST, STAGING
from kvf.cachestore.fs import FsspecFS, LocalFS
from kvf.cli.store_cmd import store_app

FORMATS = ["zarr", "hdf5"]
META = {"model": "model-fp", "tokenizer": "tok-fp", "layers": 4, "kv_heads": 2, "head_dim": 8}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def new_store(tmp_path, fmt, dtype="float16", name="store", **kw):
    return open_store(str(tmp_path / name), fmt, meta={**META, "dtype": dtype}, create=True, **kw)


def rand_kv(tokens=5, seed=0, layers=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, 2, tokens, 8, generator=g)  # [layers, 2, kv_heads, tokens, head_dim]


def key_of(i) -> str:
    return entry_key("model-fp", "prefix", "ctx", [i, i + 1, i + 2])


def entry_files(store, key):
    """Paths of an entry on disk: (entry dir or file, data file of layer 2)."""
    if store.format == "zarr":
        entry = os.path.join(store.root, key[:2], key)
        return entry, os.path.join(entry, "kv", "c.2.0.0.0.0")
    return os.path.join(store.root, key[:2], key + ".h5"), os.path.join(store.root, key[:2], key + ".h5")


def layer_offset(store, key, layer):
    """Byte offset of a layer inside its data file (0 for zarr's one-file-per-layer)."""
    h = store.header(key)
    return 0 if store.format == "zarr" else h.data_offset + layer * h.layer_nbytes


def staging_leftovers(store):
    return [n for n in os.listdir(os.path.join(store.root, STAGING)) if n != "zarr.json"]


def run_script(tmp_path, source, *args, **popen_kw):
    script = tmp_path / f"script_{uuid.uuid4().hex[:6]}.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], **popen_kw)


# ----------------------------------------------------------------------------- keys


def test_entry_key_is_deterministic_and_covers_every_field():
    base = entry_key("m", "prefix", "ctx", [1, 2, 3])
    assert len(base) == 64 and int(base, 16) >= 0
    assert entry_key("m", "prefix", "ctx", np.array([1, 2, 3])) == base
    assert entry_key("m", "prefix", "ctx", (1, 2, 3)) == base
    others = {entry_key("m2", "prefix", "ctx", [1, 2, 3]), entry_key("m", "fusion", "ctx", [1, 2, 3]),
              entry_key("m", "prefix", "ctx2", [1, 2, 3]), entry_key("m", "prefix", "ctx", [1, 2, 4]),
              entry_key("m", "prefix", "ctx", [1, 2])}
    assert base not in others and len(others) == 5
    assert entry_key("ab", "c", "", []) != entry_key("a", "bc", "", [])  # fields are length-prefixed
    with pytest.raises(TypeError):
        entry_key("m", "prefix", "ctx", [1.5])


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip(tmp_path, fmt, dtype):
    store = new_store(tmp_path, fmt, dtype)
    kv = rand_kv(tokens=7)
    assert store.put(key_of(0), kv, attrs={"variant": "prefix"}) is True
    got = store.get(key_of(0))
    assert got.dtype == TORCH_DTYPES[dtype] and got.shape == (4, 2, 2, 7, 8)
    assert torch.equal(got, kv.to(TORCH_DTYPES[dtype]))
    for layer in range(4):
        assert torch.equal(store.get_layer(key_of(0), layer), got[layer])
    # numpy input, and a fresh store object (no cached header)
    x = np.random.default_rng(1).standard_normal((4, 2, 2, 3, 8)).astype(np.float32)
    store.put(key_of(1), x)
    again = open_store(str(tmp_path / "store"), readonly=True)
    assert torch.equal(again.get(key_of(1)), torch.from_numpy(x).to(TORCH_DTYPES[dtype]))
    assert torch.equal(again.get(key_of(0)), got)
    assert again.keys() == sorted([key_of(0), key_of(1)])
    assert again.has(key_of(0)) and not again.has(key_of(2))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_zarr_on_disk_is_a_valid_zarr_v3_hierarchy(tmp_path, dtype):
    store = new_store(tmp_path, "zarr", dtype)
    kv = rand_kv(tokens=6)
    key = key_of(0)
    store.put(key, kv, extras={"scores": torch.arange(6.0)})
    root = zarr.open_group(store.root, mode="r")
    assert root.attrs["kvf_store"]["meta"]["model"] == "model-fp"
    arr = root[f"{key[:2]}/{key}/kv"]
    assert arr.shape == (4, 2, 2, 6, 8) and arr.chunks == (1, 2, 2, 6, 8)  # one chunk per layer
    data = torch.from_numpy(np.ascontiguousarray(arr[:]))
    if dtype == "bfloat16":  # stored as the raw bf16 bits
        data = data.view(torch.int16).view(torch.bfloat16)
    assert torch.equal(data, store.get(key))
    np.testing.assert_array_equal(root[f"{key[:2]}/{key}/extras/scores"][:], np.arange(6.0, dtype=np.float32))
    assert root[f"{key[:2]}/{key}"].attrs["kvf_entry"]["shape"] == [4, 2, 2, 6, 8]


def test_entries_of_one_shape_have_zarr_make_their_array_metadata_once(tmp_path, monkeypatch):
    """An array's zarr.json comes from zarr itself, which costs 0.2-0.5 ms a call: entries of one shape (most of a
    store's) reuse the first one's. A decorator once slid onto the wrong function, so every entry asked zarr again."""
    from kvf.cachestore import zarr_store
    zarr_store.array_json.cache_clear()
    made = []
    real = zarr.create_array
    monkeypatch.setattr(zarr, "create_array", lambda *a, **kw: made.append(kw["shape"]) or real(*a, **kw))
    store = new_store(tmp_path, "zarr", "float16")
    for i in range(3):
        store.put(key_of(i), rand_kv(tokens=6, seed=i))
    assert made == [(4, 2, 2, 6, 8)], made
    assert all(torch.equal(store.get(key_of(i)), rand_kv(tokens=6, seed=i).half()) for i in range(3))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hdf5_on_disk_is_valid_hdf5_with_contiguous_layers(tmp_path, dtype):
    store = new_store(tmp_path, "hdf5", dtype)
    key = key_of(0)
    store.put(key, rand_kv())
    path, _ = entry_files(store, key)
    with h5py.File(path, "r") as f:
        ds = f["kv"]
        assert ds.chunks is None and ds.compression is None  # contiguous: a layer is one slab
        assert ds.id.get_offset() == store.header(key).data_offset
        data = torch.from_numpy(ds[:])
    if dtype == "bfloat16":
        data = data.view(torch.int16).view(torch.bfloat16)
    assert torch.equal(data, store.get(key))


@pytest.mark.parametrize("fmt,compressor", [("zarr", "zstd"), ("zarr", "gzip"), ("hdf5", "gzip")])
def test_compressed_round_trip_and_corruption(tmp_path, fmt, compressor):
    store = new_store(tmp_path, fmt, compressor=compressor)
    kv = torch.zeros(4, 2, 2, 64, 8)
    kv[:, :, :, :5] = rand_kv()  # compressible
    key = key_of(0)
    store.put(key, kv)
    assert torch.equal(store.get(key), kv.half())
    assert torch.equal(store.get_layer(key, 3), kv[3].half())
    assert store.header(key).codec == compressor
    if fmt == "zarr":  # zarr itself decodes our chunks
        arr = zarr.open_array(os.path.join(store.root, key[:2], key, "kv"), mode="r")
        np.testing.assert_array_equal(arr[:], kv.half().numpy())
        with open(os.path.join(store.root, key[:2], key, "kv", "c.1.0.0.0.0"), "r+b") as f:
            f.seek(12)
            f.write(b"\xff\xff\xff\xff")
        with pytest.raises(CorruptEntry):
            store.get_layer(key, 1)
        assert [k for k, _ in store.verify()] == [key]


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_and_info_report_every_entry_they_read_to_their_progress(tmp_path, fmt):
    """`kvf store verify` and `info` draw their progress bars from `track`: it sees every committed key, once."""
    store = new_store(tmp_path, fmt)
    for i in range(3):
        store.put(key_of(i), rand_kv(seed=i))
    seen = []

    def track(keys):
        for key in keys:
            seen.append(key)
            yield key

    assert store.verify(track=track) == [] and seen == store.keys() and len(seen) == 3
    seen.clear()
    assert store.info(track=track)["entries"] == 3 and seen == store.keys()


@pytest.mark.parametrize("fmt", FORMATS)
def test_extras_attrs_and_info(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    extras = {"inter_attn": torch.rand(5, dtype=torch.bfloat16), "count": np.int64(7),
              "ids": np.arange(5, dtype=np.int32), "empty": np.zeros((0, 3), np.float32)}
    store.put(key_of(0), rand_kv(), attrs={"variant": "prefix", "doc": "d1", "n": [1, 2]}, extras=extras)
    store.put(key_of(1), rand_kv(tokens=3), attrs={"variant": "fusion"})
    store.put(key_of(2), rand_kv(tokens=2), attrs={"variant": "fusion"})
    got = store.get_extras(key_of(0))
    assert set(got) == set(extras)
    np.testing.assert_array_equal(got["inter_attn"], extras["inter_attn"].float().numpy())
    assert got["inter_attn"].dtype == np.float32
    assert got["count"].shape == () and got["count"] == 7
    np.testing.assert_array_equal(got["ids"], np.arange(5, dtype=np.int32))
    assert got["empty"].shape == (0, 3)
    assert store.get_extras(key_of(1)) == {}
    assert store.attrs(key_of(0)) == {"variant": "prefix", "doc": "d1", "n": [1, 2]}
    info = store.info()
    assert info["entries"] == 3 and info["tokens"] == 5 + 3 + 2
    assert info["variants"] == {"prefix": 1, "fusion": 2}
    assert info["meta"]["model"] == "model-fp" and info["meta"]["dtype"] == "float16"
    assert info["payload_bytes"] == 4 * 2 * 2 * 8 * 2 * (5 + 3 + 2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_put_validates_shape(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    with pytest.raises(BadShape, match="kv_heads=3"):
        store.put(key_of(0), torch.zeros(4, 2, 3, 5, 8))
    with pytest.raises(ValueError, match="layers=5"):  # BadShape is also a ValueError
        store.put(key_of(0), torch.zeros(5, 2, 2, 5, 8))
    with pytest.raises(KvfError, match=r"\[layers, 2, kv_heads, tokens, head_dim\]"):
        store.put(key_of(0), torch.zeros(4, 2, 5, 8))
    with pytest.raises(ValueError, match="invalid store key"):
        store.put("../evil", rand_kv())
    assert store.keys() == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_put_twice_is_a_noop(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    first = rand_kv(seed=1)
    assert store.put(key_of(0), first) is True
    path, _ = entry_files(store, key_of(0))
    before = os.stat(path).st_mtime_ns
    assert store.put(key_of(0), rand_kv(seed=2)) is False
    assert os.stat(path).st_mtime_ns == before
    assert torch.equal(store.get(key_of(0)), first.half())


@pytest.mark.parametrize("fmt", FORMATS)
def test_delete_and_missing(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    store.put(key_of(0), rand_kv())
    store.get_layer(key_of(0), 0)  # cache its header
    assert store.delete(key_of(0)) is True
    assert store.delete(key_of(0)) is False
    assert not store.has(key_of(0)) and store.keys() == []
    with pytest.raises(MissingEntry, match="no entry") as e:
        store.get_layer(key_of(0), 0)
    assert isinstance(e.value, KeyError) and isinstance(e.value, KvfError)
    assert staging_leftovers(store) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_buffer(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    kv = rand_kv()
    store.put(key_of(0), kv)
    out = torch.empty(2, 2, 5, 8, dtype=torch.float16)
    assert store.get_layer(key_of(0), 1, out=out) is out
    assert torch.equal(out, kv[1].half())
    with pytest.raises(ValueError, match="out="):
        store.get_layer(key_of(0), 1, out=torch.empty(2, 2, 5, 8))
    with pytest.raises(IndexError):
        store.get_layer(key_of(0), 4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_checksums_are_zlibs_crc32_so_stores_written_before_still_verify(tmp_path, fmt):
    """The store's crc32 comes from zlib-ng (SIMD) since stores were first written with zlib's."""
    import zlib
    store = new_store(tmp_path, fmt, dtype="bfloat16")
    store.put(key_of(0), rand_kv(tokens=700), extras={"summary": np.arange(12, dtype=np.float32)})
    header = store.header(key_of(0))
    for layer in range(4):
        stored = store.get_layer(key_of(0), layer).view(torch.uint16).numpy()   # the bytes on disk
        assert header.layer_crc32[layer] == zlib.crc32(stored.tobytes())
    assert header.extras["summary"]["crc32"] == zlib.crc32(np.arange(12, dtype=np.float32).tobytes())


@pytest.mark.parametrize("fmt", FORMATS)
def test_reader_cache_survives_delete_and_rebuild(tmp_path, fmt):
    reader = new_store(tmp_path, fmt)
    writer = open_store(str(tmp_path / "store"))
    writer.put(key_of(0), rand_kv(seed=1))
    assert torch.equal(reader.get_layer(key_of(0), 0), rand_kv(seed=1)[0].half())  # header now cached
    writer.delete(key_of(0))
    writer.put(key_of(0), rand_kv(seed=2))  # rebuilt with other bits: the cached checksums are stale
    assert torch.equal(reader.get_layer(key_of(0), 0), rand_kv(seed=2)[0].half())


# ----------------------------------------------------------------------------- atomicity


WRITER_KILLED_MID_WRITE = """
import sys, time, torch
from kvf.cachestore import open_store
from kvf.cachestore.fs import LocalFS
path, ready, key = sys.argv[1:4]
real_write, calls = LocalFS.write_file, [0]
def write_then_hang(self, p, data):
    calls[0] += 1
    if calls[0] == 3:  # zarr: mid-layers; hdf5: the one file write
        mv = memoryview(data).cast("B")
        real_write(self, p, mv[: len(mv) // 2])  # half the bytes are on disk
        open(ready, "w").close()
        time.sleep(600)
    real_write(self, p, data)
LocalFS.write_file = write_then_hang
store = open_store(path)
calls[0] = 2 if store.format == "hdf5" else 0
store.put(key, torch.ones(4, 2, 2, 5, 8))
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_writer_killed_mid_write_leaves_only_garbage(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    store.put(key_of(0), rand_kv())
    ready = tmp_path / "ready"
    proc = run_script(tmp_path, WRITER_KILLED_MID_WRITE, store.root, ready, key_of(1))
    deadline = time.time() + 120
    while not ready.exists():
        assert proc.poll() is None, "writer exited before reaching the write"
        assert time.time() < deadline, "writer never reached the write"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not store.has(key_of(1))
    assert store.keys() == [key_of(0)]
    with pytest.raises(MissingEntry):
        store.get(key_of(1))
    assert len(staging_leftovers(store)) == 1  # the dead writer's temp data
    assert store.info()["temp_items"] == 1 and store.info()["entries"] == 1
    # a write in progress in a live process (ours) must survive gc
    live = os.path.join(store.root, STAGING, f"{key_of(2)}~{_HOST}~{os.getpid()}~abcd1234")
    os.makedirs(live)
    freed = store.gc()
    assert freed["garbage_removed"] == 1 and freed["bytes_freed"] > 0 and freed["entries_removed"] == 0
    assert staging_leftovers(store) == [os.path.basename(live)]
    os.rmdir(live)
    assert store.verify() == []
    assert store.put(key_of(1), rand_kv(seed=3)) is True  # the key is writable again
    assert torch.equal(store.get(key_of(1)), rand_kv(seed=3).half())


@pytest.mark.parametrize("fmt", FORMATS)
def test_disk_full_cleans_up_and_keeps_committed_entries(tmp_path, fmt, monkeypatch):
    store = new_store(tmp_path, fmt)
    store.put(key_of(0), rand_kv(seed=0))
    real_write, calls = LocalFS.write_file, [0]

    def write_until_full(self, path, data):
        calls[0] += 1
        if calls[0] == 3 or fmt == "hdf5":
            mv = memoryview(data).cast("B")
            real_write(self, path, mv[: len(mv) // 3])  # a partial file, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, path, data)

    monkeypatch.setattr(LocalFS, "write_file", write_until_full)
    with pytest.raises(KvfError, match="disk full") as e:
        store.put(key_of(1), rand_kv(seed=1))
    msg = str(e.value)
    assert key_of(1) in msg and store.path in msg and "committed entries are intact" in msg and "\n" not in msg
    monkeypatch.setattr(LocalFS, "write_file", real_write)
    assert not store.has(key_of(1)) and store.keys() == [key_of(0)]
    assert staging_leftovers(store) == []
    assert store.verify() == []
    assert torch.equal(store.get(key_of(0)), rand_kv(seed=0).half())
    assert store.put(key_of(1), rand_kv(seed=1)) is True


# ----------------------------------------------------------------------------- integrity


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_bytes_are_detected(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    store.put(key_of(0), rand_kv(seed=0))
    store.put(key_of(1), rand_kv(seed=1))
    store.get_layer(key_of(0), 2)  # a cached header must not hide the damage
    _, data_file = entry_files(store, key_of(0))
    with open(data_file, "r+b") as f:
        f.seek(layer_offset(store, key_of(0), 2) + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))
    for s in (store, open_store(str(tmp_path / "store"), readonly=True)):
        with pytest.raises(CorruptEntry) as e:
            s.get_layer(key_of(0), 2)
        msg = str(e.value)
        assert key_of(0) in msg and s.path in msg and "layer 2" in msg and "kvf store verify" in msg
        with pytest.raises(CorruptEntry):
            s.get(key_of(0))
        assert torch.equal(s.get_layer(key_of(0), 1), rand_kv(seed=0)[1].half())  # other layers fine
        assert torch.equal(s.get(key_of(1)), rand_kv(seed=1).half())
        bad = s.verify()
        assert [k for k, _ in bad] == [key_of(0)] and "layer 2" in bad[0][1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncation_is_detected(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    store.put(key_of(0), rand_kv(seed=0))
    _, data_file = entry_files(store, key_of(0))
    nbytes = store.header(key_of(0)).layer_nbytes
    os.truncate(data_file, layer_offset(store, key_of(0), 2) + nbytes // 2)  # cut inside layer 2
    with pytest.raises(CorruptEntry, match="truncated"):
        store.get_layer(key_of(0), 2)
    with pytest.raises(CorruptEntry):
        store.get(key_of(0))
    assert torch.equal(store.get_layer(key_of(0), 1), rand_kv(seed=0)[1].half())
    assert [k for k, _ in store.verify()] == [key_of(0)]


def test_missing_layer_file_is_detected(tmp_path):
    store = new_store(tmp_path, "zarr")
    store.put(key_of(0), rand_kv())
    _, data_file = entry_files(store, key_of(0))
    os.unlink(data_file)
    with pytest.raises(CorruptEntry, match="missing"):
        store.get_layer(key_of(0), 2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_extras_are_detected(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    store.put(key_of(0), rand_kv(), extras={"s": np.arange(100, dtype=np.float64)})
    if fmt == "zarr":
        path = os.path.join(store.root, key_of(0)[:2], key_of(0), "extras", "s", "c.0")
        with open(path, "r+b") as f:
            f.seek(40)
            f.write(b"\x01")
    else:
        path, _ = entry_files(store, key_of(0))
        with h5py.File(path, "r+") as f:
            f["extras"]["s"][3] = 99.0
    with pytest.raises(CorruptEntry, match="extra 's'"):
        store.get_extras(key_of(0))
    assert [k for k, _ in store.verify()] == [key_of(0)]


# ----------------------------------------------------------------------------- opening


@pytest.mark.parametrize("fmt", FORMATS)
def test_meta_mismatch_is_refused(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    path = str(tmp_path / "store")
    with pytest.raises(StoreMismatch) as e:
        open_store(path, meta={**META, "model": "other-fp"})
    msg = str(e.value)
    assert isinstance(e.value, KvfError) and "\n" not in msg
    assert path in msg and "model" in msg and "model-fp" in msg and "other-fp" in msg and "--store" in msg
    with pytest.raises(StoreMismatch, match="dtype"):
        open_store(path, meta={"dtype": "bfloat16"})
    with pytest.raises(StoreMismatch, match="rope_theta"):  # a field the store never recorded
        open_store(path, meta={"rope_theta": 10000})
    assert open_store(path, meta={"model": "model-fp", "layers": 4}).format == fmt  # a matching subset is fine
    assert open_store(path, create=True, meta={**META}).keys() == store.keys()  # create=True reopens


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_store_with_no_entry_says_deleting_it_loses_nothing(tmp_path, fmt):
    """A first build whose model did not load left a store named after it, and the fixed model was refused by it."""
    store, path = new_store(tmp_path, fmt), str(tmp_path / "store")
    with pytest.raises(StoreMismatch, match="it holds no entry yet .*: delete it and re-run"):
        open_store(path, meta={**META, "model": "other-fp"})
    store.put(key_of(0), rand_kv())
    with pytest.raises(StoreMismatch, match="use another --store path or rebuild the store$"):
        open_store(path, meta={**META, "model": "other-fp"})
    other = "hdf5" if fmt == "zarr" else "zarr"
    with pytest.raises(KvfError, match=f"is a {fmt} store"):
        open_store(path, other)


def test_open_errors(tmp_path):
    with pytest.raises(KvfError, match="no kvf store at"):
        open_store(str(tmp_path / "missing"))
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "file.txt").write_text("x")
    with pytest.raises(KvfError, match="not a kvf store"):
        open_store(str(tmp_path / "notastore"), create=True)
    (tmp_path / "plainfile").write_text("x")
    with pytest.raises(KvfError, match="plainfile"):
        open_store(str(tmp_path / "plainfile" / "store"), create=True)
    with pytest.raises(KvfError, match="unknown store format"):
        open_store(str(tmp_path / "x"), "parquet", create=True)
    with pytest.raises(KvfError, match="dtype"):
        open_store(str(tmp_path / "y"), meta={"dtype": "int8"}, create=True)
    new_store(tmp_path, "zarr")
    ro = open_store(str(tmp_path / "store"), readonly=True)
    with pytest.raises(KvfError, match="read-only"):
        ro.put(key_of(0), rand_kv())
    with pytest.raises(KvfError, match="read-only"):
        ro.gc()
    (tmp_path / "empty").mkdir()  # an empty directory becomes a store
    assert open_store(str(tmp_path / "empty"), create=True).keys() == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_store_this_process_cannot_write_is_read(tmp_path, fmt, monkeypatch):
    """A shared copy on a read-only mount: `kvf run` reads it (readonly=None) instead of refusing it,
    without the lock file it cannot create; only a missing entry is an error, naming the fix."""
    import kvf.cachestore.base as base
    import kvf.cachestore.open as opener
    store = new_store(tmp_path, fmt)
    store.put(key_of(0), rand_kv())
    assert not open_store(store.path, readonly=None).readonly             # writable here: writable
    real_access, real_open = os.access, os.open
    monkeypatch.setattr(opener.os, "access", lambda p, mode: mode != os.W_OK and real_access(p, mode))
    def read_only_mount(path, flags, *mode):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *mode)
    monkeypatch.setattr(base.os, "open", read_only_mount)
    with pytest.raises(KvfError, match="not writable"):                  # asked for writes: refused, as before
        open_store(store.path)
    shared = open_store(store.path, meta={**META, "dtype": "float16"}, create=True, readonly=None)
    assert shared.readonly
    with shared.shared_lock():                                            # what a run session holds
        assert torch.equal(shared.get(key_of(0)), store.get(key_of(0)))
    with pytest.raises(KvfError, match="read-only here.*kvf build-cache.*writable --store"):
        shared.put(key_of(1), rand_kv())


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_url(tmp_path, fmt):
    url = "file://" + str(tmp_path / "store")
    store = open_store(url, fmt, meta={**META}, create=True)
    store.put(key_of(0), rand_kv())
    assert store.path == url
    plain = open_store(str(tmp_path / "store"), readonly=True)
    assert plain.format == fmt and plain.keys() == [key_of(0)]
    assert torch.equal(open_store(url).get_layer(key_of(0), 3), rand_kv()[3].half())


def test_fsspec_object_store_commits_by_marker(tmp_path):
    url = f"memory://kvf-test-{uuid.uuid4().hex}/store"  # no atomic rename there
    store = open_store(url, meta={**META}, create=True)
    assert isinstance(store.fs, FsspecFS)
    store.put(key_of(0), rand_kv(), extras={"s": np.arange(3.0)})
    assert torch.equal(store.get(key_of(0)), rand_kv().half())
    assert torch.equal(store.get_layer(key_of(0), 2), rand_kv()[2].half())
    np.testing.assert_array_equal(store.get_extras(key_of(0))["s"], np.arange(3.0))
    # an interrupted in-place write: data but no entry zarr.json (the commit marker)
    partial = f"{store.root}/{key_of(1)[:2]}/{key_of(1)}"
    store.fs.makedirs(partial + "/kv")
    store.fs.write_file(partial + "/kv/c.0.0.0.0.0", b"\0" * 64)
    assert not store.has(key_of(1)) and store.keys() == [key_of(0)]
    assert store.gc(grace_s=0)["garbage_removed"] == 1
    assert not store.fs.exists(partial)
    assert store.verify() == []
    assert store.delete(key_of(0)) and store.keys() == []
    with pytest.raises(KvfError, match="local path"):
        open_store(f"memory://kvf-test-{uuid.uuid4().hex}/h", "hdf5", create=True)


# ----------------------------------------------------------------------------- concurrency and gc


READER_WRITER = """
import os, sys, time, torch
from kvf.cachestore import open_store, entry_key
role, path, shard, n_total, ready = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
def key_of(i): return entry_key("model-fp", "prefix", "ctx", [i])
def kv_of(i): return torch.full((4, 2, 2, 512, 8), float(i)) + torch.arange(8.0)  # 256 KiB entries
if role == "write":  # shard s of 2 writes i = s, s+2, s+4, ... once the reader is polling
    store = open_store(path, meta={"model": "model-fp"}, create=True)
    while not os.path.exists(ready):
        time.sleep(0.01)
    for i in range(shard, n_total, 2):
        store.put(key_of(i), kv_of(i), attrs={"i": i})
        time.sleep(0.05)
else:  # read every entry as soon as it appears; every read must be complete and verified
    store = open_store(path, readonly=True)
    seen, partial_views, deadline = set(), 0, time.time() + 120
    open(ready, "w").close()
    while len(seen) < n_total and time.time() < deadline:
        keys = store.keys()
        partial_views += 0 < len(keys) < n_total
        for key in keys:
            if key in seen:
                continue
            i = store.attrs(key)["i"]
            assert key == key_of(i)
            assert torch.equal(store.get(key), kv_of(i).half()), key
            assert torch.equal(store.get_layer(key, 3), kv_of(i)[3].half()), key
            seen.add(key)
        time.sleep(0.005)
    print("seen", len(seen), "partial_views", partial_views)
    sys.exit(0 if len(seen) == n_total else 3)
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_reader_reads_while_two_writers_append(tmp_path, fmt):
    path, ready = str(tmp_path / "store"), tmp_path / "reader-ready"
    open_store(path, fmt, meta={**META}, create=True)
    n = 16
    reader = run_script(tmp_path, READER_WRITER, "read", path, 0, n, ready,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writers = [run_script(tmp_path, READER_WRITER, "write", path, s, n, ready, stderr=subprocess.PIPE)
               for s in (0, 1)]
    for w in writers:
        _, err = w.communicate(timeout=180)
        assert w.returncode == 0, err.decode()
    out, err = reader.communicate(timeout=180)
    assert reader.returncode == 0, out.decode() + err.decode()
    seen, partial_views = out.decode().split()[1::2]
    assert int(seen) == n
    assert int(partial_views) > 0  # the reader really read while the writers were appending
    store = open_store(path)
    assert len(store.keys()) == n and store.verify() == []
    assert store.info()["temp_items"] == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_gc_keep_removes_other_entries(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    for i in range(3):
        store.put(key_of(i), rand_kv(seed=i))
    disk_before = store.info()["bytes"]
    freed = store.gc(keep={key_of(1)})
    assert freed["entries_removed"] == 2 and freed["garbage_removed"] == 0
    assert freed["bytes_freed"] == disk_before - store.info()["bytes"] > 0
    assert store.keys() == [key_of(1)]
    assert torch.equal(store.get(key_of(1)), rand_kv(seed=1).half())
    assert staging_leftovers(store) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_per_token_overhead_is_small(tmp_path, fmt):
    meta = {"model": "m", "dtype": "float16", "layers": 30, "kv_heads": 3, "head_dim": 64}
    store = open_store(str(tmp_path / "big"), fmt, meta=meta, create=True)
    key = key_of(0)
    store.put(key, torch.randn(30, 2, 3, 256, 64), attrs={"variant": "prefix", "doc": "some-doc-id"})
    payload_per_token = 30 * 2 * 3 * 64 * 2
    path, _ = entry_files(store, key)  # measure the files ourselves, not through info()
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) \
        if os.path.isdir(path) else os.path.getsize(path)
    assert on_disk / 256 <= 1.02 * payload_per_token
    info = store.info()
    assert info["bytes"] == on_disk and info["payload_bytes_per_token"] == payload_per_token
    assert store.bytes_per_token() == on_disk / 256 and info["overhead"] <= 0.02


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("fmt", FORMATS)
def test_cli_info_verify_gc(tmp_path, fmt):
    store = new_store(tmp_path, fmt)
    store.put(key_of(0), rand_kv(), attrs={"variant": "prefix"})
    store.put(key_of(1), rand_kv(seed=1), attrs={"variant": "fusion"})
    runner = CliRunner()
    res = runner.invoke(store_app, ["info", "--store", store.path])
    assert res.exit_code == 0, res.output
    assert "entries" in res.output and "model-fp" in res.output and "prefix: 1" in res.output
    assert runner.invoke(store_app, ["verify", "--store", store.path, "--format", fmt]).exit_code == 0

    _, data_file = entry_files(store, key_of(1))
    with open(data_file, "r+b") as f:
        f.seek(layer_offset(store, key_of(1), 2) + 5)
        f.write(b"\x13\x37")
    res = runner.invoke(store_app, ["verify", "--store", store.path])
    assert res.exit_code == 1 and key_of(1) in res.output and key_of(0) not in res.output
    res = runner.invoke(store_app, ["verify", "--store", store.path, "--delete-bad"])
    assert res.exit_code == 1 and "deleted" in res.output
    assert open_store(store.path).keys() == [key_of(0)]
    res = runner.invoke(store_app, ["verify", "--store", store.path])
    assert res.exit_code == 0 and "1 entry OK" in res.output

    store.put(key_of(2), rand_kv(seed=2), attrs={"variant": "prefix"})
    keep = tmp_path / "keep.txt"
    keep.write_text("")   # an empty keep list would delete everything: refused
    res = runner.invoke(store_app, ["gc", "--store", store.path, "--keep", str(keep)])
    assert res.exit_code != 0 and "none of its 0 lines" in str(res.exception)
    keep.write_text(key_of(0) + "\n")
    res = runner.invoke(store_app, ["gc", "--store", store.path, "--keep", str(keep)])  # a preview only
    assert res.exit_code == 0 and "would remove 0 temp/garbage items and 1 of 2 entries" in " ".join(res.output.split())
    assert open_store(store.path).keys() == sorted([key_of(0), key_of(2)])
    res = runner.invoke(store_app, ["gc", "--store", store.path, "--keep", str(keep), "--yes"])
    assert res.exit_code == 0 and "removed 0 temp/garbage items and 1 entry," in " ".join(res.output.split())   # "1 entries"
    assert open_store(store.path).keys() == [key_of(0)]
    # a keep list saved with a byte-order mark (Windows editors) keeps its first key like the others
    store.put(key_of(2), rand_kv(seed=2), attrs={"variant": "prefix"})
    store.put(key_of(3), rand_kv(seed=3), attrs={"variant": "prefix"})
    keep.write_bytes(("\ufeff" + key_of(2) + "\r\n" + key_of(3) + "\r\n").encode("utf-8"))
    res = runner.invoke(store_app, ["gc", "--store", store.path, "--keep", str(keep), "--yes"])
    assert res.exit_code == 0 and open_store(store.path).keys() == sorted([key_of(2), key_of(3)])
    # a key that names no entry (a typo) is said: the entry it meant is not kept
    typo = ("0" if key_of(3)[0] != "0" else "1") + key_of(3)[1:]
    keep.write_text(key_of(2) + "\n" + typo + "\n")
    res = runner.invoke(store_app, ["gc", "--store", store.path, "--keep", str(keep)])
    assert res.exit_code == 0 and "1 of its 2 keys name no entry" in " ".join(res.output.split())
    assert "and 1 of 2 entries" in res.output   # the entry the typo meant would go: the warning says why
    res = runner.invoke(store_app, ["info", "--store", str(tmp_path / "nope")])
    assert res.exit_code != 0 and isinstance(res.exception, KvfError)


def test_a_store_url_whose_server_cannot_be_reached_is_one_line():
    """fsspec filesystems that connect when made (ftp://) raised a bare OSError: the CLI printed
    'kvf: error:: Connection refused' with no flag or fix."""
    with pytest.raises(KvfError, match=r"--store ftp://127.0.0.1:9/kv: cannot reach its server .*check the URL"):
        open_store("ftp://127.0.0.1:9/kv")


@pytest.mark.parametrize("where", ["zarr", "hdf5", "memory"])
def test_headers_of_many_keys_equal_header_of_each(tmp_path, where):
    """headers(keys) is what has() and header() give key by key: committed entries only (an interrupted write,
    an absent key are left out), each header checked, so a misplaced copy is still called corrupt."""
    if where == "memory":   # an fsspec store, which asks for every marker in one cat of a list
        store = open_store(f"memory://kvf-test-{uuid.uuid4().hex}/store", meta={**META}, create=True)
    else:
        store = new_store(tmp_path, where)
    for i in range(3):
        store.put(key_of(i), rand_kv(seed=i), extras={"s": np.arange(3.0)} if i == 1 else None)
    if where != "hdf5":   # an in-place write cut short: data, no marker
        partial = store.fs.join(store.root, key_of(7)[:2], key_of(7))
        store.fs.makedirs(store.fs.join(partial, "kv"))
        store.fs.write_file(store.fs.join(partial, "kv", "c.0.0.0.0.0"), b"\0" * 64)
    asked = [key_of(i) for i in (2, 9, 0, 7, 1)]
    fresh = open_store(store.path)
    found = fresh.headers(asked)
    assert list(found) == [key_of(2), key_of(0), key_of(1)]
    assert found == {key: open_store(store.path).header(key) for key in found}
    assert set(found[key_of(1)].extras) == {"s"} and fresh.headers([]) == {}
    if where == "zarr":   # entry 0's marker copied under entry 2's key
        shutil.copy(os.path.join(store.root, key_of(0)[:2], key_of(0), "zarr.json"),
                    os.path.join(store.root, key_of(2)[:2], key_of(2), "zarr.json"))
        with pytest.raises(CorruptEntry, match="misplaced copy"):
            open_store(store.path).headers([key_of(0), key_of(2)])


@pytest.mark.parametrize("where", ["zarr", "hdf5", "memory"])
def test_info_counts_a_damaged_header_as_unreadable_and_sums_the_rest(tmp_path, where, monkeypatch):
    """info asks for headers and sizes a batch at a time (side by side on an object store); an entry whose header
    cannot be read is counted, not fatal, and the totals are those of the readable entries one by one."""
    import kvf.cachestore.base as base
    monkeypatch.setattr(base, "INFO_BATCH", 2)   # batches that split the damaged entry from some good ones
    if where == "memory":
        store = open_store(f"memory://kvf-test-{uuid.uuid4().hex}/store", meta={**META}, create=True)
    else:
        store = new_store(tmp_path, where)
    for i in range(5):
        store.put(key_of(i), rand_kv(tokens=3 + i, seed=i), attrs={"variant": "prefix" if i % 2 else "fusion"})
    damaged = key_of(2)
    if where == "hdf5":
        store.fs.write_file(store._entry_path(damaged), b"garbage!" * 600)
    else:
        store.fs.write_file(store.fs.join(store._entry_dir(damaged), "zarr.json"), b"{not json")
    good = [key_of(i) for i in (0, 1, 3, 4)]
    info = open_store(store.path).info()
    assert info["entries"] == 4 and info["unreadable_entries"] == 1
    assert info["tokens"] == 3 + 4 + 6 + 7 and info["variants"] == {"fusion": 2, "prefix": 2}
    assert info["bytes"] == sum(store._entry_bytes(key) for key in good) > 0
    with pytest.raises(CorruptEntry):
        open_store(store.path).headers([key_of(0), damaged])
    unreadable = []
    assert list(open_store(store.path).headers([key_of(0), damaged], unreadable=unreadable)) == [key_of(0)]
    assert unreadable == [damaged]
