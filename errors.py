"""kvf's one user-facing error type, and its warnings (their own module, so the store can import them
without the rest of kvf)."""


class KvfError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero, no traceback.

    Messages name the offending file or flag and the fix.
    """


def disk_full(e: OSError) -> bool:
    """A write that failed for want of space (the disk, or the user's quota): said as such, with its fix."""
    import errno
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def warn(message: str) -> None:
    """A non-fatal problem with the input: one yellow line on stderr, and kvf carries on."""
    from rich.console import Console
    Console(stderr=True).print(f"warning: {message}", style="yellow", markup=False, highlight=False, soft_wrap=True)
