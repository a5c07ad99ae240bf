"""Committed numbers check themselves: results/expected.yaml agrees with the committed results
tables, the README's numbers are generated from it, the Makefile's defaults are its conditions,
every results file says what made it, a re-run is checked answer by answer, and `make verify-smoke`
reproduces committed records."""
import json
import os
import re
import sys
from pathlib import Path

import pytest

from kvf.scripts import readme, verify

REPO = verify.REPO
EXPECTED = verify.load_expected()


def test_committed_tables_hold_the_expected_numbers():
    report = []
    for name, entry in EXPECTED.items():
        verify.check_numbers(name, REPO / entry["table"], entry["numbers"], strict=True, report=report)
    assert report and all(ok for ok, _ in report), [line for ok, line in report if not ok]


def test_a_stale_interval_fails_even_when_the_value_holds(tmp_path):
    """README prints a number's interval from expected.yaml: the table's bounds must agree too."""
    table = tmp_path / "summary.csv"
    table.write_text("dataset,method,vs_full,vs_full_low,vs_full_high\nd,m,-0.075,-0.125,-0.025\n")
    number = {"name": "m vs full", "where": {"dataset": "d", "method": "m"}, "column": "vs_full",
              "value": -0.075, "tolerance": 0.05}
    for interval, ok in (([-0.125, -0.025], True), ([-0.2, -0.0375], False)):
        report = []
        verify.check_numbers("x.md", table, [{**number, "interval": interval}], strict=True, report=report)
        assert len(report) == 3 and report[0][0]
        assert all(good for good, _ in report) is ok, report


def test_readme_numbers_are_generated_from_expected_yaml():
    assert readme.current_block(), "README.md lost its results markers"
    assert readme.current_block() == readme.render(), "README numbers are stale: run `python -m kvf.scripts.readme --write`"
    # each file's numbers carry their conditions: results/s3.md's line once read "(`make bench-s3`; )"
    for line in readme.render().splitlines():
        if line.startswith("- `results/"):
            conditions = line.split("`; ", 1)[1]
            assert conditions.strip("):") and ("model = " in conditions or "endpoint = " in conditions), line


def makefile_defaults() -> dict:
    text = (REPO / "Makefile").read_text()
    return dict(re.findall(r"^(\w+) \?= (.*)$", text, flags=re.M))


def test_makefile_defaults_are_the_committed_conditions():
    defaults = makefile_defaults()
    for name, entry in EXPECTED.items():
        for variable, value in (entry.get("makefile") or {}).items():
            assert defaults.get(variable) == str(value), f"{name}: Makefile {variable} ?= {defaults.get(variable)}, committed {value}"


def test_make_verify_can_remake_every_results_file():
    """`make verify` re-runs `rerun` (or, where the file only summarises committed records, `rescore`)."""
    for name, entry in EXPECTED.items():
        assert "rerun" in entry or "rescore" in entry, f"{name}: no rerun or rescore command in expected.yaml"
        if "rerun" in entry:
            assert "{out}" in " ".join(entry["rerun"]) and "rerun_table" in entry, f"{name}: rerun must write into {{out}}"
        pair = entry.get("rerun_records")
        if pair is not None:
            assert {"got", "committed"} <= set(pair) <= {"got", "committed", "min_equal"}, f"{name}: rerun_records keys"
            assert sorted(REPO.glob(pair["committed"])), f"{name}: rerun_records.committed matches no file"
            assert 0 < pair.get("min_equal", 1.0) <= 1, f"{name}: rerun_records.min_equal must be in (0, 1]"


def test_a_rerun_checks_every_answer_against_the_committed_records(tmp_path):
    """`rerun_records`: a re-run whose numbers hold but whose answers moved, or which skipped records, fails."""
    committed = REPO / "results" / "kvfuse" / "runs" / "test-b-musique.jsonl"
    lines = committed.read_text().splitlines()
    got = tmp_path / "runs.jsonl"

    def compare(text, min_equal=1.0):
        got.write_text(text)
        report = []
        verify.compare_records("x.md", [got], [committed], report, every=True, min_equal=min_equal)
        return [ok for ok, _ in report], report
    oks, report = compare("\n".join(lines) + "\n")
    assert oks == [True] and f"{len(lines)} of {len(lines)}" in report[0][1]
    first = json.loads(lines[0])
    moved = "\n".join([json.dumps({**first, "answer": first["answer"] + " not"})] + lines[1:]) + "\n"
    assert compare(moved)[0] == [False]
    for min_equal, ok in ((1 - 1 / len(lines), True), (1 - 0.5 / len(lines), False)):
        oks, report = compare(moved, min_equal)
        assert oks == [ok] and "not'" in report[0][1], report
    recomputed = "\n".join([json.dumps({**first, "recomputed_tokens": first["recomputed_tokens"] - 1})] + lines[1:]) + "\n"
    oks, report = compare(recomputed, 1 - 1 / len(lines))   # a different token count is never a near-tie
    assert oks == [False, True] and f"{len(lines) - 1} of {len(lines)}" in report[1][1], report
    oks, report = compare("\n".join(lines[1:]) + "\n")
    assert oks == [True, False] and "1 committed records were not re-run" in report[1][1]


