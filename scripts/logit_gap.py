"""Is an answer that differs between two runs a greedy near-tie? Answer some questions as `kvf run` does
and print the smallest gaps between the top two logits met while decoding.

    python -m kvf.scripts.logit_gap -d DIR --qid QID -m METHOD -r RATIO --max-new-tokens 32 -o OUT.jsonl

A gap of about 1e-4 or less is a tie that summation order (batch composition, thread count) can break
either way; results/verified.md quotes these for the re-run records that differ from the committed ones.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from kvf.errors import KvfError
from kvf.pipeline.model import forward
from kvf.pipeline.workflows.run import RunOptions, parse_ratios, run


@contextmanager
def recorded_gaps():
    """While open, every Transformer.logits call appends its rows' top-1 minus top-2 logit, [t] -> list."""
    gaps: list[list[float]] = []
    original = forward.Transformer.logits

    def logits(self, hidden):
        out = original(self, hidden)                        # [t, vocab]
        top = out.topk(2, dim=-1).values                    # [t, 2]
        gaps.append((top[:, 0] - top[:, 1]).tolist())
        return out

    forward.Transformer.logits = logits
    try:
        yield gaps
    finally:
        forward.Transformer.logits = original


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-d", "--dataset", type=Path, required=True, help="a prepared dataset directory")
    parser.add_argument("--qid", required=True, help="question ids, comma-separated")
    parser.add_argument("-m", "--method", required=True, help="methods, comma-separated, as kvf run takes them")
    parser.add_argument("-r", "--ratio", default="0.15", help="recompute ratios, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--compare-full", action="store_true", help="answer with full prefill too (decoded in the same batch)")
    parser.add_argument("-o", "--out", type=Path, required=True, help="run file to write")
    args = parser.parse_args(argv)
    with recorded_gaps() as gaps:
        try:  # a bad --ratio is refused by parse_ratios, as kvf run refuses it: one line, no traceback
            run(RunOptions(out=args.out, methods=args.method.split(","), ratios=parse_ratios(args.ratio),
                           dataset=args.dataset, qids=args.qid.split(","), compare_full=args.compare_full,
                           max_new_tokens=args.max_new_tokens), Console(stderr=True))
        except KvfError as e:
            print(f"kvf: error: {e}", file=sys.stderr)
            return 1
    smallest = sorted((g, call, row) for call, row_gaps in enumerate(gaps) for row, g in enumerate(row_gaps))
    print("smallest top-2 logit gaps (gap, logits call, row):", [(round(g, 6), c, r) for g, c, r in smallest[:5]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
