"""What one chunk's entry costs to build on a GPU, through build-cache's own path (EntryBuilder).

    python -m kvf.scripts.bench_gpu_build [--random-weights llama3-8b] [--chunks 32] [--chunk-tokens 256]

For results/scale.md's projection of a 1M-chunk store, which needs a measured per-chunk cost. In one
process, with random weights of a real shape on CUDA (no download) and random 256-token chunks after S
(a byte-level BPE trained on synthetic text gives S's template), for each compute dtype
(`build-cache --compute-dtype`): one EntryBuilder writing float16 entries into a fresh local zarr
store; one chunk untimed, then --chunks chunks timed one by one with the GPU synchronised:
- the whole entry (prefill, copy to the host, encode, crc32, write and commit);
- the prefill alone (engine.chunk_kv on the same chunks, not stored), to split the two;
- entries built in a row, --chunks at a time, with the store's writes inline (each entry stored before the
  next chunk is computed) and behind (EntryBuilder.writing_behind: stored on a background thread while the
  next chunk is computed; build-cache's way on a GPU), in alternation, ROUNDS times each: ms per entry.
  The same chunks built both ways into two more stores must give the same keys and bytes (checked);
- for one more chunk, how often the whole entry makes the host wait for the GPU (torch's sync debug
  mode warns at each wait), and the GPU's own kernel time of its prefill (the profiler's device time):
  a prefill whose wall time is far above its kernel time is bound by the host launching kernels.
Needs a CUDA GPU (CI has none); --device cpu --random-weights tiny tries the script itself. Writes --out
(markdown), its table beside it as .csv (what results/scale.md's projection reads) and its numbers as .json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvf.cachestore import open_store
from kvf.errors import KvfError
from kvf.pipeline.files import work_dir, write_atomic
from kvf.pipeline.fusion.engine import FusionEngine
from kvf.pipeline.retrieval.chunking import Chunk
from kvf.pipeline.workflows.bench import RANDOM_CONFIGS, BenchOptions, load_transformer, train_bpe_tokenizer
from kvf.pipeline.workflows.build import EntryBuilder, store_meta
from kvf.pipeline.workflows.devices import check_device, compute_dtype
from kvf.pipeline.workflows.provenance import git_commit

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class InMemoryModelRef:
    """What EntryBuilder reads of a ModelRef, for weights that live only in this process."""
    name: str
    fingerprint: str
    tokenizer: object
    config: object


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-weights", default="llama3-8b", help="a shape kvf bench knows (llama3-8b, tiny)")
    p.add_argument("--chunks", type=int, default=32, help="chunks timed per compute dtype")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--compute-dtypes", default="bfloat16,float32")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "gpu" / "build.md")
    return p.parse_args(argv)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def host_waits(fn) -> int:
    """How many times fn makes the host wait for the GPU: torch's sync debug mode warns at each wait
    (a blocking copy between host and device, a CPU index handed to a kernel, .item(), ...)."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def kernel_ms(fn) -> float:
    """Milliseconds the GPU spends in kernels during fn (the profiler's self device time, summed)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1000


ROUNDS = 3   # rounds of entries built in a row, per way of writing


def random_chunks(n: int, tokens: int, vocab: int, seed: int = 0) -> list[Chunk]:
    g = torch.Generator().manual_seed(seed)
    return [Chunk(f"bench-{i:05d}", "bench", "", "", torch.randint(0, vocab, (tokens,), generator=g).tolist(), i)
            for i in range(n)]


def measure_dtype(args, dtype_name: str, tokenizer, workdir: Path) -> dict:
    """Per-chunk seconds of the whole entry and of the prefill alone, for one compute dtype."""
    transformer, _ = load_transformer(BenchOptions(random_weights=args.random_weights, device=args.device,
                                                   dtype_compute=dtype_name))
    engine = FusionEngine(transformer)
    model_ref = InMemoryModelRef(args.random_weights, f"random-{args.random_weights}", tokenizer, transformer.config)
    store = open_store(str(workdir / f"{dtype_name}.zarr"), "zarr", create=True, meta=store_meta(model_ref, "float16"))
    builder = EntryBuilder(model_ref, store, args.device, engine=engine)
    chunks = random_chunks(args.chunks + 2, args.chunk_tokens, transformer.config.vocab_size)
    builder.compute("prefix", chunks[0], None, {})          # warm-up: S stored, kernels chosen
    timed_chunks, extra = chunks[1:-1], chunks[-1]
    entry = [timed(lambda c=c: builder.compute("prefix", c, None, {}), args.device) for c in timed_chunks]
    context = (list(builder.template.prefix_ids), [builder.system_kv()])
    prefill = [timed(lambda c=c: engine.chunk_kv(builder.template.chunk_segment(c.token_ids), *context), args.device)
               for c in timed_chunks]
    entry_bytes = builder.bytes_written / builder.entries_written
    numbers = {"entry_ms": 1000 * statistics.median(entry), "prefill_ms": 1000 * statistics.median(prefill),
               "entry_mb": entry_bytes / 1e6, "chunks": args.chunks}
    in_a_row = {"inline": [], "behind": []}      # ms per entry, one value per round
    for round_ in range(ROUNDS):
        for mode, behind in (("inline", False), ("behind", True)):
            fresh = random_chunks(args.chunks, args.chunk_tokens, transformer.config.vocab_size, seed=1 + 2 * round_ + behind)
            seconds = timed(lambda: build_in_a_row(builder, fresh, behind), args.device)
            in_a_row[mode].append(1000 * seconds / args.chunks)
    numbers.update({f"row_{mode}_ms": statistics.median(ms) for mode, ms in in_a_row.items()})
    check_same_entries(model_ref, engine, args, chunks[1:5], workdir / f"{dtype_name}-check")
    if args.device.startswith("cuda"):
        numbers["host_waits"] = host_waits(lambda: builder.compute("prefix", extra, None, {}))
        numbers["kernel_ms"] = kernel_ms(lambda: engine.chunk_kv(builder.template.chunk_segment(extra.token_ids),
                                                                 *context))
    return numbers


def check_same_entries(model_ref, engine, args, chunks: list[Chunk], where: Path) -> None:
    """The chunks built with writes inline and with writes behind, each into a fresh store: the same keys and
    the same stored bytes, or KvfError."""
    stored = []
    for behind in (False, True):
        store = open_store(str(where / f"behind-{behind}.zarr"), "zarr", create=True, meta=store_meta(model_ref, "float16"))
        build_in_a_row(EntryBuilder(model_ref, store, args.device, engine=engine), chunks, behind)
        stored.append({key: store.get(key).numpy().tobytes() for key in store.keys()})
    if stored[0] != stored[1]:
        raise KvfError("entries built with writes behind differ from those written inline")


def build_in_a_row(builder: EntryBuilder, chunks: list[Chunk], behind: bool) -> None:
    """stage_kv's loop: every chunk's entry computed and stored, writes inline or behind."""
    with builder.writing_behind(behind):
        for chunk in chunks:
            builder.compute("prefix", chunk, None, {})


def table_rows(numbers: dict, chunk_tokens: int) -> list[dict]:
    """One row per compute dtype: what build.csv holds and the markdown shows."""
    return [{"compute_dtype": name, "chunk_tokens": chunk_tokens, "entry_ms": n["entry_ms"], "prefill_ms": n["prefill_ms"],
             "rest_ms": n["entry_ms"] - n["prefill_ms"], "chunks_per_s": 1000 / n["entry_ms"],
             "tokens_per_s": chunk_tokens * 1000 / n["entry_ms"], "entry_mb": n["entry_mb"],
             "host_waits": n.get("host_waits"), "kernel_ms": n.get("kernel_ms"),
             "row_inline_ms": n["row_inline_ms"], "row_behind_ms": n["row_behind_ms"],
             "behind_over_inline": n["row_behind_ms"] / n["row_inline_ms"],
             "model": numbers["model"], "device": numbers["device"]} for name, n in numbers["dtypes"].items()]


def shown(value, spec: str) -> str:
    """A number in a table cell, or a dash where it was not measured (on a CPU)."""
    return "–" if value is None else format(value, spec)


def write_report(args, numbers: dict, commit: str | None) -> None:
    import pandas as pd
    command = ("python -m kvf.scripts.bench_gpu_build " +
               f"--random-weights {args.random_weights} --chunks {args.chunks} --chunk-tokens {args.chunk_tokens}")
    rows = table_rows(numbers, args.chunk_tokens)
    lines = [f"# One chunk's entry built on a GPU ({numbers['device']})", "",
             f"Made by `{command}` at commit {commit or 'unknown'}: {args.random_weights} shape with random weights, "
             f"{args.chunk_tokens}-token chunks after S (prefix variant), float16 entries written to a fresh local zarr "
             f"store through EntryBuilder (build-cache's own path); medians over {args.chunks} chunks after one "
             "untimed, the GPU synchronised around each. Host waits: the times one more entry made the host wait "
             "for the GPU (torch's sync debug mode). GPU kernel ms: the GPU's time in kernels during one more "
             "prefill (the profiler); a prefill far slower than that is bound by the host launching kernels. In a row: "
             f"{args.chunks} entries built one after another as build-cache builds them, the store's writes inline or "
             f"behind (on a background thread while the next chunk is computed), alternating, median of {ROUNDS} rounds "
             "each.", "",
             "| compute dtype | ms per entry (all) | ms prefill alone | ms the rest (copy, encode, write) | chunks/s | "
             "tokens/s | MB per entry | host waits per entry | GPU kernel ms per prefill | ms per entry in a row, "
             "writes inline | in a row, writes behind | behind / inline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['compute_dtype']} | {r['entry_ms']:.1f} | {r['prefill_ms']:.1f} | {r['rest_ms']:.1f} | "
              f"{r['chunks_per_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['entry_mb']:.1f} | {shown(r['host_waits'], 'd')} | "
              f"{shown(r['kernel_ms'], '.1f')} | {r['row_inline_ms']:.1f} | {r['row_behind_ms']:.1f} | "
              f"{r['behind_over_inline']:.2f} |" for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, "\n".join(lines) + "\n")
    write_atomic(args.out.with_suffix(".csv"), pd.DataFrame(rows).to_csv(index=False))
    write_atomic(args.out.with_suffix(".json"), json.dumps({**numbers, "command": command, "commit": commit,
                                                            "chunk_tokens": args.chunk_tokens}, indent=1))
    print("\n".join(lines))


def check_args(args) -> None:
    """Every flag, before a model is made: a bad one is one line, not a traceback a minute in."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise KvfError("bench_gpu_build needs a CUDA GPU; run it on a GPU machine (or --device cpu --random-weights tiny)")
    check_device(args.device)
    if args.random_weights not in RANDOM_CONFIGS:
        raise KvfError(f"--random-weights {args.random_weights}: known shapes are {', '.join(RANDOM_CONFIGS)}")
    for flag, value in (("--chunks", args.chunks), ("--chunk-tokens", args.chunk_tokens)):
        if value < 1:
            raise KvfError(f"{flag} {value}: must be >= 1")
    for name in args.compute_dtypes.split(","):
        compute_dtype(args.device, name, "--compute-dtypes")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        from kvf.pipeline.data.synthetic import make_synthetic
        texts = [p.text for q in make_synthetic(None, n_questions=20, passages_per_question=4, seed=7) for p in q.contexts]
        tokenizer = train_bpe_tokenizer(texts)
        with work_dir(None, "kvf-gpu-build-") as tmp:    # GBs of entries: they go when the measuring ends
            dtypes = {}
            for name in args.compute_dtypes.split(","):
                dtypes[name] = measure_dtype(args, name, tokenizer, tmp)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()     # the last model's weights go before the next one is made
    except KvfError as e:
        print(f"kvf: error: {e}", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    write_report(args, {"device": device, "model": args.random_weights, "dtypes": dtypes}, git_commit())
    return 0


if __name__ == "__main__":
    sys.exit(main())
