"""`kvf run`: answer questions with one or more methods at one or more recompute ratios.

For each question: pick its chunks (its own passages in order, or top-k retrieved from the
workspace), make sure their KVs are in the store (computing missing ones first, untimed: that is
offline work), then time each request: load + fuse + first token, then decode. One run record
(pipeline/records.py) per (question, method, ratio), flushed and fsynced as written, so a crash
loses at most the record in flight and a re-run skips what is already there. A re-run with
settings that would change an answer is refused rather than mixed with the old records.
"""
from __future__ import annotations

import json
import textwrap
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvf.errors import KvfError, counted, warn
from kvf.pipeline.data.datasets import Question, file_stem, load_prepared, load_questions_file, looks_like_text
from kvf.pipeline.files import check_writable_dir
from kvf.pipeline.fusion.controller import (DEFAULT_QUALITY_FLOOR, choose_ratio, measure_bandwidth,
                                            measure_token_layer_seconds)
from kvf.pipeline.fusion.methods import FusionMethod, build_method, check_method_name, default_settings, get_method
from kvf.pipeline.fusion.methods.base import check_knobs_used, knob_errors_named
from kvf.pipeline.model.prompt import build_prompt, make_template
from kvf.pipeline.records import RunFile, RunRecord, cut_answers_line, cut_in_gold, parse_record, run_name
from kvf.pipeline.retrieval.chunking import ChunkTable, read_chunk_columns, read_chunk_ids
from kvf.pipeline.retrieval.neighbours import load_neighbours
from kvf.pipeline.workflows.build import (BuildOptions, EntryBuilder, check_chunk_fits, check_room, index_digests,
                                          missing_entries, open_workspace_store, settle_settings, stage_chunks,
                                          stage_indexes, write_workspace_manifest)
from kvf.pipeline.workflows.devices import allocatable_bytes, check_device, compute_dtype, dtype_name, warn_if_slow
from kvf.pipeline.workflows.display import description_column, notice, progress_bar
from kvf.pipeline.workflows.provenance import provenance
from kvf.pipeline.workflows.session import Session, check_entries_dtype, open_run_store, run_extras, workspace_path
from kvf.pipeline.workflows.weights import check_workspace_model, open_model, recorded_model, workspace_model
from kvf.pipeline.workflows.workspace import VARIANTS, Workspace, document_meant, folder_kind, ids_digest

SETTINGS = ("auto", "per-question", "shared")
RETRIEVERS = ("bm25", "dense")
DEFAULT_TOP_K = 5


@dataclass
class RunOptions:
    out: Path
    methods: list[str]
    ratios: list[float] = field(default_factory=lambda: [0.15])
    dataset: Path | None = None         # a prepared directory (kvf data prepare) ...
    questions: Path | None = None       # ... or a JSONL file of questions, answered from --workspace
    workspace: Path | None = None       # default: DATASET/workspace, else ./workspace
    variant: str | None = None          # default: the method's own offline variant
    top_k: int | None = None            # shared retrieval's k (None: 5); refused in the per-question setting
    limit: int | None = None
    offset: int = 0                     # skip the first N questions (e.g. a held-out split: --offset 100 -n 50)
    setting: str = "auto"
    retriever: str | None = None        # shared retrieval's index (None: bm25); refused in the per-question setting
    compare_full: bool = False
    model: str | None = None
    max_new_tokens: int = 32
    pipeline: bool = True
    knobs: dict | None = None           # method knobs (flags generated from each method's Knobs)
    chunk_tokens: int = 256
    store: str | None = None
    device: str = "cpu"
    dtype: str | None = None            # compute dtype; default float32 on CPU, bfloat16 on CUDA
    n_neighbours: int | None = None     # FusionRAG's n when run creates the workspace (None: 10); else must match it
    auto_ratio: bool = False            # --ratio auto: the loading controller picks each question's ratio
    quality_floor: float = DEFAULT_QUALITY_FLOOR
    label: str | None = None            # tells apart runs of one method with other models or settings
    overwrite: bool = False
    qids: list[str] | None = None       # answer only these questions
    warmup: bool = True                 # one untimed call per method first (keeps kernel set-up out of TTFT)
    share: bool = True                  # work done once per question for all methods (False: lone requests, as v1)
    ray: str | None = None              # Ray address ("local": start one here): questions spread over actors
    workers: int | None = None          # Ray actors (default: one per CPU, or per GPU with --device cuda)
    threads: int = 1                    # torch threads per Ray actor

    @property
    def questions_source(self) -> Path:
        """The file the questions come from, for messages: --questions, or the prepared dataset's."""
        return self.questions or self.dataset / "questions.jsonl"


def parse_ratios(text: str) -> list[float]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    meant = as_fractions([x[:-1] for x in items]) if items and all(x.endswith("%") for x in items) else None
    if meant:   # "15%": a percentage, written as the fraction it means
        raise KvfError(f"--ratio {text}: a ratio is a fraction of the chunk tokens, not a percentage; pass --ratio {meant}")
    try:
        ratios = [float(x) for x in items]
    except ValueError:
        if "auto" in items:
            raise KvfError(f"--ratio {text}: auto stands alone (the loading controller picks each question's ratio); "
                           "run the fixed ratios with a second kvf run") from None
        words = text.replace(",", " ").split()
        if len(words) > len(items):   # "0 0.15": a space where the comma goes
            raise KvfError(f"--ratio {text}: separate ratios with commas, e.g. --ratio {','.join(words)}") from None
        raise KvfError(f"--ratio {text}: expected numbers in [0, 1], e.g. 0.15 or 0,0.05,0.15") from None
    if ratios and all(1.0 < r <= 100.0 for r in ratios):   # "15" or "5,15": percentages again
        raise KvfError(f"--ratio {text}: every ratio must be within [0, 1] (a fraction of the chunk tokens); "
                       f"for percentages pass --ratio {as_fractions(items)}")
    bad = [r for r in ratios if not 0.0 <= r <= 1.0]
    if not ratios or bad:
        # "0,15": a decimal comma, read as the two ratios 0 and 15
        decimal = f"; for the ratio {items[0]}.{items[1]} write a decimal point" if (
            len(items) == 2 and items[0] == "0" and items[1].isdigit()) else ""
        raise KvfError(f"--ratio {text if text.strip() else repr(text)}: every ratio must be within [0, 1], "
                       f"e.g. 0.15 or 0,0.05,0.15{decimal}")
    return ratios


def as_fractions(percents: list[str]) -> str | None:
    """['15', '5'] -> '0.15,0.05': the --ratio a user who wrote percentages meant (None if one is no number)."""
    try:
        return ",".join(f"{float(p) / 100:g}" for p in percents)
    except ValueError:
        return None


def parse_methods(text: str) -> list[str]:
    """-m a,b,c ('all' = every registered method but those equal to full by construction), checked.
    An entry may set knobs and the stored variant for that entry alone (an ablation in one run):
    NAME:KNOB=VALUE:..., e.g. -m prophetkv,prophetkv:variant=fusion,cacheblend:check_layer=3."""
    from kvf.pipeline.fusion.methods import METHODS, method_names
    entries = [m.strip() for m in text.split(",") if m.strip()]
    if not entries:
        raise KvfError(f"--method {text!r}: name at least one method, e.g. -m full,reuse,cacheblend")
    if "all" in entries:
        entries = [n for n in entries if n != "all"] + [n for n in method_names() if METHODS[n].in_all]
    for entry in entries:
        parse_method_spec(entry)  # unknown names and knobs: one line listing the known ones
    return list(dict.fromkeys(entries))


@dataclass
class MethodSpec:
    """One --method entry: a method, and knobs or a stored variant set for this entry alone."""
    text: str
    name: str
    knobs: dict
    variant: str | None

    def names_its_knobs(self):
        """A knob this entry set and a method refused (-m cacheblend:check_layer=99) is named as the entry."""
        return knob_errors_named(self.knobs, lambda knob, problem: f"--method {self.text}: {knob}: {problem}")

    def build(self, ratio: float, knobs: dict | None = None, n_layers: int | None = None) -> FusionMethod:
        """This entry's method at `ratio`, its knobs over `knobs` (a run's --knob flags), checked against a model of
        n_layers where given; a refused knob is named as the entry."""
        with self.names_its_knobs():
            method = build_method(self.name, ratio, {**(knobs or {}), **self.knobs})
            if n_layers is not None:
                method.check_model(n_layers)
        return method

    @property
    def label(self) -> str | None:
        """Entries with their own settings are told apart in records and tables by their text."""
        return self.text.split(":", 1)[1] if ":" in self.text else None


