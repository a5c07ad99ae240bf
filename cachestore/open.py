"""open_store: find or create a store at a path or URL, and check it is the store the caller means."""
import json
import os
import re
import socket
import ssl
from contextlib import contextmanager
from urllib.parse import urlsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kvf.errors import KvfError, raised_from
from kvf.cachestore.base import FORMAT_VERSION, KVStore
from kvf.cachestore.dtypes import check_dtype
from kvf.cachestore.errors import NotAStore, StoreMismatch
from kvf.cachestore.fs import FsspecFS, LocalFS
from kvf.cachestore.hdf5_store import HDF5KVStore
from kvf.cachestore.zarr_store import ZarrKVStore

FORMATS = {"zarr": ZarrKVStore, "hdf5": HDF5KVStore}
_ABSENT = "<absent>"


def open_store(path: str | os.PathLike, format: str | None = None, *, meta: dict | None = None, create: bool = False,
               readonly: bool | None = False, compressor: str | None = None) -> KVStore:
    """Open the store at path (local path or fsspec URL such as file:///data/kv or s3://bucket/kv).

    format: "zarr", "hdf5", or None to detect an existing store (new stores default to zarr).
    meta: the store identity (model, tokenizer, dtype, layers, kv_heads, head_dim, ...). Written when the
      store is created; when opening, every given field must equal the stored one (StoreMismatch).
    create: create the store if it does not exist. readonly: refuse put/delete/gc; None: read-only only
      where this process cannot write the store (a shared copy on a read-only mount), else writable.
    compressor: None (default: fastest reads), or zarr "zstd"/"gzip", hdf5 "gzip"/"lzf". Applies to new entries.
    """
    path = os.fspath(path)   # a pathlib.Path too
    if format not in (None, *FORMATS):
        raise KvfError(f"unknown store format {format!r} for {path}; use --format zarr or --format hdf5")
    fs, root = _resolve(path)
    with remote_errors(fs, path):
        check_endpoint(fs, root, path)
        return _open(fs, root, path, format, meta, create, readonly, compressor)


def _open(fs, root: str, path: str, format, meta, create, readonly, compressor) -> KVStore:
    found = _detect(fs, root, path, create)
    created = found is None
    if found is None:
        if not create:
            raise NotAStore(f"no kvf store at {path}; check --store, or build one there first")
        if readonly:
            raise KvfError(f"no kvf store at {path} and it was opened read-only, so it cannot be created")
        found = format or "zarr"
        if not fs.local and not fs.exists(root.split("/")[0]):  # s3fs would create a mistyped bucket
            raise KvfError(f"--store {path}: the bucket does not exist; create it first (e.g. `aws s3 mb "
                           f"s3://{root.split('/')[0]}`) or pass another --store")
        _create(FORMATS[found], fs, root, path, meta or {}, compressor)
    elif format is not None and format != found:
        raise KvfError(f"store {path} is a {found} store, not {format}; pass --format {found} or leave --format out")
    if found == "hdf5" and not fs.local:
        raise KvfError(f"hdf5 stores need a local path, got {path}; use --format zarr for URLs")
    cls = FORMATS[found]
    identity = cls.read_identity(fs, root)
    if meta:
        check_meta(path, identity.get("meta", {}), meta, entries=lambda: len(cls(fs, root, path, identity, True, None)))
    if readonly is None:
        readonly = fs.local and not os.access(root, os.W_OK)
    if not readonly and fs.local and not os.access(root, os.W_OK):
        raise KvfError(f"store {path} is not writable; fix its permissions, use another --store path, or open it read-only")
    try:
        store = cls(fs, root, path, identity, readonly, compressor)
    except ValueError as e:  # bad compressor name / dtype
        raise KvfError(f"store {path}: {e}") from e
    store.created = created   # made by this call (a caller may say so: a mistyped path is a new, empty store)
    return store


