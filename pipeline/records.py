"""The run record: one JSON line per (question, method, settings), written by `kvf run` and read by
`kvf eval`. This module is its one definition; ARCHITECTURE.md points here.

    {"qid": str, "dataset": str, "method": str, "label": str | null,
     "settings": {"ratio": float, "variant": "prefix"|"fusion", "top_k": int, "setting": str,
                  "retriever": str | null, "chunk_tokens": int, "model": str, "max_new_tokens": int,
                  "n_neighbours": int, "store_dtype": str, "compute_dtype": str, ...method knobs},
     "chunk_ids": [str, ...],            # the chunks in prompt order
     "question": str, "answer": str, "gold": [str, ...],   # gold may be empty (questions without answers)
     "gold_mode": "any" | "all",         # any alias is right (QA) / every value is needed (RULER)
     "prompt_tokens": int, "chunk_tokens": int, "recomputed_tokens": int, "recomputed_token_layers": int,
     "answer_tokens": int,               # tokens generated (settings.max_new_tokens: cut there); absent before 2026-12-04
     "timings": {"load": s, "select": s, "recompute": s, "first_token": s, "decode": s, "read": s},
     "provenance": {"kvf_version": str, "commit": str | null, "device": str,
                    "libraries": {"torch": str, "transformers": str}},   # libraries: absent before 2026-12
     "shared": [str, ...],               # work shared with other records of the same question: prefill:full,
                                         # query-pass:VARIANT, reuse-prefill:VARIANT, decode-batch:N (run.py)
     # with --compare-full:
     "full_answer": str, "kl_full": float, "top1_agree_full": bool,
     "full_first_token": s,              # full prefill's TTFT on the same prompt (kvf eval's ttft_ratio without -m full)
     "answer_kl_full": float,            # mean KL(full || method) over full's answer tokens, each predicted from
                                         # full's tokens before it (teacher-forced; absent where full answered nothing)
     "answer_agree_full": float}         # the share of those tokens the method's cache would pick itself

`first_token` is TTFT: from request start to the first token, loading included.

A run file is append-only JSON Lines. RunFile opens one for a run: it holds an exclusive lock (a
second `kvf run` on the same file is refused), refuses a file that is not a kvf run file, and cuts
only a torn *last* line (a run killed mid-write), saying so. A run refused before its first record
leaves no file it made.
"""
from __future__ import annotations

import fcntl
import glob
import gzip
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvf.errors import KvfError, counted, disk_full, json_reason, stand_in, warn

# settings that do not change an answer: left out when deciding whether a record can be resumed
NOT_ANSWER_SETTINGS = ("store", "pipeline", "ratio_mode")


class Timings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    load: float = Field(ge=0, allow_inf_nan=False)
    select: float = Field(ge=0, allow_inf_nan=False)
    recompute: float = Field(ge=0, allow_inf_nan=False)
    first_token: float = Field(ge=0, allow_inf_nan=False)
    decode: float = Field(ge=0, allow_inf_nan=False)
    read: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    after_first_token: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # part of decode (kvfuse's shift)


class Provenance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kvf_version: str
    commit: str | None = None
    device: str
    libraries: dict[str, str] | None = None   # the releases that computed it (provenance.RECORDED_LIBRARIES)


class RunRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)
    qid: str = Field(min_length=1)
    dataset: str = Field(min_length=1)
    method: str = Field(min_length=1)
    label: str | None = None
    settings: dict[str, Any]
    chunk_ids: list[str]
    question: str
    answer: str
    gold: list[str]
    gold_mode: str = Field(default="any", pattern="^(any|all)$")  # any alias right (QA) / every value needed (RULER)
    prompt_tokens: int = Field(ge=0)
    chunk_tokens: int = Field(ge=0)
    recomputed_tokens: int = Field(ge=0)
    recomputed_token_layers: int | None = Field(default=None, ge=0)
    answer_tokens: int | None = Field(default=None, ge=0)
    timings: Timings
    provenance: Provenance | None = None
    shared: list[str] = Field(default_factory=list)
    full_answer: str | None = None
    kl_full: float | None = Field(default=None, allow_inf_nan=False)
    top1_agree_full: bool | None = None
    full_first_token: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    answer_kl_full: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    answer_agree_full: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)

    @field_validator("qid", "dataset", "method", "question", "answer", mode="before")
    @classmethod
    def _plain_string(cls, value):
        if not isinstance(value, str):  # a number or a dict qid is not silently turned into text
            raise ValueError("must be a string")
        return value

    @field_validator("settings")
    @classmethod
    def _settings(cls, settings: dict) -> dict:
        ratio = settings.get("ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise ValueError("settings.ratio must be a number within [0, 1]")
        if not isinstance(settings.get("variant", ""), (str, type(None))):
            raise ValueError("settings.variant must be a string")
        max_new_tokens = settings.get("max_new_tokens")   # kvf eval compares answer_tokens with it (cut answers)
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens < 1):
            raise ValueError("settings.max_new_tokens must be a whole number of at least 1")
        return settings

    @model_validator(mode="after")
    def _token_counts(self):
        # recomputed <= chunk <= prompt: a record past them (a hand edit) would score a ratio above 1 as measured
        if self.recomputed_tokens > self.chunk_tokens:
            raise ValueError(f"recomputed_tokens {self.recomputed_tokens} exceeds chunk_tokens {self.chunk_tokens}")
        if self.chunk_tokens > self.prompt_tokens:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} exceeds prompt_tokens {self.prompt_tokens}")
        return self

    # ---- derived --------------------------------------------------------------------------------
    @property
    def ratio(self) -> float:
        return float(self.settings["ratio"])

    @property
    def variant(self) -> str:
        return str(self.settings.get("variant") or "")

    def answer_settings(self) -> dict:
        """The settings that change an answer (what a resumed run must match)."""
        return {k: v for k, v in self.settings.items() if k not in NOT_ANSWER_SETTINGS}

    def to_line(self) -> str:
        return json.dumps(self.model_dump(mode="json", exclude_none=True)) + "\n"


def cut_in_gold(answer: str, gold: list[str], answer_tokens: int | None, max_new_tokens: int | None) -> str | None:
    """The gold answer that decoding was cut off partway through: the answer took every one of --max-new-tokens,
    holds no gold answer whole, and ends with the start of one ("... is 9800" for 9800301). None otherwise: an
    answer cut elsewhere (a model that runs on) is the model's, not the cap's. A RULER run with too few new tokens
    scored every method 0, full prefill too, and nothing said why."""
    if answer_tokens is None or max_new_tokens is None or answer_tokens < max_new_tokens or not answer.strip():
        return None
    text = " ".join(answer.lower().split())
    golds = {g: " ".join(g.lower().split()) for g in gold if g.strip()}   # each as the answer is compared
    if any(g_text in text for g_text in golds.values()):
        return None
    for g, g_text in golds.items():
        if any(text.endswith(g_text[:cut]) and (cut == len(text) or not text[-cut - 1].isalnum())
               for cut in range(1 if g_text[:1].isdigit() else 2, len(g_text))):   # a proper start, from a word's start
            return g
    return None


def cut_answers_line(cut: int, answers: int, caps: list[int], example: tuple[str, str, str, str], where: str = "",
                     fix: str = "re-run them with a larger --max-new-tokens") -> str:
    """kvf run's and kvf eval's one line on answers cut_in_gold found: how many of how many answers (in `where`),
    the caps, an example (qid, run name, answer, the gold answer it was cut inside) and `fix`."""
    qid, run, answer, gold = example
    return (f"{cut} of {counted(answers, 'answer')}{where} stopped at --max-new-tokens {', '.join(map(str, caps))} "
            f"partway through their gold answer (e.g. {qid}, {run}: '...{answer[-30:]}' for {gold!r}), so they score as "
            f"wrong; {fix}")


def run_name(record: dict) -> str:
    """How tables and progress lines name a record's run: method@ratio (method@auto under --ratio auto), the
    label of an ablation entry (`-m kvfuse:propagate=off`) after it; full and reuse without a ratio (fixed)."""
    settings = record["settings"]
    ratio = "auto" if settings.get("ratio_mode") == "auto" else f"{settings['ratio']:g}"   # auto: each question its own
    name = record["method"] + ("" if record["method"] in ("full", "reuse") else f"@{ratio}")
    return name + (f" [{record['label']}]" if record.get("label") else "")


def parse_record(data: Any, where: str) -> RunRecord:
    """A JSON value -> RunRecord, or a one-line KvfError naming `where` and the first bad field."""
    if not isinstance(data, dict):
        raise KvfError(f"{where}: not a kvf run record (expected a JSON object)")
    if "question" in data and "method" not in data:   # the file kvf run -q read (or a prepared dataset's), not the one it wrote
        raise KvfError(f"{where}: a question, not a kvf run record; this is a questions file: pass the file "
                       "`kvf run -o` wrote")
    try:
        return RunRecord.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "record"
        problem = first["msg"].removeprefix("Value error, ")   # pydantic's prefix for a validator's own words
        raise KvfError(f"{where}: not a kvf run record ({field}: {problem})") from None