def parse_method_spec(text: str, given: str | None = None) -> MethodSpec:
    """One -m entry, checked; its errors name it as `given` (default "--method TEXT"; answer() says "method='TEXT'")."""
    given = given or f"--method {text}"
    from kvf.pipeline.fusion.methods import METHODS
    from kvf.pipeline.fusion.methods.base import configuration_pairs, knob_types
    name, *parts = [part.strip() for part in text.split(":")]
    if not name:
        raise KvfError(f"{given}: no method name before ':'; write NAME or NAME:KNOB=VALUE, "
                       "e.g. cacheblend:check_layer=3 (`kvf methods` lists them)")
    check_method_name(name, given if given.startswith("method=") else None)
    types, knobs, variant = knob_types(METHODS[name].Knobs), {}, None
    for pair in configuration_pairs(name, parts):
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            named = METHODS[name].configurations
            also = f", or one of its named configurations: {', '.join(named)}" if named else ""
            if not types and not named:
                variant_too = f", or {name}:variant=prefix|fusion" if METHODS[name].uses_store else ""
                raise KvfError(f"{given}: {name} has no knobs or named configurations; write {name}{variant_too}")
            raise KvfError(f"{given}: expected NAME:KNOB=VALUE, e.g. cacheblend:check_layer=3{also}")
        if key == "variant":
            if value not in VARIANTS:
                raise KvfError(f"{given}: variant {value!r}; use prefix or fusion")
            variant = value
        elif key not in types:
            known = ", ".join(sorted(types)) or "none"
            raise KvfError(f"{given}: {name} has no knob {key!r} (its knobs: {known}; or variant)")
        else:
            knobs[key] = knob_value(given, key, value, types[key])
    return MethodSpec(text, name, knobs, variant)


def knob_value(given: str, key: str, value: str, kind: type):
    """A knob value written in a --method entry (named as `given`), as its declared type."""
    if value.lower() == "none":
        return None
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise KvfError(f"{given}: {key} is true or false, not {value!r}")
        return value.lower() in ("true", "1", "yes")
    try:
        return kind(value)
    except ValueError:
        raise KvfError(f"{given}: {key} must be {kind.__name__}, not {value!r}") from None


def check_options(opts: RunOptions) -> None:
    """Bad values are one-line errors before any work starts (the CLI checks most of them too)."""
    if (opts.dataset is None) == (opts.questions is None):
        raise KvfError("pass either --dataset DIR (a prepared directory) or --questions FILE (with --workspace)")
    if opts.limit is not None and opts.limit < 1:
        raise KvfError(f"--limit {opts.limit}: must be >= 1 (leave it out to answer every question)")
    if opts.offset < 0:
        raise KvfError(f"--offset {opts.offset}: must be >= 0")
    if opts.max_new_tokens < 1:
        raise KvfError(f"--max-new-tokens {opts.max_new_tokens}: must be >= 1")
    if opts.top_k is not None and opts.top_k < 1:
        raise KvfError(f"--top-k {opts.top_k}: must be >= 1")
    if not 0.0 <= opts.quality_floor <= 1.0:
        raise KvfError(f"--quality-floor {opts.quality_floor}: must be within [0, 1]")
    if opts.setting not in SETTINGS:
        raise KvfError(f"--setting {opts.setting}: use one of {', '.join(SETTINGS)}")
    if opts.retriever is not None and opts.retriever not in RETRIEVERS:
        raise KvfError(f"--retriever {opts.retriever}: use one of {', '.join(RETRIEVERS)}")
    if opts.variant is not None and opts.variant not in VARIANTS:
        raise KvfError(f"--variant {opts.variant}: use prefix or fusion")
    if not opts.methods:
        raise KvfError("--method: name at least one method")
    check_out_apart(opts)
    dtype = compute_dtype(opts.device, opts.dtype)   # not after a new workspace's minutes of chunking and indexing
    check_knobs_used([parse_method_spec(m).name for m in opts.methods], opts.knobs or {})
    if opts.ray is not None:
        from kvf.pipeline.workflows.distributed import check_ray
        check_ray(opts)
    warn_if_slow(opts.device, dtype)   # once every flag is accepted


def check_out_apart(opts: RunOptions) -> None:
    """--out is never the questions it answers, nor inside a prepared dataset's corpus: records appended there
    (or --overwrite, which empties the file first) would destroy the questions or become documents."""
    out, source = opts.out.resolve(), opts.questions_source.resolve()
    flag, name = ("--questions", file_stem(source)) if opts.questions is not None else ("--dataset", opts.dataset.name)
    if out == source:
        raise KvfError(f"--out {opts.out} is the questions file this run reads ({flag}); pass another --out, "
                       f"e.g. runs/{name}.jsonl")
    if opts.dataset is not None and out.is_relative_to((opts.dataset / "corpus").resolve()):
        raise KvfError(f"--out {opts.out} is inside the corpus of --dataset {opts.dataset}; pass an --out outside it, "
                       f"e.g. runs/{opts.dataset.name}.jsonl")
    documents = Workspace(opts.workspace).documents() if opts.workspace is not None else None
    if documents is not None and out.is_relative_to(documents):   # the documents' folder itself, or inside it
        # the next `kvf build-cache -w WS` read the run file as documents, and refused it as "a questions file"
        raise KvfError(f"--out {opts.out} is among the documents --workspace {opts.workspace} was built from "
                       f"({documents}); pass an --out outside them, e.g. runs/{name}.jsonl")


# ---- what to run ---------------------------------------------------------------------------------
@dataclass
class Planned:
    method: FusionMethod
    variant: str
    label: str | None = None     # the run's --label, and the entry's own settings if it has any


def plan_methods(opts: RunOptions, n_layers: int | None = None) -> list[Planned]:
    """Every (method, stored variant) to run per question: methods x ratios, duplicates dropped
    (full, reuse, prefix, ... ignore the ratio, so a sweep runs them once). With n_layers, knobs that
    depend on the model (cacheblend's check layer) are checked against it too."""
    planned, seen = [], set()
    for entry in opts.methods:
        spec = parse_method_spec(entry)
        label = " ".join(filter(None, (opts.label, spec.label))) or None
        for ratio in opts.ratios:
            method = spec.build(ratio, opts.knobs, n_layers)
            variant = spec.variant or opts.variant or method.offline_variant
            if not method.uses_store:   # full reads no stored entry: the same request under any --variant
                variant = method.offline_variant
            key = (spec.name, label, variant, json.dumps(method.settings(), sort_keys=True))
            if key not in seen:
                seen.add(key)
                planned.append(Planned(method, variant, label))
    return planned


def ratio_key(settings: dict):
    """How a record's ratio is matched on resume: 'auto' runs by mode (their ratio varies per question)."""
    return "auto" if settings.get("ratio_mode") == "auto" else round(float(settings.get("ratio", 0.0)), 9)


def record_key(qid: str, method: str, label: str | None, settings: dict) -> tuple:
    return (qid, method, label, settings.get("variant"), ratio_key(settings))


def comparable(settings: dict) -> dict:
    """Settings that change an answer, less the ratio (part of the key, or per question under auto)."""
    return {k: v for k, v in settings.items() if k not in ("ratio", "ratio_mode", "store", "pipeline")}


def auto_floor(settings: dict) -> dict:
    """The --quality-floor an auto-ratio record made before floors were recorded was run with: the default."""
    return {"quality_floor": DEFAULT_QUALITY_FLOOR} if settings.get("ratio_mode") == "auto" else {}


def check_resumable(existing: list[RunRecord], wanted: dict[tuple, dict], out: Path) -> None:
    """Records already in --out must have been run with the same answer-changing settings."""
    for record in existing:
        key = (record.method, record.label, record.settings.get("variant"), ratio_key(record.settings))
        want = wanted.get(key)
        if want is None:
            continue
        have = comparable({**default_settings(record.method), **auto_floor(record.settings), **record.settings})  # added since: default
        want = comparable(want)
        if have != want:
            # a setting the record lacks differs from one it holds as null: named, never an empty "()"
            names = sorted(n for n in set(have) | set(want) if n not in have or n not in want or have[n] != want[n])
            diff = ", ".join(f"{n} {setting_text(have, n)} -> {setting_text(want, n)}" for n in names[:4])
            raise KvfError(f"--out {out} holds {record.method} records run with other settings ({diff}); "
                           "pass a new --out, or --overwrite to replace them")


