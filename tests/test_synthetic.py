"""The synthetic two-hop corpus: deterministic, two chunks needed, prepared layout."""
import json
import re

import pytest

from kvf.errors import KvfError
from kvf.pipeline.data.datasets import load_prepared
from kvf.pipeline.data.synthetic import make_synthetic


def mentions(text: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def test_same_seed_same_corpus_other_seed_other_corpus():
    a = make_synthetic(None, n_questions=5, seed=3)
    assert a == make_synthetic(None, n_questions=5, seed=3)
    assert a != make_synthetic(None, n_questions=5, seed=4)


def test_answer_needs_two_chunks():
    questions = make_synthetic(None, n_questions=30, passages_per_question=5, seed=0)
    for q in questions:
        assert len(q.contexts) == 5
        answer = q.answers[0]
        # the answer is in exactly one of the question's passages ...
        with_answer = [p for p in q.contexts if mentions(p.text, answer)]
        assert len(with_answer) == 1, q
        # ... which does not name the question's subject: the bridge passage is needed too
        subject_passages = [p for p in q.contexts if p.title in q.question]
        assert len(subject_passages) == 1
        assert not any(mentions(with_answer[0].text, w) for w in subject_passages[0].title.split())
        # the bridge entity (title of the answer passage) links the two
        assert mentions(subject_passages[0].text, with_answer[0].title)


def test_answers_are_unique_across_the_corpus():
    questions = make_synthetic(None, n_questions=40, seed=1)
    texts = [p.text for q in questions for p in q.contexts]
    for q in questions:
        assert sum(mentions(t, q.answers[0]) for t in texts) == 1


def test_passage_lengths_between_60_and_150_words():
    lengths = [len(p.text.split()) for q in make_synthetic(None, n_questions=30, seed=2) for p in q.contexts]
    assert min(lengths) >= 60 and max(lengths) <= 150


def test_writes_prepared_layout(tmp_path):
    questions = make_synthetic(tmp_path, n_questions=6, passages_per_question=3, seed=0)
    loaded, passages = load_prepared(tmp_path)
    assert [(q.qid, q.question, q.answers, q.contexts) for q in loaded] == \
           [(q.qid, q.question, q.answers, q.contexts) for q in questions]
    assert len(passages) == 18
    manifest = json.loads((tmp_path / "prepared.json").read_text())
    assert manifest["dataset"] == "synthetic" and manifest["seed"] == 0


def test_bad_arguments():
    with pytest.raises(KvfError, match="at least 2"):
        make_synthetic(None, passages_per_question=1)
    with pytest.raises(KvfError, match="at least 1"):
        make_synthetic(None, n_questions=0)


def test_names_never_run_out(monkeypatch):
    """With one syllable to draw from there is one two-syllable river name; the next ones must grow a
    syllable (a large -n used to loop forever once every stem was taken), and stay unique."""
    import random
    import signal
    from kvf.pipeline.data import synthetic

    monkeypatch.setattr(synthetic, "ONSETS", ["b"])
    monkeypatch.setattr(synthetic, "VOWELS", ["a"])
    monkeypatch.setattr(synthetic, "CODAS", ["n"])

    def hung(*_):
        raise AssertionError("NameMaker.new never returned: the names ran out")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        names = synthetic.NameMaker(random.Random(0))
        rivers = [names.new("river") for _ in range(3)]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert rivers == ["Banban", "Banbanban", "Banbanbanban"]


def test_progress_sees_every_question():
    totals, seen = [], []

    def track(items, total):
        totals.append(total)
        for i in items:
            seen.append(i)
            yield i

    assert len(make_synthetic(None, 3, track=track)) == 3 and totals == [3] and seen == [0, 1, 2]
