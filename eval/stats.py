"""Paired bootstrap intervals: is a difference between two methods on the same questions real?"""
from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd

BOOTSTRAP_SAMPLES = 2000
MIN_QUESTIONS = 20  # below this, an interval over questions says little: we print "too few questions"


def paired_bootstrap(a: pd.Series, b: pd.Series, samples: int = BOOTSTRAP_SAMPLES,
                     seed: int = 0) -> tuple[float, float, float, int]:
    """Mean of a - b over the questions (index) both have, its 95% percentile-bootstrap interval,
    and how many questions that was: (mean, low, high, n). Questions are resampled with
    replacement (fixed seed: a report is reproducible); pairing keeps per-question difficulty out
    of the interval."""
    diff = paired_differences(a, b)                                                   # [questions]
    if not len(diff):
        return math.nan, math.nan, math.nan, 0
    low, high = np.percentile(bootstrap_means(diff, samples, seed), [2.5, 97.5])
    return float(diff.mean()), float(low), float(high), len(diff)


def ratio_of_means_interval(a: np.ndarray, b: np.ndarray, samples: int = BOOTSTRAP_SAMPLES,
                            seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of mean(a) / mean(b) over paired items (a[i], b[i]: one question's cost
    under two codes), the pairs resampled together (fixed seed)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)                      # [questions] each
    picks = resamples(len(a), samples, seed)                                           # [samples, questions]
    low, high = np.percentile(a[picks].sum(axis=1) / b[picks].sum(axis=1), [2.5, 97.5])
    return float(low), float(high)


def in_question_order(values: pd.Series) -> np.ndarray:
    """The values sorted by question (index), ties by value: an order that the records' order cannot change."""
    frame = pd.DataFrame({"question": values.index.astype(str), "value": values.to_numpy()})
    return frame.sort_values(["question", "value"], kind="stable")["value"].to_numpy()


def paired_differences(a: pd.Series, b: pd.Series) -> np.ndarray:
    """a - b on the questions (index) both have, in question order."""
    by_question_a = dict(zip(a.index, a.to_numpy(dtype=float)))   # dicts: pandas' .loc on a list of labels
    by_question_b = dict(zip(b.index, b.to_numpy(dtype=float)))   # took most of a large eval's time
    common = sorted(by_question_a.keys() & by_question_b.keys())
    return np.array([by_question_a[q] - by_question_b[q] for q in common], dtype=float)


# draws are cached per question count up to this many entries (~40 MB in float64: 20,000 flips of 256
# questions); larger ones are made afresh each time, so memory stays bounded whatever n is
CACHED_DRAW_LIMIT = 20000 * 256


def bootstrap_means(x: np.ndarray, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> np.ndarray:
    """Means of `samples` resamples of x with replacement (fixed seed: reports are reproducible)."""
    if samples * len(x) > CACHED_DRAW_LIMIT:
        return x[draw_resamples(len(x), samples, seed)].mean(axis=1)
    return x[resamples(len(x), samples, seed)].mean(axis=1)                        # [samples]


def draw_resamples(n_questions: int, samples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_questions, (samples, n_questions))   # [samples, questions]


@functools.lru_cache(maxsize=4)
def resamples(n_questions: int, samples: int, seed: int) -> np.ndarray:
    """Which questions each resample draws: they depend on the question count only, so every interval
    over the same n shares one draw."""
    picks = draw_resamples(n_questions, samples, seed)
    picks.setflags(write=False)
    return picks


PERMUTATIONS = 20000


def paired_p_value(a: pd.Series, b: pd.Series, permutations: int = PERMUTATIONS, seed: int = 0) -> float:
    """Two-sided paired permutation p-value of "a and b score alike": under that hypothesis each
    question's difference is as likely to have either sign, so flip signs at random and count how
    often the mean is at least as far from 0 as observed. 20,000 flips resolve p down to 5e-5,
    small enough for a Holm adjustment over ~100 pairs (a bootstrap of 2,000 could not)."""
    diff = paired_differences(a, b)                                                # [questions]
    if not len(diff):
        return math.nan
    observed = abs(diff.mean())
    if permutations * len(diff) > CACHED_DRAW_LIMIT:   # block by block, as drawn
        blocks = flip_blocks(len(diff), permutations, seed)
    else:
        blocks = [sign_flips(len(diff), permutations, seed)]
    as_far = sum(int((np.abs(block @ diff / len(diff)) >= observed - 1e-12).sum()) for block in blocks)
    return (as_far + 1) / (permutations + 1)


def flip_blocks(n_questions: int, permutations: int, seed: int):
    """The random signs of every flip, in blocks of 5000 flips: [flips, questions] each."""
    rng = np.random.default_rng(seed)
    for start in range(0, permutations, 5000):
        yield rng.choice([-1.0, 1.0], (min(5000, permutations - start), n_questions))


@functools.lru_cache(maxsize=4)
def sign_flips(n_questions: int, permutations: int, seed: int) -> np.ndarray:
    """All the flips at once: they depend on the question count only, so the hundreds of pairs an eval
    tests with the same n share one draw (a report takes seconds, not minutes)."""
    flips = np.concatenate(list(flip_blocks(n_questions, permutations, seed)))   # [flips, questions]
    flips.setflags(write=False)
    return flips


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values: many pairs tested at once, family-wise error kept at 5%."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def significant(low: float, high: float) -> bool:
    """The 95% interval excludes 0."""
    return (low > 0 or high < 0) and not (math.isnan(low) or math.isnan(high))


def describe_difference(mean: float, low: float, high: float, n: int) -> str:
    """'+0.120 [+0.050, +0.190]', or why there is no interval."""
    if n == 0 or math.isnan(mean):
        return "-"
    if n < MIN_QUESTIONS:
        return f"too few questions to compare (n = {n})"
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def mean_interval(values: pd.Series, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean over questions (index), (NaN, NaN) when empty.
    Values are put in question order first: the fixed-seed resamples then pick the same questions
    whatever order the run file holds its records in (two sweeps side by side interleave them)."""
    x = in_question_order(values.dropna().astype(float))                          # [questions]
    if not len(x):
        return math.nan, math.nan
    low, high = np.percentile(bootstrap_means(x, samples, seed), [2.5, 97.5])
    return float(low), float(high)
