"""The KV store on S3-compatible object storage, against real S3 endpoints on localhost (moto's standalone
server, and rclone's S3 server over a folder, started here; the tests skip with the reason if one cannot
start). The same reliability checks as the local store: round trip, verify finds corruption, gc, refused
stores, and a build-cache + run through `--store s3://...` equal to a local build. Bad endpoints, buckets
and credentials are one-line errors."""
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from rich.console import Console

from kvf.errors import KvfError
from kvf.scripts.s3_local import refused_url, start_moto, start_rclone

QUIET = Console(file=io.StringIO())
META = {"model": "m", "dtype": "float16", "layers": 2, "kv_heads": 2, "head_dim": 4}


def start_server(name: str, folder=None, extra_env=None, tls=None):
    try:
        return start_moto(extra_env, tls) if name == "moto" else start_rclone(folder)
    except RuntimeError as e:   # not installed, or it would not start here
        pytest.skip(str(e))


# two implementations: moto answers as AWS does; rclone's server (over a folder) rolls listings up only at "/"
# whatever delimiter is asked, where a store's walk once found every entry without its marker. `make test` runs
# the store against moto; the second server's pass (a minute) is `long`, run by make test-long and CI
@pytest.fixture(scope="module", params=["moto", pytest.param("rclone", marks=pytest.mark.long)])
def s3(request, tmp_path_factory):
    proc, url = start_server(request.param, tmp_path_factory.mktemp("buckets"))
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=url)
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("kvf")
    yield url
    proc.kill()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# for what does not hang on the server (Ray reaching the endpoint, writing behind, a listing faked): moto alone, to
# spare the suite
ONLY_MOTO = pytest.mark.parametrize("s3", ["moto"], indirect=True)


def kv(seed, tokens=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 2, tokens, 4, generator=g)


def test_round_trip_verify_corruption_gc_and_refusal(s3):
    from kvf.cachestore import open_store
    import s3fs
    store = open_store("s3://kvf/roundtrip", meta=META, create=True)
    keys = [("%064x" % i) for i in (1, 2, 3)]
    for i, key in enumerate(keys):
        assert store.put(key, kv(i), attrs={"variant": "prefix"})
    again = open_store("s3://kvf/roundtrip", meta=META)
    assert again.keys() == sorted(keys)
    assert torch.equal(again.get(keys[0]).float(), kv(0).half().float())
    assert again.verify() == []
    fs = s3fs.S3FileSystem()
    data_dir = again.header(keys[1]).data_dir   # the entry's data folder, named by its checksums
    layer_file = f"kvf/roundtrip/{keys[1][:2]}/{keys[1]}/{data_dir}/kv/c.1.0.0.0.0"
    data = bytearray(fs.cat_file(layer_file))
    data[3] ^= 0xFF
    fs.pipe_file(layer_file, bytes(data))                         # a flipped byte on the server
    bad = open_store("s3://kvf/roundtrip", meta=META).verify()
    assert [k for k, _ in bad] == [keys[1]] and "checksum" in bad[0][1]
    garbage, entries = again.gc_plan(keep={keys[0]})
    assert entries == sorted(keys[1:])
    again.gc(keep={keys[0]})
    assert open_store("s3://kvf/roundtrip", meta=META).keys() == [keys[0]]
    with pytest.raises(KvfError, match="holds model='m'"):
        open_store("s3://kvf/roundtrip", meta={**META, "model": "other"})


def test_a_store_opened_after_fixing_the_aws_settings_uses_the_new_ones(s3, monkeypatch, tmp_path):
    """fsspec kept one S3 filesystem per process, made with the AWS settings of the first store opened: a notebook
    that was refused (here: an endpoint nothing listens on), set the right endpoint and opened the store again was
    refused again, with the old settings."""
    from kvf.cachestore import open_store
    open_store("s3://kvf/settings", meta=META, create=True).put("%064x" % 7, kv(7))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")   # botocore's retries of the refused connection: seconds
    with refused_url() as refused, pytest.raises(KvfError, match="cannot reach the object store"):
        monkeypatch.setenv("AWS_ENDPOINT_URL", refused)
        open_store("s3://kvf/settings", meta=META)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)   # the fix the line names
    assert open_store("s3://kvf/settings", meta=META).keys() == ["%064x" % 7]
    assert open_store(f"file://{tmp_path}/local", meta=META, create=True).keys() == []   # not only S3 takes the flag


