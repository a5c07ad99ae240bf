"""The arithmetic of `make bench-scale`'s per-question sweep cost (the timings themselves are a
benchmark, not a test): when each question's records were all written, and the distinct prefills'
own layer-loop seconds that no exact sharing removes."""
import pytest

from kvf.scripts.bench_scale import own_prefill_seconds, question_ends


def test_question_ends_are_the_first_samples_with_all_of_a_questions_records(tmp_path):
    seen = [(0.1, 0), (1.0, 2), (1.5, 3), (2.0, 4), (2.5, 4), (4.0, 6)]
    assert question_ends(seen, 6, 3, tmp_path / "run.jsonl") == [1.0, 2.0, 4.0]


def test_uneven_records_per_question_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="run.jsonl"):
        question_ends([(1.0, 5)], 5, 2, tmp_path / "run.jsonl")


def record(qid, method, ratio, variant, seconds, shared=()):
    return {"qid": qid, "method": method, "settings": {"ratio": ratio, "variant": variant},
            "timings": {"recompute": seconds}, "shared": list(shared)}


def test_a_prefill_shared_by_several_records_is_counted_once():
    records = []
    for qid, scale in (("q1", 10.0), ("q2", 1.0)):
        records += [record(qid, "full", 1.0, "prefix", 3 * scale, ["prefill:full"]),
                    record(qid, "reuse", 0.0, "prefix", 1 * scale),
                    record(qid, "cacheblend", 0.0, "prefix", 1 * scale, ["reuse-prefill:prefix"]),
                    record(qid, "epic", 0.0, "prefix", 1 * scale, ["reuse-prefill:prefix"]),
                    record(qid, "fusionrag", 0.0, "fusion", 0.5 * scale, ["reuse-prefill:fusion"]),
                    record(qid, "cacheblend", 0.3, "prefix", 2 * scale)]
    assert own_prefill_seconds(records, skip_first=False) == pytest.approx((65 + 6.5) / 2)
    assert own_prefill_seconds(records) == pytest.approx(6.5)  # the first question is start-up


@pytest.mark.parametrize("flag,value", [("--share-questions", "1"), ("--sweep-questions", "2")])
def test_too_few_questions_for_a_steady_rate_is_one_line_naming_the_flag(flag, value):
    from kvf.scripts.bench_scale import parse_args
    with pytest.raises(SystemExit, match=f"{flag} {value}: needs at least"):
        parse_args([flag, value])
