"""Metrics against hand-computed cases."""
import pytest

from kvf.eval.metrics import (exact_match, normalize_answer, normalized_f1, substring_accuracy,
                              token_f1)


def test_normalize_lowercases_strips_punctuation_articles_whitespace():
    assert normalize_answer("  The  Eiffel-Tower, in PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    # articles only as whole words: "theory" and "another" keep their letters
    assert normalize_answer("theory of another") == "theory of another"
    assert normalize_answer("the") == ""


def test_exact_match_uses_normalisation_and_any_alias():
    assert exact_match("The Beatles.", ["beatles"]) == 1.0
    assert exact_match("Beatles", ["The Rolling Stones", "the beatles"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert exact_match("Paris", "paris") == 1.0  # a bare string is one alias


def test_token_f1_hand_computed():
    # pred {new, york, city}, gold {new, york}: P = 2/3, R = 1, F1 = 0.8
    assert token_f1("New York City", ["New York"]) == pytest.approx(0.8)
    # pred {barack, obama}, gold {obama}: P = 1/2, R = 1, F1 = 2/3
    assert token_f1("Barack Obama", ["Obama"]) == pytest.approx(2 / 3)
    assert token_f1("London", ["Paris"]) == 0.0
    # repeated tokens count once per occurrence: "paris paris" vs "paris": P = 1/2, R = 1
    assert token_f1("paris paris", ["paris"]) == pytest.approx(2 / 3)


def test_token_f1_takes_best_alias():
    # aliases: 0.8 ("new york"), 1.0 ("new york city")
    assert token_f1("New York City", ["New York", "new york city"]) == 1.0
    assert token_f1("the Drelvan province", ["Drelvan", "Drelvan province"]) == 1.0


def test_substring_accuracy():
    assert substring_accuracy("It was born in Paris, France.", ["paris"]) == 1.0
    assert substring_accuracy("The answer is: THE BEATLES!", ["Beatles"]) == 1.0
    assert substring_accuracy("Paris", ["Paris, France"]) == 0.0  # gold must be inside the prediction
    # a gold that normalises to nothing must not match everything
    assert substring_accuracy("anything", ["The"]) == 0.0


def test_empty_prediction_scores_zero_everywhere():
    for pred in ["", "   ", "the", "."]:
        assert exact_match(pred, ["x"]) == 0.0
        assert token_f1(pred, ["x"]) == 0.0
        assert substring_accuracy(pred, ["x"]) == 0.0
    # even when the gold normalises to empty too
    assert exact_match("", ["the"]) == 0.0


def test_no_gold_is_an_error():
    with pytest.raises(ValueError):
        token_f1("x", [])


def test_normalized_f1():
    assert normalized_f1(0.5, 0.2, 0.8) == pytest.approx(0.5)
    assert normalized_f1(0.8, 0.2, 0.8) == pytest.approx(1.0)
    assert normalized_f1(0.2, 0.2, 0.8) == pytest.approx(0.0)
    assert normalized_f1(0.9, 0.2, 0.8) == pytest.approx(7 / 6)  # can exceed 1
    assert normalized_f1(0.5, 0.4, 0.4 + 1e-8) is None  # undefined: full and reuse tie
    assert normalized_f1(0.5, 0.40, 0.41) is None       # a gap of 0.01 F1 is noise, not a scale
    assert normalized_f1(0.5, 0.40, 0.30) is None       # reuse beats full: no 0..1 reading
    assert normalized_f1(0.45, 0.40, 0.43) == pytest.approx(5 / 3)  # a gap above the minimum
