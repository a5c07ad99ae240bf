"""The README's paths for a researcher's own material: the Python API (kvf.open_workspace, kvf.evaluate),
and `kvf run -w WS -q my_questions.jsonl` on documents built with `kvf build-cache my_docs/`."""
import json
import re
import shutil
import sys

import pytest

import kvf
from kvf.cli.main import main
from kvf.pipeline.fusion.engine import recompute_budget


def cli(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["kvf", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_open_workspace_answers_by_fusing_stored_chunks(built):
    ws = kvf.open_workspace(built / "ws")
    docs = json.loads((built / "ws" / "doc_chunks.json").read_text())
    first_doc = next(iter(docs))
    answer = ws.answer("Where was the subject born?", method="cacheblend", ratio=0.15, documents=[first_doc],
                       max_new_tokens=4)
    assert answer.text and answer.chunk_ids == docs[first_doc]
    assert answer.recomputed_tokens == recompute_budget(0.15, answer.chunk_tokens)
    assert answer.timings["first_token"] > 0 and answer.settings["check_layer"] == 1
    hits = ws.search("capital province", top_k=2)
    assert len(hits) == 2 and hits[0].score >= hits[1].score
    retrieved = ws.answer("capital province", method="reuse", top_k=2, max_new_tokens=2)
    assert retrieved.chunk_ids == [hit.chunk_id for hit in hits] and retrieved.recomputed_tokens == 0
    from kvf.pipeline.retrieval.chunking import ChunkTable
    table = ChunkTable(built / "ws" / "chunks.parquet")
    for hit in hits:   # what `kvf search --json` prints: the document each chunk is cut from, and its text
        assert (hit.doc_id, hit.text) == (table[hit.chunk_id].doc_id, table[hit.chunk_id].text)
        assert hit.chunk_id in docs[hit.doc_id] and hit.text
    with pytest.raises(kvf.KvfError, match="not in workspace"):
        ws.answer("q", documents=["no-such-doc"])
    with pytest.raises(kvf.KvfError, match="not in workspace .*; its ids are its documents' own, e.g. '.+' \\(each hit "
                                           "of `kvf search`, or of ws.search\\(\\), has its doc_id\\)$"):   # nothing like it: what ids look like
        ws.answer("q", documents=["zzzzzzzzzzzzzzzzzzzzzzzz"])
    with pytest.raises(kvf.KvfError, match=f"not in workspace .*; did you mean '{first_doc}'"):   # a typo of an id
        ws.answer("q", documents=[first_doc[:-1] + "#"])
    # a ratio for a method that has none would silently run at the method's own (full: everything)
    with pytest.raises(kvf.KvfError, match="ratio=0.3: full always recomputes 1 of the chunk tokens"):
        ws.answer("q", method="full", ratio=0.3)
    assert ws.answer("q", method="full", ratio=1.0, documents=[first_doc], max_new_tokens=1).recomputed_tokens > 0
    # a misspelt or another method's knob was dropped without a word; an empty documents list meant no context
    with pytest.raises(kvf.KvfError, match="check_layr=2: not a knob of cacheblend; its knobs: check_layer"):
        ws.answer("q", method="cacheblend", check_layr=2)
    # another tool's name for one of answer()'s own arguments (kvf's own code says recompute_ratio) was taken for a knob
    for bad, said in (({"k": 3}, "k=3: answer() calls it top_k; pass top_k=3"),
                      ({"recompute_ratio": 0.15}, "recompute_ratio=0.15: answer() calls it ratio; pass ratio=0.15"),
                      ({"passages": ["a"]}, "passages=['a']: answer() calls it documents; pass documents=['a']"),
                      # the workspace's device read as a knob ("device='cuda': not a knob of cacheblend")
                      ({"device": "cuda"}, "device='cuda': the workspace's, not an answer's; pass it when opening: "
                                           "kvf.open_workspace(path, device='cuda')")):
        with pytest.raises(kvf.KvfError, match=re.escape(said)):
            ws.answer("q", method="cacheblend", **bad)
    with pytest.raises(kvf.KvfError, match="documents=\\[\\]: name at least one document"):
        ws.answer("q", documents=[])
    with pytest.raises(kvf.KvfError, match="top_k=3: documents name the chunks, so nothing is retrieved; leave out "
                                           "top_k, or leave out documents to retrieve$"):
        ws.answer("q", documents=[first_doc], top_k=3)   # it was dropped without a word
    with pytest.raises(kvf.KvfError, match="bm25 retrieval found no chunk for 'Qzxv wkpq\\?'; rephrase it, pass "
                                           "retriever='dense', or name its documents \\("):
        ws.answer("Qzxv wkpq?", method="reuse", max_new_tokens=1)   # no word of it in the corpus: no context
    # the notebook's own argument names, not the CLI's flags (it said "-k must be at least 1")
    for bad, said in (({"top_k": 0}, "top_k=0"), ({"ratio": 1.5}, "ratio=1.5"), ({"variant": "x"}, "variant='x'"),
                      ({"retriever": "splade"}, "retriever='splade'"), ({"max_new_tokens": -1}, "max_new_tokens=-1")):
        with pytest.raises(kvf.KvfError, match=re.escape(said)):
            ws.answer("q", **bad)
    # a notebook's argument of the wrong type failed deep inside (TypeError from torch, AttributeError), or
    # read a bare string letter by letter as document ids ("document 'a' is not in workspace")
    for question, bad, said in ((123, {}, "question=123: pass the question as a non-empty string"),
                                ("", {"documents": [first_doc]}, "question='': pass the question"),
                                ("q", {"ratio": "0.15"}, "ratio='0.15': must be a number"),
                                ("q", {"ratio": float("nan")}, "ratio=nan: must be within [0, 1]"),
                                ("q", {"ratio": 15}, "ratio=15: must be within [0, 1] (a fraction of the chunk tokens); "
                                                     "for 15% pass ratio=0.15"),   # as the CLI's --ratio 15
                                ("q", {"ratio": True}, "ratio=True: must be a number"),
                                ("q", {"max_new_tokens": 2.5}, "max_new_tokens=2.5: must be an integer"),
                                ("q", {"top_k": 2.0}, "top_k=2.0: must be an integer"),
                                ("q", {"documents": first_doc}, f"documents={first_doc!r}: pass a list of document ids"),
                                ("q", {"method": "nope"}, "method='nope': unknown method; known methods: a3,"),
                                # kvf run -m's spelling is taken (below); its errors name the argument, not -m
                                ("q", {"method": "cacheblend:check_layr=2"},
                                 "method='cacheblend:check_layr=2': cacheblend has no knob 'check_layr'"),
                                ("q", {"method": "cacheblend:check_layer=x"},
                                 "method='cacheblend:check_layer=x': check_layer must be int, not 'x'"),
                                ("q", {"method": "kvfuse:best"},
                                 "method='kvfuse:best': expected NAME:KNOB=VALUE, e.g. cacheblend:check_layer=3, or one "
                                 "of its named configurations: tuned"),
                                ("q", {"method": "nope:tuned"}, "method='nope:tuned': unknown method; known methods"),
                                ("q", {"method": "cacheblend:"}, "method='cacheblend:': expected NAME:KNOB=VALUE"),
                                ("q", {"method": "cacheblend:variant=fusion", "variant": "prefix"},
                                 "variant='prefix': method='cacheblend:variant=fusion' sets variant=fusion; give it once"),
                                # kvf eval's METHOD@RATIO; the line named the command line's flag, cut at its point:
                                # "cacheblend with ratio='0'.15 on the command line"
                                ("q", {"method": None}, "method=None: pass one method's name"),   # AttributeError
                                ("q", {"method": ["full", "reuse"]}, "method=['full', 'reuse']: pass one method's name"),
                                ("q", {"method": "cacheblend@0.15"},
                                 "(the ratio is given apart: method='cacheblend', ratio=0.15); known methods")):
        with pytest.raises(kvf.KvfError, match=re.escape(said)):
            ws.answer(question, **bad)
    # a knob's error named its CLI flag ("--check-layer '2': expected int"); from Python it names the argument
    for bad, said in (({"check_layer": "2"}, "check_layer='2': must be an integer"),
                      ({"check_layer": 99}, "check_layer=99: the model has 30 layers; use 1..29"),
                      ({"deviation": "q"}, "deviation='q': must be one of k, v"),
                      ({"gradual": "yes"}, "gradual='yes': must be True or False"),
                      ({"deviation": 3}, "deviation=3: must be one of k, v")):
        with pytest.raises(kvf.KvfError, match="^" + re.escape(said)):
            ws.answer("q", method="cacheblend", documents=[first_doc], **bad)
    for args, said in ((("capital", "3"), "top_k='3': must be an integer"), (("capital", 0), "top_k=0: retrieve at least"),
                       ((None,), "question=None: pass the question")):
        with pytest.raises(kvf.KvfError, match=re.escape(said)):
            ws.search(*args)
    ws.close()   # the shared workspace's store: a later test's gc of it must not find it held


def test_your_own_docs_and_questions_from_the_readme(tmp_path, capsys, monkeypatch, short_docs):
    docs = tmp_path / "my_docs"
    docs.mkdir()
    for i, text in enumerate(short_docs):
        (docs / f"doc{i}.txt").write_text(text)
    code, _, err = cli(["build-cache", docs, "-w", tmp_path / "workspace", "--chunk-tokens", "64"], capsys, monkeypatch)
    assert code == 0, err
    questions = tmp_path / "my_questions.jsonl"
    questions.write_text(json.dumps({"question": "Which province is Quillmarsh the capital of?", "answers": ["Drelvan"]})
                         + "\n" + json.dumps({"question": "Where do wild goats live?"}) + "\n")
    out = tmp_path / "runs" / "mine.jsonl"
    code, stdout, err = cli(["run", "-w", tmp_path / "workspace", "-q", questions, "-m", "full,cacheblend", "-r", "0.15",
                             "-k", "2", "--max-new-tokens", "6", "-o", out], capsys, monkeypatch)
    assert code == 0, err
    assert stdout.startswith("setting: shared (the questions name no passages), bm25 top-2")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4 and {r["method"] for r in records} == {"full", "cacheblend"}
    assert records[0]["gold"] == ["Drelvan"] and any(r["gold"] == [] for r in records)   # answers are optional
    assert "kvf run: 4 answers" in stdout                                                # the answers table
    summary = kvf.evaluate([out])
    assert set(summary.method) == {"full", "cacheblend"}
    for files in ([out, out], [out]):   # the file twice, or once: it said "Missing argument 'run_b'"
        code, stdout, err = cli(["compare", *files, "--a", "cacheblend@0.15", "--b", "full"], capsys, monkeypatch)
        assert code == 0, err
        assert f"{out} cacheblend@0.15 (A) vs {out} full (B): 2 questions" in " ".join(stdout.split())
        assert "│ full " not in stdout   # B is full prefill: its answers are not printed again as a "full" row
    code, _, err = cli(["compare", out, out], capsys, monkeypatch)    # one file, two runs: which?
    assert code == 1 and err.count("\n") == 1 and "pick one with --a" in err and "cacheblend@0.15" in err, err
    code, _, err = cli(["build-cache", docs, "-w", tmp_path / "lazy", "--chunk-tokens", "64", "--indexes-only"], capsys,
                       monkeypatch)
    assert code == 0, err
    with kvf.open_workspace(tmp_path / "lazy") as lazy:   # its repr said "KV variants none yet", even with KVs stored
        assert repr(lazy).endswith("(up to 64 tokens), KVs computed as questions need them; SmolLM2-135M-Instruct "
                                   "on cpu, float32>")
        lazy.answer("Where do wild goats live?", method="reuse", max_new_tokens=2)
        assert "KVs computed as questions need them" in repr(lazy)
    own = tmp_path / "own_passages.jsonl"   # questions that name their documents are answered from them
    own.write_text(json.dumps({"question": "Where do wild goats live?", "passages": ["doc2.txt"]}) + "\n")
    code, stdout, err = cli(["run", "-w", tmp_path / "workspace", "-q", own, "-m", "reuse", "--max-new-tokens", "4",
                             "-o", tmp_path / "own.jsonl"], capsys, monkeypatch)
    assert code == 0 and stdout.startswith("setting: per-question (the questions name their passages)"), err
    record = json.loads((tmp_path / "own.jsonl").read_text())
    assert record["chunk_ids"] == json.loads((tmp_path / "workspace" / "doc_chunks.json").read_text())["doc2.txt"]
    # the document is edited and the workspace rebuilt: a method added to the run would answer from the new
    # chunks beside reuse's record from the old ones, and eval would pair them. Refused; with nothing left to
    # answer, resuming is fine, and says that the answers come from the old text (it said only "nothing to run")
    (docs / "doc2.txt").write_text(short_docs[2].replace("wild goats", "wild goats and ibex"))
    # before the rebuild, the workspace answers from the old text: kvf search and open_workspace say so
    stale = f"{docs} changed since workspace {tmp_path / 'workspace'} was built (a document edited, added or removed)"
    code, _, err = cli(["search", "ibex", "-w", tmp_path / "workspace"], capsys, monkeypatch)
    assert code == 0 and stale in " ".join(err.split()), err
    kvf.open_workspace(tmp_path / "workspace").close()
    assert stale in " ".join(capsys.readouterr().err.split())
    code, _, err = cli(["build-cache", docs, "-w", tmp_path / "workspace", "--chunk-tokens", "64"], capsys, monkeypatch)
    assert code == 0, err
    resume = ["run", "-w", tmp_path / "workspace", "-q", own, "--max-new-tokens", "4", "-o", tmp_path / "own.jsonl"]
    code, _, err = cli([*resume, "-m", "reuse,full"], capsys, monkeypatch)
    assert code == 1 and err.count("\n") == 1, err
    assert "answered question own_passages-1 (reuse) from other chunks than workspace" in err and "--overwrite" in err
    code, _, err = cli([*resume, "-m", "reuse"], capsys, monkeypatch)
    said = [line for line in err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(said) == 1, err
    assert ("1 answered question (e.g. own_passages-1) cites chunks that workspace" in said[0]
            and "their records answer from the old text: --overwrite" in said[0]), err


def test_prepared_own_questions_with_one_passage_each_are_answered_from_it(tmp_path, capsys, monkeypatch, short_docs):
    """README: questions that carry their passages go through `kvf data prepare custom`, then `kvf run -d DIR`.
    With one passage each, -d took them for NQ-open's oracle passages and retrieved over all of them pooled
    (`setting: shared`), so a question could be answered from another's passage, or from none."""
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"question": question, "passages": [{"title": "", "text": text}]}) + "\n"
                            for question, text in (("Where was Zorvan Pellick born?", short_docs[0]),
                                                   ("What are the Kettar mountains home to?", short_docs[2]))))
    code, _, err = cli(["data", "prepare", "custom", "--input", mine, "-o", tmp_path / "prepared"], capsys, monkeypatch)
    assert code == 0, err
    code, stdout, err = cli(["run", "-d", tmp_path / "prepared", "-m", "reuse", "--max-new-tokens", "2",
                             "-o", tmp_path / "mine-run.jsonl"], capsys, monkeypatch)
    assert code == 0 and stdout.startswith("setting: per-question (the questions name their passages)"), err
    cited = {json.loads(line)["id"]: json.loads(line)["context_ids"]
             for line in (tmp_path / "prepared" / "questions.jsonl").read_text().splitlines()}
    doc_chunks = json.loads((tmp_path / "prepared" / "workspace" / "doc_chunks.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "mine-run.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:   # each from its own passage's chunks, and only those
        assert record["chunk_ids"] == [c for pid in cited[record["qid"]] for c in doc_chunks[pid]]


def test_evaluate_refuses_what_is_not_a_run_file_path():
    """kvf.evaluate(5) raised "TypeError: 'int' object is not iterable"."""
    for bad in (5, None, [3]):
        with pytest.raises(kvf.KvfError, match=re.escape(f"run_files={bad!r}: pass a run file's path")):
            kvf.evaluate(bad)
    with pytest.raises(kvf.KvfError, match=re.escape("open_workspace(5): pass the workspace's folder")):
        kvf.open_workspace(5)   # it raised a TypeError from pathlib
    # an AttributeError ('int' object has no attribute 'startswith') and a TypeError from os.fspath
    for argument, expected in ((dict(device=3), "device=3: pass 'cpu' or 'cuda'"), (dict(dtype=16), "dtype=16: pass"),
                               (dict(model=["m.gguf"]), "model=['m.gguf']: pass a model folder")):
        with pytest.raises(kvf.KvfError, match=re.escape(expected)):
            kvf.open_workspace("workspace", **argument)
    with pytest.raises(kvf.KvfError, match=re.escape("out=5: pass a folder's path")):
        kvf.evaluate("runs/x.jsonl", out=5)


def test_cachecraft_answers_from_python_as_kvf_run_does(built, tmp_path, capsys, monkeypatch):
    """In a workspace built without cachecraft's summaries, kvf run computes entries that carry them, where the
    API said "the store's entries carry none; rebuild them with `kvf build-cache --extras-for cachecraft`". It
    computes them too now, and answers as the run does."""
    for copy in ("ws-run", "ws-api"):   # the shared workspace stays as built; each side computes its own
        shutil.copytree(built / "ws", tmp_path / copy)
    first_doc = next(iter(json.loads((built / "ws" / "doc_chunks.json").read_text())))
    question = "Where was the subject born?"
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": question, "passages": [first_doc]}) + "\n")
    code, _, err = cli(["run", "-w", tmp_path / "ws-run", "-q", tmp_path / "q.jsonl", "-m", "cachecraft",
                        "--max-new-tokens", "3", "--no-show-answers", "-o", tmp_path / "r.jsonl"], capsys, monkeypatch)
    assert code in (0, None), err
    record = json.loads((tmp_path / "r.jsonl").read_text())
    answer = kvf.open_workspace(tmp_path / "ws-api").answer(question, method="cachecraft", documents=[first_doc],
                                                            max_new_tokens=3)
    assert (answer.text, answer.chunk_ids, answer.recomputed_tokens) == (record["answer"], record["chunk_ids"],
                                                                        record["recomputed_tokens"])
    assert 0 < answer.recomputed_tokens < answer.chunk_tokens


def test_a_run_entry_answers_from_python_as_kvf_run_does(built, tmp_path, capsys, monkeypatch):
    """The README's configuration to use, `-m kvfuse:tuned`, was refused from Python ("unknown method (its knobs
    go apart: method='kvfuse', sink_tokens=8, ...)"): answer() takes kvf run -m's entries now, and answers as the
    run does, with the entry's knobs and stored variant."""
    for copy in ("ws-run", "ws-api"):   # each side computes the fusion entries it needs on its own copy
        shutil.copytree(built / "ws", tmp_path / copy)
    first_doc = next(iter(json.loads((built / "ws" / "doc_chunks.json").read_text())))
    question = "Where was the subject born?"
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": question, "passages": [first_doc]}) + "\n")
    entries = ("kvfuse:tuned", "cacheblend:check_layer=2:variant=fusion")
    code, _, err = cli(["run", "-w", tmp_path / "ws-run", "-q", tmp_path / "q.jsonl", "-m", ",".join(entries),
                        "-r", "0.3", "--max-new-tokens", "3", "--no-show-answers", "-o", tmp_path / "r.jsonl"],
                       capsys, monkeypatch)
    assert code in (0, None), err
    records = {r["label"]: r for r in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    with kvf.open_workspace(tmp_path / "ws-api") as ws:
        for entry in entries:
            record = records[entry.split(":", 1)[1]]
            answer = ws.answer(question, method=entry, ratio=0.3, documents=[first_doc], max_new_tokens=3)
            assert (answer.text, answer.recomputed_tokens) == (record["answer"], record["recomputed_tokens"])
            assert answer.settings.items() <= record["settings"].items(), entry   # the run's add its own (model, ...)
        # the same knobs as keywords; a keyword knob after the entry overrides it, as a knob after it does in -m
        spelt = ws.answer(question, method="cacheblend", check_layer=2, variant="fusion", ratio=0.3,
                          documents=[first_doc], max_new_tokens=3)
        assert spelt.text == records["check_layer=2:variant=fusion"]["answer"]
        assert spelt.settings == ws.answer(question, method=entries[1], ratio=0.3, documents=[first_doc],
                                           max_new_tokens=1).settings
        overridden = ws.answer(question, method="kvfuse:tuned", hop_after=8, ratio=0.3, documents=[first_doc],
                               max_new_tokens=1)
        assert (overridden.settings["hop_after"], overridden.settings["sink_tokens"]) == (8, 8)


def test_ratio_auto_from_python_answers_at_the_ratio_it_picked(built):
    """kvf run's -r auto was "ratio='auto': must be a number" from Python: answer() lets the loading controller
    pick the ratio too, and answers exactly as at that ratio given by hand."""
    first_doc = next(iter(json.loads((built / "ws" / "doc_chunks.json").read_text())))
    question = "Where was the subject born?"
    with kvf.open_workspace(built / "ws") as ws:
        auto = ws.answer(question, method="cacheblend", ratio="auto", documents=[first_doc], max_new_tokens=3)
        picked = auto.settings["ratio"]
        assert auto.settings["ratio_mode"] == "auto" and 0.15 <= picked <= 1   # at least the default floor
        assert auto.recomputed_tokens == recompute_budget(picked, auto.chunk_tokens)
        by_hand = ws.answer(question, method="cacheblend", ratio=picked, documents=[first_doc], max_new_tokens=3)
        assert (auto.text, auto.recomputed_tokens) == (by_hand.text, by_hand.recomputed_tokens)
        floored = ws.answer(question, method="cacheblend", ratio="auto", quality_floor=1.0, documents=[first_doc],
                            max_new_tokens=1)
        assert floored.recomputed_tokens == floored.chunk_tokens   # a floor of 1 recomputes everything
        for bad, said in (({"quality_floor": 0.3}, "quality_floor=0.3: it is the least ratio=\"auto\" picks"),
                          ({"ratio": "auto", "quality_floor": 2}, "quality_floor=2: must be within [0, 1]"),
                          ({"ratio": "auto", "method": "full"}, "ratio='auto': full always recomputes 1"),
                          ({"ratio": "half"}, "ratio='half': must be a number or 'auto'")):
            with pytest.raises(kvf.KvfError, match="^" + re.escape(said)):
                ws.answer(question, documents=[first_doc], **bad)


def test_a_closed_workspace_lets_gc_run_and_answers_no_more(built, tmp_path, capsys, monkeypatch):
    """A notebook's open workspace held the store's lock until the notebook ended: `kvf store gc` said the store
    was "in use by another kvf process (a run or a build)", and there was no way to let it go but to restart."""
    shutil.copytree(built / "ws", tmp_path / "ws")
    gc = ["store", "gc", tmp_path / "ws", "--yes"]
    with kvf.open_workspace(tmp_path / "ws") as ws:
        n_chunks = sum(map(len, json.loads((tmp_path / "ws" / "doc_chunks.json").read_text()).values()))
        assert repr(ws) == (f"<kvf workspace {tmp_path / 'ws'}: {n_chunks} chunks (up to 64 tokens), KV variants "
                            "prefix; SmolLM2-135M-Instruct on cpu, float32>")   # what a notebook shows for `ws`
        code, _, err = cli(gc, capsys, monkeypatch)
        assert code == 1 and "in use by another kvf process (a run, a build, or a notebook's kvf.open_workspace: " \
                             "ws.close() lets it go)" in err
        assert ws.search("capital", top_k=1)
    assert cli(gc, capsys, monkeypatch)[0] in (0, None)   # the with block's end let it go
    for call in (lambda: ws.search("capital"), lambda: ws.answer("q", method="reuse")):
        with pytest.raises(kvf.KvfError, match=r"^this workspace was closed .*open it again with kvf.open_workspace"):
            call()
    ws.close()   # closing twice is no error
    assert repr(ws) == f"<kvf workspace {tmp_path / 'ws'} (closed)>"
    again = kvf.open_workspace(tmp_path / "ws")
    assert cli(gc, capsys, monkeypatch)[0] == 1
    again.close()
    assert cli(gc, capsys, monkeypatch)[0] in (0, None)


def test_a_flag_s_value_in_a_line_becomes_the_argument_whole():
    """A flag's value the line names becomes the argument as Python writes it: a number as it is, whole past its
    point ("--ratio 0.15" became "ratio='0'.15"), a word quoted; a bare flag before a word is the name alone."""
    from kvf.errors import as_arguments
    line = "--ratio 1.5: must be within [0, 1]; use --ratio 0.15. --device cuda: use --device cpu; omit --model for it"
    arguments = {"--ratio": ("ratio", "1.5"), "--device": ("device", "cuda"), "--model": ("model", None)}
    assert as_arguments(line, arguments) == ("ratio='1.5': must be within [0, 1]; use ratio=0.15. device='cuda': use "
                                             "device='cpu'; omit model for it")


def test_an_open_workspace_refused_after_taking_the_store_lets_it_go(built, tmp_path, capsys, monkeypatch):
    """A workspace whose chunks table is damaged is refused after its store is taken: the store stayed held while
    the refusal's traceback lived (a notebook keeps its last one), and `kvf store gc` said it was in use."""
    shutil.copytree(built / "ws", tmp_path / "ws")
    (tmp_path / "ws" / "chunks.parquet").write_bytes(b"not parquet")
    with pytest.raises(kvf.KvfError, match="chunks.parquet is not a readable Parquet file") as refused:
        kvf.open_workspace(tmp_path / "ws")
    assert refused.value.__traceback__ is not None   # held, as a notebook holds it
    assert cli(["store", "gc", tmp_path / "ws" / "kv.zarr", "--yes"], capsys, monkeypatch)[0] in (0, None)


def test_deep_checks_name_the_arguments_a_notebook_passed(built, tmp_path, monkeypatch, capsys):
    """Checks kvf shares with the CLI named its flags to a notebook ("--device cuda: ...; use --device cpu",
    "--out r is a file"), flags it never typed. They name the arguments passed now; a `kvf ...` command
    quoted as a fix stays a command."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "a_file").write_text("")
    missing = tmp_path / "no-model"
    for argument, said in ((dict(device="cuda"), "^device='cuda': this torch sees no CUDA GPU.* or use device='cpu'$"),
                           (dict(device="gpu"), "^device='gpu': kvf runs on cpu or cuda"),
                           (dict(dtype="float8"), "^dtype='float8': use one of float32"),
                           (dict(model=missing), f"^model='{missing}': no such file or directory.* or omit model for "
                                                 "the embedded")):
        with pytest.raises(kvf.KvfError, match=said) as raised:
            kvf.open_workspace(built / "ws", **argument)
        assert "--" not in str(raised.value), raised.value
    # a folder inside the workspace is named the way open_workspace takes it, not as the CLI's -w
    with pytest.raises(kvf.KvfError, match=re.escape(f"a folder inside workspace {built / 'ws'}, not a workspace; "
                                                     f"pass path='{built / 'ws'}'")):
        kvf.open_workspace(built / "ws" / "kv.zarr")
    with pytest.raises(kvf.KvfError, match=re.escape(f"path='{tmp_path / 'a_file'}' is a file; pass a directory (build "
                                                     "one with `kvf build-cache CORPUS -w DIR`)")):
        kvf.open_workspace(tmp_path / "a_file")
    from kvf.pipeline.workflows.weights import embedded_gguf_path
    ws = kvf.open_workspace(built / "ws", model=embedded_gguf_path())   # a Path: it raised an AttributeError
    first_doc = next(iter(json.loads((built / "ws" / "doc_chunks.json").read_text())))
    once = ws.answer("q", method="reuse", documents=[first_doc], max_new_tokens=1)
    assert once.text is not None
    capsys.readouterr()
    twice = ws.answer("q", method="reuse", documents=[first_doc, first_doc], max_new_tokens=1)   # said, as kvf run says it
    assert twice.chunk_ids == once.chunk_ids * 2
    assert f"documents=[...] names {first_doc!r} more than once" in capsys.readouterr().err
    with pytest.raises(kvf.KvfError, match=re.escape("use fewer chunks (top_k), smaller --chunk-tokens or lower "
                                                     "max_new_tokens")):   # --chunk-tokens: a build's flag
        ws.answer("q", documents=[first_doc], max_new_tokens=100_000)
    with pytest.raises(kvf.KvfError, match=r"\(the question alone is \d+ tokens\) \+ 1 new tokens exceeds the model's "
                                           r"\d+ positions; shorten the question$"):   # not: fewer chunks
        ws.answer("where " * 10_000, documents=[first_doc], max_new_tokens=1)
    ws.close()   # the shared workspace's store: a later test's gc of it must not find it held
    with pytest.raises(kvf.KvfError, match=re.escape(f"out='{tmp_path / 'a_file'}' is a file; pass a directory")):
        kvf.evaluate("runs/x.jsonl", out=tmp_path / "a_file")
