"""The `kvf` command line: one Typer app; each command group lives in its own module.

Errors: a user error (kvf.KvfError) prints one line naming the problem and the fix and exits 1;
an OS error about a path the user gave prints one line naming the path and exits 1; Ctrl-C and
SIGTERM print "interrupted; re-run to resume" and exit 130 / 143. Anything else is a kvf bug:
one line saying so, exit 2, and `kvf --debug ...` shows its traceback.
"""
from __future__ import annotations

import json
import os
import re
import sys

# kvf shows its own progress (rich). Set before anything imports tqdm: tqdm reads TQDM_* when imported,
# and transformers' GGUF de-quantiser draws a tqdm bar of its own.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import typer  # noqa: E402

from kvf import __version__  # noqa: E402
from kvf.cli.entry import Interrupted, Stopped, signal_beneath  # noqa: E402
from kvf.cli.options import command_group, thousands  # noqa: E402
from kvf.errors import KvfError, disk_full, is_number  # noqa: E402
from kvf.pipeline.fusion.methods.base import user_method_error  # noqa: E402

app = command_group("kvf: fuse stored chunk KV caches for RAG prefill, and measure each method side by side.")
DEBUG = {"on": False}


def _version(value: bool):
    if value:
        from kvf.pipeline.workflows.provenance import git_commit, library_versions
        commit = git_commit()
        libraries = "".join(f", {name} {release}" for name, release in library_versions().items())  # as records name them
        typer.echo(f"kvf {__version__}" + (f" ({commit})" if commit else "") + libraries)
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print kvf's version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of an unexpected error (a kvf bug)."),
):
    """kvf: build chunk KV stores, fuse them, and compare fusion methods on QA benchmarks."""
    DEBUG["on"] = debug


from kvf.cli import ask_cmd, bench_cmd, build_cmd, demo_cmd, methods_cmd, run_cmd  # noqa: E402
from kvf.cli.data_cmd import data_app  # noqa: E402
from kvf.cli.eval_cmd import compare_command, eval_command  # noqa: E402
from kvf.cli.search_cmd import search_command  # noqa: E402
from kvf.cli.store_cmd import store_app  # noqa: E402

app.command("demo")(demo_cmd.demo_command)
app.command("build-cache")(build_cmd.build_cache_command)
app.command("run")(run_cmd.run_command)
app.command("ask")(ask_cmd.ask_command)
app.command("search")(search_command)
app.command("bench")(bench_cmd.bench_command)
app.command("methods")(methods_cmd.methods_command)
app.add_typer(store_app, name="store")
app.add_typer(data_app, name="data")
app.command("eval")(eval_command)
app.command("compare")(compare_command)


# options whose value may be left out, and what they then mean (typer has no optional-value options)
OPTIONAL_VALUES = {"--ray": "local"}


def with_optional_values(args: list[str]) -> list[str]:
    """`--ray` with no value after it (the last word, or another option next) -> `--ray local`. A negative
    number next (`--ray -1`) is its value, checked where values are, not an option click never heard of."""
    out = []
    for i, word in enumerate(args):
        out.append(word)
        if word in OPTIONAL_VALUES and (i + 1 == len(args) or args[i + 1].startswith("-")
                                        and not is_number(args[i + 1])):
            out.append(OPTIONAL_VALUES[word])
    return out


def with_equals_values(args: list[str]) -> list[str]:
    """A value after `=` as the shell would have given it apart: `--workspace=~/ws` -> `--workspace=/home/me/ws`
    (the shell expands ~ in `-w ~/ws` but leaves it after `=`, and kvf took it for a folder named "~" here), and
    `-w=ws` -> `-w ws` (click took "=ws" for the value: "--workspace =ws: no workspace there")."""
    out = []
    for word in args:
        flag, sep, value = word.partition("=")
        if not (flag.startswith("-") and sep):
            out.append(word)
            continue
        if value == "~" or value.startswith("~/"):
            value = os.path.expanduser(value)
        out += [flag, value] if re.fullmatch(r"-[A-Za-z]", flag) else [f"{flag}={value}"]
    return out


