"""Draw a bench folder's plots again from its committed files (ttft.csv, rounds.csv, ttft.md), with no timing.

    python -m kvf.scripts.replot_bench results/kvfuse/bench-seeds-after [more folders]
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvf.pipeline.workflows.bench import replot


def main(argv: list[str] | None = None) -> int:
    folders = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not folders:
        print("usage: python -m kvf.scripts.replot_bench BENCH_FOLDER [...] (a folder kvf bench --out wrote)")
        return 2
    for folder in folders:
        missing = [name for name in ("ttft.csv", "rounds.csv", "ttft.md") if not (folder / name).is_file()]
        if missing:
            print(f"error: {folder} has no {', '.join(missing)}: give a folder that kvf bench --out wrote")
            return 1
        for path in replot(folder):
            print(f"drew {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
