"""`kvf methods`: the registered fusion methods, their knobs, and what they store at build time."""
from __future__ import annotations

import dataclasses

import typer
from rich.console import Console
from rich.table import Table


def methods_command(names: bool = typer.Option(False, "--names", help="Print only the names, comma-separated.")):
    """List the fusion methods kvf knows (one file each; see ARCHITECTURE.md to add one)."""
    from kvf.pipeline.fusion.methods.base import METHODS, flag_name, method_names
    if names:
        print(",".join(method_names()))
        return
    table = Table(title="kvf fusion methods")
    for col in ("method", "ratio", "default variant", "knobs", "build-time extras", "what it does"):
        table.add_column(col, overflow="fold")
    for name in method_names():
        cls = METHODS[name]
        knobs = ", ".join(f"{flag_name(f.name)} [{f.default}]" for f in dataclasses.fields(cls.Knobs)) or "-"
        ratio = f"--ratio [{cls.default_ratio}]" if cls.ratio_is_knob else f"fixed {cls.fixed_ratio:g}"
        summary = (cls.__module__ and __import__(cls.__module__, fromlist=["x"]).__doc__ or "").strip().split("\n")[0]
        table.add_row(name, ratio, cls.offline_variant if cls.uses_store else "-", knobs,
                      ", ".join(cls.extras_names) or "-", summary)
    Console().print(table)
