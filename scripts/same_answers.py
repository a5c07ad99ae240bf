"""How many answers two configurations share, question by question, in the same run files: the "N of M answers
changed" that results/kvfuse.md quotes beside a fidelity or accuracy difference.

    python -m kvf.scripts.same_answers results/kvfuse/runs/share-nq-heldout.jsonl \\
        --a "kvfuse@0.15:sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85" \\
        --b "kvfuse@0.15:sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85:hop_rows=16:hop_seeds=band:hop_weight=0:hop_after=12"

A configuration is METHOD@RATIO or METHOD@RATIO:LABEL (the label `kvf run -m` gave its knobs); full prefill is `full`.

--where adds, per question whose answers differ, where --b's answer first leaves --a's, measured against the gold
value as --a's answer spells it: before the value, at its first character, inside it, or after it (or --a's answer
does not spell a gold value). A table counts the places per task (a generated suite's task, as its records' dataset
names it; any other question's dataset), and how many of each side's answers are right.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

from kvf.errors import KvfError
from kvf.eval.metrics import accuracy, is_suite_dataset
from kvf.pipeline.records import read_records


def configuration(record) -> str:
    """`full`, METHOD@RATIO, or METHOD@RATIO:LABEL."""
    if record.method == "full":
        return "full"
    name = f"{record.method}@{record.settings.get('ratio')}"
    return f"{name}:{record.label}" if record.label else name


def answers(paths: list[Path]) -> tuple[dict[str, dict[tuple[str, str], str]], dict[tuple[str, str], tuple]]:
    """(configuration -> (dataset, qid) -> answer, (dataset, qid) -> (gold, gold_mode)), over every record of the files."""
    by_config: dict[str, dict[tuple[str, str], str]] = {}
    gold: dict[tuple[str, str], tuple] = {}
    for path in paths:
        for record in read_records(path):
            by_config.setdefault(configuration(record), {})[(record.dataset, record.qid)] = record.answer
            gold[(record.dataset, record.qid)] = (record.gold, record.gold_mode)
    return by_config, gold


PLACES = ("before the value", "at the value's first character", "inside the value", "after the value",
          "--a spells no gold value")


def where_it_leaves(a: str, b: str, gold: list[str]) -> str:
    """Where answer b first leaves answer a (they differ), against the first gold value a spells: one of PLACES."""
    spelt = [(a.find(value), value) for value in gold if value and value in a]
    if not spelt:
        return PLACES[4]
    start, value = min(spelt)
    leaves = len(os.path.commonprefix([a, b]))                                   # the first character that differs
    if leaves < start:
        return PLACES[0]
    if leaves == start:
        return PLACES[1]
    return PLACES[2] if leaves < start + len(value) else PLACES[3]


def task_of(dataset: str) -> str:
    """A generated suite's task, as its records name it ("ruler-4096/niah_multikey" -> "niah_multikey"); any other
    dataset, itself."""
    return dataset.split("/", 1)[1] if is_suite_dataset(dataset) else dataset


def correct(answer: str, gold: tuple) -> bool:
    """Whether the answer gets full accuracy: any gold alias, or every gold value where all are asked for."""
    return accuracy(answer, *gold) == 1.0


def where_table(a: dict, b: dict, gold: dict, both: list) -> str:
    """Markdown: per task and place, how many changed answers leave --a's there, and how many of each side are right."""
    counts: Counter = Counter()
    for key in both:
        if a[key] != b[key]:
            place = (task_of(key[0]), where_it_leaves(a[key], b[key], gold[key][0]))
            counts[place + ("n",)] += 1
            counts[place + ("a",)] += correct(a[key], gold[key])
            counts[place + ("b",)] += correct(b[key], gold[key])
    lines = ["| task | where --b leaves --a | answers | --a right | --b right |", "|---|---|---|---|---|"]
    for task in sorted({t for t, _, _ in counts}):
        for place in PLACES:
            if counts[(task, place, "n")]:
                lines.append(f"| {task} | {place} | {counts[(task, place, 'n')]} | {counts[(task, place, 'a')]} | "
                             f"{counts[(task, place, 'b')]} |")
    return "\n".join(lines)


def lost_table(a: dict, b: dict, gold: dict, both: list) -> str:
    """Markdown: each question --a gets right and --b does not, where --b leaves it, and both answers (first line,
    80 characters)."""
    first = lambda text: repr(text.split("\n")[0][:80])                       # noqa: E731
    lines = ["| question | where --b leaves --a | --a | --b |", "|---|---|---|---|"]
    for key in both:
        if correct(a[key], gold[key]) and not correct(b[key], gold[key]):
            lines.append(f"| {key[1]} | {where_it_leaves(a[key], b[key], gold[key][0])} | {first(a[key])} | {first(b[key])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run files (kvf run -o), plain or gzipped")
    parser.add_argument("--a", required=True, help="a configuration, METHOD@RATIO[:LABEL] or full")
    parser.add_argument("--b", required=True, help="the configuration to compare it with")
    parser.add_argument("--where", action="store_true",
                        help="also count where --b's changed answers first leave --a's, against the gold value")
    parser.add_argument("--list", action="store_true",
                        help="also list the changed answers that --a gets right and --b does not, side by side")
    args = parser.parse_args(argv)
    try:
        by_config, gold = answers(args.runs)
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
    if args.where and same < len(both):
        print(where_table(a, b, gold, both))
    if args.list:
        print(lost_table(a, b, gold, both))
    return 0


if __name__ == "__main__":
    sys.exit(main())
