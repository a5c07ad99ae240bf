"""Where a fused prefill's time goes on a GPU: the store read, the host-to-device copy, or compute.

    python -m kvf.scripts.bench_gpu_load [--random-weights llama3-8b] [--length 16384] [--repeats 3]

In one process, on one prompt (S, 512-token chunks, Q) of a random-weight model of a real shape on CUDA,
with the chunks' float16 KVs in a fresh local zarr store (page cache warm):
- the store's read rate: every layer of every chunk by get_layer (read + crc32), 1 thread and 8;
- the copy of one layer's chunk KVs to the GPU: from pageable and from pinned host memory;
- median TTFT of full prefill, and of reuse and cacheblend@0.15 with the chunk KVs coming from the
  store (StoreKVSource with 1, 2, 4 and 8 reader threads), from CPU memory and from GPU memory. GPU
  memory is the floor: what no store read can beat.
Needs a CUDA GPU (CI has none). Writes --out (markdown) and its numbers beside it as .json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvf.cachestore import open_store
from kvf.errors import KvfError
from kvf.pipeline.files import work_dir, write_atomic
from kvf.pipeline.fusion.engine import FusionEngine
from kvf.pipeline.fusion.methods import get_method
from kvf.pipeline.fusion.sources import InMemoryKV, StoreKVSource
from kvf.pipeline.workflows.bench import BenchOptions, bench_prompt, load_transformer, store_chunk_kvs
from kvf.pipeline.workflows.provenance import git_commit

ROOT = Path(__file__).resolve().parents[1]
READERS = (1, 2, 4, 8)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-weights", default="llama3-8b", help="a shape kvf bench knows (llama3-8b, tiny)")
    p.add_argument("--length", type=int, default=16384, help="prompt tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per setting (median), after one warm-up")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "gpu" / "load.md")
    return p.parse_args(argv)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of fn() after one warm-up, the GPU synchronised around each call."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def first_token(method, engine, prompt, source_factory) -> None:
    source = source_factory()
    fused = method.prefill(engine, prompt, source)
    int(torch.argmax(fused.logits))            # the first token exists
    if hasattr(source, "close"):
        source.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not torch.cuda.is_available():
            raise KvfError("bench_gpu_load needs a CUDA GPU; run it on a GPU machine")
        transformer, _ = load_transformer(BenchOptions(random_weights=args.random_weights, device="cuda"))
    except KvfError as e:
        print(f"kvf: error: {e}", file=sys.stderr)
        return 1
    engine = FusionEngine(transformer)
    prompt = bench_prompt(transformer, None, args.length, 512)
    with work_dir(None, "kvf-gpu-load-") as tmp:   # the store is GBs: it goes when the measuring ends
        store = open_store(str(tmp / "store.zarr"), "zarr", create=True,
                           meta={"model": "bench", "dtype": "float16", "layers": transformer.n_layers,
                                 "kv_heads": transformer.n_kv_heads, "head_dim": transformer.head_dim})
        numbers = measure(args, engine, prompt, store)
    write_report(args, numbers)
    return 0


def measure(args, engine: FusionEngine, prompt, store) -> dict:
    """Store reads, copies to the GPU and TTFT by where the chunk KVs come from."""
    transformer = engine.model
    keys = store_chunk_kvs(engine, prompt, store, [get_method("reuse")])
    layers = range(transformer.n_layers)
    kv_bytes = sum(store.header(k).layer_nbytes for k in keys) * transformer.n_layers
    numbers = {"model": args.random_weights, "tokens": prompt.n_tokens, "chunks": len(keys), "kv_gb": kv_bytes / 1e9,
               "device": torch.cuda.get_device_name()}

    # the store alone: read + crc32 of every layer of every chunk
    sequential = median_seconds(lambda: [store.get_layer(k, layer) for layer in layers for k in keys], args.repeats)
    with ThreadPoolExecutor(8) as pool:
        parallel = median_seconds(lambda: list(pool.map(lambda kl: store.get_layer(*kl),
                                                         [(k, layer) for layer in layers for k in keys])), args.repeats)
    numbers["store_read_gbps"] = {"1 thread": kv_bytes / sequential / 1e9, "8 threads": kv_bytes / parallel / 1e9}

    # one layer's chunks to the GPU, times the layers
    layer0 = [store.get_layer(k, 0) for k in keys]
    pinned = [kv.pin_memory() for kv in layer0]
    numbers["copy_to_gpu_ms"] = {
        "pageable": 1000 * transformer.n_layers * median_seconds(lambda: [kv.to("cuda") for kv in layer0], args.repeats),
        "pinned": 1000 * transformer.n_layers * median_seconds(
            lambda: [kv.to("cuda", non_blocking=True) for kv in pinned], args.repeats)}

    # TTFT by where the chunk KVs come from
    cpu_kvs = [store.get(k) for k in keys]
    gpu_kvs = [kv.to("cuda") for kv in cpu_kvs]
    sources = {f"store, {n} reader{'s' if n > 1 else ''}":
               (lambda n=n: StoreKVSource(store, keys, transformer.n_layers, pipeline=True, readers=n)) for n in READERS}
    sources["CPU memory"] = lambda: InMemoryKV(cpu_kvs)
    sources["GPU memory"] = lambda: InMemoryKV(gpu_kvs)
    full_ms = 1000 * median_seconds(lambda: first_token(get_method("full"), engine, prompt, lambda: None), args.repeats)
    ttft = {}
    for label, method in (("reuse", get_method("reuse")), ("cacheblend@0.15", get_method("cacheblend", 0.15))):
        for where, factory in sources.items():
            ttft[f"{label}|{where}"] = 1000 * median_seconds(lambda: first_token(method, engine, prompt, factory),
                                                            args.repeats)
    numbers["full_ms"], numbers["ttft_ms"] = full_ms, ttft
    return numbers


def write_report(args, numbers: dict) -> None:
    command = "python -m kvf.scripts.bench_gpu_load " + \
        f"--random-weights {args.random_weights} --length {args.length} --repeats {args.repeats}"
    lines = [f"# Where a fused prefill's time goes on a GPU ({numbers['device']})", "",
             f"Made by `{command}` at commit {git_commit() or 'unknown'}: {numbers['model']} shape with random "
             f"weights in bfloat16, one prompt of {numbers['tokens']} tokens ({numbers['chunks']} chunks of 512), "
             f"{numbers['kv_gb']:.2f} GB of float16 chunk KV in a local zarr store with the page cache warm; "
             f"medians of {args.repeats} after one warm-up.", "",
             "| store read (get_layer: read + crc32), all layers of all chunks | GB/s |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in numbers["store_read_gbps"].items()]
    lines += ["", "| copy of all layers' chunk KVs to the GPU | ms |", "|---|---|"]
    lines += [f"| from {k} host memory | {v:.0f} |" for k, v in numbers["copy_to_gpu_ms"].items()]
    lines += ["", f"| method | chunk KVs from | TTFT ms | x full ({numbers['full_ms']:.0f} ms) |",
              "|---|---|---|---|"]
    for key, ms in numbers["ttft_ms"].items():
        name, where = key.split("|")
        lines.append(f"| {name} | {where} | {ms:.0f} | {ms / numbers['full_ms']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, "\n".join(lines) + "\n")
    write_atomic(args.out.with_suffix(".json"), json.dumps(numbers, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
