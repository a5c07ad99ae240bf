"""What a store on S3 costs in round trips: planning a build (is each chunk's entry there?) and loading a
prompt's chunk KVs, with the requests sent one after another (kvf before) and side by side (now).

    python -m kvf.scripts.bench_s3 [--rtt-ms 0,20] [--repeats 3] [--entries 1000] [--chunks 20] [--build-chunks 8]
                                   [--out results/s3.md]

The endpoint is moto's S3 server on localhost, reached directly (RTT 0: what moto itself costs, on the
same 2 cores as the client) and through a proxy that adds a fixed round trip to every request (in-region
S3 answers a small GET in roughly 10-30 ms; a store across regions, more). Both ways ask the same store
the same questions and get the same answers (checked here); each is timed --repeats times, in alternation,
and the median is reported.

- planning: --entries chunk entries asked about, half of them present (a build resumed halfway). Before, each
  was one HEAD (has) and, when present, one GET of its header; now the store's headers() asks for every
  entry's header in one fsspec cat of a list.
- listing (`kvf store info`, `verify`, `gc`): the committed entries of that store, their keys spread over the
  256 fan-out directories as content hashes are. Before, each fan-out directory listed and then each entry's
  commit marker asked (a HEAD), one after another; now one paged listing of each fan-out directory's objects
  with `/kv/` as the delimiter (each entry's layer files rolled up into one prefix, its marker read off the
  listing: no request per entry), FANOUT_BATCH directories side by side. "listing vs HEADs" times the same
  listing against the way just before it: the fan-out directories listed, then the markers asked with a HEAD
  each, MARKER_BATCH at a time, both side by side.
- loading: one prompt's --chunks chunks of 256 tokens in SmolLM2-135M's shape (30 layers, 3 KV heads of 64,
  float16: 5.9 MB an entry), every layer read through StoreKVSource with the engine doing nothing
  else: the load a request would wait for if compute were free. Before, one reader thread; now
  REMOTE_READERS.
- building: build-cache's KV stage, --build-chunks chunks of 256 random tokens whose entries the embedded model
  (SmolLM2-135M, float32 on this CPU) computes into a fresh store each run. Before, each entry's files were
  written one after another, and before the next chunk was computed; now they go side by side (the store's
  write_many), on a background thread while the next chunk is computed (EntryBuilder.writing_behind). Both ways
  must store the same keys and bytes (checked).

Nothing is asserted: the ratios are the result.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import types
from contextlib import contextmanager

import torch
from rich.table import Table

from kvf.cachestore.base import STAGING
from kvf.pipeline.workflows.display import output_console

META = {"model": "bench-s3", "dtype": "float16", "layers": 30, "kv_heads": 3, "head_dim": 64}
CHUNK_TOKENS = 256


def key_of(i: int) -> str:
    """A content hash's shape: spread over the store's 256 fan-out directories, as a real store's keys are."""
    return hashlib.sha256(f"bench-{i}".encode()).hexdigest()


@contextmanager
def endpoint(url: str):
    """s3fs clients made from here on go to url (s3fs caches one client per process: drop it)."""
    import s3fs
    before = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = url
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        if before is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = before


