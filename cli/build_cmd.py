"""`kvf build-cache CORPUS`: chunk, index and precompute chunk KVs into a store."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvf.cli.options import (DeviceOption, RayOption, S3EndpointOption, ThreadsOption, WorkersOption, WorkspaceModelOption,
                             check_ray_flags, use_store_flags)

console = Console(stderr=True)


def build_cache_command(
    corpus: Optional[Path] = typer.Argument(None, show_default=False, help="Folder (or file) of documents: .txt, .md, .markdown, .rst, .html, .pdf files, and .jsonl, .json (an array), .csv, .tsv, .parquet rows with id, title and text (all but .parquet also gzipped, .gz) [default: the ones the workspace was built from]."),
    workspace: Path = typer.Option(Path("workspace"), "--workspace", "-w", help="Where chunks, indexes and the manifest go."),
    store: Optional[str] = typer.Option(None, "--store", help="KV store path or fsspec URL [default: WORKSPACE/kv.zarr, or kv.h5 with --format hdf5]."),
    format: Optional[str] = typer.Option(None, "--format", help="Store format: zarr or hdf5 [default: the workspace's existing store, else zarr]."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Stored KV dtype: float16, bfloat16 or float32 [default: the workspace's, else float16]."),
    compute_dtype: Optional[str] = typer.Option(None, "--compute-dtype", help="The model's dtype while computing KVs: float32, bfloat16 or float16 [default: float32 on cpu, bfloat16 on cuda]."),
    chunk_tokens: Optional[int] = typer.Option(None, "--chunk-tokens", min=1, help="Chunk length in model tokens [default: the workspace's, else 256]."),
    overlap: Optional[int] = typer.Option(None, "--overlap", min=0, help="Tokens shared by consecutive chunks of a document [default: the workspace's, else 0]."),
    variant: Optional[str] = typer.Option(None, "--variant", help="Offline variants to build, comma-separated: prefix, fusion [default: the workspace's, else prefix]."),
    neighbours: Optional[int] = typer.Option(None, "--neighbours", min=1, help="Top-n similar chunks per chunk (FusionRAG's n) [default: the workspace's, else 10]."),
    neighbour_probes: Optional[int] = typer.Option(None, "--neighbour-probes", min=1, help="Lists of about √n that the approximate neighbour search reads per chunk above 50,000 chunks: more find more of the exact neighbours, slower (results/ann_recall.md) [default: the workspace's, else 32]."),
    exact_neighbours_up_to: Optional[int] = typer.Option(None, "--exact-neighbours-up-to", min=0, help="Chunks up to which the neighbour search is exact; above, it reads --neighbour-probes lists (0: always approximate, to see what a large corpus's search finds) [default: the workspace's, else 50,000]."),
    embedder: Optional[str] = typer.Option(None, "--embedder", help="Local embedding model dir (sentence-transformers) [default: the workspace's, else all-MiniLM-L6-v2]."),
    model: WorkspaceModelOption = None,
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: build only the chunks whose id hashes to shard I of N."),
    extras_for: Optional[str] = typer.Option(None, "--extras-for", help="Methods whose build-time extras every entry stores, comma-separated, or all (e.g. cachecraft)."),
    bm25: Optional[bool] = typer.Option(None, "--bm25/--no-bm25", show_default=False, help="Build the BM25 index [default: the workspace's, else yes]."),
    dense: Optional[bool] = typer.Option(None, "--dense/--no-dense", show_default=False, help="Build the dense index (always built when --variant has fusion) [default: the workspace's, else yes]."),
    indexes_only: bool = typer.Option(False, "--indexes-only", help="Chunk and index (and find neighbours), but compute no KVs: `kvf run` computes the ones its questions need."),
    rebuild: Optional[str] = typer.Option(None, "--rebuild", help="Rebuild these stages even if they look current: bm25, dense, neighbours (a damaged index)."),
    device: DeviceOption = "cpu",
    s3_endpoint: S3EndpointOption = None,
    ray: RayOption = None,
    workers: WorkersOption = None,
    threads: ThreadsOption = None,
    batch: Optional[int] = typer.Option(None, "--batch", min=1, help="Chunks per Ray task [default: 16].",
                                        rich_help_panel="Scale-out"),
):
    """Chunk a corpus, index it (BM25 + dense), find neighbours, and store every chunk's KV cache."""
    from kvf.pipeline.workflows.build import BuildOptions, build_cache, documents_built_from, parse_shard, summary_table
    from kvf.pipeline.workflows.devices import check_device
    check_device(device, workers_only=ray is not None)  # before any work: a bad device must not leave a half-built workspace
    use_store_flags(store, s3_endpoint)   # store None: the workspace's, which may be on S3
    check_ray_flags(ray, workers, threads, batch)
    if corpus is None:
        corpus = documents_built_from(workspace)
        console.print(f"building from {corpus}, the documents {workspace} was built from", markup=False, highlight=False,
                      soft_wrap=True)
    opts = BuildOptions(corpus=corpus, workspace=workspace, store=store, format=format, dtype=dtype,
                        chunk_tokens=chunk_tokens, overlap=overlap,
                        variants=tuple(v.strip() for v in variant.split(",") if v.strip()) if variant else None,
                        n_neighbours=neighbours, neighbour_probes=neighbour_probes,
                        exact_neighbours_up_to=exact_neighbours_up_to, embedder=embedder, model=model, shard=parse_shard(shard),
                        extras_for=tuple(filter(None, (extras_for or "").split(","))), bm25=bm25, dense=dense,
                        device=device, compute_dtype=compute_dtype, rebuild=tuple(s.strip() for s in (rebuild or "").split(",") if s.strip()),
                        indexes_only=indexes_only,
                        ray=ray, workers=workers, threads=threads or BuildOptions.threads,
                        batch=batch or BuildOptions.batch)
    summary = build_cache(opts, console)
    console.print(summary_table(summary))
