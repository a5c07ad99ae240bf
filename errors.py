"""kvf's one user-facing error type, and its warnings (their own module, so the store can import them
without the rest of kvf)."""


class KvfError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero, no traceback.

    Messages name the offending file or flag and the fix.
    """


def did_you_mean(name: str, known: list[str]) -> str:
    """' (did you mean cacheblend?)' for a name written another way: another case or separators (CacheBlend,
    cache_blend), a typo (cacheblnd), or the start of one or more names (niah: niah_single, ...); '' when
    nothing is close."""
    import difflib

    def fold(text: str) -> str:
        return "".join(c for c in text.lower() if c.isalnum())

    by_fold, key = {fold(k): k for k in known}, fold(name)
    if key in by_fold:
        matches = [by_fold[key]]
    else:
        matches = [k for f, k in by_fold.items() if len(key) >= 3 and f.startswith(key)]
        matches = matches or [by_fold[f] for f in difflib.get_close_matches(key, list(by_fold), n=1)]
    if not key or not matches:
        return ""
    return f" (did you mean {', '.join(matches[:-1]) + ' or ' if len(matches) > 1 else ''}{matches[-1]}?)"


def shown(value) -> str:
    """A JSON value as an error line quotes it: as the file wrote it, cut short."""
    import json
    import textwrap
    return textwrap.shorten(json.dumps(value, ensure_ascii=False), 40, placeholder="...")


def disk_full(e: OSError) -> bool:
    """A write that failed for want of space (the disk, or the user's quota): said as such, with its fix."""
    import errno
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def warn(message: str) -> None:
    """A non-fatal problem with the input: one yellow line on stderr, and kvf carries on."""
    from rich.console import Console
    Console(stderr=True).print(f"warning: {message}", style="yellow", markup=False, highlight=False, soft_wrap=True)