def fill(url: str, entries: int, chunks: int, console) -> None:
    """The two stores, written straight to moto (no proxy): tiny entries to plan over, a prompt's to load."""
    from kvf.cachestore import open_store
    with endpoint(url):
        import s3fs
        s3fs.S3FileSystem().mkdir("bench")
        plan = open_store("s3://bench/plan", meta=META, create=True)
        load = open_store("s3://bench/load", meta=META, create=True)
        with console.status("writing the stores to moto"):
            for i in range(entries // 2):   # 2 tokens: the header is the same size whatever the entry holds
                plan.put(key_of(i), torch.zeros(30, 2, 3, 2, 64))
            for i in range(chunks):
                load.put(key_of(i), torch.randn(30, 2, 3, CHUNK_TOKENS, 64, generator=torch.Generator().manual_seed(i)))


def plan_one_by_one(store, keys) -> dict:
    return {key: store.header(key) for key in keys if store.has(key)}


def plan_side_by_side(store, keys) -> dict:
    return store.headers(keys)


def list_one_by_one(store) -> list[str]:
    """kvf's listing before: each fan-out directory listed, then each entry's commit marker asked, in turn."""
    fs, found = store.fs, []
    for fan in fs.listdir(store.root):
        if len(fan) != 2 or fan == STAGING:
            continue
        for name in fs.listdir(fs.join(store.root, fan)):
            if name != "zarr.json" and fs.exists(fs.join(store.root, fan, name, "zarr.json")):
                found.append(name)
    return sorted(found)


MARKER_BATCH = 1024   # markers asked at once by the listing before the rolled-up one


def list_markers_side_by_side(store) -> list[str]:
    """kvf's listing just before the rolled-up one: the fan-out directories listed side by side, then each
    entry's commit marker asked with a HEAD, MARKER_BATCH at a time, side by side."""
    fs = store.fs
    fans = [fs.join(store.root, fan) for fan in fs.listdir(store.root) if len(fan) == 2 and fan != STAGING]
    dirs = [fs.join(fan, name) for fan, names in zip(fans, fs.each(fs.listdir, fans)) for name in names if name != "zarr.json"]
    found = []
    for start in range(0, len(dirs), MARKER_BATCH):
        batch = dirs[start: start + MARKER_BATCH]
        found += [d.rsplit("/", 1)[-1] for d, ok in zip(batch, fs.exists_many([fs.join(d, "zarr.json") for d in batch])) if ok]
    return sorted(found)


def load(store, chunks: list[int], readers: int | None) -> list:
    from kvf.pipeline.fusion.sources import StoreKVSource
    source = StoreKVSource(store, [key_of(i) for i in chunks], META["layers"], pipeline=True, readers=readers)
    source.start(chunks)
    try:
        return [source.layer(layer, chunks) for layer in range(META["layers"])]
    finally:
        source.close()


class Building:
    """build-cache's KV stage on S3, through EntryBuilder: the embedded model and the chunks, made once; each run
    builds every chunk's entry (and S's) into a fresh store, kvf's way now or before."""

    def __init__(self, n_chunks: int):
        from kvf.pipeline.fusion.engine import FusionEngine
        from kvf.pipeline.model.forward import Transformer
        from kvf.pipeline.retrieval.chunking import Chunk
        from kvf.pipeline.workflows.weights import open_model
        self.model_ref = open_model(None)
        self.engine = FusionEngine(Transformer(self.model_ref.load("cpu", torch.float32).model))
        g, vocab = torch.Generator().manual_seed(0), self.engine.model.config.vocab_size
        self.chunks = [Chunk(f"bench-{i}", "bench", "", "", torch.randint(0, vocab, (CHUNK_TOKENS,), generator=g).tolist(), i)
                       for i in range(n_chunks)]
        self.paths: dict[bool, list[str]] = {False: [], True: []}

    def run(self, url: str, now: bool) -> float:
        """Seconds to build every entry into a fresh store on a fresh client: kvf's way now, or before."""
        from kvf.cachestore import open_store
        from kvf.cachestore.fs import ManyPaths
        from kvf.pipeline.workflows.build import EntryBuilder, store_meta
        path = f"s3://bench/build-{len(self.paths[False]) + len(self.paths[True])}"
        self.paths[now].append(path)
        with endpoint(url):
            store = open_store(path, meta=store_meta(self.model_ref, "float16"), create=True)
            if not now:   # before: an entry's files one after another
                store.fs.write_many = types.MethodType(ManyPaths.write_many, store.fs)
            builder = EntryBuilder(self.model_ref, store, "cpu", engine=self.engine)
            started = time.perf_counter()
            with builder.writing_behind(now):
                builder.system_kv()
                for chunk in self.chunks:
                    builder.compute("prefix", chunk, None, {})
            return time.perf_counter() - started

    def check_same(self, url: str) -> None:
        """Every store built either way holds the same keys and bytes."""
        from kvf.cachestore import open_store
        with endpoint(url):
            contents = [{key: store.get(key).numpy().tobytes() for key in store.keys()}
                        for store in (open_store(path) for paths in self.paths.values() for path in paths)]
        if any(c != contents[0] for c in contents):
            raise SystemExit("bench_s3: entries built the two ways differ")


def timed(url: str, store_path: str, work) -> tuple[float, object]:
    """Seconds of work(store) on a fresh client and store (no header cached), and what it returned."""
    from kvf.cachestore import open_store
    with endpoint(url):
        store = open_store(store_path)
        started = time.perf_counter()
        result = work(store)
        return time.perf_counter() - started, result


def measure(url: str, entries: int, chunks: int, repeats: int, building: "Building | None" = None) -> dict:
    """way -> median seconds, each way run `repeats` times in alternation; the answers must agree."""
    from kvf.pipeline.fusion.sources import REMOTE_READERS
    keys, prompt = [key_of(i) for i in range(entries)], list(range(chunks))
    ways = {
        ("planning", "one by one"): ("s3://bench/plan", lambda s: plan_one_by_one(s, keys)),
        ("planning", "side by side"): ("s3://bench/plan", lambda s: plan_side_by_side(s, keys)),
        ("listing", "one by one"): ("s3://bench/plan", list_one_by_one),
        ("listing", "rolled-up listings"): ("s3://bench/plan", lambda s: s.keys()),
        ("listing vs HEADs", "HEADs, side by side"): ("s3://bench/plan", list_markers_side_by_side),
        ("listing vs HEADs", "rolled-up listings"): ("s3://bench/plan", lambda s: s.keys()),
        ("loading", "one reader"): ("s3://bench/load", lambda s: load(s, prompt, 1)),
        ("loading", f"{REMOTE_READERS} readers"): ("s3://bench/load", lambda s: load(s, prompt, None)),
    }
    seconds: dict = {way: [] for way in ways}
    answers: dict = {}
    for _ in range(repeats):
        for way, (path, work) in ways.items():
            took, answer = timed(url, path, work)
            seconds[way].append(took)
            answers.setdefault(way[0], []).append(answer)
    for part, got in answers.items():   # both ways read the same thing
        same = (all(a == got[0] for a in got) if part != "loading"
                else all(torch.equal(x, y) for a in got for la, lb in zip(a, got[0]) for x, y in zip(la, lb)))
        if not same:
            raise SystemExit(f"bench_s3: the two ways of {part} read different things")
    if building is not None:
        for _ in range(repeats):
            for way, now in ((("building", "files in turn, inline"), False), (("building", "side by side, behind"), True)):
                seconds.setdefault(way, []).append(building.run(url, now))
        building.check_same(url)
    return {way: statistics.median(s) for way, s in seconds.items()}


def rows(results: dict[float, dict], args) -> list[dict]:
    """One row per (work, RTT): the median seconds each way and their ratio."""
    units = {"planning": (args.entries, f"s per {args.entries:,} entries"),
             "listing": (args.entries // 2, f"s per {args.entries // 2:,} entries"),
             "listing vs HEADs": (args.entries // 2, f"s per {args.entries // 2:,} entries"),
             "loading": (args.chunks, f"s per prompt of {args.chunks} chunks"),
             "building": (args.build_chunks, f"s per {args.build_chunks} entries built")}
    out = []
    for rtt, medians in results.items():
        for part, (count, unit) in units.items():
            if not any(way[0] == part for way in medians):
                continue
            (before_way, before), (now_way, now) = [(way[1], s) for way, s in medians.items() if way[0] == part]
            out.append({"work": part, "unit": unit, "count": count, "rtt_ms": rtt, "before": before_way,
                        "before_s": before, "now": now_way, "now_s": now, "now_over_before": now / before})
    return out


def report(table_rows: list[dict]) -> tuple[Table, list[str]]:
    table = Table(title="S3 round trips: one after another (before) vs side by side (now), median seconds")
    header = ["work", "RTT added", "before", "now", "now / before"]
    for column in header:
        table.add_column(column)
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|---|---|"]
    for r in table_rows:
        cells = [f"{r['work']} ({r['unit']})", f"{r['rtt_ms']:g} ms", f"{r['before_s']:.2f} ({r['before']})",
                 f"{r['now_s']:.2f} ({r['now']})", f"{r['now_over_before']:.2f}"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    return table, lines


def legend(table_rows: list[dict]) -> str:
    """What the table's ways are, and what its slowest RTT means at a million chunks."""
    rtt = max(r["rtt_ms"] for r in table_rows)
    at = {r["work"]: r for r in table_rows if r["rtt_ms"] == rtt}
    per_entry = {way: at["planning"][f"{way}_s"] / at["planning"]["count"] for way in ("before", "now")}
    return f"""- **before** is what kvf did until this bench was added, run by this script on the same store: planning asked
  each chunk's entry with a HEAD (`has`) and, when present, a GET of its header; listing (`kvf store info`,
  `verify`, `gc`) listed each fan-out directory and made a HEAD of each entry's commit marker; `kvf run` read a
  prompt's chunk KVs, a layer of a chunk per request, from one reader thread.
- **now**: planning asks for the headers of a batch of chunks in one fsspec `cat` of a list, which s3fs sends
  side by side; listing lists 32 fan-out directories at a time, side by side, each in pages with `/kv/` as the
  delimiter, and reads the commit markers off the listings; `kvf run` reads with 8 threads. "listing vs HEADs"
  compares that listing with the one before it (HEADs of 1,024 markers at a time, from 16 threads).
  Both ways return the same answers (the bench checks it).
- **RTT 0** is moto itself, a Python server on the client's cores: there every request costs server CPU,
  so asking side by side saves little. With **{rtt:g} ms added** to each request, as a network does, the
  requests asked one after another wait it out one by one.
- At {rtt:g} ms, planning costs {per_entry['now'] * 1000:.1f} ms an entry side by side against
  {per_entry['before'] * 1000:.1f} ms one by one: {per_entry['now'] * 1e6 / 3600:.1f} against
  {per_entry['before'] * 1e6 / 3600:.1f} hours for a million chunks. Side by side, moto's CPU bounds it here,
  not the network; what a real S3 endpoint, which does not share the client's cores, allows was not measured.
- Loading at {rtt:g} ms: {at['loading']['now_s']:.1f} s against {at['loading']['before_s']:.1f} s, with the
  engine doing nothing else. That is what kvf's layer pipeline has to hide behind compute: on this CPU
  ProphetKV at 15% takes about 1.7 s before its first token at 4K tokens (results/kvfuse.md).
""" + building_legend(at)


def building_legend(at: dict) -> str:
    """The building rows' bullet, when they were measured."""
    if "building" not in at:
        return ""
    b = at["building"]
    return f"""- Building at the same RTT, {b['count']} entries of 256 tokens computed by the embedded model (SmolLM2-135M,
  float32 on these 2 cores, beside moto): {b['now_s']:.1f} s with each entry's files written side by side, behind
  the next chunk's compute, against {b['before_s']:.1f} s writing them one after another before the next chunk
  ({b['now_over_before']:.2f}). The stores built either way hold the same keys and bytes (the bench checks it).
"""


def write(out: str, args, table_rows: list[dict], lines: list[str]) -> None:
    """OUT (markdown, with the command and commit that made it) and its numbers beside it as OUT's .csv."""
    import pandas as pd
    from kvf.pipeline.workflows.provenance import git_commit
    command = (f"python -m kvf.scripts.bench_s3 --rtt-ms {args.rtt_ms} --repeats {args.repeats} --entries {args.entries} "
               f"--chunks {args.chunks} --build-chunks {args.build_chunks}")
    intro = (f"Made by `{command}` at commit {git_commit() or 'unknown'}: moto's S3 server on localhost, sharing "
             f"this machine's {os.cpu_count()} cores with the client, reached directly and through a proxy that adds "
             f"the RTT to every request. Each way ran {args.repeats} times, in alternation; medians.")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write("# A store on S3: requests one after another vs side by side\n\n" + intro + "\n\n" + "\n".join(lines) +
                "\n\n" + legend(table_rows))
    pd.DataFrame(table_rows).to_csv(os.path.splitext(out)[0] + ".csv", index=False, float_format="%.6g")


def main(argv=None) -> None:
    from kvf.scripts.s3_local import LatencyProxy, start_moto
    p = argparse.ArgumentParser(prog="python -m kvf.scripts.bench_s3", description=__doc__.split("\n\n")[0])
    p.add_argument("--rtt-ms", default="0,20", help="round trips to add to every request, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--entries", type=int, default=1000, help="entries planning asks about (half of them present)")
    p.add_argument("--chunks", type=int, default=20, help="chunks of the prompt loaded")
    p.add_argument("--build-chunks", type=int, default=8, help="chunks whose entries building computes (0: no building)")
    p.add_argument("--out", help="write the table here as markdown, and its numbers beside it as .csv")
    args = p.parse_args(argv)
    console = output_console(130)
    try:
        rtts = [float(x) for x in args.rtt_ms.split(",")]
        if any(r < 0 for r in rtts):
            raise ValueError
    except ValueError:
        p.error(f"--rtt-ms {args.rtt_ms}: give milliseconds, comma-separated, e.g. 0,20")
    if min(args.repeats, args.entries // 2, args.chunks) < 1:
        p.error("--repeats, --chunks must be at least 1 and --entries at least 2")
    if args.build_chunks < 0:
        p.error(f"--build-chunks {args.build_chunks}: give 0 (no building) or more chunks")
    try:
        proc, url = start_moto()
    except RuntimeError as e:
        p.error(f"{e}; install the test extra: pip install -e '.[test]'")
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    try:
        fill(url, args.entries, args.chunks, console)
        building = Building(args.build_chunks) if args.build_chunks else None
        results = {}
        for rtt in rtts:
            with LatencyProxy(url, rtt) as proxied, console.status(f"timing with {rtt:g} ms added"):
                results[rtt] = measure(proxied if rtt else url, args.entries, args.chunks, args.repeats, building)
    finally:
        proc.kill()
    table_rows = rows(results, args)
    table, lines = report(table_rows)
    console.print(table)
    if args.out:
        write(args.out, args, table_rows, lines)
    return results


if __name__ == "__main__":
    main()
