"""evaluate(): summary numbers on hand-built run files, intervals on every row, outputs written,
bad files refused. Questions are replicated REPS times (q1-0 .. q4-5) so that the paired
intervals have the MIN_QUESTIONS they need; every mean equals the 4-question one."""
import gzip
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvf.errors import KvfError
from kvf.eval.report import evaluate, format_cell, summary_markdown, summary_table
from kvf.eval.stats import MIN_QUESTIONS

GOLD = {"q1": ["Paris"], "q2": ["Rome"], "q3": ["Berlin"], "q4": ["Madrid"]}
REPS = 6


def record(qid, method, answer, ratio=0.0, variant="prefix", dataset="toy", ttft=1.0, **extra):
    return {"qid": qid, "dataset": dataset, "method": method,
            "settings": {"ratio": ratio, "variant": variant, "top_k": 4, "chunk_tokens": 100},
            "chunk_ids": ["c1"], "question": f"question {qid}", "answer": answer, "gold": GOLD[qid.split("-")[0]],
            "prompt_tokens": 500, "chunk_tokens": 400, "recomputed_tokens": int(400 * ratio),
            "timings": {"load": 0.1, "select": 0.0, "recompute": 0.2, "first_token": ttft, "decode": 0.5},
            **extra}


def replicated(method, answers: dict, **kw) -> list[dict]:
    """One record per replicate of each base question q1..q4; answers[q] may be a dict of extra fields."""
    out = []
    for rep in range(REPS):
        for q, answer in answers.items():
            extra = {}
            if isinstance(answer, tuple):
                answer, extra = answer
            out.append(record(f"{q}-{rep}", method, answer, **kw, **extra))
    return out