def test_an_endpoint_that_refuses_or_is_not_s3_is_named_before_any_s3_request(monkeypatch):
    """botocore and s3fs retried a refused --s3-endpoint with back-off (~20 s before the one line); a web server
    that is not S3 (a storage console's port) answers a bare 404, which read as a missing bucket, or as no store
    there. Both are named at once, the endpoint in the line; a real S3 server's missing bucket still reads as one."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer
    import s3fs
    from kvf.cachestore import open_store
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    made = []
    with refused_url() as refused, monkeypatch.context() as patched, \
            pytest.raises(KvfError, match=f"cannot reach the object store at {refused} \\(Connection refused\\)"):
        patched.setenv("AWS_ENDPOINT_URL", refused)
        patched.setattr(s3fs.S3FileSystem, "_call_s3", lambda *a, **k: made.append(a))
        open_store("s3://kvf/kv", meta=META, create=True)
    assert made == []   # refused before any S3 request (which botocore and s3fs would retry)

    class NotFound(BaseHTTPRequestHandler):   # any path: a bare 404, as a web console gives
        page = b""

        def do_GET(self):
            page = self.page
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(page)
        do_HEAD = do_PUT = do_GET

        def log_message(self, *args):
            pass
    server = HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
        # a page botocore parses as XML (with no S3 code in it), and one it cannot parse (its status is the code)
        for NotFound.page, create in ((b"<html>not here</html>", True), (b"<html>not here</html>", False),
                                      (b"Not Found", True)):
            with pytest.raises(KvfError, match=f"the endpoint http://127.0.0.1:{server.server_port} answered HTTP 404 "
                                               "without an S3 error code, so it is not an S3 server; check --s3-endpoint"):
                open_store("s3://kvf/kv", meta=META, create=create)
    finally:
        server.shutdown()


def self_signed(folder) -> tuple[str, str]:
    """(certificate, key) PEM files in folder: a certificate for 127.0.0.1 that signs itself, as a lab's MinIO has."""
    import datetime
    import ipaddress
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "kvf test S3")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_an_https_endpoint_with_a_certificate_of_its_own_is_named_with_the_fix(tmp_path, monkeypatch):
    """An S3 server over TLS whose certificate signs itself (a lab's MinIO): before, ~20 s of retries, then "cannot
    reach the object store (SSLError: ... [SSL); check --s3-endpoint ... and that the server is up", though it was
    up. Now at once, before any S3 request: the certificate is not trusted, and AWS_CA_BUNDLE is the fix. With it
    set, the store opens and keeps what is put. A bundle that does not exist, one that holds no certificate, and a
    plain-HTTP port given as https://, are each one line too."""
    import s3fs
    from kvf.cachestore import open_store
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    for name in ("AWS_CA_BUNDLE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    made = []

    def refused_before_any_request(url: str, says: str) -> None:
        with monkeypatch.context() as patched, pytest.raises(KvfError, match=says):
            patched.setenv("AWS_ENDPOINT_URL", url)
            patched.setattr(s3fs.S3FileSystem, "_call_s3", lambda *a, **k: made.append(a))
            open_store("s3://kvf/tls", meta=META, create=True)
        assert made == []

    cert, key = self_signed(tmp_path)
    proc, url = start_server("moto", tls=(cert, key))
    try:
        assert url.startswith("https://")
        refused_before_any_request(url, f"the endpoint {url} has a TLS certificate this machine does not trust "
                                        r"\(self.signed certificate\); set AWS_CA_BUNDLE to the certificate")
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.pem"))
        refused_before_any_request(url, "the CA bundle .*missing.pem .* does not exist")
        monkeypatch.setenv("AWS_CA_BUNDLE", key)   # a file, but no certificate in it
        refused_before_any_request(url, "the CA bundle .*key.pem holds no certificate in PEM form")
        monkeypatch.setenv("AWS_CA_BUNDLE", cert)   # the fix the line names
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("kvf")
        open_store("s3://kvf/tls", meta=META, create=True).put("%064x" % 5, kv(5))
        assert open_store("s3://kvf/tls", meta=META).keys() == ["%064x" % 5]
    finally:
        proc.kill()
    proc, url = start_server("moto")   # plain HTTP, given as https://
    try:
        refused_before_any_request(url.replace("http://", "https://"),
                                   "did not complete a TLS handshake .*; if it serves plain HTTP, give --s3-endpoint as http://")
    finally:
        proc.kill()


def test_missing_bucket_refused_endpoint_and_bad_credentials_are_one_line(s3, monkeypatch, request, tmp_path):
    from kvf.cachestore import open_store
    with pytest.raises(KvfError, match="bucket does not exist"):
        open_store("s3://no-such-bucket/kv", meta=META, create=True).put("%064x" % 9, kv(9))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")   # botocore's retries of the refused connection: seconds
    with refused_url() as refused, pytest.raises(KvfError, match="cannot reach the object store.*--s3-endpoint"):
        monkeypatch.setenv("AWS_ENDPOINT_URL", refused)
        open_store("s3://kvf/roundtrip", meta=META)
    if request.node.callspec.params["s3"] == "moto":
        proc, url = start_server("moto", extra_env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})   # a server that checks credentials
    else:
        (tmp_path / "kvf").mkdir()
        proc, url = start_rclone(tmp_path, "other-key", "other-secret")  # one that knows other credentials
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        with pytest.raises(KvfError, match="access denied"):
            open_store("s3://kvf/anything", meta=META, create=True)
    finally:
        proc.kill()


def test_build_cache_and_run_on_s3_equal_a_local_build(s3, tmp_path, short_docs):
    from kvf.cachestore import open_store
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(short_docs):
        (corpus / f"doc{i}.txt").write_text(text)
    torch.set_num_threads(1)
    common = dict(corpus=corpus, chunk_tokens=32, bm25=False, dense=False, dtype="float32")
    build_cache(BuildOptions(workspace=tmp_path / "local", **common), QUIET)
    build_cache(BuildOptions(workspace=tmp_path / "remote", store="s3://kvf/build", **common), QUIET)
    local, remote = open_store(str(tmp_path / "local" / "kv.zarr")), open_store("s3://kvf/build")
    assert local.keys() == remote.keys() and len(local.keys()) > 2
    for key in local.keys():
        assert np.array_equal(local.get(key).numpy(), remote.get(key).numpy())
    assert json.loads((tmp_path / "remote" / "manifest.json").read_text())["store"] == "s3://kvf/build"
    # the workspace remembers where its store is reached: a later command needs neither --store nor the
    # endpoint (before, it went to AWS itself: "cannot reach the object store ... s3.amazonaws.com")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "Where was he born?", "passages": ["doc0.txt"]}) + "\n")
    no_endpoint = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"} | {"HF_HUB_OFFLINE": "1"}
    for command in (["store", "verify", "-w", str(tmp_path / "remote")],
                    ["run", "-w", str(tmp_path / "remote"), "-q", str(questions), "-m", "reuse", "--max-new-tokens", "2",
                     "-o", str(tmp_path / "run.jsonl")]):
        proc = subprocess.run([sys.executable, "-m", "kvf", *command], capture_output=True, text=True, env=no_endpoint)
        assert proc.returncode == 0, proc.stderr
    assert "entries OK" in subprocess.run([sys.executable, "-m", "kvf", "store", "verify", "-w", str(tmp_path / "remote"),
                                           "--s3-endpoint", s3], capture_output=True, text=True, env=no_endpoint).stdout


def test_s3_without_s3fs_names_the_extra(monkeypatch):
    """kvf installed without its s3 extra: an s3:// store says which install fixes it."""
    from kvf.cachestore import open_store
    registry = sys.modules["fsspec.registry"]
    monkeypatch.setitem(sys.modules, "s3fs", None)            # import s3fs -> ImportError
    for protocol in ("s3", "s3a"):                               # registered by an earlier s3:// test
        monkeypatch.delitem(registry._registry, protocol, raising=False)
    with pytest.raises(KvfError, match=r"s3://bucket/prefix: S3 stores need s3fs; pip install 'kvf\[s3\]'"):
        open_store("s3://bucket/prefix", create=True, meta=META)


