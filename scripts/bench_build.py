"""Build-cache benchmark: what storing costs on top of the model forward, bytes per token, read time.

    python -m kvf.scripts.bench_build [--questions 30 --passages 4 --chunk-tokens 128 --dtype float16]

On a synthetic corpus (kvf.pipeline.data.synthetic) and the embedded model, in one process:
- KV-stage throughput as build-cache does it (key hashing, store.has, forward, cast, crc32, atomic
  write) next to the bare forward (engine.chunk_kv, nothing stored) on the same chunks. The two
  alternate chunk by chunk, so a noisy neighbour on a shared machine slows both alike.
  Target: storing + hashing add <= 15%.
- bytes per stored token (all files, metadata included) vs layers x 2 x kv_heads x head_dim x
  dtype size. Target: <= 2% overhead.
- read time of one chunk's KV for one layer (store.get_layer, page cache warm), median of many calls.
Prints a rich table and writes results/build_bench.md (and its numbers as results/build_bench.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from rich.table import Table

from kvf.pipeline.files import work_dir, write_atomic
from kvf.pipeline.workflows.provenance import git_commit
from kvf.cachestore.dtypes import itemsize
from kvf.pipeline.data.synthetic import make_synthetic
from kvf.pipeline.workflows.build import EntryBuilder, open_workspace_store
from kvf.pipeline.retrieval.chunking import chunk_documents
from kvf.pipeline.retrieval.corpus import read_corpus
from kvf.pipeline.fusion.engine import FusionEngine
from kvf.pipeline.model.forward import Transformer
from kvf.pipeline.workflows.weights import open_model
from kvf.pipeline.workflows.workspace import Workspace
from kvf.pipeline.workflows.display import output_console

ROOT = Path(__file__).resolve().parent.parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=int, default=30, help="synthetic questions (corpus size)")
    p.add_argument("--passages", type=int, default=4, help="passages per question")
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--max-chunks", type=int, default=None, help="cap the chunks timed (default: all)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--format", default="zarr", choices=["zarr", "hdf5"])
    p.add_argument("--read-calls", type=int, default=600, help="get_layer calls for the read median")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--workdir", type=Path, default=None, help="where the corpus and store go (default: a temp dir)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "build_bench.md")
    return p.parse_args()


class Timed:
    """Wraps one method of an object and sums the seconds spent in it."""

    def __init__(self, obj, name: str):
        self.seconds, self.calls = 0.0, 0
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1
        setattr(obj, name, timed)


def allocated_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with work_dir(args.workdir, "kvf-bench-build-") as work:   # the store is ~23 KB per token: a temp one goes
        bench_build(args, work, output_console(140))


def bench_build(args, work: Path, console) -> None:
    make_synthetic(work / "data", n_questions=args.questions, passages_per_question=args.passages, seed=0)
    model_ref = open_model(None)
    chunks = chunk_documents(read_corpus(work / "data" / "corpus"), model_ref.tokenizer, args.chunk_tokens)
    chunks = chunks[: args.max_chunks] if args.max_chunks else chunks
    n_tokens = sum(len(c.token_ids) for c in chunks)
    console.print(f"{len(chunks)} chunks, {n_tokens:,} tokens (chunk_tokens {args.chunk_tokens}); "
                  f"torch threads {torch.get_num_threads()}; work dir {work}")

    ws = Workspace(work / "ws")
    store = open_workspace_store(ws, model_ref, None, args.format, args.dtype, create=True)
    engine = FusionEngine(Transformer(model_ref.load().model))
    builder = EntryBuilder(model_ref, store, engine=engine)
    template = builder.template
    system_kv = builder.system_kv()  # S: computed and stored once, before timing (as stage_kv does)
    put, has = Timed(store, "put"), Timed(store, "has")

    # warm-up: first calls pay one-time kernel and allocator set-up
    engine.chunk_kv(template.chunk_segment(chunks[0].token_ids), template.prefix_ids, [system_kv])

    forward_s = build_s = hash_s = 0.0
    for i, chunk in enumerate(chunks):
        def plain():
            return engine.chunk_kv(template.chunk_segment(chunk.token_ids), list(template.prefix_ids), [system_kv])

        def build():  # what stage_kv does per chunk: the key and has() in missing(), then compute()
            nonlocal hash_s
            started = time.perf_counter()
            key = builder.key("prefix", chunk, None)
            hash_s += time.perf_counter() - started
            if builder.needs(key):
                builder.compute("prefix", chunk, None, {})
        for step in ((plain, build) if i % 2 == 0 else (build, plain)):  # alternate who goes first
            started = time.perf_counter()
            step()
            elapsed = time.perf_counter() - started
            if step is plain:
                forward_s += elapsed
            else:
                build_s += elapsed
        if (i + 1) % 50 == 0:
            console.print(f"  {i + 1}/{len(chunks)} chunks")

    # bytes per token: every file of the store vs the raw KV payload
    info = store.info()
    config = model_ref.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ideal = layers * 2 * kv_heads * head_dim * itemsize(args.dtype)
    store_root = Path(store.root)
    alloc_per_token = allocated_bytes(store_root) / info["tokens"]

    # read time: one layer of one chunk, page cache warm
    keys = [builder.key("prefix", c, None) for c in chunks]
    key = keys[len(keys) // 2]
    for layer in range(layers):
        store.get_layer(key, layer)
    samples = []
    for i in range(args.read_calls):
        started = time.perf_counter()
        store.get_layer(key, i % layers)
        samples.append(time.perf_counter() - started)
    read_median = statistics.median(samples)
    layer_bytes = store.header(key).layer_nbytes

    overhead = build_s / forward_s - 1
    bpt_overhead = info["bytes_per_token"] / ideal - 1
    other_s = build_s - forward_s - put.seconds - hash_s - has.seconds
    rows = [
        ("chunks / tokens timed", f"{len(chunks)} / {n_tokens:,}", ""),
        ("model forward only (engine.chunk_kv)", f"{n_tokens / forward_s:,.0f} tok/s", f"{forward_s:.1f} s"),
        ("KV stage as build-cache (hash + has + forward + store)", f"{n_tokens / build_s:,.0f} tok/s",
         f"{build_s:.1f} s"),
        ("build overhead vs forward (target <= 15%)", f"{100 * overhead:+.1f}%", "PASS" if overhead <= 0.15 else "FAIL"),
        ("  of which store.put (cast, crc32, atomic write)", f"{1000 * put.seconds / len(chunks):.2f} ms/chunk",
         f"{100 * put.seconds / forward_s:.1f}% of forward"),
        ("  of which key hashing", f"{1000 * hash_s / len(chunks):.3f} ms/chunk",
         f"{100 * hash_s / forward_s:.2f}% of forward"),
        ("  of which store.has", f"{1000 * has.seconds / max(1, has.calls):.3f} ms/call ({has.calls} calls)",
         f"{100 * has.seconds / forward_s:.2f}% of forward"),
        ("  rest (run-to-run noise of the forward, Python)", f"{1000 * other_s / len(chunks):+.2f} ms/chunk", ""),
        (f"bytes / token on disk ({args.format}, {args.dtype})", f"{info['bytes_per_token']:,.1f}",
         f"{info['entries']} entries, {info['bytes'] / 2**20:,.1f} MiB"),
        (f"ideal: {layers} layers x 2 x {kv_heads} kv_heads x {head_dim} x {itemsize(args.dtype)} B",
         f"{ideal:,}", ""),
        ("bytes / token overhead (target <= 2%)", f"{100 * bpt_overhead:+.2f}%", "PASS" if bpt_overhead <= 0.02 else "FAIL"),
        ("  allocated on disk (filesystem blocks)", f"{alloc_per_token:,.1f}", f"{100 * (alloc_per_token / ideal - 1):+.2f}%"),
        ("read one layer of one chunk (get_layer, warm)", f"{1e6 * read_median:,.0f} us",
         f"median of {args.read_calls}; {layer_bytes / 2**10:,.0f} KiB -> {layer_bytes / read_median / 1e9:.2f} GB/s"),
    ]
    table = Table(title=f"kvf build-cache benchmark ({torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs)")
    for col in ("measure", "value", "note"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)

    command = (f"python -m kvf.scripts.bench_build --questions {args.questions} --passages {args.passages} "
               f"--chunk-tokens {args.chunk_tokens} --dtype {args.dtype} --format {args.format}")
    md = ["# build-cache benchmark", "",
          f"Made by `{command}` at commit {git_commit() or 'unknown'}; embedded "
          f"SmolLM2-135M-Instruct on CPU, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs. "
          "Forward-only and build runs alternate chunk by chunk on the same chunks.", "",
          "| measure | value | note |", "|---|---|---|"]
    md += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    write_atomic(args.out, "\n".join(md) + "\n")
    numbers = {"chunks": len(chunks), "tokens": n_tokens, "forward_tok_s": n_tokens / forward_s,
               "build_tok_s": n_tokens / build_s, "build_overhead": overhead,
               "bytes_per_token": info["bytes_per_token"], "bytes_per_token_ideal": ideal,
               "bytes_per_token_overhead": bpt_overhead, "read_layer_us": 1e6 * read_median}
    write_atomic(args.out.with_suffix(".json"), json.dumps(numbers, indent=1) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