def write_run(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def runs(tmp_path):
    full = write_run(tmp_path / "full.jsonl", replicated(
        "full", {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "Lisbon"}, ratio=1.0, ttft=2.0))
    reuse = write_run(tmp_path / "reuse.jsonl", replicated(
        "reuse", {"q1": "London", "q2": "Rome", "q3": "Munich", "q4": "Porto"}, ttft=0.5))
    # cacheblend at r = 0.2: right on q1, q2 ("in Rome" -> F1 2/3, substring 1), and q3 only vs full
    blend = write_run(tmp_path / "blend.jsonl", replicated("cacheblend", {
        "q1": ("Paris", {"kl_full": 0.1, "top1_agree_full": True}),
        "q2": ("in Rome", {"kl_full": 0.3, "top1_agree_full": True}),
        "q3": ("Munich", {"kl_full": 0.5, "top1_agree_full": False}),
        "q4": ("Lisbon", {"kl_full": 0.7, "top1_agree_full": False, "full_answer": "Lisbon Portugal"})},
        ratio=0.2, ttft=1.0))
    return [full, reuse, blend]


def row(summary: pd.DataFrame, method: str) -> pd.Series:
    rows = summary[summary.method == method]
    assert len(rows) == 1
    return rows.iloc[0]


def test_summary_numbers(runs, tmp_path):
    summary = evaluate(runs, tmp_path / "out")
    assert list(summary.method) == ["full", "reuse", "cacheblend"]  # baselines first
    full, reuse, blend = (row(summary, m) for m in ("full", "reuse", "cacheblend"))
    assert full.n == 4 * REPS and full.em == pytest.approx(0.75) and full.f1 == pytest.approx(0.75)
    assert reuse.f1 == pytest.approx(0.25)
    assert blend.em == pytest.approx(0.25)
    assert blend.f1 == pytest.approx((1 + 2 / 3 + 0 + 0) / 4)
    assert blend.substring == pytest.approx(0.5) and blend.acc == pytest.approx(0.5)
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


def test_every_row_carries_paired_intervals_to_full_and_reuse(runs, tmp_path):
    summary = evaluate(runs, tmp_path / "out")
    blend, reuse = row(summary, "cacheblend"), row(summary, "reuse")
    assert blend.metric == "f1"
    assert blend.vs_full == pytest.approx(5 / 12 - 0.75) and blend.vs_full_low <= blend.vs_full <= blend.vs_full_high
    assert blend.vs_full_high < 0                                   # significantly below full
    # vs reuse: +1 on q1, -1/3 on q2, 0 on q3 and q4: a mean of +1/6 whose interval includes 0
    assert blend.vs_reuse == pytest.approx(5 / 12 - 0.25) and blend.vs_reuse_low < 0 < blend.vs_reuse_high
    assert reuse.vs_full == pytest.approx(-0.5) and math.isnan(reuse.vs_reuse)
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "significantly below full: reuse@0, cacheblend@0.2" in md
    assert "significantly above reuse: none" in md
    assert f"{blend.vs_full:+.3f} [{blend.vs_full_low:+.3f}, {blend.vs_full_high:+.3f}]" in md
    assert "Made by `kvf eval` at commit" in md                      # results files say what made them
    assert "recorded only by `kvf run --compare-full` (`-` without it)" in md   # why kl_full / top1_agree read "-"


def test_compare_full_records_alone_give_the_ttft_ratio_and_say_what_was_not_tested(tmp_path):
    """A sweep run with --compare-full but no `-m full` showed `-` for ttft_ratio, though each record's full
    prefill was timed, and "significantly below full: none" where no full run was there to test against."""
    blend = write_run(tmp_path / "blend.jsonl", [{**rec, "full_first_token": 4.0} for rec in replicated(
        "cacheblend", {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "Lisbon"}, ratio=0.2, ttft=1.0)])
    reuse = write_run(tmp_path / "reuse.jsonl", replicated("reuse", {"q1": "x", "q2": "y"}, ttft=0.5))
    summary = evaluate([blend, reuse], tmp_path / "out")
    assert row(summary, "cacheblend").ttft_ratio == pytest.approx(0.25)
    assert math.isnan(row(summary, "reuse").ttft_ratio)          # its records carry no full prefill's TTFT
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "significantly below full: not tested (no full run on these questions)" in md
    assert f"significantly above reuse: not tested (at most {2 * REPS} questions in common with reuse" in md


def test_a_run_of_full_and_reuse_alone_says_no_method_was_there_to_test(tmp_path):
    """With only full and reuse, the reuse line said "not tested (no reuse run on these questions)" beside reuse's own row."""
    full = write_run(tmp_path / "full.jsonl", replicated("full", {"q1": "Paris", "q2": "Rome"}, ttft=2.0))
    reuse = write_run(tmp_path / "reuse.jsonl", replicated("reuse", {"q1": "Paris", "q2": "y"}, ttft=0.5))
    evaluate([full, reuse], tmp_path / "out")
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "significantly above reuse: no method besides full and reuse to test" in md
    assert "significantly below full: no method" not in md                  # reuse is tested against full


def test_record_order_in_the_run_files_changes_no_number(runs, tmp_path):
    """Two sweeps side by side interleave their records: every interval must come from the questions,
    not from the order their records were written in."""
    in_order = evaluate(runs, tmp_path / "in-order")
    shuffled = []
    for path in runs:
        lines = path.read_text().splitlines()
        lines = lines[1::2][::-1] + lines[0::2]                  # a different order of the same records
        shuffled.append(write_run(tmp_path / f"shuffled-{path.name}", [json.loads(line) for line in lines]))
    reordered = evaluate(shuffled, tmp_path / "reordered")
    columns = ["metric_low", "metric_high", "fidelity_low", "fidelity_high", "vs_full_low", "vs_full_high",
               "vs_reuse_low", "vs_reuse_high", "f1", "fidelity_f1"]
    blend = row(in_order, "cacheblend")
    assert blend.fidelity_low < blend.fidelity_f1 < blend.fidelity_high   # the intervals are not degenerate
    pd.testing.assert_frame_equal(in_order[columns].reset_index(drop=True),
                                  reordered[columns].reset_index(drop=True))


def test_few_questions_are_too_few_to_compare(tmp_path):
    few = [write_run(tmp_path / "f.jsonl", [record(f"q{i}-0", "full", "Paris", ratio=1.0) for i in (1, 2)]),
           write_run(tmp_path / "b.jsonl", [record(f"q{i}-0", "cacheblend", "Rome", ratio=0.15) for i in (1, 2)])]
    summary = evaluate(few, tmp_path / "out")
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "too few questions to compare (n = 2)" in md
    assert "a clear lead" not in md and math.isnan(row(summary, "cacheblend").norm_f1)


def test_an_ablation_at_one_ratio_gets_ranked_bars_whatever_its_n(tmp_path):
    """A dev ablation (11 questions, every entry at 15%) drew only the quality-vs-ratio plot, where every
    entry's point sits on one vertical line; ranked bars came only from n >= MIN_QUESTIONS. A sweep over
    several ratios with few questions still gets no ranked bars (its points spread along the ratio axis)."""
    one_ratio = [record(f"q{i}-0", method, "Paris", ratio=ratio) for i in (1, 2)
                 for method, ratio in (("full", 1.0), ("cacheblend", 0.15), ("fusionrag", 0.15))]
    evaluate([write_run(tmp_path / "a.jsonl", one_ratio)], tmp_path / "one")
    assert (tmp_path / "one" / "ranking_toy_ratio0.15.png").is_file()
    swept = one_ratio + [record(f"q{i}-0", "cacheblend", "Paris", ratio=0.3) for i in (1, 2)]
    evaluate([write_run(tmp_path / "b.jsonl", swept)], tmp_path / "swept")
    assert not list((tmp_path / "swept").glob("ranking_*"))


def test_plots_an_earlier_eval_drew_into_the_folder_are_removed_and_no_others(runs, tmp_path):
    """`kvf eval` into a folder an earlier eval wrote, of other runs (a dataset or ratio since left out): that eval's
    plots stayed beside the new summary as if they were its own. kvf eval's own plot names that this eval did not
    draw are removed (and said); other files stay."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("ranking_nq_ratio0.3.png", "quality_vs_ratio_nq.png", "my_figure.png", "ranking_notes.txt"):
        (out / name).write_bytes(b"\x89PNG")
    summary = evaluate(runs, out)
    assert [Path(p).name for p in summary.attrs["removed"]] == ["quality_vs_ratio_nq.png", "ranking_nq_ratio0.3.png"]
    assert {p.name for p in out.iterdir()} == {"summary.csv", "summary.md", "pairs.csv", "quality_vs_ratio_toy.png",
                                               "ranking_toy_ratio0.2.png", "ttft_vs_ratio.png", "my_figure.png",
                                               "ranking_notes.txt"}
    assert evaluate(runs, out).attrs["removed"] == []

def test_ruler_records_score_the_share_of_gold_values(tmp_path):
    recs = []
    for i in range(MIN_QUESTIONS):
        base = {"gold": ["4821", "7730"], "gold_mode": "all"}
        recs.append({**record(f"q1-{i}", "full", "4821 and 7730", ratio=1.0), **base})
        recs.append({**record(f"q1-{i}", "reuse", "4821", ratio=0.0), **base})
    summary = evaluate([write_run(tmp_path / "r.jsonl", recs)], tmp_path / "out")
    assert row(summary, "full").acc == 1.0 and row(summary, "reuse").acc == 0.5
    assert row(summary, "reuse").metric == "acc" and row(summary, "reuse").vs_full == pytest.approx(-0.5)


def test_outputs_written(runs, tmp_path):
    out = tmp_path / "out"
    summary = evaluate(runs, out)
    names = {"summary.csv", "summary.md", "pairs.csv", "quality_vs_ratio_toy.png", "ranking_toy_ratio0.2.png",
             "ttft_vs_ratio.png"}
    assert {p.name for p in out.iterdir()} == names
    assert {Path(p).name for p in summary.attrs["written"]} == names
    assert (out / "quality_vs_ratio_toy.png").read_bytes()[:4] == b"\x89PNG"
    csv = pd.read_csv(out / "summary.csv")
    assert list(csv.method) == ["full", "reuse", "cacheblend"]
    md = (out / "summary.md").read_text().split("Summary:\n\n")[1].splitlines()
    assert md[0].startswith("| dataset | method | variant |") and md[2 + 3] == ""
    assert f"| toy | cacheblend | prefix | 0.20 | {4 * REPS} |" in md[4]


def test_runs_table_says_what_was_run(runs, tmp_path):
    def provenance(transformers):   # full and reuse computed under two transformers releases
        return {"kvf_version": "0.1.0", "commit": "c", "device": "cpu",
                "libraries": {"torch": "2.13.0+cpu", "transformers": transformers}}
    shared = write_run(tmp_path / "shared.jsonl", [
        {**record(q, m, "x", ratio=1.0, dataset="nq"),
         "settings": {"ratio": 1.0, "variant": "prefix", "setting": "shared", "retriever": "dense", "top_k": 5,
                      "chunk_tokens": 256, "model": "SmolLM2"},
         "provenance": provenance("5.24.0" if m == "full" else "5.25.0")}
        for q in ("q1-0", "q2-0") for m in ("full", "reuse")])
    evaluate(runs + [shared], tmp_path / "out")
    runs_part = (tmp_path / "out" / "summary.md").read_text().split("Summary:")[0].splitlines()
    assert "Runs:" in runs_part
    assert ("| nq | 2 | shared | dense top-5 of the corpus | 256 | 500 | SmolLM2 | "
            "torch 2.13.0+cpu, transformers 5.24.0/5.25.0 |") in runs_part
    assert f"| toy | {4 * REPS} | - | - | 100 | 500 | - | not recorded |" in runs_part


def test_a_run_record_names_the_torch_and_transformers_that_computed_it():
    import torch
    import transformers
    from kvf.pipeline.records import RunRecord
    from kvf.pipeline.workflows.provenance import provenance
    made = provenance("cpu")
    assert made["libraries"] == {"torch": torch.__version__, "transformers": transformers.__version__}
    assert RunRecord.model_validate({**record("q1-0", "full", "x"), "provenance": made}).provenance.libraries == \
        made["libraries"]


def test_complete_only_keeps_questions_every_method_answered(runs, tmp_path):
    # a sweep stopped mid-question: cacheblend at 0.5 got to q1 and q2 only
    partial = write_run(tmp_path / "blend05.jsonl", [record("q1-0", "cacheblend", "Paris", ratio=0.5),
                                                     record("q2-0", "cacheblend", "Rome", ratio=0.5)])
    everything = evaluate(runs + [partial], tmp_path / "all")
    common = evaluate(runs + [partial], tmp_path / "common", complete_only=True)
    assert set(everything.n) == {4 * REPS, 2}
    assert set(common.n) == {2}  # every row now on q1, q2
    assert row(common, "full").f1 == pytest.approx(1.0) and row(common, "reuse").f1 == pytest.approx(0.5)
    # no question answered by all: a one-line error, not an empty table
    lonely = write_run(tmp_path / "other.jsonl", [record("q3-0", "cacheblend", "Berlin", ratio=0.7)])
    with pytest.raises(KvfError, match="--complete-only"):
        evaluate([partial, lonely], tmp_path / "none", complete_only=True)


def test_exclude_questions_scores_the_held_out_questions_only(runs, tmp_path, capsys):
    # q1 (every replicate) is a "dev" question: excluded, every row is over the other three
    dev = tmp_path / "dev.txt"
    dev.write_text("# tuned on these\n" + "".join(f"q1-{rep}\n" for rep in range(REPS)) + "\n")
    held_out = evaluate(runs, tmp_path / "held", exclude_questions=dev)
    assert set(held_out.n) == {3 * REPS}
    scored = held_out.attrs["records"]
    assert not scored.qid.str.startswith("q1-").any() and scored.qid.nunique() == 3 * REPS
    # an id in no run file (a typo) is said, not passed over: its question would stay in the scores
    dev.write_text("".join(f"q1-{rep}\n" for rep in range(REPS)) + "q1-O\n")
    assert set(evaluate(runs, tmp_path / "typo", exclude_questions=dev).n) == {3 * REPS}
    err = capsys.readouterr().err
    assert "1 of the 7 ids" in err and "'q1-O'" in err
    # saved with a byte-order mark and CRLF line ends (Windows editors): the first id still matches
    dev.write_bytes(("\ufeff" + "".join(f"q1-{rep}\r\n" for rep in range(REPS))).encode("utf-8"))
    assert set(evaluate(runs, tmp_path / "bom", exclude_questions=dev).n) == {3 * REPS}
    # listing every question leaves nothing: a one-line error, not an empty table
    everything = tmp_path / "all.txt"
    everything.write_text("".join(f"q{q}-{rep}\n" for q in range(1, 5) for rep in range(REPS)))
    with pytest.raises(KvfError, match="every question"):
        evaluate(runs, tmp_path / "none", exclude_questions=everything)


def test_a_notebook_leaves_questions_out_by_their_ids(runs, tmp_path, capsys):
    """kvf.evaluate had no exclude_questions: a notebook could not score a held-out split as `kvf eval` does."""
    import kvf
    dev_ids = [f"q1-{rep}" for rep in range(REPS)]
    (tmp_path / "dev.txt").write_text("\n".join(dev_ids) + "\n")
    from_list = kvf.evaluate(runs, exclude_questions=dev_ids)
    from_file = kvf.evaluate(runs, exclude_questions=tmp_path / "dev.txt")
    assert set(from_list.n) == {3 * REPS}
    pd.testing.assert_frame_equal(from_list, from_file)
    kvf.evaluate(runs, exclude_questions=[*dev_ids, "q1-O"])
    assert "exclude_questions: 1 of the 7 ids given are in no run file (e.g. 'q1-O')" in capsys.readouterr().err
    for bad in ("nope.txt", [], [3], "", {"q1-0": 1}):
        with pytest.raises(KvfError) as caught:
            kvf.evaluate(runs, exclude_questions=bad)
        assert str(caught.value).startswith("exclude_questions") and "\n" not in str(caught.value), caught.value
    with pytest.raises(KvfError, match=re.escape("exclude_questions='q1-0': no such file; pass a file of question ids "
                                                 "(one per line), or the ids as a list: exclude_questions=['q1-0']")):
        kvf.evaluate(runs, exclude_questions="q1-0")   # one id, not a file's name
    with pytest.raises(KvfError, match=re.escape("complete_only='no': pass True or False")):
        kvf.evaluate(runs, complete_only="no")   # read as true


def test_gzipped_run_files_score_the_same(runs, tmp_path):
    # committed evidence is kept as .jsonl.gz: the same records give the same table
    zipped = []
    for path in runs:
        target = tmp_path / (Path(path).name + ".gz")
        target.write_bytes(gzip.compress(Path(path).read_bytes()))
        zipped.append(target)
    plain, packed = evaluate(runs, tmp_path / "plain"), evaluate(zipped, tmp_path / "packed")
    cols = ["dataset", "method", "variant", "ratio", "n", "f1", "fidelity_f1"]
    pd.testing.assert_frame_equal(plain[cols].reset_index(drop=True), packed[cols].reset_index(drop=True))
    # a gzip cut short (an interrupted copy) is a one-line error, not a traceback or a partial table
    torn = tmp_path / "torn.jsonl.gz"
    torn.write_bytes(zipped[0].read_bytes()[:-20])
    with pytest.raises(KvfError, match="not a complete gzip file"):
        evaluate([torn], tmp_path / "torn")


def test_partial_overlap_is_noted(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(GOLD, "q5", ["Oslo"])
    epic = [record(f"q{q}-{rep}", "epic", "Paris", ratio=0.1) for rep in range(REPS) for q in (1, 2, 3, 4)]
    extra = write_run(tmp_path / "b.jsonl", epic + [record("q5-0", "epic", "Oslo", ratio=0.1)])
    summary = evaluate(runs + [extra], tmp_path / "out")
    assert row(summary, "epic").note.split("; ")[0] == f"normalized F1 on {4 * REPS}/{4 * REPS + 1} questions"


def test_undefined_normalized_f1_when_full_does_not_beat_reuse(tmp_path):
    same = {"q1": "Paris", "q2": "Rome", "q3": "x", "q4": "y"}
    full = write_run(tmp_path / "f.jsonl", replicated("full", same))
    reuse = write_run(tmp_path / "r.jsonl", replicated("reuse", same))
    blend = write_run(tmp_path / "b.jsonl", replicated("cacheblend", same, ratio=0.3))
    summary = evaluate([full, reuse, blend], tmp_path / "out")
    r = row(summary, "cacheblend")
    assert math.isnan(r.norm_f1) and "full does not beat reuse significantly" in r.note
    assert "| undefined |" in summary_markdown(summary)


def test_normalized_f1_above_one_is_explained(runs, tmp_path):
    better = write_run(tmp_path / "b.jsonl", replicated(
        "epic", {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "Madrid"}, ratio=0.3))
    r = row(evaluate(runs + [better], tmp_path / "out"), "epic")
    assert r.norm_f1 == pytest.approx(1.5) and "F1 above full's" in r.note


def test_without_full_or_reuse(tmp_path):
    blend = write_run(tmp_path / "b.jsonl", [record("q1-0", "cacheblend", "Paris", ratio=0.3)])
    summary = evaluate([blend], tmp_path / "out")
    r = row(summary, "cacheblend")
    assert r.f1 == 1.0 and math.isnan(r.norm_f1) and math.isnan(r.ttft_ratio) and math.isnan(r.fidelity_f1)
    assert "needs full and reuse" in r.note


def test_reuse_of_same_variant_is_preferred(runs, tmp_path):
    fusion_reuse = write_run(tmp_path / "reuse_fusion.jsonl", replicated(
        "reuse", {"q1": "Paris", "q2": "x", "q3": "y", "q4": "z"}, variant="fusion"))
    fusion = write_run(tmp_path / "fusionrag.jsonl", replicated(
        "fusionrag", {"q1": "Paris", "q2": "Rome", "q3": "y", "q4": "z"}, ratio=0.2, variant="fusion"))
    summary = evaluate(runs + [fusion_reuse, fusion], tmp_path / "out")
    # fusion reuse F1 = 1/4, fusionrag F1 = 2/4, full 3/4 -> 1/2
    assert row(summary, "fusionrag").norm_f1 == pytest.approx(0.5)


def test_labels_tell_apart_runs_of_one_method(runs, tmp_path):
    other = [{**r, "label": "big-model"} for r in replicated(
        "cacheblend", {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "x"}, ratio=0.2)]
    summary = evaluate(runs + [write_run(tmp_path / "big.jsonl", other)], tmp_path / "out")
    blends = summary[summary.method == "cacheblend"]
    assert sorted(blends.label) == ["", "big-model"]


def test_ratio_auto_records_are_one_run_with_an_interval(runs, tmp_path):
    """`--ratio auto` picks each question's ratio: its records were one summary row per question (n = 1, no
    interval) and `kvf compare` could not name them. They are one run, labelled auto, at the mean ratio."""
    from kvf.eval.compare import select
    from kvf.eval.report import load_runs
    records = replicated("cacheblend", {"q1": "Paris", "q2": "Rome", "q3": "Munich", "q4": "Lisbon"})
    for i, r in enumerate(records):
        r["settings"] = {**r["settings"], "ratio": 0.2 + 0.01 * i, "ratio_mode": "auto"}
    auto = write_run(tmp_path / "auto.jsonl", records)
    summary = evaluate(runs[:2] + [auto], tmp_path / "out")
    blend = row(summary, "cacheblend")
    assert blend.label == "auto" and blend.n == 4 * REPS
    assert abs(blend.ratio - sum(r["settings"]["ratio"] for r in records) / len(records)) < 1e-9
    assert blend.vs_full_low < blend.vs_full < blend.vs_full_high     # paired to full over every question
    df = load_runs(runs[:2] + [auto])
    assert len(select(df, "cacheblend:auto")) == len(select(df, "cacheblend@auto")) == 4 * REPS   # as tables name it
    with pytest.raises(KvfError, match=r"the runs there are cacheblend@auto, full@1"):
        select(df, "cacheblend@0.2")


def test_bad_run_files(tmp_path, runs, capsys):
    with pytest.raises(KvfError, match="nope.jsonl does not exist"):
        evaluate([tmp_path / "nope.jsonl"], tmp_path / "out")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(KvfError, match="empty.jsonl is empty"):
        evaluate([tmp_path / "empty.jsonl"], tmp_path / "out")
    # a sweep still writing its file: the unterminated last line is left out with a warning, the rest scored
    live = tmp_path / "live.jsonl"
    whole = Path(runs[0]).read_text()
    live.write_text(whole + whole.splitlines()[0][:60])
    assert evaluate([live], tmp_path / "live").n.iloc[0] == len(whole.splitlines())
    assert "live.jsonl line" in capsys.readouterr().err
    # a file that is nothing but a cut line is no sweep in progress: malformed, not "empty"
    (tmp_path / "cut.jsonl").write_text("x")
    with pytest.raises(KvfError, match=r"cut.jsonl line 1: malformed JSON"):
        evaluate([tmp_path / "cut.jsonl"], tmp_path / "cut")
    # a run file re-saved with a byte-order mark (a Windows editor) reads like the original
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + Path(runs[0]).read_bytes())
    assert evaluate([tmp_path / "bom.jsonl"], tmp_path / "bom").n.iloc[0] == len(whole.splitlines())
    # a malformed line that is whole is damage, not a write in progress
    (tmp_path / "broken.jsonl").write_text(json.dumps(record("q1-0", "full", "Paris")) + "\n{not json\n")
    with pytest.raises(KvfError, match=r"broken.jsonl line 2: malformed JSON \(Expecting property name enclosed in "
                                       r"double quotes at column 2\)"):
        evaluate([tmp_path / "broken.jsonl"], tmp_path / "out")
    # a line a raw newline cut inside a string: json's own reason ends in a dangling "at"; the line says where
    (tmp_path / "cut_string.jsonl").write_text(json.dumps(record("q1-0", "full", "Paris")) + '\n{"qid": "q1\n"}\n')
    with pytest.raises(KvfError, match=r"cut_string.jsonl line 2: malformed JSON \(Invalid control character at "
                                       r"column 12\)"):
        evaluate([tmp_path / "cut_string.jsonl"], tmp_path / "out")
    bad_values = {"qid": None, "timings": {"load": "fast"}, "settings": [1, 2], "answer_agree_full": 1.5,
                  "answer_kl_full": -0.1}
    for field, value in bad_values.items():
        (tmp_path / "bad.jsonl").write_text(json.dumps({**record("q1-0", "full", "Paris"), field: value}) + "\n")
        with pytest.raises(KvfError, match=f"bad.jsonl line 1: not a kvf run record \\({field}"):
            evaluate([tmp_path / "bad.jsonl"], tmp_path / "out")
    # counts past each other (a hand edit) were scored as they stood: a recomputed share above 1
    for counts, words in (({"recomputed_tokens": 450}, "recomputed_tokens 450 exceeds chunk_tokens 400"),
                          ({"chunk_tokens": 600}, "chunk_tokens 600 exceeds prompt_tokens 500")):
        (tmp_path / "counts.jsonl").write_text(json.dumps({**record("q1-0", "full", "Paris"), **counts}) + "\n")
        with pytest.raises(KvfError, match=f"counts.jsonl line 1: not a kvf run record \\(record: {words}\\)$"):
            evaluate([tmp_path / "counts.jsonl"], tmp_path / "out")
    # settings.max_new_tokens is compared with answer_tokens (answers cut inside a gold): a word or a list there
    # was an internal TypeError in kvf eval and kvf compare (make probe-files)
    for cap in ("12", [12], 0, True, 12.5):
        line = record("q1-0", "full", "Paris", answer_tokens=12)
        line["settings"]["max_new_tokens"] = cap
        (tmp_path / "cap.jsonl").write_text(json.dumps(line) + "\n")
        with pytest.raises(KvfError, match=r"cap.jsonl line 1: not a kvf run record \(settings: .*settings.max_new_tokens "
                                           "must be a whole number of at least 1"):
            evaluate([tmp_path / "cap.jsonl"], tmp_path / "out")
    nan_timing = json.dumps(record("q1-0", "full", "Paris")).replace('"load": 0.1', '"load": NaN')
    (tmp_path / "nan.jsonl").write_text(nan_timing + "\n")
    with pytest.raises(KvfError, match="nan.jsonl line 1: not a kvf run record \\(timings.load"):
        evaluate([tmp_path / "nan.jsonl"], tmp_path / "out")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(KvfError, match="binary.jsonl is not UTF-8"):
        evaluate([tmp_path / "binary.jsonl"], tmp_path / "out")
    copy = tmp_path / "copy.jsonl"   # the same records in two files: refused (one file named twice counts once)
    copy.write_bytes(Path(runs[2]).read_bytes())
    with pytest.raises(KvfError, match="appears more than once"):
        evaluate(runs + [copy], tmp_path / "out")
    with pytest.raises(KvfError, match="no run files"):
        evaluate([], tmp_path / "out")


def test_out_that_is_a_file_is_refused(runs, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(KvfError, match="--out .*afile is a file"):
        evaluate(runs, tmp_path / "afile")


def test_mismatched_files_are_refused(tmp_path, runs, monkeypatch):
    monkeypatch.setitem(GOLD, "z1", ["x"])
    other = write_run(tmp_path / "other.jsonl", [record("z1", "cacheblend", "x", ratio=0.5)])
    with pytest.raises(KvfError, match=r"other.jsonl has questions not in .*full.jsonl \(different dataset\?\): "
                                       r"its cacheblend@0.5 answers share no question with that full run"):
        evaluate(runs + [other], tmp_path / "out")
    # no full run at all: a reuse run that shares no question with the method's is still mixed-up files
    with pytest.raises(KvfError, match=r"other.jsonl has questions not in .*reuse.jsonl \(different dataset\?\)"):
        evaluate([runs[1], other], tmp_path / "out")


def test_a_later_run_without_reuse_pools_with_a_sweep(tmp_path, runs, monkeypatch):
    """More questions run later with full and one method, no reuse (as held-out runs are): pooled with the
    sweep, the method's rows count every question, and a ratio only the later run has gets no vs_reuse (its
    questions share none with reuse's) instead of a refusal."""
    for rep in range(REPS):
        monkeypatch.setitem(GOLD, f"z{rep}", ["Oslo"])
    later = write_run(tmp_path / "later.jsonl",
                      [record(f"z{rep}", "full", "Oslo", ratio=1.0, ttft=2.0) for rep in range(REPS)]
                      + [record(f"z{rep}", "cacheblend", "Oslo" if rep % 2 else "Bergen", ratio=r)
                         for rep in range(REPS) for r in (0.2, 0.6)])
    summary = evaluate(runs + [later], tmp_path / "out")
    pooled = summary[(summary.method == "cacheblend") & (summary.ratio == 0.2)].iloc[0]
    only_later = summary[(summary.method == "cacheblend") & (summary.ratio == 0.6)].iloc[0]
    assert pooled.n == 5 * REPS and summary[summary.method == "full"].iloc[0].n == 5 * REPS
    assert pooled._vs_reuse_n == 4 * REPS                          # reuse's questions, not the later run's
    assert only_later.n == REPS and only_later.fidelity_f1 == pytest.approx(0.5)
    assert math.isnan(only_later.vs_reuse) and only_later._vs_reuse_n == 0
    assert "the reuse run answered none of these questions" in only_later.note
    assert not math.isnan(only_later.vs_full)                     # full answered them: compared as ever


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
    result = CliRunner().invoke(app, ["eval", *map(str, runs), "--out", str(tmp_path / "cli"),
                                      "--compare", "cacheblend@0.2", "reuse"])
    assert result.exit_code == 0, result.output
    assert "summary.csv" in result.output and (tmp_path / "cli" / "summary.md").is_file()
    assert "cacheblend@0.2 (A) vs reuse (B)" in result.output and "in Rome" in result.output
    assert "question q2-0" in result.output                                   # each question heads its answers