def empty_value(args: list[str]) -> str | None:
    """The line for an empty word (`-w "$WS"` with WS unset, or `--store=`): an empty path meant the current
    folder, so a build went among the files there, and an empty name silently meant the default."""
    for i, word in enumerate(args):
        flag, sep, value = word.partition("=")
        if not (word.startswith("-") and sep and not value.strip()):   # --store=, -w=, --store=" "
            if word.strip():
                continue
            if not (i and args[i - 1].startswith("-")):
                where = f"after {args[i - 1]}" if i else "before the command"
                what = "an empty argument" if not word else "a blank argument"
                return f'{what} ({json.dumps(word)}) {where}; give it a value (is a shell variable unset?) or leave it out'
            flag = args[i - 1]
        return f'{flag} is given an empty value; give it one (is a shell variable unset?) or leave {flag} out'
    return None


def command_path(args: list[str]) -> str:
    """`kvf build-cache` for the words `build-cache docs --chunk-tokens`: the (sub)command the words name,
    for errors click raises before it has a context (an option's missing value)."""
    command, path = typer.main.get_command(app), ["kvf"]
    for word in args:
        if word.startswith("-") and hasattr(command, "commands"):   # a group's own option (kvf --debug run ...)
            continue
        sub = getattr(command, "commands", {}).get(word)
        if sub is None:
            break
        command, path = sub, path + [word]
    return " ".join(path)


RESUMABLE = ("build-cache", "run")   # what a re-run picks up where it stopped; the rest start again


def resumes(args: list[str]) -> bool:
    """Whether the command in `args` resumes when re-run (an interrupted eval or bench starts again)."""
    try:
        words = command_path(args).split()
    except Exception:   # on the way out of a signal: never fail there, say the plainer thing
        return False
    return len(words) > 1 and words[1] in RESUMABLE


def extra_argument_hint(where: str, ctx, message: str) -> str:
    """What a stray word was likely meant as, for the commands a new user most often gives one:
    an unquoted query, `kvf run`'s inputs passed without their flags, a -m knob's value without its =, or the
    runs of one file given to kvf compare as words."""
    from pathlib import Path
    found = re.match(r"Got unexpected extra argument(?:s|\(s\))? \((.*)\)$", message)
    if not found or ctx is None:
        return ""
    words = found.group(1).split()
    if where in ("kvf search", "kvf ask"):
        what = "query" if where == "kvf search" else "question"
        query = str(ctx.params.get(what, ""))
        if Path(query).is_dir():   # kvf search WORKSPACE "a query": the workspace goes by -w
            return f'; the workspace goes by -w: {where} "{" ".join(words)}" -w {query}'
        return f'; put a {what} of several words in quotes: {where} "{" ".join([query, *words])}"'
    if where == "kvf build-cache":   # often a shell pattern (docs/*.txt) that expanded to many files
        paths = [Path(str(ctx.params.get("corpus", ""))), *map(Path, words)]
        parents = {p.parent for p in paths if p.is_file()}
        folder = f": kvf build-cache {parents.pop()}" if len(parents) == 1 and all(p.is_file() for p in paths) else ""
        return f"; build-cache takes one CORPUS, a folder of documents or one file: pass the folder that holds them{folder}"
    if where == "kvf demo":   # kvf demo my_docs/: its corpus and questions are its own
        return DEMO_MAKES_ITS_OWN
    if where == "kvf compare" and not Path(str(ctx.params.get("run_b", ""))).exists():   # kvf compare RUN kvfuse ape
        return (f"; runs of one file go by --a and --b: kvf compare {ctx.params.get('run_a')} "
                f"--a {ctx.params.get('run_b')} --b {words[0]}")
    if where != "kvf run":
        return ""
    method = str(ctx.params.get("method") or "")
    knob = method.rsplit(":", 1)[1] if ":" in method else ""
    if knob and "=" not in knob and len(words) == 1:   # -m cacheblend:check_layer 3
        return f"; a knob in -m is written NAME:KNOB=VALUE: -m {method}={words[0]}"
    from kvf.pipeline.workflows.workspace import folder_kind
    flag_of = {"dataset": "--dataset", "workspace": "--workspace", "file": "--questions"}
    flags = [f"{flag_of[kind]} {word}" for word in words if (kind := folder_kind(Path(word))) in flag_of]
    return f"; kvf run takes its inputs by flag: {' '.join(flags)}" if flags else ""


# what a command another tool has is called here: (the group it was typed under, the word) -> kvf's own
COMMAND_ALIASES = {("kvf", "version"): "kvf --version", ("kvf", "help"): "kvf --help",
                   ("kvf store", "ls"): "kvf store info", ("kvf store", "list"): "kvf store info",
                   ("kvf store", "check"): "kvf store verify", ("kvf store", "clean"): "kvf store gc"}


