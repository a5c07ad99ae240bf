"""Checked reproductions, pyserini two-click style: does every committed number still come out?

    python -m kvf.scripts.verify            # make verify: re-run every results file's command, check every number
    python -m kvf.scripts.verify --smoke    # make verify-smoke: re-answer a few questions per results file
    python -m kvf.scripts.verify --rescore  # only re-score the committed raw records (seconds)
    python -m kvf.scripts.verify --compare-records GOT COMMITTED  # one re-run file against its committed one

results/expected.yaml lists, for every committed results file, the command that makes it, its
conditions (N, ratios, model, data files with sha256), its key numbers with a tolerance, and:
- `table`: the committed CSV/JSON the numbers are read from (always checked: the file says what
  expected.yaml says);
- `rescore` (optional): a command that recomputes the table from committed raw records into {out}; where the
  committed folder's summary.md says that command made it, --rescore also holds the folder to what `kvf eval`
  renders now (summary.csv byte for byte, summary.md but for its commit), naming the command when it is stale;
- `rerun`: the command that re-runs the conditions from scratch into {out} (hours for a sweep);
- `rerun_records` (optional): `got` (a glob under {out}) and `committed` (a repo glob): after the
  rerun, every committed record must have a re-run twin with the same answer and the same tokens
  recomputed, so a re-run checks every answer and not only the table's means (`min_equal`, optional:
  the fraction of answers that must be equal, where a near-tie is known to flip);
- `smoke` (optional): commands that re-answer a few questions into {out}/smoke.jsonl, whose records
  must equal the committed ones (same answer, same tokens recomputed);
- `requires: cuda` (optional): the rerun needs a CUDA GPU; without one it is skipped and said so (its
  committed table is still checked).
Prints OK / FAIL per number and exits 1 if anything failed. Data files are checked by sha256 first.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml

REPO = Path(__file__).resolve().parents[1]
EXPECTED = REPO / "results" / "expected.yaml"


def load_expected(path: Path = EXPECTED) -> dict:
    return yaml.safe_load(path.read_text())


def data_dir() -> Path:
    return Path(os.environ.get("KVF_DATA") or REPO.parent / "shared" / "data")


def read_table(path: Path) -> pd.DataFrame:
    if path.suffix == ".json":
        return pd.DataFrame([json.loads(path.read_text())])
    return pd.read_csv(path)


def lookup(table: pd.DataFrame, where: dict, column: str) -> float:
    rows = table
    for key, value in (where or {}).items():
        if value in ("", None):  # an unlabelled row: the CSV holds no value there
            rows = rows[rows[key].isna() | (rows[key].astype(str) == "")]
        elif isinstance(value, float):
            rows = rows[(rows[key] - value).abs() < 1e-9]
        else:
            rows = rows[rows[key].astype(str) == str(value)]
    if len(rows) != 1:
        raise LookupError(f"{len(rows)} rows match {where}")
    return float(rows.iloc[0][column])


def within(got: float, number: dict, strict: bool) -> bool:
    """strict: re-scoring the same records must give the same number (to its printed precision)."""
    want = float(number["value"])
    if strict:
        return abs(got - want) <= 5e-4 * max(1.0, abs(want))
    if "relative" in number:
        return abs(got - want) <= float(number["relative"]) * abs(want)
    return abs(got - want) <= float(number.get("tolerance", 0.0))


def check_numbers(name: str, table_path: Path, numbers: list[dict], strict: bool, report: list) -> None:
    try:
        table = read_table(table_path)
    except FileNotFoundError:
        report.append((False, f"{name}: {table_path} was not written"))
        return
    for number in numbers:
        label = f"{name}: {number['name']}"
        bound = "same to print precision" if strict else (f"±{number['relative']:.0%}" if "relative" in number
                                                           else f"±{number.get('tolerance', 0)}")
        checks = [("", number["column"], number["value"])]
        if "interval" in number:  # README prints it: the table's COLUMN_low / COLUMN_high must say the same
            checks += [(f", interval {side}", f"{number['column']}_{side}", want)
                       for side, want in zip(("low", "high"), number["interval"])]
        for what, column, want in checks:
            try:
                got = lookup(table, number.get("where"), column)
            except (LookupError, KeyError) as e:
                report.append((False, f"{label}{what}: not in {table_path.name} ({e})"))
                continue
            ok = within(got, {**number, "value": want}, strict) and not math.isnan(got)
            report.append((ok, f"{label}{what} = {got:.4g} (committed {float(want):.4g}, {bound})"))


def check_rendered(name: str, committed: Path, rescored: Path, rescore: str, report: list) -> None:
    """An eval folder made by its rescore command (its summary.md's first line names that command for the committed
    folder) must read as the command renders it now: the same summary.csv and, but for the commit in that first
    line, the same summary.md, and the same plots. A stale one (made by an older kvf eval) names the command that
    remakes it."""
    from kvf.eval.report import PLOT_PATTERNS
    committed_md, rescored_md = committed.with_name("summary.md"), rescored.with_name("summary.md")
    if committed.name != "summary.csv" or not committed_md.is_file() or not rescored_md.is_file():
        return
    folder = committed.parent.relative_to(REPO)
    command = expand_globs(rescore.replace("{out}", str(folder)))
    header = committed_md.read_text().split("\n", 1)
    if not header[0].startswith(f"Made by `{command}` at commit"):
        return   # made by another command (e.g. more run files than the rescore reads): nothing to compare
    same = committed.read_bytes() == rescored.read_bytes() and \
        header[1:] == rescored_md.read_text().split("\n", 1)[1:]
    report.append((same, f"{name}: {folder}/summary.md and summary.csv "
                         + ("as `kvf eval` renders them now" if same else f"are stale; remake them: {command}")))
    drawn = [{p.name for pattern in PLOT_PATTERNS for p in where.parent.glob(pattern)} for where in (committed, rescored)]
    report.append((drawn[0] == drawn[1], f"{name}: {folder}'s {len(drawn[0])} plots "
                   + ("are those `kvf eval` draws now" if drawn[0] == drawn[1] else
                      f"differ from those `kvf eval` draws now (not drawn now: {sorted(drawn[0] - drawn[1])[:3]}, "
                      f"missing: {sorted(drawn[1] - drawn[0])[:3]}); remake them: {command}")))


def check_data(entry: dict, report: list) -> bool:
    ok = True
    for name, spec in (entry.get("conditions", {}).get("data") or {}).items():
        path = data_dir() / spec["file"]
        if not path.is_file():
            report.append((False, f"data {name}: {path} missing (set KVF_DATA)"))
            ok = False
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        same = digest == spec["sha256"]
        report.append((same, f"data {name}: {spec['file']} sha256 {'matches' if same else 'DIFFERS: ' + digest}"))
        ok &= same
    return ok


def run(command: str, out: Path, log: Path) -> bool:
    """Run one shell-free command line ({out} filled in) from the repo root; its output goes to log."""
    argv = [a.replace("{out}", str(out)) for a in shlex.split(command)]
    if argv[0] == "kvf":
        argv = [os.environ.get("KVF", str(Path(sys.executable).with_name("kvf")))] + argv[1:]
    elif argv[0] == "python":  # this interpreter, whose environment has kvf installed
        argv = [sys.executable] + argv[1:]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        return subprocess.run(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode == 0


def expand_globs(command: str) -> str:
    """Commands run without a shell: expand REPO-relative globs (results/methods/runs/*.jsonl) here."""
    parts = []
    for token in shlex.split(command):
        if "*" in token and "{out}" not in token:
            parts += sorted(str(p.relative_to(REPO)) for p in REPO.glob(token)) or [token]
        else:
            parts.append(token)
    return shlex.join(parts)


def compare_records(name: str, got: list[Path], committed: list[Path], report: list, every: bool,
                    min_equal: float = 1.0) -> None:
    """Each re-run record must equal the committed record of the same question, method, ratio and knobs
    (same answer, tokens recomputed and prompt length); with every=True each committed record must also
    have been re-run. min_equal < 1 lets that fraction of answers differ (a greedy near-tie that a
    change in float summation order flips), each listed."""
    from kvf.pipeline.records import read_records
    from kvf.pipeline.workflows.run import record_key

    def key(r):
        return record_key(r.qid, r.method, r.label, r.settings)
    reference = {key(r): r for path in committed for r in read_records(path)}
    records = [r for path in got if path.is_file() and path.stat().st_size for r in read_records(path)]
    if not records:
        report.append((False, f"{name}: the re-run wrote no records"))
        return
    equal, compared, differing, missing = 0, 0, [], set(reference)
    for r in records:
        ref = reference.get(key(r))
        label = f"{r.qid} {r.method}@{r.ratio:g}"
        if ref is None:
            report.append((False, f"{name}: {label}: no committed record to compare with"))
            continue
        missing.discard(key(r))
        compared += 1
        if r.recomputed_tokens != ref.recomputed_tokens or r.prompt_tokens != ref.prompt_tokens:
            report.append((False, f"{name}: {label}: recomputed {r.recomputed_tokens} of {r.prompt_tokens} tokens,"
                                  f" committed {ref.recomputed_tokens} of {ref.prompt_tokens}"))
        elif r.answer != ref.answer:
            differing.append(f"{label} {r.answer!r} (committed {ref.answer!r})")
        else:
            equal += 1
    line = f"{name}: {equal} of {compared} re-run answers equal the committed ones"
    if min_equal < 1:
        line += f" (expected.yaml asks for {min_equal:.0%})"
    if differing:
        line += "; differing: " + "; ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
    report.append((equal >= min_equal * compared and equal > 0, line))
    if every and missing:
        report.append((False, f"{name}: {len(missing)} committed records were not re-run"))


def verify(mode: str, only: list[str] | None, keep: Path | None) -> int:
    expected = load_expected()
    unknown = [name for name in only or [] if name not in expected]
    if unknown:   # a misspelt name would otherwise check nothing and print "0 OK, 0 FAIL"
        print(f"kvf: error: --only {' '.join(unknown)}: not in results/expected.yaml; "
              f"give one of: {', '.join(expected)}", file=sys.stderr)
        return 2
    report: list[tuple[bool, str]] = []
    skipped: list[str] = []
    work = Path(keep or tempfile.mkdtemp(prefix="kvf-verify-"))
    work.mkdir(parents=True, exist_ok=True)
    for name, entry in expected.items():
        if only and name not in only:
            continue
        out = work / Path(name).stem
        out.mkdir(parents=True, exist_ok=True)
        log = out / "log.txt"
        numbers = entry.get("numbers", [])
        check_numbers(name, REPO / entry["table"], numbers, strict=True, report=report)   # the committed file
        if mode == "smoke":
            steps = entry.get("smoke")
            if not steps:
                continue
            if not check_data(entry, report):
                continue
            ok = all(run(step, out, log) for step in steps["commands"])
            report.append((ok, f"{name}: smoke commands " + ("ran" if ok else f"failed (see {log})")))
            if ok:
                compare_records(name, [out / "smoke.jsonl"], sorted(REPO.glob(steps["records"])), report, every=False)
        elif mode == "rescore" or (mode == "full" and "rescore" in entry and "rerun" not in entry):
            if "rescore" in entry:
                ok = run(expand_globs(entry["rescore"]), out, log)
                check_numbers(name, out / Path(entry["table"]).name, numbers, strict=True, report=report) if ok else \
                    report.append((False, f"{name}: rescore failed (see {log})"))
                if ok:
                    check_rendered(name, REPO / entry["table"], out / Path(entry["table"]).name, entry["rescore"], report)
        else:  # full: re-run the conditions from scratch
            if entry.get("requires") == "cuda" and not cuda_available():
                skipped.append(f"{name}: its rerun needs a CUDA GPU; run `python -m kvf.scripts.verify --only {name}` on one")
                continue
            if "rerun" not in entry:
                report.append((False, f"{name}: results/expected.yaml lists no `rerun` for it; add the command that remakes it into {{out}}"))
                continue
            if "rescore" in entry:
                rescored = out / "rescore"
                rescored.mkdir(exist_ok=True)
                if run(expand_globs(entry["rescore"]), rescored, log):
                    check_numbers(name, rescored / Path(entry["table"]).name, numbers, strict=True, report=report)
            if not check_data(entry, report):
                continue
            ok = all(run(step, out, log) for step in entry["rerun"])
            if not ok:
                report.append((False, f"{name}: rerun failed (see {log})"))
                continue
            check_numbers(name, out / entry["rerun_table"], numbers, strict=False, report=report)
            if "rerun_records" in entry:
                pair = entry["rerun_records"]
                compare_records(name, sorted(out.glob(pair["got"])), sorted(REPO.glob(pair["committed"])), report,
                                every=True, min_equal=pair.get("min_equal", 1.0))
    failed = print_report(report)
    for line in skipped:
        print("SKIP " + line)
    if failed or keep:   # the logs of what failed stay to be read
        where = f"work in {work}"
    else:                # a clean pass leaves nothing behind in /tmp (a rescore's tables are ~100 MB)
        shutil.rmtree(work, ignore_errors=True)
        where = "work dir removed; --keep DIR keeps it"
    print(f"{len(report) - failed} OK, {failed} FAIL{f', {len(skipped)} SKIP' if skipped else ''} ({mode}; {where})")
    return 1 if failed else 0


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def print_report(report: list[tuple[bool, str]]) -> int:
    """One OK / FAIL line per check; how many failed."""
    for ok, line in report:
        print(("OK   " if ok else "FAIL ") + line)
    return sum(not ok for ok, _ in report)


def compare_run_file(got: Path, committed: Path) -> int:
    """One re-run file against its committed run file, record by record, every committed record required:
    how a results file too long to re-run at once (ruler.md) is checked one run file at a time."""
    for flag, path in (("GOT", got), ("COMMITTED", committed)):
        if not path.is_file():
            print(f"kvf: error: --compare-records {flag}: {path} is not a file; give a run file (.jsonl or .jsonl.gz)",
                  file=sys.stderr)
            return 2
    report: list = []
    compare_records(committed.name, [got], [committed], report, every=True, min_equal=min_equal_for(committed))
    return 1 if print_report(report) else 0


def min_equal_for(committed: Path) -> float:
    """The share of equal answers results/expected.yaml asks of the results file this run file belongs to
    (its rerun_records.committed glob), so a partial re-run is held to what `make verify` holds the whole to."""
    where = committed.resolve()
    for entry in load_expected().values():
        pair = entry.get("rerun_records")
        if pair and any(p.resolve() == where for p in REPO.glob(pair["committed"])):
            return pair.get("min_equal", 1.0)
    return 1.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="re-answer a few questions")
    group.add_argument("--rescore", action="store_const", dest="mode", const="rescore", help="re-score committed records")
    group.add_argument("--compare-records", nargs=2, type=Path, metavar=("GOT", "COMMITTED"),
                       help="check one re-run file against its committed run file, every record (a partial re-run)")
    parser.add_argument("--only", nargs="*", help="results files to check (default: all in expected.yaml)")
    parser.add_argument("--keep", type=Path, help="work directory to keep (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.compare_records:
        return compare_run_file(*args.compare_records)
    return verify(args.mode or "full", args.only, args.keep)


if __name__ == "__main__":
    sys.exit(main())
