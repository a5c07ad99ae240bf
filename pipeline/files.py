"""The one way kvf writes a file: to a temp file beside it, then rename (atomic on POSIX).

A reader, or a run killed mid-write, never sees half a file, and no temp file is left behind on
any error (disk full, Ctrl-C). New files get the usual permissions (0666 less the umask), not
mkstemp's 0600, so a workspace built by one user can be read by another.

Also here: the work directory of a benchmark (`work_dir`: a temp one is removed however the run
ends), the reader of files that list one item per line (`read_listed`), and a folder named by an
environment variable (`env_folder`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; it replaces `path` when the block ends without an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename in (None, tmp):   # a failed write (disk full) names no file:
            e.filename = str(path)                                   # the user's, not our temp one
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write text (UTF-8) or bytes to `path` atomically."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temp directory beside `path`; it replaces `path` (a directory, if any) when the block
    ends without an error. A reader sees the old directory or the new one, never a half-written one
    (besides the instant between the two renames, when it sees none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def work_dir(given: str | Path | None, prefix: str) -> Iterator[Path]:
    """The directory a command works in: `given` (kept, so a rerun can reuse it), or a temp dir that is
    removed when the block ends, however it ends: a benchmark's stores are hundreds of MB each, and a
    temp dir left behind on every run fills /tmp."""
    if given is not None:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_listed(path: str | Path, flag: str, what: str) -> set[str]:
    """The items of a file that lists one `what` per line: blank lines and `# comments` skipped, and a
    leading byte-order mark (Windows editors write one) dropped, so the first item matches like the rest."""
    from kvf.errors import KvfError
    path = Path(path)
    if not path.is_file():
        raise KvfError(f"{flag} {path}: no such file; pass a file with one {what} per line")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise KvfError(f"{flag} {path} is not UTF-8 text; pass a file with one {what} per line") from None
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return {line for line in lines if line}


def other_files(folder: str | Path, ours: set[str]) -> list[str]:
    """The names in `folder` (sorted; hidden ones and `ours` left out) that kvf did not put there: a folder kvf
    writes its own files into must not be the user's folder of other things, whose files it would mix with."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.name not in ours)


def check_writable_dir(path: str | Path, flag: str, create: bool = True) -> Path:
    """A directory kvf is about to write into: created if missing; a file there, or a place that
    cannot be written, is a one-line error naming the flag. create=False checks the same and makes nothing
    (the folder nearest it that exists is probed), for a command that may still be refused before it writes."""
    from kvf.errors import KvfError
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise KvfError(f"{flag} {path} is a file; pass a directory")
    nearest = path if create else next(p for p in (path, *path.parents) if p.exists())
    if not create and not nearest.is_dir():
        raise KvfError(f"{flag} {path}: {nearest} is a file; pass a directory")
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=nearest, prefix=".kvf-write-probe-"):
            pass
    except OSError as e:
        raise KvfError(f"{flag} {path} is not writable ({e.strerror}); pass a writable directory") from None
    return path


def env_folder(var: str, what: str) -> Path | None:
    """The folder environment variable `var` names (~ expanded), or None when it is unset or empty; one of
    only spaces is refused (a stray quote in a shell profile), since kvf would make a folder called " "."""
    from kvf.errors import KvfError
    value = os.environ.get(var, "")
    if not value:
        return None
    if not value.strip():
        raise KvfError(f"{var} is blank; unset it, or set it to {what}")
    return Path(value).expanduser()
