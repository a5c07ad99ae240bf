"""evaluate(): summary numbers on hand-built run files, outputs written, bad files refused."""
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvf import KvfError
from kvf.eval.report import evaluate, summary_markdown, summary_table

GOLD = {"q1": ["Paris"], "q2": ["Rome"], "q3": ["Berlin"], "q4": ["Madrid"]}


def record(qid, method, answer, ratio=0.0, variant="prefix", dataset="toy", ttft=1.0, **extra):
    return {"qid": qid, "dataset": dataset, "method": method,
            "settings": {"ratio": ratio, "variant": variant, "top_k": 4, "chunk_tokens": 100},
            "chunk_ids": ["c1"], "question": f"question {qid}", "answer": answer, "gold": GOLD[qid],
            "prompt_tokens": 500, "chunk_tokens": 400, "recomputed_tokens": int(400 * ratio),
            "timings": {"load": 0.1, "select": 0.0, "recompute": 0.2, "first_token": ttft, "decode": 0.5},
            **extra}


def write_run(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def runs(tmp_path):
    full = write_run(tmp_path / "full.jsonl", [
        record("q1", "full", "Paris", ratio=1.0, ttft=2.0), record("q2", "full", "Rome", ratio=1.0, ttft=2.0),
        record("q3", "full", "Berlin", ratio=1.0, ttft=2.0), record("q4", "full", "Lisbon", ratio=1.0, ttft=2.0)])
    reuse = write_run(tmp_path / "reuse.jsonl", [
        record("q1", "reuse", "London", ttft=0.5), record("q2", "reuse", "Rome", ttft=0.5),
        record("q3", "reuse", "Munich", ttft=0.5), record("q4", "reuse", "Porto", ttft=0.5)])
    # cacheblend at r = 0.2: right on q1, q2 ("in Rome" -> F1 2/3, substring 1), and q3 only vs full
    blend = write_run(tmp_path / "blend.jsonl", [
        record("q1", "cacheblend", "Paris", ratio=0.2, ttft=1.0, kl_full=0.1, top1_agree_full=True),
        record("q2", "cacheblend", "in Rome", ratio=0.2, ttft=1.0, kl_full=0.3, top1_agree_full=True),
        record("q3", "cacheblend", "Munich", ratio=0.2, ttft=1.0, kl_full=0.5, top1_agree_full=False),
        record("q4", "cacheblend", "Lisbon", ratio=0.2, ttft=1.0, kl_full=0.7, top1_agree_full=False,
               full_answer="Lisbon Portugal")])
    return [full, reuse, blend]


def row(summary: pd.DataFrame, method: str) -> pd.Series:
    rows = summary[summary.method == method]
    assert len(rows) == 1
    return rows.iloc[0]


def test_summary_numbers(runs, tmp_path):
    summary = evaluate(runs, tmp_path / "out")
    assert list(summary.method) == ["full", "reuse", "cacheblend"]  # baselines first
    full, reuse, blend = (row(summary, m) for m in ("full", "reuse", "cacheblend"))
    assert full.n == 4 and full.em == pytest.approx(0.75) and full.f1 == pytest.approx(0.75)
    assert reuse.f1 == pytest.approx(0.25)
    assert blend.em == pytest.approx(0.25)
    assert blend.f1 == pytest.approx((1 + 2 / 3 + 0 + 0) / 4)
    assert blend.substring == pytest.approx(0.5)
    # (F1 - F1_reuse) / (F1_full - F1_reuse) = (5/12 - 1/4) / (3/4 - 1/4) = 1/3
    assert blend.norm_f1 == pytest.approx(1 / 3)
    assert full.norm_f1 == pytest.approx(1.0) and reuse.norm_f1 == pytest.approx(0.0)
    # fidelity: q1 1, q2 "in rome" vs "rome" 2/3, q3 "munich" vs "berlin" 0,
    # q4 against its own full_answer "Lisbon Portugal": P = 1, R = 1/2 -> 2/3
    assert blend.fidelity_f1 == pytest.approx((1 + 2 / 3 + 0 + 2 / 3) / 4)
    assert blend.kl_full == pytest.approx(0.4) and blend.top1_agree == pytest.approx(0.5)
    assert math.isnan(full.kl_full)  # not recorded -> NaN, not 0
    assert blend.ttft_ratio == pytest.approx(0.5) and reuse.ttft_ratio == pytest.approx(0.25)
    assert blend.recomputed_frac == pytest.approx(0.2)
    assert blend.ttft_s == pytest.approx(1.0) and blend.load_s == pytest.approx(0.1)


def test_outputs_written(runs, tmp_path):
    out = tmp_path / "out"
    summary = evaluate(runs, out)
    names = {"summary.csv", "summary.md", "quality_vs_ratio_toy.png", "ttft_vs_ratio.png"}
    assert {p.name for p in out.iterdir()} == names
    assert {Path(p).name for p in summary.attrs["written"]} == names
    assert (out / "quality_vs_ratio_toy.png").read_bytes()[:4] == b"\x89PNG"
    csv = pd.read_csv(out / "summary.csv")
    assert list(csv.method) == ["full", "reuse", "cacheblend"]
    md = (out / "summary.md").read_text().split("Summary:\n\n")[1].splitlines()
    assert md[0].startswith("| dataset | method |") and len(md) == 2 + 3
    assert "| toy | cacheblend | prefix | 0.20 | 4 |" in md[4]


def test_runs_table_says_what_was_run(runs, tmp_path):
    shared = write_run(tmp_path / "shared.jsonl", [
        {**record(q, m, "x", ratio=1.0, dataset="nq"),
         "settings": {"ratio": 1.0, "variant": "prefix", "setting": "shared", "retriever": "dense", "top_k": 5,
                      "chunk_tokens": 256, "model": "SmolLM2"}}
        for q in ("q1", "q2") for m in ("full", "reuse")])
    evaluate(runs + [shared], tmp_path / "out")
    runs_part = (tmp_path / "out" / "summary.md").read_text().split("Summary:")[0].splitlines()
    assert runs_part[0] == "Runs:"
    assert "| nq | 2 | shared | dense top-5 of the corpus | 256 | 500 | SmolLM2 |" in runs_part
    assert "| toy | 4 | - | - | 100 | 500 | - |" in runs_part


def test_complete_only_keeps_questions_every_method_answered(runs, tmp_path):
    # a sweep stopped mid-question: cacheblend at 0.5 got to q1 and q2 only
    partial = write_run(tmp_path / "blend05.jsonl", [record("q1", "cacheblend", "Paris", ratio=0.5),
                                                     record("q2", "cacheblend", "Rome", ratio=0.5)])
    everything = evaluate(runs + [partial], tmp_path / "all")
    common = evaluate(runs + [partial], tmp_path / "common", complete_only=True)
    assert set(everything.n) == {4, 2}
    assert set(common.n) == {2}  # every row now on q1, q2
    assert row(common, "full").f1 == pytest.approx(1.0) and row(common, "reuse").f1 == pytest.approx(0.5)
    # no question answered by all: a one-line error, not an empty table
    lonely = write_run(tmp_path / "other.jsonl", [record("q3", "cacheblend", "Berlin", ratio=0.7)])
    with pytest.raises(KvfError, match="--complete-only"):
        evaluate([partial, lonely], tmp_path / "none", complete_only=True)


def test_rows_per_ratio_and_partial_overlap(runs, tmp_path):
    more = write_run(tmp_path / "blend05.jsonl", [record("q1", "cacheblend", "Paris", ratio=0.5),
                                                  record("q2", "cacheblend", "Rome", ratio=0.5)])
    summary = evaluate(runs + [more], tmp_path / "out")
    blend = summary[summary.method == "cacheblend"]
    assert list(blend.ratio) == [0.2, 0.5]
    half = blend.iloc[1]
    # on q1, q2: F1 = 1, full = 1, reuse = 1/2 -> 1
    assert half.n == 2 and half.norm_f1 == pytest.approx(1.0)


def test_partial_overlap_is_noted(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(GOLD, "q5", ["Oslo"])
    extra = write_run(tmp_path / "b.jsonl", [record("q1", "epic", "Paris", ratio=0.1),
                                             record("q5", "epic", "Oslo", ratio=0.1)])
    summary = evaluate(runs + [extra], tmp_path / "out")
    assert row(summary, "epic").note == "normalized F1 on 1/2 questions"


def test_undefined_normalized_f1(tmp_path):
    full = write_run(tmp_path / "f.jsonl", [record("q1", "full", "Paris")])
    reuse = write_run(tmp_path / "r.jsonl", [record("q1", "reuse", "Paris")])
    blend = write_run(tmp_path / "b.jsonl", [record("q1", "cacheblend", "Paris", ratio=0.3)])
    summary = evaluate([full, reuse, blend], tmp_path / "out")
    r = row(summary, "cacheblend")
    assert math.isnan(r.norm_f1) and "undefined" in r.note
    assert "| undefined |" in summary_markdown(summary)


def test_without_full_or_reuse(tmp_path):
    blend = write_run(tmp_path / "b.jsonl", [record("q1", "cacheblend", "Paris", ratio=0.3)])
    summary = evaluate([blend], tmp_path / "out")
    r = row(summary, "cacheblend")
    assert r.f1 == 1.0 and math.isnan(r.norm_f1) and math.isnan(r.ttft_ratio) and math.isnan(r.fidelity_f1)
    assert "needs full and reuse" in r.note


def test_method_without_ratio_is_one_row(tmp_path, runs):
    rec = record("q1", "cachefocus", "Paris")
    del rec["settings"]["ratio"]
    summary = evaluate(runs + [write_run(tmp_path / "cf.jsonl", [rec])], tmp_path / "out")
    assert math.isnan(row(summary, "cachefocus").ratio)


def test_reuse_of_same_variant_is_preferred(runs, tmp_path):
    fusion_reuse = write_run(tmp_path / "reuse_fusion.jsonl", [
        record(q, "reuse", a, variant="fusion") for q, a in [("q1", "Paris"), ("q2", "x"), ("q3", "y"), ("q4", "z")]])
    fusion = write_run(tmp_path / "fusionrag.jsonl", [
        record(q, "fusionrag", a, ratio=0.2, variant="fusion") for q, a in [("q1", "Paris"), ("q2", "Rome"), ("q3", "y"), ("q4", "z")]])
    summary = evaluate(runs + [fusion_reuse, fusion], tmp_path / "out")
    # fusion reuse F1 = 1/4, fusionrag F1 = 2/4, full 3/4 -> 1/2
    assert row(summary, "fusionrag").norm_f1 == pytest.approx(0.5)


def test_bad_run_files(tmp_path, runs):
    with pytest.raises(KvfError, match="nope.jsonl does not exist"):
        evaluate([tmp_path / "nope.jsonl"], tmp_path / "out")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(KvfError, match="empty.jsonl is empty"):
        evaluate([tmp_path / "empty.jsonl"], tmp_path / "out")
    (tmp_path / "broken.jsonl").write_text(json.dumps(record("q1", "full", "Paris")) + "\n{not json\n")
    with pytest.raises(KvfError, match=r"broken.jsonl line 2: malformed JSON"):
        evaluate([tmp_path / "broken.jsonl"], tmp_path / "out")
    (tmp_path / "nogold.jsonl").write_text(json.dumps({**record("q1", "full", "Paris"), "gold": []}) + "\n")
    with pytest.raises(KvfError, match="nogold.jsonl line 1"):
        evaluate([tmp_path / "nogold.jsonl"], tmp_path / "out")
    with pytest.raises(KvfError, match="appears more than once"):
        evaluate(runs + [runs[2]], tmp_path / "out")
    with pytest.raises(KvfError, match="no run files"):
        evaluate([], tmp_path / "out")


def test_mismatched_files_are_refused(tmp_path, runs, monkeypatch):
    monkeypatch.setitem(GOLD, "z1", ["x"])
    other = write_run(tmp_path / "other.jsonl", [record("z1", "cacheblend", "x", ratio=0.5)])
    with pytest.raises(KvfError, match=r"other.jsonl has questions not in .*full.jsonl \(different dataset\?\)"):
        evaluate(runs + [other], tmp_path / "out")


def test_rich_table_and_cli(runs, tmp_path):
    from rich.console import Console
    console = Console(record=True, width=250)
    console.print(summary_table(evaluate(runs, tmp_path / "out")))
    assert "cacheblend" in console.export_text()

    import typer
    from kvf.cli.eval_cmd import eval_command
    app = typer.Typer()
    app.command("eval")(eval_command)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, ["eval", *map(str, runs), "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert "summary.csv" in result.output and (tmp_path / "cli" / "summary.md").is_file()


# ---- is the most faithful method's lead real? ------------------------------------------------
def test_paired_bootstrap_on_known_differences():
    from kvf.eval.report import paired_bootstrap
    ones, zeros = pd.Series(1.0, index=["a", "b", "c"]), pd.Series(0.0, index=["a", "b", "c"])
    assert paired_bootstrap(ones, zeros) == (1.0, 1.0, 1.0, 3)             # every resample differs by 1
    mixed = pd.Series([1.0, 0.0, 1.0, 0.0], index=list("abcd"))
    flipped = pd.Series([0.0, 1.0, 0.0, 1.0], index=list("abcd"))
    lead, low, high, n = paired_bootstrap(mixed, flipped)
    assert (lead, n) == (0.0, 4) and low < 0 < high                         # +1/-1 differences: noise
    only_shared = paired_bootstrap(pd.Series([1.0, 5.0], index=["a", "x"]), pd.Series([0.0], index=["a"]))
    assert only_shared == (1.0, 1.0, 1.0, 1)                                 # paired on common questions
    assert paired_bootstrap(ones, pd.Series([0.0], index=["z"]))[3] == 0


def selective_runs(tmp_path, second_answers) -> list[Path]:
    """full, and two selective methods at 15%: `epic` always answers as full, `cacheblend` as given."""
    full_answers = {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "Lisbon"}
    return [write_run(tmp_path / "full.jsonl", [record(q, "full", a, ratio=1.0) for q, a in full_answers.items()]),
            write_run(tmp_path / "epic.jsonl", [record(q, "epic", a, ratio=0.15) for q, a in full_answers.items()]),
            write_run(tmp_path / "blend.jsonl", [record(q, "cacheblend", a, ratio=0.15)
                                                 for q, a in second_answers.items()])]


def most_faithful_line(tmp_path, second_answers) -> str:
    evaluate(selective_runs(tmp_path, second_answers), tmp_path / "out")
    text = (tmp_path / "out" / "summary.md").read_text()
    return next(line for line in text.splitlines() if line.startswith("- toy:"))


def test_most_faithful_states_a_clear_lead(tmp_path):
    line = most_faithful_line(tmp_path, {"q1": "London", "q2": "Milan", "q3": "Munich", "q4": "Porto"})
    assert "**epic**" in line and "ahead of cacheblend (prefix, 0.000) by +1.000" in line
    assert "95% CI [+1.000, +1.000]" in line and "4 questions, a clear lead" in line


def test_most_faithful_says_when_the_lead_is_noise(tmp_path):
    line = most_faithful_line(tmp_path, {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "Porto"})
    assert "**epic**" in line and "by +0.250" in line                      # one question of four differs
    assert "within noise: the interval includes 0" in line


def test_rows_whose_records_ran_differently_say_so(tmp_path):
    alike = [record(q, "cacheblend", "Paris", ratio=0.15) for q in ("q1", "q2")]
    for i, rec in enumerate(alike):
        rec["settings"]["store"] = f"/machine{i}/kv.zarr"
    unlike = [record("q3", "cacheblend", "Paris", ratio=0.15), record("q4", "cacheblend", "Paris", ratio=0.15)]
    unlike[1]["settings"]["top_k"] = 8
    summary = evaluate([write_run(tmp_path / "a.jsonl", alike)], tmp_path / "a")
    assert "mixed" not in row(summary, "cacheblend").note          # only the store's path differs
    summary = evaluate([write_run(tmp_path / "b.jsonl", unlike)], tmp_path / "b")
    assert "mixed settings: top_k=4/8" in row(summary, "cacheblend").note