@pytest.mark.long
@ONLY_MOTO
def test_a_ray_build_reaches_the_s3_store_at_the_workspaces_endpoint(s3, tmp_path, short_docs):
    """A workspace remembers its store's endpoint, and so must the Ray workers a later build starts: they got
    the driver's environment as Ray started, before the driver read the endpoint from the manifest, and
    went to AWS itself."""
    from kvf.cachestore import open_store
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc0.txt").write_text(short_docs[0])
    torch.set_num_threads(1)
    common = dict(corpus=corpus, chunk_tokens=32, bm25=False, dense=False, dtype="float32")
    build_cache(BuildOptions(workspace=tmp_path / "ws", store="s3://kvf/ray-build", **common), QUIET)
    before = set(open_store("s3://kvf/ray-build").keys())
    (corpus / "doc1.txt").write_text(short_docs[1])
    no_endpoint = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"} | {"HF_HUB_OFFLINE": "1",
                                                                                     "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvf", "build-cache", str(corpus), "-w", str(tmp_path / "ws"),
                           "--chunk-tokens", "32", "--no-bm25", "--no-dense", "--ray", "local", "--workers", "1"],
                          capture_output=True, text=True, env=no_endpoint)
    assert proc.returncode == 0, proc.stderr
    assert len(set(open_store("s3://kvf/ray-build").keys()) - before) >= 1


def test_resuming_a_build_on_s3_asks_about_its_entries_side_by_side(s3, tmp_path, short_docs, monkeypatch):
    """Planning a build asks the store about every chunk's entry. On S3 each question asked alone is a network
    round trip (~10-30 ms on AWS: hours per million chunks), so the entries already there are asked about in one
    cat of a list per batch, never one request each. Before, each took a HEAD (has) and a GET (header), and
    listing the store a HEAD per entry; `kvf store info` a GET and a size per entry."""
    from kvf.cachestore import open_store
    from kvf.cachestore.fs import FsspecFS
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(short_docs[:2]):
        (corpus / f"doc{i}.txt").write_text(text)
    torch.set_num_threads(1)
    opts = BuildOptions(workspace=tmp_path / "ws", store="s3://kvf/plan", corpus=corpus, chunk_tokens=16, bm25=False,
                        dense=False, dtype="float32")
    build_cache(opts, QUIET)
    before = set(open_store("s3://kvf/plan").keys())
    (corpus / "doc2.txt").write_text(short_docs[2])
    alone, batches, batching = [], [], [0]   # entry markers asked about alone; sizes of lists asked at once
    for name in ("exists", "read_file"):
        original = getattr(FsspecFS, name)

        def one(self, path, *a, original=original, **kw):
            if not batching[0] and path.endswith("/zarr.json") and len(path.split("/")[-2]) == 64:
                alone.append(path.split("/")[-2])
            return original(self, path, *a, **kw)
        monkeypatch.setattr(FsspecFS, name, one)
    for name in ("read_many", "exists_many", "size_many"):
        original = getattr(FsspecFS, name)

        def many(self, paths, original=original):
            batches.append(len(paths))
            batching[0] += 1
            try:
                return original(self, paths)
            finally:
                batching[0] -= 1
        monkeypatch.setattr(FsspecFS, name, many)
    build_cache(opts, QUIET)
    after = set(open_store("s3://kvf/plan").keys())   # listing the store (kvf store info, gc) asks the same way
    info = open_store("s3://kvf/plan").info()          # and so does kvf store info, for headers and sizes
    monkeypatch.undo()
    assert info["entries"] == len(after) and info["unreadable_entries"] == 0
    assert info["bytes"] == sum(open_store("s3://kvf/plan")._entry_bytes(key) for key in after)
    assert len(before) >= 4 and after > before
    system = {key for key in before if open_store("s3://kvf/plan").attrs(key)["variant"] == "system"}
    assert len(system) == 1
    assert set(alone) & before == system       # S's entry is read alone, once; no chunk entry already there
    assert sum(batches) >= len(before - system)  # every chunk entry asked about in a list


def slowed(store, method: str = "get_layer") -> list[int]:
    """Make each call of store.<method> wait 50 ms, as a network request does, so calls that overlap show:
    returns [calls now, most at once]."""
    import threading
    lock, in_flight, original = threading.Lock(), [0, 0], getattr(store, method)

    def slow(*a, **kw):
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
        time.sleep(0.05)
        try:
            return original(*a, **kw)
        finally:
            with lock:
                in_flight[0] -= 1
    setattr(store, method, slow)
    return in_flight


def test_reading_a_prompt_from_s3_asks_side_by_side(s3, tmp_path):
    """On an object store a prompt's chunk KVs are read side by side (each read is a request that waits on the
    network; before, one after another), and the same values arrive; a local store keeps one reader. So are
    they when read again after the prefill (kvfuse's shift), once the reader threads are shut down."""
    from kvf.cachestore import open_store
    from kvf.pipeline.fusion.sources import StoreKVSource
    keys = [("%064x" % (100 + i)) for i in range(3)]
    for where in ("s3://kvf/readers", str(tmp_path / "local")):
        store = open_store(where, meta=META, create=True)
        for i, key in enumerate(keys):
            store.put(key, kv(i, tokens=4 + i))
        reader = open_store(where)
        in_flight = slowed(reader)
        source = StoreKVSource(reader, keys, n_layers=2)
        source.start([0, 1, 2])
        layers = [source.layer(layer, [0, 1, 2]) for layer in range(2)]
        source.close()
        assert source.token_counts == [4, 5, 6]
        assert all(torch.equal(layers[n][i], kv(i, tokens=4 + i)[n].half()) for n in range(2) for i in range(3))
        assert in_flight[1] == (3 if where.startswith("s3://") else 1), where
        in_flight[1] = 0
        again = source.read_again(1, [0, 1, 2])   # after the prefill, its reader threads shut down (kvfuse's shift)
        assert all(torch.equal(again[i], layers[1][i]) for i in range(3))
        assert in_flight[1] == (3 if where.startswith("s3://") else 1), ("read_again", where)


