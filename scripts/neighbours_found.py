"""How many of a workspace's exact neighbours does another workspace's search find, over the chunks runs read?

    python -m kvf.scripts.neighbours_found --exact WS --approximate WS --records RUN.jsonl... --out FILE.md

Two workspaces of the same chunks, one searched exactly and one approximately (`kvf build-cache
--exact-neighbours-up-to 0 --neighbour-probes N`): for every chunk the runs' records read, the share of its
exact neighbours the approximate search found, and the share of chunks whose neighbour list differs at all (a
FusionRAG entry is keyed by its chunk's neighbours, in order, so each such chunk has a fusion KV of its own).
Writes a table (.md and .csv) with 95% bootstrap intervals over the chunks.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from kvf.errors import KvfError
from kvf.pipeline.files import write_atomic
from kvf.pipeline.records import read_records
from kvf.pipeline.retrieval.neighbours import load_neighbours
from kvf.pipeline.workflows.provenance import git_commit
from kvf.scripts.ann_recall import recall_per_passage


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exact", type=Path, required=True, help="workspace whose neighbours were searched exactly")
    p.add_argument("--approximate", type=Path, required=True, help="workspace of the same chunks, searched approximately")
    p.add_argument("--records", type=Path, nargs="+", required=True, help="run files whose chunks are counted")
    p.add_argument("--out", type=Path, required=True, help="the table (.md; a .csv beside it)")
    return p.parse_args(argv)


def chunks_read(record_files: list[Path]) -> list[str]:
    """Every chunk id the records' prompts held, each once, in first-seen order."""
    seen = {}
    for path in record_files:
        for record in read_records(path):
            seen.update(dict.fromkeys(record.chunk_ids or []))
    if not seen:
        raise KvfError(f"--records {' '.join(map(str, record_files))}: no record names a chunk")
    return list(seen)


def neighbour_lists(workspace: Path, chunk_ids: list[str]) -> list[list[str]]:
    """The workspace's neighbours of each chunk, best first."""
    neighbours = load_neighbours(workspace / "neighbours.npz")
    missing = next((c for c in chunk_ids if c not in neighbours), None)
    if missing is not None:
        raise KvfError(f"--records name chunk {missing[:12]}, which workspace {workspace} does not hold")
    return [neighbours[c] for c in chunk_ids]


def compare(exact: list[list[str]], approximate: list[list[str]]) -> pd.DataFrame:
    """One row per chunk: the share of its exact neighbours found, and whether its list (in order) differs."""
    vocabulary = {cid: i for i, cid in enumerate(dict.fromkeys(c for row in exact + approximate for c in row))}
    width = max(len(r) for r in exact + approximate)

    def as_rows(lists: list[list[str]]) -> np.ndarray:   # [chunks, width], -1 padded
        return np.array([[vocabulary[c] for c in r] + [-1] * (width - len(r)) for r in lists])

    found = recall_per_passage(as_rows(approximate), as_rows(exact))
    return pd.DataFrame({"found": found, "differs": [a != e for a, e in zip(approximate, exact)]})


def report(per_chunk: pd.DataFrame, summary: dict, args, settings: dict) -> str:
    from kvf.eval.stats import mean_interval
    found_low, found_high = mean_interval(per_chunk["found"])
    diff_low, diff_high = mean_interval(per_chunk["differs"].astype(float))
    records = " ".join(str(p) for p in args.records)
    return "\n".join([
        "# Approximate neighbours against exact ones, over the chunks a run read", "",
        f"Made by `python -m kvf.scripts.neighbours_found --exact {args.exact} --approximate {args.approximate} "
        f"--records {records} --out {args.out}` at commit {git_commit()}.  ",
        f"Conditions: the {summary['chunks']:,} distinct chunks the records' prompts held; {settings['n_neighbours']} "
        f"neighbours a chunk; the approximate workspace's search: {settings}. 95% bootstrap intervals over the chunks.", "",
        "| chunks | exact neighbours found [95% CI] | chunks with all found | chunks whose neighbour list differs [95% CI] |",
        "|---|---|---|---|",
        f"| {summary['chunks']:,} | {summary['found']:.3f} [{found_low:.3f}, {found_high:.3f}] | "
        f"{summary['all_found']:.3f} | {summary['differs']:.3f} [{diff_low:.3f}, {diff_high:.3f}] |", ""])


def main(argv=None):
    args = parse_args(argv)
    try:
        chunk_ids = chunks_read(args.records)
        per_chunk = compare(neighbour_lists(args.exact, chunk_ids), neighbour_lists(args.approximate, chunk_ids))
        manifest = json.loads((args.approximate / "manifest.json").read_text(encoding="utf-8"))
    except (KvfError, OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: {e}")
    settings = {k: manifest.get(k) for k in ("n_neighbours", "exact_neighbours_up_to", "neighbour_probes")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"chunks": len(per_chunk), "found": per_chunk["found"].mean(),
               "all_found": (per_chunk["found"] == 1).mean(), "differs": per_chunk["differs"].mean()}
    write_atomic(args.out.with_suffix(".csv"), pd.DataFrame([summary]).round(6).to_csv(index=False))
    text = report(per_chunk, summary, args, settings)
    write_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