def command_hint(where: str, message: str) -> str:
    """Click suggests a command spelled nearly alike; a word for it from another tool gets kvf's own."""
    found = re.match(r"No such command '([^']*)'", message)
    meant = COMMAND_ALIASES.get((where, found.group(1).lower())) if found and "Did you mean" not in message else None
    return f" Use {meant}." if meant else ""   # after click's own sentence


# flags of kvf run passed to kvf bench, which times prompts it makes itself
RUN_INPUT_FLAGS = ("-w", "--workspace", "-q", "--questions", "-d", "--dataset")
# kvf demo given one's own documents or questions (its --questions is how many it makes)
DEMO_MAKES_ITS_OWN = ("; kvf demo makes its own corpus and questions: for yours, kvf build-cache DOCS -w WORKSPACE, "
                      "then kvf run -w WORKSPACE -q QUESTIONS.jsonl (README: Your own documents and questions)")


# what other tools call a flag kvf has under another name: (command, flag) -> the hint after click's line
OPTION_ALIASES = {("kvf store gc", "--dry-run"): "; gc only says what it would delete unless given --yes: leave "
                                                 "--dry-run out",
                  ("kvf store gc", "--force"): "; kvf store gc --yes deletes for real",
                  ("kvf store verify", "--fix"): "; kvf store verify --delete-bad deletes bad entries, so that a "
                                                 "rebuild recomputes them"}


def option_hint(where: str, message: str) -> str:
    """kvf bench given kvf run's inputs: say where the TTFT of one's own questions is measured; another tool's
    name for a flag kvf has: name kvf's."""
    found = re.match(r"No such option: (\S+)", message)
    if where == "kvf demo" and found and found.group(1) in RUN_INPUT_FLAGS:
        return DEMO_MAKES_ITS_OWN
    if where == "kvf bench" and found and found.group(1) in RUN_INPUT_FLAGS:
        return ("; kvf bench times prompts it builds of --lengths tokens; your own questions' TTFT against full "
                "prefill comes from kvf run (its records) and kvf eval (ttft_ratio)")
    return OPTION_ALIASES.get((where, found.group(1)), "") if found else ""


def demo_count_hint(where: str, message: str) -> str:
    """kvf demo --questions FILE: its --questions is a count, kvf run's is a file."""
    from pathlib import Path
    found = re.match(r"(?:--questions|--limit|--n|-n) (.+?): ", message)
    return DEMO_MAKES_ITS_OWN if where == "kvf demo" and found and Path(found.group(1)).exists() else ""


def invalid_value_message(message: str, args: list[str]) -> str:
    """Click's "Invalid value for '--length': Input should be a valid integer, ..." does not say what was
    typed: name the flag with its value, as kvf's own lines do, and read 4K (a context length as papers
    write it) as the number it stands for."""
    found = re.match(r"Invalid value for ('-[^']+'(?: / '-[^']+')*): (.*)$", message)
    if not found:
        return message
    names, reason = re.findall(r"'([^']+)'", found.group(1)), found.group(2)   # --n / --limit / -n
    value = None
    for i, arg in enumerate(args):
        if arg.split("=", 1)[0] in names:
            flag, value = arg.split("=", 1) if "=" in arg else (arg, args[i + 1] if i + 1 < len(args) else None)
    if value is None:
        return message
    tokens = thousands(value)
    hint = f"; write {value} as {tokens}" if tokens is not None else ""
    reason = re.sub(r"^Value error, ", "", reason)   # typer's wording for a value outside its choices
    if value.strip().lower().lstrip("+-") == "nan":   # typer read it as a float, then said "<= 1"
        reason = "not a number"
    return f"{flag} {value}: {reason[:1].lower() + reason[1:]}{hint}"