@contextmanager
def remote_errors(fs, path: str):
    """An object store's failures (no endpoint, no bucket, no access) as one line naming the fix."""
    if fs.local:
        yield
        return
    try:
        yield
    except KvfError:
        raise
    except Exception as e:
        said = remote_failure(e, any_os_error=True)
        if said:
            raise KvfError(f"--store {path}: {said}") from None
        raise


STORE_CLIENTS = ("botocore", "aiobotocore", "aiohttp", "s3fs")   # the modules an object store's failures come from


def remote_failure(e: BaseException, any_os_error: bool = False) -> str | None:
    """What an object store's failure says is wrong, and the fix; None for another error. botocore, aiohttp and
    s3fs raise many types, classified by what they say. any_os_error: e came from opening a remote store, where
    any OSError is the store's; elsewhere only those of the store's client libraries count."""
    if not (any_os_error or is_store_client_error(e)):
        return None
    setting = aws_setting(e)
    if setting:
        return setting
    text = f"{type(e).__name__}: {e}"
    first = text.splitlines()[0][:160]
    if "NoSuchBucket" in text or ("bucket" in text.lower() and isinstance(e, FileNotFoundError)):
        return f"the bucket does not exist ({first}); create it first (e.g. `aws s3 mb s3://BUCKET`) or pass another --store"
    if "ExpiredToken" in text or "TokenRefreshRequired" in text:
        return (f"the AWS session token has expired ({first}); renew the credentials (AWS_SESSION_TOKEN, or "
                "`aws sso login` for a profile)")
    if isinstance(e, PermissionError) or any(w in text for w in ("AccessDenied", "InvalidAccessKeyId",
                                                                 "SignatureDoesNotMatch", "InvalidClientTokenId",
                                                                 "NoCredentials", "Forbidden")):
        return f"access denied ({first}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
    if "CERTIFICATE_VERIFY_FAILED" in text or "SSLCertVerificationError" in text:   # behind a proxy: not checked first
        return (f"the object store's TLS certificate is not trusted here ({first}); set AWS_CA_BUNDLE to the "
                "certificate that signed it (a PEM file)")
    if any(w in text for w in ("Connect", "connect", "Endpoint", "Timeout", "refused")) or isinstance(e, OSError):
        return (f"cannot reach the object store ({first}); check --s3-endpoint (or AWS_ENDPOINT_URL) and that the "
                "server is up")
    return None


def is_store_client_error(e: BaseException) -> bool:
    """Whether e, or an error it was raised from, is one of an object store client's own (botocore's, aiohttp's,
    s3fs's), rather than a local file's or kvf's."""
    return any(type(raised).__module__.split(".")[0] in STORE_CLIENTS for raised in raised_from(e))


def aws_setting(e: Exception) -> str | None:
    """What a botocore error says is wrong in the user's AWS settings, and the fix; None for any other error.
    These came out as internal errors (a missing AWS_PROFILE, an unparsable config file) or as the store's
    marker being unreadable (a malformed region)."""
    try:
        from botocore import exceptions as aws
    except ImportError:
        return None
    if isinstance(e, aws.ProfileNotFound):
        return (f"AWS_PROFILE {e.kwargs.get('profile')!r} is not a profile in the AWS config; set AWS_PROFILE to "
                "one of its profiles, or unset it")
    if isinstance(e, aws.ConfigParseError):
        return (f"the AWS config file {e.kwargs.get('path')} cannot be parsed; fix it, or point AWS_CONFIG_FILE "
                "at another")
    if isinstance(e, aws.InvalidRegionError):
        return (f"{e.kwargs.get('region_name')!r} is not an AWS region name; fix AWS_DEFAULT_REGION (or "
                "AWS_REGION, or the profile's region)")
    return None


