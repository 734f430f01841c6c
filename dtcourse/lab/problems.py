"""Predict-then-check problems: the student predicts a number, a cell measures it.

Every lesson ends with three to five problems (part 6 of a lesson). Each has the same
three cells:

1. a markdown cell with the question, and the worked answer folded in ``<details>``;
2. ``p1 = None  # your prediction, in GB``: the student writes a number;
3. ``check(p1, lab.<stem>.problem_...())``: the ``lab`` function measures the quantity
   and computes the lesson's formula for it; :func:`check` asserts that the two agree
   (so CI checks the worked answer too) and tells the student how far their prediction was.

A prediction left at ``None`` is not an error, so Run All and nbval go through, but it shows no
number: the check still asserts the formula against the measurement, and says only how to predict,
so that running every cell gives no answer away. A wrong prediction is reported, never raised: the
student is told by how much and in which direction.

Example::

    check(p1, Answer(measured=5.2e9, formula=5.0e9, unit="B", rtol=0.05,
                     why="the allocator rounds each tensor up to 512 B"))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n"))
_BINARY = ((2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki"), (1, ""))


def pretty(value: float, unit: str = "") -> str:
    """``pretty(3.2e9, "B")`` -> ``'2.98 GiB'``; ``pretty(2.5e-5, "s")`` -> ``'25 µs'``; plain numbers stay plain.

    A unit that counts things (a lowercase word: ``"step"``, ``"rounds"``) agrees with the number:
    ``pretty(1, "rounds")`` -> ``'1 round'``, ``pretty(2, "step")`` -> ``'2 steps'``.
    """
    if len(unit) > 2 and unit.isalpha() and unit.islower():
        noun = unit.removesuffix("s")
        return f"{value:.4g} {noun if value == 1 else noun + 's'}"
    if not math.isfinite(value) or value == 0:
        return f"{value:g} {unit}".strip()
    if unit == "B":
        for size, prefix in _BINARY:
            if abs(value) >= size:
                return f"{value / size:.3g} {prefix}B"
        return f"{value:.3g} B"
    if unit in ("s", "B/s", "FLOP", "FLOP/s"):
        for size, prefix in _PREFIXES:
            if abs(value) >= size:
                return f"{value / size:.3g} {prefix}{unit}"
    return f"{value:.4g} {unit}".strip()


@dataclass(frozen=True)
class Answer:
    """A measured quantity beside what the lesson's formula says it should be.

    ``rtol`` is how far the measurement may sit from the formula, and ``why`` says what
    the formula leaves out that makes the gap (allocator rounding, timer noise, ...).
    ``atol`` covers quantities whose formula value is zero.
    """

    measured: float
    formula: float
    unit: str
    rtol: float
    why: str
    atol: float = 0.0

    def __post_init__(self) -> None:
        if not (self.rtol >= 0 and self.atol >= 0):
            raise ValueError(f"tolerances must be >= 0, got rtol={self.rtol}, atol={self.atol}")
        if not self.why:
            raise ValueError("say why the tolerance is what it is (the `why` argument)")

    @property
    def agrees(self) -> bool:
        return abs(self.measured - self.formula) <= self.atol + self.rtol * abs(self.formula)


@dataclass(frozen=True)
class Verdict:
    """What :func:`check` found: shown as one or two lines in the notebook."""

    answer: Answer
    prediction: float | None

    @property
    def error(self) -> float | None:
        """The prediction's relative error against the measurement (None without a prediction)."""
        if self.prediction is None:
            return None
        scale = max(abs(self.answer.measured), self.answer.atol, 1e-300)
        return (self.prediction - self.answer.measured) / scale

    def __repr__(self) -> str:
        a = self.answer
        if self.prediction is None:   # no number at all: Run All must not give the answer away
            return ("No prediction yet. In the cell above, replace None with your number, run that cell, "
                    "then run this one again: the measurement is shown once you have predicted.")
        err = self.error
        close = abs(err) <= max(a.rtol, 0.1)
        direction = "high" if err > 0 else "low"
        return "\n".join([
            f"measured {pretty(a.measured, a.unit)}; the lesson's formula gives {pretty(a.formula, a.unit)}",
            f"your prediction {pretty(self.prediction, a.unit)} is "
            + ("right" if close else f"{abs(err):.0%} too {direction}")
            + ("" if close else ": open the worked answer above")])


def check(prediction: float | None, answer: Answer) -> Verdict:
    """Compare the student's prediction with the measurement, and assert the formula holds.

    Raises AssertionError when the measurement and the lesson's formula disagree by more than the
    answer's tolerance: that is the lesson being wrong, not the student. Without a prediction
    (``None``) the formula is asserted all the same, but the verdict shows no number, only how to
    predict.
    """
    if prediction is not None and not isinstance(prediction, (int, float)):
        raise TypeError(f"a prediction is a number (or None), got {type(prediction).__name__}: {prediction!r}")
    if not answer.agrees:
        raise AssertionError(
            f"measured {pretty(answer.measured, answer.unit)} but the formula gives "
            f"{pretty(answer.formula, answer.unit)}: more than the {answer.rtol:.0%} allowed ({answer.why})")
    return Verdict(answer, None if prediction is None else float(prediction))
