"""Loaders on small fixtures of every format, prepare/load_prepared, and the real files when present."""
import gzip
import json
import os
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvf.errors import KvfError
from kvf.pipeline.data.datasets import (Passage, data_dir, detect_format, find_dataset_file, load_dataset,
                               load_prepared, passage_id, prepare)

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def real_data() -> Path:
    path = Path(os.environ["KVF_DATA"]) if os.environ.get("KVF_DATA") else DEFAULT_DATA
    if not path.is_dir():
        pytest.skip("KVF_DATA not set and ../shared/data absent")
    return path


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def write_jsonl(path: Path, records, gz=False) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


DPR = [
    {"question": "who wrote hamlet", "answers": ["Shakespeare", "William Shakespeare"],
     "ctxs": [{"title": "Hamlet", "text": "Hamlet is a tragedy by William Shakespeare.", "hasanswer": True},
              {"title": "Macbeth", "text": "Macbeth is a tragedy."}]},
    {"question": "what is macbeth", "answers": ["a tragedy"],
     "ctxs": [{"title": "Macbeth", "text": "Macbeth is a tragedy."}]},
]
KILT = [
    {"id": "tqa1", "input": "Which planet is the red planet?",
     "output": [{"answer": "Mars"}, {"answer": "The Red Planet Mars"},
                {"provenance": [{"wikipedia_id": "1", "title": "Mars", "text": "Mars is red."},
                                {"wikipedia_id": "1", "title": "Mars", "text": "Mars is red."}]}]},
    {"id": "tqa2", "input": "Largest planet?", "output": [{"answer": "Jupiter"}],
     "ctxs": [{"title": "Jupiter", "text": "Jupiter is the largest planet."}]},
]
TWOWIKI = [
    {"_id": "abc", "question": "Where was X's father buried?", "answer": "Cork",
     "context": [["X", ["X was a judge.", "His father was Y."]], ["Y", ["Y was buried in Cork."]]]},
]
MUSIQUE = [
    {"id": "2hop__1", "question": "Q?", "answer": "Exeter College", "answer_aliases": ["Exeter"],
     "paragraphs": [{"idx": 0, "title": "A", "paragraph_text": "a text", "is_supporting": True},
                    {"idx": 1, "title": "B", "paragraph_text": "b text", "is_supporting": False}]},
]


def test_dpr_jsonl_plain_and_gzip(tmp_path):
    for gz in (False, True):
        # gzip is detected by magic bytes, not by the file name
        path = write_jsonl(tmp_path / f"nq{gz}.data", DPR, gz=gz)
        qs = load_dataset("nq", path)
        assert [q.qid for q in qs] == ["nq-0", "nq-1"]
        assert qs[0].answers == ["Shakespeare", "William Shakespeare"]
        assert qs[0].contexts == [Passage("Hamlet", "Hamlet is a tragedy by William Shakespeare."),
                                  Passage("Macbeth", "Macbeth is a tragedy.")]


def test_triviaqa_dpr_json_array_and_kilt(tmp_path):
    qs = load_dataset("triviaqa", write_json(tmp_path / "dpr.json", DPR))
    assert len(qs) == 2 and qs[1].answers == ["a tragedy"]
    qs = load_dataset("triviaqa", write_jsonl(tmp_path / "kilt.jsonl", KILT))
    assert [q.qid for q in qs] == ["tqa1", "tqa2"]
    assert qs[0].question == "Which planet is the red planet?"
    assert qs[0].answers == ["Mars", "The Red Planet Mars"]
    assert qs[0].contexts == [Passage("Mars", "Mars is red.")]  # repeated provenance kept once
    assert qs[1].contexts == [Passage("Jupiter", "Jupiter is the largest planet.")]


def test_kilt_without_passage_text_is_refused(tmp_path):
    rec = {"id": "k", "input": "q", "output": [{"answer": "a", "provenance": [{"wikipedia_id": "9", "title": "T"}]}]}
    with pytest.raises(KvfError, match=r"record 0: no passages"):
        load_dataset("triviaqa", write_jsonl(tmp_path / "k.jsonl", [rec]))