def check_meta(path: str, stored: dict, wanted: dict, entries=lambda: None) -> None:
    """Every field the caller gives must equal the stored one (compared as JSON, so tuples == lists).
    entries() counts the store's entries, asked only on a mismatch: a store with none was left by a first build
    that stopped before writing one (e.g. a model whose weights did not load), and deleting it loses nothing."""
    for field, want in wanted.items():
        have = stored.get(field, _ABSENT)
        if _canon(have) != _canon(want):
            fix = ("it holds no entry yet (a first build stopped before writing one): delete it and re-run, or use "
                   "another --store path") if entries() == 0 else "use another --store path or rebuild the store"
            mismatch = StoreMismatch(f"store {path} holds {field}={have!r} but this run needs {field}={want!r}; {fix}")
            mismatch.stored = stored
            raise mismatch


def _canon(value) -> str:
    return json.dumps(value, sort_keys=True)


def check_url(path: str) -> None:
    """Store URLs mistyped in ways fsspec would take for something else: a local folder named `s3:` (one
    slash), an unknown protocol `S3`, a read-only HTTP site (an endpoint given as the store), no bucket."""
    scheme, sep, rest = path.partition(":/")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]+", scheme) or scheme.lower() not in fsspec.available_protocols():
        return
    if not rest.startswith("/"):
        raise KvfError(f"--store {path}: a URL needs two slashes after {scheme}:, as in {scheme.lower()}://{rest}")
    if scheme != scheme.lower():
        raise KvfError(f"--store {path}: write the protocol in lower case, as in {scheme.lower()}:/{rest}")
    if scheme in ("http", "https"):
        raise KvfError(f"--store {path}: an HTTP address is an endpoint, not a store; pass --store s3://BUCKET/PREFIX "
                       f"and the endpoint as --s3-endpoint {scheme}://{rest.lstrip('/').split('/')[0]}")
    if scheme not in ("file", "local") and not rest.strip("/"):
        raise KvfError(f"--store {path}: name a bucket and a prefix, as in {scheme}://BUCKET/PREFIX")


def _resolve(path: str):
    """(filesystem, root path). file:// URLs and plain paths use the local fast path."""
    check_url(path)
    if "://" not in path:
        root = os.path.abspath(os.path.expanduser(path))
        return LocalFS(root), root
    if path.startswith("s3://"):
        check_endpoint_variable()
    try:
        # a filesystem of its own: fsspec's per-process cache kept the first one's AWS settings, so a notebook
        # that fixed its credentials or endpoint after a refusal was refused again with the old ones
        fs, root = fsspec.core.url_to_fs(path, skip_instance_cache=True)
    except (ImportError, ValueError) as e:  # unknown protocol, or its package (s3fs, gcsfs) missing
        if isinstance(e, ImportError) and path.startswith("s3"):
            raise KvfError(f"--store {path}: S3 stores need s3fs; pip install 'kvf[s3]'") from e
        raise KvfError(f"--store {path}: cannot open it ({e})") from e
    except OSError as e:   # filesystems that connect when made (ftp://, sftp://): an unknown or refusing host
        raise KvfError(f"--store {path}: cannot reach its server ({type(e).__name__}: {e}); check the URL and "
                       "that the server is up") from None
    if isinstance(fs, LocalFileSystem):
        return LocalFS(os.path.abspath(root)), os.path.abspath(root)
    return FsspecFS(fs), root.rstrip("/")


def is_endpoint_url(value: str) -> bool:
    """An S3 endpoint as botocore takes it (--s3-endpoint, AWS_ENDPOINT_URL): an http(s) URL."""
    return value.startswith(("http://", "https://"))


