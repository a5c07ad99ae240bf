"""`kvf run`: answer a prepared dataset's questions with one method at one or more ratios.

For each question: pick its chunks (its own passages in order, or top-k retrieved from the shared
corpus), make sure their KVs are in the store (computing missing ones first, untimed: that is
offline work), then time the request: load + fuse + first token, then decode. One JSON line per
(question, ratio), flushed and fsynced as written, so a crash loses at most the question in flight
and a re-run skips what is already there.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvf import KvfError
from kvf.eval.datasets import Question, load_prepared
from kvf.pipeline.answer import Answerer
from kvf.pipeline.build import (BuildOptions, EntryBuilder, open_workspace_store, stage_chunks, stage_indexes,
                                write_workspace_manifest)
from kvf.pipeline.chunking import read_chunks_table
from kvf.pipeline.controller import DEFAULT_QUALITY_FLOOR, choose_ratio, measure_bandwidth, measure_token_layer_seconds
from kvf.pipeline.methods import FusionMethod, build_method, get_method
from kvf.pipeline.model import open_model
from kvf.pipeline.store_source import StoreKVSource
from kvf.pipeline.workspace import Workspace

SETTINGS = ("auto", "per-question", "shared")
FIXED_RATIO_METHODS = ("full", "prefix", "reuse", "pcw", "cachefocus")  # their ratio is not a knob


@dataclass
class RunOptions:
    dataset: Path
    methods: list[str]
    ratios: list[float]
    out: Path
    workspace: Path | None = None
    variant: str | None = None          # default: the method's own offline variant
    top_k: int = 5
    limit: int | None = None
    setting: str = "auto"
    retriever: str = "bm25"
    compare_full: bool = False
    model: str | None = None
    max_new_tokens: int = 32
    pipeline: bool = True
    knobs: dict | None = None           # method-specific settings
    chunk_tokens: int = 256
    store: str | None = None
    device: str = "cpu"
    n_neighbours: int = 10              # FusionRAG's n, when run has to create the workspace
    auto_ratio: bool = False            # --ratio auto: the loading controller picks each question's ratio
    quality_floor: float = DEFAULT_QUALITY_FLOOR


def parse_ratios(text: str) -> list[float]:
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvfError(f"--ratio {text}: expected numbers in [0, 1], e.g. 0.15 or 0,0.05,0.15") from None
    bad = [r for r in ratios if not 0.0 <= r <= 1.0]
    if not ratios or bad:
        raise KvfError(f"--ratio {text}: every ratio must be within [0, 1]")
    return ratios


# ---- resumable output ---------------------------------------------------------------------------
def record_key(rec: dict) -> tuple:
    return (rec["qid"], rec["method"], rec["settings"].get("variant"), ratio_key(rec["settings"]))


def ratio_key(settings: dict):
    """How a record's ratio is matched on resume: 'auto' runs by mode (their ratio varies per question)."""
    return "auto" if settings.get("ratio_mode") == "auto" else float(settings.get("ratio", 0.0))


def read_done(out: Path) -> set[tuple]:
    """Keys already written; a torn last line (killed mid-write) is cut off so appends stay valid."""
    if not out.exists():
        return set()
    done, good_bytes = set(), 0
    with open(out, "rb") as f:
        for line in f:
            try:
                done.add(record_key(json.loads(line)))
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
                break
            good_bytes += len(line)
    if good_bytes < out.stat().st_size:
        with open(out, "r+b") as f:
            f.truncate(good_bytes)
    return done


def append_record(out: Path, rec: dict) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---- choosing chunks ---------------------------------------------------------------------------
def resolve_setting(setting: str, questions: list[Question]) -> str:
    if setting not in SETTINGS:
        raise KvfError(f"--setting {setting}: use one of {', '.join(SETTINGS)}")
    if setting != "auto":
        return setting
    # one passage per question (NQ-open oracle) only makes sense pooled into a shared corpus
    return "shared" if max(len(q.contexts) for q in questions) <= 1 else "per-question"


class ChunkPicker:
    def __init__(self, ws: Workspace, setting: str, top_k: int, retriever: str):
        self.setting, self.top_k = setting, top_k
        self.doc_chunks = ws.doc_chunks()
        if setting == "shared":
            if retriever == "bm25":
                from kvf.pipeline.bm25 import BM25Searcher
                self.searcher = BM25Searcher(ws.bm25_dir)
            elif retriever == "dense":
                from kvf.pipeline.dense import DenseSearcher
                self.searcher = DenseSearcher(ws.dense_dir)
            else:
                raise KvfError(f"--retriever {retriever}: use bm25 or dense")

    def chunk_ids(self, q: Question) -> list[str]:
        if self.setting == "shared":
            return [cid for cid, _ in self.searcher.search(q.question, self.top_k)]
        ids = []
        for passage in q.contexts:
            ids += self.doc_chunks.get(passage.id, [])
        return ids


