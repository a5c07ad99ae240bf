"""`kvf methods`: the registered fusion methods, their knobs, and what they store at build time."""
from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Optional

import typer
from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text


def methods_command(only: Annotated[Optional[list[str]], typer.Argument(
                        metavar="METHOD", help="Show only these methods, each knob with its help, and the "
                                                    "file that defines it.")] = None,
                    names: Annotated[bool, typer.Option("--names", help="Print only the names, comma-separated.")] = False,
                    json_out: Annotated[bool, typer.Option("--json", help="Print every method as JSON: its summary, "
                                        "ratio, stored variant, knobs with their defaults, build-time extras.")] = False):
    """List the fusion methods kvf knows (one file each; see ARCHITECTURE.md to add one)."""
    from kvf.pipeline.fusion.methods.base import METHODS, check_method_name, method_names
    chosen = method_names()
    if only:   # as kvf run -m takes them: comma lists, and all for every method
        only = [n.strip() for item in only for n in item.split(",") if n.strip()]
        only = [n for name in only for n in (chosen if name == "all" else [name])]
        for name in only:
            check_method_name(name, f"kvf methods {name}")
        chosen = list(dict.fromkeys(only))
    if names:
        print(",".join(chosen))
        return
    if json_out:   # for scripts that build sweeps: the knobs as values, not as flag text
        print(json.dumps([method_json(METHODS[name], name) for name in chosen], indent=1))
        return
    rows = [method_row(METHODS[name], name, detail=bool(only)) for name in chosen]
    console = Console()
    if console.width >= WIDE and not only:
        console.print(methods_table(rows))
    else:   # one block per method: a table's six columns squeeze names and summaries to nothing here
        for row in rows:
            console.print(method_block(row))


WIDE = 140  # columns the table needs before its summaries read as sentences


def method_row(cls, name: str, detail: bool = False) -> dict:
    """detail: each knob with its help (`kvf methods NAME`), and the method's file."""
    from kvf.pipeline.fusion.methods.base import DEFAULT_RATIO, defined_in, flag_name, knob_help
    if detail:
        knobs = [(flag_name(f.name), knob_help(f)) for f in dataclasses.fields(cls.Knobs)]
    else:
        knobs = [f"{flag_name(f.name)} [{f.default}]" for f in dataclasses.fields(cls.Knobs)]
    paper = f" (paper: {cls.paper_ratio:g})" if cls.paper_ratio is not None else ""
    ratio = f"--ratio [{DEFAULT_RATIO:g}]{paper}" if cls.ratio_is_knob else f"fixed {cls.fixed_ratio:g}"
    return {"method": name, "ratio": ratio, "variant": cls.offline_variant if cls.uses_store else "-",
            "knobs": knobs, "extras": list(cls.extras_names), "summary": cls.summary or "-",
            "configurations": {f"{name}:{c}": f"{name}:{knobs}" for c, knobs in cls.configurations.items()},
            "file": defined_in(cls) if detail else None}


def method_json(cls, name: str) -> dict:
    from kvf.pipeline.fusion.methods.base import DEFAULT_RATIO
    return {"method": name, "summary": cls.summary, "ratio_is_knob": cls.ratio_is_knob,
            "default_ratio": DEFAULT_RATIO if cls.ratio_is_knob else cls.fixed_ratio, "paper_ratio": cls.paper_ratio,
            "stored_variant": cls.offline_variant if cls.uses_store else None,
            "knobs": {f.name: f.default for f in dataclasses.fields(cls.Knobs)}, "extras": list(cls.extras_names),
            "configurations": dict(cls.configurations)}


def methods_table(rows: list[dict]) -> Table:
    table = Table(title="kvf fusion methods", expand=True)
    for col in ("method", "ratio", "variant", "knobs [default]", "extras"):
        table.add_column(Text(col), no_wrap=True)   # Text: "[default]" is not rich markup
    table.add_column("what it recomputes", overflow="fold", ratio=1, min_width=30)
    for r in rows:
        named = [f"named: {entry}" for entry in r["configurations"]]   # kvfuse:tuned
        cells = (r["method"], r["ratio"], r["variant"], "\n".join(r["knobs"] + named) or "-",
                 "\n".join(r["extras"]) or "-", r["summary"])
        table.add_row(*map(Text, cells))   # Text: a default such as [k] is not rich markup
    return table


def method_block(r: dict) -> Group:
    """name, ratio and stored variant; then what it recomputes, its knobs and build-time extras, indented."""
    head = Text(r["method"], style="bold")
    ratio = r["ratio"] if r["ratio"].startswith("--") else f"ratio {r['ratio']}"
    head.append(f" · {ratio} · stored variant {r['variant']}")
    extras = [f"build-time extras: {', '.join(r['extras'])}"] if r["extras"] else []
    extras += [f"named configuration: -m {entry} = {knobs}" for entry, knobs in r["configurations"].items()]
    if not r["file"]:
        lines = [r["summary"]] + ([f"knobs [default]: {', '.join(r['knobs'])}"] if r["knobs"] else []) + extras
        return Group(head, *(Padding(Text(line), (0, 0, 0, 4), expand=False) for line in lines), Text(""))
    # one method in detail: a knob per row, its help wrapped beside it; the file that defines it (and cites its paper)
    knobs = Table.grid(padding=(0, 2))
    knobs.add_column(no_wrap=True)
    knobs.add_column(overflow="fold")
    for flag, help in r["knobs"]:
        knobs.add_row(Text(flag), Text(help))
    parts = [Text(r["summary"]), Text("knobs:" if r["knobs"] else "knobs: none"), *([Padding(knobs, (0, 0, 0, 2))] if r["knobs"] else []),
             *map(Text, extras), Text(f"defined in {r['file']}")]
    return Group(head, *(Padding(part, (0, 0, 0, 4)) for part in parts), Text(""))