def check_endpoint_variable() -> None:
    """AWS_ENDPOINT_URL, which botocore reads, must be a URL: botocore's "Invalid endpoint" surfaced as the store's
    marker being unreadable ("is this a kvf store?"), as if the store were at fault."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    if endpoint and not is_endpoint_url(endpoint):
        raise KvfError(f"AWS_ENDPOINT_URL {endpoint!r}: not an endpoint URL; set it to one such as "
                       "http://localhost:9000, or unset it to use AWS")


def check_endpoint(fs, root: str, path: str) -> None:
    """An S3 store at an endpoint of the user's (--s3-endpoint, AWS_ENDPOINT_URL), checked before the store's
    first request: botocore's settings first (the client, made here, refuses a bad profile, config or region),
    then that the endpoint answers, then that it answers as S3."""
    if fs.local or not path.startswith("s3://") or not os.environ.get("AWS_ENDPOINT_URL"):
        return
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    fs.fs.connect()
    check_endpoint_reachable(path, endpoint, endpoint_ca(fs.fs))
    check_speaks_s3(fs.fs, root.split("/")[0], path, endpoint)


def check_endpoint_reachable(path: str, endpoint: str, ca: str | bool, timeout_s: float = 5.0) -> None:
    """One TCP connect to the endpoint's host and port, and for https:// a TLS handshake checked against ca (as
    botocore checks it; False: not checked): botocore and s3fs retry a refused or unknown endpoint, or a
    certificate they do not trust, with back-off, so these were named only after ~20 s, an untrusted certificate
    as an endpoint that is not up. Not checked behind an HTTP proxy, which may be the only way to the endpoint."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return
    url = urlsplit(endpoint)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        connection = socket.create_connection((url.hostname, port), timeout=timeout_s)
    except (OSError, ValueError) as e:   # refused, unknown host, timed out; ValueError: a port out of range
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise KvfError(f"--store {path}: cannot reach the object store at {endpoint} ({why}); check --s3-endpoint "
                       "(or AWS_ENDPOINT_URL) and that the server is up") from None
    with connection:
        if url.scheme == "https" and ca is not False:
            check_tls(connection, url.hostname, ca, path, endpoint)


def endpoint_ca(fs) -> str | bool:
    """What s3fs's client checks an https endpoint's certificate against, as botocore picks it: the filesystem's
    own `verify` (client_kwargs, from the fsspec config; False: not checked), else AWS_CA_BUNDLE or the AWS
    profile's ca_bundle, else botocore's default bundle."""
    verify = (getattr(fs, "client_kwargs", None) or {}).get("verify")
    if verify is not None:
        return verify
    import botocore.session
    from botocore.httpsession import get_cert_path
    return botocore.session.get_session().get_config_variable("ca_bundle") or get_cert_path(True)


def check_tls(connection: socket.socket, hostname: str, ca: str | bool, path: str, endpoint: str) -> None:
    """A TLS handshake over connection, the server's certificate checked against ca (a PEM file or a folder of
    them; True: the system's), naming the fix for each way it fails."""
    if isinstance(ca, str) and not os.path.exists(ca):
        raise KvfError(f"--store {path}: the CA bundle {ca} (AWS_CA_BUNDLE, the AWS profile's ca_bundle or the "
                       "fsspec config's verify) does not exist; point it at the certificate that signed the "
                       "endpoint's (a PEM file), or unset it") from None
    cafile = ca if isinstance(ca, str) and os.path.isfile(ca) else None
    capath = ca if isinstance(ca, str) and os.path.isdir(ca) else None
    try:
        context = ssl.create_default_context(cafile=cafile, capath=capath)
    except ssl.SSLError as e:   # a DER file, a key, any other file
        raise KvfError(f"--store {path}: the CA bundle {ca} holds no certificate in PEM form ({e.reason or e}); point "
                       "AWS_CA_BUNDLE at the certificate that signed the endpoint's, as PEM") from None
    try:
        context.wrap_socket(connection, server_hostname=hostname).close()
    except ssl.SSLCertVerificationError as e:
        raise KvfError(f"--store {path}: the endpoint {endpoint} has a TLS certificate this machine does not trust "
                       f"({e.verify_message}); set AWS_CA_BUNDLE to the certificate that signed it (a PEM file), "
                       "or give --s3-endpoint as its http:// address if it serves one") from None
    except ssl.SSLError as e:   # e.g. a plain-HTTP port named as https://
        raise KvfError(f"--store {path}: the endpoint {endpoint} did not complete a TLS handshake "
                       f"({e.reason or e}); if it serves plain HTTP, give --s3-endpoint as http://...") from None
    except OSError as e:   # the server closed the connection or stayed silent mid-handshake
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise KvfError(f"--store {path}: the endpoint {endpoint} did not complete a TLS handshake ({why}); check "
                       "--s3-endpoint's scheme and port") from None


