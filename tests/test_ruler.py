"""The RULER-style generator: deterministic by seed, every passage one chunk, facts where it says."""
import json

import pytest

from kvf.pipeline.data.ruler import TASKS, make_ruler

LENGTH, CHUNK = 1024, 128


@pytest.fixture(scope="module")
def tokenizer():
    from kvf.pipeline.workflows.weights import open_model
    return open_model(None).tokenizer


def tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def suite(tokenizer, seed=0, n=2, tasks=tuple(TASKS)):
    return make_ruler(None, tokenizer, list(tasks), LENGTH, n, seed, CHUNK)


def test_same_seed_same_suite_other_seed_other_samples_and_ids(tokenizer):
    first, again, other = suite(tokenizer), suite(tokenizer), suite(tokenizer, seed=1)
    assert [(q.qid, q.question, q.answers, q.context_ids) for q in first] == \
           [(q.qid, q.question, q.answers, q.context_ids) for q in again]
    assert {q.qid for q in first}.isdisjoint({q.qid for q in other})     # seeds pool without clashing
    assert [q.context_ids for q in first] != [q.context_ids for q in other]
    assert first[0].qid == "niah_single-1024-000" and other[0].qid == "niah_single-1024-s1-000"


def test_every_passage_fits_one_chunk_and_the_sample_fits_its_length(tokenizer):
    for q in suite(tokenizer):
        sizes = [tokens(tokenizer, p.text) for p in q.contexts]
        assert max(sizes) <= CHUNK, (q.qid, max(sizes))
        assert sum(sizes) <= LENGTH - 150
        assert len(q.contexts) == (LENGTH - 150) // CHUNK


def test_facts_sit_in_the_chunks_named_by_fact_chunks(tokenizer):
    for q in suite(tokenizer, tasks=("niah_single", "niah_multikey", "boundary", "alias", "niah_multivalue")):
        texts = [p.text for p in q.contexts]
        if q.task == "boundary":                          # the key ends one chunk, the value starts the next
            a, b = q.fact_chunks
            assert b == a + 1 and texts[a].endswith("is:") and texts[b].startswith(q.answers[0])
            assert all(q.answers[0] not in t for i, t in enumerate(texts) if i != b)
        elif q.task == "alias":                           # the value is stated only in the earlier chunk
            a, b = q.fact_chunks
            assert a < b and q.answers[0] in texts[a] and q.answers[0] not in texts[b]
            assert "is the same as the one for" in texts[b]
        else:                                             # each gold value in exactly the chunks named
            for value in q.answers:
                holders = [i for i, t in enumerate(texts) if value in t]
                assert len(holders) == 1 and holders[0] in q.fact_chunks
        assert q.gold_mode == ("all" if q.task == "niah_multivalue" else "any")


def test_the_prepared_directory_records_the_seed(tokenizer, tmp_path):
    make_ruler(tmp_path / "r", tokenizer, ["niah_single"], LENGTH, 1, 3, CHUNK)
    manifest = json.loads((tmp_path / "r" / "prepared.json").read_text())
    assert manifest["seed"] == 3 and manifest["dataset"] == "ruler-1024"
    row = json.loads((tmp_path / "r" / "questions.jsonl").read_text().splitlines()[0])
    assert row["id"] == "niah_single-1024-s3-000"


def test_progress_sees_every_sample_as_it_is_made(tokenizer):
    """`kvf data ruler` draws its progress bar from `track`: told the total up front, then each sample."""
    calls = []

    def track(samples, total):
        calls.append(total)
        for sample in samples:
            calls.append(sample.qid)
            yield sample

    made = make_ruler(None, tokenizer, ["niah_single", "vt"], LENGTH, 2, 0, CHUNK, track=track)
    assert calls == [4, *[q.qid for q in made]] and len(made) == 4
    assert [q.qid for q in made] == [q.qid for q in suite(tokenizer, tasks=("niah_single", "vt"))]


def test_kvf_run_chunks_a_suite_s_workspace_to_its_passages(tokenizer, tmp_path, capsys):
    """`kvf data ruler --chunk-tokens 128` then `kvf run -d` chunked the new workspace to 256 tokens, not the
    suite's passages; a workspace chunked finer than them (which moves the boundaries the suite is made of) was
    used without a word."""
    import io
    from rich.console import Console
    from kvf.pipeline.workflows.build import BuildOptions, build_cache
    from kvf.pipeline.workflows.run import RunOptions, run
    quiet = Console(file=io.StringIO())
    make_ruler(tmp_path / "r", tokenizer, ["niah_single"], LENGTH, 1, 0, CHUNK)
    common = dict(dataset=tmp_path / "r", methods=["reuse"], ratios=[0.0], max_new_tokens=2, warmup=False)
    run(RunOptions(out=tmp_path / "a.jsonl", **common), quiet)
    answer = json.loads((tmp_path / "a.jsonl").read_text())
    assert answer["answer_tokens"] == 2 and answer["settings"]["max_new_tokens"] == 2   # how eval tells a cut answer
    assert json.loads((tmp_path / "r" / "workspace" / "manifest.json").read_text())["chunk_tokens"] == CHUNK
    assert "finer than" not in capsys.readouterr().err
    build_cache(BuildOptions(corpus=tmp_path / "r" / "corpus", workspace=tmp_path / "fine", chunk_tokens=64,
                             variants=("prefix",), bm25=False, dense=False), quiet)
    run(RunOptions(out=tmp_path / "b.jsonl", workspace=tmp_path / "fine", **common), quiet)
    assert (f"is chunked to 64 tokens, finer than the {CHUNK}-token passages" in capsys.readouterr().err)


def test_a_task_named_twice_is_made_once(tmp_path, capsys, monkeypatch):
    """`--tasks boundary,boundary` wrote each sample twice under one id, which kvf run then refused."""
    from conftest import run_cli
    code, _, err = run_cli(["data", "ruler", "--length", "1024", "--n", "2", "--tasks", "boundary,boundary", "-o",
                            tmp_path / "r"], capsys, monkeypatch)
    assert code == 0, err
    ids = [json.loads(line)["id"] for line in (tmp_path / "r" / "questions.jsonl").read_text().splitlines()]
    assert len(ids) == 2 and len(set(ids)) == 2, ids
