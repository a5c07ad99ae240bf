"""kvf's one user-facing error type, its warnings, and the Python API's naming of its lines (their own
module, so the store can import them without the rest of kvf)."""


import contextvars
import functools
import inspect
import re
from contextlib import contextmanager
from pathlib import PurePath
from typing import Iterator


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


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 question', '3 questions' ('1 entry', '3 entries' given the plural): a count as a line says it."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def stand_in(head: str, html: bool = True) -> str | None:
    """What a data file's first line shows it to be instead of data, with the fix: a Git LFS pointer (a clone made
    without git-lfs) or, unless html is False (a document may be a page), an HTML page (a download that failed or
    was redirected); None for anything else."""
    if head.lstrip("\ufeff").startswith("version https://git-lfs.github.com/spec/"):
        return "is a Git LFS pointer, not the data; fetch the data with `git lfs pull` in the clone it came from"
    if html and re.match(r"\s*<(!doctype html|html[\s>])", head.lstrip("\ufeff"), re.IGNORECASE):
        return "is an HTML page, not the data (a download that failed or was redirected?); download it again"
    return None


def disk_full(e: OSError) -> bool:
    """A write that failed for want of space (the disk, or the user's quota): said as such, with its fix."""
    import errno
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def json_reason(e) -> str:
    """Where and why a JSON line broke, as a line can say it: "Invalid control character at column 21" (json's own
    msg for that case ends in a dangling "at"), "Expecting value at column 1"."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def warn(message: str) -> None:
    """A non-fatal problem with the input: one yellow line on stderr, and kvf carries on."""
    from rich.console import Console
    Console(stderr=True).print(f"warning: {message}", style="yellow", markup=False, highlight=False, soft_wrap=True)


def as_arguments(message: str, arguments: dict[str, tuple[str, object]]) -> str:
    """A line that names the CLI's flags, naming a Python call's arguments instead: "--device cuda: ...; use
    --device cpu" -> "device='cuda': ...; use device='cpu'". arguments: flag -> (argument, value passed). A
    `kvf ...` command quoted in the line is a command to type, and stays as it is."""
    parts = message.split("`")
    for i in range(0, len(parts), 2):   # the parts outside backquotes
        for flag, (name, value) in arguments.items():
            if value is not None and not isinstance(value, bool):
                passed = str(value) if isinstance(value, PurePath) else value   # as it was passed: '0.5', 3
                parts[i] = parts[i].replace(f"{flag} {value}", f"{name}={passed!r}")
            # a fix that names a value ("or use --device cpu"), then the flag alone ("omit --model for ...")
            # (a point ends the value only where no digit follows: "--ratio 0.15" is not "ratio='0'.15")
            parts[i] = re.sub(rf"{re.escape(flag)} ([^\s;,()]+?)(?=[:,;)]|\.(?!\d)|$)",
                              lambda m: f"{name}={m[1] if is_number(m[1]) else repr(m[1])}", parts[i])
            parts[i] = re.sub(rf"{re.escape(flag)}(?![\w-])", name, parts[i])
    return "`".join(parts)


def is_number(word: str) -> bool:
    """Whether a word reads as a number: a value Python writes as it is (ratio=0.3), where a word is quoted
    (device='cpu'); a negative number after an option is its value, not another option."""
    try:
        float(word)
    except ValueError:
        return False
    return True


def percent_as_fraction(word: str) -> str | None:
    """A ratio written as a percentage ("15", for 15%) -> the fraction it stands for ("0.15"); None for any other
    word, a fraction included."""
    if not is_number(word) or not 1 < float(word) <= 100:
        return None
    return f"{float(word) / 100:g}"


_flags_kept = contextvars.ContextVar("flags_kept", default=False)


@contextmanager
def flags_kept():
    """A CLI command calling the Python API (kvf ask): kvf's lines keep naming the CLI's flags (--top-k 0), as
    every other command's do, where a notebook's call would see its arguments (top_k=0)."""
    token = _flags_kept.set(True)
    try:
        yield
    finally:
        _flags_kept.reset(token)


def called_as(flag: str, argument: str) -> str:
    """What a warning calls an input: the flag from a CLI command (flags_kept), the argument from a notebook
    (warnings are printed, not raised, so named_as_arguments does not reach them)."""
    return flag if _flags_kept.get() else argument


@contextmanager
def named_as_arguments(arguments: dict[str, tuple[str, object]]):
    """kvf's checks name the CLI's flags; a line raised inside, called from Python, names the arguments."""
    try:
        yield
    except KvfError as e:
        raise KvfError(as_arguments(str(e), arguments)) from None


def errors_name_arguments(flags: dict[str, str] | None = None, more=lambda self: {}):
    """A Python API function whose KvfError lines name its own arguments (top_k=0), not the CLI's flags
    (--top-k 0). Each argument is the flag of its name (max_new_tokens: --max-new-tokens) unless `flags` maps
    it to another (path: --workspace); more(self) adds what an object was opened with."""
    def wrap(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def named(*args, **kwargs):
            if _flags_kept.get():   # called by a CLI command (kvf ask): its lines name the flags it was given
                return function(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs)
            bound.apply_defaults()
            given = {name: value for name, value in bound.arguments.items()
                     if signature.parameters[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and name != "self"}
            arguments = {(flags or {}).get(name, "--" + name.replace("_", "-")): (name, value)
                         for name, value in given.items()}
            with named_as_arguments({**(more(args[0]) if "self" in signature.parameters else {}), **arguments}):
                return function(*args, **kwargs)
        return named
    return wrap


def raised_from(error: BaseException | None) -> Iterator[BaseException]:
    """error, then each error it was raised from or while handling (__cause__, else __context__), each once."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
