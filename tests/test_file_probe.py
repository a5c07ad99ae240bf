"""On demand (`make probe-files`, 10 to 15 minutes): every field of every JSON file kvf reads, given each of a few
values of the wrong kind or left out, as a hand edit, a converted export or another tool's file would give it,
through the real `kvf` program. A value may be accepted (an id of 7 is the id "7"); a refusal must be exactly one
line, `kvf: error: ...`, with no traceback and no internal error; and where a command ran, the files it wrote must
not hold Python's text of a value (the title "['x']", the question "None"): such a value was misread, not refused.

On the code before it, it failed 34 times with crashes alone ("passages": 7 was "'int' object is not iterable", a
manifest's "store": 7 "argument of type 'int' is not iterable"), and 39 times with misreads alone (titles, ids
and questions that were lists, null, true or NaN). What it cannot tell is whether any other accepted value was read
as meant: those are cases in tests/test_catalogue.py and tests/test_datasets.py."""
import copy
import json
import math
import os
import shutil

import pytest

from conftest import changed, probe_verdict, run_cli, tree

PROBE = os.environ.get("KVF_PROBE_FILES") == "1"
LEFT_OUT = object()
VALUES = {"left out": LEFT_OUT, "null": None, "a word": "x", "empty": "", "7": 7, "-1": -1, "NaN": math.nan,
          "true": True, "[]": [], "{}": {}, '["x"]': ["x"], "[7]": [7], "[null]": [None], "[{}]": [{}]}


def field_paths(record: dict, parent: tuple = ()) -> list[tuple]:
    """Every field of a JSON object, and every field of the objects inside it, of a list's first one included:
    ("settings", "ratio"), ("ctxs", 0, "title")."""
    paths = []
    for name, value in record.items():
        path = (*parent, name)
        paths.append(path)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            path, value = (*path, 0), value[0]          # a list of objects: its first one stands for the rest
        if isinstance(value, dict):
            paths += field_paths(value, path)
    return paths


