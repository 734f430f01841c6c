"""Variants that take turns, so that a burst of load from elsewhere hits them all alike.

A benchmark (``dtcourse.bench``) or a lesson's live measurement (``dtcourse.lab.collectives``) runs
several variants round after round; ``turns`` gives each round's order.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["turns"]


def turns(variants: Sequence, round_: int) -> list:
    """The order of round ``round_``: each round starts one variant later, so that over len(variants) rounds
    every variant runs in every place once. Place matters: gloo's all-reduce, timed three times per round
    on 4 ranks at 16 MB, was 1-8% slower in the first place than in the later two (BENCHMARKS.md). So does
    what ran just before: the collectives bench gives each variant an untimed call first
    (``lab.collectives.LEAD_IN``)."""
    k = round_ % len(variants)
    return list(variants[k:]) + list(variants[:k])
