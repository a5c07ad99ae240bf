"""Benchmark loaders: published QA files -> Questions with their passages -> a prepared directory.

A prepared directory is what the rest of kvf reads:
    out_dir/corpus/passages.jsonl   {"id", "title", "text"}, every distinct passage once
    out_dir/questions.jsonl         {"id", "question", "answers": [alias, ...], "context_ids": [...]}
    out_dir/prepared.json           where it came from (dataset, source file, sha256, format, counts)
It serves both settings: per-question contexts (a question's own context_ids, in order) and the
shared corpus (all pooled passages).

Accepted input formats (autodetected from the first record; gzip detected by magic bytes; a JSON
array, JSON Lines, a single JSON object, or a pandas column-oriented export):
    dpr      {"question", "answers" | "answer", "ctxs": [{"title", "text", ...}]}: DPR / FiD /
             lost-in-the-middle NQ-open and TriviaQA, and CacheBlend/LongBench musique_s.json and
             wikimqa_s*.json. `answers` may be a string, a list, or a list of lists (flattened).
    2wiki    {"question", "answer", "context": [[title, [sentence, ...]], ...]}: 2WikiMultihopQA
             (and HotpotQA) original; sentences are joined with single spaces.
    musique  {"question", "answer", "answer_aliases", "paragraphs": [{"title", "paragraph_text"}]}:
             MuSiQue original.
    kilt     {"id", "input", "output": [{"answer"}, {"provenance": [...]}]}: KILT. KILT provenance
             holds only Wikipedia ids, so passages must come with the record: either as DPR-style
             `ctxs` (as retrievers write them) or as provenance entries that carry `text`.
"""
import gzip
import hashlib
import json
import math
import re
import shlex
import textwrap
import warnings
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvf.errors import KvfError, did_you_mean, json_reason, shown, stand_in, warn
from kvf.pipeline.files import check_writable_dir, env_folder, other_files, write_atomic
from kvf.pipeline.retrieval.corpus import id_text, is_run_record, read_corpus, title_text

# what a line of a user's own question file looks like, for errors on a line that is not one
QUESTIONS_FIX = "see README, 'Your own documents and questions'"
QUESTION_LINE = 'each line must be one JSON object, e.g. {"question": "Who wrote Dune?", "answers": ["Frank Herbert"]}'

FORMATS = {
    "dpr": "DPR-style {question, answers, ctxs[{title,text}]} (NQ-open, TriviaQA, CacheBlend/LongBench)",
    "2wiki": "2WikiMultihopQA / HotpotQA original {question, answer, context[[title,[sentences]]], supporting_facts}, pandas export too",
    "longbench": "LongBench JSON Lines {input, context, answers, _id}: the context's 'Passage N:' blocks become passages",
    "musique": "MuSiQue original {question, answer, answer_aliases, paragraphs[{title,paragraph_text}]}",
    "kilt": "KILT {input, output[{answer}], and ctxs or provenance with text}",
}
ACCEPTED_FORMATS = {
    "nq": ["dpr", "kilt"],
    "triviaqa": ["dpr", "kilt"],
    "2wikimqa": ["dpr", "2wiki", "longbench"],
    "2wikimqa-dev": ["dpr", "2wiki"],
    "musique": ["dpr", "musique", "longbench"],
    "hotpotqa": ["2wiki", "dpr", "longbench"],
    "longbench": ["longbench"],
}
# where each benchmark's file sits under the data directory (see shared/data/SOURCES.md)
DATASET_FILES = {
    "nq": "nq/nq-open-oracle.jsonl.gz",
    "musique": "musique/musique_s.json",
    "2wikimqa": "2wikimqa/wikimqa_s_clean.json",
    "2wikimqa-dev": "2wikimqa/2wikimqa_dev500_sampled_ds.json",
    "hotpotqa": "hotpotqa/hotpotqa_dev500_fullwiki_sampled_ds.json",
}
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Passage:
    title: str
    text: str

    @property
    def id(self) -> str:
        return passage_id(self.title, self.text)


@dataclass
class Question:
    qid: str
    question: str
    answers: list[str]                                   # may be empty: a question without gold answers
    contexts: list[Passage] = field(default_factory=list)
    context_ids: list[str] | None = None                 # document ids in the corpus; default: the passages' ids
    gold_mode: str = "any"                               # "all": every answer value is needed (RULER)
    task: str | None = None                              # a generated suite's task; records' dataset is "name/task"
    fact_chunks: list[int] | None = None                 # which passages hold the facts (generated suites)

    def __post_init__(self):
        if self.context_ids is None:
            self.context_ids = [p.id for p in self.contexts]


def passage_id(title: str, text: str) -> str:
    """Stable content id: identical passages get one id wherever they come from."""
    # json.dumps of the pair keeps ("a b", "c") and ("a", "b c") apart
    key = json.dumps([title, text], ensure_ascii=False)
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# data directory