def test_verify_reads_entries_side_by_side_on_s3_and_finds_the_same(s3, tmp_path):
    """kvf store verify re-reads every layer of every entry: on S3 a request each, so entries are verified side by
    side (before, one after another: days for a million entries at 20 ms a request). It finds the same flipped
    byte as on a local store, where entries are still read one at a time."""
    from kvf.cachestore import open_store
    keys = [("%064x" % (200 + i)) for i in range(6)]
    for where in ("s3://kvf/verify", str(tmp_path / "local")):
        store = open_store(where, meta=META, create=True)
        for i, key in enumerate(keys):
            store.put(key, kv(i))
        layer_file = store.fs.join(store._data_dir(store.header(keys[3])), "kv", "c.1.0.0.0.0")
        data = bytearray(store.fs.read_file(layer_file))
        data[3] ^= 0xFF
        store.fs.write_file(layer_file, bytes(data))
        checker = open_store(where)
        in_flight = slowed(checker)
        bad = checker.verify()
        assert [key for key, _ in bad] == [keys[3]] and "checksum" in bad[0][1], where
        assert (in_flight[1] > 1) == where.startswith("s3://"), (where, in_flight)


def test_a_prompts_extras_are_read_side_by_side_on_s3(s3, tmp_path):
    """Cache-Craft's build-time extras are read for every chunk of a prompt before it is answered: on S3 side by
    side (before, one request after another), locally one after another; the same arrays either way."""
    from kvf.cachestore import open_store
    keys = [("%064x" % (300 + i)) for i in range(4)]
    for where in ("s3://kvf/extras", str(tmp_path / "local")):
        store = open_store(where, meta=META, create=True)
        for i, key in enumerate(keys):
            store.put(key, kv(i), extras={"score": np.arange(3.0) + i})
        reader = open_store(where)
        in_flight = slowed(reader, "get_extras")
        got = reader.get_extras_many(keys)
        assert all(np.array_equal(g["score"], np.arange(3.0) + i) for i, g in enumerate(got))
        assert (in_flight[1] > 1) == where.startswith("s3://"), (where, in_flight)


@ONLY_MOTO
def test_a_build_on_s3_computes_the_next_chunk_while_an_entry_is_written(s3, tmp_path, short_docs, monkeypatch):
    """An entry's write to an object store is mostly waiting on the network, so build-cache stores each entry on a
    background thread while it computes the next chunk (EntryBuilder.writing_behind); into a local store on the
    CPU, it writes inline. Before, on S3 every chunk's compute waited for the last entry's write."""
    import threading
    from kvf.cachestore.zarr_store import ZarrKVStore
    from kvf.pipeline.fusion.engine import FusionEngine
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(short_docs[:2]):
        (corpus / f"doc{i}.txt").write_text(text)
    torch.set_num_threads(1)
    events, lock = [], threading.Lock()
    real_put, real_chunk_kv = ZarrKVStore.put, FusionEngine.chunk_kv

    def put(self, *a, **kw):
        with lock:
            events.append(+1)
        time.sleep(0.1)
        try:
            return real_put(self, *a, **kw)
        finally:
            with lock:
                events.append(-1)

    def chunk_kv(self, *a, **kw):
        with lock:
            events.append(0)
        return real_chunk_kv(self, *a, **kw)
    monkeypatch.setattr(ZarrKVStore, "put", put)
    monkeypatch.setattr(FusionEngine, "chunk_kv", chunk_kv)
    overlapped = {}
    for where, store in (("s3", "s3://kvf/behind"), ("local", None)):
        events.clear()
        build_cache(BuildOptions(workspace=tmp_path / where, store=store, corpus=corpus, chunk_tokens=16, bm25=False,
                                 dense=False, dtype="float32"), QUIET)
        depth, overlapped[where] = 0, 0
        for event in events:
            depth += event
            overlapped[where] += event == 0 and depth > 0
        assert events.count(-1) >= 4
    assert overlapped["s3"] > 0 and overlapped["local"] == 0


def test_an_entrys_files_are_written_side_by_side_on_s3_and_its_marker_last(s3, monkeypatch):
    """An entry is 30 layer files plus metadata: on S3 a PUT each, so they go side by side (fsspec's pipe of a
    dict); before, one after another (about 0.6 s an entry at 20 ms a request). The commit marker is still
    written alone, after every data file has landed, so a reader never sees a marker without its data."""
    import asyncio
    from kvf.cachestore import open_store
    from kvf.cachestore.fs import FsspecFS
    store = open_store("s3://kvf/writes", meta=META, create=True)
    key, value = "%064x" % 400, kv(7)
    in_flight, landed, marker_seen = [0, 0], [], []
    real_pipe_file, real_write_file = store.fs.fs._pipe_file, FsspecFS.write_file

    async def pipe_file(path, data, *a, **kw):
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        await asyncio.sleep(0.05)
        try:
            return await real_pipe_file(path, data, *a, **kw)
        finally:
            in_flight[0] -= 1
            landed.append(path)

    def write_file(self, path, data):
        if path.endswith(f"{key}/zarr.json"):
            marker_seen.append((len(landed), in_flight[0]))
        return real_write_file(self, path, data)
    monkeypatch.setattr(store.fs.fs, "_pipe_file", pipe_file)
    monkeypatch.setattr(FsspecFS, "write_file", write_file)
    assert store.put(key, value, extras={"score": np.arange(3.0)})
    layers = META["layers"]
    assert in_flight[1] > 1                                       # side by side
    assert sum("/kv/c." in path for path in landed) == layers     # every layer in the batch
    assert marker_seen == [(len(landed), 0)]                      # the marker after all of them, alone
    monkeypatch.undo()
    reread = open_store("s3://kvf/writes")
    assert torch.equal(reread.get(key), value.to(torch.float16)) and reread.verify() == []
    assert np.array_equal(reread.get_extras(key)["score"], np.arange(3.0))


def entry_folders(store, key: str) -> list[str]:
    """What an entry's folder on S3 holds, by name."""
    return sorted(path.rsplit("/", 1)[-1] for path in store.fs.fs.ls(store._entry_dir(key), refresh=True))