def check_compare_full_kept(existing: list[RunRecord], wanted: set[tuple], out: Path, compare_full: bool) -> None:
    """--compare-full puts full prefill's answer beside each answer. A resumed run that asks for it would skip the
    answers already there without it, and one that leaves it out would add answers without it to a row that has
    it: either row then scores fidelity on some of its questions only. Refused, with the fix."""
    for record in existing:
        key = (record.method, record.label, record.settings.get("variant"), ratio_key(record.settings))
        if key not in wanted or (record.full_answer is not None) == compare_full:
            continue
        row = f"{record.method}{f' [{record.label}]' if record.label else ''} ratio {record.ratio:g}"
        if compare_full:
            raise KvfError(f"--out {out} holds {row} answers run without --compare-full, which a resumed run skips "
                           "as done and leaves without full prefill's answer; pass a new --out, or --overwrite to "
                           "answer them again with it")
        raise KvfError(f"--out {out} holds {row} answers run with --compare-full; add --compare-full to resume "
                       "it, or pass a new --out")


def check_same_device(existing: list[RunRecord], out: Path, device: str) -> None:
    """A run file answered on one kind of device and resumed on another would mix CPU and GPU timings: in a row's
    TTFT, and in every TTFT ratio that divides one device's time by the other's full prefill. Refused."""
    kind = device.split(":")[0]
    for record in existing:
        theirs = record.provenance.device.split(":")[0] if record.provenance else kind
        if theirs != kind:
            raise KvfError(f"--out {out} was answered on {theirs} ({record.method}, question {record.qid}), so answers "
                           f"timed on {kind} would mix devices in its TTFTs; resume it with --device {theirs}, or pass a new --out")


def setting_text(settings: dict, name: str) -> str:
    return repr(settings[name]) if name in settings else "(none)"


def check_same_questions(existing: list[RunRecord], questions: list[Question], opts: RunOptions,
                         source_ids: set[str]) -> None:
    """A question edited since --out answered it (same id, other text) would be skipped as done, its old
    answer kept under its id: refused. So is a question whose id changed (ids given to a file that had
    none): it would be answered again under its new id, and scored twice. Edited gold answers only change
    scoring: the records keep the answers they were scored with, so that is said."""
    source = opts.questions_source
    by_id, by_text = {q.qid: q for q in questions}, {q.question: q for q in questions}
    answered = {record.qid for record in existing}
    regolded = set()
    for record in existing:
        q = by_id.get(record.qid)
        if q is None:
            renamed = by_text.get(record.question) if record.qid not in source_ids else None
            if renamed is not None and renamed.qid not in answered:
                raise KvfError(f"--out {opts.out} answered {record.question[:60]!r} as question {record.qid}, but {source} "
                               f"now names it {renamed.qid}; pass a new --out, or --overwrite to answer afresh")
            continue
        if record.question != q.question:
            raise KvfError(f"--out {opts.out} answered question {record.qid} as {record.question[:60]!r}, but {source} "
                           f"now asks {q.question[:60]!r}; pass a new --out, or --overwrite to answer afresh")
        if list(record.gold) != list(q.answers):
            regolded.add(record.qid)
    if regolded:
        warn(f"--out {opts.out}: the answers of {len(regolded)} question(s) in {source} changed since they were run "
             f"(e.g. {sorted(regolded)[0]}); their records keep the gold they were run with: --overwrite to re-run")


def check_same_chunks(existing: list[RunRecord], pending: list[Question], picker, opts: RunOptions) -> None:
    """A question answered before the workspace's corpus changed (a document added, removed or edited, then
    rebuilt) now gets other chunks: its new records would sit beside old ones answered from another
    context, and eval would pair them as if not. Refused, for the questions still to answer."""
    first_of = {}
    for record in existing:
        first_of.setdefault(record.qid, record)
    for q in pending:
        record = first_of.get(q.qid)
        if record is not None and list(record.chunk_ids) != picker.chunk_ids(q):
            raise KvfError(f"--out {opts.out} answered question {q.qid} ({record.method}) from other chunks than workspace "
                           f"{picker.ws.root} gives it now (its documents changed since); the methods of one run must "
                           "see the same context: pass a new --out, or --overwrite to answer afresh")


def warn_answered_from_old_chunks(existing: list[RunRecord], answered: list[Question], ws, opts: RunOptions) -> None:
    """Questions answered in full before their documents were edited or removed (then rebuilt) are not run again,
    so check_same_chunks never sees them: a re-run said "nothing to run" over answers from text the workspace no
    longer has. Said, not refused: the file is one run still. Only chunks gone from the workspace are seen here
    (a set lookup; a document added since could change what retrieval finds, which only searching again tells)."""
    asked = {q.qid for q in answered}
    if not asked:
        return
    held = set(read_chunk_ids(ws.chunks_path))
    stale = sorted({r.qid for r in existing if r.qid in asked and not set(r.chunk_ids) <= held})
    if stale:
        warn(f"--out {opts.out}: {counted(len(stale), 'answered question')} (e.g. {stale[0]}) {'cites' if len(stale) == 1 else 'cite'} chunks that workspace "
             f"{ws.root} no longer holds (their documents changed since); their records answer from the old text: "
             "--overwrite to answer afresh, or pass a new --out")


# ---- choosing chunks -----------------------------------------------------------------------------
def resolve_setting(setting: str, questions: list[Question], own_questions: bool = False) -> tuple[str, str]:
    """(setting, why): auto picks per-question when questions bring several passages (or, in your own
    questions, --questions or `kvf data prepare custom`, name any), else shared retrieval."""
    if setting != "auto":
        return setting, "as asked (--setting)"
    most = max(len(q.context_ids) for q in questions)
    if most == 0:
        return "shared", "the questions name no passages"
    if own_questions:
        return "per-question", "the questions name their passages"
    if most == 1:  # one passage per question (NQ-open oracle) only makes sense pooled into a shared corpus
        return "shared", "each question names at most one passage"
    return "per-question", f"questions name up to {most} passages"


def settle_retrieval(opts: RunOptions, setting: str, why: str) -> RunOptions:
    """-k and --retriever shape shared retrieval. The per-question setting retrieves nothing, and there both
    were silently ignored (`-k 3` answered from all 20 of a question's passages): refused, naming why."""
    if setting == "per-question":
        for flag, value in (("--top-k", opts.top_k), ("--retriever", opts.retriever)):
            if value is not None:
                raise KvfError(f"{flag} {value}: the per-question setting ({why}) answers from each question's own "
                               f"passages and retrieves nothing; pass --setting shared to retrieve, or leave {flag} out")
    retriever = opts.retriever or Workspace(default_workspace(opts)).default_retriever()
    return replace(opts, top_k=opts.top_k or DEFAULT_TOP_K, retriever=retriever)


def repeated(ids: list[str]) -> list[str]:
    """The ids named more than once, in first-named order."""
    return [i for i, n in Counter(ids).items() if n > 1]


def warn_cited_twice(questions: list[Question]) -> None:
    """A question citing one passage twice (a copy-paste in one's own questions file) was answered with that
    passage's chunks twice in its prompt, without a word: said once for the run, since it may be meant."""
    twice = [(q.qid, pid) for q in questions for pid in repeated(q.context_ids)]
    if twice:
        (qid, pid), more = twice[0], len({qid for qid, _ in twice}) - 1
        others = f" ({counted(more, 'more question')} cite one more than once)" if more else ""
        warn(f"question {qid} cites passage {pid!r} more than once{others}; its chunks go into the prompt each time it "
             "is cited")