def test_2wiki_original_and_pandas_columns(tmp_path):
    qs = load_dataset("2wikimqa", write_json(tmp_path / "dev.json", TWOWIKI))
    assert qs[0].qid == "abc" and qs[0].answers == ["Cork"]
    assert qs[0].contexts[0] == Passage("X", "X was a judge. His father was Y.")
    # the pandas DataFrame.to_json() export renames _id to _1 and stores columns
    df = pd.DataFrame(TWOWIKI * 12).rename(columns={"_id": "_1"})
    df["_1"] = [f"id{i}" for i in range(12)]
    path = tmp_path / "cols.json"
    df.to_json(path)
    qs = load_dataset("2wikimqa", path)
    assert [q.qid for q in qs] == [f"id{i}" for i in range(12)]  # numeric row order, not "0","1","10",...
    assert qs[0].contexts == load_dataset("2wikimqa", tmp_path / "dev.json")[0].contexts


def test_benchmark_ids_and_titles_that_are_not_text(tmp_path):
    """A record id that is a list, true or NaN was the question id "['x']", "True" or "nan": the record's index
    stands in. A passage title of NaN (a table's missing value) was the title "nan": it is no title."""
    rows = [{**MUSIQUE[0], "id": ["x"]}, {**MUSIQUE[0], "id": True}, {**MUSIQUE[0], "id": float("nan")}]
    rows[0]["paragraphs"] = [{**p, "title": float("nan")} for p in rows[0]["paragraphs"]]
    qs = load_dataset("musique", write_jsonl(tmp_path / "m.jsonl", rows))
    assert [q.qid for q in qs] == ["musique-0", "musique-1", "musique-2"]
    assert qs[0].contexts[0].title == "" and qs[1].contexts[0].title == MUSIQUE[0]["paragraphs"][0]["title"]


def test_2wiki_context_whose_sentences_are_one_string_is_that_text(tmp_path):
    """A converted file's [title, "whole text"] was read letter by letter: the passage "X   w a s ..."."""
    joined = [{**TWOWIKI[0], "context": [[title, " ".join(sentences)] for title, sentences in TWOWIKI[0]["context"]]}]
    qs = load_dataset("2wikimqa", write_json(tmp_path / "dev.json", joined))
    assert qs[0].contexts == load_dataset("2wikimqa", write_json(tmp_path / "as_lists.json", TWOWIKI))[0].contexts


def test_list_of_lists_answers_are_flattened(tmp_path):
    rec = {"question": "q", "answers": [["Iranian hospital Dubai"], ["Dubai"]], "ctxs": [{"title": "", "text": "t"}]}
    assert load_dataset("2wikimqa", write_json(tmp_path / "w.json", [rec]))[0].answers == ["Iranian hospital Dubai", "Dubai"]


def test_musique_original(tmp_path):
    qs = load_dataset("musique", write_jsonl(tmp_path / "m.jsonl", MUSIQUE))
    assert qs[0].qid == "2hop__1" and qs[0].answers == ["Exeter College", "Exeter"]
    assert qs[0].contexts == [Passage("A", "a text"), Passage("B", "b text")]


def test_unknown_format_names_file_and_accepted_formats(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"query": "q", "label": "a"}])
    with pytest.raises(KvfError) as e:
        load_dataset("musique", path)
    msg = str(e.value)
    assert "odd.jsonl" in msg and "dpr" in msg and "musique" in msg and "\n" not in msg
    # a known format that the dataset does not take is refused too
    with pytest.raises(KvfError, match="accepted: dpr"):
        load_dataset("nq", write_json(tmp_path / "w.json", TWOWIKI))
    assert detect_format({"x": 1}) is None