@pytest.mark.parametrize("theirs_when", ["before my marker", "after my data"])
def test_two_writers_of_one_entry_on_s3_never_mix_their_files(s3, theirs_when):
    """Two builds of one store at once can reach an entry together where they meet. On S3 each wrote the entry's
    files in place, so with other bits (another thread count) the entry ended with one writer's layers under the
    other's checksums: corrupt. Each writer's files now go into a folder named by their checksums, which the marker
    names. However the two interleave, the entry is one writer's whole; a writer that finds the other's marker
    already there removes its own files; with the same bits both write the same files."""
    from kvf.cachestore import open_store
    key = "%064x" % 4242
    for mine, theirs in ((kv(1), kv(2)), (kv(3), kv(3))):
        where = f"s3://kvf/race-{theirs_when.replace(' ', '-')}-{torch.equal(mine, theirs)}"
        me, other = open_store(where, meta=META, create=True), open_store(where, meta=META, create=True)
        step = "write_file" if theirs_when == "before my marker" else "write_many"
        real = getattr(me.fs, step)

        def interleaved(*args, real=real, theirs=theirs, other=other):
            if step == "write_many":
                real(*args)
            if step == "write_many" or args[0].endswith(f"{key}/zarr.json"):
                assert other.put(key, theirs)            # the other writer, whole, in between
            if step == "write_file":
                real(*args)
        setattr(me.fs, step, interleaved)
        committed = me.put(key, mine)
        reread = open_store(where)
        assert reread.verify() == [], (theirs_when, reread.verify())
        assert committed == (theirs_when == "before my marker")   # mine found no marker, or theirs stands
        kept = mine if committed else theirs
        assert torch.equal(reread.get(key), kept.half())
        folders = entry_folders(reread, key)
        assert reread.header(key).data_dir in folders and "zarr.json" in folders
        # files no marker named are gone, unless theirs was overwritten by mine (both had found no marker)
        assert len(folders) == (3 if committed and not torch.equal(mine, theirs) else 2), folders


def test_gc_removes_the_data_folder_no_marker_names_once_it_is_old(s3, tmp_path):
    """When two writers of one entry with other bits both find no marker, the last marker stands and the other
    writer's data folder stays in the entry, named by nothing. gc never looked inside a committed entry, so that
    folder stayed until the entry went. The walk's listing shows an entry's data folders for free: gc now asks the
    marker of each entry that holds more than one, and removes the folders it does not name once they are older
    than the grace period (a writer that lost to another's marker removes its own meanwhile). The entry still
    reads and verifies; an entry written before data folders keeps its own kv/; a damaged marker keeps its data."""
    from kvf.cachestore import open_store
    key, older, damaged, plain = "%064x" % 4545, "%064x" % 4646, "%064x" % 4747, "%064x" % 4848
    me, other = open_store("s3://kvf/unnamed", meta=META, create=True), open_store("s3://kvf/unnamed", meta=META, create=True)
    real = me.fs.write_file

    def theirs_first(path, data):   # both wrote their data and found no marker; theirs lands, then mine over it
        if path.endswith(f"{key}/zarr.json"):
            assert other.put(key, kv(2))
        return real(path, data)
    me.fs.write_file = theirs_first
    assert me.put(key, kv(1))
    me.fs.write_file = real
    assert me.put(plain, kv(3))
    # an entry written before data folders (its data in its own kv/), with a writer's folder left beside it
    local = open_store(str(tmp_path / "local"), meta=META, create=True)
    local.put(older, kv(4))
    me.fs.fs.put(local._entry_dir(older), me._entry_dir(older), recursive=True)
    me.fs.fs.copy(me._entry_dir(key), me._entry_dir(damaged), recursive=True)
    for entry in (older, damaged):
        me.fs.write_file(me.fs.join(me._entry_dir(entry), "d-0123456789abcdef", "zarr.json"), b"{}")
    me.fs.write_file(me.fs.join(me._entry_dir(damaged), "zarr.json"), b"not json")
    store = open_store("s3://kvf/unnamed")
    named = store.header(key).data_dir
    assert len(entry_folders(store, key)) == 3                            # mine, theirs, the marker
    asked, real_read_many = [], store.fs.read_many
    store.fs.read_many = lambda paths: asked.extend(paths) or real_read_many(paths)
    assert store.gc() == {"garbage_removed": 0, "entries_removed": 0, "bytes_freed": 0}   # young: left alone
    assert sorted(p.split("/")[-2] for p in asked) == sorted([key, older, damaged])   # no other marker asked
    assert store.info()["temp_items"] == 2
    freed = store.gc(grace_s=0.0)
    assert freed["garbage_removed"] == 2 and freed["entries_removed"] == 0 and freed["bytes_freed"] > 0
    again = open_store("s3://kvf/unnamed")
    assert entry_folders(again, key) == sorted([named, "zarr.json"])
    assert entry_folders(again, older) == ["kv", "zarr.json"]
    assert "d-0123456789abcdef" in entry_folders(again, damaged)
    assert torch.equal(again.get(key), kv(1).half()) and torch.equal(again.get(older), kv(4).half())
    assert [k for k, _ in again.verify()] == [damaged] and again.info()["temp_items"] == 0


def test_a_failed_write_on_s3_is_untrusted_and_its_retry_lands_on_the_same_files(s3, monkeypatch):
    """A write cut off before its marker (a dropped connection, a killed worker) leaves its data unmarked: never an
    entry, and gc's after the grace period. The retry writes the same bits into the same folder, so it leaves no
    second copy behind in the entry it commits."""
    from kvf.cachestore import open_store
    key = "%064x" % 4343
    store = open_store("s3://kvf/retry", meta=META, create=True)
    real = store.fs.write_file

    def cut_off(path, data):
        if path.endswith(f"{key}/zarr.json"):
            raise ConnectionResetError("connection reset by peer")
        return real(path, data)
    monkeypatch.setattr(store.fs, "write_file", cut_off)
    with pytest.raises(KvfError):
        store.put(key, kv(5))
    monkeypatch.undo()
    again = open_store("s3://kvf/retry")
    assert not again.has(key) and [k for k, _ in again.verify()] == [key]   # reported unfinished, not read
    assert again.put(key, kv(5)) and again.verify() == []
    assert torch.equal(again.get(key), kv(5).half())
    assert entry_folders(again, key) == sorted([again.header(key).data_dir, "zarr.json"])


