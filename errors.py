"""kvf's one user-facing error type (its own module, so the store can import it without the rest of kvf)."""


class KvfError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero, no traceback.

    Messages name the offending file or flag and the fix.
    """