def test_bad_records_refused_with_index_or_skipped(tmp_path):
    records = [DPR[0], {"question": "q", "answers": [], "ctxs": [{"title": "", "text": "t"}]}, DPR[1]]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(KvfError, match=r"bad\.jsonl: record 1: no answers.*--skip-bad"):
        load_dataset("nq", path)
    with pytest.warns(UserWarning, match="skipped 1 bad record"):
        qs = load_dataset("nq", path, skip_bad=True)
    assert [q.qid for q in qs] == ["nq-0", "nq-2"]  # ids stay the record index


def test_missing_empty_and_malformed_files(tmp_path):
    with pytest.raises(KvfError, match="does not exist"):
        load_dataset("nq", tmp_path / "nope.jsonl")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(KvfError, match="empty"):
        load_dataset("nq", tmp_path / "empty.json")
    (tmp_path / "broken.jsonl").write_text(json.dumps(DPR[0]) + "\n{oops\n")
    with pytest.raises(KvfError, match="line 2"):
        load_dataset("nq", tmp_path / "broken.jsonl")
    with pytest.raises(KvfError, match="unknown dataset"):
        load_dataset("squad", write_json(tmp_path / "d.json", DPR))


def test_prepare_pools_passages_and_round_trips(tmp_path):
    manifest = prepare("nq", write_jsonl(tmp_path / "nq.jsonl", DPR), tmp_path / "out")
    assert (manifest["questions"], manifest["passages"], manifest["format"]) == (2, 2, "dpr")
    corpus = [json.loads(l) for l in (tmp_path / "out/corpus/passages.jsonl").read_text().splitlines()]
    assert [r["id"] for r in corpus] == [passage_id("Hamlet", DPR[0]["ctxs"][0]["text"]),
                                         passage_id("Macbeth", "Macbeth is a tragedy.")]
    assert set(corpus[0]) == {"id", "title", "text"}
    rows = [json.loads(l) for l in (tmp_path / "out/questions.jsonl").read_text().splitlines()]
    assert rows[1] == {"id": "nq-1", "question": "what is macbeth", "answers": ["a tragedy"],
                       "context_ids": [corpus[1]["id"]]}  # the shared Macbeth passage is stored once
    questions, passages = load_prepared(tmp_path / "out")
    assert [q.contexts for q in questions] == [q.contexts for q in load_dataset("nq", tmp_path / "nq.jsonl")]
    assert len(passages) == 2


def test_preparing_another_dataset_where_one_was_says_it_replaces_it(tmp_path, capsys):
    """`kvf data prepare musique -o DIR` where DIR held nq replaced it without a word."""
    prepare("nq", write_jsonl(tmp_path / "nq.jsonl", DPR), tmp_path / "out")
    prepare("nq", write_jsonl(tmp_path / "nq.jsonl", DPR), tmp_path / "out", limit=1)   # the same one again: quiet
    assert "replaces" not in capsys.readouterr().err
    prepare("musique", write_jsonl(tmp_path / "m.jsonl", MUSIQUE), tmp_path / "out")
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'out'} held the nq dataset; musique replaces it" in err, err
    assert json.loads((tmp_path / "out" / "prepared.json").read_text())["dataset"] == "musique"


def test_passage_ids_are_stable_content_hashes():
    assert passage_id("a", "b") == passage_id("a", "b") == Passage("a", "b").id
    assert passage_id("a b", "c") != passage_id("a", "b c")
    assert len(passage_id("", "x")) == 16


def test_load_prepared_errors(tmp_path):
    with pytest.raises(KvfError, match="kvf data prepare"):
        load_prepared(tmp_path)
    prepare("nq", write_jsonl(tmp_path / "nq.jsonl", DPR), tmp_path / "out")
    (tmp_path / "out/corpus/passages.jsonl").write_text("")
    with pytest.raises(KvfError, match="not in corpus"):
        load_prepared(tmp_path / "out")


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("KVF_DATA", str(tmp_path))
    assert data_dir() == tmp_path
    assert data_dir(str(tmp_path / "..")) == tmp_path / ".."  # the flag wins over the env
    with pytest.raises(KvfError, match="--data-dir"):
        data_dir(str(tmp_path / "missing"))
    monkeypatch.setenv("KVF_DATA", str(tmp_path / "missing"))
    with pytest.raises(KvfError, match="KVF_DATA"):
        data_dir()
    (tmp_path / "musique").mkdir()
    (tmp_path / "musique/musique_s.json").write_text("[]")
    assert find_dataset_file("musique", tmp_path) == tmp_path / "musique/musique_s.json"
    with pytest.raises(KvfError, match="missing"):
        find_dataset_file("nq", tmp_path)
    with pytest.raises(KvfError, match="--input"):
        find_dataset_file("triviaqa", tmp_path)