def check_speaks_s3(fs, bucket: str, path: str, endpoint: str) -> None:
    """One listing of the bucket (a GET, whose refusals S3 explains in its body): an endpoint that is some other
    web server (a storage console's port, a proxy) answers with a bare HTTP status, which s3fs reads as "not
    found", so a mistyped --s3-endpoint was reported as a missing bucket or as no store there. Any other
    failure is left to the calls that follow, which say what it is."""
    try:
        fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
    except Exception as e:  # s3fs raises its own types; botocore's answer (a ClientError) is the cause
        response = getattr(e.__cause__ or e.__context__ or e, "response", None)
        code = str((response or {}).get("Error", {}).get("Code", ""))
        if response is not None and (not code or code.isdigit()):   # S3 names every refusal (NoSuchBucket, ...)
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", code or "?")
            raise KvfError(f"--store {path}: the endpoint {endpoint} answered HTTP {status} "
                           "without an S3 error code, so it is not an S3 server; check --s3-endpoint (or "
                           "AWS_ENDPOINT_URL): the S3 API's address and port, not a console's") from None


def _detect(fs, root: str, path: str, create: bool = True) -> str | None:
    """Which format lives at root; None if nothing does (missing or empty directory). create: whether the
    caller would make a store there (the fix for a folder of other files differs)."""
    found = []
    for name, cls in FORMATS.items():
        try:
            identity = cls.read_identity(fs, root)
        except (ValueError, OSError) as e:
            if not fs.local and (not isinstance(e, ValueError) or aws_setting(e)):
                raise  # an object store's own failure (access, endpoint, settings): remote_errors says which
            raise KvfError(f"store {path}: cannot read {cls.MARKER} ({e}); is this a kvf store?") from e
        if identity == {}:
            inside_a_store(fs, root, path)
            raise KvfError(f"{path} holds a {cls.MARKER} that is not a kvf store's; use another --store path")
        if identity is not None:
            found.append(name)
    if len(found) > 1:
        raise KvfError(f"{path} has both zarr and hdf5 store markers; pass --format")
    if found:
        return found[0]
    if fs.local and os.path.exists(root) and (not os.path.isdir(root) or os.listdir(root)):
        inside_a_store(fs, root, path)
        fix = "use another --store path (or an empty directory)" if create else \
            "pass a store (such as WORKSPACE/kv.zarr) or a workspace folder"
        raise NotAStore(f"{path} exists and is not a kvf store; {fix}")
    return None


def inside_a_store(fs, root: str, path: str, levels: int = 3) -> None:
    """A path inside a local kvf store (a fan-out folder, an entry, a marker file): the store is what the
    user meant, so the error names it."""
    parent = root
    for _ in range(levels if fs.local else 0):
        parent = os.path.dirname(parent)
        for cls in FORMATS.values():
            try:
                identity = cls.read_identity(fs, parent)
            except (ValueError, OSError):
                continue
            if identity:
                raise KvfError(f"{path} is inside the kvf store {parent}; pass the store itself")


def _create(cls, fs, root: str, path: str, meta: dict, compressor: str | None) -> None:
    meta = json.loads(json.dumps(meta))  # JSON-clean, and a copy
    meta.setdefault("dtype", "float16")
    try:
        check_dtype(meta["dtype"])
        cls.check_compressor(compressor)
    except ValueError as e:
        raise KvfError(f"cannot create store {path}: {e}") from e
    identity = {"format": cls.format, "version": FORMAT_VERSION, "meta": meta, "compressor": compressor}
    try:
        cls.write_identity(fs, root, identity)
    except OSError as e:
        raise KvfError(f"cannot create store at {path}: {e.strerror or e}; choose a writable --store path") from e
