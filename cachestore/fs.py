"""The few file operations the stores need, for a local directory and for any fsspec filesystem.

Local stores commit an entry by renaming a finished temp directory/file into place (atomic, first
writer wins). Object stores have no atomic rename, so there the entry's metadata file is written last
and is the commit marker (see zarr_store.py).
"""
import errno
import os
import posixpath
import shutil
from concurrent.futures import ThreadPoolExecutor

import fsspec.asyn

ASK_THREADS = 16   # requests an object store is asked side by side where fsspec has no batched call


class ManyPaths:
    """Questions about many paths (or entries) at once, through each(): one after another on a local disk, side by
    side from ASK_THREADS threads on an object store, where fsspec has no batched call (s3fs runs every call on
    its own event loop, so calls from several threads overlap on the network)."""
    local: bool

    def each(self, ask, items: list) -> list:
        """[ask(item) for item in items], in order."""
        if self.local:
            return [ask(item) for item in items]
        with ThreadPoolExecutor(max_workers=ASK_THREADS, thread_name_prefix="kvf-ask") as pool:
            return list(pool.map(ask, items))

    def read_many(self, paths: list[str]) -> list[bytes | None]:
        """Each file's bytes, one read after another; None where there is no such file."""
        found = []
        for path in paths:
            try:
                found.append(self.read_file(path))
            except FileNotFoundError:
                found.append(None)
        return found

    def exists_many(self, paths: list[str]) -> list[bool]:
        return self.each(self.exists, paths)

    def write_many(self, files: dict) -> None:
        """Write each file (path -> bytes or a buffer), one after another, in order; the first failure raises."""
        for path, data in files.items():
            self.write_file(path, data)

    def size_many(self, paths: list[str]) -> list[int]:
        return self.each(self.size, paths)

    def names_marked(self, parent: str, marker: str, bulk: str | None = None) -> list[tuple[str, bool, frozenset | None]]:
        """(name, whether name/marker exists, what name holds) for every name in parent, files too (never marked);
        symlinks are left out, never followed. `bulk`: the folder in each name that holds its many files (a hint
        for object stores). What a name holds (its first-level children) comes only where one listing of parent
        shows it for free (object stores); None here."""
        names = [n for n in self.listdir(parent) if not self.is_link(self.join(parent, n))]
        return [(name, self.exists(self.join(parent, name, marker)), None) for name in names]


