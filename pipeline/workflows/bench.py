"""`kvf bench`: TTFT of every method vs full prefill, side by side in one process.

For each context length: build a prompt of k chunks (+ S and a question), store the chunks' KVs
in a fresh on-disk store, then one warm-up request per method and ratio, then `repeats` rounds
that time every method once each (timed_rounds), with the page cache warm, and as many after
dropping the store's pages before each request (cold). Reports median TTFT, its breakdown (load =
time the engine waited for data, read = total read time, select, recompute), and the ratio to
`full`: per round, method TTFT / full's TTFT in the same round, in the same process on the same
prompt; the median over rounds, with their range. Peak memory above the loaded model comes from one
more request per entry after every timing is done (measure_peaks says why). Pipelined loading can be compared with --no-pipeline runs
(`pipeline_hidden` = share of read time hidden behind compute).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvf.errors import KvfError, counted
from kvf.cachestore import open_store
from kvf.pipeline.fusion.controller import choose_ratio, measure_bandwidth, measure_token_layer_seconds
from kvf.pipeline.fusion.engine import FusionEngine
from kvf.pipeline.model.forward import Transformer
from kvf.pipeline.fusion.methods import METHODS, build_method, discover, method_names
from kvf.pipeline.model.prompt import FusedPrompt
from kvf.pipeline.fusion.sources import StoreKVSource
from kvf.pipeline.files import atomic_path, work_dir, write_atomic
from kvf.pipeline.workflows.devices import check_model_fits, compute_dtype, warn_if_slow
from kvf.pipeline.workflows.display import fit_table, progress_bar, wrapped_label
from kvf.pipeline.workflows.workspace import EntryKeys

RANDOM_CONFIGS = {
    # Llama-3-8B shapes (no weights: randomly initialised, for timing only)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, head_dim=128,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
    # a tiny shape, so the random-weights path runs in tests on CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096, head_dim=16),
}


@dataclass
class BenchOptions:
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    chunk_tokens: int = 512
    methods: list[str] = field(default_factory=lambda: ["all"])
    ratios: list[float] = field(default_factory=lambda: [0.05, 0.15, 0.3])
    knobs: dict = field(default_factory=dict)     # method knobs, as on `kvf run`
    repeats: int = 3
    modes: tuple[str, ...] = ("warm", "cold")
    compare_no_pipeline: bool = True
    auto_ratio: bool = True
    auto_method: str = "cacheblend"   # the method timed at the loading controller's ratio
    model: str | None = None
    random_weights: str | None = None
    device: str = "cpu"
    dtype: str = "float16"          # stored KV dtype
    dtype_compute: str | None = None  # compute dtype (default float32 on cpu, bfloat16 on cuda)
    out: Path = Path("results/bench")
    workdir: Path | None = None
    store_url: str | None = None      # where the benchmark stores go (a path or URL; default: workdir)
    versus: str | None = None         # an -m entry every other entry is also paired with, round by round


# ---- model and prompts --------------------------------------------------------------------------
def train_bpe_tokenizer(texts: list[str], vocab_size: int = 2000):
    """A byte-level BPE trained on `texts`: a tokenizer for random weights, where no model files exist."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def load_transformer(opts: BenchOptions):
    """(Transformer, tokenizer or None). Random weights: real shapes, no download, timing only."""
    if opts.random_weights and opts.model:   # one would be timed, the other silently not
        raise KvfError(f"--model {opts.model} and --random-weights {opts.random_weights}: give one (--model times those "
                       "weights, --random-weights a random model of that shape)")
    if opts.random_weights:
        from transformers import AutoModelForCausalLM, LlamaConfig
        if opts.random_weights not in RANDOM_CONFIGS:
            raise KvfError(f"--random-weights {opts.random_weights}: known shapes are {', '.join(RANDOM_CONFIGS)}")
        config = LlamaConfig(**RANDOM_CONFIGS[opts.random_weights], tie_word_embeddings=False)
        dtype = compute_dtype(opts.device, opts.dtype_compute)
        check_model_fits(config, dtype, opts.device, f"--random-weights {opts.random_weights}")
        with torch.device(opts.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
        return Transformer(model), None
    from kvf.pipeline.workflows.weights import load_model
    lm = load_model(opts.model, opts.device, compute_dtype(opts.device, opts.dtype_compute))
    return Transformer(lm.model), lm.tokenizer


def bench_prompt(transformer: Transformer, tokenizer, length: int, chunk_tokens: int) -> FusedPrompt:
    """A prompt of about `length` tokens: S, k chunks of chunk_tokens (the last one shorter), Q."""
    if tokenizer is not None:
        from kvf.pipeline.data.synthetic import make_synthetic
        from kvf.pipeline.model.prompt import make_template
        template = make_template(tokenizer)
        questions = make_synthetic(None, n_questions=max(4, length // 300), passages_per_question=4, seed=7)
        text = " ".join(p.text for q in questions for p in q.contexts)
        pool = tokenizer(text, add_special_tokens=False)["input_ids"]
        prefix, question = list(template.prefix_ids), template.question_ids(questions[0].question)
    else:
        g = torch.Generator().manual_seed(0)
        vocab = transformer.config.vocab_size
        pool = torch.randint(0, vocab, (length * 2,), generator=g).tolist()
        prefix, question = pool[:32], pool[32:64]
    # the model's whole context (--lengths 8192 on an 8K model) leaves one position for the first token
    room = min(length, transformer.max_positions - 1) - len(prefix) - len(question)
    if room < 1:
        raise KvfError(f"--lengths {length}: too short for the system prefix and question "
                       f"({len(prefix) + len(question)} tokens); use lengths of at least {len(prefix) + len(question) + 1}")
    if len(pool) < room:
        raise KvfError(f"--lengths {length}: the benchmark's text holds only {len(pool):,} tokens; use a shorter length")
    chunks = [pool[i: min(i + chunk_tokens, room)] for i in range(0, room, chunk_tokens)]
    return FusedPrompt(prefix, chunks, question)


# ---- memory -------------------------------------------------------------------------------------
class PeakMemory:
    """Peak memory above the level at `start` (CPU: resident set via /proc; CUDA: allocator)."""

    def __init__(self, device: str):
        """On the CPU this fixes glibc's mmap threshold for the rest of the process: make one after timing."""
        self.cuda = device == "cuda"
        if not self.cuda:
            fixed_mmap_threshold()


    @staticmethod
    def _status(field_name: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name):
                    return int(line.split()[1]) * 1024
        return 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            release_free_heap()  # else freed, still-resident heap pages absorb the request unseen
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak resident set (VmHWM) to the current one
            except OSError:
                pass
            self.base = self._status("VmRSS")

    def peak_above_start(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated() - self.base
        return max(0, self._status("VmHWM") - self.base)


def glibc():
    """The C library, for glibc's allocator controls below; None where it cannot be loaded."""
    import ctypes
    import ctypes.util
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None


def fixed_mmap_threshold(threshold: int = 1 << 20) -> None:
    """Make glibc map every allocation >= 1 MiB with mmap and unmap it on free. By default the
    threshold grows after the first big free, later tensors come from a heap that keeps its
    pages, and the resident set stops tracking live memory (peaks would read as 0)."""
    libc = glibc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD; setting it also stops the dynamic adjustment


def release_free_heap() -> None:
    """Give the heap's free pages back to the OS (glibc malloc_trim), so that the resident set is the
    live memory and whatever a request allocates next shows up in it. Requests timed before with the
    allocator's defaults leave up to tens of MB of freed heap resident, which later tensors reuse
    without the resident set growing: peaks read low (every selective method read 1.00x the fused KV)."""
    libc = glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def drop_page_cache(root: str) -> None:
    """Cold start: ask the kernel to drop the store's pages (posix_fadvise DONTNEED)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---- one timed request --------------------------------------------------------------------------
def timed_request(engine: FusionEngine, method, prompt: FusedPrompt, store, keys, pipeline: bool,
                  memory: PeakMemory | None = None, extras: list[dict] | None = None) -> dict:
    """One request's times; with `memory`, also its peak memory up to the first token (peak_bytes)."""
    source = StoreKVSource(store, keys, engine.model.n_layers, pipeline, extras) if method.uses_store else None
    if memory is not None:
        memory.start()
    started = time.perf_counter()
    fused = method.prefill(engine, prompt, source)
    int(torch.argmax(fused.logits))  # the first token exists (and on CUDA, this syncs)
    ttft = time.perf_counter() - started
    peak = memory.peak_above_start() if memory is not None else None
    fused.cache  # noqa: B018 -- runs (and times) the work a method put off until after the first token
    row = {"ttft": ttft, "load": fused.timings["load"], "select": fused.timings["select"],
           "recompute": fused.timings["recompute"], "read": source.read_seconds if source else 0.0,
           "after_first_token": fused.after_first_token_seconds, "recomputed_tokens": fused.recomputed_tokens}
    if peak is not None:
        row["peak_bytes"] = peak
    if source is not None:
        source.close()
    del fused
    return row


def request_in_mode(mode: str, engine: FusionEngine, setup: "LengthSetup", done: Callable[[], None],
                    method, pipeline: bool) -> dict:
    """One timed request; cold mode drops the store's pages first."""
    if mode == "cold":
        drop_page_cache(setup.store.root)
    row = timed_request(engine, method, setup.prompt, setup.store, setup.keys, pipeline, extras=setup.extras)
    done()
    return row


def median_row(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def timed_rounds(run_list: list, repeats: int, timed: Callable[..., dict]) -> list[list[dict]]:
    """`repeats` rounds, each timing every entry of run_list once -> per entry its rows, round by round.

    Rounds, not one method's repeats in a row: a slow spell of the machine (another process, the
    CPU's clock) then falls on every method alike, and the ratios of one round are side by side.
    The order changes round by round (round_orders), so that no method always runs first, or always
    right after the same other one (e.g. after full prefill, which leaves the allocator and caches
    in a different state than a selective prefill does)."""
    reps: list[list[dict]] = [[] for _ in run_list]
    orders = round_orders(len(run_list))
    for round_index in range(repeats):
        for entry in orders[round_index % len(orders)]:
            reps[entry].append(timed(*run_list[entry]))
    return reps


def round_orders(n: int) -> list[list[int]]:
    """A Williams design: orders of 0..n-1 in which every entry comes first equally often and right after
    every other entry equally often (n orders for even n, 2n for odd n: the orders and their mirrors)."""
    base, low, high = [0], 1, n - 1                       # 0, 1, n-1, 2, n-2, ...
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    orders = [[(x + shift) % n for x in base] for shift in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 else orders


def paired_ratio_stats(method_reps: list[dict], full_reps: list[dict] | None) -> dict:
    """TTFT / full TTFT of the same round, per round -> their median and range (nan without full)."""
    if full_reps is None:
        return {"ttft_ratio": float("nan"), "ttft_ratio_min": float("nan"), "ttft_ratio_max": float("nan")}
    ratios = [m["ttft"] / f["ttft"] for m, f in zip(method_reps, full_reps)]
    return {"ttft_ratio": statistics.median(ratios), "ttft_ratio_min": min(ratios), "ttft_ratio_max": max(ratios)}


VERSUS_RESAMPLES = 10000


def paired_interval(ttfts: list[float], versus_ttfts: list[float], resamples: int = VERSUS_RESAMPLES,
                    seed: int = 0) -> tuple[float, float, float]:
    """Per round, an entry's TTFT over another's from the same round -> their geometric mean and its 95%
    percentile-bootstrap interval over rounds (fixed seed). Ratios are averaged as logs: 0.5x and 2x cancel."""
    logs = np.log(np.asarray(ttfts) / np.asarray(versus_ttfts))                      # [rounds]
    picks = np.random.default_rng(seed).integers(0, len(logs), (resamples, len(logs)))  # [resamples, rounds]
    low, high = np.percentile(logs[picks].mean(axis=1), [2.5, 97.5])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


def check_versus(versus: str, planned: list[tuple]) -> None:
    """--versus must name one of the -m entries (with the same knobs)."""
    from kvf.pipeline.workflows.run import parse_method_spec
    try:
        wanted = parse_method_spec(versus)
    except KvfError as e:
        raise KvfError(str(e).replace(f"--method {versus}", f"--versus {versus}", 1)) from None
    is_versus = [m.name == wanted.name and label_of(spec) == wanted.label for m, spec in planned]
    if not any(is_versus):
        entries = ", ".join(sorted({m.name + (f":{label_of(spec)}" if label_of(spec) else "") for m, spec in planned}))
        raise KvfError(f"--versus {versus}: no -m entry is {versus}; name one of the timed entries ({entries})")
    ratios = sorted({m.recompute_ratio for (m, _), mine in zip(planned, is_versus) if mine})
    others = [m for (m, _), mine in zip(planned, is_versus) if not mine and m.name != "full"]
    if not any(paired_with(m, m.recompute_ratio, ratios, not METHODS[wanted.name].ratio_is_knob) for m in others):
        # found after every timing, it wrote an empty paired table over "0 rounds"
        raise KvfError(f"--versus {versus}: no other -m entry is timed at its ratio ({', '.join(f'{r:g}' for r in ratios)}) "
                       f"to pair with it; add one, e.g. -m full,{versus},prophetkv")


def paired_with(method, ratio: float, versus_ratios: list[float], any_ratio: bool) -> bool:
    """Whether an entry is paired with --versus: at the same ratio; at any ratio when --versus has no ratio knob;
    and one without a ratio knob (reuse) with a --versus timed at one ratio only."""
    return any_ratio or ratio in versus_ratios or (not method.ratio_is_knob and len(versus_ratios) == 1)


def add_versus(df: pd.DataFrame, versus: str) -> pd.DataFrame:
    """vs_ratio [vs_low, vs_high]: each pipelined row's TTFT over the --versus entry's at the same length, mode
    and ratio (any ratio, when the --versus method has none of its own), paired round by round
    (paired_interval); nan where there is none."""
    from kvf.pipeline.workflows.run import parse_method_spec
    wanted = parse_method_spec(versus)
    any_ratio = not METHODS[wanted.name].ratio_is_knob
    df = df.copy()
    df["vs_ratio"] = df["vs_low"] = df["vs_high"] = float("nan")
    plain = df.pipeline & ~df.ratio_auto
    is_versus = plain & (df.method == wanted.name) & (df.spec.fillna("") == (wanted.label or ""))
    for (length, mode), group in df[plain].groupby(["length", "mode"]):
        references = group[is_versus[group.index]]
        ratios = sorted(set(references.ratio))
        for i, row in group[~is_versus[group.index] & (group.method != "full")].iterrows():
            if not paired_with(METHODS[row.method], row.ratio, ratios, any_ratio):
                continue
            reference = references if any_ratio or len(ratios) == 1 else references[references.ratio == row.ratio]
            if len(reference):
                stats = paired_interval(row.round_ttfts, reference.iloc[0].round_ttfts)
                df.loc[i, ["vs_ratio", "vs_low", "vs_high"]] = stats
    return df


def plan(opts: BenchOptions) -> list[tuple]:
    """(method, spec) per --method entry and ratio; methods without a ratio knob run once. An entry may set
    knobs for itself alone, as on `kvf run` (kvfuse:propagate=off); spec is the parsed entry (None for the
    full prefill added here). full prefill is always timed, first unless named: it is what every ratio
    divides by."""
    from kvf.pipeline.workflows.run import parse_method_spec
    entries = [n for n in method_names() if METHODS[n].in_all] if "all" in opts.methods else opts.methods
    planned, seen = [], set()
    for entry in entries:
        spec = parse_method_spec(entry)
        for ratio in opts.ratios:
            method = spec.build(ratio, opts.knobs)
            key = (spec.name, str(method.settings()))
            if key not in seen:
                seen.add(key)
                planned.append((method, spec))
    if not any(method.name == "full" for method, _ in planned):  # every ratio in the table is to full prefill
        planned.insert(0, (build_method("full", 1.0), None))
    return planned


def check_planned_model(planned: list[tuple], n_layers: int) -> None:
    """Knobs that depend on the model (cacheblend's check layer), named as their entry set them: out of
    range, a method would time other work."""
    for method, spec in planned:
        with spec.names_its_knobs() if spec else contextlib.nullcontext():
            method.check_model(n_layers)


def label_of(spec) -> str | None:
    """An entry's own knobs as its label (kvfuse:propagate=off -> 'propagate=off'); None for a plain entry."""
    return spec.label if spec else None


def store_chunk_kvs(engine: FusionEngine, prompt: FusedPrompt, store, methods: list) -> list[str]:
    """Offline step: each chunk's prefix-variant KV, with the build-time extras of the methods that
    have a hook, into the store, untimed. Returns their keys. (Timing does not depend on which
    variant's values are stored.)"""
    hooks = {type(m) for m in methods if m.extras_hook is not None}
    keys = EntryKeys("bench", prompt.prefix_ids)
    prefix_kv = engine.prefix_kv(prompt.prefix_ids)
    out = []
    for seg in prompt.chunk_segments:
        key = keys.chunk("prefix", seg)
        if not store.has(key):
            attention = [] if hooks else None
            kv = engine.chunk_kv(seg, prompt.prefix_ids, [prefix_kv], attention_out=attention)
            extras = {}
            for cls in hooks:
                extras.update(cls.extras_hook(attention, [len(prompt.prefix_ids)], list(prompt.prefix_ids)))
            store.put(key, kv.cpu(), attrs={"variant": "prefix"}, extras=extras)
        out.append(key)
    return out


@dataclass
class LengthSetup:
    """One prompt length's prompt, store and what is timed on it."""
    prompt: FusedPrompt
    store: object
    keys: list[str]
    extras: list[dict]
    run_list: list[tuple]            # (method, pipelined loading?) per timed entry
    auto: float | None               # the loading controller's ratio (the last entry), if timed
    fused_kv_bytes: int


def prepare_length(opts: BenchOptions, engine: FusionEngine, methods: list, length: int, prompt: FusedPrompt,
                   workdir: Path, token_layer_seconds: float | None) -> LengthSetup:
    """The prompt of `length` tokens with its chunks' KVs stored (untimed), and the entries to time on it."""
    transformer = engine.model
    location = f"{opts.store_url.rstrip('/')}/store-{length}.zarr" if opts.store_url else str(workdir / f"store-{length}.zarr")
    store = open_store(location, "zarr", create=True,
                       meta={"model": "bench", "dtype": opts.dtype, "layers": transformer.n_layers,
                             "kv_heads": transformer.n_kv_heads, "head_dim": transformer.head_dim})
    keys = store_chunk_kvs(engine, prompt, store, methods)
    extras = store.get_extras_many(keys)  # Cache-Craft's, read before timing like any index
    fused_kv_bytes = transformer.cache_bytes(prompt.n_tokens)
    auto = None
    if opts.auto_ratio:
        layer_bytes, bandwidth = measure_bandwidth(store, keys)
        auto = choose_ratio(layer_bytes, bandwidth, prompt.n_chunk_tokens, token_layer_seconds)
    return LengthSetup(prompt, store, keys, extras, timed_entries(opts, methods, auto), auto, fused_kv_bytes)


def timed_entries(opts: BenchOptions, methods: list, auto: float | None) -> list[tuple]:
    """(method, pipelined loading?) per entry timed at one length: every method, the 0.15 ones again
    without pipelining (--compare-no-pipeline), and --auto-method at the controller's ratio `auto`."""
    run_list = [(m, True) for m in methods]
    if opts.compare_no_pipeline:
        run_list += [(m, False) for m in methods if m.uses_store and m.ratio_is_knob and m.recompute_ratio == 0.15]
    if auto is not None:
        run_list.append((build_method(opts.auto_method, auto, opts.knobs), True))
    return run_list


def time_length(opts: BenchOptions, engine: FusionEngine, setup: LengthSetup, spec_of: dict,
                advance: Callable[[], None]) -> list[list[dict]]:
    """One warm-up request per entry, then the timed rounds of every mode -> per mode, per entry its row."""
    for method, pipeline in setup.run_list:
        timed_request(engine, method, setup.prompt, setup.store, setup.keys, pipeline, extras=setup.extras)
    by_mode = []
    for mode in opts.modes:
        reps = timed_rounds(setup.run_list, opts.repeats, partial(request_in_mode, mode, engine, setup, advance))
        full_reps = next((r for (m, _), r in zip(setup.run_list, reps) if m.name == "full"), None)
        rows = []
        for (method, pipeline), method_reps in zip(setup.run_list, reps):
            row = median_row(method_reps)
            row.update(paired_ratio_stats(method_reps, full_reps))
            row["round_ttfts"] = tuple(r["ttft"] for r in method_reps)  # in round order: pairs are per round
            row.update(length=setup.prompt.n_tokens, method=method.name, spec=spec_of.get(id(method)),
                       ratio=method.settings().get("ratio", float("nan")), mode=mode, pipeline=pipeline,
                       ratio_auto=method is setup.run_list[-1][0] and setup.auto is not None,
                       context_tokens=setup.prompt.n_chunk_tokens, chunk_size=opts.chunk_tokens,
                       fused_kv_bytes=setup.fused_kv_bytes)
            rows.append(row)
        by_mode.append(rows)
    return by_mode


def measure_peaks(engine: FusionEngine, memory: PeakMemory, setup: LengthSetup, advance: Callable[[], None]) -> list[int]:
    """Per entry, the peak memory above the start of one more (untimed) request, store warm.

    Apart from the timings because on the CPU the resident set tracks live memory only once glibc maps
    every allocation >= 1 MiB on its own and unmaps it on free (PeakMemory); every such tensor then
    costs fresh zeroed pages, which made full prefill 15-20% slower at 4K tokens and every ratio to it
    look better than a serving process sees (results/bench_allocator.md). The timed requests run with
    the allocator's defaults; `memory` is made after them."""
    peaks = []
    for method, pipeline in setup.run_list:
        peaks.append(timed_request(engine, method, setup.prompt, setup.store, setup.keys, pipeline, memory,
                                   setup.extras)["peak_bytes"])
        advance()
    return peaks


def measure(opts: BenchOptions, engine: FusionEngine, prompts: dict[int, FusedPrompt], planned: list, workdir: Path,
            console: Console) -> list[dict]:
    """Every length's timed rounds, then one request per entry for peak memory -> one row per timing."""
    methods = [method for method, _ in planned]
    spec_of = {id(method): label_of(spec) for method, spec in planned}   # an entry's own knobs, for its label
    model_bytes = sum(p.numel() * p.element_size() for p in engine.model.hf_model.parameters())
    token_layer_seconds = measure_token_layer_seconds(engine.model) if opts.auto_ratio else None
    timed: list[tuple[LengthSetup, list[list[dict]]]] = []
    # how many entries each length times (the same at every length; any auto ratio counts one)
    entries = len(timed_entries(opts, methods, 0.15 if opts.auto_ratio else None))
    rounds = len(opts.modes) * opts.repeats
    # said up front: the defaults time hundreds of requests up to 8K tokens, hours on a CPU
    console.print(f"kvf bench: {counted(entries, 'entry', 'entries')} x {counted(len(opts.lengths), 'length')} (up to "
                  f"{max(opts.lengths):,} tokens) x {counted(opts.repeats, 'round')} x {counted(len(opts.modes), 'store state')} "
                  f"({' and '.join(opts.modes)}) = {counted(entries * len(opts.lengths) * rounds, 'timed request')}, "
                  "plus a warm-up and a memory request per entry; narrow it with -m, -r, --lengths or --rounds",
                  highlight=False, markup=False)
    with progress_bar(console) as progress:
        task = progress.add_task("benchmarking: timed requests, then one per entry for peak memory",
                                 total=entries * len(opts.lengths) * (rounds + 1))
        advance = partial(progress.advance, task)
        for length in opts.lengths:
            setup = prepare_length(opts, engine, methods, length, prompts[length], workdir, token_layer_seconds)
            timed.append((setup, time_length(opts, engine, setup, spec_of, advance)))
        rows = []
        memory = PeakMemory(opts.device)  # after every timing: its setting stays for the rest of the process
        for setup, by_mode in timed:
            peaks = measure_peaks(engine, memory, setup, advance)
            for mode_rows in by_mode:
                rows += [dict(row, peak_bytes=peak, model_bytes=model_bytes) for row, peak in zip(mode_rows, peaks)]
    return rows


def check_lengths(lengths: list[int], max_positions: int) -> None:
    """Before any work: a length past the model's positions was cut to fit without a word (the table
    then said 4,095 tokens for --lengths 20000). The model's own length (8192 on an 8K model) is its
    whole context: timed at one token less, room for the first token, as the table shows."""
    for length in lengths:
        if length > max_positions:
            raise KvfError(f"--lengths {length}: the model holds {max_positions:,} positions; use lengths up to "
                           f"{max_positions:,}")


def bench(opts: BenchOptions, console: Console) -> pd.DataFrame:
    planned = plan(opts)
    warn_if_slow(opts.device, compute_dtype(opts.device, opts.dtype_compute))
    if opts.versus:
        check_versus(opts.versus, planned)
    transformer, tokenizer = load_transformer(opts)
    check_lengths(opts.lengths, transformer.max_positions)
    # made before the plan is said: a length too short for S and Q is refused first
    prompts = {length: bench_prompt(transformer, tokenizer, length, opts.chunk_tokens) for length in opts.lengths}
    check_planned_model(planned, transformer.n_layers)
    if opts.auto_ratio:
        build_method(opts.auto_method, 0.15, opts.knobs).check_model(transformer.n_layers)
    with work_dir(opts.workdir, "kvf-bench-") as workdir:   # the stores go when the benchmark ends
        rows = measure(opts, FusionEngine(transformer), prompts, planned, workdir, console)
    df = add_ratios(pd.DataFrame(rows))
    return add_versus(df, opts.versus) if opts.versus else df


TIME_COLUMNS = ("ttft", "load", "read", "select", "recompute", "after_first_token")


def add_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Hidden load share, memory check, times in ms (ttft_ratio comes from the rounds: paired_ratio_stats)."""
    # share of the store's read time that compute hid; clamped to [0, 1]: without pipelining the
    # wait is the read plus a little bookkeeping, which would read as a tiny negative share
    df["load_hidden"] = [min(1.0, max(0.0, 1 - row.load / row.read)) if row.read > 0 else float("nan")
                         for _, row in df.iterrows()]
    df["peak_over_kv"] = df.peak_bytes / df.fused_kv_bytes
    for column in TIME_COLUMNS:
        df[f"{column}_ms"] = 1000 * df[column]
    df["label"] = [method_label(row) for _, row in df.iterrows()]
    return df.drop(columns=list(TIME_COLUMNS))


def method_label(row) -> str:
    """What a row timed: the method [its entry's own knobs], its ratio when it has one, and (auto) for
    the controller's pick."""
    spec = row.get("spec")
    name = f"{row.method} [{spec}]" if isinstance(spec, str) and spec else row.method
    if row.ratio_auto:
        return f"{name} (auto r={row.ratio:.2f})"
    return name if ratio_fixed(row.method) or row.ratio != row.ratio else f"{name}@{row.ratio:g}"


def ratio_fixed(method: str) -> bool:
    """Whether the method ignores --ratio (full, reuse, pcw, ...): its rows carry no ratio in their label,
    and the length plot draws them at every ratio."""
    methods = discover()
    return method in methods and not methods[method].ratio_is_knob


def pipeline_hidden_share(df: pd.DataFrame) -> pd.DataFrame:
    """Per method at 0.15: load time with pipelining vs without (same length and mode)."""
    on = df[df.pipeline & (df.ratio == 0.15) & ~df.ratio_auto].set_index(["length", "mode", "method"])
    off = df[~df.pipeline].set_index(["length", "mode", "method"])
    joined = on[["load_ms", "read_ms", "recompute_ms"]].join(
        off[["load_ms"]].rename(columns={"load_ms": "load_no_pipeline_ms"}), how="inner")
    hidden = 1 - joined.load_ms / joined.load_no_pipeline_ms.where(joined.load_no_pipeline_ms > 0)
    joined["hidden_fraction"] = hidden.clip(0.0, 1.0)
    return joined.reset_index()


MD_COLUMNS = ["length", "mode", "label", "pipeline", "ttft_ms", "ttft_ratio", "ttft_ratio_range", "load_ms", "read_ms", "select_ms",
              "recompute_ms", "after_first_token_ms", "load_hidden", "peak_over_kv"]
FORMATS = {"ttft_ms": "{:.1f}", "load_ms": "{:.2f}", "read_ms": "{:.2f}", "select_ms": "{:.2f}",
           "recompute_ms": "{:.1f}", "after_first_token_ms": "{:.1f}", "ttft_ratio": "{:.3f}", "load_hidden": "{:.2f}", "peak_over_kv": "{:.2f}"}


def write_results(df: pd.DataFrame, out: Path, device_label: str, command: str = "kvf bench",
                  repeats: int | None = None, versus: str | None = None) -> list[Path]:
    from kvf.pipeline.workflows.provenance import git_commit
    out.mkdir(parents=True, exist_ok=True)
    csv, rounds_csv, md, png = out / "ttft.csv", out / "rounds.csv", out / "ttft.md", out / "ttft_vs_context.png"
    write_atomic(csv, df.drop(columns=["round_ttfts"], errors="ignore").to_csv(index=False))
    write_atomic(rounds_csv, round_rows(df).to_csv(index=False))
    lines = [f"# TTFT vs full prefill ({device_label})", "",
             f"Made by `{command}` at commit {git_commit() or 'unknown'}"
             + (f"; after one warm-up request per row, {counted(repeats, 'round')} that time{'s' if repeats == 1 else ''} "
                "every row once each (in a balanced order), times being medians over the rounds" if repeats else "") + ". "
             "All times in ms. `ttft_ratio` = the median over rounds of method TTFT / full TTFT in the same round "
             "(same process, same prompt); `ttft_ratio_range` = the lowest and highest of those per-round ratios, "
             "how much the machine's timing moved. "
             "`load_ms` = time waiting for the store, `read_ms` = total read time, `load_hidden` = 1 - load/read "
             "(the share of reading hidden behind compute, clamped to [0, 1]). `after_first_token_ms` = work a "
             "method puts off until after the first token, which decoding pays and TTFT leaves out (kvfuse's shift). "
             "`peak_over_kv` = peak memory above "
             "the loaded model / fused KV size, from one more request per row after all timings (on the CPU the "
             "setting that makes the resident set track live memory slows big allocations, so timed requests run "
             "without it). `(auto r=...)` rows ran at the loading controller's ratio "
             "(`kvf run --ratio auto`).", "",
             "| " + " | ".join(MD_COLUMNS) + " |", "|" + "---|" * len(MD_COLUMNS)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(ratio_range(row) if c == "ttft_ratio_range" else _fmt(row[c], FORMATS.get(c))
                                       for c in MD_COLUMNS) + " |")
    hidden = pipeline_hidden_share(df)
    if len(hidden):
        lines += ["", "## Pipelined loading (ratio 0.15)", "",
                  "| length | mode | method | load ms (pipelined) | load ms (no pipeline) | hidden fraction |",
                  "|---|---|---|---|---|---|"]
        for _, r in hidden.iterrows():
            lines.append(f"| {r.length} | {r['mode']} | {r.method} | {r.load_ms:.2f} | {r.load_no_pipeline_ms:.2f} | "
                         f"{_fmt(r.hidden_fraction, '{:.2f}')} |")
    if "vs_ratio" in df:
        lines += versus_lines(df, versus)
    write_atomic(md, "\n".join(lines) + "\n")
    plot_ratio_vs_length(df, png, device_label)
    if "vs_ratio" not in df or df.vs_ratio.isna().all():
        return [csv, rounds_csv, md, png]
    paired_png = out / "ttft_paired.png"
    plot_paired(df, paired_png, versus, device_label)
    return [csv, rounds_csv, md, png, paired_png]


def replot(out: Path) -> list[Path]:
    """The plots of a bench folder drawn again from its ttft.csv, rounds.csv and ttft.md (device label, --versus),
    with no timing: for a plotting change to reach committed benches."""
    df = pd.read_csv(out / "ttft.csv")
    df["ratio_auto"] = df.ratio_auto.astype(bool)   # pandas reads a column of True/False as bool, of blanks as float
    df["pipeline"] = df.pipeline.astype(bool)
    rounds = pd.read_csv(out / "rounds.csv").groupby(["length", "mode", "label", "pipeline"]).ttft_ms.apply(list)
    df["round_ttfts"] = [[t / 1000 for t in rounds.get((r.length, r["mode"], r.label, r.pipeline), [])]
                         for _, r in df.iterrows()]
    md = (out / "ttft.md").read_text().splitlines()
    device_label = md[0].removeprefix("# TTFT vs full prefill (").removesuffix(")")
    paths = [out / "ttft_vs_context.png"]
    plot_ratio_vs_length(df, paths[0], device_label)
    versus = next((line.removeprefix("## Paired with ").removesuffix(", round by round") for line in md
                   if line.startswith("## Paired with ")), None)
    if versus and "vs_ratio" in df and df.vs_ratio.notna().any():
        paths.append(out / "ttft_paired.png")
        plot_paired(df, paths[1], versus, device_label)
    return paths


def round_rows(df: pd.DataFrame) -> pd.DataFrame:
    """One row per timed request: length, mode, label, pipeline, round (0-based, in time order per entry), ttft_ms."""
    keys = ["length", "mode", "label", "pipeline"]
    rows = [dict(zip(keys, (row[k] for k in keys)), round=i, ttft_ms=1000 * t)
            for _, row in df.iterrows() for i, t in enumerate(row.get("round_ttfts") or ())]
    return pd.DataFrame(rows, columns=keys + ["round", "ttft_ms"])


def versus_lines(df: pd.DataFrame, versus: str | None) -> list[str]:
    """The md section pairing every entry with --versus round by round."""
    paired = df[df.vs_ratio.notna()]
    rounds = len(paired.iloc[0].round_ttfts) if len(paired) else 0
    lines = ["", f"## Paired with {versus}, round by round", "",
             f"TTFT / {versus}'s TTFT in the same round: the geometric mean over the {rounds} rounds and its 95% "
             f"bootstrap interval over rounds ({VERSUS_RESAMPLES:,} resamples). An interval that contains 1 does not "
             "tell the two apart on this machine.", "",
             f"| length | mode | label | TTFT / {versus} | 95% interval | apart? |", "|---|---|---|---|---|---|"]
    for _, r in paired.iterrows():
        verdict = "slower" if r.vs_low > 1 else "faster" if r.vs_high < 1 else "no"
        lines.append(f"| {r.length} | {r['mode']} | {r.label} | {r.vs_ratio:.3f} | [{r.vs_low:.3f}, {r.vs_high:.3f}] | {verdict} |")
    return lines


def ratio_range(row) -> str:
    """The per-round TTFT ratios' lowest-highest, or - where there is no full row to pair with."""
    low, high = row.get("ttft_ratio_min", float("nan")), row.get("ttft_ratio_max", float("nan"))
    return "-" if low != low else f"{low:.3f}-{high:.3f}"


def _fmt(value, spec: str | None = None) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return spec.format(value) if spec else f"{value:.4g}"
    return str(value)


def plotted_ratios(rows: pd.DataFrame) -> list[float]:
    """The ratios the length plot draws: 0.15 alone when it was timed (three ratios of every method would crowd
    it), else every ratio timed (`-r 0.3` drew an empty plot)."""
    ratios = sorted(rows.ratio.dropna().unique())
    return [0.15] if 0.15 in ratios else ratios


def plot_ratio_vs_length(df: pd.DataFrame, path: Path, device_label: str) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator
    fig = Figure(figsize=(8.5, 4.8))
    ax = fig.subplots()
    warm = df[(df["mode"] == "warm") & df.pipeline]
    full = warm[warm.method == "full"].sort_values("length")
    ax.axhline(1.0, linestyle="--", color="black", label="full prefill")
    others = warm[~warm.ratio_auto & (warm.method != "full")]
    # bool, not object: with no other rows (-m full) an empty object mask selects columns, not rows
    no_ratio = others.method.map(ratio_fixed).astype(bool)
    fixed, selective = others[no_ratio], others[~no_ratio]
    shown = plotted_ratios(selective)
    selective = selective[selective.ratio.isin(shown)]
    markers = iter(["s", "D", "^", "v", "P", "X"])
    for label, g in fixed.groupby("label"):
        g = g.sort_values("length")
        ax.plot(g.length, g.ttft_ratio, marker=next(markers, "o"), linestyle=":", label=label)
    for label, g in selective.groupby("label"):  # bars: the per-round ratios' range
        g = g.sort_values("length")
        spread = [g.ttft_ratio - g.ttft_ratio_min, g.ttft_ratio_max - g.ttft_ratio] if "ttft_ratio_min" in g else None
        ax.errorbar(g.length, g.ttft_ratio, yerr=spread, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    lengths = sorted(warm.length.unique())
    ax.set_xticks(lengths, [f"{int(n):,}" for n in lengths])   # the lengths measured, as numbers (not 2^9)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_ylim(bottom=0)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT / full prefill TTFT")
    has_spread = "ttft_ratio_min" in warm and bool((warm.ttft_ratio_max > warm.ttft_ratio_min).any())  # one round: none
    absolute = ", ".join(f"{int(r.length)}: {r.ttft_ms / 1000:.2f} s" for _, r in full.iterrows())
    at = f"recompute ratio {shown[0]:g}, " if len(shown) == 1 else ""
    ax.set_title(f"TTFT ratio vs context length, {at}store warm ({device_label})\n"
                 f"full prefill TTFT: {absolute}" + ("; bars: range over rounds" if has_spread else ""), fontsize=10)
    ax.grid(alpha=0.3)
    save_with_legend_outside(fig, ax, path)


def plot_paired(df: pd.DataFrame, path: Path, versus: str, device_label: str) -> None:
    """Each entry's TTFT over --versus's in the same round (geometric mean, 95% bootstrap bars), against length:
    the differences of a few percent that the ratio-to-full plot cannot show apart."""
    from matplotlib.figure import Figure
    paired = df[df.vs_ratio.notna()]
    labels = sorted(paired.label.unique())
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    ax.axhline(1.0, linestyle="--", color="black", label=versus)
    lengths = sorted(paired.length.unique())
    for i, label in enumerate(labels):
        g = paired[paired.label == label].sort_values("length")
        x = [lengths.index(n) + 0.12 * (i - (len(labels) - 1) / 2) for n in g.length]  # side by side per length
        ax.errorbar(x, g.vs_ratio, yerr=[g.vs_ratio - g.vs_low, g.vs_high - g.vs_ratio], marker="o",
                    linestyle="none", capsize=4, label=label)
    ax.set_xticks(range(len(lengths)), [f"{int(n)}" for n in lengths])
    ax.set_xlim(-0.5, len(lengths) - 0.5)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel(f"TTFT / {versus} TTFT, same round")
    rounds = len(paired.iloc[0].round_ttfts)
    ax.set_title(f"TTFT paired with {versus}, round by round ({device_label})\n"
                 f"geometric mean over {rounds} rounds; bars: 95% bootstrap interval", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    save_with_legend_outside(fig, ax, path)


LEGEND_RIGHT_CHARS = 40   # longer legend labels go under the axes
LEGEND_LINE_CHARS = 80    # under the axes, a label is broken after a knob's ":" into lines no longer than this


def save_with_legend_outside(fig, ax, path: Path) -> None:
    """The bench plots' legend outside the data, then the PNG written atomically: to the right, or under the axes
    when a label is long (an entry with knobs), where it would squeeze the axes and push the title off the figure;
    there each label is broken into lines that fit the figure."""
    handles, labels = ax.get_legend_handles_labels()
    if max(map(len, labels), default=0) > LEGEND_RIGHT_CHARS:
        ax.legend(handles, [wrapped_label(label, LEGEND_LINE_CHARS) for label in labels], fontsize=8, loc="upper center",
                  bbox_to_anchor=(0.5, -0.16), frameon=False)
    else:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=130, format="png")


# the terminal table's columns: header -> the cell of one row (ttft.md has every column)
BENCH_CELLS = {
    "tokens": lambda r: str(r.length),
    "mode": lambda r: r["mode"],
    "method": lambda r: escape(r.label),                                 # escaped: "[knob=value]" is not markup
    "TTFT ms": lambda r: f"{r.ttft_ms:.1f}",
    "x full": lambda r: _fmt(r.ttft_ratio, "{:.3f}"),
    "load ms": lambda r: f"{r.load_ms:.2f}",
    "read ms": lambda r: f"{r.read_ms:.2f}",
    "hidden": lambda r: _fmt(r.load_hidden, "{:.2f}"),
    "peak/KV": lambda r: f"{r.peak_over_kv:.2f}",
    "x versus [95%]": lambda r: "-" if r.vs_ratio != r.vs_ratio else escape(f"{r.vs_ratio:.3f} [{r.vs_low:.3f}, {r.vs_high:.3f}]"),
}
BENCH_DROPPABLE = ("peak/KV", "read ms", "hidden", "load ms")    # left out first when a terminal is narrow


def summary_table(df: pd.DataFrame, title: str, width: int = 10_000) -> Table:
    """The pipelined rows as a rich Table no wider than `width` (columns left out as BENCH_DROPPABLE says)."""
    columns = [c for c in BENCH_CELLS if c != "x versus [95%]" or "vs_ratio" in df]

    def build(shown: list[str]) -> Table:
        table = Table(title=title)
        for col in shown:
            table.add_column(col, justify="right")
        for _, r in df[df.pipeline].iterrows():
            table.add_row(*(BENCH_CELLS[col](r) for col in shown))
        return table
    return fit_table(build, columns, BENCH_DROPPABLE, width, "ttft.md")