def test_one_rerun_file_is_checked_against_its_committed_file(tmp_path, capsys):
    """--compare-records: a partial re-run of a long results file, one run file at a time."""
    committed = REPO / "results" / "kvfuse" / "runs" / "test-b-musique.jsonl"
    lines = committed.read_text().splitlines()
    got = tmp_path / "got.jsonl"
    got.write_text("\n".join(lines[::-1]) + "\n")                   # same records, another order
    assert verify.main(["--compare-records", str(got), str(committed)]) == 0
    assert f"OK   test-b-musique.jsonl: {len(lines)} of {len(lines)}" in capsys.readouterr().out
    got.write_text("\n".join(lines[1:]) + "\n")                     # one committed record not re-run
    assert verify.main(["--compare-records", str(got), str(committed)]) == 1
    assert "1 committed records were not re-run" in capsys.readouterr().out
    ruler = REPO / "results" / "ruler" / "runs" / "ruler-2048-s2.jsonl"     # expected.yaml lets 1% differ here
    records = [json.loads(line) for line in ruler.read_text().splitlines()]
    records[0]["answer"] += " (a near-tie parted)"
    got.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert verify.min_equal_for(ruler) == EXPECTED["results/ruler.md"]["rerun_records"]["min_equal"] < 1
    assert verify.main(["--compare-records", str(got), str(ruler)]) == 0
    assert f"{len(records) - 1} of {len(records)} re-run answers equal" in capsys.readouterr().out
    assert verify.main(["--compare-records", str(tmp_path / "missing.jsonl"), str(committed)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compare-records GOT" in err and "missing.jsonl" in err


def test_an_unknown_results_file_name_is_refused_in_one_line(capsys):
    """--only with a name expected.yaml does not list must not check nothing and report success."""
    assert verify.main(["--rescore", "--only", "results/methods.md", "results/nosuch.md"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert "--only results/nosuch.md" in out.err and "results/methods.md" in out.err


def test_a_rerun_that_needs_a_gpu_is_skipped_and_said_so_without_one(tmp_path, capsys, monkeypatch):
    """results/gpu.md cannot be re-made on a CPU: verify says so instead of failing, and still checks its table."""
    monkeypatch.setattr(verify, "cuda_available", lambda: False)
    assert verify.main(["--only", "results/gpu.md", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SKIP results/gpu.md: its rerun needs a CUDA GPU" in out and ", 1 SKIP (full;" in out
    assert out.count("OK   results/gpu.md") == len(EXPECTED["results/gpu.md"]["numbers"])


def test_every_results_file_says_what_made_it():
    for name in EXPECTED:
        text = (REPO / name).read_text()
        assert re.search(r"Made by `[^`]+` at commit [0-9a-f]{7,}", text), f"{name} does not state its command and commit"


def test_each_results_file_is_its_header_and_the_summary_the_makefile_puts_under_it():
    """results/methods.md (and ceiling, hotpotqa, ruler, ruler_calibration) is `cat scripts/X_header.md
    X/summary.md`, by its make target. Five of them had drifted from that: their summary.md was remade and they were
    not, so they stated tests ("significantly below full: none") that their own summary.md called not tested."""
    makefile = (REPO / "Makefile").read_text()
    outs = dict(re.findall(r"^(\w+_OUT) \?= (\S+)$", makefile, flags=re.M))
    joined = re.findall(r"^\tcat (scripts/\w+_header\.md) \$\((\w+_OUT)\)/summary\.md > \$\(\2\)\.md$", makefile, flags=re.M)
    assert len(joined) >= 5, joined
    for header, out in joined:
        made = (REPO / header).read_text() + (REPO / outs[out] / "summary.md").read_text()
        assert (REPO / f"{outs[out]}.md").read_text() == made, f"{outs[out]}.md is not {header} + {outs[out]}/summary.md"


def test_every_committed_eval_folder_has_the_runs_table_kvf_eval_renders_now():
    """A column added to kvf eval's runs table (libraries) left 54 committed summary.md files stale, which only
    `make verify --rescore` (20 minutes) said: each folder kvf eval made must carry the runs table's columns of today."""
    from kvf.eval.report import RUNS_HEADER
    stale = [str(summary.relative_to(REPO)) for summary in sorted((REPO / "results").glob("**/summary.md"))
             if summary.read_text().startswith("Made by `kvf eval") and RUNS_HEADER not in summary.read_text().splitlines()]
    assert not stale, f"remake them (the command on each one's first line): {stale}"


@pytest.mark.long
@pytest.mark.skipif(not (Path(os.environ.get("KVF_DATA") or REPO.parent / "shared" / "data") / "musique").is_dir(),
                    reason="benchmark data not available (set KVF_DATA)")
def test_verify_smoke_reproduces_committed_records(tmp_path, capsys):
    assert verify.main(["--smoke", "--keep", str(tmp_path)]) == 0, capsys.readouterr().out


def test_verify_removes_its_temp_work_dir_after_a_clean_pass_and_keeps_it_after_a_failure(tmp_path, monkeypatch,
                                                                                          capsys):
    """A re-score writes ~100 MB of tables per run: a pass leaves nothing in /tmp; a failure keeps the logs."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    only = ["results/recompute_cost.md"]   # committed numbers only in --smoke: no model, seconds

    def work_dirs():
        return [p.name for p in tmp_path.iterdir() if p.name.startswith("kvf-verify-")]
    assert verify.main(["--smoke", "--only", *only]) == 0
    assert work_dirs() == [] and "work dir removed" in capsys.readouterr().out
    monkeypatch.setattr(verify, "check_numbers", lambda name, *a, report, **k: report.append((False, f"{name}: off")))
    assert verify.main(["--smoke", "--only", *only]) == 1
    kept = work_dirs()
    assert len(kept) == 1 and f"work in {tmp_path / kept[0]}" in capsys.readouterr().out


def test_a_results_file_names_a_dirty_commit_only_when_code_changed(tmp_path, monkeypatch):
    """Re-scoring rewrites results/ while it runs: that must not mark the commit '-dirty'; a changed
    source file must."""
    import subprocess

    from kvf.pipeline.workflows import provenance

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "summary.md").write_text("old\n")
    (tmp_path / "stats.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(provenance, "REPO_ROOT", tmp_path)

    def commit():
        provenance.git_commit.cache_clear()
        return provenance.git_commit()

    assert re.fullmatch(r"[0-9a-f]{40}", commit())
    (tmp_path / "results" / "summary.md").write_text("new\n")
    assert not commit().endswith("-dirty")
    (tmp_path / "stats.py").write_text("x = 2\n")
    assert commit().endswith("-dirty")
    provenance.git_commit.cache_clear()


def test_logit_gap_records_the_top_two_gap_of_every_row_and_restores_the_model():
    """scripts/logit_gap.py: the evidence that a differing re-run answer is a greedy near-tie."""
    import torch
    from conftest import tiny_model
    from kvf.pipeline.model.forward import Transformer
    from kvf.scripts.logit_gap import recorded_gaps
    model = Transformer(tiny_model("llama"))
    original = Transformer.logits
    hidden = torch.randn(3, model.config.hidden_size)
    with recorded_gaps() as gaps:
        out = model.logits(hidden)
    top = out.topk(2, dim=-1).values
    assert gaps == [(top[:, 0] - top[:, 1]).tolist()] and all(g >= 0 for g in gaps[0])
    assert Transformer.logits is original


def test_logit_gap_refuses_a_bad_ratio_and_a_missing_dataset_in_one_line(tmp_path, capsys):
    from kvf.scripts import logit_gap
    (tmp_path / "data").mkdir()
    for data, argv, flag in (("data", ["-r", "1.5"], "--ratio 1.5"), ("data", ["-r", "x"], "--ratio x"),
                             ("missing", [], "--dataset")):
        code = logit_gap.main(["-d", str(tmp_path / data), "--qid", "q", "-m", "full", "-o", str(tmp_path / "o.jsonl")] + argv)
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and err.startswith("kvf: error: ") and flag in err, err


def test_every_committed_results_file_is_listed_in_expected_yaml():
    """A results file that expected.yaml does not list would be checked by nothing."""
    listed = set(EXPECTED)
    for path in sorted((REPO / "results").glob("*.md")):
        name = f"results/{path.name}"
        assert name == "results/verified.md" or name in listed, f"{name} is not in results/expected.yaml"


def test_every_committed_eval_folder_is_rescored_by_verify():
    """results/kvfuse/test, heldout-k-musique, heldout-k-ruler and heldout-musique were listed nowhere, so `verify
    --rescore` never saw test/ go stale after a note changed, nor checked the numbers results/kvfuse.md cites from
    them. Every folder `kvf eval` wrote under results/ now has an entry whose rescore is the command its summary.md
    says made it (else verify's check_rendered skips the folder without a word)."""
    rescored = {entry["table"]: entry["rescore"] for entry in EXPECTED.values() if "rescore" in entry}
    for summary in sorted((REPO / "results").glob("**/summary.md")):
        folder = summary.parent.relative_to(REPO)
        if not summary.read_text().startswith("Made by `kvf eval"):
            continue
        rescore = rescored.get(f"{folder}/summary.csv")
        assert rescore, f"{folder}/summary.csv is no results/expected.yaml entry's table with a rescore"
        command = verify.expand_globs(rescore.replace("{out}", str(folder)))
        assert summary.read_text().startswith(f"Made by `{command}` at commit"), folder


def test_bench_gpu_load_without_a_gpu_says_so_in_one_line(capsys, monkeypatch):
    """A CPU machine (CI's) gets one `kvf: error:` line, not a traceback; so does an unknown shape on a GPU."""
    import torch
    from kvf.scripts import bench_gpu_load
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu_load.main([]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvf: error: ") and "CUDA GPU" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench_gpu_load.main(["--random-weights", "nosuch"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--random-weights nosuch" in err


def test_verify_runs_python_commands_with_its_own_interpreter(tmp_path):
    """expected.yaml commands that start with `python` (scripts) run in verify's environment, where kvf is
    installed, not in whatever `python` the PATH finds first."""
    log = tmp_path / "log.txt"
    assert verify.run("python -c 'import kvf.scripts.selection_probe'", tmp_path, log), log.read_text()
    assert log.read_text().startswith(f"$ {sys.executable} ")


@pytest.mark.parametrize("probe", ["selection_probe", "correction_probe", "requery_probe"])
def test_probes_refuse_a_missing_dataset_or_report_in_one_line(tmp_path, capsys, probe):
    import importlib
    script = importlib.import_module(f"kvf.scripts.{probe}")
    for argv, named in ((["--dataset", str(tmp_path / "none"), "--records", str(tmp_path / "r.jsonl")], "none"),
                        (["--report", str(tmp_path / "r.jsonl")], "--report"), ([], "--records FILE")):
        code = script.main(argv)
        err = capsys.readouterr().err
        assert code in (1, 2) and err.count("\n") == 1 and "error: " in err and named in err, err


def test_kvf_bench_and_eval_do_not_write_over_committed_evidence_by_default():
    """Run from the repository with their default --out, `kvf bench` and `kvf eval` must not replace a
    results file that results/expected.yaml holds (results/ttft.md is `make ttft`'s, with its conditions)."""
    import inspect

    from kvf.cli.bench_cmd import bench_command
    from kvf.cli.eval_cmd import eval_command
    from kvf.pipeline.workflows.bench import BenchOptions
    committed = {(REPO / name).parent.resolve() for name in EXPECTED}
    defaults = {"kvf bench": inspect.signature(bench_command).parameters["out"].default.default,
                "kvf eval": inspect.signature(eval_command).parameters["out"].default,
                "BenchOptions": BenchOptions().out}
    for command, out in defaults.items():
        assert (REPO / out).resolve() not in committed, f"{command} writes into {out}, beside committed evidence"


def test_the_budget_oracle_finds_the_best_allocation_a_brute_force_finds():
    """scripts/budget_oracle.py bounds any per-question budget rule by the best allocation of the swept ratios
    at a mean of at most 0.15: its dynamic programme must find what trying every allocation finds."""
    import itertools
    import numpy as np
    import pandas as pd
    from kvf.scripts.budget_oracle import best_allocation
    rng = np.random.default_rng(0)
    ratios = [0.0, 0.05, 0.15, 0.3]
    for _ in range(20):
        fidelity = pd.DataFrame(rng.random((5, 4)), columns=ratios, index=[f"q{i}" for i in range(5)])
        chosen = best_allocation(fidelity, 0.15)
        assert chosen.mean() <= 0.15 + 1e-9
        got = sum(fidelity.loc[q, r] for q, r in chosen.items())
        best = max(sum(fidelity.iloc[i][r] for i, r in enumerate(pick)) for pick in itertools.product(ratios, repeat=5)
                   if sum(pick) <= 0.15 * 5 + 1e-9)
        assert got == pytest.approx(best)


@pytest.mark.parametrize("args,said", [(["--runs", "nope.jsonl"], "budget_oracle: run file nope.jsonl does not exist; pass the "
                                                                        ".jsonl file (or the folder of them) that `kvf run -o` wrote"),
                                       (["--runs", "nope.jsonl", "--mean", "0"], "budget_oracle: --mean 0: a mean ratio within (0, 1]")])
def test_the_budget_oracle_refuses_bad_input_in_one_line(args, said, tmp_path):
    from kvf.scripts import budget_oracle
    with pytest.raises(SystemExit) as exit_info:
        budget_oracle.main([*args, "--out", str(tmp_path / "b.md")])
    assert str(exit_info.value) == said


def test_the_spread_probe_refuses_bad_input_in_one_line(tmp_path, capsys):
    from kvf.scripts import spread_probe
    out = ["--out", str(tmp_path / "s.md")]
    for argv, code, named in ((["--data", str(tmp_path)], 2, "one run file per dataset"),
                              (["--data", str(tmp_path / "none"), "--runs", str(tmp_path / "r.jsonl")], 1, "none"),
                              (["--replot"], 1, "s.csv")):
        assert spread_probe.main([*argv, *out]) == code
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("spread_probe: error: ") and named in err, err
    assert not (tmp_path / "s.md").exists()


def test_probe_legends_name_the_shared_knobs_once():
    from kvf.eval.plots import shared_knobs
    from kvf.scripts.read_probe import FULL
    full = frozenset({FULL})
    labels, common = shared_knobs([FULL, "a=1:b=2", "a=1:b=2:c=3", "a=1:b=2:d=4:e=5"], full)
    assert common == "a=1:b=2" and labels == [FULL, "base", "base + c=3", "base + d=4 + e=5"]
    assert shared_knobs([FULL, "a=1:b=2"], full) == ([FULL, "a=1:b=2"], None)  # one entry: as it is
    assert shared_knobs(["x=1", "y=2"]) == (["x=1", "y=2"], None)              # nothing shared
    assert shared_knobs(["", "x=1:y=2", "x=1"]) == (["", "base + y=2", "base"], "x=1")   # unlabelled rows kept


@pytest.mark.parametrize("probe", ["hop_probe", "read_probe", "value_probe", "divergence_probe"])
def test_the_hop_read_value_and_divergence_probes_refuse_bad_input_in_one_line(tmp_path, capsys, probe):
    import importlib
    script = importlib.import_module(f"kvf.scripts.{probe}")
    out = ["--out", str(tmp_path / "h.md")]
    built = tmp_path / "built"
    (built / "workspace").mkdir(parents=True)
    (built / "workspace" / "manifest.json").write_text("{}")
    for argv, code, named in ((["--data", str(tmp_path)], 2, "--methods"),
                              (["--data", str(tmp_path), "--methods", "kvfuse", "--runs", "a", "b"], 2, "--runs"),
                              (["--data", str(tmp_path / "none"), "--methods", "kvfuse"], 1, "none"),
                              (["--data", str(built), "--methods", "prophetkv"], 1, "--methods prophetkv"),
                              (["--data", str(built), "--methods", "kvfuse:hop_weight=1"], 1, "hop_rows"),
                              (["--data", str(built), "--methods", "kvfuse:hops=2"], 1, "no knob 'hops'"),
                              (["--replot"], 1, "h.csv")):
        assert script.main([*argv, *out]) == code
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"{probe}: error: ") and named in err, err
    assert not (tmp_path / "h.md").exists()


@pytest.mark.parametrize("probe", ["hop_probe", "divergence_probe"])
def test_the_probes_refuse_a_run_file_made_over_other_neighbours(tmp_path, capsys, probe):
    """A run file made with --neighbours 3 read fusion KVs that a workspace built with 10 does not hold: probing it
    there compared another cache with the run's answers (QA probes ran so until the check), so it is refused."""
    import importlib
    import json
    script = importlib.import_module(f"kvf.scripts.{probe}")
    data = tmp_path / "musique"
    (data / "corpus").mkdir(parents=True)
    (data / "corpus" / "passages.jsonl").write_text(json.dumps({"id": "p1", "title": "t", "text": "x"}) + "\n")
    (data / "questions.jsonl").write_text(json.dumps({"id": "q1", "question": "?", "answers": ["a"],
                                                      "context_ids": ["p1"]}) + "\n")
    (data / "workspace").mkdir()
    (data / "workspace" / "manifest.json").write_text(json.dumps({"n_neighbours": 10}))
    run = {"qid": "q1", "dataset": "musique", "method": "kvfuse", "settings": {"ratio": 0.15, "n_neighbours": 3},
           "chunk_ids": ["c1"], "question": "?", "answer": "a", "gold": ["a"], "prompt_tokens": 9,
           "chunk_tokens": 1, "recomputed_tokens": 0,
           "timings": {"load": 0.0, "select": 0.0, "recompute": 0.0, "first_token": 0.1, "decode": 0.1}}
    runs = tmp_path / "runs.jsonl"
    runs.write_text(json.dumps(run) + "\n")
    argv = ["--data", str(data), "--runs", str(runs), "--methods", "kvfuse", "--out", str(tmp_path / "p.md")]
    assert script.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--neighbours 3" in err and "built with 10" in err and str(runs) in err, err
    (data / "workspace" / "manifest.json").write_text("{")                    # a damaged manifest: named, no traceback
    assert script.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "manifest.json" in err, err
    assert not (tmp_path / "p.md").exists()


def test_a_probe_table_says_none_where_it_has_no_rows():
    from kvf.scripts.locate_probe import table_lines
    assert table_lines(["a", "b", "c"], []) == ["| a | b | c |", "|---|---|---|", "| (none) | | |"]
    assert table_lines(["a", "b"], ["| 1 | 2 |"]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]


@pytest.mark.parametrize("argv,named", [(["--offset", "-3"], "--offset -3"), (["-n", "0"], "-n 0"),
                                        (["-n", "-1"], "-n -1")])
def test_the_divergence_probe_refuses_a_negative_offset_or_count_in_one_line(tmp_path, capsys, argv, named):
    """A negative --offset or -n was a slice from the end (a silent other selection), -n 0 an empty table's KeyError."""
    from kvf.scripts import divergence_probe
    data = tmp_path / "built"
    (data / "workspace").mkdir(parents=True)
    (data / "workspace" / "manifest.json").write_text("{}")
    assert divergence_probe.main(["--data", str(data), "--methods", "kvfuse", *argv, "--out", str(tmp_path / "d.md")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"divergence_probe: error: {named}: "), err
    assert not (tmp_path / "d.md").exists()


def test_a_probe_that_probes_no_sample_says_so_in_one_line(tmp_path, capsys):
    """An offset past the last question (or a run file naming none of them) left an empty table, which the report
    read as a KeyError traceback."""
    import pandas as pd
    from kvf.pipeline.fusion.methods.kvfuse import KvFuse
    from kvf.scripts.hop_probe import kvfuse_probe_main
    data = tmp_path / "built"
    (data / "workspace").mkdir(parents=True)
    (data / "workspace" / "manifest.json").write_text("{}")
    never = lambda *a: pytest.fail("nothing to plot or report")                  # noqa: E731
    argv = ["--data", str(data), "--methods", "kvfuse", "--out", str(tmp_path / "p.md")]
    assert kvfuse_probe_main("p", "doc", "p.md", KvFuse, lambda *a: pd.DataFrame(), never, never, argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"p: error: --data {data}: no sample was probed"), err


def test_the_divergence_probe_finds_where_two_answers_part_and_full_prefills_margin():
    import torch
    from kvf.pipeline.model.decode import first_difference
    from kvf.scripts.divergence_probe import ecdf, margins
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 7]) == 2                              # one answer stops first
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])                      # [T, vocab]
    torch.testing.assert_close(margins(probs), torch.tensor([0.3, 0.4]))
    import pandas as pd
    assert ecdf(pd.Series([0.3, 0.1, 0.2, 0.1])) == ([0.1, 0.1, 0.2, 0.3], [0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize("answer,gold,cut", [
    ("The special magic number for velvet is 712472.", ["7124722"], True),     # begun, the last digit lost
    ("The special magic number for velvet is 7124722.", ["7124722"], False),   # the whole number
    ("The special magic number for lemon is 12.", ["1234567"], False),          # two digits: any number's start
    ("The special magic number for ember is: 999999.", ["9709422"], False),     # another number
    ("7124722 and 881", ["7124722", "8812345"], True),                          # one of two values cut
])
def test_a_cut_copy_is_a_gold_number_begun_and_cut_short(answer, gold, cut):
    from kvf.scripts.copy_probe import cut_copy
    assert cut_copy(answer, gold) is cut


def test_the_copy_probe_refuses_bad_input_in_one_line(tmp_path):
    from kvf.scripts import copy_probe
    with pytest.raises(SystemExit) as exit_info:
        copy_probe.main(["--runs", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "c.md")])
    assert str(exit_info.value).startswith("copy_probe: ") and "nope.jsonl" in str(exit_info.value)
    assert "\n" not in str(exit_info.value) and not (tmp_path / "c.md").exists()
    with pytest.raises(SystemExit) as exit_info:                 # --rows on a folder that holds no prepared dataset
        copy_probe.main(["--rows", str(tmp_path), "some-qid"])
    assert str(exit_info.value).startswith("copy_probe: ") and "\n" not in str(exit_info.value)


def test_a_stale_eval_folder_names_the_command_that_remakes_it(tmp_path, monkeypatch):
    """verify --rescore checked a folder's numbers only: summary.md written by an older `kvf eval` (other notes,
    other reasons on its significance lines) passed. Now a folder its rescore command made must read as that
    command renders it today, but for the commit in its first line; one made by another command is not compared."""
    monkeypatch.setattr(verify, "REPO", tmp_path)
    committed, rescored = tmp_path / "results" / "x", tmp_path / "out"
    committed.mkdir(parents=True)
    rescored.mkdir()
    command = "kvf eval results/x/runs.jsonl --out {out}"
    body = "\nRuns:\n\n| a | b |\n"
    for folder, made_by, commit in ((committed, "results/x", "abc"), (rescored, str(rescored), "def")):
        (folder / "summary.csv").write_text("dataset,f1\nd,0.5\n")
        (folder / "summary.md").write_text(f"Made by `kvf eval results/x/runs.jsonl --out {made_by}` at commit {commit}.\n" + body)
    for folder in (committed, rescored):
        (folder / "ttft_vs_ratio.png").write_bytes(b"\x89PNG")
    report = []
    verify.check_rendered("x.md", committed / "summary.csv", rescored / "summary.csv", command, report)
    assert report == [(True, "x.md: results/x/summary.md and summary.csv as `kvf eval` renders them now"),
                      (True, "x.md: results/x's 1 plots are those `kvf eval` draws now")]
    # a plot an earlier eval drew (a ratio since left out of the runs) sat beside the summary as its own
    (committed / "ranking_x_ratio0.3.png").write_bytes(b"\x89PNG")
    report = []
    verify.check_rendered("x.md", committed / "summary.csv", rescored / "summary.csv", command, report)
    assert report[1] == (False, "x.md: results/x's 2 plots differ from those `kvf eval` draws now (not drawn now: "
                                "['ranking_x_ratio0.3.png'], missing: []); remake them: kvf eval results/x/runs.jsonl "
                                "--out results/x")
    (committed / "summary.md").write_text("Made by `kvf eval results/x/runs.jsonl --out results/x` at commit abc.\n"
                                          + body.replace("Runs", "Runs (an older wording)"))
    report = []
    verify.check_rendered("x.md", committed / "summary.csv", rescored / "summary.csv", command, report)
    assert report[0] == (False, "x.md: results/x/summary.md and summary.csv are stale; remake them: "
                                "kvf eval results/x/runs.jsonl --out results/x")
    (committed / "summary.md").write_text("Made by `kvf eval other.jsonl --out results/x` at commit abc.\n" + body)
    report = []
    verify.check_rendered("x.md", committed / "summary.csv", rescored / "summary.csv", command, report)
    assert report == []


def test_same_answers_counts_the_questions_two_configurations_answer_alike(tmp_path, capsys):
    """scripts/same_answers: the "N of M answers changed" results/kvfuse.md quotes, from the run files; a
    configuration with no records is refused in one line naming those there are."""
    from kvf.scripts import same_answers

    def rec(qid, method, answer, ratio=0.15, label=None):
        return {"qid": qid, "dataset": "toy", "method": method, "label": label,
                "settings": {"ratio": 1.0 if method == "full" else ratio, "variant": "fusion", "top_k": 4,
                             "chunk_tokens": 100},
                "chunk_ids": ["c1"], "question": f"question {qid}", "answer": answer, "gold": ["x"],
                "prompt_tokens": 500, "chunk_tokens": 400, "recomputed_tokens": 60,
                "timings": {"load": 0.1, "select": 0.0, "recompute": 0.2, "first_token": 1.0, "decode": 0.5}}
    run = tmp_path / "r.jsonl"
    run.write_text("".join(json.dumps(r) + "\n" for r in [
        rec("q1", "full", "Paris"), rec("q2", "full", "Rome"), rec("q3", "full", "Oslo"),
        rec("q1", "kvfuse", "Paris"), rec("q2", "kvfuse", "Milan"),
        rec("q1", "kvfuse", "Paris", label="sink_tokens=8"), rec("q2", "kvfuse", "Rome", label="sink_tokens=8"),
        rec("q3", "kvfuse", "Oslo", label="sink_tokens=8")]))
    assert same_answers.main([str(run), "--a", "kvfuse@0.15", "--b", "kvfuse@0.15:sink_tokens=8"]) == 0
    assert capsys.readouterr().out.strip() == "2 questions answered by both; same answers: 1; changed: 1"
    assert same_answers.main([str(run), "--a", "full", "--b", "kvfuse@0.15:sink_tokens=8"]) == 0
    assert capsys.readouterr().out.strip() == "3 questions answered by both; same answers: 3; changed: 0"
    assert same_answers.main([str(run), "--a", "kvfuse@0.3", "--b", "full"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --a kvfuse@0.3: no records of it in") and "kvfuse@0.15:sink_tokens=8" in err
    assert len(err.splitlines()) == 1


def test_same_answers_where_places_the_first_difference_against_the_gold_value(tmp_path, capsys):
    """--where: where --b's answer first leaves --a's, against the gold value --a spells (before it, at its first
    character, inside it, after it), per RULER-style task; --list: the questions --a gets right and --b does not."""
    from kvf.scripts import same_answers
    assert same_answers.where_it_leaves("The number for parrot is 2401115.", "The number for the number", ["2401115"]) \
        == "before the value"
    assert same_answers.where_it_leaves("It is 2401115.", "It is 17.", ["2401115"]) == "at the value's first character"
    assert same_answers.where_it_leaves("It is 2401115.", "It is 2409.", ["2401115"]) == "inside the value"
    assert same_answers.where_it_leaves("It is 2401115.", "It is 2401115. It is", ["2401115"]) == "after the value"
    assert same_answers.where_it_leaves("It is 10.", "It is 17.", ["2401115"]) == "--a spells no gold value"
    assert same_answers.task_of("ruler-4096/niah_multikey") == "niah_multikey"
    assert same_answers.task_of("ruler-4096/alias") == "alias"
    assert same_answers.task_of("nq") == "nq"

    def rec(qid, method, answer):                     # a suite's records name their task as kvf run writes them
        return {"qid": qid, "dataset": f"ruler-4096/{qid.split('-')[0]}", "method": method, "label": None, "gold": ["2401115"],
                "gold_mode": "any", "settings": {"ratio": 1.0 if method == "full" else 0.15}, "chunk_ids": ["c1"],
                "question": "q", "answer": answer, "prompt_tokens": 500, "chunk_tokens": 400, "recomputed_tokens": 60,
                "timings": {"load": 0.1, "select": 0.0, "recompute": 0.2, "first_token": 1.0, "decode": 0.5}}
    run = tmp_path / "r.jsonl"
    run.write_text("".join(json.dumps(r) + "\n" for r in [
        rec("alias-4096-000", "full", "for parrot is 2401115."), rec("alias-4096-000", "kvfuse", "for the number for"),
        rec("alias-4096-001", "full", "is 2401115."), rec("alias-4096-001", "kvfuse", "is 17."),
        rec("boundary-4096-000", "full", "is 2401115."), rec("boundary-4096-000", "kvfuse", "is: 2401115."),
        rec("boundary-4096-001", "full", "is 2401115."), rec("boundary-4096-001", "kvfuse", "is 2401115.")]))
    assert same_answers.main([str(run), "--a", "full", "--b", "kvfuse@0.15", "--where", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "4 questions answered by both; same answers: 1; changed: 3"
    assert out[3:6] == ["| alias | before the value | 1 | 1 | 0 |", "| alias | at the value's first character | 1 | 1 | 0 |",
                        "| boundary | before the value | 1 | 1 | 1 |"]
    assert out[8:] == ["| alias-4096-000 | before the value | 'for parrot is 2401115.' | 'for the number for' |",
                       "| alias-4096-001 | at the value's first character | 'is 2401115.' | 'is 17.' |"]