def test_a_compare_run_not_in_the_files_is_refused_before_anything_is_written(runs, tmp_path, capsys, monkeypatch):
    """`kvf eval --compare cacheblend@0.2 nope` printed the whole summary and wrote every table and plot, then
    failed on the second run's name."""
    import sys

    from kvf.cli.main import main
    monkeypatch.setattr(sys, "argv", ["kvf", "eval", *map(str, runs), "-o", str(tmp_path / "out"),
                                      "--compare", "cacheblend@0.2", "nope"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1 and not out
    assert err.startswith("kvf: error: --compare nope: no records match; the runs there are ") and "cacheblend@0.2" in err
    assert not list((tmp_path / "out").glob("*"))   # no summary, no plot


def test_a_label_in_brackets_is_printed_as_it_is(tmp_path):
    """rich read a label "[v2]" as a markup tag: the summary table's label cell came out empty."""
    from rich.console import Console
    labelled = write_run(tmp_path / "l.jsonl", [dict(r, label="[v2]") for r in replicated("reuse", {"q1": "Paris"})])
    console = Console(width=200, record=True)
    console.print(summary_table(evaluate([labelled], tmp_path / "out")))
    assert "[v2]" in console.export_text()


def test_a_narrow_terminal_gets_fewer_columns_not_numbers_broken_over_lines(runs, tmp_path):
    """At 80 columns the table leaves out columns (and says which) instead of squeezing every column until
    each number wraps; the variant stays while two rows differ only by it."""
    from rich.console import Console
    summary = evaluate(runs, tmp_path / "out")

    def shown(table, width):
        console = Console(record=True, width=width)
        console.print(table)
        return console.export_text()
    wide = shown(summary_table(summary), 250)
    assert "not shown" not in wide and "vs_reuse" in wide
    narrow = shown(summary_table(summary, width=80), 80)
    assert "not shown at this width: " in narrow and "summary.md has them" in narrow
    assert "vs_reuse" in narrow.split("not shown")[1]                          # named as left out, not shown
    blend = row(summary, "cacheblend")
    assert any("cacheblend" in line and f"{blend.fidelity_f1:.3f}" in line and format_cell(blend, "vs_full") in line
               for line in narrow.splitlines())                              # one row, one line, interval whole
    assert "variant" in narrow.split("not shown")[1]                          # one variant per method here
    twin = write_run(tmp_path / "fusion.jsonl", replicated("cacheblend", {"q1": "Paris", "q2": "Rome", "q3": "x",
                                                                          "q4": "y"}, ratio=0.2, variant="fusion"))
    both = shown(summary_table(evaluate([*runs, twin], tmp_path / "out2"), width=80), 80)
    assert "fusion" in both.split("not shown")[0]                            # the rows need it to differ


# ---- is the most faithful method's lead real? ------------------------------------------------
def test_paired_bootstrap_on_known_differences():
    from kvf.eval.stats import paired_bootstrap
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
    return [write_run(tmp_path / "full.jsonl", replicated("full", full_answers, ratio=1.0)),
            write_run(tmp_path / "epic.jsonl", replicated("epic", full_answers, ratio=0.15)),
            write_run(tmp_path / "blend.jsonl", replicated("cacheblend", second_answers, ratio=0.15))]


def most_faithful_line(tmp_path, second_answers) -> str:
    evaluate(selective_runs(tmp_path, second_answers), tmp_path / "out")
    text = (tmp_path / "out" / "summary.md").read_text()
    return next(line for line in text.splitlines() if line.startswith("- toy: **"))


def test_most_faithful_states_a_clear_lead(tmp_path):
    line = most_faithful_line(tmp_path, {"q1": "London", "q2": "Milan", "q3": "Munich", "q4": "Porto"})
    assert "**epic**" in line and "ahead of cacheblend (prefix, 0.000) by +1.000" in line
    assert "95% CI [+1.000, +1.000]" in line and f"{4 * REPS} questions, a clear lead" in line


def test_most_faithful_says_when_the_lead_is_noise(tmp_path):
    # cacheblend differs from full on 1 replicate of q4 only: a lead of 1/24
    answers = replicated("cacheblend", {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "Lisbon"}, ratio=0.15)
    answers[-1]["answer"] = "Porto"
    runs = selective_runs(tmp_path, {"q1": "Paris"})
    write_run(runs[2], answers)
    evaluate(runs, tmp_path / "out")
    line = next(line for line in (tmp_path / "out" / "summary.md").read_text().splitlines()
                if line.startswith("- toy: **"))
    assert "**epic**" in line and f"by +{1 / 24:.3f}" in line
    assert "within noise: the interval includes 0" in line


def test_rows_whose_records_ran_differently_say_so(tmp_path):
    alike = [record(q, "cacheblend", "Paris", ratio=0.15) for q in ("q1-0", "q2-0")]
    for i, rec in enumerate(alike):
        rec["settings"]["store"] = f"/machine{i}/kv.zarr"
    unlike = [record("q3-0", "cacheblend", "Paris", ratio=0.15), record("q4-0", "cacheblend", "Paris", ratio=0.15)]
    unlike[1]["settings"]["top_k"] = 8
    summary = evaluate([write_run(tmp_path / "a.jsonl", alike)], tmp_path / "a")
    assert "mixed" not in row(summary, "cacheblend").note          # only the store's path differs
    summary = evaluate([write_run(tmp_path / "b.jsonl", unlike)], tmp_path / "b")
    assert "mixed settings: top_k=4/8" in row(summary, "cacheblend").note


def test_a_generated_suite_is_also_scored_over_all_its_tasks():
    import pandas as pd
    from kvf.eval.report import with_pooled_tasks
    df = pd.DataFrame({"dataset": ["ruler/a", "ruler/a", "ruler/b", "nq", "one/x"], "qid": ["1", "2", "3", "4", "5"]})
    pooled = with_pooled_tasks(df)
    assert sorted(pooled[pooled.dataset == "ruler (all tasks)"].qid) == ["1", "2", "3"]
    assert len(pooled) == len(df) + 3  # a suite of one task and a plain dataset are not repeated


def test_every_pair_of_methods_is_compared_with_holm_adjustment(runs, tmp_path):
    from kvf.eval.pairs import pairwise_differences
    summary = evaluate(runs, tmp_path / "out")
    pairs = pairwise_differences(summary.attrs["records"], summary)
    fidelity = pairs[pairs.measure == "fidelity_f1"]
    pairs = pairs[pairs.measure == "f1"].set_index(["a", "b"])
    # full is not compared in fidelity (1 by definition): reuse vs cacheblend only
    assert list(zip(fidelity.a, fidelity.b)) == [("cacheblend (prefix)", "reuse (prefix)")]
    # per-question F1 over q1..q4: full 1, 1, 1, 0; reuse 0, 1, 0, 0; cacheblend 1, 2/3, 0, 0
    assert pairs.loc[("full (prefix)", "reuse (prefix)"), "diff"] == pytest.approx(0.5)
    assert pairs.loc[("full (prefix)", "cacheblend (prefix)"), "diff"] == pytest.approx(1 / 3)
    assert pairs.loc[("cacheblend (prefix)", "reuse (prefix)"), "diff"] == pytest.approx(1 / 6)
    assert len(pairs) == 3 and (pairs.n == 4 * REPS).all()
    assert pairs.loc[("full (prefix)", "reuse (prefix)"), "significant"]
    assert (pairs.p_holm >= pairs.p).all()
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "- toy at ratio 0.2, f1 vs gold (3 pairs tested, n = 24)" in text
    assert "full (prefix) > reuse (prefix): +0.500" in text
    assert (tmp_path / "out" / "pairs.csv").is_file()
    assert (tmp_path / "out" / "ranking_toy_ratio0.2.png").is_file()


def test_a_pair_that_differs_only_by_noise_is_not_called_different(tmp_path):
    from kvf.eval.pairs import pairwise_differences
    # a right where b is wrong on q1, the reverse on q2: the mean difference is 0
    a = write_run(tmp_path / "a.jsonl", replicated("epic", {"q1": "Paris", "q2": "Milan", "q3": "Berlin", "q4": "x"},
                                                   ratio=0.2))
    b = write_run(tmp_path / "b.jsonl", replicated("cacheblend", {"q1": "Lyon", "q2": "Rome", "q3": "Berlin", "q4": "x"},
                                                   ratio=0.2))
    summary = evaluate([a, b], tmp_path / "out")
    pairs = pairwise_differences(summary.attrs["records"], summary)
    pairs = pairs[pairs.measure == "f1"]
    assert len(pairs) == 1 and pairs.iloc[0]["diff"] == pytest.approx(0.0)
    assert not pairs.iloc[0].significant and pairs.iloc[0].p > 0.5
    assert "no pair differs after Holm adjustment" in (tmp_path / "out" / "summary.md").read_text()


def test_holm_and_permutation_p_values():
    from kvf.eval.stats import holm, paired_p_value
    # sorted 0.01, 0.03, 0.04 -> x3, x2, x1 = 0.03, 0.06, 0.04 -> running maximum 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    same = pd.Series([1.0, 0.0, 1.0] * 10)
    assert paired_p_value(same, same) == 1.0
    better = pd.Series([1.0] * 30)
    worse = pd.Series([0.0] * 30)
    assert paired_p_value(better, worse) < 1e-3        # every flip of 30 equal signs but two is smaller
    one_off = pd.Series([1.0] + [0.0] * 29)
    assert paired_p_value(one_off, worse) == pytest.approx(1.0)   # one question says nothing


def test_shared_sign_flips_and_paired_differences_give_the_numbers_of_their_first_form():
    """The p-value draws its flips once per question count, and the paired differences come from dicts
    rather than pandas label lookups (a large eval took minutes): the same numbers as the direct forms."""
    import numpy as np

    from kvf.eval.stats import paired_differences, paired_p_value

    def direct_p_value(diff, permutations=20000, seed=0):   # the first form: fresh flips, block by block
        observed, rng, as_far = abs(diff.mean()), np.random.default_rng(seed), 0
        for start in range(0, permutations, 5000):
            signs = rng.choice([-1.0, 1.0], (min(5000, permutations - start), len(diff)))
            as_far += int((np.abs((signs * diff).mean(axis=1)) >= observed - 1e-12).sum())
        return (as_far + 1) / (permutations + 1)
    rng = np.random.default_rng(7)
    for n in (20, 37, 50, 300):   # 300: past the cached draws' limit, drawn afresh block by block
        for _ in range(3):   # F1-like scores with many ties, questions in different orders, a NaN, a bool run
            qids = [f"q{i}" for i in range(n)]
            a = pd.Series(rng.choice([0.0, 0.5, 1.0, float("nan")], n, p=[.4, .2, .38, .02]), index=qids)
            b = pd.Series(rng.choice([0.0, 1.0], n).astype(bool), index=qids).sample(frac=1, random_state=1)
            b = b.iloc[: n - 2]   # b lacks two questions
            common = sorted(set(a.index) & set(b.index))
            want = (a.loc[common].astype(float) - b.loc[common].astype(float)).to_numpy()
            np.testing.assert_array_equal(paired_differences(a, b), want)
            clean = a.fillna(0.0)
            assert paired_p_value(clean, b.astype(float)) == direct_p_value(paired_differences(clean, b.astype(float)))
    from kvf.eval.stats import bootstrap_means
    for n in (50, 3000):   # 3000: past the limit too
        x = rng.random(n)
        picks = np.random.default_rng(0).integers(0, n, (2000, n))
        np.testing.assert_array_equal(bootstrap_means(x), x[picks].mean(axis=1))


def test_eval_reports_its_progress_through_track(runs, tmp_path):
    """kvf eval shows a progress bar (a large eval takes a minute): evaluate() walks every stage's items
    through `track`, and tracking changes no output."""
    stages = []

    def track(items, description=""):
        items = list(items)
        stages.append((description, len(items)))
        return items
    tracked = evaluate(runs, tmp_path / "tracked", track=track)
    plain = evaluate(runs, tmp_path / "plain")
    assert [d for d, _ in stages] == ["reading run files", "scoring each method and ratio",
                                      "testing every pair of methods", "drawing plots"]
    assert dict(stages)["reading run files"] == 3 and dict(stages)["scoring each method and ratio"] == len(plain)
    assert dict(stages)["drawing plots"] == len(tracked.attrs["written"]) - 3   # + summary.csv, .md, pairs.csv
    for name in ("summary.csv", "pairs.csv"):
        assert (tmp_path / "tracked" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


def test_a_labelled_single_ratio_row_does_not_turn_its_methods_line_into_points():
    from matplotlib.figure import Figure

    from kvf.eval.plots import plot_panel
    rows = pd.DataFrame({"method": ["kvfuse"] * 4, "label": ["", "", "", "other"], "variant": ["fusion"] * 4,
                         "ratio": [0.0, 0.15, 0.3, 0.15], "acc": [0.5, 0.7, 0.9, 0.8],
                         "recomputed_frac": [0.0, 0.15, 0.3, 0.15]})
    ax = Figure().subplots()
    colours = {"kvfuse": "red", "kvfuse [other]": "blue"}
    assert plot_panel(ax, rows, "acc", None, None, "accuracy", colours, show_variant=False)
    lines = {bars.get_label(): bars.lines[0] for bars in ax.containers}    # errorbar: (data line, caps, bars)
    assert list(lines["kvfuse"].get_xdata()) == [0.0, 0.15, 0.3]          # a line through its three ratios
    assert lines["kvfuse"].get_linestyle() == "-"
    assert lines["kvfuse [other]"].get_linestyle() == "None"               # the one-ratio row: a point


def test_points_at_the_frame_are_drawn_whole():
    """A run at one ratio put its only point on the plot's right edge, and a score of 0 sat half under
    the x axis: the x range ends past the last ratio, and markers are not clipped by the frame."""
    from matplotlib.figure import Figure

    from kvf.eval.plots import plot_panel
    rows = pd.DataFrame({"method": ["cacheblend"], "label": [""], "variant": ["prefix"], "ratio": [0.15],
                         "acc": [0.0], "recomputed_frac": [0.149]})
    ax = Figure().subplots()
    assert plot_panel(ax, rows, "acc", None, None, "accuracy", {"cacheblend": "red"}, show_variant=False)
    assert ax.get_xlim()[1] >= 0.149 + 0.01
    assert not ax.containers[0].lines[0].get_clip_on()


def test_compare_full_answers_stand_for_the_full_run_that_was_not_given(tmp_path):
    """`kvf run -m cacheblend --compare-full` writes full prefill's answer and TTFT into every record, yet kvf eval
    gave no vs_full and said "not tested (no full run on these questions)". The row's own full answers now stand
    for the full run: the same numbers as with a full run that answered alike, and a note that says where from."""
    full_answers = {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "Lisbon"}
    blend = {q: (answer, {"full_answer": full_answers[q], "full_first_token": 2.0})
             for q, answer in {"q1": "Paris", "q2": "in Rome", "q3": "Munich", "q4": "Lisbon"}.items()}
    alone = write_run(tmp_path / "blend.jsonl", replicated("cacheblend", blend, ratio=0.2, ttft=1.0))
    with_full = write_run(tmp_path / "full.jsonl", replicated("full", full_answers, ratio=1.0, ttft=2.0))
    own = evaluate([alone], tmp_path / "own").set_index("method").loc["cacheblend"]
    given = evaluate([alone, with_full], tmp_path / "given").set_index("method").loc["cacheblend"]
    assert not math.isnan(own.vs_full) and own.vs_full < 0                         # q3 lost against full's gold
    for column in ("vs_full", "vs_full_low", "vs_full_high", "fidelity_f1", "ttft_ratio"):
        assert own[column] == pytest.approx(given[column]), column
    assert "full: its --compare-full answers" in own.note and "compare-full answers" not in given.note
    assert "normalized F1 needs reuse run" in own.note
    text = (tmp_path / "own" / "summary.md").read_text()
    assert "significantly below full: cacheblend@0.2" in text, text
    # kvf compare RUN --a cacheblend@0.2 --b full said "--b full: no records match"; B is now those answers
    from kvf.eval.compare import per_question, select
    from kvf.eval.report import load_runs
    df = load_runs([alone])
    table = per_question(df, select(df, "cacheblend@0.2", "--a"), select(df, "full", "--b"))
    assert len(table) == 4 * REPS and table.attrs["full_side"] == "B"
    assert list(table.answer_b[:4]) == [full_answers[q] for q in ("q1", "q2", "q3", "q4")]
    assert table.attrs["metric"] == "f1" and list(table.score_b[:4]) == [1.0, 1.0, 1.0, 0.0] and (table.fidelity_b == 1.0).all()
    # under the table, the means eval's row gives and A - B with its paired interval (kvf compare printed none)
    from kvf.eval.compare import comparison_summary
    from kvf.eval.stats import describe_difference, paired_bootstrap
    summary = comparison_summary(table)
    a_fid = pd.Series(table.fidelity_a.to_numpy(), index=table.dataset + "/" + table.qid)
    assert f"vs full: A {a_fid.mean():.3f}, B 1.000, A - B {describe_difference(*paired_bootstrap(a_fid, a_fid * 0 + 1))}" in summary
    assert own.fidelity_f1 == pytest.approx(a_fid.mean()) and "[" in summary.partition("vs full")[2]   # q4's gold is Madrid


def test_methods_at_one_ratio_are_set_side_by_side_so_each_interval_shows():
    """Nine methods at ratio 0.15 drew nine error bars on one vertical line, each hiding the others. Each series
    is now shifted sideways on the page (not in the data), centred on its ratio, and the frame leaves them room."""
    from matplotlib.figure import Figure

    from kvf.eval.plots import DODGE_POINTS, plot_panel
    rows = pd.DataFrame({"method": ["a3", "cacheblend", "prophetkv"], "label": [""] * 3, "variant": ["prefix"] * 3,
                         "ratio": [0.15] * 3, "recomputed_frac": [0.15] * 3, "fidelity_f1": [0.8, 0.8, 0.8],
                         "low": [0.7] * 3, "high": [0.9] * 3})
    figure = Figure(dpi=100)
    ax = figure.subplots()
    assert plot_panel(ax, rows, "fidelity_f1", "low", "high", "fidelity", {"a3": "red", "cacheblend": "blue",
                                                                           "prophetkv": "green"}, show_variant=False)
    centre = ax.transData.transform((0.15, 0.8))[0]
    shifts = []
    for bars in ax.containers:
        line = bars.lines[0]
        assert list(line.get_xdata()) == [0.15]                                 # the data keep their ratio
        shifts.append(line.get_transform().transform((0.15, 0.8))[0] - centre)
        assert bars.lines[2][0].get_transform() == line.get_transform()        # its interval moves with it
    step = DODGE_POINTS * 100 / 72                                              # points -> pixels at 100 dpi
    assert shifts == pytest.approx([-step, 0, step])
    left, right = ax.get_xlim()
    assert right - 0.15 > 0 and ax.transData.transform((right, 0))[0] - centre > step   # room for the last one


def test_a_score_of_zero_is_drawn_above_the_frame_and_one_question_is_not_questions(tmp_path, monkeypatch):
    """reuse scoring 0 on every question drew its line exactly on the x axis, where the frame hid it, and a
    one-question run was titled "n = 1 questions"."""
    from kvf.eval import plots
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.setdefault(Path(path).name, fig))
    one = write_run(tmp_path / "one.jsonl", [record("q1-0", "reuse", "London"), record("q1-0", "cacheblend", "x", ratio=0.2)])
    evaluate([one], tmp_path / "out")
    figure = figures["quality_vs_ratio_toy.png"]
    gold_ax = figure.axes[0]
    reuse_line = next(line for line in gold_ax.get_lines() if line.get_label() == "reuse")
    assert reuse_line.get_ydata()[0] == 0 and gold_ax.get_ylim()[0] < 0
    assert "(n = 1 question;" in figure.texts[0].get_text()


def test_a_figure_of_points_over_different_questions_says_so(tmp_path, runs, monkeypatch):
    """A later run of other questions pooled with a sweep (make kvfuse-heldout-musique) drew points over 15 to 74
    questions under the title "n = 74 questions": each figure now gives the range."""
    from kvf.eval import plots
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.setdefault(Path(path).name, fig))
    for rep in range(2):
        monkeypatch.setitem(GOLD, f"z{rep}", ["Oslo"])
    later = write_run(tmp_path / "later.jsonl", [record(f"z{rep}", m, "Oslo", ratio=r, ttft=t) for rep in range(2)
                                                 for m, r, t in (("full", 1.0, 2.0), ("cacheblend", 0.6, 1.0))])
    evaluate(runs + [later], tmp_path / "out")
    n_sweep, n_all = 4 * REPS, 4 * REPS + 2
    assert f"(n = 2 to {n_all} questions, by point;" in figures["quality_vs_ratio_toy.png"].texts[0].get_text()
    assert f"(n = {n_sweep} to {n_all} questions, by point;" in figures["ranking_toy_ratio0.2.png"].texts[0].get_text()
    figures.clear()
    evaluate(runs, tmp_path / "sweep")   # one set of questions: one n, as before
    assert f"(n = {n_sweep} questions;" in figures["quality_vs_ratio_toy.png"].texts[0].get_text()


def test_a_ranking_s_colour_key_names_only_the_reference_rows_it_draws(tmp_path, monkeypatch):
    """A run of full and cacheblend drew no grey bar, yet its ranking said "black: full prefill, grey: reuse"."""
    from kvf.eval import plots
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.setdefault(Path(path).name, fig))
    run = write_run(tmp_path / "r.jsonl", [record("q1-0", "full", "London"), record("q1-0", "cacheblend", "x", ratio=0.2)])
    evaluate([run], tmp_path / "out")
    title = next(f for name, f in figures.items() if name.startswith("ranking_")).texts[0].get_text()
    assert "black: full prefill" in title and "reuse" not in title