def test_an_s3_entry_written_in_place_before_data_folders_still_reads(s3, tmp_path):
    """Entries written on S3 before data folders existed hold their data in the entry's own folder, as a local
    entry does, and a header without data_dir: they read and verify as they did."""
    from kvf.cachestore import open_store
    key = "%064x" % 4444
    local = open_store(str(tmp_path / "local"), meta=META, create=True)
    local.put(key, kv(6), extras={"score": np.arange(2.0)})
    remote = open_store("s3://kvf/older", meta=META, create=True)
    remote.fs.fs.put(local._entry_dir(key), remote._entry_dir(key), recursive=True)
    older = open_store("s3://kvf/older")
    assert older.header(key).data_dir is None and older.verify() == []
    assert torch.equal(older.get(key), kv(6).half()) and np.array_equal(older.get_extras(key)["score"], np.arange(2.0))


def test_listing_a_store_on_s3_lists_its_fanout_directories_side_by_side(s3, tmp_path):
    """A store's keys spread over 256 fan-out directories, and listing it (`kvf store info`, `verify`, `gc`) lists
    each: on S3 a request each, so they are listed side by side (before, one after another: 256 round trips per
    walk). Locally they are listed one at a time. Both find every key."""
    import hashlib
    from kvf.cachestore import open_store
    keys = sorted(hashlib.sha256(f"fan-{i}".encode()).hexdigest() for i in range(40))
    assert len({key[:2] for key in keys}) > 20
    for where in ("s3://kvf/fanout", str(tmp_path / "local")):
        store = open_store(where, meta=META, create=True)
        for i, key in enumerate(keys):
            store.put(key, kv(i, tokens=1))
        lister = open_store(where)
        in_flight = slowed(lister.fs, "names_marked")   # a fan-out directory's walk
        assert lister.keys() == keys, where
        assert (in_flight[1] > 1) == where.startswith("s3://"), (where, in_flight)


def test_walking_an_s3_store_lists_objects_and_asks_nothing_per_entry(s3, tmp_path):
    """A walk (`kvf store info`, `verify`, `gc`, a build's resume check) asked S3 for each entry's commit marker, a
    request per entry (a million for a million-chunk store); it now reads the markers off one paged listing of each
    fan-out directory, with each entry's layer files rolled up (`/kv/` as the delimiter). It finds what per-entry
    questions found: committed entries, an unfinished one, a stray file, each as a local store sees the same files."""
    from kvf.cachestore import open_store
    keys = [("%064x" % (900 + i)) for i in range(6)]
    found = {}
    for where in ("s3://kvf/markers", str(tmp_path / "local")):
        store = open_store(where, meta=META, create=True)
        for i, key in enumerate(keys):
            store.put(key, kv(i, tokens=1))
        unfinished, fan = "%064x" % 901_000, store.fs.join(store.root, keys[0][:2])
        store.fs.makedirs(store.fs.join(store._entry_dir(unfinished), "kv"))
        store.fs.write_file(store.fs.join(store._entry_dir(unfinished), "kv", "c.0.0.0.0.0"), b"\0" * 8)
        store.fs.write_file(store.fs.join(fan, "stray"), b"x")
        walker = open_store(where)
        asked = []
        real_exists = walker.fs.exists
        walker.fs.exists = lambda path: asked.append(path) or real_exists(path)
        found[where] = sorted(walker._walk_entries())
        assert walker.keys() == keys
        if where.startswith("s3://"):
            assert asked == [], asked[:3]
            # a listing with another delimiter is no directory's listing: s3fs's directory cache never holds it
            assert not [path for path in walker.fs.fs.dircache if path.startswith("kvf/markers/")], list(walker.fs.fs.dircache)
    strip = lambda walk, root: [(key, None if d is None else d[len(root):].lstrip("/\\").replace("\\", "/"), ok, folders)
                                for key, d, ok, folders in walk]
    assert strip(found["s3://kvf/markers"], "kvf/markers") == strip(found[str(tmp_path / "local")], str(tmp_path / "local"))
    assert ("stray", False) in {(key, ok) for key, _, ok, _ in found[str(tmp_path / "local")]}


@ONLY_MOTO
def test_a_walk_lists_through_public_calls_only(s3, monkeypatch):
    """The rolled-up listing rested on s3fs's private `_iterdir` (a later s3fs that took other arguments raised
    TypeError out of every walk, and its own paging loops on a repeated token). It lists through s3fs's S3 client
    and botocore's paginator now: with s3fs's paged listings gone, the walk finds the same, asking nothing per entry."""
    from kvf.cachestore import open_store
    from kvf.cachestore.fs import FsspecFS
    keys = [("%064x" % (950 + i)) for i in range(3)]
    store = open_store("s3://kvf/changed-listing", meta=META, create=True)
    for i, key in enumerate(keys):
        store.put(key, kv(i, tokens=1))
    rolled_up = sorted(open_store("s3://kvf/changed-listing")._walk_entries())
    walker = open_store("s3://kvf/changed-listing")

    def gone(*a, **kw):
        raise TypeError("a later s3fs's private listing")
    for private in ("_iterdir", "_list_pages"):
        monkeypatch.setattr(walker.fs.fs, private, gone)
    monkeypatch.setattr(FsspecFS, "exists", lambda *a, **kw: pytest.fail("a question per entry"))
    # s3fs lists the fan-out level itself, privately: those directories are given
    monkeypatch.setattr(FsspecFS, "listdir", lambda self, path: sorted({k[:2] for k in keys}))
    assert sorted(walker._walk_entries()) == rolled_up and walker.keys() == keys


