"""Scaling benchmark: build-cache and sweeps in one process vs on 1 and 2 Ray workers, and what a
sweep's shared work saves per question. Everything is measured side by side in one run.

    python -m kvf.scripts.bench_scale [--questions 48 --passages 4 --sweep-questions 16 --share-questions 2]

On a synthetic corpus (kvf.pipeline.data.synthetic; no download) and the embedded model, every
process computing with one torch thread:
1. build throughput (chunks/s of the KV stage, prefix variant): one process, Ray x1, Ray x2. The three
   stores must hold the same keys and the same bytes (checked, not assumed). Ray's times include its
   actors' start-up (one model load each, in parallel); the one-process time does not include its
   model load (stage_kv starts timing after it).
2. sweep throughput (answers/s of `kvf run`): one process, Ray x1, Ray x2, on the same questions and
   methods. Steady state: from the time every worker has finished its first question to the last
   question (start-up and model loads excluded, as in a long sweep); the whole-run rate is shown
   beside it. The records must agree.
3. per-question cost of the methods sweep issue 18 names (v1's 9 methods x ratios 0/0.05/0.15/0.3,
   --compare-full), on the same questions, as three processes side by side: v1 itself (commit
   V1_COMMIT, main when the issue was filed, checked out into a git worktree), today's code with
   --no-share (every request alone, decode batch 1) and with sharing (the default). A watcher notes
   when each question's records are all written; the cost per question is the time from the first
   question's last record to the last question's, over n - 1 questions, so start-up (imports, model
   load, each method's untimed warm-up call) stays out, as it does in a long sweep.
4. a written projection of the cost of a 1M-chunk store (bytes measured per token here; GPU hours
   from build-cache's own cost per entry measured on a GPU, entries built in a row with their writes behind
   where the table has them (scripts/bench_gpu_build's table, results/gpu/h200-f7556d7/build.csv), and from
   FLOPs under stated assumptions).
4b. the driver's share (chunking and indexing stay on the driver, whatever the number of GPUs): its
   cost per chunk of embedding for the dense index, and of the neighbour search (exact up to 50K chunks:
   all pairs, so chunks squared; above, an inverted file: about chunks^1.5), measured at one thread and
   projected to the corpus. `--rerender JSON
   --measure-driver` measures only these and adds them to the numbers.
5. with --real DIR (a prepared dataset, e.g. work/musique: ~6K tokens a question), part 3's sweep again
   on its first --real-questions questions, v1 against shared work: what sharing saves at a real
   prompt length. Each code answers from its own copy of DIR (its own workspace and store), filled by
   an untimed first run.
Prints rich tables and writes results/scale.md, results/scale.json and results/scale.png.
`--rerender results/scale.json` measures nothing: it writes the report again from those numbers (with the
flags that run was given) and the current --gpu-build table.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvf.cachestore import open_store
from kvf.eval.stats import ratio_of_means_interval
from kvf.pipeline.data.synthetic import make_synthetic
from kvf.pipeline.files import work_dir, write_atomic
from kvf.pipeline.fusion.methods import METHODS, method_names
from kvf.pipeline.records import read_records
from kvf.pipeline.retrieval.neighbours import EXACT_UP_TO, IVF_PROBES
from kvf.pipeline.workflows.build import DEFAULT_NEIGHBOURS, BuildOptions, build_cache
from kvf.pipeline.workflows.provenance import git_commit
from kvf.pipeline.workflows.run import RunOptions, parse_methods, run
from kvf.pipeline.workflows.display import output_console

ROOT = Path(__file__).resolve().parent.parent
QUIET = Console(file=io.StringIO())
SWEEP_RATIOS = [0.0, 0.05, 0.15, 0.3]
V1_COMMIT = "8e6847b"  # main when issue 18 was filed: the sweep whose cost it asks to cut to a third
V1_METHODS = "full,reuse,pcw,epic,cacheblend,cachecraft,fusionrag,prophetkv,cachefocus"  # v1's 9 methods
V1_RECORDS_6K = ROOT / "results" / "methods" / "runs" / "musique.jsonl.gz"  # v1's methods sweep, committed


def methods_sweep_args(data: Path, n: int) -> list[str]:
    """`kvf run` arguments of the sweep issue 18 names, on the first n questions of `data` (parts 3 and 5)."""
    ratios = ",".join(f"{r:g}" for r in SWEEP_RATIOS)
    return ["-d", str(data), "-n", str(n), "-m", V1_METHODS, "-r", ratios, "--compare-full", "--max-new-tokens", "16"]

# stated assumptions of the projection (not measured here)
H100_BF16_DENSE_FLOPS = 989e12   # NVIDIA H100 SXM datasheet, dense BF16
ASSUMED_MFU = 0.40               # prefill is compute-bound; 40% is a typical well-tuned figure
ASSUMED_GPU_DOLLARS_PER_HOUR = 2.50
ASSUMED_S3_DOLLARS_PER_GB_MONTH = 0.023
ASSUMED_WRITE_GB_PER_S = 1.0     # sustained object-store writes of one 8-GPU node
LLAMA3_8B = {"name": "Llama-3-8B", "params": 8.0e9, "layers": 32, "kv_heads": 8, "head_dim": 128}


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=int, default=48, help="synthetic questions (the corpus is their passages)")
    p.add_argument("--passages", type=int, default=4, help="passages per question")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="chunks per Ray task")
    p.add_argument("--sweep-questions", type=int, default=16, help="questions of the throughput sweeps")
    p.add_argument("--sweep-methods", default="full,reuse,cacheblend,prophetkv")
    p.add_argument("--share-questions", type=int, default=4,
                   help="questions of the per-question cost comparison (the first one is start-up, not counted)")
    p.add_argument("--corpus-chunks", type=float, default=1e6, help="chunks in the projected corpus")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the projection")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temp dir, removed afterwards")
    p.add_argument("--share-note", default="nothing else running", help="what else ran during part 3")
    p.add_argument("--real", type=Path, default=None,
                   help="a prepared dataset dir (kvf data prepare) for part 5, e.g. work/musique; default: skip part 5")
    p.add_argument("--real-questions", type=int, default=3, help="questions of part 5 (the first is not counted)")
    p.add_argument("--gpu-build", type=Path, default=ROOT / "results" / "gpu" / "h200-f7556d7" / "build.csv",
                   help="scripts/bench_gpu_build's table (one chunk's entry built on a GPU) for the projection")
    p.add_argument("--neighbours", type=int, default=DEFAULT_NEIGHBOURS, help="neighbours per chunk in the projection")
    p.add_argument("--knn-vectors", type=int, default=20_000, help="vectors of the timed exact neighbour search")
    p.add_argument("--approx-vectors", type=int, default=200_000,
                   help="vectors of the timed approximate neighbour search (more than the exact search's limit)")
    p.add_argument("--measure-driver", action="store_true",
                   help="with --rerender: measure the driver's per-chunk costs (part 4b) and add them to the numbers")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "scale.md")
    p.add_argument("--rerender", type=Path, default=None, metavar="JSON",
                   help="measure nothing: write --out again from an earlier run's numbers (its .json) and the "
                        "current --gpu-build, with the flags that run was given")
    args = p.parse_args(argv)
    if args.measure_driver and args.rerender is None:
        raise SystemExit("bench_scale: --measure-driver: only with --rerender JSON (a full run measures the driver anyway)")
    if not 1 <= args.neighbours < args.knn_vectors:
        raise SystemExit(f"bench_scale: --neighbours {args.neighbours} --knn-vectors {args.knn_vectors}: need "
                         "1 <= neighbours < vectors")
    if args.approx_vectors <= EXACT_UP_TO:
        raise SystemExit(f"bench_scale: --approx-vectors {args.approx_vectors}: the search is exact up to "
                         f"{EXACT_UP_TO:,} chunks; pass more")
    if args.rerender is not None:
        return args
    # steady-state rates leave out each worker's first question (2 Ray workers) or the first question
    for flag, value, least in (("--sweep-questions", args.sweep_questions, 3),
                               ("--share-questions", args.share_questions, 2),
                               ("--real-questions", args.real_questions, 2)):
        if value < least:
            raise SystemExit(f"bench_scale: {flag} {value}: needs at least {least} questions "
                             "(the first ones carry start-up and are not counted)")
    if args.real is not None and not (args.real / "questions.jsonl").is_file():
        raise SystemExit(f"bench_scale: --real {args.real}: no questions.jsonl there; prepare it first, e.g. "
                         f"`kvf data prepare musique --out {args.real}` (reads $KVF_DATA)")
    return args


def cached(work: Path, part: str, compute):
    """A part's numbers, computed once per work dir (a rerun with the same --workdir resumes)."""
    path = work / f"part-{part}.json"
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    write_atomic(path, json.dumps(value))
    return value