def data_dir(flag: str | None = None) -> Path:
    """--data-dir, else $KVF_DATA, else ../shared/data beside the repo if it exists."""
    if flag:
        path, origin = Path(flag).expanduser(), "--data-dir"
    elif (env := env_folder("KVF_DATA", "the folder that holds the benchmark files")) is not None:
        path, origin = env, "KVF_DATA"
    else:
        path = REPO_ROOT.parent / "shared" / "data"
        if not path.is_dir():
            raise KvfError(f"no data directory: pass --data-dir DIR or set KVF_DATA ({path} does not exist)")
        return path
    if not path.is_dir():
        state = "is a file, not a folder" if path.exists() else "does not exist"
        raise KvfError(f"data directory {path} (from {origin}) {state}; pass the folder that holds the "
                       f"benchmark files (e.g. {next(iter(DATASET_FILES.values()))}), or --input FILE")
    return path


def check_dataset_name(name: str) -> None:
    if name not in ACCEPTED_FORMATS:
        raise KvfError(f"unknown dataset '{name}'{did_you_mean(name, [*ACCEPTED_FORMATS, 'custom'])}; "
                       f"known: {', '.join(ACCEPTED_FORMATS)}, or custom (your own questions)")


def find_dataset_file(name: str, directory: str | Path | None = None) -> Path:
    """The default input file of a benchmark inside the data directory."""
    check_dataset_name(name)   # a typo is a typo, not a dataset without a file of its own
    if name not in DATASET_FILES:
        accepted = " or ".join(ACCEPTED_FORMATS.get(name, []))
        raise KvfError(f"{name} has no file of its own in the data directory (only {', '.join(DATASET_FILES)} do); "
                       f"pass --input FILE" + (f" ({accepted} format)" if accepted else ""))
    path = data_dir(str(directory) if directory else None) / DATASET_FILES[name]
    if not path.is_file():
        raise KvfError(f"dataset file {path} is missing; pass --input FILE or fix --data-dir/KVF_DATA")
    return path


# ---------------------------------------------------------------------------------------------
# reading files

def read_text(path: Path) -> str:
    """File contents as text, gunzipped when the file starts with the gzip magic bytes."""
    if path.is_dir():   # the dataset's folder (KVF_DATA/musique): its one file is meant
        inside = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        example = inside[0] if inside else path / "FILE"
        raise KvfError(f"--input {path} is a folder; pass the dataset's file in it, e.g. --input {example}")
    if not path.is_file():
        raise KvfError(f"input file {path} does not exist")
    raw = gunzipped(path.read_bytes(), f"input file {path}")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise KvfError(f"{path} is not UTF-8 text ({e})") from None


def gunzipped(raw: bytes, where: str) -> bytes:
    """A file's bytes, gunzipped when they start with the gzip magic bytes (whatever the file's name); `where` names
    the file (and its flag) when they are not a whole gzip stream."""
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:   # a cut-off download; click read EOFError as Ctrl-D
        raise KvfError(f"{where}: not a readable gzip file ({e or 'it ends early'}); check it with `gzip -t` and "
                       "fetch or compress it again") from None


def _is_pandas_columns(obj: dict) -> bool:
    # DataFrame.to_json() default: {column: {row_key: value}} with the same row keys everywhere
    columns = list(obj.values())
    if not columns or not all(isinstance(c, dict) for c in columns):
        return False
    row_keys = set(columns[0])
    return bool(row_keys) and all(set(c) == row_keys for c in columns)


def _pandas_rows(obj: dict) -> list[dict]:
    row_keys = list(next(iter(obj.values())))
    # row keys are "0".."n-1" strings: keep numeric order, not string order
    row_keys.sort(key=lambda k: (0, int(k)) if str(k).isdigit() else (1, str(k)))
    return [{col: obj[col][k] for col in obj} for k in row_keys]


def _read_jsonl(path: Path, text: str) -> list[dict]:
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if not records and (instead := stand_in(line)):
                raise KvfError(f"{path} {instead}") from None
            if not records:
                raise KvfError(f"{path} is neither JSON nor JSON Lines (line {lineno}: {json_reason(e)}); pass the benchmark's "
                               ".json or .jsonl file") from None
            raise KvfError(f"{path} line {lineno}: malformed JSON ({json_reason(e)})") from None
    return records


