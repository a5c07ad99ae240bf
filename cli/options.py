"""CLI options shared by several commands, declared once, and the method-knob flags generated
from every registered method's Knobs dataclass."""
from __future__ import annotations

import functools
import inspect
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup


class CommandGroup(TyperGroup):
    """Plain (click) help, with each command's summary wrapped in full: click cuts it at ~60 characters
    with '...'. kvf's apps use plain help because typer's rich tables squeeze an option's help into
    ~17 columns on an 80-column terminal."""

    def resolve_command(self, ctx, args):
        """The (sub)command the words name; a command's list option given twice is refused here, before click
        keeps its last value only."""
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None and not isinstance(command, TyperGroup):
            from kvf.errors import KvfError
            if (line := repeated_list_option(command, rest) or dash_path(command, rest)) is not None:
                raise KvfError(f"{line} (see `{ctx.command_path} {name} --help`)")
        return name, command, rest

    def format_commands(self, ctx, formatter) -> None:
        rows = [(name, cmd.get_short_help_str(limit=10_000)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def value_options(command) -> dict:
    """Each name of each option that takes a value (not a flag), as written (-m, --method): its parameter."""
    return {opt: param for param in command.params if param.param_type_name == "option" and not param.is_flag
            for opt in param.opts + param.secondary_opts}


def repeated_list_option(command, args: list[str]) -> str | None:
    """The line for a list option (one whose help says it is comma-separated) given twice, `-m reuse -m
    cacheblend`: click keeps the last value and drops the first without a word, so a sweep ran one method where
    the user asked for two. A single-value option given twice keeps its last, as in most tools: a script may
    append an override."""
    lists = {opt: param for opt, param in value_options(command).items() if "comma" in (param.help or "").lower()}
    given: dict[str, tuple[str, str]] = {}   # param name -> (the flag as written, its value)
    for i, word in enumerate(args):
        flag, sep, value = word.partition("=") if word.startswith("--") else (word, "", "")
        param = lists.get(flag)
        if param is None:
            continue
        value = value if sep else (args[i + 1] if i + 1 < len(args) else "")
        if param.name in given:
            first, first_value = given[param.name]
            return (f"{flag} is given twice ({first_value}, then {value}), and only the last would count; give "
                    f"them in one, comma-separated: {first} {first_value},{value}")
        given[param.name] = (flag, value)
    return None


# str options and arguments that name a file, a folder or a store (the rest of kvf's paths are typed Path)
PATH_NAMES = {"store", "where", "model", "data_dir"}


def takes_path(command, param) -> bool:
    """Whether a parameter names a file, a folder or a store (annotated Path, list[Path], or in PATH_NAMES)."""
    annotation = inspect.signature(command.callback).parameters[param.name].annotation
    return param.name in PATH_NAMES or "Path" in str(annotation)


def dash_path(command, args: list[str]) -> str | None:
    """The line for "-" given as a path (`-q -`, `-o -`, `kvf eval -`). kvf reads and writes named files: a
    resumed run reads its questions again and appends to its run file, and a write is a rename. `-q -` said
    the file "-" was missing, and `-o -` wrote a run file named "-"."""
    options = value_options(command)
    arguments = [param for param in command.params if param.param_type_name == "argument"]
    pending, position = None, 0   # (flag, option) the next word is the value of; how many arguments came before
    for word in args:
        if pending is not None:
            (named, param), pending = pending, None
        elif word.startswith("--") and "=" in word:
            named, _, word = word.partition("=")
            param = options.get(named)
        elif word in options:
            pending = (word, options[word])
            continue
        elif word == "-" or not word.startswith("-"):   # an argument ("-" alone is one, to click)
            param = arguments[min(position, len(arguments) - 1)] if arguments else None
            named = param and (param.metavar or param.name.upper())
            position += 1
        else:
            continue   # a flag
        if word == "-" and param is not None and takes_path(command, param):
            return (f'{named} -: kvf takes a named file or folder here, not standard input or output; pass a '
                    f'path (./- for a file named "-")')
    return None


def command_group(help: str) -> typer.Typer:
    """A kvf command group (the root app, `kvf data`, `kvf store`): plain help, no arguments = help, and -h
    as --help (most tools take it; its commands inherit it)."""
    return typer.Typer(help=help, cls=CommandGroup, rich_markup_mode=None, no_args_is_help=True,
                       pretty_exceptions_enable=False, add_completion=False,
                       context_settings={"help_option_names": ["-h", "--help"]})


ModelOption = Annotated[Optional[str], typer.Option(
    "--model", help="Local HF model dir or .gguf file (default: the embedded SmolLM2-135M-Instruct).")]
WorkspaceModelOption = Annotated[Optional[str], typer.Option(
    "--model", help="Local HF model dir or .gguf file (default: the one the workspace was built with; for a new "
                    "workspace, the embedded SmolLM2-135M-Instruct).")]
DeviceOption = Annotated[str, typer.Option("--device", help="cpu, or cuda (cuda:N) with a CUDA build of torch.")]
S3EndpointOption = Annotated[Optional[str], typer.Option(
    "--s3-endpoint", help="S3-compatible endpoint URL for s3:// stores (MinIO, Ceph, moto, ...) [default: AWS, or $AWS_ENDPOINT_URL].")]


def thousands(text: str) -> int | None:
    """'4K' -> 4096, '0.5k' -> 512: a token count as papers write context lengths (None for anything else)."""
    import re
    found = re.fullmatch(r"(\d+(?:\.\d+)?)[kK]", text.strip())
    return round(float(found.group(1)) * 1024) if found else None


def use_store_flags(store: str | None, endpoint: str | None) -> None:
    """--store checked as the user typed it (a mistyped URL would be taken for a local folder), and
    --s3-endpoint set as the standard variable botocore (and so s3fs, and Ray workers) read. `store`: where
    the store is, when known here; an endpoint beside a store not on S3 would be ignored, so it is refused."""
    import os

    from kvf.cachestore import check_url, is_endpoint_url
    from kvf.errors import KvfError
    if store:
        check_url(store)
    if not endpoint:
        return
    if not is_endpoint_url(endpoint):
        raise KvfError(f"--s3-endpoint {endpoint}: not an endpoint URL; pass one such as http://localhost:9000")
    if store is not None and not store.startswith("s3://"):
        raise KvfError(f"--s3-endpoint {endpoint}: the store {store} is not on S3 (s3://bucket/prefix), so no endpoint "
                       "is used; leave --s3-endpoint out, or pass --store s3://BUCKET/PREFIX")
    os.environ["AWS_ENDPOINT_URL"] = endpoint


RayOption = Annotated[Optional[str], typer.Option(
    "--ray", metavar="[ADDRESS]",   # --ray alone means local (kvf.cli.main.with_optional_values)
    help="Spread the work over Ray actors: --ray alone (or --ray local) starts Ray on this machine; "
         "--ray ADDRESS joins a cluster (auto, ray://HEAD:10001). Needs pip install 'kvf[ray]'.",
    rich_help_panel="Scale-out")]
WorkersOption = Annotated[Optional[int], typer.Option(
    "--workers", min=1, help="Ray actors, each with its own model [default: one per CPU, or per GPU with --device cuda].",
    rich_help_panel="Scale-out")]
ThreadsOption = Annotated[Optional[int], typer.Option(
    "--threads", min=1, help="torch threads per Ray actor [default: 1].", rich_help_panel="Scale-out")]


def check_ray_flags(ray: str | None, workers: int | None, threads: int | None = None, batch: int | None = None) -> None:
    """Ray's own flags without --ray would be ignored: refused (they default to None, so a given one shows)."""
    from kvf.errors import KvfError
    if ray is None:
        for flag, value, example in (("--workers", workers, "--workers 2"), ("--threads", threads, "--threads 2"),
                                     ("--batch", batch, "--batch 8")):
            if value is not None:
                raise KvfError(f"{flag} {value} needs --ray (e.g. --ray local {example}); without it the work runs "
                               "in this process")


DtypeOption = Annotated[Optional[str], typer.Option(
    "--dtype", help="Compute dtype: float32, bfloat16 or float16 [default: float32 on cpu, bfloat16 on cuda].")]


def with_method_knobs(command):
    """Give `command` one option per method knob (from the registry; shared names share a flag).

    The command declares **knobs; the generated options arrive there, None when not given."""
    from kvf.pipeline.fusion.methods.base import flag_name, knob_specs
    signature = inspect.signature(command, eval_str=True)   # Annotated[..., typer.Option(help=...)], not the string
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    specs = knob_specs()
    for spec in specs:
        if spec.type is bool:
            option = typer.Option(None, f"{flag_name(spec.name)}/{flag_name('no_' + spec.name)}", help=spec.help,
                                  rich_help_panel="Method knobs")
        else:
            option = typer.Option(None, flag_name(spec.name), help=spec.help, rich_help_panel="Method knobs")
        params.append(inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=Optional[spec.type]))
    names = {spec.name for spec in specs}

    @functools.wraps(command)
    def wrapper(**kwargs):
        knobs = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        return command(**kwargs, **knobs)

    wrapper.__signature__ = signature.replace(parameters=params)
    return wrapper
