"""`kvf build-cache` end to end: what a build writes, stored KVs fusing like in-memory ones,
resuming after SIGKILL, integrity, store identity, sharding, and bad input via the CLI."""
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rich.console import Console

from conftest import assert_one_line, run_cli, tiny_llama_dir
from kvf.errors import KvfError
from kvf.cachestore import CorruptEntry, StoreMismatch, open_store
from kvf.cachestore.fs import LocalFS
from kvf.pipeline.data.synthetic import make_synthetic
from kvf.pipeline.workflows.build import BuildOptions, EntryBuilder, build_cache, in_shard, store_meta
from kvf.pipeline.retrieval.chunking import ChunkTable, chunk_id_for, read_chunks_table, tokenizer_fingerprint
from kvf.pipeline.fusion.sources import InMemoryKV
from kvf.pipeline.retrieval.neighbours import load_neighbours
from kvf.pipeline.fusion.methods import get_method
from kvf.pipeline.workflows.weights import ModelRef, open_model
from kvf.pipeline.fusion.sources import StoreKVSource
from kvf.pipeline.workflows.workspace import EntryKeys, Workspace, ids_digest

QUIET = Console(file=io.StringIO())
CHUNK_TOKENS = 32
QUESTION = "In which province was Zorvan Pellick born?"
LONG_DOC = ("The Kettar mountains lie north of the Ossel sea. Their slopes are home to wild goats, "
            "eagles and a few shepherd families who move their flocks twice a year. In winter the "
            "passes close for months, and the villages below trade salt and wool with the river "
            "towns of the Drelvan province until the snow melts in late spring.")
# one thread: the subprocess builds must compute bit-identical KVs, and 2 threads on a shared
# 2-core box are slower than one
SUB_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "200",
           "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """In-process builds match the subprocess ones bit for bit, and run ~5x faster on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- helpers -------------------------------------------------------------------------------------
def write_corpus(root: Path, short_docs) -> Path:
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for i, text in enumerate(short_docs):
        (corpus / f"doc{i}.txt").write_text(text)
    (corpus / "copy_of_doc0.txt").write_text(short_docs[0])  # identical chunk: stored once
    (corpus / "mountains.md").write_text("# Kettar\n" + LONG_DOC)
    return corpus


def opts_for(root: Path, corpus: Path, **kw) -> BuildOptions:
    base = dict(corpus=corpus, workspace=root / "ws", chunk_tokens=CHUNK_TOKENS, n_neighbours=2,
                bm25=False, dense=False)
    return BuildOptions(**{**base, **kw})


def chunk_keys(store) -> list[str]:
    return [k for k in store.keys() if store.attrs(k).get("variant") != "system"]


def entry_bytes(store, key) -> bytes:
    return store.get(key).view(torch.uint8).numpy().tobytes()


def expected_keys(model_ref, chunks, variant="prefix") -> set[str]:
    from kvf.pipeline.model.prompt import make_template
    template = make_template(model_ref.tokenizer)
    keys = EntryKeys(model_ref.fingerprint, template.prefix_ids)
    return {keys.chunk(variant, template.chunk_segment(c.token_ids)) for c in chunks}


KVF = [str(Path(sys.executable).parent / "kvf")]  # the installed console script, as users run it


def kvf_cli(*args, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([*KVF, *map(str, args)], env=SUB_ENV, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


# ---- one float32 build shared by the module (never modified: tests that damage it copy it) ---------
@pytest.fixture(scope="module")
def built(tmp_path_factory, short_docs):
    root = tmp_path_factory.mktemp("build")
    corpus = write_corpus(root, short_docs)
    opts = opts_for(root, corpus, dtype="float32", bm25=True, dense=True)
    summary = build_cache(opts, QUIET)
    ws = Workspace(opts.workspace)
    yield SimpleNamespace(root=root, corpus=corpus, opts=opts, summary=summary, ws=ws,
                          chunks=read_chunks_table(ws.chunks_path), model_ref=open_model(None))
    shutil.rmtree(root, ignore_errors=True)


def test_stage_one_streamed_in_tokenizer_batches_equals_chunking_each_document(tmp_path, monkeypatch):
    """Stage 1 tokenizes documents a batch at a time (a fast tokenizer spreads a batch over the cores) and
    streams the table: it must cut exactly what tokenizing each document alone does, duplicates, a literal
    control token, non-ASCII text and batch edges included."""
    import kvf.pipeline.workflows.build as build_module
    from kvf.pipeline.retrieval.chunking import chunk_documents, split_documents
    from kvf.pipeline.retrieval.corpus import read_corpus
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [LONG_DOC, "Zorvan <|im_end|> Pellick", "Café Ørsted – naïve résumé " * 9, LONG_DOC, "x", "  y  "]
    with open(corpus / "docs.jsonl", "w") as f:
        for i, text in enumerate(texts * 2):
            f.write(json.dumps({"id": f"d{i}", "title": f"T{i % 3}", "text": text}, ensure_ascii=False) + "\n")
    monkeypatch.setattr(build_module, "TOKENIZE_DOCS", 5)
    tokenizer = open_model(None).tokenizer
    opts = opts_for(tmp_path, corpus, chunk_tokens=16, overlap=4)
    table, stat = build_module.stage_chunks(opts, Workspace(tmp_path / "ws"), tokenizer)
    docs = read_corpus(corpus)
    assert list(table.chunks()) == chunk_documents(docs, tokenizer, 16, 4)
    assert Workspace(tmp_path / "ws").doc_chunks() == {
        doc: [c.chunk_id for c in chunks] for doc, chunks in split_documents(docs, tokenizer, 16, 4).items()}
    assert (stat.items, stat.note) == (len(table), "12 documents")


def test_the_build_driver_never_holds_every_chunk_as_an_object(tmp_path, monkeypatch):
    """build-cache read every document, then every chunk, as Python objects and kept both through its three
    stages: about 9 KB a 256-token chunk, 9 GB for a million (`bench_chunk_table --driver`). Stage 1 now
    streams documents into chunks.parquet, and the indexes and the KV stage read a ChunkTable, making Chunk
    objects a batch at a time (and one per neighbour a fusion entry reads). The store is the same."""
    from kvf.pipeline.retrieval import chunking
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with open(corpus / "passages.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"p{i}", "title": f"Place {i}",
                                "text": f"Vessa-{i} is a town on the river Ork, {i * 7} miles from the coast. " * 2}) + "\n")
    tiny = str(tiny_llama_dir(tmp_path / "tiny"))   # what the driver holds does not depend on the model
    one_go = build_cache(opts_for(tmp_path / "one-go", corpus, dtype="float32", variants=["prefix", "fusion"],
                                  model=tiny), QUIET)
    live = {"now": 0, "peak": 0}
    real_init = chunking.Chunk.__init__

    def counting_init(self, *args, **kw):
        real_init(self, *args, **kw)
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])

    def counting_del(self):
        live["now"] -= 1
    monkeypatch.setattr(chunking.Chunk, "__init__", counting_init)
    monkeypatch.setattr(chunking.Chunk, "__del__", counting_del, raising=False)
    monkeypatch.setattr(chunking, "WRITE_ROWS", 4)
    monkeypatch.setattr(chunking, "OBJECT_ROWS", 4)
    opts = opts_for(tmp_path, corpus, dtype="float32", variants=["prefix", "fusion"], bm25=True, model=tiny)
    summary = build_cache(opts, QUIET)
    assert summary.chunks == one_go.chunks >= 20   # 5 batches of 4 or more
    assert live["peak"] <= 16   # a batch written, a batch read, a document's chunks, a fusion entry's neighbours
    monkeypatch.undo()
    batched, whole = (open_store(root / "ws" / "kv.zarr", readonly=True) for root in (tmp_path, tmp_path / "one-go"))
    assert sorted(chunk_keys(batched)) == sorted(chunk_keys(whole))   # batches of 4 chunks change nothing stored
    assert all(torch.equal(batched.get(k), whole.get(k)) for k in chunk_keys(whole))
    assert read_chunks_table(tmp_path / "ws" / "chunks.parquet") == read_chunks_table(
        tmp_path / "one-go" / "ws" / "chunks.parquet")