def test_cli_prepare(tmp_path):
    import typer
    from kvf.cli.data_cmd import data_app
    app = typer.Typer()
    app.add_typer(data_app, name="data")
    app.command("noop")(lambda: None)  # keep "data" a subcommand
    path = write_jsonl(tmp_path / "bad.jsonl", [DPR[0], {"question": "q", "answers": [], "ctxs": []}])
    result = CliRunner().invoke(app, ["data", "prepare", "nq", "--input", str(path), "--out", str(tmp_path / "o"), "--skip-bad"])
    assert result.exit_code == 0, result.output
    assert "1 question," in result.output and "1 skipped" in result.output
    one = write_jsonl(tmp_path / "one.jsonl", [DPR[1]])   # it said "1 distinct passages"
    result = CliRunner().invoke(app, ["data", "prepare", "nq", "--input", str(one), "--out", str(tmp_path / "o1")])
    assert result.exit_code == 0 and "nq: 1 question, 1 distinct passage (dpr format" in result.output, result.output
    # -n past the file's end: what the user asked for is not silently cut to what there is
    result = CliRunner().invoke(app, ["data", "prepare", "nq", "--input", str(path), "--out", str(tmp_path / "o"),
                                      "--skip-bad", "-n", "50"])
    assert "1 question (-n 50 asked: that is all there are)" in " ".join(result.output.split()), result.output
    result = CliRunner().invoke(app, ["data", "prepare", "nq", "--input", str(path), "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, KvfError)


# ---- the real files (shared/data, see SOURCES.md) ---------------------------------------------

def test_real_musique():
    qs = load_dataset("musique", find_dataset_file("musique", real_data()))
    assert len(qs) == 150 and all(len(q.contexts) == 10 and len(q.answers) == 1 for q in qs)
    assert qs[0].answers == ["Exeter College"]


def test_real_2wikimqa_clean_flattens_two_answer_lists():
    qs = load_dataset("2wikimqa", find_dataset_file("2wikimqa", real_data()))
    assert len(qs) == 102 and all(len(q.contexts) == 10 for q in qs)
    assert [q.answers for q in qs if len(q.answers) > 1] == [["Iranian hospital Dubai", "Dubai"]]


def test_real_2wikimqa_dev500_pandas_export():
    qs = load_dataset("2wikimqa-dev", find_dataset_file("2wikimqa-dev", real_data()))
    assert len(qs) == 500 and all(len(q.contexts) == 10 for q in qs)
    assert qs[0].qid == "100c512a0bde11eba7f7acde48001122" and qs[0].answers == ["Cork"]
    assert qs[0].question == "Where was the place of burial of Charles Mathew's father?"
    assert qs[0].contexts[0].title == "Anthony Robinson (Unitarian)"


def test_real_nq_oracle_gzip():
    qs = load_dataset("nq", find_dataset_file("nq", real_data()))
    assert len(qs) == 2655 and all(len(q.contexts) == 1 for q in qs)
    assert qs[0].answers == ["Wilhelm Conrad Röntgen"]


def test_real_prepare_musique_pools_shared_passages(tmp_path):
    manifest = prepare("musique", find_dataset_file("musique", real_data()), tmp_path)
    assert manifest["questions"] == 150
    assert manifest["source_sha256"] == "d679da1dad32b7f3645de9db0d7a1aaa7e679eb76ed48c02c4688137e5ce6674"
    questions, passages = load_prepared(tmp_path)
    # fewer distinct passages than 150 x 10: some chunks repeat across questions and are pooled once
    assert len(passages) == manifest["passages"] < 1500
    assert all(len(q.contexts) == 10 for q in questions)


def test_data_dir_default_absent_is_an_error(tmp_path, monkeypatch):
    import kvf.pipeline.data.datasets as datasets
    monkeypatch.delenv("KVF_DATA", raising=False)
    monkeypatch.setattr(datasets, "REPO_ROOT", tmp_path / "repo")  # no ../shared/data beside it
    with pytest.raises(KvfError, match="pass --data-dir DIR or set KVF_DATA"):
        data_dir()


def test_malformed_json_array_names_the_line(tmp_path):
    (tmp_path / "arr.json").write_text('[\n{"question": "q",\n "answers": ["a"] "ctxs": []}\n]')
    with pytest.raises(KvfError, match=r"arr.json line 3: malformed JSON"):
        load_dataset("nq", tmp_path / "arr.json")


def test_empty_passages_are_dropped(tmp_path):
    rec = {"question": "q", "answers": ["a"], "ctxs": [{"title": "T", "text": "  "}, {"title": "U", "text": "u"}]}
    assert load_dataset("nq", write_json(tmp_path / "e.json", [rec]))[0].contexts == [Passage("U", "u")]


def test_own_questions_file_saved_by_a_windows_editor_reads_like_any_other(tmp_path):
    """`kvf run -q FILE` and `kvf data prepare custom --input FILE`: a byte-order mark and CRLF line
    ends (what Notepad writes) read as plain UTF-8 lines, not 'malformed JSON' on line 1."""
    from kvf.pipeline.data.datasets import load_questions_file, prepare_custom
    lines = [{"question": "Who founded Acme?", "answers": ["Jane Roe"], "passages": [{"title": "Acme", "text": "Jane Roe."}]},
             {"question": "Who runs Beta?", "answers": ["John Doe"], "passages": [{"title": "Beta", "text": "John Doe."}]}]
    def windows_file(name, rows):
        path = tmp_path / name
        path.write_bytes(("\ufeff" + "".join(json.dumps(row) + "\r\n" for row in rows) + "\r\n").encode("utf-8"))
        return path
    own = load_questions_file(windows_file("mine.jsonl", [{k: v for k, v in line.items() if k != "passages"}
                                                          for line in lines]))
    assert [q.question for q in own] == ["Who founded Acme?", "Who runs Beta?"] and own[0].answers == ["Jane Roe"]
    prepare_custom(windows_file("custom.jsonl", lines), tmp_path / "prepared")
    prepared, _ = load_prepared(tmp_path / "prepared")
    assert [q.question for q in prepared] == ["Who founded Acme?", "Who runs Beta?"]


def test_a_gzipped_questions_file_reads_as_its_lines_and_names_its_questions_as_they_do(tmp_path):
    """Run files and corpora may be gzipped; your own questions were refused as "not UTF-8 text (byte 1)". A gzipped
    questions file (kvf run -q, kvf data prepare custom --input) now reads as its lines, and its questions are named
    as the plain file's are (mine-1, not mine.jsonl-1)."""
    import gzip
    from kvf.pipeline.data.datasets import load_questions_file, prepare_custom
    rows = [{"question": "Who founded Acme?", "answers": ["Jane Roe"], "passages": [{"title": "Acme", "text": "Jane Roe."}]},
            {"question": "Who runs Beta?", "answers": ["John Doe"], "passages": [{"title": "Beta", "text": "John Doe."}]}]
    text = "".join(json.dumps({k: v for k, v in row.items() if k != "passages"}) + "\n" for row in rows).encode()
    (tmp_path / "mine.jsonl").write_bytes(text)
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "mine.jsonl.gz").write_bytes(gzip.compress(text))
    assert load_questions_file(tmp_path / "gz" / "mine.jsonl.gz") == load_questions_file(tmp_path / "mine.jsonl")
    assert [q.qid for q in load_questions_file(tmp_path / "gz" / "mine.jsonl.gz")] == ["mine-1", "mine-2"]
    custom = tmp_path / "custom.jsonl.gz"
    custom.write_bytes(gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode()))
    prepare_custom(custom, tmp_path / "prepared")
    assert [q.question for q in load_prepared(tmp_path / "prepared")[0]] == ["Who founded Acme?", "Who runs Beta?"]


