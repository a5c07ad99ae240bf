"""The `kvf` command line: one Typer app; each command group lives in its own module."""
import typer

app = typer.Typer(help="kvf: fuse stored chunk KV caches for RAG prefill, and measure each method side by side.",
                  no_args_is_help=True, pretty_exceptions_enable=False)


def main():
    app()