def town_corpus(root: Path, n: int) -> Path:
    """n short documents, a chunk each."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(n):
        (corpus / f"d{i}.txt").write_text(f"Vessa-{i} is a town on the river Ork, {i * 7} miles from the coast. " * 3)
    return corpus


def test_the_room_a_fusion_build_needs_counts_its_neighbours_prefix_entries(tmp_path, monkeypatch):
    """A --variant fusion build also stores the prefix entries its fusion entries attend to (their neighbours'), and
    the room check counted only the fusion entries, about half of what the build writes. With one byte less free
    than the build writes it is refused; with exactly that, it builds."""
    from kvf.cachestore.base import KVStore
    corpus = town_corpus(tmp_path, 4)
    written = build_cache(opts_for(tmp_path / "a", corpus, variants=["fusion"]), QUIET).bytes_written
    monkeypatch.setattr(KVStore, "free_bytes", lambda self: written - 1)
    with pytest.raises(KvfError, match="entries still to build need about"):
        build_cache(opts_for(tmp_path / "b", corpus, variants=["fusion"]), QUIET)
    monkeypatch.setattr(KVStore, "free_bytes", lambda self: written)
    asked, real_missing_ids = [], EntryBuilder.missing_ids
    monkeypatch.setattr(EntryBuilder, "missing_ids", lambda self, variant, *a: asked.append(variant) or
                        real_missing_ids(self, variant, *a))
    summary = build_cache(opts_for(tmp_path / "b", corpus, variants=["fusion"]), QUIET)
    assert summary.bytes_written == written
    # one plan, sized and then built (the build asked the store about every entry again); its prefix stage is
    # a row of its own, saying whose entries it holds, as on Ray
    assert asked == ["prefix", "fusion"]
    rows = {s.name: s for s in summary.stages if s.name.startswith("kv")}
    assert list(rows) == ["kv prefix", "kv fusion"] and rows["kv prefix"].note == "for fusion"
    assert rows["kv prefix"].items == rows["kv fusion"].items == summary.chunks   # each chunk a neighbour of some


def test_shards_of_a_fusion_build_at_once_compute_each_neighbour_prefix_entry_once(tmp_path, monkeypatch):
    """A fusion build plans its neighbours' prefix entries up front, and those neighbours belong to every shard: a
    shard that planned them before another stored them computed them again (N shards: up to N times the work)."""
    import kvf.pipeline.workflows.build as build_module
    corpus = town_corpus(tmp_path, 6)
    computed, real_compute, real_stage_kv = [], EntryBuilder.compute, build_module.stage_kv
    monkeypatch.setattr(EntryBuilder, "compute", lambda self, variant, chunk, *a: computed.append(
        (variant, chunk.chunk_id)) or real_compute(self, variant, chunk, *a))

    def other_shard_meanwhile(opts, *args):   # shard 0 builds between shard 1's plan and its KV stage
        monkeypatch.setattr(build_module, "stage_kv", real_stage_kv)
        build_cache(replace(opts, shard=(0, 2)), QUIET)
        return real_stage_kv(opts, *args)
    monkeypatch.setattr(build_module, "stage_kv", other_shard_meanwhile)
    build_cache(opts_for(tmp_path, corpus, variants=["fusion"], shard=(1, 2)), QUIET)
    prefix = [cid for variant, cid in computed if variant == "prefix"]
    assert len(prefix) == len(set(prefix)) > 0
    fusion = [cid for variant, cid in computed if variant == "fusion"]   # each shard its own half, once
    assert sorted(fusion) == sorted(c.chunk_id for c in read_chunks_table(tmp_path / "ws" / "chunks.parquet"))


def test_a_session_makes_chunk_objects_only_for_the_chunks_it_is_asked_for(built, monkeypatch):
    """kvf run (each Ray worker, each API session) held every chunk of the workspace as Python objects, a
    Python int per token: 1.3 GB for 100K chunks of 256 tokens, 13 GB for a million. The table now stays
    columnar and a chunk becomes a Chunk when a question asks for it; gc reads the table a batch at a time."""
    from kvf.pipeline.retrieval import chunking
    from kvf.pipeline.workflows.session import Session
    path, chunks = built.ws.chunks_path, built.chunks
    table = chunking.ChunkTable(path)
    assert list(table) == chunking.read_chunk_ids(path) == [c.chunk_id for c in chunks] and len(table) == len(chunks)
    assert all(table[c.chunk_id] == c for c in chunks) and "f" * 64 not in table
    with pytest.raises(KeyError):
        table["f" * 64]
    assert list(chunking.iter_chunk_tokens(path, rows=2)) == [(c.chunk_id, c.token_ids) for c in chunks]
    monkeypatch.setattr(chunking, "OBJECT_ROWS", 2)
    backwards = [c.chunk_id for c in reversed(chunks)]
    assert list(table.chunks()) == chunks and list(table.chunks(backwards)) == chunks[::-1]
    assert table.tokens() == sum(len(c.token_ids) for c in chunks) and table.tokens(backwards[:2]) == sum(
        len(c.token_ids) for c in chunks[-2:]) and table.tokens([]) == 0
    assert list(table.texts) == [c.text for c in chunks]
    made, real_chunk = [], chunking.Chunk

    def counted(**row):
        made.append(row["chunk_id"])
        return real_chunk(**row)
    monkeypatch.setattr(chunking, "Chunk", counted)
    session = Session(built.ws)
    assert made == []
    assert session.chunks([chunks[1].chunk_id]) == [chunks[1]] and made == [chunks[1].chunk_id]


def test_build_writes_chunks_indexes_store_and_summary(built):
    chunks, ws, summary = built.chunks, built.ws, built.summary
    fingerprint = tokenizer_fingerprint(built.model_ref.tokenizer)
    assert len({c.chunk_id for c in chunks}) == len(chunks) >= 4
    for c in chunks:  # stable content ids, windows of at most --chunk-tokens model tokens
        assert c.chunk_id == chunk_id_for(fingerprint, c.token_ids)
        assert 1 <= len(c.token_ids) <= CHUNK_TOKENS
    doc_chunks = ws.doc_chunks()
    assert doc_chunks["copy_of_doc0.txt"] == doc_chunks["doc0.txt"]  # identical docs share their chunk
    assert len(doc_chunks["mountains.md"]) >= 2
    # one entry per distinct chunk, plus S's own
    store = open_store(summary.store, readonly=True)
    assert set(chunk_keys(store)) == expected_keys(built.model_ref, chunks)
    assert len(store.keys()) == len(chunks) + 1
    assert store.verify() == []
    assert store.meta["dtype"] == "float32" and store.meta["layers"] == 30
    # the summary: chunks, tokens, entries and bytes written, per-stage rates
    tokens = sum(len(c.token_ids) for c in chunks)
    assert (summary.chunks, summary.tokens, summary.entries_written) == (len(chunks), tokens, len(chunks))
    payload = sum(store.header(k).layers * store.header(k).layer_nbytes for k in chunk_keys(store))
    assert summary.bytes_written == payload
    stages = {s.name: s for s in summary.stages}
    assert set(stages) == {"chunk", "bm25 index", "dense index", "neighbours", "kv prefix"}
    assert stages["kv prefix"].items == len(chunks) and stages["kv prefix"].tokens == tokens
    assert stages["kv prefix"].seconds > 0
    # the manifest names the store by absolute path, so `kvf run` finds it from any directory
    manifest = ws.manifest()
    assert manifest["store"] == "kv.zarr"  # relative to the workspace, so a moved workspace keeps its store
    neighbours = load_neighbours(ws.neighbours_path)
    assert set(neighbours) == {c.chunk_id for c in chunks}
    assert all(len(n) == 2 and cid not in n for cid, n in neighbours.items())


def test_search_finds_the_chunk_in_the_bm25_index(built, capsys, monkeypatch):
    code, out, _ = run_cli(["search", "shepherd families flocks", "--workspace", built.ws.root, "-k", "1"],
                            capsys, monkeypatch)
    assert code == 0
    [top] = [c for c in built.chunks if "shepherd" in c.text]
    assert top.chunk_id[:12] in out
    # no word of the query is indexed: the line says that meaning is the dense index's to match
    code, out, _ = run_cli(["search", "???", "--workspace", built.ws.root], capsys, monkeypatch)
    assert code == 0 and out.strip() == ("no bm25 hits for '???'; BM25 matches words, `--retriever dense` matches "
                                         "meaning"), out


def test_a_workspace_keeps_its_bm25_choice_and_search_refuses_an_index_of_older_chunks(built, tmp_path, capsys,
                                                                                     monkeypatch):
    """Two defects found growing a corpus. `--no-bm25` was not kept: the next build-cache without it started
    Java and indexed every chunk, as --variant or --chunk-tokens are kept. And after a --no-bm25 build of a
    grown corpus, `kvf search` served the BM25 index of the older chunks, missing every new document without
    a word (`kvf run` refused it). Now the choice is kept, and search refuses the stale index in one line."""
    opts = copy_build(built, tmp_path)
    ws, corpus = Path(opts.workspace), tmp_path / "corpus"
    shutil.copytree(built.corpus, corpus)
    (corpus / "owls.txt").write_text("Snowy owls nest on the tundra of Vellmora island every spring.")
    code, _, summary = run_cli(["build-cache", corpus, "-w", ws, "--no-bm25"], capsys, monkeypatch)
    assert code == 0 and "dense index" in summary and "bm25 index" not in summary   # the build's summary table
    code, _, err = run_cli(["search", "snowy owls tundra", "-w", ws], capsys, monkeypatch)
    assert_one_line(code, err, "bm25 index", "another set of chunks", f"--workspace {ws} --rebuild bm25")
    (corpus / "bees.txt").write_text("Orvath Lenn keeps bees in the hills above Quillmarsh.")
    code, _, summary = run_cli(["build-cache", corpus, "-w", ws], capsys, monkeypatch)
    assert code == 0 and "dense index" in summary and "bm25 index" not in summary
    assert json.loads((ws / "manifest.json").read_text())["bm25"] is False
    code, _, summary = run_cli(["build-cache", corpus, "-w", ws, "--bm25"], capsys, monkeypatch)
    assert code == 0 and "bm25 index" in summary
    code, out, _ = run_cli(["search", "snowy owls tundra", "-w", ws, "-k", "1", "--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)[0]["doc_id"] == "owls.txt"


def test_the_fix_a_missing_index_names_builds_it_in_a_workspace_built_without_it(tmp_path, short_docs, capsys,
                                                                                monkeypatch):
    """`kvf search` on a workspace built with --no-bm25 (or --no-dense) said "build it with `kvf build-cache
    CORPUS --workspace WS`"; since a left-out flag keeps --no-bm25, that command built nothing. The command
    it names now builds the index, and search then finds the chunk."""
    corpus = write_corpus(tmp_path, short_docs)
    ws = tmp_path / "ws"
    code, _, _ = run_cli(["build-cache", corpus, "-w", ws, "--no-bm25", "--no-dense", "--chunk-tokens", CHUNK_TOKENS],
                         capsys, monkeypatch)
    assert code == 0
    for retriever in ("bm25", "dense"):
        code, _, err = run_cli(["search", "Quillmarsh glass", "-w", ws, "--retriever", retriever], capsys, monkeypatch)
        fix = re.search(r"`kvf build-cache CORPUS (.*?)`", err)
        assert code != 0 and fix and len(err.strip().splitlines()) == 1, err
        assert "does not exist" in err, err   # not "is missing index.faiss, ...", which reads as a damaged index
        code, _, _ = run_cli(["build-cache", corpus, *fix.group(1).split()], capsys, monkeypatch)
        assert code == 0
        code, out, _ = run_cli(["search", "Quillmarsh glass", "-w", ws, "--retriever", retriever, "-k", "1", "--json"],
                               capsys, monkeypatch)
        assert code == 0 and json.loads(out)[0]["doc_id"] in ("doc0.txt", "doc1.txt", "copy_of_doc0.txt")


def test_the_fix_for_missing_neighbours_lets_fusionrag_run_without_building_every_fusion_entry(tmp_path, short_docs,
                                                                                             capsys, monkeypatch):
    """FusionRAG on a workspace built --no-dense said to rebuild with `--variant fusion`, which computes every
    chunk's fusion KV (a run computes those its questions need). The fix it names builds the neighbours only."""
    corpus = write_corpus(tmp_path, short_docs)
    ws, questions = tmp_path / "ws", tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": QUESTION, "answers": ["Drelvan"]}) + "\n")
    assert run_cli(["build-cache", corpus, "-w", ws, "--no-dense", "--chunk-tokens", CHUNK_TOKENS], capsys,
                   monkeypatch)[0] == 0
    run_args = ["run", "-w", ws, "-q", questions, "-m", "fusionrag", "-r", "0.15", "--max-new-tokens", "2",
                "--no-show-answers", "-o", tmp_path / "r.jsonl"]
    code, _, err = run_cli(run_args, capsys, monkeypatch)
    fix = re.search(r"`kvf build-cache CORPUS (.*?)`", err)
    assert code != 0 and "neighbours" in err and fix, err
    code, _, summary = run_cli(["build-cache", corpus, *fix.group(1).split()], capsys, monkeypatch)
    assert code == 0 and "neighbours" in summary and "kv fusion" not in summary
    assert run_cli(run_args, capsys, monkeypatch)[0] == 0


@pytest.mark.parametrize("method", ["reuse", "cacheblend"])
def test_stored_kvs_fuse_exactly_like_in_memory_ones(built, answerer, method):
    """float32 store: loading from it (pipelined or not) gives the in-memory fused result."""
    store = open_store(built.summary.store, readonly=True)
    chunks = [c for c in built.chunks if c.doc_id in ("doc0.txt", "doc1.txt", "mountains.md")][:3]
    prompt = answerer.prompt([c.token_ids for c in chunks], QUESTION)
    keys = [EntryKeys(built.model_ref.fingerprint, prompt.prefix_ids).chunk("prefix", seg)
            for seg in prompt.chunk_segments]
    engine = answerer.engine
    memory = InMemoryKV([engine.chunk_kv(seg, prompt.prefix_ids, None) for seg in prompt.chunk_segments])
    for key, kv in zip(keys, memory.chunk_kvs):
        assert (store.get(key) - kv).abs().max().item() <= 1e-4
    fuse = get_method(method, recompute_ratio=0.15)
    expected = fuse.prefill(engine, prompt, memory)
    got = {}
    for pipeline, readers in ((False, None), (True, None), (True, 3)):   # 3: chunks read side by side
        source = StoreKVSource(store, keys, answerer.transformer.n_layers, pipeline=pipeline, readers=readers)
        try:
            got[pipeline, readers] = fuse.prefill(engine, prompt, source)
        finally:
            source.close()
        assert source.read_seconds > 0
    assert (got[False, None].logits - expected.logits).abs().max().item() <= 1e-4
    assert got[False, None].recomputed_tokens == expected.recomputed_tokens
    assert torch.equal(got[False, None].logits, got[True, None].logits)
    assert torch.equal(got[False, None].logits, got[True, 3].logits)


def test_kvfuse_reads_stored_rows_again_after_the_source_is_closed(built, answerer):
    """kvfuse's shift needs the stored KV of rows its prefill recomputed: it reads them from the store again
    when decoding first reads the cache, after `kvf run` has closed the source. The cache then equals the
    one fused from the same KVs in memory, bit for bit, and the re-read counts neither as loading nor as
    reading (TTFT and the hidden share leave it out)."""
    store = open_store(built.summary.store, readonly=True)
    chunks = [c for c in built.chunks if c.doc_id in ("doc0.txt", "doc1.txt", "mountains.md")][:3]
    prompt = answerer.prompt([c.token_ids for c in chunks], QUESTION)
    keys = [EntryKeys(built.model_ref.fingerprint, prompt.prefix_ids).chunk("prefix", seg)
            for seg in prompt.chunk_segments]
    fuse = get_method("kvfuse", recompute_ratio=0.3)
    memory = InMemoryKV([store.get(key) for key in keys])
    expected = fuse.prefill(answerer.engine, prompt, memory)
    source = StoreKVSource(store, keys, answerer.transformer.n_layers, pipeline=True)
    got = fuse.prefill(answerer.engine, prompt, source)
    source.close()
    read, loaded = source.read_seconds, source.load_seconds
    assert got.after_first_token is not None
    assert torch.equal(got.cache.kv, expected.cache.kv)
    assert (source.read_seconds, source.load_seconds) == (read, loaded)
    unshifted = get_method("kvfuse", recompute_ratio=0.3, propagate="off").prefill(answerer.engine, prompt, memory)
    assert not torch.equal(got.cache.kv, unshifted.cache.kv)


def test_rerun_on_unchanged_corpus_does_no_model_work(built, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("model work on an unchanged corpus")
    monkeypatch.setattr(ModelRef, "load", refuse)
    monkeypatch.setattr("kvf.pipeline.retrieval.dense.Embedder.__init__", refuse)
    monkeypatch.setattr("kvf.pipeline.retrieval.bm25.build_bm25", refuse)
    keys_before = open_store(built.summary.store, readonly=True).keys()
    summary = build_cache(replace(built.opts), QUIET)
    assert summary.entries_written == 0 and summary.bytes_written == 0
    assert summary.entries_skipped == len(built.chunks)
    assert [s.name for s in summary.stages] == ["chunk", "kv prefix"]
    assert summary.stages[-1].note == "all entries present"
    assert open_store(built.summary.store, readonly=True).keys() == keys_before


def test_a_new_document_embeds_only_its_own_chunks(built, tmp_path, monkeypatch):
    """A later build of a grown corpus reuses the dense vectors of the chunks it has (the index used to be
    embedded again from scratch: an hour per 100K chunks on a CPU), and ends with the index of a one-go build."""
    from kvf.pipeline.retrieval.dense import Embedder, load_embeddings
    root = tmp_path / "grown"
    shutil.copytree(built.root, root)
    (root / "corpus" / "owls.txt").write_text("Owls hunt at night and find mice by sound alone, even under snow.")
    embedded = []
    real = Embedder.encode
    monkeypatch.setattr(Embedder, "encode", lambda self, texts, batch_size=64: embedded.extend(texts) or real(self, texts, batch_size))
    summary = build_cache(replace(built.opts, corpus=root / "corpus", workspace=root / "ws", store=None), QUIET)
    chunks = read_chunks_table(Workspace(root / "ws").chunks_path)
    new = [c for c in chunks if c.doc_id == "owls.txt"]
    assert [c.text for c in new] == embedded and len(chunks) == len(built.chunks) + len(new)
    dense = {s.name: s for s in summary.stages}["dense index"]
    assert dense.items == len(new) and dense.note == f"{len(built.chunks)} reused"
    vectors, ids = load_embeddings(root / "ws" / "dense")
    fresh = Embedder().encode([c.text for c in chunks])
    assert ids == [c.chunk_id for c in chunks]
    np.testing.assert_allclose(vectors, fresh, rtol=0, atol=1e-5)


def test_store_of_another_dtype_is_refused(built, tmp_path):
    with pytest.raises(KvfError) as err:   # the workspace's own store: named by the flag, with the fix
        build_cache(replace(built.opts, dtype="float16"), QUIET)
    message = str(err.value)
    assert "\n" not in message and message.startswith("--dtype float16: workspace") and "holds float32 KVs" in message
    assert "leave --dtype out" in message
    with pytest.raises(StoreMismatch) as err:   # another workspace naming that store
        build_cache(replace(built.opts, dtype="float16", workspace=tmp_path / "ws", store=built.summary.store), QUIET)
    assert "dtype='float32'" in str(err.value) and "dtype='float16'" in str(err.value)
    with pytest.raises(StoreMismatch, match="dtype"):
        open_store(built.summary.store, meta=store_meta(built.model_ref, "float16"))


def test_a_later_build_keeps_the_workspaces_settings_unless_told(built, tmp_path, capsys, monkeypatch):
    """`kvf build-cache CORPUS -w WS` on a grown corpus, without repeating the first build's flags, cut every
    document again at the default 256 tokens (every KV computed again, without a word) and, on a float32
    store, was refused for the default float16. A flag left out now keeps the workspace's setting; one that
    changes it is said in one line."""
    root = tmp_path / "grown"
    shutil.copytree(built.root, root)
    (root / "corpus" / "owls.txt").write_text("Owls hunt at night and find mice by sound alone, even under snow.")
    ws = root / "ws"
    before = json.loads((ws / "manifest.json").read_text())
    code, _, err = run_cli(["build-cache", root / "corpus", "-w", ws, "--no-bm25"], capsys, monkeypatch)
    assert code == 0 and "warning" not in err, err
    after = json.loads((ws / "manifest.json").read_text())
    for name in ("chunk_tokens", "overlap", "dtype", "n_neighbours", "embedder"):
        assert after[name] == before[name], name
    new = [c for c in read_chunks_table(ws / "chunks.parquet") if c.doc_id == "owls.txt"]
    assert len(read_chunks_table(ws / "chunks.parquet")) == len(built.chunks) + len(new)
    assert len(open_store(str(ws / "kv.zarr")).keys()) == len(built.chunks) + len(new) + 1   # + S: nothing recut
    code, _, err = run_cli(["build-cache", root / "corpus", "-w", ws, "--no-bm25", "--chunk-tokens", 16],
                           capsys, monkeypatch)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 1 and f"--chunk-tokens 16: workspace {ws} was built with {CHUNK_TOKENS}" in \
        warnings[0] and f"leave --chunk-tokens out to keep {CHUNK_TOKENS}" in warnings[0], err
    assert json.loads((ws / "manifest.json").read_text())["chunk_tokens"] == 16


def test_a_later_build_keeps_the_workspaces_variants_unless_told(built, tmp_path, capsys, monkeypatch):
    """--variant left out built only prefix entries for a grown corpus's new chunks, though the workspace had
    its fusion entries built ahead (and its manifest still said so); now it keeps the workspace's variants."""
    root = tmp_path / "grown"
    shutil.copytree(built.root, root)
    ws = root / "ws"
    build_cache(replace(built.opts, corpus=root / "corpus", workspace=ws, store=None, variants=("prefix", "fusion")), QUIET)
    (root / "corpus" / "owls.txt").write_text("Owls hunt at night and find mice by sound alone, even under snow.")
    code, _, err = run_cli(["build-cache", root / "corpus", "-w", ws, "--no-bm25"], capsys, monkeypatch)
    assert code == 0, err
    store = open_store(str(ws / "kv.zarr"))
    chunk_ids = {c.chunk_id for c in read_chunks_table(ws / "chunks.parquet")}
    for variant in ("prefix", "fusion"):
        assert {store.attrs(k)["chunk_id"] for k in chunk_keys(store) if store.attrs(k)["variant"] == variant} >= \
            chunk_ids, variant
    assert json.loads((ws / "manifest.json").read_text())["variants"] == ["fusion", "prefix"]


def test_store_of_another_model_or_tokenizer_is_refused(built, tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer
    model_dir = built.model_ref.model_dir
    tiny = tiny_llama_dir(tmp_path / "tiny", built.model_ref.tokenizer)   # a different model with the same tokenizer
    code, _, err = run_cli(["build-cache", built.corpus, "--workspace", tmp_path / "ws", "--store", built.summary.store,
                             "--model", tiny, "--dtype", "float32", "--no-bm25", "--no-dense"], capsys, monkeypatch)
    assert_one_line(code, err, "holds model=", "rebuild the store")
    # the same weights with another tokenizer (one added token)
    retok = tmp_path / "retok"
    retok.mkdir()
    for f in [model_dir / "config.json", *model_dir.glob("*.safetensors")]:
        (retok / f.name).symlink_to(f)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<kvf-extra-token>"])
    tokenizer.save_pretrained(retok)
    assert open_model(str(retok)).fingerprint == built.model_ref.fingerprint
    with pytest.raises(StoreMismatch, match="holds tokenizer="):
        build_cache(replace(built.opts, model=str(retok), workspace=tmp_path / "ws2", store=built.summary.store), QUIET)


def test_a_workspace_keeps_the_model_it_was_built_with(built, tmp_path, capsys, monkeypatch):
    """--model left out of a later command means the workspace's own model, found from any folder. Before, a later
    `kvf build-cache -w WS` on a workspace built with --model refused with "store ... holds model=...; use another
    --store path or rebuild the store", and `kvf ask` / `kvf run -w` / `kvf.open_workspace` with "pass that --model"."""
    import kvf
    tiny = tiny_llama_dir(tmp_path / "tiny", built.model_ref.tokenizer)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["build-cache", built.corpus, "-w", "ws", "--model", "tiny", "--dtype", "float32",
                            "--no-bm25"], capsys, monkeypatch)
    assert code == 0, err
    ws = tmp_path / "ws"
    assert json.loads((ws / "manifest.json").read_text())["model_arg"] == str(tiny.resolve())   # not "tiny"
    entries = sorted(open_store(str(ws / "kv.zarr")).keys())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, _, err = run_cli(["build-cache", "-w", ws], capsys, monkeypatch)
    assert code == 0, err
    assert sorted(open_store(str(ws / "kv.zarr")).keys()) == entries   # the same model's: none computed again
    code, out, err = run_cli(["ask", QUESTION, "-w", ws, "-m", "reuse", "--max-new-tokens", 2, "--json"], capsys,
                             monkeypatch)
    assert code == 0, err
    with kvf.open_workspace(ws) as notebook:
        assert notebook.session.model_ref.model_dir == tiny.resolve()
        assert notebook.answer(QUESTION, method="reuse", max_new_tokens=2).text == json.loads(out)[0]["answer"]
    # another model, given: refused with the fix, by every command
    other = built.model_ref.model_dir
    for command in (["ask", QUESTION, "-w", ws], ["build-cache", built.corpus, "-w", ws]):
        code, _, err = run_cli([*command, "--model", other], capsys, monkeypatch)
        assert_one_line(code, err, f"--model {other}: workspace {ws} was built with model", "leave --model out")
    # other weights saved over the model (fine-tuned in place): not "--model None", nor "leave --model out"
    shutil.copytree(tiny, tmp_path / "kept")
    tiny_llama_dir(tiny, built.model_ref.tokenizer, initializer_range=0.05)
    for given in ([], ["--model", tiny]):
        code, _, err = run_cli(["ask", QUESTION, "-w", ws, *given], capsys, monkeypatch)
        assert_one_line(code, err, f"workspace {ws} was built with model", "whose weights have changed since",
                        "pass --model with the weights it was built with")
    shutil.rmtree(tiny)
    (tmp_path / "kept").rename(tiny)
    # the model moved: said, with the fix
    tiny.rename(tmp_path / "moved")
    code, _, err = run_cli(["ask", QUESTION, "-w", ws, "-m", "reuse", "--max-new-tokens", 2], capsys, monkeypatch)
    assert_one_line(code, err, f"workspace {ws} was built with --model {tiny.resolve()}, which no longer exists",
                    "pass --model")
    code, _, err = run_cli(["ask", QUESTION, "-w", ws, "-m", "reuse", "--max-new-tokens", 2, "--model",
                            tmp_path / "moved"], capsys, monkeypatch)
    assert code == 0, err


# chat templates of real models, and how each must hold kvf's instructions: as a system message, or at the head of
# the one user turn (a template that takes no system message: it raises, or drops it)
CHAT_TEMPLATES = {
    "Llama-3-Instruct (trims each message)": ("system", (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
        "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
        "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")),
    "Mistral-Instruct v0.1/v0.2 (refuses a system message)": ("user", (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")),
    "Qwen3 (thinks first unless told not to)": ("system", (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and "
        "enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")),
    "drops a system message": ("user", (
        "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<user>' + message['content'] + "
        "'</user>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<bot>' }}{% endif %}")),
}


@pytest.mark.parametrize("instructions, chat_template", CHAT_TEMPLATES.values(), ids=list(CHAT_TEMPLATES))
def test_the_prompt_is_the_chat_templates_own_rendering(instructions, chat_template):
    """`kvf build-cache --model` a Llama-3-Instruct said "kvf: internal error: ValueError: not enough values to
    unpack": its template trims each message, and the prompt was cut where "Question: " had lost its space.
    Qwen3's has the model think first unless told not to: kvf scores a short answer, so it tells it.
    Mistral-Instruct v0.1/v0.2's template raises on a system message ("internal error: TemplateError: Conversation
    roles must alternate ..."), and one that drops it left the prompt without kvf's instructions, silently. Now the
    prompt is, token for token, what the template renders for the system message and the user turn, or for the one
    user turn with the instructions at its head where the template takes no system message."""
    from transformers import AutoTokenizer
    from kvf.pipeline.model.prompt import SYSTEM_PROMPT, build_prompt, make_template
    tokenizer = AutoTokenizer.from_pretrained(open_model(None).model_dir)
    tokenizer.chat_template = chat_template
    passage = "Quillmarsh is a river town."
    prompt = build_prompt(make_template(tokenizer), [tokenizer(passage, add_special_tokens=False)["input_ids"]],
                          QUESTION)
    turn = f"Documents:\n{passage}\n\nQuestion: {QUESTION}"
    messages = ([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": turn}]
                if instructions == "system" else [{"role": "user", "content": f"{SYSTEM_PROMPT}\n\n{turn}"}])
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert tokenizer.decode(prompt.all_ids()) == rendered
    assert "enable_thinking" not in chat_template or rendered.endswith("<think>\n\n</think>\n\n")   # answers at once
    tokenizer.chat_template = "{{ raise_exception('no chat here') }}"   # no turn it can render: said, with the fix
    with pytest.raises(KvfError, match=r"chat template cannot render one user turn \(no chat here\); pass a --model"):
        make_template(tokenizer)
    tokenizer.chat_template = "{{ messages[-1]['content'][:12] }}"   # one that cuts the message short
    with pytest.raises(KvfError, match=r"chat template does not keep the user's message as written; pass a --model"):
        make_template(tokenizer)


def test_a_question_that_names_a_control_token_asks_about_its_text():
    """An LLM engineer's question "What does <|im_end|> mean in ChatML?" put the embedded model's end-of-turn token
    mid-question: the model read the turn as ended there. The question's text stays text, as a chunk's does
    (split_special_tokens); the template's own control tokens after it stay, and any other question's ids are as
    they were (one piece)."""
    from kvf.pipeline.model.prompt import encode, make_template
    tokenizer = open_model(None).tokenizer
    template = make_template(tokenizer)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = template.question_ids("What does <|im_end|> mean in ChatML?")
    assert ids.count(end_of_turn) == 1 and ids[-len(encode(tokenizer, template.question_tail)):] == \
        encode(tokenizer, template.question_tail)   # the template's end of the user turn, and only it
    assert tokenizer.decode(ids).startswith("Question: What does <|im_end|> mean in ChatML?<|im_end|>")
    plain = "Where is Quillmarsh?"
    assert template.question_ids(plain) == encode(tokenizer, template.question_head + plain + template.question_tail)


def by_chunk(store) -> dict[str, torch.Tensor]:
    """chunk id -> its stored prefix KV"""
    return {store.attrs(k)["chunk_id"]: store.get(k) for k in chunk_keys(store)}


def test_compute_dtype_is_the_models_dtype_while_building(built, tmp_path):
    """--compute-dtype (default float32 on the CPU, bfloat16 on CUDA, as kvf run's --dtype) is the dtype the
    model computes KVs in: a bfloat16 build stores bfloat16 arithmetic (off the float32 build's values by
    bfloat16's rounding, not more), records it in the manifest, and Ray workers are handed it too."""
    from kvf.pipeline.workflows.distributed import KVWorkerImpl
    tiny = tiny_llama_dir(tmp_path / "tiny", built.model_ref.tokenizer)
    stores = {}
    for name in ("float32", "bfloat16"):
        ws = tmp_path / name
        build_cache(opts_for(tmp_path, built.corpus, workspace=ws, model=str(tiny), dtype="float32",
                             compute_dtype=None if name == "float32" else name), QUIET)
        assert json.loads((ws / "manifest.json").read_text())["compute_dtype"] == name
        stores[name] = by_chunk(open_store(str(ws / "kv.zarr")))
    assert sorted(stores["float32"]) == sorted(stores["bfloat16"]) and stores["float32"]
    for chunk_id, full in stores["float32"].items():
        half = stores["bfloat16"][chunk_id]
        assert not torch.equal(full, half)
        assert (half - full).abs().max() <= 0.05 * full.abs().max()
    worker = KVWorkerImpl(str(tiny), str(tmp_path / "bfloat16" / "kv.zarr"), "float32", "cpu", (), 1, "bfloat16")
    assert worker.builder.engine.model.dtype == torch.bfloat16


def test_one_store_keeps_each_compute_dtypes_entries_apart(built, tmp_path, capsys, monkeypatch):
    """Entries are keyed by the dtype that computed them. A build resumed with another --compute-dtype, or a
    run on a GPU (bfloat16) over a store built on the CPU, found every float32 entry under its key and used
    it: the manifest said bfloat16 over float32 bytes, and entries computed later mixed the two. Now each
    dtype's entries are its own, equal to a store built in that dtype alone; a run in another dtype than the
    build's says in one line that it computes its own; gc --keep-workspace keeps both."""
    from kvf.pipeline.workflows.gc import collect
    tiny = tiny_llama_dir(tmp_path / "tiny", built.model_ref.tokenizer)
    alone = {}
    for name in ("float32", "bfloat16"):
        build_cache(opts_for(tmp_path, built.corpus, workspace=tmp_path / f"alone-{name}", model=str(tiny),
                             dtype="float32", compute_dtype=name), QUIET)
        alone[name] = open_store(str(tmp_path / f"alone-{name}" / "kv.zarr"))
    shared = tmp_path / "ws"
    for name in ("float32", "bfloat16"):   # the same workspace and store, resumed in another dtype
        build_cache(opts_for(tmp_path, built.corpus, workspace=shared, model=str(tiny), dtype="float32",
                             compute_dtype=name), QUIET)
    store = open_store(str(shared / "kv.zarr"))
    assert sorted(store.keys()) == sorted(set(alone["float32"].keys()) | set(alone["bfloat16"].keys()))
    assert not set(alone["float32"].keys()) & set(alone["bfloat16"].keys())
    for one in alone.values():
        for key in one.keys():
            assert torch.equal(store.get(key), one.get(key))

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": QUESTION, "passages": ["doc0.txt", "mountains.md"]}) + "\n")
    for dtype in ("bfloat16", "float32"):   # the manifest's (the last build's), then another
        code, _, err = run_cli(["run", "-w", shared, "-q", questions, "-m", "reuse", "--model", tiny, "--dtype", dtype,
                                 "--max-new-tokens", 2, "-o", tmp_path / f"{dtype}.jsonl"], capsys, monkeypatch)
        warnings = [line for line in err.splitlines() if "were built in" in line]
        assert code == 0 and len(warnings) == (dtype == "float32"), err
    assert "built in bfloat16; this run computes in float32" in warnings[0] and "--dtype bfloat16" in warnings[0]
    import kvf   # the Python API takes the dtype too, and says the same
    for dtype in ("bfloat16", "float32"):
        kvf.open_workspace(shared, model=str(tiny), dtype=dtype)
        warnings = [line for line in capsys.readouterr().err.splitlines() if "were built in" in line]
        assert len(warnings) == (dtype == "float32")
    assert 'pass open_workspace(..., dtype="bfloat16") to use the built ones' in warnings[0]

    collect(str(shared / "kv.zarr"), None, None, shared, True, QUIET)
    assert sorted(open_store(str(shared / "kv.zarr")).keys()) == sorted(store.keys())


@pytest.mark.parametrize("native", [False, True])
def test_half_precision_on_a_cpu_without_it_is_said_up_front(native, built, tmp_path, capsys, monkeypatch):
    """bfloat16 matmul on a CPU without native support is 64x float32's time for one SmolLM2 projection here:
    a build or run asked for it crawled with no word why. One warning line, before any work; none where the
    CPU has it, and none for float32."""
    from kvf.pipeline.workflows import devices
    monkeypatch.setattr(devices, "native_half_matmul", lambda dtype: native)
    with pytest.raises(KvfError, match="--batch 0"):   # refused after the dtype is settled, before any work
        build_cache(opts_for(tmp_path, built.corpus, compute_dtype="bfloat16", batch=0), QUIET)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ([] if native else [lines[0]])
    if not native:
        assert lines[0].startswith("warning: --compute-dtype bfloat16 on this CPU") and "leave --compute-dtype out" in lines[0]
    devices.warn_if_slow("cpu", torch.float32)
    devices.warn_if_slow("cuda", torch.bfloat16)
    assert capsys.readouterr().err == ""


def stop_kv_stage_after(monkeypatch, n: int) -> None:
    """The next build stops (KeyboardInterrupt) after its KV stage has committed n entries."""
    from kvf.pipeline.workflows.build import EntryBuilder
    compute, calls = EntryBuilder.compute, []

    def stopping(self, *args, **kwargs):
        if len(calls) == n:
            raise KeyboardInterrupt
        calls.append(1)
        return compute(self, *args, **kwargs)
    monkeypatch.setattr(EntryBuilder, "compute", stopping)


def stage_names(summary) -> set[str]:
    return {s.name for s in summary.stages}


def test_a_build_stopped_in_its_kv_stage_resumes_without_building_its_indexes_again(tmp_path, short_docs, monkeypatch):
    """Index digests were recorded only in the manifest, written when a build ends: a build stopped in its KV
    stage built BM25, the dense index's neighbours and (before the dense slices) its embeddings again on resume.
    indexes.json records each index as it ends."""
    corpus = write_corpus(tmp_path, short_docs)
    opts = opts_for(tmp_path, corpus, bm25=True, dense=True)
    with monkeypatch.context() as m:
        stop_kv_stage_after(m, 2)
        with pytest.raises(KeyboardInterrupt):
            build_cache(opts, QUIET)
    assert not (tmp_path / "ws" / "manifest.json").exists()
    resumed = build_cache(opts, QUIET)
    assert stage_names(resumed) == {"chunk", "kv prefix"}
    manifest = json.loads((tmp_path / "ws" / "manifest.json").read_text())
    table = read_chunks_table(tmp_path / "ws" / "chunks.parquet")
    from kvf.pipeline.workflows.build import index_digests
    assert manifest["indexes"] == index_digests(manifest, [c.chunk_id for c in table], [c.title for c in table])


def test_neighbour_probes_other_than_the_workspaces_search_again_and_the_default_keeps_older_workspaces(tmp_path,
                                                                                                    short_docs):
    """--neighbour-probes is a workspace setting: another number of lists read searches the neighbours again (they
    key the fusion entries) and is kept in the manifest; the default's digest is the one made before the flag
    existed, so older workspaces keep their neighbours."""
    from kvf.pipeline.retrieval.neighbours import IVF_PROBES
    from kvf.pipeline.workflows.build import dense_digest
    from kvf.pipeline.workflows.workspace import ids_digest
    corpus = write_corpus(tmp_path, short_docs)
    build_cache(opts_for(tmp_path, corpus, dense=True), QUIET)
    manifest = json.loads((tmp_path / "ws" / "manifest.json").read_text())
    assert manifest["neighbour_probes"] == IVF_PROBES
    assert dense_digest("set", None, 2, IVF_PROBES) == dense_digest("set", None, 2, None) == ids_digest(["set", "default", 2])
    assert dense_digest("set", None, 2, 4) != dense_digest("set", None, 2, IVF_PROBES)
    assert "neighbours" not in stage_names(build_cache(opts_for(tmp_path, corpus, dense=True), QUIET))
    said = io.StringIO()
    again = build_cache(opts_for(tmp_path, corpus, dense=True, neighbour_probes=4), Console(file=said, width=300))
    assert "neighbours" in stage_names(again)
    assert "--neighbour-probes 4 reads lists of the approximate search" in said.getvalue()   # a small corpus: exact
    manifest = json.loads((tmp_path / "ws" / "manifest.json").read_text())
    assert manifest["neighbour_probes"] == 4
    assert "neighbours" not in stage_names(build_cache(opts_for(tmp_path, corpus, dense=True), QUIET))  # left out: kept


def test_exact_neighbours_up_to_0_searches_approximately_and_every_list_read_finds_the_exact_neighbours(tmp_path,
                                                                                                    short_docs):
    """--exact-neighbours-up-to is a workspace setting: 0 makes a small corpus's search the approximate one a large
    corpus gets (to see what it finds); it searches again, is kept in the manifest, and reading every list of it
    finds the exact search's neighbours."""
    from kvf.pipeline.retrieval.neighbours import EXACT_UP_TO, load_neighbours
    from kvf.pipeline.workflows.build import dense_digest
    corpus = write_corpus(tmp_path, short_docs)
    build_cache(opts_for(tmp_path, corpus, dense=True), QUIET)
    exact = load_neighbours(tmp_path / "ws" / "neighbours.npz")
    assert json.loads((tmp_path / "ws" / "manifest.json").read_text())["exact_neighbours_up_to"] == EXACT_UP_TO
    assert dense_digest("set", None, 2, None, EXACT_UP_TO) == dense_digest("set", None, 2, None)
    assert len({dense_digest("set", None, 2, 4), dense_digest("set", None, 2, None, 4),
                dense_digest("set", None, 2, None, 0)}) == 3
    approximate = build_cache(opts_for(tmp_path, corpus, dense=True, exact_neighbours_up_to=0, neighbour_probes=10_000),
                              QUIET)
    assert "neighbours" in stage_names(approximate)
    assert json.loads((tmp_path / "ws" / "manifest.json").read_text())["exact_neighbours_up_to"] == 0
    every_list = load_neighbours(tmp_path / "ws" / "neighbours.npz")
    assert every_list.ids == exact.ids and np.array_equal(every_list.rows, exact.rows)
    assert "neighbours" not in stage_names(build_cache(opts_for(tmp_path, corpus, dense=True), QUIET))  # left out: kept


def test_indexes_only_builds_chunks_indexes_and_neighbours_but_no_kv_and_a_later_build_computes_them(tmp_path,
                                                                                                    short_docs):
    """--indexes-only: a workspace `kvf run` can answer from (its KVs computed as questions need them), no entry
    stored and none promised in the manifest; the same build without it then computes only the KVs."""
    corpus = write_corpus(tmp_path, short_docs)
    summary = build_cache(opts_for(tmp_path, corpus, dense=True, variants=("prefix", "fusion"), indexes_only=True), QUIET)
    assert stage_names(summary) == {"chunk", "dense index", "neighbours", "kv"} and summary.entries_written == 0
    manifest = json.loads((tmp_path / "ws" / "manifest.json").read_text())
    assert manifest["variants"] == [] and (tmp_path / "ws" / "neighbours.npz").is_file()
    assert chunk_keys(open_store(tmp_path / "ws" / "kv.zarr")) == []
    later = build_cache(opts_for(tmp_path, corpus, dense=True, variants=("prefix", "fusion")), QUIET)
    assert stage_names(later) == {"chunk", "kv prefix", "kv fusion"} and later.entries_written > 0
    assert json.loads((tmp_path / "ws" / "manifest.json").read_text())["variants"] == ["fusion", "prefix"]
    with pytest.raises(KvfError, match="--extras-for .* --indexes-only"):
        build_cache(opts_for(tmp_path, corpus, indexes_only=True, extras_for=("cachecraft",)), QUIET)


def test_top_neighbours_reading_every_list_is_the_exact_search_and_fewer_lists_find_fewer():
    """Above the exact limit, `probes` lists are read: all of them is the exact search, one finds fewer."""
    from test_retrieval import clustered_unit_vectors
    from kvf.errors import KvfError
    from kvf.pipeline.retrieval.neighbours import top_neighbours
    vectors = clustered_unit_vectors(2500)
    ids = [f"c{i}" for i in range(len(vectors))]
    exact = top_neighbours(vectors, ids, 10)
    every_list = top_neighbours(vectors, ids, 10, exact_up_to=100, probes=50)
    one_list = top_neighbours(vectors, ids, 10, exact_up_to=100, probes=1)
    assert np.array_equal(every_list.rows, exact.rows)
    assert not np.array_equal(one_list.rows, exact.rows)
    with pytest.raises(KvfError, match="--neighbour-probes must be at least 1"):
        top_neighbours(vectors, ids, 10, exact_up_to=100, probes=0)


def test_an_index_rebuilt_by_a_stopped_build_is_not_trusted_for_the_chunks_it_was_not_built_from(tmp_path, short_docs,
                                                                                                monkeypatch):
    """A document added, a build stopped in its KV stage (its BM25 index already holds the new chunks, the manifest
    still names the old set), the document removed again: the manifest's digest matched the chunks table again,
    and BM25 over the other set was kept and searched. Now it is built again."""
    from kvf.pipeline.retrieval.bm25 import BM25Searcher
    corpus = write_corpus(tmp_path, short_docs)
    opts = opts_for(tmp_path, corpus, bm25=True, dense=False)
    build_cache(opts, QUIET)
    added = corpus / "added.txt"
    added.write_text("Vellmora is a harbour town whose lighthouse keepers breed grey falcons.")
    with monkeypatch.context() as m:
        stop_kv_stage_after(m, 0)
        with pytest.raises(KeyboardInterrupt):
            build_cache(opts, QUIET)
    added.unlink()
    again = build_cache(opts, QUIET)
    assert "bm25 index" in stage_names(again)
    table = {c.chunk_id for c in read_chunks_table(tmp_path / "ws" / "chunks.parquet")}
    hits = BM25Searcher(tmp_path / "ws" / "bm25").search("Vellmora lighthouse falcons", 5)
    assert {chunk_id for chunk_id, _ in hits} <= table   # the removed document's chunk is not found



def test_a_title_edited_in_the_corpus_is_indexed_again_by_bm25(tmp_path):
    """BM25 indexes a chunk's title with its text, and its digest held the chunk ids alone: a document whose title
    was edited (no chunk id changes) kept its old title in BM25, found by the old word and not by the new, while
    search showed the new. A workspace whose digest is the chunk set alone (built before titles were in it) is
    fresh for kvf run, and its next build indexes BM25 again."""
    from kvf.pipeline.retrieval.bm25 import BM25Searcher
    from kvf.pipeline.workflows.run import stale_indexes
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rows = [{"id": "a", "title": "Zorblat", "text": "The river runs north to the sea."},
            {"id": "b", "title": "Mountains", "text": "Snow covers the peaks in winter."}]
    (corpus / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = opts_for(tmp_path, corpus, bm25=True, dense=False, indexes_only=True)
    build_cache(opts, QUIET)
    ws = tmp_path / "ws"
    rows[0]["title"] = "Quixley"
    (corpus / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "bm25 index" in stage_names(build_cache(opts, QUIET))
    assert BM25Searcher(ws / "bm25").search("Quixley", 1) and not BM25Searcher(ws / "bm25").search("Zorblat", 1)
    assert "bm25 index" not in stage_names(build_cache(opts, QUIET))    # nothing changed: not again
    # a workspace whose record holds the chunk set alone
    manifest = json.loads((ws / "manifest.json").read_text())
    legacy = ids_digest([c.chunk_id for c in read_chunks_table(ws / "chunks.parquet")])
    manifest["indexes"]["bm25"] = legacy
    (ws / "manifest.json").write_text(json.dumps(manifest))
    (ws / "indexes.json").write_text(json.dumps(manifest["indexes"]))
    assert stale_indexes(Workspace(ws), manifest) == []
    assert "bm25 index" in stage_names(build_cache(opts, QUIET))

def test_a_ray_driver_without_a_gpu_embeds_the_dense_index_on_its_cpu(built, tmp_path, monkeypatch):
    """With --ray, --device cuda names the workers' device; a driver without a GPU embedded on cuda and failed."""
    from rich.console import Console
    from kvf.pipeline.workflows.build import stage_indexes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    opts = opts_for(tmp_path, built.corpus, dense=True, device="cuda", ray="local")
    console = Console(file=io.StringIO(), width=300)
    state = {}
    stage_indexes(opts, Workspace(tmp_path / "ws"), ChunkTable(built.ws.chunks_path), state, console)
    assert state["dense"] and (tmp_path / "ws" / "neighbours.npz").is_file()
    assert "embeds the dense index on its CPU" in console.file.getvalue()


def copy_build(built, dest: Path) -> BuildOptions:
    """A private copy of the module's workspace and store."""
    shutil.copytree(built.ws.root, dest / "ws")
    return replace(built.opts, workspace=dest / "ws", store=str(dest / "ws" / "kv.zarr"))


def test_a_bad_row_late_in_a_grown_corpus_is_one_line_and_leaves_the_workspace_as_it_was(built, tmp_path, capsys,
                                                                                         monkeypatch):
    """Stage 1 reads the corpus as it chunks it (it need not fit in memory), so a bad JSONL row is found after
    earlier documents were chunked: it is one line naming the file and line, and the workspace's files are
    the last build's, byte for byte, with no temp file beside them."""
    opts = copy_build(built, tmp_path)
    corpus = tmp_path / "corpus"
    shutil.copytree(built.corpus, corpus)
    (corpus / "zz-more.jsonl").write_text(json.dumps({"id": "new1", "text": "Orvath Lenn keeps bees."}) + "\n"
                                          + '{"id": "new2", "text": unquoted}\n')
    ws = Path(opts.workspace)
    before = {p.name: p.read_bytes() for p in ws.iterdir() if p.is_file()}
    code, _, err = run_cli(["build-cache", corpus, "--workspace", ws], capsys, monkeypatch)
    assert_one_line(code, err, "zz-more.jsonl:2", "not valid JSON")
    assert {p.name: p.read_bytes() for p in ws.iterdir() if p.is_file()} == before


def test_corrupt_or_truncated_entry_is_detected_reported_and_rebuilt(built, answerer, tmp_path, capsys, monkeypatch):
    opts = copy_build(built, tmp_path)
    store = open_store(opts.store)
    keys = sorted(chunk_keys(store))
    flipped, truncated = keys[0], keys[1]
    layer_file = lambda key, layer: Path(opts.store) / key[:2] / key / "kv" / f"c.{layer}.0.0.0.0"  # noqa: E731
    data = bytearray(layer_file(flipped, 3).read_bytes())
    data[100] ^= 0x40
    layer_file(flipped, 3).write_bytes(bytes(data))
    with open(layer_file(truncated, 0), "r+b") as f:
        f.truncate(50)
    fresh = open_store(opts.store, readonly=True)
    assert {k: p for k, p in fresh.verify()} == {flipped: "layer 3 checksum mismatch",
                                                 truncated: f"layer 0 truncated (50 of {fresh.header(truncated).layer_nbytes} bytes)"}
    # `kvf store verify` names both and exits 1
    code, out, _ = run_cli(["store", "verify", "--store", opts.store], capsys, monkeypatch)
    assert code == 1 and flipped in out and truncated in out and "2 of" in out
    # a fusion never uses them silently: the source raises, pipelined or not
    chunk = {c.chunk_id: c for c in built.chunks}[fresh.attrs(flipped)["chunk_id"]]
    prompt = answerer.prompt([chunk.token_ids], QUESTION)
    for pipeline, readers in ((False, None), (True, None), (True, 3)):
        source = StoreKVSource(fresh, [flipped], answerer.transformer.n_layers, pipeline=pipeline, readers=readers)
        with pytest.raises(CorruptEntry, match="checksum"):
            get_method("reuse").prefill(answerer.engine, prompt, source)
        source.close()
    with pytest.raises(CorruptEntry, match="truncated"):
        fresh.get_layer(truncated, 0)
    # --delete-bad, then a rebuild recomputes exactly those two
    code, _, _ = run_cli(["store", "verify", "--store", opts.store, "--delete-bad"], capsys, monkeypatch)
    assert code == 1
    summary = build_cache(opts, QUIET)
    assert summary.entries_written == 2
    repaired = open_store(opts.store, readonly=True)
    assert repaired.verify() == []
    original = open_store(built.summary.store, readonly=True)
    assert entry_bytes(repaired, flipped) == entry_bytes(original, flipped)


def test_extras_for_cachecraft_adds_summaries_to_existing_entries_and_sticks(built, tmp_path, monkeypatch):
    from kvf.pipeline.fusion.methods.cachecraft import EXTRAS
    opts = copy_build(built, tmp_path)
    summary = build_cache(replace(opts, extras_for=("cachecraft",)), QUIET)
    assert summary.entries_written == len(built.chunks)  # entries without summaries were replaced
    store, original = open_store(opts.store, readonly=True), open_store(built.summary.store, readonly=True)
    for key in chunk_keys(store):
        extras = store.get_extras(key)
        assert set(extras) == set(EXTRAS) and extras["cc_inter"].shape == (1, store.header(key).tokens)
        assert (store.get(key) - original.get(key)).abs().max().item() <= 1e-4  # same KV, one prefill
    assert Workspace(opts.workspace).manifest()["extras_for"] == ["cachecraft"]
    # later builds without the flag keep the promise: nothing missing, no model work
    monkeypatch.setattr(ModelRef, "load", lambda *a, **k: pytest.fail("model loaded"))
    assert build_cache(opts, QUIET).entries_written == 0


def test_two_shards_into_one_file_url_store_equal_one_full_build(built, tmp_path):
    path = tmp_path / "sharded.zarr"
    url = "file://" + str(path)
    first = build_cache(opts_for(tmp_path, built.corpus, workspace=tmp_path / "ws0", store=url, dtype="float32",
                                 shard=(0, 2)), QUIET)
    store = open_store(url, readonly=True)
    mine = [c for c in built.chunks if in_shard(c.chunk_id, (0, 2))]
    assert 0 < len(mine) < len(built.chunks)
    assert set(chunk_keys(store)) == expected_keys(built.model_ref, mine)
    assert first.entries_written == len(mine) and first.entries_skipped == 0
    assert Workspace(tmp_path / "ws0").manifest()["store"] == url
    second = build_cache(opts_for(tmp_path, built.corpus, workspace=tmp_path / "ws1", store=url, dtype="float32",
                                  shard=(1, 2)), QUIET)
    assert second.entries_written == len(built.chunks) - len(mine)
    assert (path / "zarr.json").is_file()  # the URL's path, not a folder named "file:"
    full, sharded = open_store(built.summary.store, readonly=True), open_store(str(path), readonly=True)
    assert sharded.keys() == full.keys()
    for key in full.keys():
        assert entry_bytes(sharded, key) == entry_bytes(full, key), key


def test_a_build_beside_another_goes_in_reverse_and_skips_what_the_other_stored(built, tmp_path, monkeypatch):
    """Two build-caches of one workspace at once (a second terminal): the second computed every entry the first
    did, in the same order, and said "entries written 0, already present 0". A build that finds another
    computing KVs builds in reverse and asks the store again every few chunks, so the two meet in the middle; the
    store is still a one-go build's, byte for byte."""
    import kvf.pipeline.workflows.build as build_module
    monkeypatch.setattr(build_module, "RECHECK_EVERY", 2, raising=False)
    opts = opts_for(tmp_path, built.corpus, dtype="float32")
    full = open_store(built.summary.store, readonly=True)
    order = [c.chunk_id for c in built.chunks]          # the plan's order: the chunks table's
    other_stores = order[: len(order) // 2]             # what the other build, going forward, stores meanwhile
    assert len(other_stores) >= 2
    computed = []
    real_compute = EntryBuilder.compute

    def compute(builder, variant, chunk, neighbours, by_id):
        if not computed:   # the other build is under way: the first half of the plan lands while this one runs
            for chunk_id in other_stores:
                key = builder.key("prefix", by_id[chunk_id], None)
                builder.store.put(key, full.get(key), attrs={"variant": "prefix", "chunk_id": chunk_id})
        computed.append(chunk.chunk_id)
        return real_compute(builder, variant, chunk, neighbours, by_id)
    monkeypatch.setattr(EntryBuilder, "compute", compute)
    (tmp_path / "ws").mkdir()
    with Workspace(tmp_path / "ws").kv_stage_turn() as first:   # held by the other build
        assert first
        summary = build_cache(opts, QUIET)
    assert computed == order[len(other_stores):][::-1]   # from the end, and none of what the other stored
    assert (summary.entries_written, summary.entries_found) == (len(order) - len(other_stores), len(other_stores))
    shown = Console(record=True, width=300)
    shown.print(build_module.summary_table(summary))   # it said "entries written 0 (0.0 MiB), already present 0"
    assert (f"already present 0, stored meanwhile by another writer {len(other_stores)}"
            in " ".join(shown.export_text().split()))
    store = open_store(summary.store, readonly=True)
    assert store.keys() == full.keys()
    for key in full.keys():
        assert entry_bytes(store, key) == entry_bytes(full, key), key


@pytest.mark.parametrize("behind", [False, True], ids=["writes-inline", "writes-behind"])
def test_disk_full_mid_build_keeps_committed_entries(built, tmp_path, capsys, monkeypatch, behind):
    """Also with the writes behind (a GPU's or an object store's build): the same one line, the same entries
    committed (the writes queued after the failed one are dropped), and a resumed build completes the store."""
    from kvf.pipeline.workflows.build import EntryBuilder
    monkeypatch.setattr(EntryBuilder, "writes_behind", lambda self: behind)
    layer_writes = {"n": 0}
    real_write = LocalFS.write_file

    def write_file(self, path, data):
        if f"{os.sep}kv{os.sep}c." in path:
            layer_writes["n"] += 1
            if layer_writes["n"] == 3 * 30 + 5:  # S and two chunks committed, the third half-written
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, path, data)

    monkeypatch.setattr(LocalFS, "write_file", write_file)
    ws = tmp_path / "ws"
    code, _, err = run_cli(["build-cache", built.corpus, "--workspace", ws, "--chunk-tokens", CHUNK_TOKENS,
                             "--no-bm25", "--no-dense"], capsys, monkeypatch)
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("kvf: error: disk full while writing entry")
    store = open_store(str(ws / "kv.zarr"), readonly=True)
    assert len(chunk_keys(store)) == 2 and store.verify() == []
    assert os.listdir(ws / "kv.zarr" / ".kvf-tmp") == ["zarr.json"]  # the half-written entry is gone
    committed = {k: entry_bytes(store, k) for k in store.keys()}
    monkeypatch.setattr(LocalFS, "write_file", real_write)
    summary = build_cache(opts_for(tmp_path, built.corpus), QUIET)
    assert summary.entries_written == len(built.chunks) - 2
    after = open_store(str(ws / "kv.zarr"), readonly=True)
    assert after.verify() == [] and len(chunk_keys(after)) == len(built.chunks)
    assert {k: entry_bytes(after, k) for k in committed} == committed


def small_corpus(tmp_path: Path, short_docs) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(short_docs[:2]):
        (corpus / f"doc{i}.txt").write_text(text)
    return corpus


def test_entries_do_not_depend_on_which_run_computed_s(tmp_path, short_docs):
    """float16: a chunk computed right after S was (in this process) equals one computed later from
    the stored S, so a resumed build writes the same bytes as a one-go build."""
    opts = opts_for(tmp_path, small_corpus(tmp_path, short_docs))
    build_cache(opts, QUIET)
    store = open_store(str(opts.workspace / "kv.zarr"))
    one_go = {k: entry_bytes(store, k) for k in chunk_keys(store)}
    for key in one_go:  # keep S, drop every chunk: the rebuild reads S back from the store
        store.delete(key)
    assert build_cache(opts, QUIET).entries_written == len(one_go) == 2
    rebuilt = open_store(str(opts.workspace / "kv.zarr"), readonly=True)
    assert {k: entry_bytes(rebuilt, k) for k in one_go} == one_go


def test_a_later_build_may_leave_the_corpus_out(tmp_path, short_docs, capsys, monkeypatch):
    """`kvf build-cache -w WS` (documents added to the corpus, CORPUS not typed again) said "Missing argument
    'corpus'". It now reads the documents the workspace was built from, wherever it runs, and builds only the new
    ones. Where those documents are gone, or a workspace does not yet exist, it says so in one line."""
    corpus, ws = small_corpus(tmp_path, short_docs), tmp_path / "ws"
    code, _, err = run_cli(["build-cache", corpus, "-w", ws, "--chunk-tokens", CHUNK_TOKENS, "--no-bm25", "--no-dense"],
                           capsys, monkeypatch)
    assert code == 0, err
    (corpus / "owls.txt").write_text("Owls hunt at night and find mice by sound alone, even under snow.")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, _, err = run_cli(["build-cache", "-w", ws], capsys, monkeypatch)
    assert code == 0 and f"building from {corpus}, the documents {ws} was built from" in err, err
    assert set(Workspace(ws).doc_chunks()) == {"doc0.txt", "doc1.txt", "owls.txt"}
    corpus.rename(tmp_path / "moved")
    code, _, err = run_cli(["build-cache", "-w", ws], capsys, monkeypatch)
    assert_one_line(code, err, f"the documents {ws} was built from, {corpus}, are not there any more",
                    f"kvf build-cache DOCS -w {ws}")
    manifest = json.loads((ws / "manifest.json").read_text())
    del manifest["corpus_absolute"]   # a workspace an older kvf built: its corpus as that build was given it
    (ws / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli(["build-cache", "-w", ws], capsys, monkeypatch)
    assert_one_line(code, err, f"names its documents only as {corpus}, from where that build ran")
    code, _, err = run_cli(["build-cache", "-w", tmp_path / "new"], capsys, monkeypatch)
    assert_one_line(code, err, "CORPUS is missing: pass the documents to build from")
    assert not (tmp_path / "new").exists()


def test_rerun_without_format_uses_the_workspace_hdf5_store(tmp_path, short_docs, capsys, monkeypatch):
    args = ["build-cache", small_corpus(tmp_path, short_docs), "--workspace", tmp_path / "ws",
            "--chunk-tokens", CHUNK_TOKENS, "--no-bm25", "--no-dense"]
    code, _, err = run_cli([*args, "--format", "hdf5"], capsys, monkeypatch)
    assert code == 0, err
    monkeypatch.setattr(ModelRef, "load", lambda *a, **k: pytest.fail("model loaded"))
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert re.search(r"entries written 0 .*already present 2", err)
    assert not (tmp_path / "ws" / "kv.zarr").exists()
    assert Workspace(tmp_path / "ws").manifest()["format"] == "hdf5"


def test_rerun_without_store_keeps_building_into_the_workspace_store_elsewhere(tmp_path, short_docs, capsys, monkeypatch):
    # a workspace built with --store elsewhere, rebuilt after a new document without --store, used to start
    # an empty WORKSPACE/kv.zarr and recompute every entry there
    corpus, shared, ws = small_corpus(tmp_path, short_docs), tmp_path / "shared.zarr", tmp_path / "ws"
    args = ["build-cache", corpus, "--workspace", ws, "--chunk-tokens", CHUNK_TOKENS, "--no-bm25", "--no-dense"]
    code, _, err = run_cli([*args, "--store", shared], capsys, monkeypatch)
    assert code == 0, err
    (Path(corpus) / "added.txt").write_text("Added later: the lighthouse keeper was Ada Vole.")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert re.search(r"entries written 1 .*already present 2", err)
    assert not (ws / "kv.zarr").exists()
    assert Workspace(ws).store_location() == str(shared)
    # another --format is a switch, said once on stderr; the store left behind is untouched
    before = sorted(p.name for p in shared.rglob("*"))
    code, _, err = run_cli([*args, "--format", "hdf5"], capsys, monkeypatch)
    assert code == 0, err
    assert f"switches from its store {shared} to {ws / 'kv.h5'}" in " ".join(err.split())
    assert re.search(r"entries written 3 .*already present 0", err)
    assert Workspace(ws).store_location() == str(ws / "kv.h5")
    assert sorted(p.name for p in shared.rglob("*")) == before


def test_disk_full_on_workspace_files_is_one_line_and_leaves_no_temp_file(built, tmp_path, capsys, monkeypatch):
    def full(writer):   # the writer has opened its file and written Parquet's magic bytes: then the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("kvf.pipeline.retrieval.chunking.ChunkTableWriter._flush", full)
    ws = tmp_path / "ws"
    ws.mkdir()   # the user's folder: kept (a folder this build created goes, test_catalogue)
    code, _, err = run_cli(["build-cache", built.corpus, "--workspace", ws, "--no-bm25", "--no-dense"],
                            capsys, monkeypatch)
    assert_one_line(code, err, f"--workspace {ws}", "disk full")
    # no chunks table, no half-written temp file (the build's lock file stays, empty, for the next build)
    assert sorted(p.name for p in ws.iterdir()) == [".kvf-build.lock", "kv.zarr"]


# ---- killed mid-build: resume, readers during the build, equality with a one-go build -------------
def entry_files(store_path: Path, key: str) -> dict[str, tuple[int, int]]:
    entry = store_path / key[:2] / key
    return {str(p.relative_to(entry)): (p.stat().st_mtime_ns, p.stat().st_ino) for p in entry.rglob("*") if p.is_file()}


@pytest.mark.long
def test_sigkill_midway_then_rerun_resumes_and_equals_one_go_build(tmp_path):
    make_synthetic(tmp_path / "data", n_questions=2, passages_per_question=3, seed=1)
    corpus = tmp_path / "data" / "corpus"
    build_args = ["build-cache", corpus, "--chunk-tokens", CHUNK_TOKENS, "--no-bm25", "--no-dense"]
    ws, store_path = tmp_path / "ws", tmp_path / "ws" / "kv.zarr"
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([*KVF, *map(str, build_args), "--workspace", str(ws)],
                            env=SUB_ENV, stdout=log, stderr=subprocess.STDOUT)
    reads, seen_sizes, store, deadline = 0, set(), None, time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if store is None and (store_path / "zarr.json").is_file():
                store = open_store(str(store_path), readonly=True)
            if store is not None:
                keys = store.keys()
                seen_sizes.add(len(keys))
                for key in keys:  # a reader loads whole entries (checksummed) while the build appends
                    store.get(key)
                    reads += 1
                if len(keys) >= 4:  # S and at least 3 chunks committed
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.02)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-2000:]
    assert reads >= 4 and len(seen_sizes) >= 2  # read while the store grew under the reader
    store = open_store(str(store_path), readonly=True)
    assert store.verify() == []  # committed entries are whole; a half-written one is invisible
    before = {k: entry_files(store_path, k) for k in store.keys()}

    rerun = kvf_cli(*build_args, "--workspace", ws)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    n_chunks = len(read_chunks_table(ws / "chunks.parquet"))
    assert len(before) - 1 < n_chunks  # it really was killed midway
    written, present = map(int, re.search(r"entries written (\d+) .*already present (\d+)", rerun.stderr).groups())
    assert (written, present) == (n_chunks - (len(before) - 1), len(before) - 1)  # nothing recomputed
    assert {k: entry_files(store_path, k) for k in before} == before  # committed files untouched
    verify = kvf_cli("store", "verify", "--store", store_path)
    assert verify.returncode == 0 and f"{n_chunks + 1} entries OK" in verify.stdout
    open_store(str(store_path)).gc()  # the killed writer's temp data goes
    assert open_store(str(store_path), readonly=True).info()["temp_items"] == 0

    one_go = kvf_cli(*build_args, "--workspace", tmp_path / "ws_one_go")
    assert one_go.returncode == 0, one_go.stderr[-2000:]
    resumed, reference = open_store(str(store_path), readonly=True), open_store(str(tmp_path / "ws_one_go" / "kv.zarr"), readonly=True)
    assert resumed.keys() == reference.keys()
    for key in reference.keys():
        assert entry_bytes(resumed, key) == entry_bytes(reference, key), key


# ---- the real CLI: variants, summary, search, store info ------------------------------------------
def test_cli_builds_prefix_and_fusion_with_cachecraft_extras(tmp_path, short_docs):
    write_corpus(tmp_path, short_docs)
    ws = tmp_path / "ws"
    result = kvf_cli("build-cache", "corpus", "--workspace", "ws", "--chunk-tokens", CHUNK_TOKENS, "--neighbours", 2,
                     "--variant", "prefix,fusion", "--extras-for", "cachecraft", "--no-bm25", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    # the store inside the workspace is named relative to it: a moved workspace keeps using it
    assert json.loads((ws / "manifest.json").read_text())["store"] == "kv.zarr"
    assert "Traceback" not in result.stderr
    assert result.stderr.lstrip(" ").startswith("build-cache:"), result.stderr[:200]  # piped: no bars, no empty lines
    for text in ("kv prefix", "kv fusion", "dense index", "tokens/s", "items/s", "entries written"):
        assert text in result.stderr, text
    chunks = read_chunks_table(ws / "chunks.parquet")
    neighbours = load_neighbours(ws / "neighbours.npz")
    store = open_store(str(ws / "kv.zarr"), readonly=True)
    variants = [store.attrs(k)["variant"] for k in store.keys()]
    assert sorted(variants) == sorted(["system"] + ["prefix"] * len(chunks) + ["fusion"] * len(chunks))
    for key in store.keys():
        attrs = store.attrs(key)
        if attrs["variant"] == "fusion":  # attended to exactly its stored neighbours, in order
            assert attrs["neighbours"] == neighbours[attrs["chunk_id"]] and len(attrs["neighbours"]) == 2
            assert store.get_extras(key)["cc_inter"].shape == (3, store.header(key).tokens)  # S + 2 neighbours
    info = kvf_cli("store", "info", "--store", ws / "kv.zarr")
    assert info.returncode == 0 and f"fusion: {len(chunks)}, prefix: {len(chunks)}, system: 1" in info.stdout
    assert re.search(r"free on its disk +│ [\d.]+ [KMGT]iB \(about [\d,]+ more tokens\)", info.stdout), info.stdout


def test_cli_missing_corpus_is_one_line_without_traceback(tmp_path):
    result = kvf_cli("build-cache", tmp_path / "nope", "--workspace", tmp_path / "ws")
    assert_one_line(result.returncode, result.stderr, "does not exist")
    assert not (tmp_path / "ws").exists()  # refused before touching anything


# ---- bad input: one line, exit 1, no traceback ----------------------------------------------------
def bad_corpus(tmp_path: Path, kind: str) -> Path:
    corpus = tmp_path / "corpus"
    if kind == "missing":
        return corpus
    corpus.mkdir()
    if kind == "unsupported":
        (corpus / "table.xlsx").write_bytes(b"PK\x03\x04")
        (corpus / "paper.docx").write_bytes(b"PK\x03\x04")
    return corpus


@pytest.mark.parametrize("kind,fragment", [("missing", "does not exist"), ("empty", "is empty"),
                                           ("unsupported", "has no supported files")])
def test_bad_corpus_is_refused_before_the_workspace_is_touched(tmp_path, capsys, monkeypatch, kind, fragment):
    corpus = bad_corpus(tmp_path, kind)
    code, _, err = run_cli(["build-cache", corpus, "--workspace", tmp_path / "ws"], capsys, monkeypatch)
    assert_one_line(code, err, fragment, str(corpus))
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("flags,fragment", [
    (["--shard", "2/2"], "shards count from 0; the 2 shards are 0/2 .. 1/2"), (["--shard", "3/2"], "--shard 3/2: need 0 <= I < N"),
    (["--shard", "x"], "--shard x"), (["--variant", "prefix,suffix"], "--variant suffix"),
    (["--dtype", "float64"], "--dtype float64"), (["--chunk-tokens", "0"], "--chunk-tokens"),
    (["--chunk-tokens", "32", "--overlap", "40"], "--overlap"), (["--format", "parquet"], "--format parquet: unknown")])
def test_bad_flags_are_one_line_errors(built, tmp_path, capsys, monkeypatch, flags, fragment):
    code, _, err = run_cli(["build-cache", built.corpus, "--workspace", tmp_path / "ws", "--no-bm25", "--no-dense",
                             *flags], capsys, monkeypatch)
    assert_one_line(code, err, fragment)
    assert not (tmp_path / "ws").exists()   # refused before the new workspace's folder is made


def test_store_path_not_writable_is_one_line(built, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code, _, err = run_cli(["build-cache", built.corpus, "--workspace", tmp_path / "ws", "--no-bm25", "--no-dense",
                             "--store", blocker / "kv.zarr"], capsys, monkeypatch)
    assert_one_line(code, err, "cannot create store", "writable --store")
    code, _, err = run_cli(["build-cache", built.corpus, "--workspace", blocker / "ws"], capsys, monkeypatch)
    assert_one_line(code, err, "--workspace", "not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_store_dir_without_write_permission_is_one_line(built, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = run_cli(["build-cache", built.corpus, "--workspace", tmp_path / "ws", "--no-bm25",
                                 "--no-dense", "--store", locked / "kv.zarr"], capsys, monkeypatch)
    finally:
        locked.chmod(0o700)
    assert_one_line(code, err, "cannot create store")


def test_binary_non_utf8_and_tokenless_documents_are_skipped_with_a_warning(built, tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("Quillmarsh is the capital of the Drelvan province.")
    (corpus / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (corpus / "latin1.md").write_bytes("Caf\xe9 in Quillmarsh".encode("latin-1"))
    (corpus / "blank.md").write_text("  \n\t\n")
    (corpus / "rows.jsonl").write_text('{"id": "r1", "text": ""}\n{"id": "r2", "text": "Goats live on the Kettar slopes."}\n')
    ws = tmp_path / "ws"
    code, _, err = run_cli(["build-cache", corpus, "--workspace", ws, "--no-bm25", "--no-dense"], capsys, monkeypatch)
    assert code == 0, err
    for name in ("image.txt", "latin1.md", "blank.md", "'r1'"):
        assert re.search(r"warning: skipped.*" + re.escape(name), err), name
    chunks = read_chunks_table(ws / "chunks.parquet")
    assert sorted(c.doc_id for c in chunks) == ["good.txt", "r2"]
    assert len(chunk_keys(open_store(str(ws / "kv.zarr"), readonly=True))) == 2


def test_build_cache_errors_are_kvf_errors(built, tmp_path):
    """The in-process API raises KvfError (what the CLI turns into one line), never a bare exception."""
    with pytest.raises(KvfError, match="does not exist"):
        build_cache(opts_for(tmp_path, tmp_path / "nope"), QUIET)


def test_a_build_whose_chunks_another_build_rewrote_leaves_the_workspace_to_the_other(tmp_path, short_docs,
                                                                                     monkeypatch):
    """Two build-caches with other settings on one workspace: the files stages take turns (a lock), and a
    build whose chunks table was rewritten by the other while it computed KVs does not write its manifest
    over the other's files (the workspace said 64-token chunks over a 128-token table and index)."""
    import kvf.pipeline.workflows.build as build_module
    from kvf.pipeline.retrieval.chunking import write_chunks_table
    corpus = write_corpus(tmp_path, short_docs)
    opts = opts_for(tmp_path, corpus, dtype="float32")
    real_stage_kv = build_module.stage_kv

    def other_build_meanwhile(opts, builder, chunks, *args):   # what a build of other settings leaves
        stats = real_stage_kv(opts, builder, chunks, *args)
        write_chunks_table(list(chunks.chunks())[1:], Workspace(opts.workspace).chunks_path)
        return stats
    monkeypatch.setattr(build_module, "stage_kv", other_build_meanwhile)
    with pytest.raises(KvfError, match="another build-cache with other settings rewrote its chunks"):
        build_cache(opts, QUIET)
    assert not Workspace(opts.workspace).manifest_path.exists()
    monkeypatch.setattr(build_module, "stage_kv", real_stage_kv)
    assert build_cache(opts, QUIET).chunks > 0 and Workspace(opts.workspace).manifest_path.exists()   # alone: fine


def test_the_workspace_files_lock_makes_a_second_build_wait(tmp_path):
    """While one build holds a workspace's files lock, a second one says it waits, and gets it after."""
    import threading
    ws, said, order = Workspace(tmp_path / "ws"), [], []

    def second_build():
        with ws.files_lock(said.append):
            order.append("second")
    with ws.files_lock(said.append):
        second = threading.Thread(target=second_build)
        second.start()
        time.sleep(0.3)
        order.append("first done")
    second.join(5)
    assert order == ["first done", "second"] and said == [f"another build is writing workspace {ws.root}'s files; waiting for it"]


def test_a_fusion_entry_past_the_model_positions_is_refused_not_stored(built, tmp_path):
    """A fusion entry sits after S and its neighbours; past the model's positions RoPE extrapolates and the
    KV is not the model's. The build refuses up front (--neighbours, --chunk-tokens: the catalogue), and
    each entry refuses again on its real lengths, before anything is stored."""
    from kvf.pipeline.workflows.build import EntryBuilder
    store = open_store(str(tmp_path / "kv.zarr"), meta=store_meta(built.model_ref, "float32"), create=True)
    builder = EntryBuilder(built.model_ref, store)
    chunk, *others = built.chunks[:4]
    by_id = {c.chunk_id: c for c in built.chunks}
    neighbours = {chunk.chunk_id: [c.chunk_id for c in others]}
    builder.engine.model.max_positions = len(builder.template.prefix_ids) + 2 * CHUNK_TOKENS  # room for 2 chunks
    with pytest.raises(KvfError, match=f"chunk {chunk.chunk_id[:12]}: after S and its 3 neighbours .* past the model"):
        builder.compute("fusion", chunk, neighbours, by_id)
    assert builder.key("fusion", chunk, neighbours) not in store.keys()


def test_writes_behind_overlap_the_next_chunk_and_store_what_writes_inline_store(built, tmp_path, monkeypatch):
    """Inside writing_behind() an entry is stored on a background thread while the next chunk is computed (on a
    GPU, or an object store, what build-cache, Ray workers and `kvf run` do); never more than WRITES_BEHIND
    entries wait. The store ends with the same keys and bytes as writing each entry before the next chunk. A
    local store on the CPU writes inline by default: it would share the cores with the compute."""
    import threading
    from kvf.pipeline.workflows.build import WRITES_BEHIND, EntryBuilder
    chunks = list(built.chunks[:5])
    stores = {}
    for behind in (False, True):
        store = open_store(str(tmp_path / f"behind-{behind}.zarr"), meta=store_meta(built.model_ref, "float32"),
                           create=True)
        builder = EntryBuilder(built.model_ref, store)
        assert builder.writes_behind() is False                  # local store, CPU: inline unless told
        builder.system_kv()
        events, lock, real_put, real_chunk_kv = [], threading.Lock(), store.put, builder.engine.chunk_kv

        def put(*a, **kw):
            with lock:
                events.append("put starts")
            time.sleep(0.2)                                       # a write slower than a chunk's compute
            try:
                return real_put(*a, **kw)
            finally:
                with lock:
                    events.append("put ends")

        def chunk_kv(*a, **kw):
            with lock:
                events.append("compute")
            return real_chunk_kv(*a, **kw)
        monkeypatch.setattr(store, "put", put)
        monkeypatch.setattr(builder.engine, "chunk_kv", chunk_kv)
        with builder.writing_behind(behind):
            for chunk in chunks:
                builder.compute("prefix", chunk, None, {})
        depth, deepest, overlapped = 0, 0, 0
        for event in events:
            depth += {"put starts": 1, "put ends": -1}.get(event, 0)
            deepest = max(deepest, depth)
            overlapped += event == "compute" and depth > 0
        assert deepest == 1                                       # one writer
        assert (overlapped > 0) == behind                         # computes overlap writes only behind
        assert events.count("put ends") == len(chunks) and builder.entries_written == len(chunks)
        stores[behind] = open_store(str(tmp_path / f"behind-{behind}.zarr"), readonly=True)
    assert WRITES_BEHIND >= 2
    inline, behind = stores[False], stores[True]
    assert inline.keys() == behind.keys() and len(chunk_keys(inline)) == len(chunks)
    assert {k: entry_bytes(inline, k) for k in inline.keys()} == {k: entry_bytes(behind, k) for k in behind.keys()}


def test_an_error_while_writes_are_behind_stores_what_was_computed_and_is_the_error_raised(built, tmp_path):
    """The body's own error wins over the pending writes, and the entries computed before it are stored: a
    resumed build does not compute them again."""
    from kvf.pipeline.workflows.build import EntryBuilder
    store = open_store(str(tmp_path / "kv.zarr"), meta=store_meta(built.model_ref, "float32"), create=True)
    builder = EntryBuilder(built.model_ref, store)
    chunks = list(built.chunks[:2])
    with pytest.raises(KeyboardInterrupt):
        with builder.writing_behind(True):
            for chunk in chunks:
                builder.compute("prefix", chunk, None, {})
            raise KeyboardInterrupt
    assert builder.missing("prefix", chunks, None) == [] and store.verify() == []