# ---- 1. build ------------------------------------------------------------------------------------
def timed_build(corpus: Path, workspace: Path, ray_workers: int | None, batch: int) -> dict:
    opts = BuildOptions(corpus=corpus, workspace=workspace, bm25=False, dense=False, threads=1, batch=batch,
                        ray=None if ray_workers is None else "local", workers=ray_workers)
    summary = build_cache(opts, QUIET)
    kv = [s for s in summary.stages if s.name.startswith("kv prefix")][0]
    return {"chunks": kv.items, "tokens": kv.tokens, "seconds": kv.seconds, "chunks_per_s": kv.items / kv.seconds,
            "bytes": summary.bytes_written}


def same_store(a: Path, b: Path) -> bool:
    """Same keys, and every entry's tensor equal bit for bit."""
    store_a, store_b = open_store(str(a), readonly=True), open_store(str(b), readonly=True)
    keys = sorted(store_a.keys())
    return keys == sorted(store_b.keys()) and all(torch.equal(store_a.get(k), store_b.get(k)) for k in keys)


# ---- 2. sweep throughput -------------------------------------------------------------------------
def timed_run(data: Path, workspace: Path, out: Path, methods: str, n: int, ray_workers: int | None) -> dict:
    """answers_per_s: steady state, from the time every worker has finished its first question to the
    last question (start-up and model loads excluded); wall_answers_per_s: over the whole run."""
    opts = RunOptions(out=out, methods=parse_methods(methods), dataset=data, workspace=workspace, limit=n,
                      max_new_tokens=8, ray=None if ray_workers is None else "local", workers=ray_workers,
                      threads=1)
    with LineCounter(out) as lines:
        run(opts, QUIET)
    records = run_records(out)
    ends = question_ends(lines.seen, len(records), n, out)
    workers = ray_workers or 1
    steady = (n - workers) * len(records) / n / (ends[-1] - ends[workers - 1])
    return {"questions": n, "answers": len(records), "seconds": lines.seconds, "answers_per_s": steady,
            "wall_answers_per_s": len(records) / lines.seconds, "records": records}


def run_records(out: Path) -> list[dict]:
    """A run file's records as dicts, read (and checked) by kvf's own reader."""
    return [r.model_dump() for r in read_records(out)]


def answers_of(records: list[dict]) -> dict:
    return {(r["qid"], r["method"], r["settings"].get("ratio")): r["answer"] for r in records}


# ---- 3. per-question cost of a methods sweep: v1, lone requests, shared work ------------------------
def v1_checkout(work: Path) -> Path:
    """A directory whose `kvf` package is commit V1_COMMIT (a git worktree): put it on PYTHONPATH."""
    tree, pkg = work / "v1" / "tree", work / "v1" / "pkg"
    if not (tree / "__init__.py").exists():
        shutil.rmtree(tree, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(tree), V1_COMMIT],
                       check=True, capture_output=True)
    pkg.mkdir(parents=True, exist_ok=True)
    if not (pkg / "kvf").exists():
        (pkg / "kvf").symlink_to(tree.resolve(), target_is_directory=True)
    return pkg