class LocalFS(ManyPaths):
    """`root`: removals outside it (through a symlink, say) are refused, so no store operation ever
    deletes anything that is not the store's."""
    local = True
    sep = os.sep

    def __init__(self, root: str | None = None):
        self.root = os.path.realpath(root) if root else None

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def write_file(self, path: str, data) -> None:
        """The one low-level write every store file goes through (tests patch it to simulate ENOSPC)."""
        with open(path, "wb") as f:
            f.write(data)

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        """Read len(out) bytes at offset into out; returns how many were there (short = truncated file)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], offset + done)
                if n == 0:
                    break
                done += n
            return done
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, path: str) -> int:
        """Bytes of a file, or of all files under a directory (apparent sizes)."""
        if not os.path.isdir(path):
            return os.path.getsize(path) if os.path.exists(path) else 0
        total = 0
        for dirpath, _, files in os.walk(path):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(dirpath, name))
                except FileNotFoundError:
                    pass
        return total

    def mtime(self, path: str) -> float | None:
        try:
            return os.path.getmtime(path)
        except FileNotFoundError:
            return None

    def inside_root(self, path: str) -> bool:
        """True when `path` itself (not what a symlink at it points to) lies inside the root."""
        if self.root is None:
            return True
        parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
        return parent == self.root or parent.startswith(self.root + os.sep)

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def remove(self, path: str) -> None:
        """Remove a file or a directory tree; missing is fine. A symlink is removed, never followed;
        a path outside the root (reached through a symlinked directory) is refused."""
        if not self.inside_root(path):
            raise ValueError(f"refusing to remove {path}: it lies outside the store {self.root}")
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def publish(self, src: str, dst: str) -> bool:
        """Atomically move a finished src into place at dst, never replacing an existing dst.

        Returns False (and removes src) when dst already exists: another writer committed first.
        Directories: rename fails on a non-empty target. Files: link() fails on an existing target.
        """
        if os.path.isdir(src):
            try:
                os.rename(src, dst)
                return True
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    self.remove(src)
                    return False
                raise
        try:
            os.link(src, dst)
        except FileExistsError:
            os.unlink(src)
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            if os.path.exists(dst):  # no hard links here: check-then-rename (tiny race, same content)
                os.unlink(src)
                return False
            os.rename(src, dst)
            return True
        os.unlink(src)
        return True


def signed_too_long_ago(error: BaseException) -> bool:
    """S3 refused a request for the time it was signed at: AWS's RequestTimeTooSkewed, or another server's
    AccessDenied saying so (rclone's: "The difference between the request time and the server's time exceeds the
    maximum allowed"). A request signed, then held up past the allowed 15 minutes (the host slept, its VM paused)
    is refused this way even though nothing else is wrong with it."""
    from botocore.exceptions import ClientError
    if not isinstance(error, ClientError):
        return False
    said = error.response.get("Error", {})
    return said.get("Code") == "RequestTimeTooSkewed" or "difference between the request time" in str(said.get("Message"))


def resend_stale_signatures() -> None:
    """Have s3fs resend a request refused as signed_too_long_ago: botocore signs each try with the time then, so
    the try after a pause goes through; a clock that is really wrong is still refused after s3fs's tries. s3fs
    holds one handler per process (set_custom_error_handler): one set before is kept, and asked after ours."""
    import s3fs.core
    earlier = s3fs.core.CUSTOM_ERROR_HANDLER
    if getattr(earlier, "resends_stale_signatures", False):
        return

    def handler(error: BaseException) -> bool:
        return signed_too_long_ago(error) or earlier(error)
    handler.resends_stale_signatures = True
    s3fs.core.set_custom_error_handler(handler)


class FsspecFS(ManyPaths):
    """Any fsspec filesystem (s3://, gs://, memory://, ...). No atomic rename: stores commit by marker."""

    local = False
    sep = "/"

    def is_link(self, path: str) -> bool:
        return False  # object stores have no symlinks

    def __init__(self, fs):
        self.fs = fs
        if self._is_s3():
            resend_stale_signatures()

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def write_file(self, path: str, data) -> None:
        self.fs.pipe_file(path, bytes(data))

    def read_file(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def write_many(self, files: dict) -> None:
        """Write each file (path -> bytes or a buffer). An async filesystem (s3fs) sends the writes side by side
        (fsspec's pipe of a dict); a failure raises, and the files already written stay."""
        if files:
            self.fs.pipe({path: bytes(data) for path, data in files.items()})

    def read_many(self, paths: list[str]) -> list[bytes | None]:
        """Each file's bytes, None where there is no such file. An async filesystem (s3fs) sends the requests
        side by side (fsspec's cat of a list); a failure other than a missing file is raised."""
        if not paths:
            return []
        if any(c in path for path in paths for c in "*?["):  # cat would read these as glob patterns
            return super().read_many(paths)
        answers = self.fs.cat(list(paths), on_error="return")  # stripped path -> bytes or the exception
        found = []
        for path in paths:
            answer = answers[self.fs._strip_protocol(path)]
            if isinstance(answer, FileNotFoundError):
                answer = None
            elif isinstance(answer, BaseException):
                raise answer
            found.append(answer)
        return found

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        data = self.fs.cat_file(path, start=offset, end=offset + len(out))
        out[: len(data)] = data
        return len(data)

    def exists(self, path: str) -> bool:
        # not fs.exists: some fsspec/s3fs versions answer False when the endpoint is down, which would read
        # as "no store here"; info() lets a failure to reach the server propagate
        try:
            self.fs.info(path)
            return True
        except FileNotFoundError:
            return False

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []

    def names_marked(self, parent: str, marker: str, bulk: str | None = None) -> list[tuple[str, bool, frozenset | None]]:
        """As ManyPaths.names_marked. On S3, from one listing of parent's objects with `/{bulk}/` as the
        delimiter: S3 rolls each name's bulk files up into one prefix, so a name costs a few listed items (its
        marker, its bulk, and for a zarr entry its data folder's zarr.json) and a page of 1,000 keys covers some
        300 names, with no request per name's marker. The same items show what each name holds. A server that does
        not take that delimiter (_rolled_up_listing) is listed whole instead: every key, more pages, still no question
        per name.
        Elsewhere (or with no bulk folder named), a listing and a question per name."""
        if bulk is None or not self._lists_with_any_delimiter():
            return super().names_marked(parent, marker)
        root = self._strip(parent)
        bucket, _, key = root.partition("/")
        held: dict[str, set] = {}
        listing = fsspec.asyn.sync(self.fs.loop, self._rolled_up_listing, bucket, key + "/", f"/{bulk}/")
        if listing is None:   # a server that does not take the delimiter (rclone, MinIO): every key, unrolled
            listing = fsspec.asyn.sync(self.fs.loop, self._rolled_up_listing, bucket, key + "/", "")
        if listing is None:   # nor that: a question per name
            return super().names_marked(parent, marker)
        for path in listing:
            name, _, rest = path[len(root) + 1:].partition("/")
            held.setdefault(name, set())
            if rest:
                held[name].add(rest.partition("/")[0])
        return [(name, marker in held[name], frozenset(held[name])) for name in sorted(held)]

    def _is_s3(self) -> bool:
        return type(self.fs).__name__ == "S3FileSystem"

    def _lists_with_any_delimiter(self) -> bool:
        """An S3 filesystem, whose client (s3fs's public set_session) lists with any delimiter S3 takes."""
        return self._is_s3() and hasattr(self.fs, "set_session")

    async def _list_pages(self, bucket: str, prefix: str, delimiter: str):
        """The pages of one ListObjectsV2 listing, through s3fs's S3 client and botocore's paginator (public calls
        both; s3fs's own paged listing is private). The paginator stops a server that repeats its continuation
        token with a PaginationError."""
        client = await self.fs.set_session()
        paging = {"Bucket": bucket, "Prefix": prefix} | ({"Delimiter": delimiter} if delimiter else {})
        async for page in client.get_paginator("list_objects_v2").paginate(**paging):
            yield page

    async def _rolled_up_listing(self, bucket: str, prefix: str, delimiter: str,
                                 resent: bool = False) -> list[str] | None:
        """Every key under prefix as "bucket/key", with the keys holding `delimiter` rolled up to one prefix each
        ("bucket/prefix", without its last "/"); s3fs's directory cache is left alone (a listing with another
        delimiter is not a directory's). S3's errors become the Python ones s3fs's own listings raise
        (PermissionError, FileNotFoundError, ...).
        None when the server does not take that delimiter as S3 and moto do: rclone's S3 server rolls keys up at
        "/" whatever is asked (each entry then looked like a name without its marker), MinIO hands back the same
        page and token again and again, others answer 501 Not Implemented.
        delimiter "": every key, none rolled up (a name's bulk files are listed too: more pages, no more questions).
        A page refused as signed_too_long_ago (botocore's paginator is not behind s3fs's retries) restarts the
        listing once."""
        from botocore.exceptions import ClientError, PaginationError
        from s3fs.errors import translate_boto_error
        names: dict[str, None] = {}   # in listing order
        try:
            async for page in self._list_pages(bucket, prefix, delimiter):
                rolled_up = [p["Prefix"] for p in page.get("CommonPrefixes", [])]
                if any(not (delimiter and p.endswith(delimiter)) for p in rolled_up):
                    return None   # rolled up at another delimiter than the one asked
                for name in [f"{bucket}/{p[:-1]}" for p in rolled_up] + [f"{bucket}/{c['Key']}" for c in page.get("Contents", [])]:
                    if name in names:
                        return None   # a page handed back again
                    names[name] = None
        except PaginationError:
            return None
        except ClientError as e:
            if delimiter and e.response.get("Error", {}).get("Code") in ("NotImplemented", "InvalidArgument"):
                return None
            if signed_too_long_ago(e) and not resent:
                return await self._rolled_up_listing(bucket, prefix, delimiter, resent=True)
            raise translate_boto_error(e) from None
        return list(names)

    def _strip(self, path: str) -> str:
        return self.fs._strip_protocol(path).rstrip("/")

    def size(self, path: str) -> int:
        if self.fs.isdir(path):
            return int(self.fs.du(path, total=True))
        return int(self.fs.size(path)) if self.fs.exists(path) else 0

    def mtime(self, path: str) -> float | None:
        """A file's modification time; for a "directory" (a prefix), its newest file's."""
        try:
            if self.fs.isdir(path):
                times = [self.fs.modified(p).timestamp() for p in self.fs.find(path)]
                return max(times) if times else None
            return self.fs.modified(path).timestamp()
        except (FileNotFoundError, NotImplementedError, OSError, AttributeError, ValueError):
            return None

    def remove(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def publish(self, src: str, dst: str) -> bool:
        raise NotImplementedError("object stores have no atomic rename; commit by marker instead")
