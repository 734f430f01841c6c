"""Benchmarks, one per stem (``dtcourse bench <stem>``): each times an implementation against its reference in
the same run, the variants taking turns step by step so that a burst of load from elsewhere hits them alike.

Shared by them: ``step_times`` (a variant's step times with their median and quartiles, in ms) and
``paired_ratio`` (the median of the step-by-step ratios of two variants that took turns).
"""

from __future__ import annotations

import statistics
from typing import Sequence

__all__ = ["step_times", "paired_ratio"]


def step_times(times: Sequence[float]) -> dict:
    """``{"times", "median_ms", "q1_ms", "q3_ms"}`` of step times in seconds (one time: all three equal it)."""
    q1, median, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"times": list(times), "median_ms": 1e3 * median, "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3}


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median of ``ours[i] / theirs[i]``: steps i of both ran back to back, under the same load."""
    return statistics.median(a / b for a, b in zip(ours, theirs))