def read_records(path: Path) -> list[dict]:
    """All records of a JSON array, JSON Lines, single-object or pandas-column JSON file."""
    path = Path(path)
    text = read_text(path)
    if not text.strip():
        raise KvfError(f"input file {path} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):  # a JSON array: its own error says where it broke
            raise KvfError(f"{path} line {e.lineno}: malformed JSON ({json_reason(e)})") from None
        data = _read_jsonl(path, text)
    if isinstance(data, dict):
        data = _pandas_rows(data) if _is_pandas_columns(data) else [data]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise KvfError(f"{path}: expected a list of JSON objects (records); accepted formats: {_format_list()}")
    if not data:
        raise KvfError(f"input file {path} holds no records")
    return data


# ---------------------------------------------------------------------------------------------
# formats

def _format_list(names=None) -> str:
    return "; ".join(f"{n}: {FORMATS[n]}" for n in (names or FORMATS))


def detect_format(record: dict) -> str | None:
    """Which published format a record is in, from its keys; None if none fits."""
    keys = set(record)
    if {"input", "context", "answers"} <= keys:
        return "longbench"
    if "input" in keys and "output" in keys:
        return "kilt"
    if "question" not in keys:
        return None
    if "ctxs" in keys:
        return "dpr"
    if "paragraphs" in keys:
        return "musique"
    if "context" in keys and "answer" in keys:
        return "2wiki"
    return None


def flatten_answers(value) -> list[str]:
    """A string, a list, or a list of lists of aliases -> a flat list of distinct non-empty aliases."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    out = []
    for item in value:
        for alias in flatten_answers(item) if isinstance(item, list) else [item]:
            if not isinstance(alias, str):
                raise ValueError(f"answer {alias!r} is not a string")
            if alias.strip() and alias not in out:
                out.append(alias)
    return out


def _join_sentences(sentences: list[str] | str) -> str:
    # 2Wiki sentences carry no separating whitespace; HotpotQA's do: add a space only when missing
    if isinstance(sentences, str):   # a converted file's whole text: one sentence, not one per letter ("a b c")
        return sentences
    text = ""
    for s in sentences:
        if text and not text[-1].isspace() and not s[:1].isspace():
            text += " "
        text += s
    return text


def make_passage(title, text) -> Passage:
    """A passage from a record; a text that is not a string (null, a number) is a bad record, and so is a title
    that is a list or an object (it would be the title "['x']")."""
    if not isinstance(text, str):
        raise ValueError(f"passage text is {type(text).__name__}, not a string")
    title_string = title_text(title)
    if title_string is None:
        raise ValueError(f"passage title is {type(title).__name__}, not a string")
    return Passage(title_string, text)


def _dpr_passages(ctxs) -> list[Passage]:
    return [make_passage(c.get("title"), c.get("text")) for c in ctxs]


def _parse_dpr(rec: dict):
    answers = rec["answers"] if "answers" in rec else rec.get("answer")
    return rec["question"], flatten_answers(answers), _dpr_passages(rec["ctxs"])


def _parse_2wiki(rec: dict):
    passages = [make_passage(title, _join_sentences(sentences)) for title, sentences in rec["context"]]
    return rec["question"], flatten_answers([rec["answer"], rec.get("answer_aliases") or []]), passages


def _parse_musique(rec: dict):
    passages = [make_passage(p.get("title"), p.get("paragraph_text")) for p in rec["paragraphs"]]
    return rec["question"], flatten_answers([rec["answer"], rec.get("answer_aliases") or []]), passages


def _parse_kilt(rec: dict):
    outputs = rec["output"]
    answers = flatten_answers([o["answer"] for o in outputs if isinstance(o.get("answer"), str)])
    if "ctxs" in rec:
        passages = _dpr_passages(rec["ctxs"])
    else:
        passages = []
        for o in outputs:
            for prov in o.get("provenance") or []:
                p = make_passage(prov.get("title"), prov["text"]) if "text" in prov else None
                if p and p not in passages:
                    passages.append(p)
    return rec["input"], answers, passages


LONGBENCH_PASSAGE = re.compile(r"(?m)^Passage \d+:\s*\n")


def _parse_longbench(rec: dict):
    """LongBench hotpotqa / 2wikimqa / musique: `context` holds 'Passage N:\nTitle\ntext' blocks."""
    blocks = [b.strip() for b in LONGBENCH_PASSAGE.split(rec["context"]) if b.strip()]
    passages = []
    for block in blocks:
        title, _, text = block.partition("\n")
        passages.append(Passage(title.strip(), text.strip()) if text.strip() else Passage("", title.strip()))
    return rec["input"], flatten_answers(rec["answers"]), passages


PARSERS = {"dpr": _parse_dpr, "2wiki": _parse_2wiki, "musique": _parse_musique, "kilt": _parse_kilt,
           "longbench": _parse_longbench}


def _source_qid(rec: dict) -> str | None:
    # 2Wiki's _id is renamed _1 by pandas; its `id` column is then only the dev.json row index
    for key in ("_id", "_1", "id", "qid"):
        qid = id_text(rec.get(key))   # a list, true or NaN is no id (it was "['x']"): the next field, or the index
        if qid is not None:
            return qid
    return None


def parse_records(name: str, path: Path, records: list[dict]) -> tuple[list[Question], str, list[str]]:
    """Records -> (questions, format, bad-record messages). A bad record has no answers, no
    non-empty passages, or misses a field its format needs. Empty passages are dropped."""
    check_dataset_name(name)
    accepted = ACCEPTED_FORMATS[name]
    fmt = detect_format(records[0])
    if fmt not in accepted:
        keys = ", ".join(sorted(records[0])[:12])
        raise KvfError(f"{path}: unrecognised format for dataset '{name}' (first record keys: {keys}); "
                       f"accepted: {_format_list(accepted)}")
    questions, bad, seen = [], [], set()
    for index, rec in enumerate(records):
        try:
            question, answers, passages = PARSERS[fmt](rec)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            bad.append(f"record {index}: not valid {fmt} format ({type(e).__name__}: {e})")
            continue
        # an empty passage holds nothing and the corpus reader skips it: drop it here too
        passages = [p for p in passages if p.text.strip()]
        if not isinstance(question, str) or not question.strip():   # null was asked as the question "None"
            bad.append(f"record {index}: no question (a non-empty string)")
            continue
        if not answers:
            bad.append(f"record {index}: no answers")
            continue
        if not passages:
            bad.append(f"record {index}: no passages")
            continue
        # source ids when the file has them, else the record index: stable for the same file
        qid = _source_qid(rec) or f"{name}-{index}"
        if qid in seen:
            qid = f"{qid}-{index}"
        seen.add(qid)
        questions.append(Question(qid, question, answers, passages))
    return questions, fmt, bad


def _check_bad(path: Path, bad: list[str], skip_bad: bool):
    if bad and not skip_bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise KvfError(f"{path}: {bad[0]}{more}; fix the file or pass --skip-bad to skip such records")
    if bad:
        warnings.warn(f"{path}: skipped {len(bad)} bad record(s); first: {bad[0]}", stacklevel=3)


def load_dataset(name: str, path: str | Path, skip_bad: bool = False) -> list[Question]:
    """Read a benchmark file into Questions (format autodetected, see the module docstring)."""
    path = Path(path)
    questions, _, bad = parse_records(name, path, read_records(path))
    _check_bad(path, bad, skip_bad)
    return questions


# ---------------------------------------------------------------------------------------------
# prepared directory

def _write_jsonl(path: Path, rows):
    write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def pool_passages(questions: list[Question]) -> dict[str, Passage]:
    """Every distinct passage once, in first-seen order."""
    pooled = {}
    for q in questions:
        for p in q.contexts:
            pooled.setdefault(p.id, p)
    return pooled


def question_row(q: Question) -> dict:
    row = {"id": q.qid, "question": q.question, "answers": q.answers, "context_ids": [p.id for p in q.contexts]}
    if q.gold_mode != "any":
        row["gold_mode"] = q.gold_mode
    if q.task is not None:
        row["task"] = q.task
    if q.fact_chunks is not None:
        row["fact_chunks"] = q.fact_chunks
    return row


def check_not_foreign(out_dir: Path) -> None:
    """--out is new, empty, or a prepared dataset (written over): a folder of other files (say, the user's own
    documents) got corpus/ and questions.jsonl beside them, and a later build of that folder read them too."""
    if not out_dir.is_dir() or (out_dir / "prepared.json").is_file():
        return
    others = other_files(out_dir, {"corpus", "questions.jsonl", "workspace"})   # prepared.json is written last
    if others:
        raise KvfError(f"--out {out_dir} holds other files ({others[0]}), and is not a prepared dataset; pass a new or "
                       "empty folder")


def warn_replaced(out_dir: Path, dataset: str | None) -> None:
    """Preparing one dataset where another was (musique -o DIR of nq) replaced it without a word."""
    try:
        before = json.loads((out_dir / "prepared.json").read_text(encoding="utf-8")).get("dataset")
    except (OSError, ValueError, AttributeError):
        return   # none there, or a damaged one: nothing to name
    if isinstance(before, str) and before != dataset:
        warn(f"--out {out_dir} held the {before} dataset; {dataset} replaces it (its workspace is rebuilt by the next "
             f"`kvf run -d {out_dir}`)")


def write_prepared(questions: list[Question], out_dir: str | Path, manifest: dict,
                   corpus_extra: list[Passage] = ()) -> dict:
    """Write corpus/passages.jsonl, questions.jsonl and prepared.json; returns the manifest.
    corpus_extra: more passages for the shared corpus that no question cites."""
    check_not_foreign(Path(out_dir))
    out_dir = check_writable_dir(out_dir, "--out")
    warn_replaced(out_dir, manifest.get("dataset"))
    (out_dir / "corpus").mkdir(exist_ok=True)
    pooled = pool_passages(questions)
    for p in corpus_extra:
        pooled.setdefault(p.id, p)
    manifest = {**manifest, "questions": len(questions), "passages": len(pooled)}
    try:
        _write_jsonl(out_dir / "corpus" / "passages.jsonl",
                     ({"id": pid, "title": p.title, "text": p.text} for pid, p in pooled.items()))
        _write_jsonl(out_dir / "questions.jsonl", (question_row(q) for q in questions))
        write_atomic(out_dir / "prepared.json", json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    except OSError as e:
        raise KvfError(f"--out {out_dir} is not writable ({e.strerror}); pass a writable directory") from None
    return manifest


def prepare(name: str, input_file: str | Path, out_dir: str | Path, skip_bad: bool = False,
            limit: int | None = None) -> dict:
    """Convert a benchmark file into a prepared directory; returns its manifest (counts included).
    limit: keep the first N questions (the same N first questions a run with --limit N answers)."""
    if limit is not None and limit < 1:
        raise KvfError(f"--limit {limit}: must be >= 1 (leave it out for every question)")
    check_dataset_name(name)   # before reading a large file
    path = Path(input_file)
    check_not_anothers_file(name, path)
    questions, fmt, bad = parse_records(name, path, read_records(path))
    _check_bad(path, bad, skip_bad)
    if limit is not None:
        questions = questions[:limit]
    manifest = {"dataset": name, "source": str(path.resolve()), "format": fmt,
                "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "skipped": len(bad)}
    return write_prepared(questions, out_dir, manifest)


def check_not_anothers_file(name: str, path: Path) -> None:
    """`kvf data prepare musique --input .../wikimqa_s_clean.json`: the benchmarks share one file format, so
    the file parsed, and its questions went into every table under the other benchmark's name."""
    for other, known in DATASET_FILES.items():
        if other != name and path.name == Path(known).name:
            raise KvfError(f"--input {path}: {path.name} is {other}'s file, not {name}'s; prepare it as {other} "
                           f"(kvf data prepare {other} --input {path}), or rename the file if it holds {name}'s questions")


def prepare_custom(input_file: str | Path, out_dir: str | Path, corpus: str | Path | None = None,
                   limit: int | None = None) -> dict:
    """`kvf data prepare custom --input FILE [--corpus DOCS]`: your own questions -> a prepared directory.

    FILE is JSON Lines, one question per line:
        {"id": "q1", "question": "...", "answers": ["...", ...],
         "passages": [{"title": "...", "text": "..."}, ...]}      # the question's own passages, or
         "passages": ["doc-id", ...]                                # ids of documents in --corpus
    "id" and "answers" are optional (without answers, a question is scored against full prefill's answer
    only); leave "passages" out (or empty) to retrieve from the whole corpus at run time.
    """
    path = Path(input_file)
    if limit is not None and limit < 1:
        raise KvfError(f"--limit {limit}: must be >= 1 (leave it out for every question)")
    documents = {d.doc_id: d for d in read_corpus(corpus)} if corpus is not None else {}
    questions = []
    for where, row, question in read_question_lines(path, "--input", id_prefix="custom"):
        passages = []
        for item in listed_passages(row, where, "of {\"title\", \"text\"} passages or of document ids of --corpus"):
            item = digits_of(item)
            if isinstance(item, str):
                if not documents and looks_like_text(item):   # a passage's text where a document id goes
                    raise KvfError(f"{where}: passage {textwrap.shorten(item, 40, placeholder='...')!r} looks like a passage's text, not a document id; "
                                   f"write it as {{\"title\": \"\", \"text\": \"...\"}} (ids name documents of --corpus)")
                if item not in documents:
                    named = [d for d in documents if Path(d).stem == item]   # "d1" for the file d1.txt
                    example = next(iter(documents), None)
                    fix_id = (f"write the document's file name, {named[0]!r}" if len(named) == 1 else
                              f"check the id (--corpus ids are file names, or a .jsonl's \"id\": e.g. {example!r})"
                              if documents else "pass --corpus DOCS")
                    raise KvfError(f"{where}: passage id {item!r} is not a document of --corpus "
                                   f"{corpus or '(none given)'}; {fix_id}, or give the passage as {{title, text}}")
                passages.append(Passage(documents[item].title, documents[item].text))
            elif isinstance(item, dict) and isinstance(item.get("text"), str) and item["text"].strip():
                try:
                    passages.append(make_passage(item.get("title"), item["text"]))
                except ValueError as e:   # a title that is a list or an object
                    raise KvfError(f"{where}: {e}") from None
            else:
                raise KvfError(f"{where}: each passage is a document id or {{\"title\", \"text\"}} with a non-empty text")
        questions.append(replace(question, contexts=passages, context_ids=[p.id for p in passages]))
    questions = questions[:limit] if limit is not None else questions
    if not documents and not any(q.contexts for q in questions):   # nothing to retrieve from at run time
        raise KvfError(f"--input {path}: no question carries passages and no --corpus is given, so the dataset would "
                       f"have no documents; give questions \"passages\", add --corpus DOCS, or answer them over your "
                       f"own workspace with `kvf run -w WS -q {path}`")
    extra = [Question(f"doc-{d}", "", [], [Passage(doc.title, doc.text)]) for d, doc in documents.items()]
    manifest = {"dataset": "custom", "source": str(path.resolve()), "format": "custom",
                "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "skipped": 0}
    return write_prepared(questions, out_dir, manifest, corpus_extra=[p for q in extra for p in q.contexts])


def _read_jsonl_objects(path: Path, where: str, fix: str, line_fix: str | None = None) -> list[tuple[int, dict]]:
    """(line number, row) of a JSON Lines file whose rows are JSON objects, gzipped or not. A leading byte-order
    mark (Windows editors write one) is dropped; `where` names the file (and its flag) in errors, `line_fix`
    (default `fix`) what a line should look like."""
    line_fix = fix if line_fix is None else line_fix
    if not path.is_file():
        raise KvfError(f"{where} is {'a directory' if path.is_dir() else 'missing'}; {fix}")
    raw = path.read_bytes()
    try:
        text = gunzipped(raw, where).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise KvfError(f"{where} is not UTF-8 text (byte {e.start}); save it as UTF-8, or {fix}") from None
    if is_json_array(text):
        raise KvfError(f"{where} is one JSON array; kvf reads JSON Lines, one object per line: convert it with "
                       + converted_with(path, raw, "[print(json.dumps(o)) for o in json.load(sys.stdin)]"))
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if not rows and (instead := stand_in(line)):
                    raise KvfError(f"{where} {instead}") from None
                if not rows and (table := table_kind(path)):   # a spreadsheet's export: its header row is no JSON
                    delimiter = ", delimiter='\\t'" if table == "TSV" else ""
                    raise KvfError(f"{where} is a {table} table; kvf reads JSON Lines, one object per line, its columns "
                                   "as fields: convert it with " + converted_with(
                                       path, raw, f"[print(json.dumps(r)) for r in csv.DictReader(sys.stdin{delimiter})]",
                                       "csv,"))
                raise KvfError(f"{where} line {lineno}: malformed JSON ({json_reason(e)}); {line_fix}") from None
            if not isinstance(row, dict):
                raise KvfError(f"{where} line {lineno}: expected a JSON object; {line_fix}")
            rows.append((lineno, row))
    return rows


def converted_with(path: Path, raw: bytes, program: str, modules: str = "") -> str:
    """The shell command that writes a file's rows as JSON Lines beside it: python3 -c PROGRAM over its text
    (gunzipped first where it is gzipped)."""
    quoted = shlex.quote(str(path))
    source = f"gzip -dc {quoted} | " if raw[:2] == b"\x1f\x8b" else ""
    return (f"`{source}python3 -c \"import {modules}json,sys; {program}\"{'' if source else ' < ' + quoted} "
            f"> {shlex.quote(str(lines_path(path)))}`")


def table_kind(path: Path) -> str | None:
    """"CSV" or "TSV" for a file named as a table (gzipped or not), else None."""
    name = path.name.lower().removesuffix(".gz")
    return "CSV" if name.endswith(".csv") else "TSV" if name.endswith(".tsv") else None


def lines_path(path: Path) -> Path:
    """Where a JSON array's conversion to JSON Lines goes: beside it, as .jsonl, never over it (the shell empties
    the file a `>` names before the command reads it)."""
    converted = path.with_name(f"{file_stem(path)}.jsonl")
    return converted if converted != path else path.with_name(f"{file_stem(path)}.lines.jsonl")


def file_stem(path: Path) -> str:
    """A file's name without its extension, or its two for a gzipped file: questions.jsonl.gz -> questions."""
    name = path.name[:-3] if path.name.lower().endswith(".gz") else path.name
    return Path(name).stem


def is_json_array(text: str) -> bool:
    """A whole file that is one JSON array of objects (a .json export), not JSON Lines."""
    if not text.lstrip().startswith("["):
        return False
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def _read_prepared_jsonl(path: Path, directory: Path) -> list[tuple[int, dict]]:
    """(line number, row) of a prepared directory's JSONL file."""
    return _read_jsonl_objects(path, str(path), f"is {directory} a directory made by `kvf data prepare`? (re-run it)")


def claim_id(qid: str, seen: set[str], where: str) -> None:
    """One question per id: run records are keyed by it, so two questions under one id would collide."""
    if qid in seen:
        raise KvfError(f"{where}: question id {qid} is used twice; give every question its own id")
    seen.add(qid)


def _text_field(row: dict, name: str, where: str, fix: str) -> str:
    value = row.get(name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and name == "id" and math.isfinite(value):
        value = str(value)   # not NaN or Infinity: "nan" would pass as an id no one wrote
    if not isinstance(value, str) or not value.strip():
        raise KvfError(f"{where}: needs a non-empty string \"{name}\"; {fix}")
    return value


# names a user's own question file may give a field kvf reads under another: read as nothing, they would
# leave a question unscored, or retrieved for instead of answered from the passages it names
MEANT_FIELDS = {"answers": ("gold", "golds", "target", "targets", "label", "labels", "ground_truth", "reference",
                            "references", "gold_answers"),
                "passages": ("passage", "context", "contexts", "ctxs", "documents", "docs", "doc_ids", "passage_ids")}
WITHOUT_FIELD = {"answers": "scored against full prefill's answer only", "passages": "answered from retrieved chunks"}
# a question's id as kvf's own run records ("qid") and BEIR's queries.jsonl ("_id") name it, besides "id"
QUESTION_ID_FIELDS = ("id", "qid", "_id")
# what other tools call the question's text (BEIR's queries.jsonl: "text")
QUESTION_TEXT_FIELDS = ("query", "text", "prompt", "input", "q")


def check_field_names(row: dict, where: str) -> None:
    """A field named as another tool names "answers" or "passages", where the row lacks kvf's own name."""
    for read, others in MEANT_FIELDS.items():
        if read == "answers" and "answer" in row:
            continue
        given = next((name for name in others if name in row), None)
        if given is not None and read not in row:
            raise KvfError(f"{where}: field \"{given}\" is not read; kvf reads \"{read}\": rename it (or drop it, "
                           f"and the question is {WITHOUT_FIELD[read]})")


def check_not_a_run_record(row: dict, where: str) -> None:
    """A line kvf run wrote, given as a question: a run file carries each question once per method and ratio,
    so it read as "question id q-1 is used twice" (or, with one method in it, as questions without answers)."""
    if is_run_record(row) and "question" in row:
        raise KvfError(f"{where}: a kvf run record, not a question; this is a run file (kvf eval reads it): pass "
                       f"your questions, {{\"question\": ...}} a line")


def check_question_field(row: dict, where: str) -> None:
    """A line without "question": a corpus's document given as a question, or the question under another name."""
    if "question" in row:
        return
    if "contents" in row or ("title" in row and "text" in row):
        raise KvfError(f"{where}: a document, not a question; this is a corpus file (kvf build-cache reads it): pass "
                       f"your questions, {{\"question\": ...}} a line")
    given = next((name for name in QUESTION_TEXT_FIELDS if name in row), None)
    if given is not None:
        raise KvfError(f"{where}: field \"{given}\" is not read; kvf reads the question from \"question\": rename it")


def question_id(row: dict, where: str, default: str) -> str:
    """The line's own id ("id", "qid" or "_id", the first given), else `default`."""
    given = next((row[name] for name in QUESTION_ID_FIELDS if row.get(name) not in (None, "")), None)
    return default if given is None else _text_field({"id": given}, "id", where, QUESTIONS_FIX)


def digits_of(value):
    """A whole number as its digits; anything else as it is, for the caller to refuse (other numbers, booleans).
    An answer (a year, a count: "answers": [1921]), and a cited document id: a .jsonl corpus's integer "id" 1 is
    the document "1" (read_corpus keys it so), and a question may cite it as written there."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _answers_field(row: dict, where: str, required: bool) -> list[str]:
    value = row.get("answers", row.get("answer"))
    if value is None and not required:
        return []
    value = [digits_of(v) for v in value] if isinstance(value, list) else digits_of(value)
    try:
        answers = flatten_answers(value) if isinstance(value, (str, list)) else None
    except (ValueError, TypeError):   # a list holding numbers or objects
        answers = None
    if answers is None or (required and not answers):
        raise KvfError(f"{where}: \"answers\" must be a string, a whole number or a list of them" + ("" if not required else
                       " (every question needs at least one answer here)"))
    return answers


def load_prepared(directory: str | Path) -> tuple[list[Question], dict[str, Passage]]:
    """Read a prepared directory back: questions with their contexts resolved, and the corpus.

    A question's context_ids are document ids of the corpus (as written in passages.jsonl), so a
    hand-written prepared directory with its own ids ("p1", "p2") works like a generated one.
    """
    directory = Path(directory)
    fix = "re-run `kvf data prepare` or fix the file"
    passages_path = directory / "corpus" / "passages.jsonl"
    passages = {}
    for lineno, r in _read_prepared_jsonl(passages_path, directory):
        where = f"{passages_path} line {lineno}"
        passages[_text_field(r, "id", where, fix)] = Passage(str(r.get("title") or ""), _text_field(r, "text", where, fix))
    questions, seen = [], set()
    questions_path = directory / "questions.jsonl"
    for lineno, r in _read_prepared_jsonl(questions_path, directory):
        where = f"{questions_path} line {lineno}"
        qid = _text_field(r, "id", where, fix)
        claim_id(qid, seen, where)
        context_ids = r.get("context_ids")
        if not isinstance(context_ids, list) or not all(isinstance(c, str) for c in context_ids):
            raise KvfError(f"{where}: needs \"context_ids\", a list of passage ids from corpus/passages.jsonl "
                           "(an empty list means: retrieve from the whole corpus)")
        missing = [cid for cid in context_ids if cid not in passages]
        if missing:
            raise KvfError(f"{where}: question {qid} cites passage {missing[0]} not in corpus/passages.jsonl; {fix}")
        gold_mode = r.get("gold_mode", "any")
        if gold_mode not in ("any", "all"):
            raise KvfError(f"{where}: gold_mode must be \"any\" (one alias suffices) or \"all\" (every value needed)")
        task, fact_chunks = r.get("task"), r.get("fact_chunks")   # a generated suite's (kvf data ruler)
        if task is not None and not (isinstance(task, str) and task.strip()):   # records group by it: never dropped
            raise KvfError(f"{where}: \"task\" must be a task's name, e.g. \"niah_single\" (or left out); {fix}")
        if fact_chunks is not None and not (isinstance(fact_chunks, list) and all(
                type(i) is int and 0 <= i < len(context_ids) for i in fact_chunks)):
            raise KvfError(f"{where}: \"fact_chunks\" must be a list of positions in \"context_ids\" (or left out); {fix}")
        questions.append(Question(qid, _text_field(r, "question", where, fix), _answers_field(r, where, required=False),
                                  [passages[cid] for cid in context_ids], list(context_ids), gold_mode, task,
                                  fact_chunks))
    if not questions:
        raise KvfError(f"{questions_path} holds no questions; {fix}")
    return questions, passages


def looks_like_text(item: str) -> bool:
    """A passage cited by id that is a sentence or more: its text, put where a document id goes."""
    return len(item.split()) > 2


def load_questions_file(path: str | Path) -> list[Question]:
    """`kvf run --questions FILE`: JSON Lines of {"question", "answers"?, "id" (or "qid", "_id")?, "passages"?}, where
    passages are document ids of the workspace's corpus (leave them out to retrieve)."""
    path = Path(path)
    questions = []
    for where, row, question in read_question_lines(path, "--questions", id_prefix=file_stem(path)):
        what = "of document ids of the workspace's corpus"
        passages = [digits_of(p) for p in listed_passages(row, where, what)]
        if any(isinstance(p, dict) for p in passages):   # the passages' own text: `kvf data prepare custom` reads those
            raise KvfError(f"{where}: \"passages\" here name documents of the workspace by id; to bring each passage's text with its question, "
                           f"run `kvf data prepare custom --input {path} -o DIR`, then `kvf run -d DIR`")
        if not all(isinstance(p, str) for p in passages):
            raise KvfError(f"{where}: \"passages\" must be a list {what}; {QUESTIONS_FIX}")
        questions.append(replace(question, context_ids=passages))
    return questions


def listed_passages(row: dict, where: str, what: str) -> list:
    """A question line's "passages": a list (absent or null: none named, so retrieve). Anything else is refused:
    a bare string would be read letter by letter, and one {"title", "text"} object key by key."""
    passages = row.get("passages")
    if passages is None:
        return []
    if not isinstance(passages, list):
        raise KvfError(f"{where}: \"passages\" must be a list {what}, even of one; this one is {shown(passages)}")
    return passages


def read_question_lines(path: Path, flag: str, id_prefix: str) -> list[tuple[str, dict, Question]]:
    """Every line of your own questions file (kvf run -q, kvf data prepare custom): (where it is, the row, its
    Question without passages). Names a line's fields as kvf names them, gives a line without an "id" one
    (ID_PREFIX-LINE), refuses a repeated id and a file without questions."""
    lines, seen = [], set()
    for lineno, row in _read_jsonl_objects(path, f"{flag} {path}", "pass a JSON Lines file of questions; " + QUESTIONS_FIX,
                                           QUESTION_LINE):
        where = f"{flag} {path} line {lineno}"
        check_not_a_run_record(row, where)
        check_field_names(row, where)
        check_question_field(row, where)
        qid = question_id(row, where, f"{id_prefix}-{lineno}")
        claim_id(qid, seen, where)
        # answers are optional: without them a question is scored against full prefill's answer only
        question = Question(qid, _text_field(row, "question", where, QUESTIONS_FIX), _answers_field(row, where, required=False))
        lines.append((where, row, question))
    if not lines:
        raise KvfError(f"{flag} {path} holds no questions; {QUESTIONS_FIX}")
    return lines
