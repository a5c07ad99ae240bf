"""`kvf methods`: the registered fusion methods, their knobs, and what they store at build time."""
from __future__ import annotations

import dataclasses
import json

import typer
from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text


def methods_command(names: bool = typer.Option(False, "--names", help="Print only the names, comma-separated."),
                    json_out: bool = typer.Option(False, "--json", help="Print every method as JSON: its summary, "
                                                  "ratio, stored variant, knobs with their defaults, build-time extras.")):
    """List the fusion methods kvf knows (one file each; see ARCHITECTURE.md to add one)."""
    from kvf.pipeline.fusion.methods.base import METHODS, method_names
    if names:
        print(",".join(method_names()))
        return
    if json_out:   # for scripts that build sweeps: the knobs as values, not as flag text
        print(json.dumps([method_json(METHODS[name], name) for name in method_names()], indent=1))
        return
    rows = [method_row(METHODS[name], name) for name in method_names()]
    console = Console()
    if console.width >= WIDE:
        console.print(methods_table(rows))
    else:   # one block per method: a table's six columns squeeze names and summaries to nothing here
        for row in rows:
            console.print(method_block(row))


WIDE = 140  # columns the table needs before its summaries read as sentences


def method_row(cls, name: str) -> dict:
    from kvf.pipeline.fusion.methods.base import DEFAULT_RATIO, flag_name
    knobs = [f"{flag_name(f.name)} [{f.default}]" for f in dataclasses.fields(cls.Knobs)]
    paper = f" (paper: {cls.paper_ratio:g})" if cls.paper_ratio is not None else ""
    ratio = f"--ratio [{DEFAULT_RATIO:g}]{paper}" if cls.ratio_is_knob else f"fixed {cls.fixed_ratio:g}"
    return {"method": name, "ratio": ratio, "variant": cls.offline_variant if cls.uses_store else "-",
            "knobs": knobs, "extras": list(cls.extras_names), "summary": cls.summary or "-"}


def method_json(cls, name: str) -> dict:
    from kvf.pipeline.fusion.methods.base import DEFAULT_RATIO
    return {"method": name, "summary": cls.summary, "ratio_is_knob": cls.ratio_is_knob,
            "default_ratio": DEFAULT_RATIO if cls.ratio_is_knob else cls.fixed_ratio, "paper_ratio": cls.paper_ratio,
            "stored_variant": cls.offline_variant if cls.uses_store else None,
            "knobs": {f.name: f.default for f in dataclasses.fields(cls.Knobs)}, "extras": list(cls.extras_names)}


def methods_table(rows: list[dict]) -> Table:
    table = Table(title="kvf fusion methods", expand=True)
    for col in ("method", "ratio", "variant", "knobs [default]", "extras"):
        table.add_column(Text(col), no_wrap=True)   # Text: "[default]" is not rich markup
    table.add_column("what it recomputes", overflow="fold", ratio=1, min_width=30)
    for r in rows:
        cells = (r["method"], r["ratio"], r["variant"], "\n".join(r["knobs"]) or "-", "\n".join(r["extras"]) or "-",
                 r["summary"])
        table.add_row(*map(Text, cells))   # Text: a default such as [k] is not rich markup
    return table


def method_block(r: dict) -> Group:
    """name, ratio and stored variant; then what it recomputes, its knobs and build-time extras, indented."""
    head = Text(r["method"], style="bold")
    ratio = r["ratio"] if r["ratio"].startswith("--") else f"ratio {r['ratio']}"
    head.append(f" · {ratio} · stored variant {r['variant']}")
    lines = [r["summary"]] + ([f"knobs [default]: {', '.join(r['knobs'])}"] if r["knobs"] else []) \
        + ([f"build-time extras: {', '.join(r['extras'])}"] if r["extras"] else [])
    return Group(head, *(Padding(Text(line), (0, 0, 0, 4), expand=False) for line in lines), Text(""))