@ONLY_MOTO
@pytest.mark.parametrize("server", ["repeats its token (MinIO)", "repeats its page", "does not implement it"])
def test_a_walk_lists_every_key_where_the_server_does_not_take_the_kv_delimiter(s3, monkeypatch, server):
    """S3 rolls keys up at any delimiter; MinIO answers a listing with another than "/" with the same page and its
    token again and again (botocore's paginator stops that with a PaginationError; s3fs's own paging listed for
    ever), and some servers answer 501. The walk then lists every key (delimiter none) and finds the same entries,
    with no question per entry."""
    from botocore.exceptions import ClientError, PaginationError
    from kvf.cachestore import open_store
    from kvf.cachestore.fs import FsspecFS
    keys = [("%064x" % (960 + i)) for i in range(3)]
    store = open_store("s3://kvf/odd-delimiter", meta=META, create=True)
    for i, key in enumerate(keys):
        store.put(key, kv(i, tokens=1))
    walker = open_store("s3://kvf/odd-delimiter")
    own, pages = FsspecFS._list_pages, []

    async def odd(self, bucket, prefix, delimiter):
        if delimiter in ("/", ""):
            async for page in own(self, bucket, prefix, delimiter):
                yield page
            return
        if server == "does not implement it":
            raise ClientError({"Error": {"Code": "NotImplemented", "Message": "only / is a delimiter"}}, "ListObjectsV2")
        async for page in own(self, bucket, prefix, delimiter):
            for _ in range(10_000):   # the same page again and again
                pages.append(prefix)
                if server == "repeats its token (MinIO)" and pages.count(prefix) > 1:
                    raise PaginationError(message="The same next token was received twice")
                yield page
    monkeypatch.setattr(FsspecFS, "_list_pages", odd)
    monkeypatch.setattr(FsspecFS, "exists", lambda *a, **kw: pytest.fail("a question per entry"))
    assert walker.keys() == keys
    assert len(pages) <= 2 * len(set(pages))   # each listing left at its first page seen again


def test_info_gc_and_verify_walk_an_s3_store_once(s3, tmp_path):
    """`kvf store info`, `gc` and `verify` each ask for the committed entries and the unfinished ones. On S3 a walk of
    the store is a listing per fan-out directory, so one walk answers both (before, each command walked twice).
    The answers are those of two walks: an unfinished entry is still found."""
    import hashlib
    from kvf.cachestore import open_store
    keys = sorted(hashlib.sha256(f"walk-{i}".encode()).hexdigest() for i in range(12))
    store = open_store("s3://kvf/walk", meta=META, create=True)
    for i, key in enumerate(keys):
        store.put(key, kv(i, tokens=1))
    unfinished = "%064x" % 77   # an entry's data without its marker (a writer killed mid-put)
    store.fs.write_file(store.fs.join(store._entry_dir(unfinished), "kv", "c.0.0.0.0.0"), b"\0" * 8)
    fans = {key[:2] for key in keys + [unfinished]}
    for command in ("info", "verify", "gc"):
        walker = open_store("s3://kvf/walk")
        listed, real_walk = [], walker.fs.names_marked
        walker.fs.names_marked = lambda path, marker, bulk=None: listed.append(path.rstrip("/").rsplit("/", 1)[-1]) or real_walk(path, marker, bulk)
        if command == "info":
            info = walker.info()
            assert info["entries"] == len(keys) and info["temp_items"] == 1
        elif command == "verify":
            assert [key for key, _ in walker.verify()] == [unfinished]
        else:
            garbage, entries = walker.gc_plan(keep=set(keys[:2]), grace_s=0.0)
            assert len(garbage) == 1 and unfinished in garbage[0] and entries == keys[2:]
        walked = [name for name in listed if name in fans]
        assert sorted(walked) == sorted(fans), (command, walked)   # each fan-out directory listed once


def test_gc_removes_entries_side_by_side_on_s3_and_frees_the_same(s3, tmp_path):
    """`kvf store gc --keep ...` removes every entry not kept: on S3 each removal is requests (the marker, then the
    data), so entries go side by side (before, one after another); locally one at a time. Either way it removes
    and counts the same entries and bytes, and keeps the others readable."""
    from kvf.cachestore import open_store
    keys = [("%064x" % (500 + i)) for i in range(8)]
    freed = {}
    for where in ("s3://kvf/gc", str(tmp_path / "local")):
        store = open_store(where, meta=META, create=True)
        for i, key in enumerate(keys):
            store.put(key, kv(i))
        sizes = {key: store._entry_bytes(key) for key in keys}
        collector = open_store(where)
        in_flight = slowed(collector, "delete")
        freed[where] = collector.gc(keep=set(keys[:3]), grace_s=0.0)
        assert freed[where] == {"garbage_removed": 0, "entries_removed": 5, "bytes_freed": sum(sizes[k] for k in keys[3:])}
        assert open_store(where).keys() == keys[:3] and open_store(where).verify() == []
        assert (in_flight[1] > 1) == where.startswith("s3://"), (where, in_flight)


def test_the_latency_proxy_ends_its_connections_when_it_closes(caplog, recwarn):
    """A connection still open when the latency proxy (bench_s3's) closes ends with it: no task is left pending on
    its stopped loop, which the garbage collector would report later, in whichever test runs then."""
    import gc
    import socket
    from kvf.scripts.s3_local import LatencyProxy
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    with LatencyProxy(f"http://127.0.0.1:{server.getsockname()[1]}", 5) as url:
        client = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        client.send(b"x")
        time.sleep(0.3)
    gc.collect()
    client.close()
    server.close()
    assert "Task was destroyed" not in caplog.text and "Exception in callback" not in caplog.text
    assert not [w for w in recwarn if "Unraisable" in type(w.message).__name__], [str(w.message) for w in recwarn]


def sign_stale_once(monkeypatch, which) -> list[int]:
    """The first request `which(request)` picks is signed 20 minutes before it reaches the server, as when the
    host pauses between signing and sending; returns [requests still to sign stale] (0 once it was sent)."""
    import datetime

    import botocore.auth
    real_now, real_add_auth, stale = botocore.auth.get_current_datetime, botocore.auth.SigV4Auth.add_auth, [1]

    def add_auth(self, request):
        if stale[0] and which(request):
            stale[0] -= 1
            monkeypatch.setattr(botocore.auth, "get_current_datetime",
                                lambda: real_now() - datetime.timedelta(minutes=20))
            try:
                return real_add_auth(self, request)
            finally:
                monkeypatch.setattr(botocore.auth, "get_current_datetime", real_now)
        return real_add_auth(self, request)
    monkeypatch.setattr(botocore.auth.SigV4Auth, "add_auth", add_auth)
    return stale