class ChunkPicker:
    def __init__(self, ws: Workspace, setting: str, top_k: int, retriever: str):
        self.setting, self.top_k, self.ws = setting, top_k, ws
        self.retriever, self._searcher = retriever, None
        self.doc_chunks = ws.doc_chunks()
        self._chunk_ids_of: dict[str, list[str]] = {}  # per qid: searched once (check_prompts_fit, then answering)
        if setting == "shared":
            check_index_fresh(ws, retriever)

    @property
    def searcher(self):
        """Opened on first use (the per-question setting never searches)."""
        if self._searcher is None:
            self._searcher = self.ws.open_searcher(self.retriever)
        return self._searcher

    def check_questions(self, questions: list[Question], corpus: Path | None = None) -> None:
        """Every passage a question names must have chunks in the workspace: never an empty context by accident.
        corpus: the dataset's corpus, named in the fix (re-prepared data leaves its old workspace behind)."""
        for q in questions:
            missing = [pid for pid in q.context_ids if not self.doc_chunks.get(pid)]
            if self.setting == "per-question" and not q.context_ids:
                raise KvfError(f"question {q.qid} names no passages, so the per-question setting has no context for "
                               "it; give it passages or pass --setting shared")
            if missing and (meant := document_meant(missing[0], self.doc_chunks)):
                raise KvfError(f"question {q.qid} cites passage {missing[0]!r}, which is not a document of workspace "
                               f"{self.ws.root}; did you mean {meant!r}? (a document's id is its file name, or a "
                               f".jsonl's \"id\")")
            if missing and looks_like_text(missing[0]):   # "passages": ["Alice founded Acme ..."]
                raise KvfError(f"question {q.qid} cites passage {textwrap.shorten(missing[0], 40, placeholder='...')!r}, which looks like a passage's "
                               f"text, not a document id of workspace {self.ws.root}; to bring passages with the "
                               "questions, write them as {\"title\", \"text\"} and run `kvf data prepare custom --input "
                               "FILE -o DIR`, then `kvf run -d DIR`")
            if missing and corpus is None:   # your own --questions file: a mistyped id as likely as another corpus
                example = next(iter(self.doc_chunks), None)
                raise KvfError(f"question {q.qid} cites passage {missing[0]!r}, which is not a document of workspace "
                               f"{self.ws.root} (its ids are file names, or a .jsonl's \"id\": e.g. {example!r}); check "
                               "the id, or, if the workspace was built from another corpus, rebuild it from the one "
                               "that has it (`kvf build-cache CORPUS -w WS`) or pass the workspace built for it (-w)")
            if missing:
                raise KvfError(f"question {q.qid} cites passage {missing[0]}, which has no chunks in workspace {self.ws.root}: "
                               f"the workspace was built from another corpus; rebuild it from this one with "
                               f"`kvf build-cache {corpus} -w {self.ws.root}` (chunks it already holds keep their stored "
                               "KVs), or pass the workspace built for it (-w)")

    def chunk_ids(self, q: Question) -> list[str]:
        if q.qid not in self._chunk_ids_of:
            self._chunk_ids_of[q.qid] = self._pick(q)
        return self._chunk_ids_of[q.qid]

    def _pick(self, q: Question) -> list[str]:
        if self.setting == "shared":
            return [cid for cid, _ in self.searcher.search(q.question, self.top_k)]
        ids = []
        for pid in q.context_ids:
            ids += self.doc_chunks[pid]
        return ids


def check_prompts_fit(questions: list[Question], prompt_of, planned: list[Planned], opts: RunOptions,
                      setting: str, limit: int, console: Console, fits_memory=None) -> None:
    """Every question's prompt (those still to answer) must fit the model's positions with --max-new-tokens
    to spare, under every planned method, checked before any work: else a sweep stops at its first long question, and
    at that question again on every resume. prompt_of(q) -> FusedPrompt; fits_memory(q, prompt), where given, checks
    that its caches fit in the free memory (caches_fit_memory)."""
    methods = [p.method for p in planned] + ([get_method("full")] if opts.compare_full else [])
    source = opts.questions_source
    fewer = fewer_chunks(setting)
    with progress_bar(console) as progress:
        for q in progress.track(questions, description="checking every prompt fits"):
            prompt = prompt_of(q)
            check_prompt_fits(q, prompt, methods, opts.max_new_tokens, limit, source, fewer)
            if fits_memory is not None:
                fits_memory(q, prompt)
            if prompt.n_chunk_tokens == 0:  # only shared retrieval gets here: BM25 matched no word of the question
                raise KvfError(f"question {q.qid} in {source}: {opts.retriever} retrieval found no chunk for it, so every "
                               f"method would answer it without context, alike; rephrase it, use --retriever dense, "
                               f"or leave it out of {source.name}")


def fewer_chunks(setting: str) -> str:
    """How to shorten a question's prompt in this setting."""
    return "retrieve fewer chunks (--top-k)" if setting == "shared" else "give it fewer passages"


def check_prompt_fits(q: Question, prompt, methods: list[FusionMethod], max_new_tokens: int, limit: int,
                      source: Path, fewer: str) -> None:
    """One question's prompt (a FusedPrompt) under each method: its positions + the new tokens <= limit."""
    for method in methods:
        used = prompt.positions_used(method.positions(prompt))
        if used + max_new_tokens > limit:
            why, fix = prompt.overflow_fix(limit, fewer)
            raise KvfError(f"question {q.qid} in {source}: its prompt under {method.name} takes {used} positions"
                           f"{why}, + --max-new-tokens {max_new_tokens} > the model's {limit}; {fix}, "
                           f"or leave the question out of {source.name}")


def check_run_room(builder: EntryBuilder, chunks: ChunkTable, neighbours_of, picker: ChunkPicker,
                   todo: list[list[Planned]], questions: list[Question]) -> None:
    """A run computes the stored KVs its questions need as it reaches them (on its Ray workers too): a disk that
    could not hold them all stopped it with "disk full" hours in. The entries still missing are sized first, as
    build-cache does (a local store; todo[i]: what question i has left to run)."""
    pending = [(q, {p.variant for p in left if p.method.uses_store}) for q, left in zip(questions, todo)]
    variants = set().union(*(needed for _, needed in pending))
    if not variants or builder.store.free_bytes() is None:
        return
    ids = list(dict.fromkeys(cid for q, needed in pending if needed for cid in picker.chunk_ids(q)))
    neighbours = neighbours_of() if "fusion" in variants else None
    missing = missing_entries(variants, builder, chunks, neighbours, ids)
    check_room(builder, chunks, missing, [], what="entries still to compute for these questions")


def stale_indexes(ws: Workspace, manifest: dict) -> list[str]:
    """The indexes the manifest says were built from another chunks table than the workspace's (an index
    built before indexes recorded their chunk set is taken as fresh, and a BM25 index built before they recorded
    its titles, on the same chunks)."""
    built_from = manifest.get("indexes") or {}
    chunk_ids, titles = read_chunk_columns(ws.chunks_path, ["chunk_id", "title"])
    fresh = index_digests(manifest, chunk_ids, titles)
    legacy = {"bm25": ids_digest(chunk_ids)}
    return [name for name, digest in built_from.items()
            if name in fresh and digest not in (None, fresh[name], legacy.get(name))]


def check_index_fresh(ws: Workspace, retriever: str) -> None:
    """An index built from another chunks table (the corpus changed, then a --no-bm25 rebuild) is refused."""
    manifest = ws.manifest()
    if (manifest.get("indexes") or {}).get(retriever) is None:
        return  # built before indexes recorded their chunk set: nothing to compare (and no table to read)
    if retriever in stale_indexes(ws, manifest):
        raise KvfError(f"the {retriever} index of workspace {ws.root} was built from another set of chunks (the corpus "
                       f"changed since); rebuild it with `kvf build-cache CORPUS --workspace {ws.root} --rebuild {retriever}`")


# ---- the workspace -------------------------------------------------------------------------------
def default_workspace(opts: RunOptions) -> Path:
    if opts.workspace is not None:
        return opts.workspace
    return opts.dataset / "workspace" if opts.dataset is not None else Path("workspace")


def check_neighbours(opts: RunOptions, ws: Workspace) -> None:
    """--neighbours shapes the fusion entries of a workspace run creates; one that existed keeps its own
    (it was silently ignored, and the records said the workspace's n). A workspace this run created has it."""
    built = ws.manifest().get("n_neighbours")
    if opts.n_neighbours is not None and built is not None and opts.n_neighbours != built:
        raise KvfError(f"--neighbours {opts.n_neighbours}: workspace {ws.root} was built with {built}, which its fusion "
                       f"entries use; leave --neighbours out, or build another workspace with `kvf build-cache CORPUS "
                       f"-w NEW_WS --neighbours {opts.n_neighbours}` and pass -w NEW_WS")


