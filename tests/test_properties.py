"""Property-based tests (hypothesis) of the parsers users feed by hand: run records and dataset files.
Whatever the input, they return parsed data or raise a one-line KvfError: never another exception."""
import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvf.errors import KvfError
from kvf.pipeline.data.datasets import load_prepared, parse_records
from kvf.pipeline.records import RunRecord, parse_record, read_records

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                           lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
                           max_leaves=12)
VALID = {"qid": "q1", "dataset": "toy", "method": "full", "settings": {"ratio": 1.0, "variant": "prefix"},
         "chunk_ids": ["c1"], "question": "q", "answer": "a", "gold": ["a"], "prompt_tokens": 5, "chunk_tokens": 3,
         "recomputed_tokens": 3, "timings": {"load": 0.1, "select": 0.0, "recompute": 0.2, "first_token": 0.3, "decode": 0.1}}
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def one_line(error: KvfError) -> bool:
    return "\n" not in str(error) and str(error)


@SETTINGS
@given(json_values)
def test_any_json_value_is_a_record_or_a_one_line_error(value):
    try:
        assert isinstance(parse_record(value, "f line 1"), RunRecord)
    except KvfError as e:
        assert one_line(e) and str(e).startswith("f line 1")


@SETTINGS
@given(st.sampled_from(sorted(VALID)), json_values)
def test_a_record_with_one_field_replaced_is_valid_or_refused_naming_it(field, value):
    record = {**VALID, field: value}
    try:
        parsed = parse_record(record, "f line 1")
        assert getattr(parsed, field) is not None or value is None
    except KvfError as e:
        assert one_line(e) and field in str(e)


@SETTINGS
@given(st.binary(max_size=200))
def test_any_bytes_as_a_run_file(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("runs") / "r.jsonl"
    path.write_bytes(data)
    try:
        assert all(isinstance(r, RunRecord) for r in read_records(path))
    except KvfError as e:
        assert one_line(e)


@SETTINGS
@given(st.lists(st.dictionaries(st.sampled_from(["question", "answers", "answer", "ctxs", "context", "paragraphs",
                                                 "input", "output", "_id", "title", "text"]), json_values, max_size=6),
                min_size=1, max_size=4),
       st.sampled_from(["nq", "2wikimqa", "musique", "hotpotqa", "longbench"]))
def test_dataset_records_of_any_shape(tmp_path_factory, records, name):
    try:
        questions, fmt, bad = parse_records(name, Path("f.json"), records)
        for q in questions:
            assert q.answers and q.contexts and all(isinstance(p.text, str) for p in q.contexts)
    except KvfError as e:
        assert one_line(e)


@SETTINGS
@given(st.lists(json_values, max_size=4), st.lists(json_values, max_size=4))
def test_prepared_directories_of_any_content(tmp_path_factory, passages, questions):
    root = tmp_path_factory.mktemp("prepared")
    (root / "corpus").mkdir()
    (root / "corpus" / "passages.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages))
    (root / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    try:
        loaded, _ = load_prepared(root)
        assert all(q.qid and q.question for q in loaded)
    except KvfError as e:
        assert one_line(e)