def test_a_ranking_draws_no_bar_where_a_row_has_no_score(tmp_path, monkeypatch):
    """Questions without gold answers ranked with a bar of 0 on the gold panel (read as F1 = 0), and a row with no
    fidelity (no full prefill beside it) with a bar of 0 there. Such a panel now says why it is empty, and such a
    row reads n/a."""
    from kvf.eval import plots
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.setdefault(Path(path).name, fig))
    rows = pd.DataFrame({"method": ["full", "cacheblend", "epic"], "label": "", "variant": "prefix", "ratio": 0.15,
                         "metric": "f1", "n": 8, "f1": float("nan"), "metric_low": float("nan"), "metric_high": float("nan"),
                         "fidelity_f1": [1.0, 0.7, float("nan")], "fidelity_low": [1.0, 0.6, float("nan")],
                         "fidelity_high": [1.0, 0.8, float("nan")]})
    plots.plot_ranking(rows, "mine at recompute ratio 0.15", tmp_path / "ranking.png")
    [fidelity] = figures["ranking.png"].axes                      # no row has gold: no empty gold frame
    assert figures["ranking.png"].texts[0].get_text().endswith("\n" + plots.NO_GOLD)   # the title says why
    assert [t.get_text() for t in fidelity.texts] == ["n/a"]
    assert [bar.get_width() for bar in fidelity.patches] == [0.7, 1.0, 0.0]   # ranked; the row with no score last
    assert fidelity.texts[0].get_position()[1] == 2                            # n/a on that row
    whiskers = [seg for collection in fidelity.collections for seg in collection.get_segments() if len(seg)]
    assert len(whiskers) == 2                                      # one per scored row, none at 0 for epic


