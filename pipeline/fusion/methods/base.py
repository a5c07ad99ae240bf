"""The common interface of fusion methods, and the registry that maps names to them.

A method is one file under pipeline/fusion/methods/ (or in a directory named by $KVF_METHOD_PATH)
with one FusionMethod subclass decorated with @register. The class declares everything about
itself, and nothing else in kvf names it:
- `name`, `summary` (one line: what it recomputes; the README's methods table carries it too), and `Knobs`: a dataclass whose fields (declared with `knob()`) become `kvf run` and
  `kvf bench` flags with their help text, are validated, and are recorded with every run. A knob
  added to an existing method defaults to the method as it was, so records made before the knob
  existed resume as its default (`default_settings`);
- `ratio_is_knob` (False: the method recomputes a fixed amount, `fixed_ratio`, whatever --ratio
  says), `offline_variant` (the stored variant it reads by default), `uses_store`,
  `reuse_at_ratio_zero` (at ratio 0 it is plain reuse, so a sweep shares reuse's prefill), `configurations`
  (named knob sets: `-m kvfuse:tuned` runs the knobs its file names `tuned`, labelled `tuned`);
- `extras_hook`: an optional build-time hook (Cache-Craft's attention summaries) that build-cache,
  run and bench call through this interface;
- its answers to the engine's one layer loop (FusionEngine.fuse): `plan` (positions, the rows
  recomputed from layer 0, the chunks loaded), `before_layer` / `after_layer`, `passes` and
  `next_pass_rows`, `records_query_attention`, `finish`, and `query_pass` (its first pass is
  reuse's, so a sweep may share it).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
import typing
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvf.errors import KvfError, did_you_mean, percent_as_fraction
from kvf.pipeline.fusion.engine import (FusionEngine, FusionPlan, FusionResult, FusionState, LayerKVSource,
                                        recompute_budget)
from kvf.pipeline.model.prompt import FusedPrompt

METHODS: dict[str, type["FusionMethod"]] = {}
METHOD_PATH_ENV = "KVF_METHOD_PATH"  # extra directories of method files, ':'-separated

# the recompute ratio of a method given none (`kvf run` without -r, Workspace.answer without ratio=):
# one budget for every method, so their answers compare
DEFAULT_RATIO = 0.15


# ---- knobs ------------------------------------------------------------------------------------
def knob(default, help: str, *, min=None, max=None, choices=None):
    """One method knob: a dataclass field carrying its CLI help and its valid values."""
    return field(default=default, metadata={"help": help, "min": min, "max": max, "choices": choices})


@dataclass
class NoKnobs:
    """A method without knobs."""


def flag_name(knob_name: str) -> str:
    return "--" + knob_name.replace("_", "-")


class KnobError(KvfError):
    """A knob's value refused: the line names the CLI flag (`--check-layer 99: ...`); `knob` and `problem`
    let a caller that took the knob otherwise name it its own way (the Python API: `check_layer=99: ...`)."""

    def __init__(self, knob: str, shown: str | None, problem: str):
        self.knob, self.problem = knob, problem
        super().__init__(f"{flag_name(knob)}{'' if shown is None else ' ' + shown}: {problem}")


@contextmanager
def knob_errors_named(knobs: dict, line):
    """A knob in `knobs` that a method refuses is named the caller's way, line(knob, problem) (a -m entry, a
    Python argument), not as its CLI flag, which the user did not type; other knobs' lines pass through."""
    try:
        yield
    except KnobError as e:
        if e.knob not in knobs:
            raise
        raise KvfError(line(e.knob, e.problem)) from None


def knob_types(knobs_class: type) -> dict[str, type]:
    """Field name -> its plain type (int, float, str, bool), Optional unwrapped."""
    hints = typing.get_type_hints(knobs_class)
    out = {}
    for f in dataclasses.fields(knobs_class):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        out[f.name] = args[0] if args else hint
    return out


KIND_WORDS = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}


