"""On demand (`make probe-flags`, 30 to 41 minutes): every option of every kvf command given each of a few bad
values, as a careless user or a broken script would give them, through the real `kvf` program. A value may be
accepted (a workspace named x, a seed of -1); a refusal must be exactly one line, `kvf: error: ...`, naming the
flag, with no traceback and no internal error. The default suite checks the empty value of every flag
(tests/test_catalogue.py); this one tries the rest, which needs the model and takes minutes."""
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import probe_verdict, run_cli
from test_catalogue import SUB_ENV, value_flags

BAD_VALUES = ("-1", "x", "nan", "{cwd}/none/d/f", "-")   # "-": standard input or output, to most tools
PROBE = os.environ.get("KVF_PROBE_FLAGS") == "1"


def base_commands(dataset, ws, run_file, tmp) -> dict[str, list]:
    """A command line per command that works as it is, cheaply; the probed flag is added to (or replaces its
    value in) it. Each writes under its own folder, named by {i}."""
    return {
        "demo": ["demo", "-w", f"{tmp}/{{i}}-demo", "--max-new-tokens", "2", "--questions", "1"],
        "build-cache": ["build-cache", dataset / "corpus", "-w", f"{tmp}/{{i}}-ws", "--no-bm25", "--no-dense",
                        "--chunk-tokens", "64"],
        "run": ["run", "-d", dataset, "-w", ws, "-m", "reuse", "-n", "1", "--max-new-tokens", "2", "--no-show-answers",
                "-o", f"{tmp}/{{i}}-o.jsonl"],
        "search": ["search", "capital", "-w", ws],
        "ask": ["ask", "capital", "-w", ws, "-m", "reuse", "--max-new-tokens", "2"],
        "bench": ["bench", "--random-weights", "tiny", "--lengths", "96", "--chunk-tokens", "32", "-m", "full",
                  "--repeats", "1", "--no-cold", "-o", f"{tmp}/{{i}}-bench"],
        "methods": ["methods"],
        "eval": ["eval", run_file, "-o", f"{tmp}/{{i}}-eval"],
        "compare": ["compare", run_file, "--a", "reuse", "--b", "full"],
        "store info": ["store", "info", ws],
        "store verify": ["store", "verify", ws],
        "store gc": ["store", "gc", ws],
        "data prepare": ["data", "prepare", "custom", "--input", dataset / "questions.jsonl", "-o", f"{tmp}/{{i}}-prep"],
        "data synthetic": ["data", "synthetic", "-o", f"{tmp}/{{i}}-syn", "-n", "1"],
        "data ruler": ["data", "ruler", "-o", f"{tmp}/{{i}}-ruler", "--length", "1024", "-n", "1",
                       "--tasks", "niah_single"],
    }


def with_value(words: list, flag: str, value: str, aliases: dict) -> list[str]:
    """words with flag set to value: the base's own value for it (under any of its names) replaced."""
    words = [str(w) for w in words]
    for i, word in enumerate(words):
        if word == flag or aliases.get(word) == flag:
            return [*words[:i], *words[i + 2:], flag, value]
    return [*words, flag, value]


@pytest.mark.skipif(not PROBE, reason="on demand: make probe-flags (KVF_PROBE_FLAGS=1), 30 to 41 minutes")
def test_every_flag_s_bad_values_are_accepted_or_one_line(built, tmp_path, capsys, monkeypatch):
    """Each bad value is accepted, or refused in one line that makes nothing (in its folder or under its paths)."""
    shutil.copytree(built / "data", tmp_path / "data")
    shutil.copytree(built / "ws", tmp_path / "ws")     # store commands and gc run on a copy
    dataset, ws, run_file = tmp_path / "data", tmp_path / "ws", tmp_path / "run.jsonl"
    assert run_cli(["run", "-d", dataset, "-w", ws, "-m", "full,reuse", "-n", "2", "--max-new-tokens", "2",
                    "--no-show-answers", "-o", run_file], capsys, monkeypatch)[0] == 0
    bases = base_commands(dataset, ws, run_file, tmp_path)
    aliases = {"-w": "--workspace", "-o": "--out", "-m": "--method", "-n": "--limit", "-d": "--dataset"}
    flags = value_flags()
    assert {" ".join(words) for words, _ in flags} <= set(bases), "a command without a base here: add one"
    jobs = []   # (the folder it runs in, its words)
    for (words, flag), value in ((f, v) for f in flags for v in BAD_VALUES):
        i = len(jobs)
        cwd = tmp_path / f"cwd-{i}"   # a folder of its own: a relative value (x, nan) names a new path, not another's
        base = [w.replace("{i}", str(i)) if isinstance(w, str) else w for w in bases[" ".join(words)]]
        jobs.append((i, cwd, with_value(base, flag, value.format(cwd=cwd), aliases)))

    def probe(job):
        i, cwd, args = job
        cwd.mkdir()
        try:
            done = subprocess.run([sys.executable, "-m", "kvf", *args], capture_output=True, text=True,
                                  timeout=300, env=SUB_ENV, cwd=cwd, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return args, "timed out after 300 s"
        made = sorted(str(p) for p in (*cwd.iterdir(), *tmp_path.glob(f"{i}-*")))
        if done.returncode != 0 and made:   # a refusal makes nothing: no empty run file, no --out folder
            return args, f"refused, yet it made {', '.join(made)}"
        return args, probe_verdict(done.returncode, done.stderr, prefix="kvf: ")

    with ThreadPoolExecutor(2) as pool:
        failures = [(args, why) for args, why in pool.map(probe, jobs) if why is not None]
    assert not failures, "\n".join(f"kvf {' '.join(args)}: {why}" for args, why in failures)