def test_a_ranking_leaves_out_answer_kl_that_one_row_alone_measured(tmp_path, monkeypatch):
    """results/methods.md's sweep, resumed with kvfuse:tuned, drew a third panel of answer KL with one bar (the new
    rows' records measure it, the sweep's older ones do not) and n/a on every other row: nothing to compare. The
    panel is now left out where one row alone has it beside rows that do not, and the title says why."""
    from kvf.eval import plots
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.update({Path(path).name: fig}))
    nan = float("nan")
    rows = pd.DataFrame({"method": ["full", "cacheblend", "kvfuse"], "label": "", "variant": "prefix", "ratio": 0.15,
                         "metric": "f1", "n": 8, "f1": [0.2, 0.1, 0.15], "metric_low": [0.1, 0.0, 0.1],
                         "metric_high": [0.3, 0.2, 0.2], "fidelity_f1": [1.0, 0.7, 0.8], "fidelity_low": [1.0, 0.6, 0.7],
                         "fidelity_high": [1.0, 0.8, 0.9], "answer_kl": [0.0, nan, 0.05],
                         "answer_kl_low": [0.0, nan, 0.03], "answer_kl_high": [0.0, nan, 0.07]})
    plots.plot_ranking(rows, "one measured", tmp_path / "one.png")
    assert len(figures["one.png"].axes) == 2
    assert figures["one.png"].texts[0].get_text().endswith("\n" + plots.ONE_ANSWER_KL)
    plots.plot_ranking(rows.assign(answer_kl=[0.0, 0.2, 0.05], answer_kl_low=[0.0, 0.1, 0.03],
                                   answer_kl_high=[0.0, 0.3, 0.07]), "two measured", tmp_path / "two.png")
    gold, fidelity, answer_kl = figures["two.png"].axes
    assert [bar.get_width() for bar in answer_kl.patches] == [0.2, 0.05, 0.0]   # ranked by fidelity, best at the top
    assert plots.ONE_ANSWER_KL not in figures["two.png"].texts[0].get_text()


def test_every_method_gets_its_own_colour_even_when_listed_once_per_ratio():
    from kvf.eval.plots import _palette
    labels = [f"method{i}" for i in range(12)] * 3            # plot_quality lists each method at every ratio
    colours = _palette(labels)
    assert len(colours) == 12 and len(set(colours.values())) == 12


def test_the_gold_panel_is_scaled_to_its_data():
    """A small model's gold F1 (0.03-0.12 here) on a [0, 1] axis is a flat line at the floor: the gold
    panel's top follows its highest value or interval end (to 0.05); scores near 1 keep [0, 1.02]."""
    from kvf.eval.plots import data_top
    low = pd.DataFrame({"f1": [0.03, 0.08, float("nan")], "metric_high": [0.06, 0.12, float("nan")]})
    assert data_top(low, ["f1", "metric_high"]) == pytest.approx(0.15)         # 1.15 x 0.12 = 0.138, up to 0.15
    high = pd.DataFrame({"acc": [0.8, 0.95], "metric_high": [0.9, 1.0]})
    assert data_top(high, ["acc", "metric_high"]) == 1.02
    assert data_top(pd.DataFrame({"f1": [float("nan")]}), ["f1", "metric_high"]) == 1.02   # nothing to scale to


def test_questions_without_gold_answers_are_counted_apart(tmp_path):
    """A user's own questions file may give answers for some questions only: gold F1 averages those, and
    the table, summary.md and the gold panel say over how many, instead of an n that counts them all."""
    records = []
    for method, ratio in (("full", 1.0), ("cacheblend", 0.15)):
        for rep in range(REPS):
            records.append(record(f"q1-{rep}", method, "Paris", ratio=ratio))
            records.append(record(f"q2-{rep}", method, "no idea", ratio=ratio, gold=[]))   # no answers given
    summary = evaluate([write_run(tmp_path / "mine.jsonl", records)], tmp_path / "out")
    blend = row(summary, "cacheblend")
    assert blend.n == 2 * REPS and blend.n_gold == REPS and blend.f1 == 1.0
    assert format_cell(blend, "n") == f"{2 * REPS} ({REPS} with gold)"
    assert f"gold metrics over the {REPS} of {2 * REPS} questions with answers" in blend.note
    assert f"| {2 * REPS} ({REPS} with gold) |" in (tmp_path / "out" / "summary.md").read_text()
    from kvf.eval.plots import gold_count
    assert gold_count(summary[summary.dataset == "toy"]) == f" (n = {REPS} with gold answers)"
    with_gold = [r for r in records if r["gold"]]
    whole = evaluate([write_run(tmp_path / "all.jsonl", with_gold)], tmp_path / "all")
    assert format_cell(row(whole, "cacheblend"), "n") == str(REPS) and gold_count(whole) == ""


def test_runs_with_nothing_to_score_against_say_so(tmp_path, capsys):
    """A user's own questions without answers, run without --compare-full: no gold and no full answer to
    score against. kvf eval says so and how to fix it, instead of a silent table of dashes; a run with
    full's answers (or gold) draws no such warning."""
    bare = [record(f"q1-{i}", "cacheblend", "Paris", ratio=0.15, gold=[]) for i in range(REPS)]
    evaluate([write_run(tmp_path / "bare.jsonl", bare)], tmp_path / "bare")
    err = capsys.readouterr().err
    assert "toy: no question has gold answers and no record has full prefill's answer" in err and "--compare-full" in err
    with_full = bare + [record(f"q1-{i}", "full", "Paris", ratio=1.0, gold=[]) for i in range(REPS)]
    summary = evaluate([write_run(tmp_path / "full.jsonl", with_full)], tmp_path / "full")
    assert row(summary, "cacheblend").fidelity_f1 == 1.0
    assert "no question has gold" not in capsys.readouterr().err


def test_runs_with_gold_but_no_full_prefill_say_why_fidelity_is_a_dash(tmp_path, capsys):
    """A run scored against gold with no full prefill beside it (no -m full, no --compare-full): the terminal's
    table shows '-' for vs_full, fidelity and TTFT ratio and no notes, so kvf eval says why, once, and the fix;
    with full's answers it says nothing."""
    blend = [record(f"q1-{i}", "cacheblend", "Paris", ratio=0.15) for i in range(REPS)]
    summary = evaluate([write_run(tmp_path / "blend.jsonl", blend)], tmp_path / "blend")
    assert row(summary, "cacheblend").f1 == 1.0 and pd.isna(row(summary, "cacheblend").fidelity_f1)
    err = capsys.readouterr().err
    assert "no full prefill answered the questions of toy" in err and "--compare-full" in err and "-m full" in err
    with_full = blend + [record(f"q1-{i}", "full", "Paris", ratio=1.0) for i in range(REPS)]
    evaluate([write_run(tmp_path / "full.jsonl", with_full)], tmp_path / "full")
    assert "no full prefill answered" not in capsys.readouterr().err
    # a suite's tasks are named once, by the suite
    tasks = [record(f"q1-{i}", "cacheblend", "Paris", ratio=0.15, dataset=f"ruler-2048/{task}")
             for task in ("alias", "boundary") for i in range(REPS)]
    evaluate([write_run(tmp_path / "suite.jsonl", tasks)], tmp_path / "suite")
    assert "no full prefill answered the questions of ruler-2048, so" in capsys.readouterr().err