def looks_like_record(line: bytes) -> bool:
    """A JSON object with a record's own fields: a damaged record (its line is named), not another kind of file."""
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and {"method", "settings"} <= set(data)


def record_start(line: bytes | str) -> bool:
    """Whether a line begins as `kvf run` writes a record (qid first): a record cut short, when it is the file's
    only line, not another kind of file."""
    head = line.encode() if isinstance(line, str) else line
    return head.lstrip(b"\xef\xbb\xbf \t").startswith(b'{"qid":')


def is_run_file(path: Path) -> bool:
    """A file named as `kvf run` writes them (.jsonl), or as committed evidence is kept (.jsonl.gz)."""
    return path.is_file() and path.name.endswith((".jsonl", ".jsonl.gz"))


def run_files_of(paths: list[str | Path]) -> list[Path]:
    """The run files a user named: a directory stands for the .jsonl / .jsonl.gz files in it, and a quoted
    glob (runs/*.jsonl, which no shell expanded) for the files it matches; anything else as given."""
    files = []
    for given in map(Path, paths):
        if given.is_dir():
            inside = sorted(p for p in given.iterdir() if is_run_file(p))
            if not inside:
                deeper = sorted({str(p.parent) for p in given.rglob("*") if is_run_file(p)})
                fix = (f"its subfolders hold some ({', '.join(deeper[:3])}{', ...' if len(deeper) > 3 else ''}): pass those"
                       if deeper else "pass the files `kvf run` wrote")
                raise KvfError(f"run file directory {given} holds no .jsonl or .jsonl.gz files; {fix}")
            files += inside
        elif not given.exists() and any(c in str(given) for c in "*?["):
            matched = sorted(Path(p) for p in glob.glob(str(given)))
            if not matched:
                raise KvfError(f"run files {given}: the pattern matches no file")
            files += matched
        else:
            files.append(given)
    unique, seen = [], set()   # a file named twice (runs/ and runs/a.jsonl) counts once, where first named
    for f in files:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append(f)
    return unique