# ---- the run ---------------------------------------------------------------------------------
def ensure_workspace(opts: RunOptions, console: Console) -> Workspace:
    """Use the workspace built by build-cache; if there is none yet, chunk and index the dataset's corpus."""
    ws = Workspace(opts.workspace or opts.dataset / "workspace")
    if not ws.manifest_path.is_file():
        console.print(f"no workspace at {ws.root}: chunking and indexing {opts.dataset / 'corpus'} "
                      "(KVs are computed as questions need them)")
        model_ref = open_model(opts.model)
        bopts = BuildOptions(corpus=opts.dataset / "corpus", workspace=ws.root, model=opts.model,
                             chunk_tokens=opts.chunk_tokens, variants=("prefix", "fusion"), store=opts.store,
                             n_neighbours=opts.n_neighbours)
        chunks, _ = stage_chunks(bopts, ws, model_ref.tokenizer)
        index_state: dict = {}
        stage_indexes(bopts, ws, chunks, index_state)
        store = open_workspace_store(ws, model_ref, opts.store, None, bopts.dtype, create=True)
        write_workspace_manifest(ws, bopts, model_ref, store, index_state, variants=[], cachecraft_meta=False)
    return ws


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) of the first-token distributions, P = full prefill."""
    p_log, q_log = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((p_log.exp() * (p_log - q_log)).sum())


def plan_methods(opts: RunOptions) -> list[tuple[FusionMethod, str]]:
    """Every (method, stored variant) to run per question: methods x ratios, duplicates dropped
    (full, reuse, prefix, ... ignore the ratio, so a sweep runs them once)."""
    planned, seen = [], set()
    for name in opts.methods:
        for ratio in opts.ratios:
            method = build_method(name, ratio, opts.knobs)
            variant = opts.variant or method.offline_variant
            key = (name, variant, json.dumps(method.settings(), sort_keys=True))
            if key not in seen:
                seen.add(key)
                planned.append((method, variant))
    return planned


def dataset_name(directory: Path) -> str:
    manifest = directory / "prepared.json"
    return json.loads(manifest.read_text()).get("dataset", directory.name) if manifest.is_file() else directory.name


def run(opts: RunOptions, console: Console) -> Path:
    questions, _ = load_prepared(opts.dataset)
    if opts.limit:
        questions = questions[: opts.limit]
    planned = plan_methods(opts)
    ws = ensure_workspace(opts, console)
    manifest = ws.manifest()
    setting = resolve_setting(opts.setting, questions)
    picker = ChunkPicker(ws, setting, opts.top_k, opts.retriever)
    chunks_by_id = {c.chunk_id: c for c in read_chunks_table(ws.chunks_path)}
    neighbours = None
    if any(variant == "fusion" for _, variant in planned):
        from kvf.pipeline.neighbours import load_neighbours
        neighbours = load_neighbours(ws.neighbours_path)

    model_ref = open_model(opts.model)
    if manifest.get("model_fingerprint") not in (None, model_ref.fingerprint):
        raise KvfError(f"--workspace {ws.root} was built with model {manifest.get('model')}; pass that --model "
                       "or use another --workspace")
    store = open_workspace_store(ws, model_ref, opts.store or manifest.get("store"), None,
                                 manifest.get("dtype", "float16"), create=True)
    answerer = Answerer(model_ref.load(opts.device))
    needs_extras = any(m.name == "cachecraft" for m, _ in planned)  # Cache-Craft's build-time summaries
    builder = EntryBuilder(model_ref, store, opts.device, cachecraft_meta=needs_extras, engine=answerer.engine)
    answerer.engine.remember_prefix_kv(builder.template.prefix_ids, builder.system_kv())
    n_layers = answerer.transformer.n_layers
    full_method = get_method("full")
    token_layer_seconds = measure_token_layer_seconds(answerer.transformer) if opts.auto_ratio else None
    name = dataset_name(opts.dataset)

    opts.out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(opts.out)
    warmed: set[str] = set()
    totals = {"n": 0, "ttft": 0.0, "recomputed": 0.0}
    label = ",".join(opts.methods)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[stats]}"), console=console) as progress:
        task = progress.add_task(f"{label} on {name}", total=len(questions) * len(planned), stats="")
        for q in questions:
            todo = [(m, v) for m, v in planned if (q.qid, m.name, v, ratio_key(auto_settings(m, opts))) not in done]
            progress.advance(task, len(planned) - len(todo))
            if not todo:
                continue
            chunk_ids = picker.chunk_ids(q)
            chunks = [chunks_by_id[cid] for cid in chunk_ids]
            prompt = answerer.prompt([c.token_ids for c in chunks], q.question)
            keys = {v: ensure_entries(builder, v, chunks, neighbours, chunks_by_id)
                    for v in {v for m, v in todo if m.uses_store}}
            extras = {v: [store.get_extras(k) for k in ks] for v, ks in keys.items()} if needs_extras else {}
            full = None
            if opts.compare_full:
                warm_up(answerer, full_method, prompt, None, warmed)
                full = answerer.answer(prompt, full_method, None, opts.max_new_tokens)
            if opts.auto_ratio:  # the loading controller picks this question's ratio (untimed: a calibration)
                todo = [(with_auto_ratio(m, store, keys.get(v, []), prompt, token_layer_seconds, opts), v)
                        for m, v in todo]
            for method, variant in todo:
                def source(pipeline=opts.pipeline):
                    if not method.uses_store:
                        return None
                    return StoreKVSource(store, keys[variant], n_layers, pipeline, extras.get(variant))
                if method.name == "full" and full is not None:
                    src, ans = None, full  # --compare-full has just timed this very prefill: do not run it twice
                else:
                    warm_up(answerer, method, prompt, source(), warmed)
                    src = source()
                    ans = answerer.answer(prompt, method, src, opts.max_new_tokens)
                rec = {"qid": q.qid, "dataset": name, "method": method.name,
                       "settings": {**auto_settings(method, opts), "variant": variant, "top_k": opts.top_k,
                                    "setting": setting, "retriever": opts.retriever if setting == "shared" else None,
                                    "chunk_tokens": manifest.get("chunk_tokens"), "model": model_ref.name,
                                    "store": str(store.path), "pipeline": opts.pipeline},
                       "chunk_ids": chunk_ids, "question": q.question, "gold": q.answers, **ans.record()}
                if src is not None:
                    src.close()
                    rec["timings"]["read"] = round(src.read_seconds, 6)
                if full is not None:
                    rec.update(full_answer=full.text, kl_full=kl_divergence(full.fused.logits, ans.fused.logits),
                               top1_agree_full=bool(torch.argmax(full.fused.logits) == torch.argmax(ans.fused.logits)))
                append_record(opts.out, rec)
                totals["n"] += 1
                totals["ttft"] += ans.timings["first_token"]
                totals["recomputed"] += ans.fused.recomputed_tokens / max(1, prompt.n_chunk_tokens)
                progress.update(task, advance=1, stats=f"mean TTFT {1000 * totals['ttft'] / totals['n']:.0f} ms, "
                                                       f"recomputed {100 * totals['recomputed'] / totals['n']:.1f}%")
    return opts.out


def warm_up(answerer: Answerer, method: FusionMethod, prompt, source, warmed: set[str]) -> None:
    """A method's first call pays one-time kernel set-up: run it once, untimed, so TTFT leaves it out."""
    if method.name not in warmed:
        method.prefill(answerer.engine, prompt, source)
        warmed.add(method.name)