def with_field(record: dict, path: tuple, value) -> dict:
    """A copy of record with the field at path set to value (or removed, for LEFT_OUT)."""
    record = copy.deepcopy(record)
    holder = record
    for name in path[:-1]:
        holder = holder[name]
    if value is LEFT_OUT:
        del holder[path[-1]]
    else:
        holder[path[-1]] = value
    return record


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_lines(path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# Python's text of a list, null, true or NaN, as a JSON string: found in a file kvf wrote, such a value was taken
# as text (the title "['x']", the question "None") where it should have been refused
PYTHON_TEXT = [json.dumps(text) for text in ("['x']", "[None]", "None", "True", "nan")]


def misread(written: list) -> str | None:
    """None, unless a JSON file among `written` (files, or folders of them) holds one of PYTHON_TEXT."""
    for path in written:
        for file in [path] if path.is_file() else sorted(path.rglob("*.json*")):
            found = next((text for text in PYTHON_TEXT if text in file.read_text(errors="replace")), None)
            if found:
                return f"{file.name} holds {found}, Python's text of a value the file did not hold as text"
    return None


def probe_file(root, name: str, target, records: list[dict], commands: list[list], capsys, monkeypatch,
               written: tuple = ()) -> list[str]:
    """Each field of records[0] set to each VALUES value in `target` (the rest as they are), then each command;
    where a command runs, the files it wrote (`written`) are read for PYTHON_TEXT; where it is refused, nothing
    under root (the test's folder) may have changed: no empty run file, no half-made folder, no rewritten store.
    The file is restored afterwards -> one line per failure."""
    failures = []
    original = target.read_bytes()
    for args in commands:   # the file as it is must be taken: else every damage would be "refused" for nothing
        code, _, err = run_cli(args, capsys, monkeypatch)
        assert code == 0 and not misread(written), f"{name}: the undamaged file is refused or misread: {err}"
    for path in field_paths(records[0]):
        for label, value in VALUES.items():
            write_lines(target, [with_field(records[0], path, value), *records[1:]])
            for args in commands:
                before = tree(root, target)
                code, _, err = run_cli(args, capsys, monkeypatch)
                why = probe_verdict(code, err) or (misread(written) if code == 0 else
                                                   changed(before, tree(root, target)))
                if why:
                    failures.append(f"{name} {'.'.join(map(str, path))} = {label}: kvf {' '.join(map(str, args))}: {why}")
    target.write_bytes(original)
    return failures


def one_line_json(target) -> None:
    """manifest.json is one object written over lines: as one line, so that write_lines can rewrite it."""
    target.write_text(json.dumps(json.loads(target.read_text())) + "\n")


@pytest.mark.skipif(not PROBE, reason="on demand: make probe-files (KVF_PROBE_FILES=1), 10 to 15 minutes")
def test_every_field_of_every_file_kvf_reads_is_accepted_or_one_line(built, tmp_path, capsys, monkeypatch):
    shutil.copytree(built / "data", tmp_path / "data")
    shutil.copytree(built / "ws", tmp_path / "ws")
    dataset, ws, out = tmp_path / "data", tmp_path / "ws", tmp_path / "out"
    run_file = tmp_path / "run.jsonl"
    assert run_cli(["run", "-d", dataset, "-w", ws, "-m", "full,reuse", "-n", "2", "--max-new-tokens", "2",
                    "--no-show-answers", "-o", run_file], capsys, monkeypatch)[0] == 0
    prepared = read_lines(dataset / "questions.jsonl")
    passages = {p["id"]: p for p in read_lines(dataset / "corpus" / "passages.jsonl")}
    own = tmp_path / "own.jsonl"            # kvf run -q: passages by document id
    write_lines(own, [{"id": q["id"], "question": q["question"], "answers": q["answers"], "passages": q["context_ids"]}
                      for q in prepared[:2]])
    custom = tmp_path / "custom.jsonl"      # kvf data prepare custom: passages carried as {title, text}
    write_lines(custom, [{"id": q["id"], "question": q["question"], "answers": q["answers"],
                          "passages": [{"title": passages[i]["title"], "text": passages[i]["text"]} for i in q["context_ids"]]}
                         for q in prepared[:2]])
    corpus = tmp_path / "docs.jsonl"        # kvf build-cache: a .jsonl corpus
    write_lines(corpus, list(passages.values())[:3])
    one_line_json(ws / "manifest.json")
    one_run = ["-m", "reuse", "--max-new-tokens", "1", "-n", "1", "--no-show-answers", "-o", out / "o.jsonl",
               "--overwrite"]
    failures = []
    failures += probe_file(tmp_path, "run record", run_file, read_lines(run_file),
                           [["eval", run_file, "-o", out / "eval"], ["compare", run_file, "--a", "reuse", "--b", "full"]],
                           capsys, monkeypatch)
    failures += probe_file(tmp_path, "-q questions", own, read_lines(own), [["run", "-w", ws, "-q", own, *one_run]],
                           capsys, monkeypatch)
    failures += probe_file(tmp_path, "custom --input", custom, read_lines(custom),
                           [["data", "prepare", "custom", "--input", custom, "-o", out / "custom"]],
                           capsys, monkeypatch, written=(out / "custom",))
    failures += probe_file(tmp_path, ".jsonl corpus", corpus, read_lines(corpus),
                           [["build-cache", corpus, "-w", out / "ws", "--no-bm25", "--no-dense", "--chunk-tokens", "64",
                             "--neighbours", "1"]], capsys, monkeypatch, written=(out / "ws" / "doc_chunks.json",))
    failures += probe_file(tmp_path, "prepared questions", dataset / "questions.jsonl", prepared,
                           [["run", "-d", dataset, "-w", ws, *one_run]], capsys, monkeypatch)
    failures += probe_file(tmp_path, "workspace manifest", ws / "manifest.json", read_lines(ws / "manifest.json"),
                           [["search", "capital", "-w", ws], ["store", "info", ws], ["run", "-w", ws, "-q", own, *one_run]],
                           capsys, monkeypatch)
    nq_rows = [{"question": q["question"], "answers": q["answers"],
                "ctxs": [{"title": passages[i]["title"], "text": passages[i]["text"]} for i in q["context_ids"]]}
               for q in prepared[:2]]
    musique_rows = [{"id": q["id"], "question": q["question"], "answer": q["answers"][0], "answer_aliases": [],
                     "paragraphs": [{"idx": j, "title": passages[i]["title"], "paragraph_text": passages[i]["text"],
                                     "is_supporting": j == 0} for j, i in enumerate(q["context_ids"])]}
                    for q in prepared[:2]]
    wiki_rows = [{"_id": q["id"], "question": q["question"], "answer": q["answers"][0],
                  "context": [[passages[i]["title"], passages[i]["text"].split(". ")] for i in q["context_ids"]]}
                 for q in prepared[:2]]
    for name, rows in (("nq", nq_rows), ("musique", musique_rows), ("2wikimqa", wiki_rows)):   # benchmark records
        source = tmp_path / f"{name}.jsonl"
        write_lines(source, rows)
        failures += probe_file(tmp_path, f"{name} record", source, rows,
                               [["data", "prepare", name, "--input", source, "-o", out / name]], capsys, monkeypatch,
                               written=(out / name,))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