def test_passages_null_means_none_named_in_both_own_questions_files(tmp_path):
    """`"passages": null` (what pandas writes for a missing value) names no passages, as leaving the field out does:
    `kvf run -q` refused it, `kvf data prepare custom` took it as none. Both now read it alike."""
    from kvf.pipeline.data.datasets import load_questions_file, prepare_custom
    rows = [{"id": "a", "question": "Who founded Acme?", "passages": None},
            {"id": "b", "question": "Who runs Beta?", "passages": [{"title": "Beta", "text": "John Doe runs Beta."}]}]
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [q.context_ids for q in load_questions_file(write_json(tmp_path / "ids.jsonl", rows[0]))] == [[]]
    prepare_custom(mine, tmp_path / "prepared")
    prepared, _ = load_prepared(tmp_path / "prepared")
    assert [len(q.context_ids) for q in prepared] == [0, 1]


def test_own_questions_with_passages_need_no_answers(tmp_path):
    """`kvf data prepare custom`: answers are optional, as for `kvf run -q` (a user's own questions are
    scored against full prefill's answer); it refused a file without them."""
    from kvf.pipeline.data.datasets import prepare_custom
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"question": "Who built it?", "passages": [{"title": "B", "text": "Ann built it."}]}) + "\n"
                    + json.dumps({"question": "Who runs Beta?", "answers": "John Doe",
                                  "passages": [{"title": "Beta", "text": "John Doe."}]}) + "\n")
    prepare_custom(mine, tmp_path / "prepared")
    prepared, _ = load_prepared(tmp_path / "prepared")
    assert [(q.question, q.answers) for q in prepared] == [("Who built it?", []), ("Who runs Beta?", ["John Doe"])]
    assert [p.text for p in prepared[0].contexts] == ["Ann built it."]


