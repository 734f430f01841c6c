"""Fault tolerance's formulas (lesson 12): how often to save a snapshot, and what failures cost.

C is the time one snapshot takes, M the mean time between failures, R the restart (detect, restart,
reload). Young ("A first order approximation to the optimum checkpoint interval", CACM 1974) and Daly
("A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 2006) give the interval between snapshots that wastes the least;
``dtcourse.lab.fault_tolerance`` sets both beside a simulated job with random failures.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["young_interval", "daly_interval", "expected_overhead"]


def young_interval(save: float, mtbf: float) -> float:
    """Young's first-order optimum: checkpoint every sqrt(2 C M) seconds of work."""
    return math.sqrt(2 * save * mtbf)


def daly_interval(save: float, mtbf: float) -> float:
    """Daly's higher-order optimum: Young's, corrected for a save time C that is not small against M."""
    if save >= 2 * mtbf:
        return mtbf
    x = save / (2 * mtbf)
    return math.sqrt(2 * save * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - save


def expected_overhead(interval, save: float, mtbf: float, restart: float):
    """Extra time per unit of work, T/W - 1, for exponential failures (Daly's exact expectation): every
    ``interval`` of work is followed by a save of ``save``; a failure, also during a save or a restart, costs
    ``restart`` and the work since the last save."""
    interval = np.asarray(interval, dtype=float)
    return mtbf * math.exp(restart / mtbf) * np.expm1((interval + save) / mtbf) / interval - 1
