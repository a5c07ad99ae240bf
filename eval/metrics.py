"""Answer-quality metrics: SQuAD-normalised EM, token F1, substring accuracy, and normalized F1.

All per-answer metrics take one prediction and a list of gold aliases and score the best alias.
An empty prediction (empty after normalisation) scores 0 everywhere.
"""
import re
import string
from collections import Counter

PUNCTUATION = set(string.punctuation)
ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower-case, drop punctuation, drop articles, fold whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in PUNCTUATION)
    text = ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _as_golds(golds) -> list[str]:
    # a bare string is one alias, not a list of characters
    golds = [golds] if isinstance(golds, str) else list(golds)
    if not golds:
        raise ValueError("no gold answers to score against")
    return golds


def exact_match(pred: str, golds) -> float:
    """1.0 if the normalised prediction equals any normalised gold alias."""
    pred = normalize_answer(pred)
    if not pred:
        return 0.0
    return float(any(pred == normalize_answer(g) for g in _as_golds(golds)))


def _f1_one(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(pred: str, golds) -> float:
    """SQuAD token-overlap F1, maximised over gold aliases."""
    pred_tokens = normalize_answer(pred).split()
    if not pred_tokens:
        return 0.0
    return max(_f1_one(pred_tokens, normalize_answer(g).split()) for g in _as_golds(golds))


def substring_accuracy(pred: str, golds) -> float:
    """1.0 if any normalised gold alias occurs inside the normalised prediction (lost-in-the-middle)."""
    pred = normalize_answer(pred)
    if not pred:
        return 0.0
    # a gold that normalises to "" (e.g. "The") would match everything: it cannot count
    golds = [normalize_answer(g) for g in _as_golds(golds)]
    return float(any(g and g in pred for g in golds))


# Below this gap between full prefill's and full reuse's F1 the scale of eq. 11 is noise: dividing
# by a gap of 0.01 turns a 0.05 F1 wobble into "5x better than full". A negative gap (reuse beats
# full, as a 135M model can on a hard set) has no "0 = reuse, 1 = full" reading at all.
NORMALIZED_F1_MIN_GAP = 0.02


def normalized_f1(f1: float, f1_reuse: float, f1_full: float) -> float | None:
    """FusionRAG eq. 11: where a method sits between full reuse (0) and full prefill (1).

    None ("undefined") unless full beats reuse by at least NORMALIZED_F1_MIN_GAP F1.
    """
    denominator = f1_full - f1_reuse
    if denominator < NORMALIZED_F1_MIN_GAP:
        return None
    return (f1 - f1_reuse) / denominator


def gold_values_present(pred: str, golds) -> float:
    """RULER's score: the fraction of the gold values that occur in the prediction (normalised,
    as whole words). Every value counts: a multi-value question answered with one of two values scores 0.5."""
    pred = f" {normalize_answer(pred)} "
    golds = [normalize_answer(g) for g in _as_golds(golds)]
    golds = [g for g in golds if g]
    if not golds:
        return 0.0
    return sum(f" {g} " in pred for g in golds) / len(golds)


def accuracy(pred: str, golds, gold_mode: str) -> float:
    """`acc`: RULER's share of gold values present where every value is asked for (gold_mode "all"), else
    whether any gold alias occurs in the prediction."""
    return gold_values_present(pred, golds) if gold_mode == "all" else substring_accuracy(pred, golds)


def is_suite_dataset(dataset: str) -> bool:
    """A generated suite's task ("ruler-2048/boundary")."""
    return "/" in dataset


def scored_by_accuracy(dataset: str, gold_mode: str) -> bool:
    """Whether answers to these questions are scored by `acc` rather than F1: a generated suite's tasks, and
    questions whose answers need every gold value."""
    return is_suite_dataset(dataset) or gold_mode == "all"