def test_a_full_run_asked_other_requests_is_said(tmp_path, capsys):
    """full run with -k 5, a method with -k 3 (or another model, or fewer new tokens): its fidelity and TTFT
    ratio compare different requests. The row's note and a warning say so; requests alike say nothing."""
    full = [record(f"q1-{i}", "full", "Paris", ratio=1.0) for i in range(REPS)]
    blend = [record(f"q1-{i}", "cacheblend", "Paris", ratio=0.15) for i in range(REPS)]
    summary = evaluate([write_run(tmp_path / "same.jsonl", full + blend)], tmp_path / "same")
    assert "was asked" not in row(summary, "cacheblend").note
    assert "other requests" not in capsys.readouterr().err
    other = [{**r, "chunk_ids": ["c1", "c2"]} for r in full[:2]] + full[2:]       # full saw more chunks on 2
    summary = evaluate([write_run(tmp_path / "other.jsonl", other + blend)], tmp_path / "other")
    assert f"full was asked 2 of {REPS} questions with other chunks" in row(summary, "cacheblend").note
    err = capsys.readouterr().err
    assert "toy: 1 row(s) are compared with runs asked other requests" in err and "same -k" in err
    longer = [{**r, "settings": {**r["settings"], "max_new_tokens": 32}} for r in full]
    summary = evaluate([write_run(tmp_path / "longer.jsonl", longer + blend)], tmp_path / "longer")
    assert f"full was asked {REPS} of {REPS} questions" in row(summary, "cacheblend").note


def test_a_directory_or_a_quoted_glob_stands_for_its_run_files(runs, tmp_path):
    """`kvf eval runs/` and `kvf eval 'runs/*.jsonl'` (no shell expanded it) read the run files there, each
    once; a directory without run files, or a pattern that matches none, is a one-line error naming it."""
    folder = tmp_path / "folder"
    folder.mkdir()
    for path in runs:
        (folder / Path(path).name).write_bytes(Path(path).read_bytes())
    (folder / "notes.txt").write_text("not a run file\n")
    cols = ["method", "ratio", "n", "f1"]
    named = evaluate(runs, tmp_path / "named")[cols].reset_index(drop=True)
    for given in ([folder], [str(folder / "*.jsonl")], [folder, folder / Path(runs[0]).name]):
        pd.testing.assert_frame_equal(evaluate(given, tmp_path / "given")[cols].reset_index(drop=True), named)
    (tmp_path / "empty").mkdir()
    with pytest.raises(KvfError, match="empty holds no .jsonl or .jsonl.gz files"):
        evaluate([tmp_path / "empty"], tmp_path / "e")
    with pytest.raises(KvfError, match=r"x\*.jsonl: the pattern matches no file"):
        evaluate([str(folder / "x*.jsonl")], tmp_path / "e")


def test_eval_json_is_the_only_thing_on_stdout(runs, tmp_path, capsys, monkeypatch):
    """`kvf eval --json | jq`: the 'wrote ...' line (and a --compare table) go to stderr, so stdout parses."""
    import sys

    from kvf.cli.main import main
    monkeypatch.setattr(sys, "argv", ["kvf", "eval", *map(str, runs), "-o", str(tmp_path / "out"), "--json",
                                      "--compare", "cacheblend@0.2", "full"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None), err
    rows = json.loads(out)
    assert {r["method"] for r in rows} == {"full", "reuse", "cacheblend"} and "wrote summary.csv" in err
    # summary.csv's columns, as written: eval's own bookkeeping (_vs_full_n, _ttft_mixed, ...) stays out
    assert list(rows[0]) == list(pd.read_csv(tmp_path / "out" / "summary.csv").columns)


def test_eval_json_carries_the_answer_columns_summary_csv_has(tmp_path, capsys, monkeypatch):
    """`kvf eval --json` printed SUMMARY_COLUMNS alone, so runs made with --compare-full lost answer_kl and
    answer_agree (and answer_kl's interval), which summary.csv holds; stdout now has summary.csv's columns."""
    import sys

    from kvf.cli.main import main
    answers = {q: ("x", {"full_answer": "x y", "answer_agree_full": 0.5, "answer_kl_full": 0.25}) for q in GOLD}
    run = write_run(tmp_path / "r.jsonl", replicated("prophetkv", answers, ratio=0.2))
    monkeypatch.setattr(sys, "argv", ["kvf", "eval", str(run), "-o", str(tmp_path / "out"), "--json"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None), err
    rows = json.loads(out)
    assert list(rows[0]) == list(pd.read_csv(tmp_path / "out" / "summary.csv").columns)
    assert rows[0]["answer_kl"] == pytest.approx(0.25) and rows[0]["answer_agree"] == pytest.approx(0.5)


def test_a_labelled_run_is_selected_as_tables_print_it():
    """`kvf run --label big` prints the run as 'cacheblend@0.15 [big]'; --a / --compare took only
    'cacheblend@0.15:big', and the printed form failed ('the ratio after @ must be a number')."""
    from kvf.eval.compare import select
    df = pd.DataFrame({"dataset": ["toy"] * 3, "method": ["cacheblend", "cacheblend", "reuse"], "label": ["big", "", "x@1"],
                       "variant": ["prefix"] * 3, "ratio": [0.15, 0.15, 0.0], "qid": ["q1"] * 3})
    assert list(select(df, "cacheblend@0.15 [big]").index) == list(select(df, "cacheblend@0.15:big").index) == [0]
    assert list(select(df, "reuse [x@1]").index) == list(select(df, "reuse:x@1").index) == [2]
    assert list(select(df, "cacheblend:big@0.15").index) == [0]    # as kvf run -m spells it, NAME:KNOBS, then @ratio
    assert list(select(df, "cacheblend [big]@0.15").index) == [0]   # as kvf bench and the plots print it
    from rich.console import Console

    from kvf.eval.compare import comparison_table
    table = pd.DataFrame({"qid": ["q1"], "question": ["Where?"], "gold": ["x"], "answer_a": ["a"], "answer_b": ["b"],
                          "score_a": [0.0], "score_b": [1.0], "fidelity_a": [None], "fidelity_b": [None], "full_answer": [None]})
    table.attrs["metric"] = "f1"
    console = Console(width=200, record=True)
    console.print(comparison_table(table, "run.jsonl cacheblend@0.15 [big]", "run.jsonl full"))
    assert "run.jsonl cacheblend@0.15 [big] (A) vs run.jsonl full (B)" in console.export_text()   # markup ate "[big]"


def test_a_progress_bar_shows_a_bracketed_name_as_it_is():
    """Progress descriptions hold dataset and file names ("answering runs [v2]"); rich's default column read
    "[v2]" as markup and dropped it."""
    import io

    from rich.console import Console

    from kvf.pipeline.workflows.display import progress_bar
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    with progress_bar(console) as progress:
        progress.add_task("answering mine [v2]", total=2, completed=1)
        progress.refresh()
    assert "answering mine [v2]" in out.getvalue()


def test_a_progress_bar_that_advances_in_slices_half_a_minute_apart_shows_an_eta():
    """The dense index advances 1,024 chunks at a time, ~35 s apart on this CPU: with rich's 30 s speed
    window its ETA read -:--:-- for the whole stage."""
    import io

    from rich.console import Console

    from kvf.pipeline.workflows.display import progress_bar
    console = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)
    clock = [0.0]
    with progress_bar(console) as progress:
        progress.get_time = lambda: clock[0]
        task = progress.add_task("dense index", total=8192)
        for _ in range(2):
            clock[0] += 35.0
            progress.advance(task, 1024)
        remaining = progress.tasks[0].time_remaining
    assert remaining is not None and remaining == pytest.approx(35.0 * 6, rel=0.01)


def test_compare_takes_a_run_over_several_datasets_as_one(tmp_path, capsys, monkeypatch):
    """A RULER suite's run spans its tasks (ruler-2048/niah_single, ruler-2048/boundary, ...). kvf compare RUN
    --a kvfuse@0.15 --b full said 'matches 2 runs; narrow it with @ratio or :label', which no ratio or label
    narrows. A run is now its method, label, variant and ratio over every dataset it answered; each question is
    scored by its own dataset's metric (acc here) against its own dataset's full run."""
    from conftest import run_cli
    lines = []
    for task, qid, gold in (("niah_single", "n1", "1234"), ("boundary", "b1", "5678")):
        for method, ratio, answer in (("full", 1.0, f"It is {gold}."), ("kvfuse", 0.15, "It is 99.")):
            lines.append({"qid": qid, "dataset": f"ruler-2048/{task}", "method": method,
                          "settings": {"ratio": ratio, "variant": "prefix"}, "chunk_ids": ["c1"], "question": f"what {qid}",
                          "answer": answer, "gold": [gold], "prompt_tokens": 50, "chunk_tokens": 40,
                          "recomputed_tokens": int(40 * ratio),
                          "timings": {"load": 0.0, "select": 0.0, "recompute": 0.1, "first_token": 0.1, "decode": 0.1}})
    run = tmp_path / "ruler.jsonl"
    run.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = run_cli(["compare", run, "--a", "kvfuse@0.15", "--b", "full"], capsys, monkeypatch)
    assert code == 0, err
    assert "2 questions" in out and "n1" in out and "b1" in out and "acc: against gold" in out
    # the two runs' means under the table, A - B with its interval (too few questions for one here)
    assert "over 2 questions (2 answered differently): acc: A 0.000, B 1.000, A - B too few questions" in " ".join(out.split())
    from kvf.eval.compare import per_question, select
    from kvf.eval.report import load_runs
    df = load_runs([run])
    table = per_question(df, select(df, "kvfuse@0.15", "--a"), select(df, "full", "--b"))
    assert table.attrs["metric"] == "acc" and list(table.score_a) == [0.0, 0.0] and list(table.score_b) == [1.0, 1.0]
    # --json: stdout holds one object per question alone (as kvf eval --json and kvf bench --json), the summary on stderr
    code, out, err = run_cli(["compare", run, "--a", "kvfuse@0.15", "--b", "full", "--json"], capsys, monkeypatch)
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["dataset"], r["qid"], r["metric"], r["score_a"], r["score_b"]) for r in rows] == [
        ("ruler-2048/niah_single", "n1", "acc", 0.0, 1.0), ("ruler-2048/boundary", "b1", "acc", 0.0, 1.0)]
    assert "over 2 questions" in err
    # kvf eval --compare: eval pools a suite's tasks once more ("ruler-2048 (all tasks)"); each question counts once
    code, out, err = run_cli(["eval", run, "-o", tmp_path / "ev", "--compare", "kvfuse@0.15", "full"], capsys, monkeypatch)
    assert code == 0, err
    assert "over 2 questions (2 answered differently)" in " ".join(out.split()), out
    # two runs of other metrics together: each question by its own, and the column says so
    lines += [dict(line, dataset="toy", qid="t1", gold=["It is 99"]) for line in lines[:2]]
    run.write_text("".join(json.dumps(line) + "\n" for line in lines))
    df = load_runs([run])
    table = per_question(df, select(df, "kvfuse@0.15", "--a"), select(df, "full", "--b"))
    assert table.attrs["metric"] == "gold" and len(table) == 3


def test_a_run_named_without_a_label_is_the_unlabelled_run():
    """An ablation file holds kvfuse@0.15 and kvfuse@0.15 [sink_tokens=8]. kvf compare --b kvfuse@0.15 said 'matches
    2 runs (kvfuse@0.15, kvfuse@0.15:sink_tokens=8); narrow it', naming the very run asked for. A name without a
    label is now the unlabelled run's; with no unlabelled run, one labelled run still answers to it."""
    from kvf.eval.compare import select
    df = pd.DataFrame({"dataset": ["toy"] * 3, "method": ["kvfuse"] * 3, "label": ["", "sink_tokens=8", "x"],
                       "variant": ["fusion"] * 3, "ratio": [0.15, 0.15, 0.3], "qid": ["q1"] * 3})
    assert list(select(df, "kvfuse@0.15").index) == [0]
    assert list(select(df, "kvfuse@0.15:sink_tokens=8").index) == [1]
    assert list(select(df, "kvfuse@0.3").index) == [2]          # no unlabelled run at 0.3: its one labelled run
    assert list(select(df, "kvfuse").index) == [0]