def auto_settings(method: FusionMethod, opts: RunOptions) -> dict:
    """A method's recorded settings; with --ratio auto, selective methods say so."""
    settings = method.settings()
    if opts.auto_ratio and "ratio" in settings and method.name not in FIXED_RATIO_METHODS:
        settings["ratio_mode"] = "auto"
    return settings


def with_auto_ratio(method: FusionMethod, store, keys: list[str], prompt, token_layer_seconds: float,
                    opts: RunOptions) -> FusionMethod:
    """The same method at the ratio where recomputing a layer takes as long as loading one."""
    if method.name in FIXED_RATIO_METHODS or not keys:
        return method
    layer_bytes, bandwidth = measure_bandwidth(store, keys)
    ratio = choose_ratio(layer_bytes, bandwidth, prompt.n_chunk_tokens, token_layer_seconds, opts.quality_floor)
    return build_method(method.name, ratio, opts.knobs)


def ensure_entries(builder: EntryBuilder, variant: str, chunks, neighbours, chunks_by_id) -> list[str]:
    """Store keys of the question's chunks, computing missing entries now (offline work, untimed)."""
    for chunk in builder.missing(variant, chunks, neighbours):
        builder.compute(variant, chunk, neighbours, chunks_by_id)
    return [builder.key(variant, c, neighbours) for c in chunks]
