"""HDF5 layout: one file per entry, local filesystems only.

    <root>/kvf_store.json          {"kvf_store": {format, version, meta, compressor}}
    <root>/.kvf-tmp/               staging for writes
    <root>/<key[:2]>/<key>.h5      one entry:
        userblock (first 512*2^n bytes, ignored by HDF5): b"KVF1" + uint32 LE length + header JSON
        /kv           [layers, 2, kv_heads, tokens, head_dim], contiguous, so layer l is the file bytes
                      [data_offset + l * layer_nbytes, + layer_nbytes)
        /extras/<name>
        attribute kvf_entry on / : the header JSON again (without data_offset), for h5py users

The file is built in memory (h5py on a BytesIO), written to staging in one write and linked into place
(atomic, first writer wins). Reads take the header from the userblock and a layer with one pread: the
HDF5 library is not on the hot path. With a compressor, /kv is chunked by layer and read through h5py.
"""
import dataclasses
import io
import json

import h5py
import numpy as np

from kvf.cachestore.base import STAGING, EntryHeader, KVStore, Unreadable, write_once
from kvf.cachestore.dtypes import STORE_DTYPES
from kvf.cachestore.errors import MissingEntry
from kvf.cachestore.keys import fanout

MAGIC = b"KVF1"
COMPRESSORS = ("gzip", "lzf")  # built into every h5py


def userblock_size(nbytes: int) -> int:
    """HDF5 wants the userblock to be a power of two >= 512."""
    return max(512, 1 << (nbytes - 1).bit_length())


def build_image(header: EntryHeader, stored: np.ndarray, extras: dict) -> tuple[memoryview, EntryHeader]:
    """The whole .h5 file as bytes, and the header with data_offset filled in."""
    body = json.dumps(header.to_dict()).encode()
    ub = userblock_size(8 + len(body) + 32)  # +32: room for the data_offset digits added below
    bio = io.BytesIO()
    with h5py.File(bio, "w", userblock_size=ub) as f:
        layout = {} if header.codec is None else {"chunks": (1, *stored.shape[1:]), "compression": header.codec}
        ds = f.create_dataset("kv", data=stored, **layout)  # [layers, 2, kv_heads, tokens, head_dim]
        if header.dtype == "bfloat16":
            ds.attrs["kvf_dtype"] = "bfloat16"  # stored as raw uint16 bits
        if extras:
            group = f.create_group("extras")
            for name, a in extras.items():
                group.create_dataset(name, data=a)
        f.attrs["kvf_entry"] = body.decode()
        f.flush()
        header = dataclasses.replace(header, data_offset=ds.id.get_offset())  # None when chunked
    block = json.dumps(header.to_dict()).encode()
    prefix = MAGIC + len(block).to_bytes(4, "little") + block
    assert len(prefix) <= ub, "userblock sized too small"
    image = bio.getbuffer()
    image[: len(prefix)] = prefix
    return image, header