def test_ttft_ratio_against_a_full_prefill_another_run_timed_is_said(tmp_path, capsys):
    """The sinks row of results/kvfuse/sinks-ruler read ttft_ratio 0.205 beside the default's 0.272, as if the sinks
    made kvfuse faster: its full prefill had been timed by the sweep's run file, another process on a differently
    loaded machine; methods.md's kvfuse rows, appended to the sweep's file sessions later, likewise. A run is a run
    file at a commit. Where full was timed by the row's own run on enough questions, the ratio is taken over those
    and the note says so; where not, the note says that another run timed full, eval says it once on the terminal
    (whose table shows no notes) and the TTFT plot leaves the row out. A method timed by full's own run, or against
    its own --compare-full timings (which come before a full run's), gets no note."""
    answers = {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "Lisbon"}
    def at(commit, records):
        return [dict(r, provenance={"kvf_version": "0.1", "commit": commit, "device": "cpu"}) for r in records]
    full = at("aaaa", replicated("full", answers, ratio=1.0, ttft=2.0))
    for r in full[:4]:                                   # questions q1-0..q4-0: full timed at 4 s by a later session
        r["timings"] = dict(r["timings"], first_token=4.0)
        r["provenance"] = dict(r["provenance"], commit="cccc")
    sweep = write_run(tmp_path / "sweep.jsonl", full + at("aaaa", replicated("cacheblend", answers, ratio=0.2, ttft=1.0))
                      + at("bbbb", replicated("a3", answers, ratio=0.2, ttft=1.5)))
    other = write_run(tmp_path / "other.jsonl", at("aaaa", replicated("kvfuse", answers, ratio=0.2, ttft=0.5)))
    own = write_run(tmp_path / "own.jsonl", replicated(
        "epic", {q: (a, {"full_answer": a, "full_first_token": 4.0}) for q, a in answers.items()}, ratio=0.2, ttft=1.0))
    summary = evaluate([sweep, other], tmp_path / "out").set_index("method")
    n, same = 4 * REPS, 4 * REPS - 4
    blend = summary.loc["cacheblend"]                    # 20 questions timed alongside full: the ratio over those
    assert blend.ttft_ratio == pytest.approx(0.5) and f"ttft_ratio over the {same} of {n} questions" in blend.note
    said = f"ttft_ratio: full timed by another run on {n} of {n} questions"
    assert said in summary.loc["kvfuse"].note and said in summary.loc["a3"].note     # another file; another commit
    assert summary.loc["kvfuse"].ttft_ratio == pytest.approx(0.5 * n / (2.0 * same + 4.0 * 4))   # every question
    assert "ttft_ratio" not in summary.loc["full"].note
    err = capsys.readouterr().err
    assert "2 row(s) divide their TTFT by a full prefill another run timed" in err and "toy a3@0.2" in err
    assert said in (tmp_path / "out" / "summary.md").read_text()
    alone = evaluate([own], tmp_path / "own").set_index("method")      # its own --compare-full timings
    assert alone.loc["epic"].ttft_ratio == pytest.approx(0.25) and "ttft_ratio" not in alone.loc["epic"].note
    assert "another run" not in capsys.readouterr().err
    # beside a full run that another run timed, they still come first: timed by the record's own run
    with_sweep = evaluate([sweep, own], tmp_path / "both").set_index("method")
    assert with_sweep.loc["epic"].ttft_ratio == pytest.approx(0.25) and "ttft_ratio" not in with_sweep.loc["epic"].note


def test_significance_lines_name_a_labelled_run_as_kvf_compare_takes_it(tmp_path):
    """summary.md's significance lines named an ablation row `kvfuse [sink_tokens=8]@0.15`, a form `kvf compare --a`
    refused ("no records match"); they now print method@ratio:label, the selector compare's own errors list."""
    from kvf.eval.compare import select
    from kvf.eval.report import load_runs
    answers = {"q1": "Paris", "q2": "Rome", "q3": "Berlin", "q4": "Lisbon"}
    wrong = {"q1": "Oslo", "q2": "Oslo", "q3": "Oslo", "q4": "Oslo"}
    run = write_run(tmp_path / "run.jsonl", replicated("full", answers, ratio=1.0, ttft=2.0)
                    + [dict(r, label="deviation=v") for r in replicated("cacheblend", wrong, ratio=0.2)])
    evaluate([run], tmp_path / "out")
    text = (tmp_path / "out" / "summary.md").read_text()
    named = re.search(r"significantly below full: ([^\s;,]+)", text)[1]
    assert named == "cacheblend@0.2:deviation=v", text
    picked = select(load_runs([run]), named, "--a")
    assert set(picked.label) == {"deviation=v"} and len(picked) == 4 * REPS


def test_compare_summary_names_the_datasets_it_pools():
    """`kvf compare results/ruler/runs/` takes the 2K and 4K suites as one run each; its summary said "over 400
    questions" without saying that it pooled both lengths. It now names them with their counts; one suite's tasks
    (ruler-2048/niah_single, ruler-2048/alias) are one dataset there, and one dataset says nothing more."""
    from kvf.eval.compare import comparison_summary, pooled_over
    suites = pd.Series(["ruler-2048/alias"] * 3 + ["ruler-2048/boundary"] * 2 + ["ruler-4096/alias"] * 4)
    assert pooled_over(suites) == " of ruler-2048 (5) and ruler-4096 (4)"
    assert pooled_over(pd.Series(["ruler-2048/alias", "ruler-2048/boundary"])) == ""
    assert pooled_over(pd.Series(["nq", "musique", "nq"])) == " of musique (1) and nq (2)"
    table = pd.DataFrame({"dataset": ["nq", "musique"] * 10, "qid": [f"q{i}" for i in range(20)],
                          "answer_a": ["x"] * 20, "answer_b": ["y"] * 20, "score_a": [1.0] * 20, "score_b": [0.0] * 20,
                          "fidelity_a": [1.0] * 20, "fidelity_b": [0.5] * 20})
    table.attrs["metric"] = "f1"
    assert comparison_summary(table).startswith("over 20 questions of musique (10) and nq (10) (20 answered differently)")


def test_compare_summary_says_why_it_has_no_vs_full():
    """Two runs with no full prefill beside them (no full run, no --compare-full): the summary left "vs full" out
    and the table showed "full  -", without saying why. It now says so, with the fix; with full's answers, no."""
    from kvf.eval.compare import comparison_summary
    table = pd.DataFrame({"dataset": ["nq"] * 20, "qid": [f"q{i}" for i in range(20)], "answer_a": ["x"] * 20,
                          "answer_b": ["y"] * 20, "score_a": [1.0] * 20, "score_b": [0.0] * 20, "full_answer": [""] * 20,
                          "fidelity_a": [math.nan] * 20, "fidelity_b": [math.nan] * 20})
    table.attrs.update(metric="f1", full_side=None)
    assert "vs full: - (no full prefill answered these questions: add -m full to the run, or re-run it with --compare-full)" in \
        comparison_summary(table)
    answered = table.assign(full_answer="x", fidelity_a=1.0, fidelity_b=0.0)
    assert "no full prefill" not in comparison_summary(answered) and "vs full: A 1.000, B 0.000" in comparison_summary(answered)


def test_a_ranking_leaves_out_a_measure_no_row_has_and_says_why(tmp_path, monkeypatch):
    """RULER rows run without --compare-full and without a full run drew a fidelity frame with nothing in it, its
    note over the x label. A ranking now draws only the measures some row has; the title names what is missing
    and how to get it. With no measure at all the gold frame stays, saying so."""
    from kvf.eval import plots
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.update({Path(path).name: fig}))
    nan = float("nan")
    rows = pd.DataFrame({"method": ["kvfuse", "kvfuse"], "label": ["", "key_shift_scale=0.5"], "variant": "fusion",
                         "ratio": 0.15, "metric": "acc", "n": 80, "acc": [0.75, 0.7], "metric_low": [0.65, 0.6],
                         "metric_high": [0.85, 0.8], "fidelity_f1": nan, "fidelity_low": nan, "fidelity_high": nan})
    plots.plot_ranking(rows, "ruler at recompute ratio 0.15", tmp_path / "ranking.png")
    [gold] = figures["ranking.png"].axes
    assert [bar.get_width() for bar in gold.patches] == [0.7, 0.75] and gold.get_xlabel() == plots.METRIC_NAMES["acc"]
    assert figures["ranking.png"].texts[0].get_text().endswith("\n" + plots.NO_FIDELITY)
    plots.plot_ranking(rows.assign(acc=nan, metric_low=nan, metric_high=nan), "none", tmp_path / "ranking.png")
    [gold] = figures["ranking.png"].axes
    assert [t.get_text() for t in gold.texts] == [plots.NO_GOLD]
    # every row scored 0 (a weak model's gold F1): the bars had no width and the panel read as failed to draw
    plots.plot_ranking(rows.assign(acc=0.0, metric_low=0.0, metric_high=0.0), "zeros", tmp_path / "ranking.png")
    [gold] = figures["ranking.png"].axes
    assert [t.get_text() for t in gold.texts] == [plots.ALL_ZERO] and len(gold.get_xticks()) > 1   # the axis stays
    plots.plot_ranking(rows.assign(acc=[0.0, 0.0], metric_high=[0.1, 0.0]), "a zero with an interval", tmp_path / "r.png")
    assert len(figures["r.png"].axes[0].texts) == 0   # an interval above 0 is drawn, and said by the bars


def test_a_ranking_keeps_its_panels_wide_and_their_labels_apart_with_long_row_names(tmp_path, monkeypatch):
    """kvfuse's dev ranking names rows by their knobs (~100 characters): the figure was 12 inches wide whatever the
    names, so the names took most of it, the two panels shrank to an inch each and their x labels ran into each
    other. The figure now widens with its longest name."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from kvf.eval import plots
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.setdefault(Path(path).name, fig))
    long = "sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85:ape_temperature=0.9:ape_scale=0.9"
    rows = pd.DataFrame({"method": ["full", "kvfuse", "kvfuse"], "label": ["", "", long], "variant": "fusion",
                         "ratio": 0.15, "metric": "acc", "n": 40, "acc": [0.8, 0.6, 0.5], "metric_low": [0.7, 0.5, 0.4],
                         "metric_high": [0.9, 0.7, 0.6], "fidelity_f1": [1.0, 0.9, 0.85],
                         "fidelity_low": [1.0, 0.85, 0.8], "fidelity_high": [1.0, 0.95, 0.9]})
    plots.plot_ranking(rows, "ruler at recompute ratio 0.15", tmp_path / "ranking.png")
    fig = figures["ranking.png"]
    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    gold, fidelity = fig.axes
    for ax in (gold, fidelity):
        assert ax.get_window_extent(renderer).width / fig.dpi >= 2.5                 # inches of panel
    left, right = gold.xaxis.label.get_window_extent(renderer), fidelity.xaxis.label.get_window_extent(renderer)
    assert left.x1 < right.x0                                                         # the x labels do not meet
    names = gold.get_yticklabels()[-1].get_window_extent(renderer)
    assert names.x0 >= 0                                                              # the longest name is on the figure


def test_answer_kl_and_agreement_are_columns_only_where_records_measured_them(runs, tmp_path):
    """kvf run --compare-full records answer_kl_full / answer_agree_full (full's whole answer, teacher-forced
    over each cache) since 2026-11-30: their means are summary columns beside top1_agree, and tables of older
    records keep their columns (and bytes). kvf compare takes full's answers from --compare-full alone (0 and 1)."""
    before = evaluate(runs, tmp_path / "old")
    header = (tmp_path / "old" / "summary.csv").read_text().splitlines()[0].split(",")
    assert "answer_kl" not in header and "answer_kl" not in (tmp_path / "old" / "summary.md").read_text()
    measured = write_run(tmp_path / "measured.jsonl", replicated("prophetkv", {
        q: (answer, {"full_answer": full, "kl_full": 0.1, "top1_agree_full": True,
                     "answer_kl_full": kl, "answer_agree_full": agree})
        for q, answer, full, kl, agree in (("q1", "Paris", "Paris", 0.0, 1.0), ("q2", "Rome", "Rome", 0.2, 1.0),
                                           ("q3", "Munich", "Berlin", 0.4, 0.5), ("q4", "Porto", "Lisbon", 0.6, 0.0))},
        ratio=0.2))
    summary = evaluate([measured], tmp_path / "new")
    prophet = row(summary, "prophetkv")
    assert prophet.answer_kl == pytest.approx(0.3) and prophet.answer_agree == pytest.approx(0.625)
    header = (tmp_path / "new" / "summary.csv").read_text().splitlines()[0].split(",")
    at = header.index("top1_agree") + 1
    assert header[at: at + 4] == ["answer_kl", "answer_kl_low", "answer_kl_high", "answer_agree"]
    assert prophet.answer_kl_low < 0.3 < prophet.answer_kl_high
    assert "`answer_kl` / `answer_agree`" in (tmp_path / "new" / "summary.md").read_text()
    # the ranking figure gets a third panel, the KL with its interval; older tables keep two
    from kvf.eval import plots
    panels = {}
    for name, files in (("old", runs), ("new", [measured])):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(plots, "save_figure", lambda fig, path, name=name: panels.setdefault(name, fig.axes))
            evaluate(files, tmp_path / f"{name}-figures")
    assert len(panels["old"]) == 2 and len(panels["new"]) == 3
    assert "KL" in panels["new"][2].get_xlabel() and len(panels["new"][2].patches) == 1   # one bar: prophetkv
    assert "answer_kl" not in before.columns or before.answer_kl.isna().all()
    # kvf compare gives their paired differences too
    from kvf.eval.compare import comparison_summary, per_question, select
    from kvf.eval.report import load_runs
    df = load_runs([measured])
    line = comparison_summary(per_question(df, select(df, "prophetkv@0.2"), select(df, "full")))
    assert "full's answer KL: A 0.300, B 0.000" in line and "full's answer tokens agreed: A 0.625, B 1.000" in line