def ensure_workspace(opts: RunOptions, console: Console, questions: list[Question]) -> Workspace:
    """Use the workspace built by build-cache; for a prepared dataset with none yet, chunk and index its corpus.
    The dataset's own workspace that lacks passages its questions cite (`kvf data prepare` wrote a larger corpus
    into the directory since) is chunked and indexed again, in its own settings; stored KVs stay valid."""
    ws = workspace_path(default_workspace(opts))
    if ws.manifest_path.is_file() and not why_outdated(opts, ws, questions):
        warn_corpus_changed(ws)
        return ws
    if opts.dataset is None:
        raise ws.not_built()
    # a read-only copy of the data cannot hold its default workspace: name the flag that moves it
    flag = "--workspace" if opts.workspace is not None else "--workspace (default: inside --dataset)"
    ws.check_own_folder(flag, opts.store)
    check_writable_dir(ws.root, flag)
    with ws.files_lock(notice(console)):
        previous = ws.manifest() if ws.manifest_path.is_file() else None
        why = why_outdated(opts, ws, questions) if previous is not None else f"no workspace at {ws.root}"
        if not why:
            return ws   # another run built it while this one waited
        console.print(f"{why}: chunking and indexing {opts.dataset / 'corpus'} (KVs are computed as questions need "
                      "them)", markup=False)
        previous = previous or {}
        # a workspace chunked again keeps its own settings, and its store; a new one takes run's flags
        model_ref = open_model(opts.model)
        own = {} if previous else {"chunk_tokens": passage_tokens(opts.dataset) or opts.chunk_tokens,
                                   "n_neighbours": opts.n_neighbours}
        bopts = settle_settings(BuildOptions(corpus=opts.dataset / "corpus", workspace=ws.root, model=opts.model,
                                             variants=VARIANTS, format=previous.get("format"), device=opts.device,
                                             store=opts.store or (ws.reach_store() if previous.get("store") else None),
                                             compute_dtype=opts.dtype, ray=opts.ray, **own), previous, console)
        check_chunk_fits(bopts, model_ref)
        chunks, _ = stage_chunks(bopts, ws, model_ref.tokenizer)
        index_state = ws.index_state() or {}   # indexes an earlier, stopped run finished are kept
        stage_indexes(bopts, ws, chunks, index_state, console)
        store = open_workspace_store(ws, model_ref, bopts.store, bopts.format, bopts.dtype, create=True)
        write_workspace_manifest(ws, bopts, model_ref, store, index_state, variants=[], extras_for=[])
    return ws


def warn_corpus_changed(ws: Workspace) -> None:
    """A workspace answers from its documents as they were chunked: an edit to the corpus since is said, with
    the build that takes it in (its new chunks only)."""
    corpus = ws.corpus_changed()
    if corpus is not None:
        warn(f"{corpus} changed since workspace {ws.root} was built (a document edited, added or removed); its "
             f"answers come from the documents as they were: `kvf build-cache -w {ws.root}` brings it up to date")


def why_outdated(opts: RunOptions, ws: Workspace, questions: list[Question]) -> str | None:
    """Why a prepared dataset's own workspace (DATASET/workspace, built from DATASET/corpus by the same model)
    must be chunked and indexed again, or None: it has no chunks for passages its questions cite, or a refresh
    stopped before its indexes caught up with its chunks. A workspace built from another corpus, or with -w, is
    never rebuilt here: ChunkPicker.check_questions and check_index_fresh refuse, naming the fix."""
    if opts.workspace is not None or opts.dataset is None:
        return None
    manifest = ws.manifest()
    built_from, corpus = Path(manifest.get("corpus") or ""), (opts.dataset / "corpus").resolve()
    # the manifest names the corpus as the building run was given it: relative to that run's directory
    if built_from.resolve() != corpus and built_from.parts[-2:] != corpus.parts[-2:]:
        return None
    if recorded_model(manifest.get("model_arg")) != recorded_model(opts.model):
        return None
    cited = {pid for q in questions for pid in q.context_ids}
    if cited - ws.doc_chunks().keys():
        return f"workspace {ws.root} lacks passages of {opts.dataset / 'corpus'} that its questions cite"
    if ws.corpus_changed(corpus):   # a passage edited in place keeps its id: its old text would be answered from
        return f"{opts.dataset / 'corpus'} changed since workspace {ws.root} was chunked"
    if stale_indexes(ws, manifest):
        return f"workspace {ws.root} was left half updated (its indexes predate its chunks)"
    return None


def check_dataset_folder(path: Path) -> None:
    """--dataset names a folder made by `kvf data prepare`; a workspace, a folder of documents or a questions
    file given there is said to be what it is, with the flags it goes with."""
    kind = folder_kind(path)
    if kind == "file":
        raise KvfError(f"--dataset {path} is a file; pass a questions file as --questions {path} (with --workspace WS)")
    if not path.is_dir():
        raise KvfError(f"--dataset {path}: not a directory; make one with `kvf data prepare` or `kvf data synthetic`")
    if kind == "workspace":
        raise KvfError(f"--dataset {path} is a workspace (kvf build-cache made it), not a prepared dataset; pass it "
                       f"as --workspace {path} with --questions FILE")
    if kind == "documents":
        raise KvfError(f"--dataset {path} holds documents, not a prepared dataset; build a workspace from them "
                       f"(`kvf build-cache {path} -w {path.name}-workspace`) and run with --workspace "
                       f"{path.name}-workspace --questions FILE")


def load_questions(opts: RunOptions) -> tuple[list[Question], str, set[str]]:
    """(questions, dataset name, the ids of all the source's questions) from --dataset or --questions, cut to
    --qid, --offset and --limit."""
    questions, name = source_questions(opts)
    return select_questions(questions, opts), name, {q.qid for q in questions}


def source_questions(opts: RunOptions) -> tuple[list[Question], str]:
    """Every question of --dataset or --questions, and the dataset's name."""
    if opts.dataset is not None:
        check_dataset_folder(opts.dataset)
        questions, _ = load_prepared(opts.dataset)
        name = dataset_name(opts.dataset)
    else:
        if folder_kind(opts.questions) == "dataset":
            raise KvfError(f"--questions {opts.questions} is a prepared dataset; pass it as --dataset {opts.questions}")
        questions = load_questions_file(opts.questions)
        name = file_stem(opts.questions)
    return questions, name


def select_questions(questions: list[Question], opts: RunOptions) -> list[Question]:
    """The questions --qid, --offset and --limit pick, in order."""
    if opts.qids:
        known = {q.qid for q in questions}
        missing = [qid for qid in opts.qids if qid not in known]
        if missing:
            raise KvfError(f"--qid {missing[0]}: no such question in {opts.dataset or opts.questions}")
        questions = [q for q in questions if q.qid in set(opts.qids)]
    if opts.offset:
        if opts.offset >= len(questions):
            held = "--qid picks only" if opts.qids else f"{opts.dataset or opts.questions} has only"
            raise KvfError(f"--offset {opts.offset}: {held} {counted(len(questions), 'question')}; "
                           f"pass an --offset below {len(questions)}")
        questions = questions[opts.offset:]
    if opts.limit is not None and opts.limit > len(questions):   # said, as `kvf data prepare -n` says it
        there = "--qid picks" if opts.qids else "there is" if len(questions) == 1 else "there are"
        held = f"{counted(len(questions), 'question')} left after --offset {opts.offset}" if opts.offset else \
            f"{there} only {counted(len(questions), 'question')}"
        warn(f"{held}, fewer than the {opts.limit} asked; answering those")
    if opts.limit is not None:
        questions = questions[: opts.limit]
    return questions


