"""`kvf methods`: the registered fusion methods, their knobs, and what they store at build time."""
from __future__ import annotations

import dataclasses

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text


def methods_command(names: bool = typer.Option(False, "--names", help="Print only the names, comma-separated.")):
    """List the fusion methods kvf knows (one file each; see ARCHITECTURE.md to add one)."""
    from kvf.pipeline.fusion.methods.base import METHODS, flag_name, method_names
    if names:
        print(",".join(method_names()))
        return
    table = Table(title="kvf fusion methods", expand=True)
    for col in ("method", "ratio", "variant", "knobs [default]", "extras"):
        table.add_column(Text(col), no_wrap=True)   # Text: "[default]" is not rich markup
    table.add_column("what it recomputes", overflow="fold", ratio=1, min_width=30)
    for name in method_names():
        cls = METHODS[name]
        knobs = "\n".join(f"{flag_name(f.name)} [{f.default}]" for f in dataclasses.fields(cls.Knobs)) or "-"
        ratio = f"--ratio [{cls.default_ratio}]" if cls.ratio_is_knob else f"fixed {cls.fixed_ratio:g}"
        cells = (name, ratio, cls.offline_variant if cls.uses_store else "-", knobs,
                 "\n".join(cls.extras_names) or "-", cls.summary or "-")
        table.add_row(*map(Text, cells))   # Text: a default such as [k] is not rich markup
    Console().print(table)