def test_pairs_test_full_answer_agreement_and_kl_where_records_measured_them(tmp_path):
    """Where records carry answer_agree_full and answer_kl_full, pairs.csv tests them as a third and fourth measure
    (Holm within each family); two runs whose answers part from full's equally often in F1 but at different tokens
    differ there. KL's pairs put the lower KL first."""
    full_answers = {"q1": "the city of Paris", "q2": "in Rome today", "q3": "Berlin was it", "q4": "Lisbon by the sea"}

    def run(method, agree):
        return replicated(method, {q: ("x", {"full_answer": a, "answer_agree_full": agree[i], "answer_kl_full": 1 - agree[i]})
                                   for i, (q, a) in enumerate(full_answers.items())}, ratio=0.2)
    early = write_run(tmp_path / "early.jsonl", run("prophetkv", [0.0, 0.25, 0.0, 0.25]))
    late = write_run(tmp_path / "late.jsonl", run("cacheblend", [0.75, 0.75, 1.0, 0.75]))
    evaluate([early, late], tmp_path / "out", command="kvf eval")
    pairs = pd.read_csv(tmp_path / "out" / "pairs.csv")
    agreement = pairs[pairs.measure == "answer_agree"].iloc[0]
    assert agreement.a.startswith("cacheblend") and agreement["diff"] == pytest.approx(0.8125 - 0.125)
    assert agreement.significant
    fidelity = pairs[pairs.measure == "fidelity_f1"].iloc[0]
    assert fidelity["diff"] == 0 and not fidelity.significant        # the same answer F1 ("x" against each)
    kl = pairs[pairs.measure == "answer_kl"].iloc[0]                 # lower is better: cacheblend first, a - b < 0
    assert kl.a.startswith("cacheblend") and kl["diff"] == pytest.approx(0.1875 - 0.875) and kl.high < 0
    assert kl.a_mean == pytest.approx(0.1875) and kl.significant
    summary_md = (tmp_path / "out" / "summary.md").read_text()
    assert "full's answer tokens agreed" in summary_md
    assert "full's answer KL per token (lower first)" in summary_md and "  - cacheblend (prefix) < prophetkv (prefix): -0.688" in summary_md


def test_a_long_knob_list_is_broken_into_lines_in_the_legend_and_the_ranking(tmp_path, monkeypatch):
    """kvfuse's ablations (labels of up to nine knobs) drew a quality legend wider than both of its panels and
    ranking row names wider than the bars: both are now broken after a knob's ':', every character kept."""
    from kvf.eval import plots
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.setdefault(Path(path).name, fig))
    knobs = "sink_tokens=8:sinks_after_top=2:locate_from=0.6:locate_to=0.85:ape_temperature=0.9:ape_scale=0.9"
    score = [1.0, 0.6, 0.5]
    rows = pd.DataFrame({"dataset": "toy", "method": ["full", "kvfuse", "kvfuse"], "label": ["", "", knobs],
                         "variant": "fusion", "ratio": [0.0, 0.15, 0.15], "recomputed_frac": [1.0, 0.15, 0.15],
                         "metric": "f1", "n": 8, "f1": [0.1, 0.08, 0.07], "metric_low": 0.0, "metric_high": 0.2,
                         "fidelity_f1": score, "fidelity_low": [s - 0.1 for s in score],
                         "fidelity_high": [min(1.0, s + 0.1) for s in score]})
    long_name = f"kvfuse [{knobs}]"
    plots.plot_quality(rows, "toy", tmp_path / "quality.png")
    legend = figures["quality.png"].legends[0]
    entries = [text.get_text() for text in legend.get_texts()]
    [broken] = [entry for entry in entries if "\n" in entry]
    assert broken.replace("\n", "") == long_name and all(line.endswith(":") for line in broken.split("\n")[:-1])
    assert max(len(line) for entry in entries for line in entry.split("\n")) <= plots.LEGEND_LABEL_CHARS
    plots.plot_ranking(rows[rows.ratio == 0.15], "toy at recompute ratio 0.15", tmp_path / "ranking.png")
    names = [tick.get_text() for tick in figures["ranking.png"].axes[0].get_yticklabels()]
    assert long_name in [name.replace("\n", "") for name in names] and any("\n" in name for name in names)
    assert max(len(line) for name in names for line in name.split("\n")) <= plots.RANKING_NAME_CHARS


def test_the_ttft_plot_wraps_its_panels_and_counts_many_rows_it_leaves_out(tmp_path, monkeypatch):
    """RULER's four tasks and their pool at two lengths drew ten TTFT panels in one row (44 inches wide), and 52
    kvfuse ablations timed against another run's full prefill were named on one line under it (260 inches)."""
    from kvf.eval import plots
    figures = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.setdefault(Path(path).name, fig))
    datasets = [f"ruler-{n}/{task}" for n in (2048, 4096) for task in ("alias", "boundary", "niah_single")]
    drawn = pd.DataFrame([{"dataset": d, "method": m, "label": "", "variant": "prefix", "ratio": r, "n": 10,
                           "recomputed_frac": r, "ttft_ratio": t, "ttft_s": 7.0, "_ttft_mixed": False}
                          for d in datasets for m, r, t in (("full", 0.0, 1.0), ("cacheblend", 0.15, 0.3))])
    elsewhere = pd.DataFrame([{"dataset": datasets[0], "method": "kvfuse", "label": f"sink_tokens={i}",
                               "variant": "fusion", "ratio": 0.15, "n": 10, "recomputed_frac": 0.15, "ttft_ratio": 0.3,
                               "ttft_s": 7.0, "_ttft_mixed": True} for i in range(plots.NOTE_NAMES_AT_MOST + 1)])
    plots.plot_ttft(pd.concat([drawn, elsewhere], ignore_index=True), tmp_path / "ttft.png")
    figure = figures["ttft.png"]
    panels = [ax for ax in figure.axes if ax.get_title()]
    assert sorted(ax.get_title().split(" (")[0] for ax in panels) == sorted(datasets)
    rows = {round(ax.get_position().y0, 3) for ax in panels}
    assert len(rows) == 2 and figure.get_figwidth() < 16               # two rows of three, not one row of six
    note = next(text.get_text() for text in figure.texts if text.get_text().startswith("not drawn"))
    assert f"{plots.NOTE_NAMES_AT_MOST + 1} rows (summary.md's notes name them)" in note and "sink_tokens" not in note
    plots.plot_ttft(pd.concat([drawn, elsewhere.iloc[:2]], ignore_index=True), tmp_path / "few.png")
    note = next(text.get_text() for text in figures["few.png"].texts if text.get_text().startswith("not drawn"))
    assert "kvfuse [sink_tokens=0] (fusion) at 0.15" in note and "kvfuse [sink_tokens=1] (fusion) at 0.15" in note
    # cacheblend drawn at 0.3 and left out at 0.15 and 0.05: the note names those two ratios, so that the line
    # drawn does not read as missing
    blend = drawn[drawn.method == "cacheblend"].iloc[0]
    partly = pd.DataFrame([drawn.iloc[0]] + [blend.copy() for _ in range(3)]).reset_index(drop=True)
    partly.loc[1:, "ratio"], partly.loc[1:, "_ttft_mixed"] = [0.3, 0.15, 0.05], [False, True, True]
    plots.plot_ttft(partly, tmp_path / "partly.png")
    note = next(text.get_text() for text in figures["partly.png"].texts if text.get_text().startswith("not drawn"))
    assert note.endswith("cacheblend (prefix) at 0.05, 0.15")


def test_many_configurations_at_one_ratio_stay_within_a_span_around_it():
    """kvfuse's 60 dev configurations at 15%, each 2.5 points from the next, spread 150 points (2 inches) and ran out
    of the panel on both sides; past DODGE_SPAN_POINTS they draw closer together."""
    from matplotlib.figure import Figure
    from kvf.eval.plots import DODGE_POINTS, DODGE_SPAN_POINTS, dodged
    ax = Figure(dpi=72).subplots()                                  # 72 dpi: one pixel a point
    centre = ax.transData.transform((0.15, 0.5))[0]
    shifts = [dodged(ax, i, 60).transform((0.15, 0.5))[0] - centre for i in range(60)]
    assert shifts[-1] - shifts[0] == pytest.approx(DODGE_SPAN_POINTS) and shifts == sorted(shifts)
    few = [dodged(ax, i, 3).transform((0.15, 0.5))[0] - centre for i in range(3)]
    assert few == pytest.approx([-DODGE_POINTS, 0, DODGE_POINTS])   # a few keep their full step


def test_answers_cut_partway_through_their_gold_are_said_by_run_and_eval(tmp_path, capsys):
    """`kvf run` of a RULER suite with --max-new-tokens 12 scored every method 0, full prefill too: each answer
    stopped inside its number ("... for jungle is 9800" for 9800301), and nothing said why. An answer that took every
    new token, holds no gold answer whole and ends with the start of one is now counted by run and eval, with the
    fix; an answer cut elsewhere (the model running on) or one that ended before the cap is not."""
    from kvf.pipeline.records import cut_in_gold
    from kvf.pipeline.workflows.run import MethodStats
    assert cut_in_gold("The special magic number for jungle is 9800", ["9800301"], 12, 12) == "9800301"
    assert cut_in_gold("It was the capital, Par", ["Paris"], 12, 12) == "Paris"
    assert cut_in_gold("The special magic number for jungle is 9800", ["9800301"], 11, 12) is None   # it ended there
    assert cut_in_gold("It is 9800301 and", ["9800301"], 12, 12) is None                       # gold whole: right
    assert cut_in_gold("The number is 19800", ["9800301"], 12, 12) is None                     # not from a word's start
    assert cut_in_gold("It was the capital, P", ["Paris"], 12, 12) is None                     # one letter: too little
    assert cut_in_gold("The answer is that the city", ["Paris"], 12, 12) is None               # ran on: the model's
    assert cut_in_gold("It was Par", ["Paris"], None, 12) is None                              # a record from before
    cut = record("q1", "full", "It was the capital, Par", ratio=1.0, answer_tokens=12)
    cut["settings"]["max_new_tokens"] = 12
    whole = record("q2", "full", "Rome", ratio=1.0, answer_tokens=2)
    whole["settings"]["max_new_tokens"] = 12
    stats = MethodStats()
    stats.add(whole)
    assert stats.cut_warning() is None
    stats.add(cut)
    assert stats.cut_warning() == ("1 of 2 answers stopped at --max-new-tokens 12 partway through their gold answer "
                                   "(e.g. q1, full: '...It was the capital, Par' for 'Paris'), so they score as wrong; "
                                   "re-run with a larger --max-new-tokens, into a new --out or with --overwrite")
    run_file = write_run(tmp_path / "cut.jsonl", [cut, whole])
    evaluate([run_file], tmp_path / "out")
    err = " ".join(capsys.readouterr().err.split())
    assert (f"warning: 1 of 2 answers in {run_file} stopped at --max-new-tokens 12 partway through their gold answer "
            "(e.g. q1, full@1: '...It was the capital, Par' for 'Paris'), so they score as wrong; re-run them with a "
            "larger --max-new-tokens") in err