def test_an_unknown_passage_id_names_the_fix_that_applies(tmp_path):
    """With --corpus given, the error told the user to "pass --corpus DOCS", which they had."""
    from kvf.pipeline.data.datasets import prepare_custom
    docs, mine = tmp_path / "docs", tmp_path / "mine.jsonl"
    docs.mkdir()
    (docs / "acme.txt").write_text("Acme was founded by Jane Roe.")
    mine.write_text(json.dumps({"question": "Who founded Acme?", "passages": ["acme-corp"]}) + "\n")
    with pytest.raises(KvfError, match=f"line 1: passage id 'acme-corp' is not a document of --corpus {docs}; check "
                                       "the id .*e.g. 'acme.txt'"):
        prepare_custom(mine, tmp_path / "prepared", corpus=docs)
    mine.write_text(json.dumps({"question": "Who founded Acme?", "passages": ["acme"]}) + "\n")   # acme.txt's stem
    with pytest.raises(KvfError, match="passage id 'acme' is not a document of --corpus .*; write the document's "
                                       "file name, 'acme.txt'"):
        prepare_custom(mine, tmp_path / "prepared", corpus=docs)
    with pytest.raises(KvfError, match=r"--corpus \(none given\); pass --corpus DOCS, or give the passage"):
        prepare_custom(mine, tmp_path / "prepared")
    mine.write_text(json.dumps({"question": "Who founded Acme?", "passages": ["acme.txt"]}) + "\n")
    prepare_custom(mine, tmp_path / "prepared", corpus=docs)
    prepared, _ = load_prepared(tmp_path / "prepared")
    assert [p.text for p in prepared[0].contexts] == ["Acme was founded by Jane Roe."]