def kvf_env(python_path: Path | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if python_path is not None:
        env["PYTHONPATH"] = str(python_path)
    return env


def kvf(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvf", *args]


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")  # a line still being written is not counted
    except FileNotFoundError:
        return 0


def own_prefill_seconds(records: list[dict], skip_first: bool = True) -> float:
    """Mean per question of the layer-loop seconds (timings.recompute) of every distinct prefill of a
    shared sweep, each counted once: the work no exact sharing can remove, since each prefill
    recomputes its own tokens over its own cache. A record tagged reuse-prefill:V shares reuse's."""
    per_question: dict[str, dict] = {}
    for rec in records:
        tag = next((t for t in rec["shared"] if t.startswith("reuse-prefill:")), None)
        if rec["method"] == "reuse":
            tag = f"reuse-prefill:{rec['settings']['variant']}"
        key = tag or (rec["method"], rec["settings"].get("ratio"), rec["settings"]["variant"])
        per_question.setdefault(rec["qid"], {}).setdefault(key, rec["timings"]["recompute"])
    seconds = [sum(prefills.values()) for prefills in per_question.values()]
    seconds = seconds[1:] if skip_first and len(seconds) > 1 else seconds  # as per_question: steady state
    return sum(seconds) / len(seconds)


def v1_split_at_6k(path: Path) -> dict | None:
    """From v1's committed MuSiQue sweep records (about 6K tokens per question): seconds per question in
    all (time to first token + decoding), in the ratio-knob methods' time to first token, in full's."""
    if not path.exists():
        return None
    # only v1's methods: the sweep file also holds methods added since (ape, a3, kvfuse)
    records = [r for r in read_records(path) if r.method in V1_METHODS.split(",")]
    n = len({r.qid for r in records})
    fixed = {name for name in method_names() if not METHODS[name].ratio_is_knob}  # method_names() discovers them
    total = sum(r.timings.first_token + r.timings.decode for r in records) / n
    selective = sum(r.timings.first_token for r in records if r.method not in fixed) / n
    full = sum(r.timings.first_token for r in records if r.method == "full") / n
    new_tokens = sorted({r.settings.get("max_new_tokens") for r in records} - {None})
    return {"questions": n, "total": total, "selective": selective, "full": full,
            "prefills_recomputed": prefills_recomputed(records), "max_new_tokens": new_tokens}


def prefills_recomputed(records: list) -> float:
    """Mean per question of the chunk token-layers that the sweep's prefills recompute (each record's
    recomputed_token_layers: every (method, ratio) of v1 is one prefill, the full prefill included),
    in units of the full prefill's own. Times full prefill's seconds, it is what recomputing those rows
    costs at full prefill's rate, a floor under any exact sharing: no selection, loading or decoding."""
    per_question: dict[str, list[int]] = {}
    full: dict[str, int] = {}
    for r in records:
        per_question.setdefault(r.qid, []).append(r.recomputed_token_layers)
        if r.method == "full":
            full[r.qid] = r.recomputed_token_layers
    return sum(sum(layers) / full[qid] for qid, layers in per_question.items()) / len(per_question)


# ---- 5. the same sweep on a real dataset --------------------------------------------------------------
def real_sweep(work: Path, dataset: Path, n: int, v1: Path, console: Console) -> dict:
    """Part 3's sweep on the first n questions of a prepared dataset, v1 against shared work, each code
    answering from its own copy of the dataset (its own workspace and store). An untimed first run per
    code computes every entry the sweep reads (both variants, Cache-Craft's summaries)."""
    out = {}
    for key, python_path in (("v1", v1), ("shared", None)):
        def measure(key=key, python_path=python_path):
            data = work / f"real-{key}"
            if not (data / "questions.jsonl").exists():
                shutil.copytree(dataset, data, ignore=shutil.ignore_patterns("workspace"))
            console.print(f"{dataset.name}, {key}: computing the stored entries (untimed) ...")
            subprocess.run(kvf("run", "-d", str(data), "-n", str(n), "--neighbours", "3", "-m", "reuse,fusionrag,cachecraft",
                               "-r", "0.05", "--max-new-tokens", "1", "-o", str(work / f"real-{key}-entries.jsonl")),
                           env=kvf_env(python_path), check=True, capture_output=True, cwd=ROOT)
            console.print(f"{dataset.name}, {key}: methods sweep per question ...")
            return watched_sweep(kvf("run", *methods_sweep_args(data, n), "--neighbours", "3",
                                     "-o", str(work / f"real-{key}.jsonl")),
                                 kvf_env(python_path), work / f"real-{key}.jsonl", n)
        out[key] = cached(work, f"real-{key}", measure)
    records = out["shared"]["records"]
    return {"dataset": str(dataset), "questions": n, "v1": out["v1"]["per_question"],
            "shared": out["shared"]["per_question"], "answers": out["shared"]["answers"],
            "v1_each": out["v1"]["each"], "shared_each": out["shared"]["each"],
            "prompt_tokens": sum(r["prompt_tokens"] for r in records) / len(records),
            "own_prefills": own_prefill_seconds(records),
            "same_answers": answers_of(out["v1"]["records"]) == answers_of(records)}


class LineCounter:
    """Notes (seconds since start, complete lines) whenever a file's line count changes, sampling
    every 50 ms in a background thread while the `with` block runs."""

    def __init__(self, path: Path):
        self.path, self.seen, self.seconds = path, [], 0.0
        self.started = time.perf_counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def sample(self) -> None:
        lines = count_lines(self.path)
        if not self.seen or lines != self.seen[-1][1]:
            self.seen.append((time.perf_counter() - self.started, lines))

    def loop(self) -> None:
        while not self.stop.is_set():
            self.sample()
            time.sleep(0.05)

    def __enter__(self) -> "LineCounter":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.seconds = time.perf_counter() - self.started
        self.sample()


def watched_sweep(cmd: list[str], env: dict, out: Path, n: int) -> dict:
    """Run one sweep process over n questions; per_question = (time the last question's records were
    all written - time the first's were) / (n - 1)."""
    out.unlink(missing_ok=True)
    with LineCounter(out) as lines:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"sweep failed ({' '.join(cmd)}): {proc.stderr.decode()[-2000:]}")
    records = run_records(out)
    done_at = question_ends(lines.seen, len(records), n, out)
    return {"questions": n, "answers": len(records), "seconds": lines.seconds,
            "per_question": (done_at[-1] - done_at[0]) / (n - 1),
            "each": [end - before for before, end in zip(done_at, done_at[1:])],   # [n - 1] steady questions
            "records": records}


def cost_interval(each: list[float] | None, v1_each: list[float] | None) -> tuple[float, float] | None:
    """95% interval of (mean cost per question) / (v1's), the same steady questions paired; None where a run
    measured before per-question costs were kept (its numbers are re-rendered as they were)."""
    if not each or not v1_each or len(each) != len(v1_each):
        return None
    return ratio_of_means_interval(each, v1_each)


def interval_text(interval: tuple[float, float]) -> str:
    return f"[{interval[0]:.2f}, {interval[1]:.2f}]"


def with_interval(ratio: float, interval: tuple[float, float] | None) -> str:
    return f"{ratio:.2f}" + (f" {interval_text(interval)}" if interval else "")


def question_ends(seen: list[tuple[float, int]], total: int, n: int, out: Path) -> list[float]:
    """When each of n questions had all its records written, from (seconds, lines so far) samples;
    every question writes total / n records."""
    if total == 0 or total % n:
        raise SystemExit(f"{out}: {total} records cannot be the same number for each of {n} questions")
    return [next(t for t, lines in seen if lines >= i * total // n) for i in range(1, n + 1)]


# ---- 4. projection ----------------------------------------------------------------------------------
def chunk_texts(text: str, tokenizer, tokens: int, n: int) -> list[str]:
    """n windows of `tokens` of the tokenizer's tokens, cut from text (cycled when it is short)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids * (1 + tokens * n // len(ids))
    return [tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(n)]


def measure_driver(text: str, chunk_tokens: int, n_neighbours: int, knn_vectors: int, approx_vectors: int,
                   n_chunks: int = 128, exact_up_to: int = EXACT_UP_TO) -> dict:
    """The driver's cost per chunk at one thread: embedding it for the dense index (the default embedder,
    on the CPU), and kvf's top_neighbours over random unit vectors: exact over knn_vectors, approximate
    (inverted file) over approx_vectors. Random vectors time the search; they say nothing of its recall."""
    import faiss
    from kvf.pipeline.retrieval.dense import DEFAULT_EMBEDDER, Embedder
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    embedder = Embedder()
    tokens = min(chunk_tokens, embedder.model.max_seq_length - 2)   # the embedder reads no further
    texts = chunk_texts(text, embedder.model.tokenizer, tokens, n_chunks)
    embedder.encode(texts[:8])                                       # warm-up
    started = time.perf_counter()
    embedder.encode(texts)
    embed_seconds = time.perf_counter() - started
    knn_seconds = time_neighbours(knn_vectors, embedder.dim, n_neighbours, exact_up_to=knn_vectors)
    approx_seconds = time_neighbours(approx_vectors, embedder.dim, n_neighbours, exact_up_to=exact_up_to)
    return {"embedder": DEFAULT_EMBEDDER, "embedder_tokens": tokens, "embed_chunks_per_s": n_chunks / embed_seconds,
            "knn_vectors": knn_vectors, "knn_seconds": knn_seconds, "n_neighbours": n_neighbours,
            "approx_vectors": approx_vectors, "approx_seconds": approx_seconds, "exact_up_to": exact_up_to,
            "approx_lists_read": IVF_PROBES, "dim": embedder.dim, "threads": 1}


def time_neighbours(n_vectors: int, dim: int, n_neighbours: int, exact_up_to: int) -> float:
    """Seconds of kvf's top_neighbours over n_vectors random unit vectors [n, dim]."""
    import numpy as np
    from kvf.pipeline.retrieval.neighbours import top_neighbours
    vectors = np.random.default_rng(0).standard_normal((n_vectors, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    started = time.perf_counter()
    top_neighbours(vectors, [str(i) for i in range(n_vectors)], n_neighbours, exact_up_to=exact_up_to)
    return time.perf_counter() - started


def approximate_search(chunks: float, driver: dict) -> bool:
    """Whether the projection's neighbour search is the approximate one (an older scale.json timed only the exact)."""
    return "approx_seconds" in driver and chunks > driver["exact_up_to"]


def neighbour_seconds(chunks: float, driver: dict) -> float:
    """The neighbour search over `chunks`, from the timed one: exact compares every pair (chunks²); the
    inverted file reads a fixed number of its √chunks lists per chunk (chunks^1.5)."""
    if approximate_search(chunks, driver):
        return driver["approx_seconds"] * (chunks / driver["approx_vectors"]) ** 1.5
    return driver["knn_seconds"] * (chunks / driver["knn_vectors"]) ** 2


def kv_bytes_per_token(model: dict, dtype_bytes: int = 2) -> int:
    return model["layers"] * 2 * model["kv_heads"] * model["head_dim"] * dtype_bytes


GPU_BUILD_COLUMNS = {"compute_dtype", "chunk_tokens", "entry_ms", "prefill_ms", "model", "device"}


def gpu_build_cost(table: Path) -> dict | None:
    """One chunk's entry built on a GPU through build-cache's own path, in bfloat16 (its default there),
    from scripts/bench_gpu_build's table; None when there is no such table. Where the table times entries
    built in a row with their writes behind (row_behind_ms), that is the cost: it is how build-cache runs."""
    if not table.is_file():
        return None
    import pandas as pd
    try:
        rows = pd.read_csv(table)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError):
        rows = pd.DataFrame()
    missing = GPU_BUILD_COLUMNS - set(rows.columns)
    if missing:
        raise SystemExit(f"bench_scale: --gpu-build {table}: not bench_gpu_build's table (no {', '.join(sorted(missing))} "
                         "column); pass the build.csv that `python -m kvf.scripts.bench_gpu_build --out DIR/build.md` wrote")
    rows = rows[rows["compute_dtype"] == "bfloat16"]
    if rows.empty:
        return None
    row = rows.iloc[0]
    in_a_row = "row_behind_ms" in rows.columns and pd.notna(row.row_behind_ms)
    cost_ms = float(row.row_behind_ms if in_a_row else row.entry_ms)
    return {"seconds_per_chunk": cost_ms / 1000, "cost_ms": cost_ms, "in_a_row": bool(in_a_row),
            "entry_ms": float(row.entry_ms), "prefill_ms": float(row.prefill_ms),
            "chunk_tokens": int(row.chunk_tokens), "gpu": str(row.device).removeprefix("NVIDIA ").split()[0],
            "model": row.model,
            "table": str(table.relative_to(ROOT)) if table.is_relative_to(ROOT) else str(table)}


def gpu_cost_what(gpu_cost: dict) -> str:
    """What the projection's GPU cost per chunk timed, in words."""
    return ("entries built in a row, each store write behind the next chunk's compute" if gpu_cost["in_a_row"]
            else "one entry alone")


def projection(chunks: float, chunk_tokens: int, gpus: int, measured: dict, gpu_cost: dict | None = None,
               driver: dict | None = None) -> dict:
    tokens = chunks * chunk_tokens
    driver_hours = {} if driver is None else {
        "driver_embed_core_hours": chunks / driver["embed_chunks_per_s"] / 3600,
        "driver_knn_core_hours": neighbour_seconds(chunks, driver) / 3600}
    llama_bytes = tokens * kv_bytes_per_token(LLAMA3_8B)
    flops_seconds = 2 * LLAMA3_8B["params"] * tokens / (H100_BF16_DENSE_FLOPS * ASSUMED_MFU)
    # measured: a whole entry (prefill, copy to the host, local write) per chunk, in proportion to its tokens
    gpu_seconds = (chunks * gpu_cost["seconds_per_chunk"] * chunk_tokens / gpu_cost["chunk_tokens"] if gpu_cost
                   else flops_seconds)
    return {"flops_gpu_hours": flops_seconds / 3600,
            "gpu_hours_measured": bool(gpu_cost), "chunks": chunks, "tokens": tokens, "gpus": gpus,
            "smollm_bytes": tokens * measured["bytes_per_token"],
            "smollm_cpu_core_hours": tokens / measured["tokens_per_core_s"] / 3600,
            "llama_bytes": llama_bytes, "llama_gpu_hours": gpu_seconds / 3600,
            "llama_wall_hours": gpu_seconds / 3600 / gpus,
            "llama_dollars": gpu_seconds / 3600 * ASSUMED_GPU_DOLLARS_PER_HOUR,
            "llama_storage_dollars_month": llama_bytes / 1e9 * ASSUMED_S3_DOLLARS_PER_GB_MONTH,
            "llama_write_hours": llama_bytes / 1e9 / (ASSUMED_WRITE_GB_PER_S * max(1, gpus // 8)) / 3600,
            **driver_hours}


def store_or_compute(proj: dict) -> str:
    """Which costs more, the store or its computation: said from the numbers, not assumed."""
    storage, compute = proj["llama_storage_dollars_month"], proj["llama_dollars"]
    if storage >= compute:
        return (f"At this size the store, not the prefill, is the cost: keeping {proj['llama_bytes'] / 2**40:.1f} TiB "
                f"costs ${storage:,.0f} a month against ${compute:,.0f} once for {proj['llama_gpu_hours']:,.1f} GPU-hours.")
    return (f"Computing it costs more than a month of keeping it: ${compute:,.0f} for {proj['llama_gpu_hours']:,.1f} "
            f"GPU-hours against ${storage:,.0f} a month for {proj['llama_bytes'] / 2**40:.1f} TiB.")


# ---- report ---------------------------------------------------------------------------------------
def table(title: str, columns: list[str], rows: list[list]) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        t.add_row(*map(str, r))
    return t


def markdown_table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def throughput_rows(results: dict, unit: str, wall: str | None = None) -> list[list]:
    one = results["ray x1"][unit]
    return [[name, f"{r[unit]:.3f}", *([f"{r[wall]:.3f}"] if wall else []), f"{r['seconds']:.1f}",
             f"{r[unit] / one:.2f}×"] for name, r in results.items()]


def plot(build: dict, sweep: dict, share: dict, real: dict | None, own_prefills: float, path: Path,
         shared_intervals: tuple = (None, None)) -> None:
    """Three panels: build and sweep throughput per execution, and the methods sweep's cost per question
    against v1's (synthetic prompts, and the real dataset's where part 5 ran), with issue 18's target of a third
    and, per prompt length, what the distinct prefills' own layer loops cost (no exact sharing removes them).
    shared_intervals: shared / v1's 95% interval per prompt length (synthetic, real), drawn on its bar where known."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), gridspec_kw={"width_ratios": [1, 1, 1.25]})
    for ax, results, unit, label in ((axes[0], build, "chunks_per_s", "build-cache KV stage (chunks/s)"),
                                     (axes[1], sweep, "answers_per_s", "kvf run sweep (answers/s, steady)")):
        names = list(results)
        ax.bar(names, [results[n][unit] for n in names], color=["#888888", "#4C72B0", "#DD8452"])
        ax.set_ylabel(label)
        ax.set_xlabel("execution (1 torch thread per process)")
    ax = axes[2]
    v1, lone, shared = (share[name]["per_question"] for name in share)   # the table's order: v1, lone, shared
    groups = [("synthetic prompts", {"v1": 1.0, "lone requests": lone / v1, "shared work": shared / v1}, own_prefills / v1)]
    if real is not None:
        groups.append((f"{Path(real['dataset']).name} ({real['prompt_tokens'] / 1000:.1f}K tokens)",
                       {"v1": 1.0, "shared work": real["shared"] / real["v1"]}, real["own_prefills"] / real["v1"]))
    colors = {"v1": "#888888", "lone requests": "#4C72B0", "shared work": "#DD8452"}
    width = 0.27
    for g, ((_, costs, loops), interval) in enumerate(zip(groups, shared_intervals)):
        offsets = [(i - (len(costs) - 1) / 2) * width for i in range(len(costs))]
        for (mode, cost), dx in zip(costs.items(), offsets):
            ax.bar(g + dx, cost, width, color=colors[mode], label=mode if g == 0 else None)
        dx = offsets[-1]   # the shared bar: its 95% interval, and the part of it its distinct prefills' layer loops take
        if interval:   # drawn from its own ends: a percentile interval need not hold the bar's height
            ax.errorbar(g + dx, (interval[0] + interval[1]) / 2, yerr=(interval[1] - interval[0]) / 2,
                        fmt="none", ecolor="black", elinewidth=1, capsize=3,
                        label="shared work's 95% interval" if g == 0 else None)
        ax.hlines(loops, g + dx - width / 2, g + dx + width / 2, colors="black", linewidth=2,
                  label="its distinct prefills' layer loops" if g == 0 else None)
    ax.axhline(1 / 3, color="black", linestyle="--", linewidth=1, label="issue 18's target (1/3 of v1)")
    ax.set_xticks(range(len(groups)), [name for name, _, _ in groups])
    ax.set_ylabel("sweep cost per question (x v1)")
    ax.set_xlabel("questions (9 methods x 4 ratios, --compare-full)")
    ax.set_ylim(0, 2.0)   # room above the tallest bar (lone requests, ~1.3) for the legend
    ax.legend(fontsize=7, frameon=False, loc="upper center", ncol=2)
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle("Scale-out on a 2-core CPU, SmolLM2-135M-Instruct (float32)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=200)
    plt.close(fig)


def driver_rows(proj: dict, driver: dict) -> list[list]:
    if approximate_search(proj["chunks"], driver):
        search = [f"approximate {driver['n_neighbours']} neighbours, CPU core-hours",
                  f"measured {driver['approx_seconds']:.1f} s for {driver['approx_vectors']:,} chunks (faiss inverted file, "
                  f"{driver['approx_lists_read']} of √chunks lists read, one thread), x (chunks / that)^1.5"]
    else:
        search = [f"exact {driver['n_neighbours']} neighbours, CPU core-hours",
                  f"measured {driver['knn_seconds']:.1f} s for {driver['knn_vectors']:,} chunks (faiss flat, one thread), "
                  "x (chunks / that)²"]
    return [
        ["any (driver)", "dense index embeddings, CPU core-hours", f"{proj['driver_embed_core_hours']:,.1f}",
         f"measured {driver['embed_chunks_per_s']:.1f} chunks/s per core ({driver['embedder']}, "
         f"{driver['embedder_tokens']} tokens a chunk, one thread)"],
        ["any (driver)", search[0], f"{proj['driver_knn_core_hours']:,.1f}", search[1]],
    ]


def projection_rows(proj: dict, measured: dict, gpu_cost: dict | None, gpus: int) -> list[list]:
    gpu = gpu_cost["gpu"] if gpu_cost else "H100"
    gpu_from = (f"measured: build-cache on an {gpu}, {gpu_cost['cost_ms']:.0f} ms per {gpu_cost['chunk_tokens']}-token "
                f"chunk ({gpu_cost_what(gpu_cost)}; random weights, bfloat16)" if gpu_cost else
                f"assumed: 2 x 8e9 FLOPs per token, {H100_BF16_DENSE_FLOPS / 1e12:.0f} TFLOP/s BF16 dense at {ASSUMED_MFU:.0%} MFU")
    return [
        ["SmolLM2-135M", "store size", f"{proj['smollm_bytes'] / 2**40:.2f} TiB",
         f"measured {measured['bytes_per_token'] / 1024:.1f} KiB per stored token (float16, all files)"],
        ["SmolLM2-135M", "CPU core-hours", f"{proj['smollm_cpu_core_hours']:,.0f}",
         f"measured {measured['tokens_per_core_s']:.0f} tokens/s per core (one process, one thread)"],
        ["Llama-3-8B", "store size", f"{proj['llama_bytes'] / 2**40:.1f} TiB",
         f"{kv_bytes_per_token(LLAMA3_8B) // 1024} KiB per token (32 layers x 2 x 8 KV heads x 128 x float16)"],
        ["Llama-3-8B", f"GPU-hours ({gpu})", f"{proj['llama_gpu_hours']:,.1f}", gpu_from],
        ["Llama-3-8B", f"wall hours on {gpus} GPUs", f"{proj['llama_wall_hours']:,.2f}",
         "Ray actors, one per GPU, scale linearly (as measured above on CPU)"],
        ["Llama-3-8B", "hours to write the store", f"{proj['llama_write_hours']:,.1f}",
         f"assumed {ASSUMED_WRITE_GB_PER_S:g} GB/s of sustained object-store writes per 8-GPU node"],
        ["Llama-3-8B", "compute dollars", f"${proj['llama_dollars']:,.0f}", f"assumed ${ASSUMED_GPU_DOLLARS_PER_HOUR:.2f} per {gpu}-hour"],
        ["Llama-3-8B", "storage dollars per month", f"${proj['llama_storage_dollars_month']:,.0f}",
         f"assumed ${ASSUMED_S3_DOLLARS_PER_GB_MONTH} per GB-month (S3 standard)"],
    ]


def search_note(proj: dict, driver: dict) -> str:
    if not approximate_search(proj["chunks"], driver):
        return "the exact neighbour search compares every pair."
    return (f"above {driver['exact_up_to']:,} chunks the neighbour search is approximate (an inverted file, of whose "
            f"√chunks lists each chunk's search reads {driver['approx_lists_read']}), timed on random vectors, which say "
            "nothing of its recall. Its recall against the exact search is tested on clustered vectors (at least 0.9, "
            "tests/test_retrieval.py) but not measured on a real corpus this large (none is on this machine).")


def driver_note(proj: dict, driver: dict, measured_by: str | None) -> str:
    """What the driver rows mean: chunking and indexing stay on the driver, so they do not shrink with GPUs."""
    cores = 64
    hours = proj["driver_embed_core_hours"] + proj["driver_knn_core_hours"]
    return ("The driver rows are the part that more GPUs do not shorten: in a Ray build, chunking and indexing stay on "
            "the driver. They are measured on this CPU at one thread" +
            (f" (by `{measured_by}`, on top of the numbers above)" if measured_by else "") +
            " and projected: embedding is per chunk; " + search_note(proj, driver) + " On a "
            f"{cores}-core CPU head node they take about {hours / cores:,.1f} h, if they scale with cores; with "
            "`--device cuda` and a GPU on the driver the embedder runs there instead (not measured); the neighbour "
            "search stays on its CPU. BM25 indexing (Lucene, on the driver too) is not in these rows.\n")


def rows_floor(at_6k: dict) -> float:
    """Seconds per question that recomputing the sweep's rows costs at full prefill's own rate (v1's
    committed 6K records): full prefill's seconds x the full prefills' worth of token-layers recomputed."""
    return at_6k["full"] * at_6k["prefills_recomputed"]


def new_tokens_said(at_6k: dict) -> str:
    """'12 new tokens', as the records' settings say (several caps: each named)."""
    caps = at_6k.get("max_new_tokens") or []
    return f"{' or '.join(str(c) for c in caps)} new tokens" if caps else "new tokens as their settings say"


def real_section(real: dict, note: str, at_6k: dict | None, interval: tuple[float, float] | None) -> list[str]:
    """Part 5 in markdown: the sweep at a real dataset's prompt length, v1 against shared work (and shared / v1's
    95% interval, where the run kept each question's cost)."""
    rows = [[name, real["questions"], real["answers"], f"{real[key]:.1f}",
             with_interval(real[key] / real["v1"], interval if key == "shared" else None)]
            for name, key in ((f"v1 ({V1_COMMIT}, as filed)", "v1"), ("shared work (default)", "shared"))]
    return [f"## The same sweep at a real prompt length ({Path(real['dataset']).name})\n",
            markdown_table(["code", "questions", "answers", "s/question", "vs v1" + (" [95% CI]" if interval else "")],
                           rows),
            f"\nPart 3's sweep (v1's 9 methods x ratios 0, 0.05, 0.15, 0.3, --compare-full, 16 new tokens) on the first "
            f"{real['questions']} questions of `{real['dataset']}` (prepared by `kvf data prepare`; per-question passages, "
            f"256-token chunks, FusionRAG neighbours n = 3), {real['prompt_tokens']:,.0f} prompt tokens on average, "
            f"measured with {note}; steady state over {real['questions'] - 1} questions, as in part 3. Each code answered "
            f"from its own copy of the dataset, whose store an untimed first run filled. Shared / v1 = "
            f"**{real['shared'] / real['v1']:.2f}**" + (f" (95% interval {interval_text(interval)}, "
            "a bootstrap over the steady questions, each one's cost under both codes resampled together)" if interval else "") +
            f"; same answers: **{real['same_answers']}**. At this length the distinct "
            f"prefills' own layer loops (each once, the full prefill included) take **{real['own_prefills']:.0f} s** per "
            f"question, **{real['own_prefills'] / real['v1']:.2f}** of v1's cost: each recomputed row attends over up to "
            "the whole prompt's cache rows, work that grows with the prompt and that no other request can do for "
            "it. The target of a third of v1 is further away at a real length than on the short synthetic prompts "
            "above." + (f" Recomputing alone sets a floor under it: in v1's committed MuSiQue records ({V1_RECORDS_6K.relative_to(ROOT)}, "
                        f"{at_6k['questions']} questions, {new_tokens_said(at_6k)}, two sweeps sharing the 2 cores), this sweep's "
                        f"prefills recompute **{at_6k['prefills_recomputed']:.2f}** full prefills' worth of chunk token-layers "
                        f"per question (the full prefill's own 1.00 included; each recomputed row attends over the rows "
                        f"before it, as in a full prefill), which at the full prefill's own {at_6k['full']:.1f} s there "
                        f"comes to {rows_floor(at_6k):.0f} s: **{rows_floor(at_6k) / at_6k['total']:.2f}** of v1's "
                        f"{at_6k['total']:.0f} s per question in the same records, before any selection, loading or "
                        "decoding. No sharing that keeps every answer exact takes this sweep to a third of v1 at this "
                        "length." if at_6k and "prefills_recomputed" in at_6k else "") + "\n"]


def main():
    args = parse_args()
    if args.rerender is not None:
        rerender(args, "python -m kvf.scripts.bench_scale " + shlex.join(sys.argv[1:]))
        return
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with work_dir(args.workdir, "kvf-bench-scale-") as work:   # a temp one goes however the run ends
        bench_scale(args, work, output_console(140))


def rerender(args, rendered_by: str) -> None:
    """--rerender: the report again from an earlier run's numbers, with the flags that run was given (its
    command), today's --gpu-build and --out."""
    try:
        numbers = json.loads(args.rerender.read_text())
        measured_argv = shlex.split(numbers["command"])[3:]         # after `python -m kvf.scripts.bench_scale`
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"bench_scale: --rerender {args.rerender}: not a bench_scale .json ({e}); pass the .json "
                         "beside a scale.md it wrote") from None
    measured = parse_args([*measured_argv, "--rerender", str(args.rerender)])
    measured.out, measured.gpu_build = args.out, args.gpu_build
    numbers["v1_at_6k"] = v1_split_at_6k(V1_RECORDS_6K)   # arithmetic on committed records: today's, not the json's
    if args.measure_driver:
        numbers["driver"] = measure_driver(synthetic_text(), measured.chunk_tokens, args.neighbours, args.knn_vectors,
                                           args.approx_vectors)
        numbers["driver_measured_by"] = rendered_by
    report(measured, numbers, output_console(140), rendered_by=rendered_by)


def synthetic_text() -> str:
    """The synthetic corpus's passages, one text: what the driver's embedder reads in part 4b."""
    questions = make_synthetic(None, n_questions=16, passages_per_question=4, seed=0)   # in memory, no files
    return "\n".join(passage.text for q in questions for passage in q.contexts)


def bench_scale(args, work: Path, console) -> None:
    data = work / "data"
    if not (data / "questions.jsonl").exists():
        make_synthetic(data, n_questions=args.questions, passages_per_question=args.passages, seed=0)
    corpus = data / "corpus"
    console.print(f"synthetic corpus: {args.questions} questions x {args.passages} passages; work dir {work}")

    def one_build(name, workers):
        shutil.rmtree(work / f"ws-{name}", ignore_errors=True)
        console.print(f"build-cache, {name} ...")
        return timed_build(corpus, work / f"ws-{name}", workers, args.batch)
    build = {name: cached(work, f"build-{workers}", lambda n=name, w=workers: one_build(n, w))
             for name, workers in (("one process", None), ("ray x1", 1), ("ray x2", 2))}
    stores = {name: work / f"ws-{name}" / "kv.zarr" for name in build}
    builds_equal = all(same_store(stores["one process"], stores[n]) for n in ("ray x1", "ray x2"))

    def one_sweep(name, workers):
        console.print(f"kvf run sweep, {name} ...")
        (work / f"sweep-{name}.jsonl").unlink(missing_ok=True)
        return timed_run(data, work / "ws-one process", work / f"sweep-{name}.jsonl", args.sweep_methods,
                         args.sweep_questions, workers)
    sweep = {name: cached(work, f"sweep-{workers}", lambda n=name, w=workers: one_sweep(n, w))
             for name, workers in (("one process", None), ("ray x1", 1), ("ray x2", 2))}
    sweeps_equal = all(answers_of(sweep["one process"]["records"]) == answers_of(sweep[n]["records"])
                       for n in ("ray x1", "ray x2"))

    # every method needs both stored variants (and Cache-Craft's summaries): built before timing, by each code
    if not (work / "ws-share" / "manifest.json").exists():
        console.print("build-cache for the methods sweep (prefix and fusion variants; untimed) ...")
        build_cache(BuildOptions(corpus=corpus, workspace=work / "ws-share", bm25=False, variants=("prefix", "fusion"),
                                 n_neighbours=3, extras_for=("cachecraft",)), QUIET)
    v1 = v1_checkout(work)
    if not (work / "ws-v1" / "manifest.json").exists():
        console.print(f"build-cache for the methods sweep with v1 ({V1_COMMIT}; untimed) ...")
        subprocess.run(kvf("build-cache", str(corpus), "-w", str(work / "ws-v1"), "--variant", "prefix,fusion",
                           "--neighbours", "3", "--cachecraft-meta", "--no-bm25"),
                       env=kvf_env(v1), check=True, capture_output=True, cwd=ROOT)
    sweep_args = methods_sweep_args(data, args.share_questions)
    modes = {  # name: (part key, command, PYTHONPATH)
        f"v1 ({V1_COMMIT}, as filed)": ("v1", sweep_args + ["-w", str(work / "ws-v1")], v1),
        "lone requests (--no-share)": ("lone", sweep_args + ["-w", str(work / "ws-share"), "--no-share"], None),
        "shared work (default)": ("shared", sweep_args + ["-w", str(work / "ws-share")], None),
    }

    def one_share(name, key, cmd_args, python_path):
        console.print(f"methods sweep per question, {name} ...")
        out = work / f"share-{key}.jsonl"
        return watched_sweep(kvf("run", *cmd_args, "-o", str(out)), kvf_env(python_path), out, args.share_questions)
    share = {name: cached(work, f"share-{key}", lambda n=name, k=key, c=cmd, pp=pp: one_share(n, k, c, pp))
             for name, (key, cmd, pp) in modes.items()}
    share_answers = [answers_of(r["records"]) for r in share.values()]
    share_equal = all(a == share_answers[0] for a in share_answers[1:])

    real = real_sweep(work, args.real, args.real_questions, v1, console) if args.real is not None else None
    console.print("the driver's per-chunk costs (embedding, exact and approximate neighbours) ...")
    driver = measure_driver(synthetic_text(), args.chunk_tokens, args.neighbours, args.knn_vectors, args.approx_vectors)
    one = build["one process"]
    numbers = {"build": build, "sweep": {n: {k: v for k, v in r.items() if k != "records"} for n, r in sweep.items()},
               "share": {n: {k: v for k, v in r.items() if k != "records"} for n, r in share.items()},
               "own_prefills_per_question": own_prefill_seconds(share["shared work (default)"]["records"]),
               "v1_at_6k": v1_split_at_6k(V1_RECORDS_6K), "real": real,
               "builds_equal": builds_equal, "sweeps_equal": sweeps_equal, "share_equal": share_equal, "driver": driver,
               "conditions": (f"model SmolLM2-135M-Instruct (embedded GGUF, float32 on CPU), {os.cpu_count()} CPU cores, "
                              f"one torch thread per process; synthetic corpus (kvf.pipeline.data.synthetic, seed 0) of "
                              f"{args.questions} questions x {args.passages} passages = {one['chunks']} chunks, "
                              f"{one['tokens']:,} tokens"),
               "command": "python -m kvf.scripts.bench_scale " + shlex.join(sys.argv[1:])}
    report(args, numbers, console)


def report(args, numbers: dict, console, rendered_by: str | None = None) -> None:
    """Tables on the console; --out, its .json and its plot from the measured numbers (and --gpu-build)."""
    build, sweep, share, real = numbers["build"], numbers["sweep"], numbers["share"], numbers["real"]
    builds_equal, sweeps_equal, share_equal = numbers["builds_equal"], numbers["sweeps_equal"], numbers["share_equal"]
    floor, at_6k = numbers["own_prefills_per_question"], numbers["v1_at_6k"]
    ratios = ",".join(f"{r:g}" for r in SWEEP_RATIOS)
    one = build["one process"]
    measured = {"bytes_per_token": one["bytes"] / one["tokens"], "tokens_per_core_s": one["tokens"] / one["seconds"]}
    gpu_cost = gpu_build_cost(args.gpu_build)
    driver = numbers.get("driver")
    proj = projection(args.corpus_chunks, args.chunk_tokens, args.gpus, measured, gpu_cost, driver)

    build_rows = throughput_rows(build, "chunks_per_s")
    sweep_rows = throughput_rows(sweep, "answers_per_s", "wall_answers_per_s")
    sweep_cols = ["execution", "answers/s (steady)", "answers/s (whole run)", "seconds", "vs ray x1"]
    per_q = {n: r["per_question"] for n, r in share.items()}
    before, lone, shared_s = per_q.values()
    v1_name, _, shared_name = share   # the table's order: v1, lone, shared
    intervals = {n: None if n == v1_name else cost_interval(share[n].get("each"), share[v1_name].get("each"))
                 for n in share}
    real_interval = cost_interval(real.get("shared_each"), real.get("v1_each")) if real else None
    share_rows = [[n, share[n]["questions"], share[n]["answers"], f"{s:.1f}", with_interval(s / before, intervals[n])]
                  for n, s in per_q.items()]
    share_cols = ["code", "questions", "answers", "s/question", "vs v1" + (" [95% CI]" if any(intervals.values()) else "")]
    for title, cols, rows in (("build-cache KV stage", ["execution", "chunks/s", "seconds", "vs ray x1"], build_rows),
                              ("kvf run sweep", sweep_cols, sweep_rows),
                              ("methods sweep per question", share_cols, share_rows)):
        console.print(table(title, cols, rows))
    console.print(f"Ray builds equal the one-process build (keys and bytes): {builds_equal}; "
                  f"sweep answers equal: {sweeps_equal}; v1, lone and shared answers equal: {share_equal}; "
                  f"per-question cost, shared / v1: {shared_s / before:.2f}, shared / lone: {shared_s / lone:.2f}; "
                  f"distinct prefills' own layer loops / v1: {floor / before:.2f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(build, sweep, share, real, floor, args.out.with_suffix(".png"), (intervals[shared_name], real_interval))
    command, conditions = numbers["command"], numbers["conditions"]
    made_by = (f"Made by `{command.strip()}` at commit {git_commit() or 'unknown'}." if rendered_by is None else
               f"Made by `{rendered_by}` at commit {git_commit() or 'unknown'}, from the numbers that `{command.strip()}` "
               "measured (scale.json; expected.yaml says when and at which commits).")
    md = ["# Scale-out: Ray workers and shared sweep work\n",
          f"{made_by}  \nConditions: {conditions}.\n",
          "## Build throughput (KV stage, prefix variant)\n",
          markdown_table(["execution", "chunks/s", "seconds", "vs ray x1"], build_rows),
          f"\nRay builds equal the one-process build, same keys and same bytes: **{builds_equal}** "
          f"(checked entry by entry). Ray times include actor start-up (a model load per actor, in parallel); "
          f"the one-process time starts after its model load. Batches of {args.batch} chunks.\n",
          "## Sweep throughput (`kvf run`)\n",
          markdown_table(sweep_cols, sweep_rows),
          f"\n{args.sweep_questions} questions x methods {args.sweep_methods} at ratio 0.15, 8 new tokens. The "
          "steady rate counts the answers written after every worker has finished its first question, over "
          "the time to the last question (what a long sweep sustains); the whole-run rate and seconds include "
          "start-up and every process's model load. `vs ray x1` compares steady rates. Same answers on every "
          f"path: **{sweeps_equal}**.\n",
          "## Per-question cost of the methods sweep: v1, lone requests, shared work\n",
          markdown_table(share_cols, share_rows),
          f"\nThe sweep issue 18 names: v1's methods ({V1_METHODS.replace(',', ', ')}) x ratios "
          f"{ratios.replace(',', ', ')}, --compare-full, 16 new tokens, on the same {args.share_questions} questions, each "
          f"mode its own `kvf run` process (v1 is commit {V1_COMMIT} in a git worktree, on a store it built), "
          f"measured with {args.share_note}. Seconds per question are steady state: from the first "
          f"question's last record to the last question's, over {args.share_questions - 1} questions (start-up, "
          f"model load and the per-method warm-up calls excluded). Shared / v1 = **{shared_s / before:.2f}**" +
          (f" (95% interval {interval_text(intervals[shared_name])}, a bootstrap over "
           "the steady questions, each one's costs resampled together)" if intervals[shared_name] else "") + f", "
          f"shared / lone = **{shared_s / lone:.2f}**; same answers in all three: **{share_equal}**. Sharing does "
          "once per question what lone requests repeat: the full prefill, each variant's query-only pass, the "
          "prefill and decoding of every method that is plain reuse at ratio 0, and decoding (all of a question's "
          "answers in one batch). Both kvf modes also do work that v1 did not: `--compare-full` teacher-forces full "
          "prefill's whole answer over every cache (`answer_kl_full`), with decoding's own logits where an answer is "
          "still full's and one pass for the rest. What it cannot share bounds the saving: each distinct prefill "
          f"recomputes its own tokens over its own cache. Their layer loops alone (timings.recompute, each distinct prefill once, "
          f"the full prefill included) take **{floor:.1f} s** per question, **{floor / before:.2f}** of v1's cost" +
          (", so no exact sharing reaches a third of v1 on this sweep." if floor >= before / 3 else
           f": a third of v1 would leave {before / 3 - floor:.1f} s per question for all the rest (decoding "
           f"{share['shared work (default)']['answers'] // args.share_questions} answers of 16 tokens included; "
           f"here the rest takes {shared_s - floor:.1f} s).") +
          (f" At MuSiQue's 6K tokens the recomputed tokens weigh more still: in v1's committed records "
           f"(results/methods/runs/musique.jsonl.gz, {at_6k['questions']} questions, two sweeps sharing the 2 cores) "
           f"the methods with a ratio knob take {at_6k['selective']:.0f} of {at_6k['total']:.0f} s per question "
           f"to their first token and the full prefill {at_6k['full']:.0f} s; part 5 measures it." if at_6k and real is None
           else "") + "\n",
          *(real_section(real, args.share_note, at_6k, real_interval) if real else []),
          f"## Projection: a {proj['chunks']:,.0f}-chunk store ({args.chunk_tokens} tokens per chunk)\n",
          markdown_table(["model", "what", "value", "from"], projection_rows(proj, measured, gpu_cost, args.gpus) +
                         (driver_rows(proj, driver) if driver else [])),
          "\nThe SmolLM2 rows are measured in this run. " + (
              f"The Llama-3-8B GPU-hours come from build-cache's own cost per entry, measured on an {gpu_cost['gpu']} "
              f"with random weights of Llama-3-8B's shape ({gpu_cost['table']}: {gpu_cost['cost_ms']:.0f} ms per "
              f"{gpu_cost['chunk_tokens']}-token chunk in bfloat16, {gpu_cost_what(gpu_cost)}; one entry alone takes "
              f"{gpu_cost['entry_ms']:.0f} ms, {gpu_cost['prefill_ms']:.0f} ms of it the prefill after S and the rest the "
              "copy to the host and the store's write), taken in proportion to a chunk's tokens. "
              f"A chunk is one short forward pass, far below the GPU's arithmetic rate: the FLOPs estimate would say "
              f"{proj['flops_gpu_hours']:,.1f}. " if gpu_cost else
              "The Llama-3-8B GPU-hours are arithmetic on the stated FLOPs assumptions (no GPU table at "
              f"{args.gpu_build}). ") +
          "The other Llama-3-8B rows are arithmetic on the stated assumptions. The fusion variant doubles bytes "
          f"and compute. {store_or_compute(proj)}\n",
          *([driver_note(proj, driver, numbers.get("driver_measured_by"))] if driver else []),
          f"![throughput and the sweep's cost per question]({args.out.with_suffix('.png').name})\n"]
    write_atomic(args.out, "\n".join(md))
    bounds = {f"{column}_{side}": (interval[i] if interval else None)   # COLUMN_low/_high: what verify checks
              for column, interval in (("shared_over_v1", intervals[shared_name]),
                                       ("real_shared_over_v1", real_interval))
              for i, side in enumerate(("low", "high"))}
    numbers = {**numbers, "shared_over_lone": shared_s / lone, "shared_over_v1": shared_s / before, **bounds,
               "own_prefills_over_v1": floor / before,
               "real_shared_over_v1": real["shared"] / real["v1"] if real else None,
               "real_own_prefills_over_v1": real["own_prefills"] / real["v1"] if real else None,
               "rows_floor_at_6k_over_v1": rows_floor(at_6k) / at_6k["total"] if at_6k else None, "projection": proj,
               **({"rendered_by": rendered_by} if rendered_by else {})}
    write_atomic(args.out.with_suffix(".json"), json.dumps(numbers, indent=1))
    console.print(f"wrote {args.out}, {args.out.with_suffix('.json').name}, {args.out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
