"""Store errors. All are `kvf.KvfError`, so the CLI prints them on one line and exits 1."""
from kvf.errors import KvfError


class StoreMismatch(KvfError):
    """The store was built for another model / tokenizer / dtype / shape than the caller asks for.
    stored: the store's identity (its meta), for a caller that can tell an equal identity written another way."""
    stored: dict = {}


class NotAStore(KvfError):
    """Nothing, or something other than a kvf store, where an existing store was asked for."""


class CorruptEntry(KvfError):
    """An entry's bytes on disk do not match the checksums recorded when it was written."""


class MissingEntry(KvfError, KeyError):
    """No committed entry under this key. Also a KeyError, so `except KeyError` works."""

    def __str__(self):  # KeyError would print repr(message) in quotes
        return str(self.args[0]) if self.args else ""


class BadShape(KvfError, ValueError):
    """A KV tensor whose shape does not fit the store (also a ValueError)."""