def prepared_manifest(directory: Path) -> dict:
    """A prepared dataset's prepared.json ({} where there is none), its fields checked: a damaged one is an error
    naming it and the `kvf data` command that makes the dataset again."""
    manifest = directory / "prepared.json"
    if not manifest.is_file():
        return {}
    try:
        found = json.loads(manifest.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        found = None
    if not isinstance(found, dict):
        raise KvfError(f"{manifest} is damaged; make the dataset again with the `kvf data` command that made it "
                       f"(prepare, ruler or synthetic) and --out {directory}")
    name, size = found.get("dataset"), found.get("chunk_tokens")
    if name is not None and not isinstance(name, str):   # records and tables are grouped by it: never a list's text
        raise KvfError(f"{manifest} is damaged (dataset {name!r}); make it again: {remake_command(found, directory)}")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise KvfError(f"{manifest} is damaged (chunk_tokens {size!r}); make it again: {remake_command(found, directory)}")
    return found


def remake_command(found: dict, directory: Path) -> str:
    """The `kvf data` command that makes a prepared dataset again, from what its prepared.json still says."""
    kind, source = found.get("format"), found.get("source")
    if kind == "ruler":
        return f"`kvf data ruler --out {directory}` (with the --length, --seed and --chunk-tokens it was made with)"
    if kind == "synthetic":
        return f"`kvf data synthetic --out {directory}` (with the --n, --passages and --seed it was made with)"
    given = f" --input {source}" if isinstance(source, str) else ""
    if kind == "custom":
        return f"`kvf data prepare custom{given} --out {directory}` (with --corpus if it was made with one)"
    name = found.get("dataset") if isinstance(found.get("dataset"), str) else "NAME"
    return f"`kvf data prepare {name}{given} --out {directory}`"


def dataset_name(directory: Path) -> str:
    return prepared_manifest(directory).get("dataset") or directory.name


def passage_tokens(directory: Path | None) -> int | None:
    """The passage size a dataset was made for (`kvf data ruler --chunk-tokens`): its chunk boundaries are its
    passages', so its workspace is chunked to it. None for datasets made without one."""
    return prepared_manifest(directory).get("chunk_tokens") if directory is not None else None


def warn_passages_cut(opts: RunOptions, ws: Workspace) -> None:
    """A workspace chunked finer than its dataset's passages cuts each passage again, which moves the boundaries
    a suite such as RULER's boundary task is made of: said, with the rebuild that matches."""
    size, chunked = passage_tokens(opts.dataset), ws.manifest().get("chunk_tokens")
    if size is not None and isinstance(chunked, int) and chunked < size:
        warn(f"workspace {ws.root} is chunked to {chunked} tokens, finer than the {size}-token passages "
             f"{opts.dataset} was made with, so its chunks are not its passages; rebuild it with "
             f"`kvf build-cache {opts.dataset / 'corpus'} -w {ws.root} --chunk-tokens {size}`")


# ---- the run -------------------------------------------------------------------------------------
def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) of next-token distributions, P = full prefill's: of one [vocab], or the mean over the rows
    of [T, vocab] (each answer token's)."""
    p_log, q_log = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def auto_settings(method: FusionMethod, opts: RunOptions) -> dict:
    """A method's recorded settings; with --ratio auto, methods whose ratio is a knob say so."""
    settings = method.settings()
    if opts.auto_ratio and method.ratio_is_knob:
        settings["ratio_mode"] = "auto"
        settings["quality_floor"] = opts.quality_floor   # the controller's least ratio: another floor, other answers
    return settings


def say_resumed(console: Console, out: Path, total: int, todo: int) -> None:
    """A re-run over a run file says what it found there: it printed the same table as a fresh run, and
    "runs written" after writing nothing."""
    if todo == total:
        return
    if todo == 0:
        console.print(f"{out}: every answer asked for ({total}) is there already; nothing to run (--overwrite "
                      "answers again)",
                      highlight=False, markup=False)
    else:
        console.print(f"{out}: resuming; {counted(total - todo, 'answer')} of the {total} asked for already there, "
                      f"{todo} to run",
                      highlight=False, markup=False)


def step_name(method: FusionMethod, label: str | None) -> str:
    """A method about to run, as its records will be named (run_name): cacheblend@0.15, kvfuse@0.15 [tuned]."""
    return run_name({"method": method.name, "settings": {"ratio": method.recompute_ratio}, "label": label})


class MethodStats:
    """Per-method running means for the live progress bar."""

    def __init__(self):
        self.ttft: dict[str, list[float]] = {}
        self.compared_full: dict[str, float] = {}   # qid -> the TTFT of the full prefill --compare-full ran
        self.cut = 0                                # answers cut off by --max-new-tokens inside their gold answer
        self.first_cut: tuple[dict, str] | None = None   # the first of them, and its gold answer: the example

    def add(self, record: dict) -> None:
        self.ttft.setdefault(run_name(record), []).append(record["timings"]["first_token"])
        if record.get("full_first_token") is not None:
            self.compared_full[record["qid"]] = record["full_first_token"]
        gold = cut_in_gold(record.get("answer", ""), record.get("gold", []), record.get("answer_tokens"),
                           record["settings"].get("max_new_tokens"))
        if gold is not None:
            self.cut += 1
            self.first_cut = self.first_cut or (record, gold)

    def cut_warning(self) -> str | None:
        """One line when answers stopped at --max-new-tokens partway through their gold answer: they score as
        wrong for a reason no method has."""
        if self.first_cut is None:
            return None
        record, gold = self.first_cut
        return cut_answers_line(self.cut, sum(map(len, self.ttft.values())), [record["settings"]["max_new_tokens"]],
                                (record["qid"], run_name(record), record["answer"], gold),
                                fix="re-run with a larger --max-new-tokens, into a new --out or with --overwrite")

    def line(self, width: int = 110) -> str:
        parts = [f"{label} {1000 * sum(v) / len(v):.0f}ms" for label, v in self.ttft.items()]
        if self.compared_full and "full" not in self.ttft:   # the baseline the others are read against
            parts.append(f"full (--compare-full) {1000 * sum(self.compared_full.values()) / len(self.compared_full):.0f}ms")
        text = "mean TTFT: " + " | ".join(parts)
        return text if len(text) <= width else text[: width - 1] + "…"


def base_settings(opts: RunOptions, setting: str, manifest: dict, model_name: str, dtype: torch.dtype) -> dict:
    """The answer-changing settings every record of this run carries, besides its method's own."""
    return {"top_k": opts.top_k, "setting": setting, "retriever": opts.retriever if setting == "shared" else None,
            "chunk_tokens": manifest.get("chunk_tokens"), "model": model_name,
            "max_new_tokens": opts.max_new_tokens, "n_neighbours": manifest.get("n_neighbours"),
            "store_dtype": manifest.get("dtype", "float16"), "compute_dtype": dtype_name(dtype),
            "pipeline": opts.pipeline}


def settings_for(planned: list[Planned], opts: RunOptions, base: dict) -> dict[int, dict]:
    """Each planned method's recorded settings, by id(planned)."""
    return {id(p): {**auto_settings(p.method, opts), "variant": p.variant, **base} for p in planned}


def run(opts: RunOptions, console: Console) -> Path:
    check_options(opts)
    check_device(opts.device, workers_only=opts.ray is not None)
    questions, name, source_ids = load_questions(opts)
    built = Workspace(default_workspace(opts))   # --model left out: the workspace's own
    if built.manifest_path.is_file():
        opts = replace(opts, model=workspace_model(built.manifest(), opts.model, built.root))
    # the model's config only (no weights yet): model-dependent knobs are refused before a new workspace's
    # minutes of chunking and indexing
    planned = plan_methods(opts, open_model(opts.model).config.num_hidden_layers)
    # a user's own questions (-q, or prepared by `kvf data prepare custom`) that name one passage each mean it:
    # NQ-open's single oracle passages are the ones pooled into a shared corpus
    own = opts.questions is not None or name == "custom"
    setting, why = resolve_setting(opts.setting, questions, own_questions=own)
    opts = settle_retrieval(opts, setting, why)
    workspace_path(default_workspace(opts))  # a file there is refused before anything is written
    with RunFile(opts.out, warn=lambda m: console.print(f"warning: {m}", style="yellow", soft_wrap=True, markup=False)) as run_file:
        existing = [] if opts.overwrite else run_file.records()   # --overwrite empties it after the checks below
        # the first line of output (stdout: stderr is for problems) says how chunks are chosen, and why
        Console().print(f"setting: {setting} ({why})" + (f", {opts.retriever} top-{opts.top_k}" if setting == "shared" else ""),
                        markup=False, highlight=False)
        ws = ensure_workspace(opts, console, questions)
        warn_passages_cut(opts, ws)
        check_neighbours(opts, ws)
        picker = ChunkPicker(ws, setting, opts.top_k, opts.retriever)
        picker.check_questions(questions, opts.dataset / "corpus" if opts.dataset else None)
        dtype = compute_dtype(opts.device, opts.dtype)
        check_entries_dtype(ws, dtype_name(dtype))
        extras_for = {p.method.name for p in planned if p.method.extras_hook is not None}
        if opts.ray is None:
            session = Session(ws, opts.model, opts.device, opts.dtype, opts.store, tuple(extras_for))
            model_name = session.model_ref.name
            prompt_of = lambda q: session.prompt(session.chunks(picker.chunk_ids(q), opts.retriever), q.question)  # noqa: E731
            max_positions = session.answerer.transformer.max_positions
        else:  # the driver only plans and writes: its workers load the model
            model_ref = open_model(opts.model)
            check_workspace_model(ws.manifest(), ws.root, model_ref, opts.model)
            model_name = model_ref.name
            template, chunks_by_id = make_template(model_ref.tokenizer), ChunkTable(ws.chunks_path)
            prompt_of = lambda q: build_prompt(template, [chunks_by_id[c].token_ids for c in picker.chunk_ids(q)],  # noqa: E731
                                               q.question)
            max_positions = model_ref.config.max_position_embeddings
        settings_of = settings_for(planned, opts, base_settings(opts, setting, ws.manifest(), model_name, dtype))
        check_resumable(existing, {(p.method.name, p.label, p.variant, ratio_key(settings_of[id(p)])): settings_of[id(p)]
                                   for p in planned}, opts.out)
        check_compare_full_kept(existing, {(p.method.name, p.label, p.variant, ratio_key(settings_of[id(p)]))
                                           for p in planned}, opts.out, opts.compare_full)
        check_same_device(existing, opts.out, opts.device)
        check_same_questions(existing, questions, opts, source_ids)
        done = {record_key(r.qid, r.method, r.label, r.settings) for r in existing}
        todo_of = {q.qid: [i for i, p in enumerate(planned)
                           if record_key(q.qid, p.method.name, p.label, settings_of[id(p)]) not in done]
                   for q in questions}
        check_same_chunks(existing, [q for q in questions if todo_of[q.qid]], picker, opts)
        warn_answered_from_old_chunks(existing, [q for q in questions if not todo_of[q.qid]], ws, opts)
        # questions already answered in full proved that they fit: a resumed sweep does not search them again
        fits_memory = (caches_fit_memory(session.answerer.transformer, todo_of, planned, opts, setting)
                       if opts.ray is None else None)   # Ray workers check their own memory (methods_at_once)
        check_prompts_fit([q for q in questions if todo_of[q.qid]], prompt_of, planned, opts, setting, max_positions,
                          console, fits_memory)
        if opts.ray is None:
            builder, chunk_table, neighbours_of = session.builder, session.chunks_by_id, session.neighbours
        else:   # the driver sizes what its workers will compute (an EntryBuilder loads the model only to compute)
            manifest = ws.manifest()
            builder = EntryBuilder(model_ref, open_run_store(ws, manifest, model_ref, opts.store), opts.device,
                                   run_extras(manifest, extras_for), dtype=dtype)
            chunk_table, neighbours_of = chunks_by_id, lambda: load_neighbours(ws.neighbours_file, chunks_by_id)
        check_run_room(builder, chunk_table, neighbours_of, picker,
                       [[planned[i] for i in todo_of[q.qid]] for q in questions], questions)
        say_resumed(console, opts.out, len(questions) * len(planned), sum(len(todo) for todo in todo_of.values()))
        warn_cited_twice([q for q in questions if todo_of[q.qid]])   # after every check: a refused run is one line
        if opts.overwrite:   # only now: a refused --overwrite keeps the records it would have replaced
            run_file.truncate_all()
        stats = MethodStats()
        with progress_bar(console, description_column(), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TimeRemainingColumn(), TextColumn("{task.fields[step]}", markup=False),
                          TextColumn("{task.fields[stats]}", markup=False)) as progress:
            task = progress.add_task(f"answering {name}", total=len(questions) * len(planned), stats="", step="")
            progress.advance(task, sum(len(planned) - len(todo) for todo in todo_of.values()))

            def write(rec: dict) -> None:
                run_file.append(parse_record(rec, "kvf run (internal)"))
                stats.add(rec)
                progress.update(task, advance=1, stats=stats.line())

            jobs = [(q, todo_of[q.qid]) for q in questions if todo_of[q.qid]]
            if opts.ray is not None:
                from kvf.pipeline.workflows.distributed import run_with_ray
                run_with_ray(opts, jobs, setting, name, ws.root, write)
            else:
                answer_here(QuestionRunner(opts, session, picker, planned, settings_of, name), jobs, progress, task, write)
    if stats.ttft:
        console.print(stats.line(width=400), markup=False)   # run names carry [labels]
    cut = stats.cut_warning()
    if cut:
        console.print(f"warning: {cut}", style="yellow", soft_wrap=True, markup=False)
    return opts.out


# the share of the free memory a question's prefilled caches may take (QuestionRunner.methods_at_once); the rest is
# for what a prefill and decoding allocate on the way (attention blocks, MLP rows, logits) and for the store's reads
CACHE_MEMORY_SHARE = 0.6


def held_caches(todo: list[Planned], opts: RunOptions) -> int:
    """The KV caches a question keeps from its first prefill to its last answer: full prefill's (for `full` or
    --compare-full), and per stored variant its query-only pass (whose loaded cache other methods copy) and reuse's
    prefill."""
    needs_full = opts.compare_full or any(not p.method.uses_store for p in todo)
    return int(needs_full) + 2 * len({p.variant for p in todo if p.method.uses_store})


def check_caches_fit(q: Question, n_tokens: int, held: int, one_cache: int, free: int, opts: RunOptions,
                     setting: str) -> None:
    """The fewest caches a question must hold at once, its held ones and one method's, must fit in the free memory:
    past it the kernel ends the process without a word (on a GPU, an allocation fails mid-answer)."""
    need = (held + 1) * one_cache
    if need > free:
        raise KvfError(f"question {q.qid} in {opts.questions_source}: its prompt of {n_tokens:,} tokens + --max-new-tokens "
                       f"{opts.max_new_tokens} needs {held + 1} KV caches at once ({need / 2**30:.2f} GiB), more than the "
                       f"{free / 2**30:.2f} GiB free on {opts.device}; {fewer_chunks(setting)}, lower --max-new-tokens"
                       + (", leave out --compare-full" if opts.compare_full else "")
                       + ", or free some memory (another --device)")


def caches_fit_memory(transformer, todo_of: dict, planned: list[Planned], opts: RunOptions, setting: str):
    """-> fits_memory(q, prompt) for check_prompts_fit: question q's fewest caches at once (check_caches_fit) against
    the memory free now, before any answer; None where the free memory cannot be read."""
    free = allocatable_bytes(opts.device)
    if free is None:
        return None

    def fits_memory(q: Question, prompt) -> None:
        one_cache = transformer.cache_bytes(prompt.n_tokens + opts.max_new_tokens)
        held = held_caches([planned[i] for i in todo_of[q.qid]], opts)
        check_caches_fit(q, prompt.n_tokens, held, one_cache, free, opts, setting)
    return fits_memory


def answer_here(runner: QuestionRunner, jobs: list, progress: Progress, task, write) -> None:
    """Answer (question, planned indices) jobs in this process, showing offline KV work and each step as it happens."""
    offline = progress.add_task("offline KVs", total=None, stats="", step="", visible=False)
    on_missing = lambda n, v: progress.update(offline, description=f"offline KVs ({v})", total=n,  # noqa: E731
                                              completed=0, visible=True)
    for number, (q, indices) in enumerate(jobs, 1):
        on_step = lambda text: progress.update(task, step=f"question {number}/{len(jobs)}: {text}")  # noqa: E731
        for rec in runner.records(q, [runner.planned[i] for i in indices], on_missing, lambda: progress.advance(offline),
                                  on_step):
            progress.update(offline, visible=False)
            write(rec)
    progress.update(task, step="")


class QuestionRunner:
    """Answers one question with every planned method: its chunks' entries once, the full prefill once
    (shared by `full` and --compare-full), each method's timed prefill (one reuse prefill per variant for
    every method that is plain reuse here), then the answers decoded together in one batch (in groups of
    methods where the free memory holds fewer caches: methods_at_once). What a record shares with others is
    listed in its `shared` field."""

    def __init__(self, opts: RunOptions, session: Session, picker: ChunkPicker, planned: list[Planned],
                 settings_of: dict, name: str, memory_share: float | None = None):
        self.opts, self.session, self.picker, self.planned = opts, session, picker, planned
        self.settings_of, self.name = settings_of, name
        self.memory_share = CACHE_MEMORY_SHARE if memory_share is None else memory_share   # of the free memory, for caches
        self.prov = provenance(opts.device)
        self.full_method, self.reuse_method = get_method("full"), get_method("reuse")
        self.warmed: set[str] = set() if opts.warmup else {p.method.name for p in planned} | {"full"}
        self.token_layer_seconds = (measure_token_layer_seconds(session.answerer.transformer)
                                    if opts.auto_ratio else None)

    def warm(self, prompt, method: FusionMethod, keys) -> None:
        if method.name not in self.warmed:  # one untimed call per method: kernel set-up stays out of TTFT
            self.session.warm_up(prompt, method, keys)
            self.warmed.add(method.name)

    def records(self, q: Question, todo: list[Planned], on_missing=None, on_done=None, on_step=None):
        """Yield one run record (a dict) per planned method of `todo`, for question q. A method's prefilled cache
        is held until its answer is decoded and scored; where the free memory holds fewer caches than there are
        methods, they go in groups (methods_at_once), each prefilled, decoded and scored before the next.
        on_step(text) hears each step as it starts ("prefill cacheblend@0.15"): a question's records all come at
        its end, minutes apart on long prompts."""
        opts, session = self.opts, self.session
        say = on_step or (lambda text: None)
        chunk_ids = self.picker.chunk_ids(q)
        chunks = session.chunks(chunk_ids, opts.retriever)
        prompt = session.prompt(chunks, q.question)
        keys = {v: session.entries(v, chunks, on_missing=(lambda n, v=v: on_missing(n, v)) if on_missing else None,
                                   on_done=on_done)
                for v in {p.variant for p in todo if p.method.uses_store}}
        needs_full = opts.compare_full or any(not p.method.uses_store for p in todo)
        at_once = self.methods_at_once(prompt, held_caches(todo, opts), q)
        full = None
        if needs_full:
            say("prefill full")
            self.warm(prompt, self.full_method, None)
            full = session.prefill(prompt, self.full_method, None, opts.max_new_tokens)
        shared_of = {v: {} for v in keys} if opts.share else {}  # per variant: its query-only pass, once
        reused = {}    # per variant: the one reuse prefill that every method which is reuse here shares
        kept = {}      # id(prefill) -> its answer, for the prefills every group shares (full's, reuse's)
        scored = {}    # the same for (answer KL, agreement) to full's answer, with --compare-full: kept prefills' only
        full_answer = None
        for start in range(0, len(todo), at_once):
            jobs = []  # (planned, method, (fused, timings))
            for p in todo[start: start + at_once]:
                method, variant_keys = p.method, keys.get(p.variant)
                if opts.auto_ratio:  # the loading controller picks this question's ratio (untimed: a calibration)
                    method = with_auto_ratio(method, session.store, variant_keys or [], prompt, self.token_layer_seconds,
                                             opts.quality_floor)
                if not method.uses_store:
                    jobs.append((p, method, full))  # the full prefill timed above: not run twice
                    continue
                if opts.share and method.is_reuse():
                    if p.variant not in reused:
                        say(f"prefill reuse ({p.variant})")
                        reused[p.variant] = self.prefill(prompt, self.reuse_method, variant_keys, shared_of.get(p.variant))
                    jobs.append((p, method, reused[p.variant]))
                    continue
                say(f"prefill {step_name(method, p.label)}")
                jobs.append((p, method, self.prefill(prompt, method, variant_keys, shared_of.get(p.variant))))
            to_decode = list({id(pre): pre for pre in ([full] if full else []) + [pre for _, _, pre in jobs]
                              if id(pre) not in kept}.values())
            if to_decode:   # a later group of methods that all share reuse's prefill has nothing new to decode
                say(f"decoding {counted(len(to_decode), 'answer')}")
            answer_of = {**kept, **{id(pre): ans for pre, ans in zip(to_decode, self.decode(prompt, to_decode))}}
            kept.update({id(pre): answer_of[id(pre)] for pre in [full, *reused.values()] if pre is not None})
            full_answer = answer_of[id(full)] if full else None
            group_scored = {}   # keyed by id: only while this group's prefills live (a freed one's id is reused)
            if full_answer is not None and opts.compare_full:
                say("full's answer over every cache (--compare-full)")
                group_scored = {**scored, **self.on_full_answer(full_answer, {k: a for k, a in answer_of.items()
                                                                                if k not in scored})}
                scored = {k: v for k, v in group_scored.items() if k in kept}
            for p, method, prefilled in jobs:
                yield self.record(q, p, method, prefilled, answer_of[id(prefilled)], chunk_ids, full, full_answer,
                                  reused, group_scored)
            jobs = to_decode = answer_of = prefilled = None   # this group's caches go before the next group's are made

    def methods_at_once(self, prompt, held: int, q: Question) -> int:
        """How many methods a question prefills before decoding them: all of them, unless memory_share of the free
        memory holds fewer of their caches (with `held` caches more, kept for the whole question: held_caches).
        Holding every method's cache of a long prompt at once took 7.5 GB for v1's 9 methods x 4 ratios at 6K tokens
        here; past the free memory, the kernel ends the process without a word. Where not even one method's cache
        fits beside the held ones, the question is refused (check_caches_fit)."""
        free = allocatable_bytes(self.opts.device)
        if free is None:
            return len(self.planned)
        one_cache = self.session.answerer.transformer.cache_bytes(prompt.n_tokens + self.opts.max_new_tokens)
        check_caches_fit(q, prompt.n_tokens, held, one_cache, free, self.opts, self.picker.setting)
        return max(1, int(self.memory_share * free / one_cache) - held)

    def record(self, q: Question, p: Planned, method: FusionMethod, prefilled, ans, chunk_ids, full, full_answer,
               reused: dict, scored: dict) -> dict:
        """One run record: the answer, its settings, what it shared, and with --compare-full how it stands to full's."""
        opts, session = self.opts, self.session
        settings = {**self.settings_of[id(p)], "ratio": method.recompute_ratio, "store": str(session.store.path)}
        rec = {"qid": q.qid, "dataset": f"{self.name}/{q.task}" if q.task else self.name, "method": method.name,
               "label": p.label, "settings": settings, "chunk_ids": chunk_ids, "question": q.question,
               "gold": q.answers, "gold_mode": q.gold_mode, "provenance": self.prov, **ans.record()}
        shared = []
        if prefilled is full and opts.compare_full:
            shared.append("prefill:full")
        if prefilled is reused.get(p.variant) and method.name != "reuse":
            shared.append(f"reuse-prefill:{p.variant}")
        if prefilled[0].info.get("shared"):
            shared += [f"{piece}:{p.variant}" for piece in prefilled[0].info["shared"]]
        if ans.decoded_with > 1:
            shared.append(f"decode-batch:{ans.decoded_with}")
        rec["shared"] = shared
        if "read" in prefilled[1]:
            rec["timings"]["read"] = round(prefilled[1]["read"], 6)
        if full_answer is not None and opts.compare_full:
            rec.update(full_answer=full_answer.text,
                       kl_full=kl_divergence(full_answer.fused.logits, ans.fused.logits),
                       top1_agree_full=bool(torch.argmax(full_answer.fused.logits) == torch.argmax(ans.fused.logits)),
                       full_first_token=round(full_answer.timings["first_token"], 6))
            if id(prefilled) in scored:
                rec["answer_kl_full"], rec["answer_agree_full"] = scored[id(prefilled)]
        return rec

    def on_full_answer(self, full_answer, answer_of: dict) -> dict[int, tuple[float, float]]:
        """Per answer (by its prefill's id): how its cache predicts full prefill's answer token by token, each
        from full's tokens before it: the mean KL(full || it) over those tokens, and the share of them it would
        pick itself. Where answers part in decoding, this tells how far apart, as answer F1 cannot. Untimed:
        decoding's own logits up to where an answer leaves full's, then full's later tokens over every cache, in one
        batched pass (per group of methods, see records) when work is shared."""
        tokens = full_answer.token_ids
        if not tokens:   # full prefill answered nothing: no token to predict
            return {}
        target = torch.tensor(tokens)
        answers = [full_answer] + [ans for ans in answer_of.values() if ans is not full_answer]
        batch = len(answers) if self.opts.share else 1   # as decode(): lone requests one by one
        predicted = [steps for start in range(0, len(answers), batch)
                     for steps in self.session.answerer.predictions_many(answers[start: start + batch], tokens)]
        steps_of = {id(ans): steps for ans, steps in zip(answers, predicted)}              # per answer [T, vocab]
        full_steps = steps_of[id(full_answer)]
        scores = {}
        for key, ans in answer_of.items():
            steps = steps_of[id(ans)]                                                        # [T, vocab]
            agree = (steps.argmax(-1).cpu() == target).float().mean()
            scores[key] = (max(0.0, kl_divergence(full_steps, steps)), float(agree))   # KL >= 0 but for rounding
        return scores

    def prefill(self, prompt, method: FusionMethod, variant_keys, shared: dict | None):
        self.warm(prompt, method, variant_keys)
        return self.session.prefill(prompt, method, variant_keys, self.opts.max_new_tokens, self.opts.pipeline, shared)

    def decode(self, prompt, prefilled: list) -> list:
        """Decode a question's prefilled answers in one batch (their caches are all held by now anyway),
        or one by one without sharing; returns answers in the same order."""
        batch = max(1, len(prefilled)) if self.opts.share else 1
        answers = []
        for start in range(0, len(prefilled), batch):
            answers += self.session.answerer.decode_many(prompt, prefilled[start: start + batch],
                                                         self.opts.max_new_tokens,
                                                         keep_logits=self.opts.compare_full)   # for on_full_answer
        return answers


def with_auto_ratio(method: FusionMethod, store, keys: list[str], prompt, token_layer_seconds: float,
                    quality_floor: float) -> FusionMethod:
    """The same method at the ratio where recomputing a layer takes as long as loading one."""
    if not method.ratio_is_knob or not keys:
        return method
    layer_bytes, bandwidth = measure_bandwidth(store, keys)
    ratio = choose_ratio(layer_bytes, bandwidth, prompt.n_chunk_tokens, token_layer_seconds, quality_floor)
    return type(method)(ratio, knobs=method.knobs)