def check_knobs(knobs) -> None:
    """Every knob's type and range, as one-line errors naming the flag."""
    types = knob_types(type(knobs))
    for f in dataclasses.fields(knobs):
        value, meta, kind = getattr(knobs, f.name), f.metadata, types[f.name]
        if value is None:
            if f.default is not None:
                raise KnobError(f.name, None, "needs a value")
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            setattr(knobs, f.name, value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            wanted = (f"one of {', '.join(map(str, meta['choices']))}" if meta.get("choices")
                      else KIND_WORDS.get(kind, kind.__name__))
            raise KnobError(f.name, repr(value), f"must be {wanted}")
        if kind is float and value != value:
            raise KnobError(f.name, str(value), "not a number")
        if meta.get("min") is not None and value < meta["min"]:
            raise KnobError(f.name, str(value), f"must be >= {meta['min']}")
        if meta.get("max") is not None and value > meta["max"]:
            raise KnobError(f.name, str(value), f"must be <= {meta['max']}")
        if meta.get("choices") and value not in meta["choices"]:
            raise KnobError(f.name, str(value), f"must be one of {', '.join(map(str, meta['choices']))}")


# ---- the method interface ---------------------------------------------------------------------
class FusionMethod:
    name = ""
    summary = ""                  # one line, what it recomputes: `kvf methods` prints it, the README's row says it
    Knobs: type = NoKnobs
    ratio_is_knob = True          # False: the method ignores --ratio and recomputes `fixed_ratio`
    fixed_ratio = 0.0
    paper_ratio: float | None = None   # the ratio its paper reports at, shown by `kvf methods`; runs use
                                       # DEFAULT_RATIO unless told, so every method compares at one budget
    offline_variant = "prefix"    # which stored variant it reads by default
    uses_store = True             # False for `full`: it never reads chunk KVs
    passes = 1                    # layer loops per request (two-pass methods select in the first)
    query_pass = False            # True: its first pass is reuse's plain query-only pass (default plan, no
                                  # hooks in it), which a sweep runs once per question and variant
    reuse_at_ratio_zero = False   # True: at ratio 0 it recomputes and changes nothing (see is_reuse)
    repositions = False           # True: it moves rows mid-fusion (engine.reposition), so it loads each layer itself
    extras_hook = None            # (attention [L][t, c+t], context_lengths, context_ids) -> {name: array}
    extras_names: tuple = ()      # the extras an entry must carry for this method
    # what the contract test (tests/test_method_contract.py) holds every method to:
    in_all = True                 # part of `-m all` (prefix is not: it equals full by construction)
    oracle_knobs: dict = {}       # with these knobs at ratio 1 the method reproduces full prefill
    exact_budget = True           # recomputes exactly round(r * chunk tokens); False: within one token per chunk
    configurations: dict = {}     # NAME -> "knob=value:..." that `-m METHOD:NAME` runs, labelled NAME (e.g. the
                                  # setting an ablation chose, where changing the default would relabel old records)

    def __init__(self, recompute_ratio: float | None = None, knobs=None, **knob_values):
        if knobs is None:
            unknown = sorted(set(knob_values) - {f.name for f in dataclasses.fields(self.Knobs)})
            if unknown:
                raise KvfError(f"{flag_name(unknown[0])}: method {self.name} has no such knob")
            knobs = self.Knobs(**knob_values)
        check_knobs(knobs)
        self.knobs = knobs
        if not self.ratio_is_knob:
            recompute_ratio = self.fixed_ratio
        elif recompute_ratio is None:
            recompute_ratio = DEFAULT_RATIO
        recompute_budget(recompute_ratio, 0)  # validates the range
        self.recompute_ratio = float(recompute_ratio)

    def settings(self) -> dict:
        """What is recorded with every run: the ratio and every knob."""
        return {"ratio": self.recompute_ratio, **dataclasses.asdict(self.knobs)}

    def is_reuse(self) -> bool:
        """Whether this request's fused prefill is, bit for bit, `reuse`'s on the same stored variant
        (the contract test holds every method to it), so a sweep computes and decodes it once."""
        return self.reuse_at_ratio_zero and self.ratio_is_knob and self.recompute_ratio == 0.0

    def check_model(self, n_layers: int) -> None:
        """Knobs that depend on the loaded model (e.g. a layer index) are checked here."""

    def prefill(self, engine: FusionEngine, prompt: FusedPrompt, source: LayerKVSource | None = None,
                max_new_tokens: int = 0, shared: dict | None = None) -> FusionResult:
        """This method's fused prefill: the engine's one layer loop with this method's answers."""
        return engine.fuse(self, prompt, source, max_new_tokens, shared)

    # ---- answers to the layer loop ----------------------------------------------------------
    def plan(self, engine: FusionEngine, prompt: FusedPrompt, source: LayerKVSource | None,
             max_new_tokens: int) -> FusionPlan:
        """Before layer 0: positions, rows recomputed from layer 0, chunks loaded (timed as `select`)."""
        return FusionPlan(self.initial_chunk_rows(prompt), self.positions(prompt), self.loaded_chunks(prompt))

    def positions(self, prompt: FusedPrompt) -> torch.Tensor | None:
        """[n] RoPE positions; None = contiguous from 0."""
        return None

    def initial_chunk_rows(self, prompt: FusedPrompt) -> torch.Tensor:
        """Chunk rows recomputed from layer 0 (Q's rows always are). Default: none (full reuse)."""
        return torch.empty(0, dtype=torch.long)

    def loaded_chunks(self, prompt: FusedPrompt) -> list[int] | None:
        """Chunks whose stored KV is read; None = all."""
        return None

    def before_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        """May shrink the recomputed set (engine.keep_rows) before `layer` runs."""

    def after_layer(self, engine: FusionEngine, state: FusionState, layer: int) -> None:
        """May read what the layer recorded, prune or re-position (engine.drop_rows_from_context, reposition)."""

    def records_query_attention(self, state: FusionState, layer: int) -> bool:
        """Whether this layer records Q's attention to every row (state.query_attention)."""
        return False

    def next_pass_rows(self, engine: FusionEngine, state: FusionState) -> torch.Tensor:
        """Between passes: the chunk rows the next pass recomputes from layer 0."""
        raise NotImplementedError(f"{self.name} declares {self.passes} passes but no next_pass_rows")

    def pass_computes_question(self, pass_index: int) -> bool:
        """Whether a pass after the first computes Q's rows beside its chunk rows. The last pass must (its Q gives
        the first token); an earlier one that only records what chunk rows attend to need not, since a chunk row
        never attends to Q (causal), and Q's rows are computed afresh by the pass after."""
        return True

    def finish(self, engine: FusionEngine, state: FusionState, result: FusionResult) -> None:
        """After the last layer: adjust the result (e.g. compact the cache, report info)."""


# ---- helpers shared by several methods -----------------------------------------------------------
def all_chunk_rows(prompt: FusedPrompt) -> torch.Tensor:
    return torch.arange(prompt.n_prefix, prompt.n_prefix + prompt.n_chunk_tokens)


def top_rows(scores: torch.Tensor, rows: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` rows with the highest scores (scores[i] belongs to rows[i]), sorted by row."""
    if budget <= 0:
        return rows[:0]
    picked = torch.topk(scores.float().cpu(), min(budget, len(rows))).indices  # rows live on the CPU
    return torch.sort(rows[picked]).values


def chunk_attention(query_attention: torch.Tensor, prompt: FusedPrompt) -> torch.Tensor:
    """[n] Q attention per cache row -> [k] attention per chunk (sum over its rows)."""
    return torch.stack([query_attention[s:e].sum() for s, e in prompt.chunk_spans()])


# ---- the registry -----------------------------------------------------------------------------
def register(cls):
    """Class decorator: make a method available by its name. A name can be registered once."""
    if not cls.name:
        raise TypeError(f"{cls.__qualname__} has no `name`")
    known = METHODS.get(cls.name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise KvfError(f"method name {cls.name!r} is registered twice: by {defined_in(known)} and by {defined_in(cls)}; "
                       "rename one of them")
    METHODS[cls.name] = cls
    return cls


def defined_in(cls) -> str:
    """A method class's file (`kvf methods NAME` says it; a module name when it has none)."""
    import inspect
    try:
        return inspect.getsourcefile(cls) or cls.__module__
    except TypeError:   # a class made where no file is (a notebook cell)
        return cls.__module__


_discovered = False


def discover() -> dict[str, type[FusionMethod]]:
    """Import every method file (this package, then each $KVF_METHOD_PATH directory) once."""
    global _discovered
    if _discovered:
        return METHODS
    _discovered = True
    package = Path(__file__).parent
    for info in pkgutil.iter_modules([str(package)]):
        if info.name != "base":
            importlib.import_module(f"{__package__}.{info.name}")
    for directory in filter(None, os.environ.get(METHOD_PATH_ENV, "").split(os.pathsep)):
        if not Path(directory).is_dir():
            raise KvfError(f"{METHOD_PATH_ENV}={directory}: not a directory of method files")
        for path in sorted(Path(directory).glob("*.py")):
            load_method_file(path, directory)
    return METHODS


USER_METHOD_FILES: set[str] = set()   # the $KVF_METHOD_PATH files loaded, links resolved: where errors are blamed


def load_method_file(path: Path, directory: str) -> None:
    """One $KVF_METHOD_PATH file, imported; an error in it (a typo, a missing import) is one line naming the
    file and its line, since it is the user's code and not kvf's."""
    module_name = f"kvf_user_methods.{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    USER_METHOD_FILES.add(os.path.realpath(path))
    try:
        spec.loader.exec_module(module)
    except KvfError:   # register()'s own line (a name registered twice)
        raise
    except Exception as e:
        found = user_method_line(e)
        line = e.lineno if isinstance(e, SyntaxError) else found[1] if found else None
        message = e.msg if isinstance(e, SyntaxError) else str(e).splitlines()[0] if str(e) else ""
        raise KvfError(f"{METHOD_PATH_ENV}: {path}{f' line {line}' if line else ''}: {type(e).__name__}: {message}; "
                       f"fix the method file, or move it out of {directory}") from None


def user_method_line(error: BaseException, traceback_text: str = "") -> tuple[str, int] | None:
    """(file, line) of the innermost frame in a $KVF_METHOD_PATH file, from the error's traceback or, for an
    error that crossed processes (a Ray worker's), from its printed traceback; None when the error did not
    pass through one (the CLI then calls it kvf's own bug)."""
    import traceback
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(error.__traceback__)]
    frames += [(path, int(line)) for path, line in re.findall(r'File "([^"]+)", line (\d+)', traceback_text)]
    frames = [(path, line) for path, line in frames if os.path.realpath(path) in USER_METHOD_FILES]
    return frames[-1] if frames else None


def user_method_error(error: BaseException, traceback_text: str = "") -> str | None:
    """The one line for an error raised inside a $KVF_METHOD_PATH method: the user's code, blamed on its file
    and line; None when the error is not from one."""
    blamed = user_method_line(error, traceback_text)
    if blamed is None:
        return None
    message = str(error).splitlines()[0][:200] if str(error) else ""
    return (f"{blamed[0]} line {blamed[1]} (a method file of {METHOD_PATH_ENV}) raised {type(error).__name__}: "
            f"{message}; fix the method")


def method_names() -> list[str]:
    return sorted(discover())


def methods_with_extras() -> list[str]:
    """The methods whose build-time hook stores extras with every entry (what `--extras-for` may name)."""
    return sorted(name for name, cls in discover().items() if cls.extras_hook is not None)


def check_method_name(name: str, given: str | None = None) -> None:
    """An unknown method is one line naming it as it was given (`given`, e.g. "--auto-method x" or "method='x'";
    default "--method NAME") and listing the known ones."""
    known = method_names()
    if name not in known:
        words, (method, at, ratio) = name.split(), name.partition("@")
        python = (given or "").startswith("method=")   # named as a Python call's argument
        if len(words) > 1 and set(words) <= set(known):
            hint = f" (separate methods with commas: {','.join(words)})"
        elif at and method in known:   # kvf eval's and compare's METHOD@RATIO
            ratio = percent_as_fraction(ratio) or ratio   # "@15" meant 15%: --ratio takes 0.15
            if python:
                hint = f" (the ratio is given apart: method={method!r}, ratio={ratio})"
            elif (given or "").startswith("kvf methods"):   # which lists a method's knobs, at no ratio
                hint = f" (a ratio is no part of its name: kvf methods {method})"
            else:
                hint = f" (the ratio is given apart: -m {method} --ratio {ratio})"
        elif name.split(":")[0] in known:   # kvf run -m's NAME:KNOB=VALUE where a bare name goes
            base, *knobs = name.split(":")
            if (given or "").startswith("kvf methods"):   # which lists every knob of a method
                hint = f" (knobs are no part of its name: kvf methods {base})"
            elif not any(knobs):   # a trailing colon, and no knob after it
                hint = did_you_mean(base, known)
            else:
                hint = knobs_apart(name)
        else:
            hint = did_you_mean(name, known)
        raise KvfError(f"{given or f'--method {name}'}: unknown method{hint}; known methods: {', '.join(known)}")


def configuration_pairs(method: str, parts: list[str]) -> list[str]:
    """A -m entry's parts after the method's name, each named configuration (`kvfuse:tuned`) written out as
    its own KNOB=VALUE parts, in place (so a knob after it overrides it); other parts as they are."""
    named = METHODS[method].configurations if method in METHODS else {}
    return [pair for part in parts for pair in (named[part].split(":") if part in named else [part])]


def knobs_apart(name: str) -> str:
    """Where a bare method name goes, NAME:KNOB=VALUE (kvf run -m's spelling) says how its knobs go there:
    their own flags on the command line."""
    base, *knobs = name.split(":")
    given = dict(knob.partition("=")[::2] for knob in configuration_pairs(base, knobs) if knob)   # a later one wins
    return f" (its knobs go apart: {base} {' '.join(f'{flag_name(k)} {v}' for k, v in given.items())})"


def get_method(name: str, recompute_ratio: float | None = None, **knob_values) -> FusionMethod:
    """A method by name, at a ratio (None: its default) with its knobs."""
    check_method_name(name)
    return METHODS[name](recompute_ratio, **knob_values)


def default_settings(name: str) -> dict:
    """Every knob of a registered method at its default ({} for a name not registered): what a record
    made before a knob existed ran with, by the rule above."""
    discover()
    return dataclasses.asdict(METHODS[name].Knobs()) if name in METHODS else {}


def build_method(name: str, recompute_ratio: float, knobs: dict | None = None) -> FusionMethod:
    """get_method with only the knobs this method takes that were set (other methods' flags are ignored)."""
    discover()
    get_method(name)  # validates the name
    own = {f.name for f in dataclasses.fields(METHODS[name].Knobs)}
    return get_method(name, recompute_ratio, **{k: v for k, v in (knobs or {}).items() if k in own and v is not None})


@dataclass
class KnobSpec:
    """One CLI flag generated from the methods' knobs (shared when several methods use the same name)."""
    name: str
    type: type
    help: str
    methods: list[str]


def knob_specs() -> list[KnobSpec]:
    """Every knob of every registered method, one per name, in registration order."""
    specs: dict[str, KnobSpec] = {}
    for method_name in method_names():
        cls = METHODS[method_name]
        types = knob_types(cls.Knobs)
        for f in dataclasses.fields(cls.Knobs):
            spec = specs.get(f.name)
            if spec is None:
                specs[f.name] = KnobSpec(f.name, types[f.name], f"{method_name}: {knob_help(f)}", [method_name])
            elif spec.type is not types[f.name]:
                raise KvfError(f"knob {f.name} is {spec.type.__name__} in {spec.methods[0]} but "
                               f"{types[f.name].__name__} in {method_name}; give one of them another name")
            else:
                spec.methods.append(method_name)
                spec.help += f"; {method_name}: {knob_help(f)}"
    return list(specs.values())


def knob_help(f: dataclasses.Field) -> str:
    """A knob's help with its default; a None default is explained by the help itself ("default: calibrated")."""
    return f.metadata.get("help", "") + ("" if f.default is None else f" [default: {f.default}]")


def check_knobs_used(method_names_run: list[str], knobs: dict) -> None:
    """A method flag that no method of the run takes is a mistake, not something to ignore silently."""
    specs = {s.name: s for s in knob_specs()}
    for name, value in knobs.items():
        if value is not None and name in specs and not set(specs[name].methods) & set(method_names_run):
            raise KvfError(f"{flag_name(name)}: none of the methods run ({', '.join(method_names_run)}) takes it; "
                           f"it is a knob of {', '.join(specs[name].methods)}")