def read_records(path: Path) -> list[RunRecord]:
    """Every record of a run file, plain or gzipped (for kvf eval): a line that is not a record is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise KvfError(f"run file {path} does not exist; pass the .jsonl file (or the folder of them) that `kvf run -o` wrote")
    records, cut = [], False
    # committed evidence is kept gzipped (results/*/runs/*.jsonl.gz); `kvf run` writes plain lines
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:   # -sig: a file re-saved by a Windows editor
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as e:
                    if not line.endswith("\n") and (records or record_start(line)):   # the last line, cut short
                        warn(f"run file {path} line {lineno} is incomplete (a `kvf run` still writing it, or one "
                             "stopped mid-line): left out")
                        cut = True
                        break
                    if not records and (instead := stand_in(line)):
                        raise KvfError(f"run file {path} {instead}") from None
                    if not records and path.suffix.lower() in OTHER_FORMATS:   # kvf eval's own summary.csv, say
                        raise KvfError(f"run file {path} is {path.suffix.lower()}, not the JSON Lines `kvf run` writes; "
                                       "pass the .jsonl files kvf run -o wrote") from None
                    raise KvfError(f"run file {path} line {lineno}: malformed JSON ({json_reason(e)}); fix or remove that line, "
                                   "or leave the file out") from None
                records.append(parse_record(data, f"run file {path} line {lineno}"))
    except UnicodeDecodeError:
        raise KvfError(f"run file {path} is not UTF-8 text: pass the JSON Lines files `kvf run` writes") from None
    except (gzip.BadGzipFile, EOFError):
        raise KvfError(f"run file {path} is not a complete gzip file: re-compress it with `gzip -k` from the .jsonl") from None
    if not records:
        raise KvfError(f"run file {path} {'holds no whole record' if cut else 'is empty'}: re-run `kvf run` or leave it out")
    return records


# names of other formats an --out may be given by mistake
OTHER_FORMATS = (".csv", ".tsv", ".json", ".parquet", ".xlsx", ".md", ".txt")


class RunFile:
    """An append-only run file held by one `kvf run` at a time (see the module docstring)."""

    def __init__(self, path: Path, warn: Callable[[str], None] = lambda message: None):
        self.path = Path(path)
        self.warn = warn
        self._file = None

    def __enter__(self) -> "RunFile":
        if self.path.suffix == ".gz":  # appending record by record needs plain lines
            raise KvfError(f"--out {self.path}: `kvf run` writes plain JSON Lines; pass {self.path.with_suffix('')} "
                           "and gzip it when the run is done (kvf eval reads both)")
        if self.path.suffix.lower() in OTHER_FORMATS:   # JSON Lines under another name: kvf eval DIR would pass it by
            raise KvfError(f"--out {self.path}: `kvf run` writes JSON Lines (.jsonl), not {self.path.suffix.lower()}; pass "
                           f"{self.path.with_suffix('.jsonl')} (kvf eval writes the tables as CSV and Markdown)")
        # what this run makes, a refused run takes away again (see __exit__)
        self._made_dirs = [d for d in reversed(self.path.parents) if not d.exists()]
        self._made_file = not self.path.exists()
        while self._file is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                file = open(self.path, "a+b", buffering=0)   # unbuffered: a failed write leaves nothing pending
            except IsADirectoryError:
                raise KvfError(f"--out {self.path} is a directory; pass a file path such as {self.path}/run.jsonl") from None
            except OSError as e:
                raise KvfError(f"--out {self.path}: cannot write it ({e.strerror}); pass a writable path") from None
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.close()
                raise KvfError(f"--out {self.path} is being written by another `kvf run`; wait for it or pass another --out") from None
            if same_file(file, self.path):
                self._file = file
            else:   # a refused run unlinked it while we opened it: the lock is on no file, open the path again
                file.close()
        return self

    def __exit__(self, *exc) -> None:
        if self._made_file and os.fstat(self._file.fileno()).st_size == 0:
            # a run refused before its first record leaves no empty file (nor the folders made for it);
            # unlinked under the lock, so a run waiting for this file opens the path afresh (same_file)
            self.path.unlink(missing_ok=True)
            for folder in reversed(self._made_dirs):
                try:
                    folder.rmdir()
                except OSError:   # something else was put there meanwhile
                    break
        self._file.close()  # releases the lock

    def records(self) -> list[RunRecord]:
        """The records already in the file. A torn last line is cut (and said); any other bad line is an error."""
        self._file.seek(0)
        lines = self._file.read().split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
            complete = True
        else:
            complete = False  # the last line has no newline: maybe torn
        records, good_bytes = [], 0
        for lineno, raw in enumerate(lines, start=1):
            last = lineno == len(lines)
            try:
                record = parse_record(json.loads(raw), f"--out {self.path} line {lineno}")
            except (json.JSONDecodeError, UnicodeDecodeError, KvfError) as e:
                if last and not complete and (records or record_start(raw)):  # killed mid-write: only this line is lost
                    self.warn(f"--out {self.path}: cut a torn last line (a run killed mid-write); it will be re-run")
                    break
                if not records and lineno == 1 and not looks_like_record(raw):   # said so before appending to it
                    raise KvfError(f"--out {self.path} is not a kvf run file (line 1 is not a run record); "
                                   "pass a new --out, or --overwrite to replace it") from None
                reason = str(e) if isinstance(e, KvfError) else f"--out {self.path} line {lineno}: malformed JSON"
                raise KvfError(f"{reason}; fix or remove that line (kvf never drops records)") from None
            records.append(record)
            good_bytes += len(raw) + 1
        if not complete and len(records) == len(lines):  # a whole record without its newline: keep it
            self._file.write(b"\n")
            good_bytes = self._file.tell()
        if good_bytes < self._file.seek(0, os.SEEK_END):
            self._file.truncate(good_bytes)
        return records

    def truncate_all(self) -> None:
        """--overwrite: start the file afresh."""
        self._file.truncate(0)

    def append(self, record: RunRecord) -> None:
        """One record, fsynced: a crash loses at most the record being written. A write that fails (disk
        full) is cut back, so the file ends with whole records and a re-run resumes it."""
        start = self._file.seek(0, os.SEEK_END)
        try:
            line = memoryview(record.to_line().encode())
            while line:
                line = line[self._file.write(line):]
            os.fsync(self._file.fileno())
        except OSError as e:
            self._file.truncate(start)
            if disk_full(e):
                raise KvfError(f"--out {self.path}: disk full while writing a record; the records before it are kept: "
                               "free some space there and re-run to resume") from None
            e.filename = str(self.path)
            raise


def same_file(file, path: Path) -> bool:
    """Whether the open file is still the one at path (not unlinked or replaced since it was opened)."""
    try:
        here, there = os.fstat(file.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
