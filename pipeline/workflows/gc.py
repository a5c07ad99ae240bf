"""`kvf store gc`: collect garbage, and entries nobody keeps, without ever wiping a store by mistake.

- Without --yes it only says what it would delete.
- A keep list must name at least one entry of the store (store keys are 64-hex entry keys, not
  the chunk ids users see in chunks.parquet and run records), else it is refused.
- --keep-workspace WS keeps every entry that workspace's chunks can use (S, and each chunk's
  prefix and fusion entries, in any compute dtype), which is what users mean.
- It holds the store's exclusive lock: while a run or a build reads or writes it, gc refuses.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kvf.cachestore import open_store
from kvf.errors import KvfError, counted, warn
from kvf.pipeline.files import read_listed
from kvf.pipeline.workflows.devices import COMPUTE_DTYPES
from kvf.pipeline.workflows.workspace import EntryKeys, Workspace


def workspace_keys(path: Path) -> set[str]:
    """Every store key the workspace's chunks can use: S's entry, and each chunk's prefix and fusion entries."""
    from kvf.pipeline.model.prompt import make_template
    from kvf.pipeline.retrieval.chunking import iter_chunk_tokens
    from kvf.pipeline.workflows.weights import open_model, workspace_model
    ws = Workspace(path)
    if not ws.manifest_path.is_file():
        raise ws.not_built(named="--keep-workspace ", pass_as="--keep-workspace {}")
    manifest = ws.manifest()
    model_ref = open_model(workspace_model(manifest, None, ws.root, "put it back there: --keep-workspace reads its "
                                           "tokenizer to name the workspace's entries"))
    model_ref.adopt(manifest.get("model_fingerprint"))   # built by an earlier kvf: its entries are its own
    template = make_template(model_ref.tokenizer)
    neighbours = {}
    if ws.neighbours_file.is_file():
        from kvf.pipeline.retrieval.neighbours import load_neighbours
        neighbours = load_neighbours(ws.neighbours_file)
    # a build on the CPU and a run on a GPU (bfloat16) may share one store
    every_dtype = [EntryKeys(model_ref.fingerprint, template.prefix_ids, dtype) for dtype in COMPUTE_DTYPES]
    wanted = {keys.system() for keys in every_dtype}
    for chunk_id, token_ids in iter_chunk_tokens(ws.chunks_path):   # a batch at a time: a big table fits
        segment = template.chunk_segment(token_ids)
        for keys in every_dtype:
            wanted.add(keys.chunk("prefix", segment))
            if chunk_id in neighbours:
                wanted.add(keys.chunk("fusion", segment, neighbours[chunk_id]))
    return wanted


def collect(location: str, fmt: str | None, keep_file: Path | None, keep_workspace: Path | None, yes: bool,
            console: Console, named_workspace: Path | None = None) -> dict:
    """named_workspace: the workspace the store was named through (`kvf store gc WS`), for a hint only:
    its unused entries are never removed unless kept ones are named (the store may be shared)."""
    store = open_store(location, fmt)
    with store.exclusive_lock():
        existing = set(store.keys())
        keep = None
        if keep_file is not None:
            listed = read_listed(keep_file, "--keep", "store key")
            if not listed & existing:
                raise KvfError(f"--keep {keep_file}: none of its {len(listed)} lines names an entry of store {location} "
                               "(store keys are the 64-hex entry keys that `kvf store info --json` lists, not chunk ids); "
                               "to keep what a workspace uses, pass --keep-workspace WS")
            unknown = sorted(listed - existing)
            if unknown:   # a mistyped key keeps nothing, and the entry it meant goes
                warn(f"--keep {keep_file}: {len(unknown)} of its {len(listed)} keys name no entry of store {location} "
                     f"(e.g. {unknown[0][:16]}...); an entry meant by a mistyped key is not kept")
            keep = listed
        if keep_workspace is not None:
            used = workspace_keys(keep_workspace)
            if not used & existing:
                raise KvfError(f"--keep-workspace {keep_workspace}: the workspace uses none of the {len(existing)} entries of "
                               f"store {location} (another model or another store?); nothing would be kept, so nothing is deleted")
            keep = (keep or set()) | used
        garbage, entries = store.gc_plan(keep)
        if keep is None and named_workspace is not None:
            hint_unused(existing, named_workspace, console)
        if not yes:
            nbytes = sum(store.fs.size(p) for p in garbage) + sum(store._entry_bytes(k) for k in entries)
            console.print(f"would remove {counted(len(garbage), 'temp/garbage item')} and {len(entries)} of "
                          f"{counted(len(existing), 'entry', 'entries')} "
                          f"({nbytes / 2**20:.1f} MiB) from {location}; re-run with --yes to delete them", soft_wrap=True, markup=False)
            return {"garbage_removed": 0, "entries_removed": 0, "bytes_freed": 0, "would_remove": len(entries)}
        freed = store.gc(keep=keep)
        console.print(f"removed {counted(freed['garbage_removed'], 'temp/garbage item')} and "
                      f"{counted(freed['entries_removed'], 'entry', 'entries')}, "
                      f"freed {freed['bytes_freed'] / 2**20:.1f} MiB in {location}", soft_wrap=True, markup=False)
        return freed


def hint_unused(existing: set[str], workspace: Path, console: Console) -> None:
    """Entries the workspace no longer uses (its documents were removed or changed): say how to collect them.
    Not done unasked: another workspace may share the store and use them."""
    unused = len(existing - workspace_keys(workspace))
    if unused:
        console.print(f"{unused} of {counted(len(existing), 'entry', 'entries')} {'is' if unused == 1 else 'are'} not used "
                      f"by workspace {workspace} (documents removed or "
                      f"changed since they were stored); add --keep-workspace {workspace} to remove them, unless "
                      "another workspace shares this store", soft_wrap=True, markup=False)