def test_two_questions_under_one_id_in_an_own_questions_file_are_refused(tmp_path):
    """`kvf run -q FILE`: records are keyed by question id; two questions sharing one were both answered,
    and the run file then failed `kvf eval` ('appears more than once') and confused resuming."""
    from kvf.pipeline.data.datasets import load_questions_file
    questions = tmp_path / "mine.jsonl"
    questions.write_text(json.dumps({"id": "a", "question": "Who founded Acme?"}) + "\n"
                         + json.dumps({"id": "a", "question": "Who runs Beta?"}) + "\n")
    with pytest.raises(KvfError, match="mine.jsonl line 2: question id a is used twice"):
        load_questions_file(questions)
    questions.write_text(json.dumps({"question": "Who founded Acme?"}) + "\n" + json.dumps({"question": "Who?"}) + "\n")
    assert [q.qid for q in load_questions_file(questions)] == ["mine-1", "mine-2"]   # made-up ids never collide


def test_a_question_id_named_qid_or_beir_id_is_the_questions_own(tmp_path):
    """"qid" (kvf's own run records name it so) and "_id" (BEIR's queries.jsonl) were not read: the run's records
    carried made-up ids (mine-1, ...) instead, and two questions sharing one id were both answered."""
    from kvf.pipeline.data.datasets import load_questions_file
    questions = tmp_path / "mine.jsonl"
    questions.write_text("\n".join(json.dumps(row) for row in [{"qid": "q7", "question": "Who founded Acme?"},
                                                                 {"_id": 12, "question": "Who runs Beta?"},
                                                                 {"id": "x", "qid": "y", "question": "Who?"},
                                                                 {"question": "Where?"}]) + "\n")
    assert [q.qid for q in load_questions_file(questions)] == ["q7", "12", "x", "mine-4"]
    questions.write_text(json.dumps({"qid": "a", "question": "Who?"}) + "\n" + json.dumps({"_id": "a", "question": "Why?"}) + "\n")
    with pytest.raises(KvfError, match="mine.jsonl line 2: question id a is used twice"):
        load_questions_file(questions)


def test_integer_document_ids_are_cited_as_the_corpus_writes_them(tmp_path):
    """A .jsonl corpus's {"id": 1} is document "1" (read_corpus keys it so); a question citing it as written
    there, "passages": [1], was refused by `kvf run -q` and by `kvf data prepare custom`."""
    from kvf.pipeline.data.datasets import load_questions_file, prepare_custom
    docs, mine = tmp_path / "docs", tmp_path / "mine.jsonl"
    docs.mkdir()
    (docs / "c.jsonl").write_text(json.dumps({"id": 1, "title": "Acme", "text": "Acme was founded by Jane Roe."}) + "\n")
    mine.write_text(json.dumps({"question": "Who founded Acme?", "passages": [1]}) + "\n")
    assert load_questions_file(mine)[0].context_ids == ["1"]
    prepare_custom(mine, tmp_path / "prepared", corpus=docs)
    prepared, _ = load_prepared(tmp_path / "prepared")
    assert [p.text for p in prepared[0].contexts] == ["Acme was founded by Jane Roe."]
    mine.write_text(json.dumps({"question": "Who founded Acme?", "passages": [True]}) + "\n")   # not an id
    with pytest.raises(KvfError, match="passages"):
        load_questions_file(mine)


def test_a_whole_number_answer_is_its_digits(tmp_path):
    """"answers": [1921] (a year, as many question files write it) was refused as not a string: it is "1921";
    a fraction or a boolean is still refused."""
    from kvf.pipeline.data.datasets import load_questions_file
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "When was Acme founded?", "answers": [1921, "in 1921"]}\n'
                    '{"question": "How many anvils?", "answer": 12}\n')
    assert [q.answers for q in load_questions_file(path)] == [["1921", "in 1921"], ["12"]]
    path.write_text('{"question": "q", "answers": [0.5]}\n')
    with pytest.raises(KvfError, match="line 1: \"answers\" must be a string, a whole number or a list of them"):
        load_questions_file(path)

