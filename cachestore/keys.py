"""Entry keys: what a stored chunk KV is, as one hex string."""
import hashlib
import re
from typing import Sequence

import numpy as np

_KEY_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z_-]{2,127}$")


def entry_key(model_fingerprint: str, variant: str, context_key: str, token_ids: Sequence[int]) -> str:
    """sha256 (hex) of the model, the offline variant, what the chunk attended to, and its token ids.

    Each string is length-prefixed and the ids are hashed as int64 little-endian, so no two different
    inputs can produce the same byte stream (no "ab"+"c" == "a"+"bc" collisions).
    """
    h = hashlib.sha256(b"kvf-entry-v1\0")
    for field in (model_fingerprint, variant, context_key):
        if not isinstance(field, str):
            raise TypeError(f"entry_key fields must be str, got {type(field).__name__}")
        data = field.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    ids = np.asarray(token_ids)  # (tokens,)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise TypeError(f"token_ids must be a flat sequence of ints, got shape {ids.shape} dtype {ids.dtype}")
    h.update(len(ids).to_bytes(8, "little"))
    h.update(ids.astype("<i8").tobytes())
    return h.hexdigest()


def check_key(key: str) -> str:
    """Keys become file names: allow only [0-9A-Za-z_-], 3..128 chars, starting alphanumeric."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"invalid store key {key!r}: use entry_key() (hex), or 3-128 chars of [0-9A-Za-z_-]")
    return key


def fanout(key: str) -> str:
    """First two characters: 256 sub-directories for hex keys, so no directory holds millions of entries."""
    return key[:2]