class HDF5KVStore(KVStore):
    format = "hdf5"
    MARKER = "kvf_store.json"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dirs_made: set[str] = set()

    # ---------------------------------------------------------------- store identity

    @classmethod
    def read_identity(cls, fs, root: str) -> dict | None:
        path = fs.join(root, cls.MARKER)
        if not fs.exists(path):
            return None
        return json.loads(fs.read_file(path)).get("kvf_store", {})

    @classmethod
    def write_identity(cls, fs, root: str, identity: dict) -> None:
        fs.makedirs(fs.join(root, STAGING))
        write_once(fs, root, fs.join(root, cls.MARKER), json.dumps({"kvf_store": identity}, indent=1).encode())

    @staticmethod
    def check_compressor(compressor):
        if compressor is not None and compressor not in COMPRESSORS:
            raise ValueError(f"hdf5 stores support compressor None, {', '.join(COMPRESSORS)}; got {compressor!r}")
        return compressor

    # ---------------------------------------------------------------- paths

    def _entry_path(self, key: str) -> str:
        return self.fs.join(self.root, fanout(key), key + ".h5")

    def _is_committed(self, key: str) -> bool:
        return self.fs.exists(self._entry_path(key))

    def _committed_keys(self):
        for fan in self.fs.listdir(self.root):
            if len(fan) != 2:
                continue
            for name in self.fs.listdir(self.fs.join(self.root, fan)):
                if name.endswith(".h5"):
                    yield name[:-3]

    def _makedirs_once(self, path: str) -> None:
        if path not in self._dirs_made:
            self.fs.makedirs(path)
            self._dirs_made.add(path)

    # ---------------------------------------------------------------- writing

    def _write_entry(self, header: EntryHeader, stored: np.ndarray, extras: dict) -> bool:
        image, header = build_image(header, stored, extras)
        self._makedirs_once(self.fs.join(self.root, STAGING))
        self._makedirs_once(self.fs.join(self.root, fanout(header.key)))
        with self._staged(self._staging_path(header.key, ".h5")) as tmp:
            self.fs.write_file(tmp, image)
            return self.fs.publish(tmp, self._entry_path(header.key))  # the commit

    # ---------------------------------------------------------------- reading

    def _read_header(self, key: str) -> EntryHeader:
        path = self._entry_path(key)
        buf = bytearray(4096)
        try:
            n = self.fs.read_into(path, 0, memoryview(buf))
        except FileNotFoundError:
            raise MissingEntry(f"no entry {key} in store {self.path}") from None
        if n < 8 or buf[:4] != MAGIC:
            raise self._corrupt(key, "no kvf header in the HDF5 userblock")
        length = int.from_bytes(buf[4:8], "little")
        if 8 + length > len(buf):  # big attrs: read the rest
            buf = bytearray(8 + length)
            n = self.fs.read_into(path, 0, memoryview(buf))
        if n < 8 + length:
            raise self._corrupt(key, "file truncated inside its header")
        try:
            return EntryHeader.from_dict(json.loads(bytes(buf[8: 8 + length])))
        except (ValueError, KeyError, TypeError) as e:
            raise self._corrupt(key, f"unreadable entry header ({e!r})") from e

    def _read_layers_into(self, header: EntryHeader, layers: list[int], rows: np.ndarray) -> None:
        path = self._entry_path(header.key)
        if header.data_offset is None:
            return self._read_chunked(path, header, layers, rows)
        nbytes = header.layer_nbytes
        if layers == list(range(layers[0], layers[0] + len(layers))):  # consecutive: one read
            runs = [(layers[0], rows.reshape(-1))]
        else:
            runs = [(layer, row) for layer, row in zip(layers, rows)]
        for first, dest in runs:
            n = self.fs.read_into(path, header.data_offset + first * nbytes, memoryview(dest))
            if n != dest.size:
                raise Unreadable(f"file truncated at layer {first + n // nbytes} ({n} of {dest.size} bytes read)")

    @staticmethod
    def _read_chunked(path: str, header: EntryHeader, layers: list[int], rows: np.ndarray) -> None:
        np_dtype = STORE_DTYPES[header.dtype][1]
        try:
            with h5py.File(path, "r") as f:
                ds = f["kv"]
                for row, layer in zip(rows, layers):
                    ds.read_direct(row.view(np_dtype).reshape(header.layer_shape), source_sel=np.s_[layer])
        except (OSError, KeyError, RuntimeError, ValueError) as e:
            raise Unreadable(f"HDF5 read failed ({e})") from e

    def _read_extras(self, header: EntryHeader) -> dict[str, np.ndarray]:
        with h5py.File(self._entry_path(header.key), "r") as f:
            return {name: np.asarray(f["extras"][name][()], dtype=np.dtype(info["dtype"]))
                    for name, info in header.extras.items()}

    # ---------------------------------------------------------------- maintenance

    def _entry_bytes(self, key: str) -> int:
        return self.fs.size(self._entry_path(key))

    def _delete_entry(self, key: str) -> bool:
        if not self._is_committed(key):
            return False
        self.fs.remove(self._entry_path(key))  # unlink is atomic; open readers keep their inode
        return True
