"""How many answers two configurations share, question by question, in the same run files: the "N of M answers
changed" that results/kvfuse.md quotes beside a fidelity or accuracy difference.

    python -m kvf.scripts.same_answers results/kvfuse/runs/share-nq-heldout.jsonl \\
        --a "kvfuse@0.15:sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85" \\
        --b "kvfuse@0.15:sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85:hop_rows=16:hop_seeds=band:hop_weight=0:hop_after=12"

A configuration is METHOD@RATIO or METHOD@RATIO:LABEL (the label `kvf run -m` gave its knobs); full prefill is `full`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvf.errors import KvfError
from kvf.pipeline.records import read_records


def configuration(record) -> str:
    """`full`, METHOD@RATIO, or METHOD@RATIO:LABEL."""
    if record.method == "full":
        return "full"
    name = f"{record.method}@{record.settings.get('ratio')}"
    return f"{name}:{record.label}" if record.label else name


def answers(paths: list[Path]) -> dict[str, dict[tuple[str, str], str]]:
    """configuration -> (dataset, qid) -> answer, over every record of the files."""
    by_config: dict[str, dict[tuple[str, str], str]] = {}
    for path in paths:
        for record in read_records(path):
            by_config.setdefault(configuration(record), {})[(record.dataset, record.qid)] = record.answer
    return by_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run files (kvf run -o), plain or gzipped")
    parser.add_argument("--a", required=True, help="a configuration, METHOD@RATIO[:LABEL] or full")
    parser.add_argument("--b", required=True, help="the configuration to compare it with")
    args = parser.parse_args(argv)
    try:
        by_config = answers(args.runs)
        for flag, name in (("--a", args.a), ("--b", args.b)):
            if name not in by_config:
                raise KvfError(f"{flag} {name}: no records of it in {', '.join(map(str, args.runs))}; "
                               f"give one of: {', '.join(sorted(by_config))}")
    except KvfError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    a, b = by_config[args.a], by_config[args.b]
    both = sorted(set(a) & set(b))
    same = sum(a[q] == b[q] for q in both)
    print(f"{len(both)} questions answered by both; same answers: {same}; changed: {len(both) - same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
