"""`kvf store info|verify|gc`: inspect and maintain a chunk KV store."""
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvf import KvfError
from kvf.cachestore import open_store

store_app = typer.Typer(help="Inspect and maintain a chunk KV store (info, verify, gc).", no_args_is_help=True)
console = Console()

StoreOpt = Annotated[str, typer.Option("--store", help="Store path or URL (file://, s3://, ...).")]
FormatOpt = Annotated[Optional[str], typer.Option("--format", help="zarr or hdf5; default: detect.")]


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


@store_app.command()
def info(store: StoreOpt, format: FormatOpt = None):
    """Entries, tokens, bytes on disk and per token, variants, and the store's identity."""
    s = open_store(store, format, readonly=True)
    i = s.info()
    table = Table(title=f"kvf store {store}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("format", f"{i['format']} ({i['dtype']}, compressor {i['compressor']})")
    for field, value in i["meta"].items():
        table.add_row(f"meta.{field}", str(value))
    table.add_row("entries", f"{i['entries']}" + (f" ({i['unreadable_entries']} unreadable)" if i["unreadable_entries"] else ""))
    table.add_row("tokens", str(i["tokens"]))
    table.add_row("bytes on disk", _size(i["bytes"]))
    if i["bytes_per_token"] is not None:
        table.add_row("bytes / token", f"{i['bytes_per_token']:.1f} (data {i['payload_bytes_per_token']:.1f}, "
                                       f"overhead {100 * i['overhead']:.2f}%)")
    table.add_row("variants", ", ".join(f"{v}: {n}" for v, n in sorted(i["variants"].items())) or "-")
    table.add_row("temp / garbage", f"{i['temp_items']} items, {_size(i['temp_bytes'])}")
    console.print(table)


@store_app.command()
def verify(store: StoreOpt, format: FormatOpt = None,
           delete_bad: Annotated[bool, typer.Option("--delete-bad", help="Delete corrupt entries so a rebuild recomputes them.")] = False):
    """Re-read every entry and check its checksums; exit 1 if any entry is bad."""
    s = open_store(store, format, readonly=not delete_bad)
    n = len(s.keys())
    bad = s.verify()
    for key, problem in bad:
        console.print(f"[red]BAD[/red] {key}: {problem}", soft_wrap=True)
        if delete_bad:
            s.delete(key)
    if not bad:
        console.print(f"[green]{n} entries OK[/green] in {store}")
        return
    action = "deleted; rebuild to recompute them" if delete_bad else "re-run with --delete-bad, then rebuild"
    console.print(f"[red]{len(bad)} of {n} entries bad[/red] in {store} ({action})")
    raise typer.Exit(1)


@store_app.command()
def gc(store: StoreOpt, format: FormatOpt = None,
       keep: Annotated[Optional[Path], typer.Option("--keep", help="File of keys to keep, one per line: every other entry is deleted.")] = None):
    """Remove temp data left by crashed writers (and, with --keep, every entry not listed)."""
    keep_keys = None
    if keep is not None:
        if not keep.is_file():
            raise KvfError(f"--keep file {keep} not found; pass a file with one key per line")
        keep_keys = {line.strip() for line in keep.read_text().splitlines() if line.strip()}
    freed = open_store(store, format).gc(keep=keep_keys)
    console.print(f"removed {freed['garbage_removed']} temp/garbage items and {freed['entries_removed']} entries, "
                  f"freed {_size(freed['bytes_freed'])} in {store}")
