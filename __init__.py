"""kvf: reuse precomputed chunk KV caches to make RAG prefill cheap, and measure what each fusion method keeps."""

__version__ = "0.1.0"


class KvfError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero, no traceback.

    Messages name the offending file or flag and the fix.
    """
