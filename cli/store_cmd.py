"""`kvf store info|verify|gc`: inspect and maintain a chunk KV store (by --store, or a workspace's)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvf.cachestore import NotAStore, open_store
from kvf.errors import KvfError, counted
from kvf.cli.options import command_group
from kvf.pipeline.workflows.display import progress_bar, size_text
from kvf.pipeline.workflows.workspace import as_given, workspaces_meant

store_app = command_group("Inspect and maintain a chunk KV store (info, verify, gc).")
console = Console()

StoreOpt = Annotated[Optional[str], typer.Option("--store", help="Store path or URL (file://, s3://, ...).")]
WorkspaceOpt = Annotated[Optional[Path], typer.Option("--workspace", "-w", help="Use this workspace's store.")]
FormatOpt = Annotated[Optional[str], typer.Option("--format", help="zarr or hdf5 [default: detect].")]
WhereArg = Annotated[Optional[str], typer.Argument(
    metavar="STORE|WORKSPACE", show_default=False,
    help="A store path or URL (kv.zarr, kv.h5, s3://bucket/prefix), or a workspace folder; or use --store / -w.")]
EndpointOpt = Annotated[Optional[str], typer.Option("--s3-endpoint", help="S3-compatible endpoint URL for s3:// stores [default: AWS, or $AWS_ENDPOINT_URL].")]


def resolve_store(store: str | None, workspace: Path | None, endpoint: str | None = None,
                  where: str | None = None, command: str = "info") -> str:
    """--store, or the store named by --workspace's manifest (one of them); or `where`, the positional
    argument: a workspace folder stands for its store (the manifest's, else its kv.zarr or kv.h5),
    anything else is a store."""
    from kvf.cli.options import use_store_flags
    if where is not None:
        if store is not None or workspace is not None:
            raise KvfError(f"{where}: name the store once, as an argument or with --store / --workspace")
        workspace = named_workspace(where, None)
        if workspace is None:
            store = unfinished_workspace_store(Path(where)) or where
            if store == where and "://" not in where:
                check_not_beside_a_workspace(Path(where), command)
    if (store is None) == (workspace is None):
        raise KvfError(f"pass a store (kvf store {command} PATH, or --store PATH / URL) or --workspace DIR, one of them")
    if store is None and not (workspace / "manifest.json").is_file():
        store = unfinished_workspace_store(workspace)
    if store is None:
        from kvf.pipeline.workflows.workspace import Workspace
        store = Workspace(workspace).reach_store()
    use_store_flags(store, endpoint)
    return store


def check_not_beside_a_workspace(folder: Path, command: str) -> None:
    """`kvf store info DATASET` (or its corpus/, or a workspace's bm25/) said only "is not a kvf store"; the
    workspace beside it is what was meant. A store kept in such a place (an older store in a workspace) is
    opened as asked."""
    meant = workspaces_meant(folder)
    if not meant:
        return
    try:
        open_store(str(folder), readonly=True).close()
    except NotAStore:
        shown = [str(as_given(m, folder)) for m in meant]
        others = f" (or {', '.join(shown[1:4])})" if len(shown) > 1 else ""
        which = "a workspace in it" if meant[0].parent == folder.absolute() else "the workspace it goes with"
        raise KvfError(f"{folder} is not a kvf store; pass {which}: kvf store {command} {shown[0]}{others}") from None


def unfinished_workspace_store(folder: Path) -> str | None:
    """The one default store inside a folder without a manifest: a workspace whose first build has not finished."""
    defaults = [folder / name for name in ("kv.zarr", "kv.h5") if (folder / name).exists()]
    return str(defaults[0]) if len(defaults) == 1 else None


def named_workspace(where: str | None, workspace: Path | None) -> Path | None:
    """The workspace the store was named through: --workspace, or a positional folder with a manifest."""
    if workspace is not None:
        return workspace
    return Path(where) if where and (Path(where) / "manifest.json").is_file() else None


@store_app.command()
def info(where: WhereArg = None, store: StoreOpt = None, workspace: WorkspaceOpt = None, format: FormatOpt = None,
         json_out: Annotated[bool, typer.Option("--json", help="Print the information as JSON.")] = False,
         s3_endpoint: EndpointOpt = None):
    """Entries, tokens, bytes on disk and per token, variants, and the store's identity."""
    location = resolve_store(store, workspace, s3_endpoint, where)
    s = open_store(location, format, readonly=True)
    with progress_bar(Console(stderr=True)) as progress:   # stderr: --json output stays clean
        i = s.info(track=lambda keys: progress.track(keys, description="read entry headers"))
    if json_out:
        print(json.dumps(i, default=str))
        return
    table = Table(title=Text(f"kvf store {location}"), show_header=False)   # Text: a path's [brackets] are not markup
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("format", f"{i['format']} ({i['dtype']}, compressor {i['compressor']})")
    for field, value in i["meta"].items():
        table.add_row(f"meta.{field}", str(value))
    table.add_row("entries", f"{i['entries']}" + (f" ({i['unreadable_entries']} unreadable)" if i["unreadable_entries"] else ""))
    table.add_row("tokens", str(i["tokens"]))
    table.add_row("bytes on disk", size_text(i["bytes"]))
    if i["bytes_per_token"] is not None:
        table.add_row("bytes / token", f"{i['bytes_per_token']:.1f} (data {i['payload_bytes_per_token']:.1f}, "
                                       f"overhead {100 * i['overhead']:.2f}%)")
    table.add_row("variants", ", ".join(f"{v}: {n}" for v, n in sorted(i["variants"].items())) or "-")
    table.add_row("temp / garbage", f"{i['temp_items']} items, {size_text(i['temp_bytes'])}")
    if i["free_bytes"] is not None:   # what build-cache checks a build against (a local store's disk)
        room = f" (about {int(i['free_bytes'] / i['bytes_per_token']):,} more tokens)" if i["bytes_per_token"] else ""
        table.add_row("free on its disk", size_text(i["free_bytes"]) + room)
    console.print(table)


@store_app.command()
def verify(where: WhereArg = None, store: StoreOpt = None, workspace: WorkspaceOpt = None, format: FormatOpt = None,
           delete_bad: Annotated[bool, typer.Option("--delete-bad", help="Delete bad entries so a rebuild recomputes them.")] = False,
           s3_endpoint: EndpointOpt = None):
    """Re-read every entry and check its checksums and identity; exit 1 if any entry is bad."""
    location = resolve_store(store, workspace, s3_endpoint, where, "verify")
    s = open_store(location, format, readonly=not delete_bad)
    n = len(s.keys())
    with progress_bar(console) as progress:
        bad = s.verify(track=lambda keys: progress.track(keys, description="verify entries"))
    for key, problem in bad:
        console.print(f"[red]BAD[/red] {escape(key)}: {escape(problem)}", soft_wrap=True)  # problems are free text
        if delete_bad:
            s.delete(key)
    if not bad:
        console.print(f"[green]{counted(n, 'entry', 'entries')} OK[/green] in {escape(str(location))}", soft_wrap=True)  # a path is not cut
        return
    action = "deleted; rebuild to recompute them" if delete_bad else "re-run with --delete-bad, then rebuild"
    console.print(f"[red]{len(bad)} of {counted(n, 'entry', 'entries')} bad[/red] in {escape(str(location))} ({action})", soft_wrap=True)
    raise typer.Exit(1)


@store_app.command()
def gc(where: WhereArg = None, store: StoreOpt = None, workspace: WorkspaceOpt = None, format: FormatOpt = None,
       keep: Annotated[Optional[Path], typer.Option("--keep", help="File of store keys to keep, one per line: every other entry goes.")] = None,
       keep_workspace: Annotated[Optional[Path], typer.Option("--keep-workspace", help="Keep every entry this workspace's chunks and variants use; every other entry goes.")] = None,
       yes: Annotated[bool, typer.Option("--yes", help="Delete for real; without it gc only says what it would delete.")] = False,
       s3_endpoint: EndpointOpt = None):
    """Remove temp data left by crashed writers; with --keep or --keep-workspace, also every entry not kept."""
    from kvf.pipeline.workflows.gc import collect
    location = resolve_store(store, workspace, s3_endpoint, where, "gc")
    collect(location, format, keep, keep_workspace, yes, console, named_workspace(where, workspace))
