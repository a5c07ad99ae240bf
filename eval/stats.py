"""Paired bootstrap intervals: is a difference between two methods on the same questions real?"""
from __future__ import annotations

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
    common = sorted(set(a.index) & set(b.index))
    if not common:
        return math.nan, math.nan, math.nan, 0
    diff = (a.loc[common].astype(float) - b.loc[common].astype(float)).to_numpy()     # [questions]
    picks = np.random.default_rng(seed).integers(0, len(diff), (samples, len(diff)))  # [samples, questions]
    low, high = np.percentile(diff[picks].mean(axis=1), [2.5, 97.5])
    return float(diff.mean()), float(low), float(high), len(common)


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
    """95% percentile-bootstrap interval of the mean over questions (NaN, NaN when empty)."""
    x = values.dropna().astype(float).to_numpy()
    if not len(x):
        return math.nan, math.nan
    picks = np.random.default_rng(seed).integers(0, len(x), (samples, len(x)))
    low, high = np.percentile(x[picks].mean(axis=1), [2.5, 97.5])
    return float(low), float(high)