@pytest.mark.parametrize("s3", [pytest.param("rclone", marks=pytest.mark.long)], indirect=True)
def test_a_request_signed_before_the_host_paused_is_signed_again(s3, monkeypatch):
    """A request signed, then held up past the server's allowed clock difference (the host slept or its VM paused:
    CI once lost an hour that way mid-put) is refused as "request time too skewed"; the store signs it again with
    the time now and sends it once more: a write (through s3fs's retries) and a listing (through botocore's
    paginator). rclone's server checks a request's time (moto does not). Before, the put failed: could not write
    entry ...: The difference between the request time and the server's time exceeds the maximum allowed."""
    from kvf.cachestore import open_store
    store, key = open_store("s3://kvf/paused", meta=META, create=True), "%064x" % 400
    stale = sign_stale_once(monkeypatch, lambda request: request.method == "PUT")
    assert store.put(key, kv(4))
    assert stale == [0]   # the stale signature was sent, and refused
    # the entries' listing (FsspecFS.names_marked's, with /kv/ as the delimiter), sent by botocore's paginator
    stale = sign_stale_once(monkeypatch, lambda request: "delimiter=%2Fkv%2F" in request.url)
    reader = open_store("s3://kvf/paused")
    assert reader.keys() == [key] and stale == [0]
    assert torch.equal(reader.get(key), kv(4).half())


def test_only_a_refusal_for_the_signing_time_is_resent(monkeypatch):
    """What counts as signed too long ago: AWS's code (RequestTimeTooSkewed) and rclone's AccessDenied that says so;
    not another AccessDenied (wrong keys are refused at once), nor other errors. A handler set in s3fs before kvf's
    is still asked."""
    import s3fs.core
    from botocore.exceptions import ClientError
    from kvf.cachestore.fs import resend_stale_signatures, signed_too_long_ago

    def refused(code, message):
        return ClientError({"Error": {"Code": code, "Message": message}}, "PutObject")
    assert signed_too_long_ago(refused("RequestTimeTooSkewed", "The difference between the request time and the "
                                       "current time is too large."))
    assert signed_too_long_ago(refused("AccessDenied", "The difference between the request time and the server's "
                                       "time exceeds the maximum allowed."))
    assert not signed_too_long_ago(refused("AccessDenied", "Access Denied"))
    assert not signed_too_long_ago(refused("SignatureDoesNotMatch", "The request signature we calculated does not match"))
    assert not signed_too_long_ago(PermissionError("The difference between the request time and the current time"))
    monkeypatch.setattr(s3fs.core, "CUSTOM_ERROR_HANDLER", lambda e: isinstance(e, KeyError))  # a user's own
    resend_stale_signatures()
    handler = s3fs.core.CUSTOM_ERROR_HANDLER
    assert handler(refused("RequestTimeTooSkewed", "")) and handler(KeyError()) and not handler(refused("AccessDenied", ""))
    resend_stale_signatures()   # once per process, however many stores are opened
    assert s3fs.core.CUSTOM_ERROR_HANDLER is handler


def server_of_its_own(monkeypatch, tmp_path, docs):
    """(process, url, corpus folder): a moto server this test may stop, the AWS settings pointing at it (a refused
    connection tried once), its bucket `kvf`, and a corpus of docs."""
    import s3fs
    proc, url = start_server("moto")
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_ENDPOINT_URL", url), ("AWS_MAX_ATTEMPTS", "1")):
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("kvf")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(docs):
        (corpus / f"doc{i}.txt").write_text(text)
    return proc, url, corpus


def test_an_endpoint_that_stops_answering_mid_build_is_one_line(tmp_path, short_docs, capsys, monkeypatch):
    """The S3 server went down while build-cache wrote its entries: "kvf: internal error: EndpointConnectionError:
    Could not connect to the endpoint URL ... (please report it; re-run with --debug for the traceback)". Now one
    line: the endpoint cannot be reached, the fix, and that a re-run resumes. A local failure is still a file's."""
    from conftest import assert_one_line, run_cli
    from kvf.cachestore import remote_failure
    from kvf.cachestore.zarr_store import ZarrKVStore
    proc, url, corpus = server_of_its_own(monkeypatch, tmp_path, short_docs)
    real_put, puts = ZarrKVStore.put, []

    def put(self, *a, **kw):   # the server goes down as the build stores its second chunk
        puts.append(1)
        if len(puts) == 2:
            proc.kill()
            proc.wait()
        return real_put(self, *a, **kw)
    monkeypatch.setattr(ZarrKVStore, "put", put)
    torch.set_num_threads(1)
    try:
        code, _, err = run_cli(["build-cache", corpus, "-w", tmp_path / "ws", "--store", "s3://kvf/ws",
                                "--chunk-tokens", "32", "--no-bm25", "--no-dense"], capsys, monkeypatch)
    finally:
        proc.kill()
    assert len(puts) >= 2
    assert_one_line(code, err, "kvf: error: cannot reach the object store (", url,
                    "check --s3-endpoint (or AWS_ENDPOINT_URL) and that the server is up; a re-run resumes")
    assert remote_failure(PermissionError(13, "Permission denied", str(tmp_path))) is None   # a local file's: its own line


def test_an_expired_session_token_names_its_renewal():
    from botocore.exceptions import ClientError
    from kvf.cachestore import remote_failure
    expired = ClientError({"Error": {"Code": "ExpiredToken", "Message": "The provided token has expired."}}, "PutObject")
    assert remote_failure(expired).startswith("the AWS session token has expired (ClientError: An error occurred "
                                              "(ExpiredToken)")
    assert "renew the credentials (AWS_SESSION_TOKEN, or `aws sso login`" in remote_failure(expired)


def test_a_notebooks_answer_whose_store_stopped_answering_is_a_kvf_error(tmp_path, short_docs, monkeypatch):
    """kvf.open_workspace(...).answer on an S3 store whose server went down after it opened raised botocore's own
    EndpointConnectionError; it is a KvfError, the same line the CLI gives."""
    import kvf
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    proc, url, corpus = server_of_its_own(monkeypatch, tmp_path, short_docs)
    try:
        torch.set_num_threads(1)
        build_cache(BuildOptions(corpus=corpus, workspace=tmp_path / "ws", store="s3://kvf/api", chunk_tokens=32,
                                 bm25=False, dense=False), QUIET)
        ws = kvf.open_workspace(tmp_path / "ws")
        assert ws.answer("Where was Zorvan Pellick born?", method="reuse", documents=["doc0.txt"], max_new_tokens=2).text
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(KvfError, match=f"cannot reach the object store .*{url}.*; check --s3-endpoint"):
        ws.answer("Where was Zorvan Pellick born?", method="reuse", documents=["doc1.txt"], max_new_tokens=2)
    ws.close()
