"""The `kvf` command line: one Typer app; each command group lives in its own module.

User errors (kvf.KvfError) print one line naming the problem and the fix, and exit 1.
"""
from __future__ import annotations

import os
import sys

import typer

from kvf import KvfError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(help="kvf: fuse stored chunk KV caches for RAG prefill, and measure each method side by side.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)



@app.callback()
def root():
    """kvf: build chunk KV stores, fuse them, and compare fusion methods on QA benchmarks."""


from kvf.cli import bench_cmd, build_cmd, demo_cmd, run_cmd  # noqa: E402
from kvf.cli.search_cmd import search_command  # noqa: E402
from kvf.cli.store_cmd import store_app  # noqa: E402
from kvf.cli.data_cmd import data_app  # noqa: E402
from kvf.cli.eval_cmd import eval_command  # noqa: E402

app.command("demo")(demo_cmd.demo_command)
app.command("build-cache")(build_cmd.build_cache_command)
app.command("run")(run_cmd.run_command)
app.command("search")(search_command)
app.command("bench")(bench_cmd.bench_command)
app.add_typer(store_app, name="store")
app.add_typer(data_app, name="data")
app.command("eval")(eval_command)


def main():
    try:
        app()
    except KvfError as e:
        print(f"kvf: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("kvf: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