def main():
    """Run the CLI; every way it can end is one line on stderr (see the module docstring).
    Signals are turned into exceptions by kvf.cli.entry, the program's entry point."""
    debug = "--debug" in sys.argv[1:]
    try:
        if (empty := empty_value(sys.argv[1:])) is not None:
            raise KvfError(f"{empty} (see `{command_path(sys.argv[1:])} --help`)")
        # click's usage errors come to us, to be printed on one line
        code = app(args=with_optional_values(with_equals_values(sys.argv[1:])), prog_name="kvf",
                   standalone_mode=False)
        if code == 130:  # typer turns a KeyboardInterrupt it sees into this code
            raise KeyboardInterrupt
        sys.exit(code if isinstance(code, int) else 0)
    except typer.TyperException as e:  # bad flags and arguments (typer's own click)
        if type(e).__name__ == "NoArgsIsHelpError":   # `kvf`, `kvf store`, `kvf data` alone: their help
            print(e.ctx.get_help())
            sys.exit(0)
        ctx = getattr(e, "ctx", None)
        where = ctx.command_path if ctx is not None else command_path(sys.argv[1:])
        format_message = getattr(e, "format_message", None)
        message = invalid_value_message(" ".join((format_message() if format_message else str(e)).split()), sys.argv[1:])
        try:
            hint = (extra_argument_hint(where, ctx, message) + command_hint(where, message)
                    + option_hint(where, message) + demo_count_hint(where, message))
        except Exception:   # a hint is a nicety: a bug in one must not turn click's one line into a traceback
            if debug:
                raise
            hint = ""
        see = "" if f"{where} --help" in hint else f" (see `{where} --help`)"   # `kvf help`: "Use kvf --help." says it
        print(f"kvf: error: {message}{hint}{see}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2) or 2)
    except Stopped as e:
        e.exit(resumes(sys.argv[1:]))
    except (KeyboardInterrupt, typer.Abort) as e:
        if isinstance(e.__cause__, EOFError):   # click calls any EOFError raised in a command an Abort (Ctrl-D)
            report_unexpected(e.__cause__, debug)
        Interrupted().exit(resumes(sys.argv[1:]))
    except KvfError as e:
        if (stopped := signal_beneath(e)) is not None:   # a check that caught a wrapped signal as its failure
            stopped.exit(resumes(sys.argv[1:]))
        print(f"kvf: error: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        if debug:
            raise
        store_failed(e)   # s3fs raises its refusals as OSErrors
        where = f" {e.filename}:" if e.filename else ""
        if disk_full(e):
            print(f"kvf: error:{where} disk full (no space left on device); free some space there, or write "
                  "elsewhere (--out, --workspace or --store), and re-run", file=sys.stderr)
        else:
            print(f"kvf: error:{where} {e.strerror or e} (check the path and its permissions)", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # a kvf bug: say so in one line; --debug shows where
        if not debug:
            store_failed(e)
            if out_of_memory(e):
                print(f"kvf: error: out of memory ({out_of_memory(e)}); {MEMORY_FIX.get(command_path(sys.argv[1:]), MEMORY_FIX['kvf'])}",
                      file=sys.stderr)
                sys.exit(1)
        report_unexpected(e, debug)


def store_failed(e: BaseException) -> None:
    """Exit in one line where e is the object store's failure mid-command (its endpoint went down, the credentials
    expired): it read as an internal error, "please report it". Opening a store names these already."""
    from kvf.cachestore import remote_failure
    said = remote_failure(e)
    if said:
        again = "; a re-run resumes" if resumes(sys.argv[1:]) else ""
        print(f"kvf: error: {said}{again}", file=sys.stderr)
        sys.exit(1)


# what to lower when a command runs out of memory (torch's allocators raise; the kernel's OOM killer says nothing)
MEMORY_FIX = {
    "kvf run": "shorten the prompts (fewer passages, --top-k), lower --max-new-tokens, or free some memory; "
               "a re-run resumes",
    "kvf build-cache": "lower --chunk-tokens or --batch, use a half --compute-dtype on a GPU, or free some memory; "
                       "a re-run resumes",
    "kvf bench": "time shorter --lengths or fewer --methods, or free some memory",
    "kvf": "free some memory, or give the command less to hold at once",
}


def out_of_memory(e: BaseException) -> str | None:
    """-> the allocator's own words where `e` is an allocation that failed (torch's OutOfMemoryError on a GPU,
    its CPU allocator's RuntimeError, Python's MemoryError), else None."""
    text = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e):
        return text
    return None


def report_unexpected(e: BaseException, debug: bool) -> None:
    """An error no check of kvf's caught: a kvf bug, or the user's method file's. One line and exit; --debug
    raises it, for its traceback."""
    if (stopped := signal_beneath(e)) is not None:
        stopped.exit(resumes(sys.argv[1:]))
    if debug:
        raise e
    blamed = user_method_error(e)
    if blamed is not None:   # raised in a method file of $KVF_METHOD_PATH: the user's code, not kvf's
        print(f"kvf: error: {blamed} (--debug shows the traceback)", file=sys.stderr)
        sys.exit(1)
    message = str(e).splitlines()[0][:200] if str(e) else ""
    print(f"kvf: internal error: {type(e).__name__}: {message} (please report it; re-run with --debug for the "
          "traceback)", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
