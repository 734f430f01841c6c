"""Exercise 04 (a dynamic loss scaler): the released notebook, its checks and the autograder.

A scaler that forgets to restart its count of clean steps after an overflow fails the checks
that contain an overflow, with the step, the expected and actual scales and the mistake named, and
scores under half: the scaler's dynamics carry 9 of the 10 points. The checks are also driven
directly with other wrong scalers, and with scalers that lean on the course's ``DynamicLossScaler``
or on ``torch.amp.GradScaler``, which are refused (no kernel). Full marks for the solution and zero
for the untouched exercise are checked with every exercise's, in ``test_grading.py``; here a scaler
written differently from the solution gets full marks too. Each grading run starts one Jupyter
kernel (a few seconds). Run just these with
``pytest -q test_mixed_precision_exercise.py``, and everything about this exercise with
``pytest -q tests -k "04_mixed_precision_loss_scaler or test_mixed_precision_exercise"``.
"""

from __future__ import annotations

import time

import pytest

import torch

from dtcourse import checks
from dtcourse import mixed_precision as mp
from exercise_harness import (EXPECTED, assert_released, by_id, failed, grade_answers, nbgrader_cells, solution_code,
                              source_path)

NAME = "04_mixed_precision_loss_scaler"
POINTS = EXPECTED[NAME].points

SOLUTION = solution_code(NAME)["loss_scaler"]
BACKOFF = "self._scale = to_fp32(self._scale * self.backoff_factor)"


def wrong(old: str, new: str) -> str:
    """The solution's cell with ``old`` (which must be there) replaced by ``new``."""
    assert old in SOLUTION, f"{old!r} is not in the solution"
    return SOLUTION.replace(old, new)


# _next_scale() backs off on an overflow but leaves the count of clean steps where it was.
NO_RESET = wrong(f"{BACKOFF}\n            self._growth_tracker = 0\n", f"{BACKOFF}\n")

# Right, and unlike the solution: step() marks the optimizer first and asks for the flag with
# try/except; update() reads the flags with max() and clears the iteration before choosing the next
# scale; _next_scale() counts modulo growth_interval.
MODULAR = '''
class DynamicLossScaler(LossScaler):
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        super().__init__(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._growth_tracker = 0

    def step(self, optimizer):
        if id(optimizer) in self._stepped:
            raise RuntimeError("one step() per optimizer in an iteration")
        self._stepped.add(id(optimizer))
        try:
            overflow = self._found_inf[id(optimizer)]
        except KeyError:
            self.unscale_(optimizer)
            overflow = self._found_inf[id(optimizer)]
        if not overflow:
            return optimizer.step()

    def update(self):
        if len(self._found_inf) == 0:
            raise RuntimeError("call step() before update()")
        found, self._found_inf, self._stepped = max(self._found_inf.values()), {}, set()
        self._next_scale(found)

    def _next_scale(self, found_inf):
        if found_inf:
            self._growth_tracker = 0
            self._scale = to_fp32(self._scale * self.backoff_factor)
            return
        self._growth_tracker = (self._growth_tracker + 1) % self.growth_interval
        if self._growth_tracker == 0 and math.isfinite(to_fp32(self._scale * self.growth_factor)):
            self._scale = to_fp32(self._scale * self.growth_factor)
'''


def scaler_class(body: str, **names):
    """``DynamicLossScaler`` from the notebook's given cells plus ``body`` (seeing ``names``), built without a kernel."""
    given = nbgrader_cells(source_path(NAME))
    namespace: dict = dict(names)
    for grade_id in ("setup", "scaffold"):
        exec(compile(given[grade_id], f"<{grade_id}>", "exec"), namespace)
    exec(compile(body, "<answer>", "exec"), namespace)
    return namespace["DynamicLossScaler"]


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["self._growth_tracker += 1", '"fp32_rounding"'], stubs={"loss_scaler": 3},
                    given={"setup": ["from dtcourse.mixed_precision import to_fp32"],
                           "loss_scaler": ["class DynamicLossScaler(LossScaler)", "super().__init__(init_scale)",
                                           "self._growth_tracker = 0", "def step(self, optimizer",
                                           "def update(self)", "def _next_scale(self, found_inf"],
                           "scaffold": ["class LossScaler:", "self._scale = to_fp32(init_scale)",
                                        "def unscale_(self, optimizer"]})


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_a_count_not_restarted_after_overflow_is_reported_precisely(tmp_path):
    report = grade_answers(NAME, tmp_path, {"loss_scaler": NO_RESET})
    result = by_id(report)
    assert failed(report) == ["check_nan", "check_streams_hidden", "check_edges_hidden"], str(report)
    assert report.score == 3 < POINTS / 2, str(report)          # growth (2) and misuse (1) still pass
    nan = result["check_nan"].message
    # NaN at step 4: GradScaler's count restarts at 0 and reaches 3 at step 7; this one kept its 1
    # and grows the scale a step early, at step 6.
    assert "DynamicLossScaler is wrong in case 'nan'" in nan, nan
    assert ("step 6: after update() the scale should be 65536.0 (unchanged: 2 of 3 clean steps in a row), "
            "yours is 131072.0.") in nan, nan
    assert "GradScaler [65536.0, 131072.0, 131072.0, 65536.0, 65536.0, 65536.0]" in nan, nan
    assert "yours      [65536.0, 131072.0, 131072.0, 65536.0, 65536.0, 131072.0]" in nan, nan
    assert ("Every scale of yours so far is exactly what a scaler gets that does not restart its count of clean "
            "steps at a back-off") in nan, nan
    assert "case 'inf'" in result["check_streams_hidden"].message
    assert "case 'fp32_rounding'" in result["check_edges_hidden"].message


def test_a_scaler_written_unlike_the_solution_gets_full_marks(tmp_path):
    report = grade_answers(NAME, tmp_path, {"loss_scaler": MODULAR})
    assert report.score == POINTS and not failed(report), str(report)


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
def test_reference_passes_every_case():
    every_case = tuple(checks.mixed_precision.SCALER_CASES)
    checks.check_loss_scaler(scaler_class(SOLUTION), cases=every_case)


def test_stepping_despite_an_overflow_is_named():
    body = wrong("return None  # skipped", "return optimizer.step()  # wrong")
    with pytest.raises(AssertionError, match=r"(?s)case 'nan' .*step 4: GradScaler skipped optimizer\.step\(\) "
                                             r"\(a gradient was NaN\), but yours called it\."):
        checks.check_loss_scaler(scaler_class(body), cases=("growth", "nan"))


def test_a_scale_kept_in_float64_gets_the_rounding_hint():
    backoff = scaler_class(wrong(BACKOFF, "self._scale = self._scale * self.backoff_factor"))
    checks.check_loss_scaler(backoff, cases=("growth", "nan", "inf", "defaults"))     # powers of two: exact
    rounding = (r"(?s)case 'fp32_rounding'.*step 6: after update\(\) the scale should be 980\.0999755859375 "
                r"\(backed off: .*\), yours is 980\.0999999999999\..*hint: yours differs only in rounding")
    with pytest.raises(AssertionError, match=rounding):
        checks.check_loss_scaler(backoff, cases=("fp32_rounding",))
    growth = scaler_class(wrong("grown = to_fp32(self._scale * self.growth_factor)",
                                "grown = self._scale * self.growth_factor"))
    overflow = (r"(?s)step 0: after update\(\) the scale should be 1\.70\d+e\+38 \(unchanged: the count of "
                r"clean steps reached growth_interval \(1\), but the grown scale would be inf in fp32.*\), "
                r"yours is 3\.40\d+e\+38\..*hint: yours is not a float32 value")   # 2^128: finite in float64 only
    with pytest.raises(AssertionError, match=overflow):
        checks.check_loss_scaler(growth, cases=("growth_overflow",))


def test_unscaling_twice_and_missing_refusals_are_named():
    twice = wrong("if key not in self._found_inf:\n            self.unscale_(optimizer)",
                           "self._found_inf.pop(key, None)\n        self.unscale_(optimizer)")   # unscale again
    complaint = (r"(?s)case 'unscale_first' .*step 0: after step\(\) your parameters differ from GradScaler's "
                 r"by up to .*unscaled exactly once")
    with pytest.raises(AssertionError, match=complaint):
        checks.check_loss_scaler(scaler_class(twice), cases=("unscale_first",))
    lenient = wrong('raise RuntimeError("step() was', 'print("step() was')
    complaint = r"step\(\) called twice before update\(\) should raise RuntimeError, but yours returned normally"
    with pytest.raises(AssertionError, match=complaint):
        checks.check_loss_scaler(scaler_class(lenient), cases=("misuse",))


def test_an_endless_update_fails_after_the_timeout():
    body = wrong("self._found_inf, self._stepped = {}, set()", "while True:\n            pass")
    start = time.monotonic()
    complaint = r"DynamicLossScaler did not finish within 2 s: .*case 'growth'.*step 0"
    with pytest.raises(AssertionError, match=complaint):
        checks.check_loss_scaler(scaler_class(body), cases=("growth",), timeout=2)
    assert time.monotonic() - start < 20


def test_unknown_cases_are_refused():
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_loss_scaler(scaler_class(SOLUTION), cases=("nope",))


@pytest.mark.parametrize("old, new, case, named", [
    (BACKOFF, "pass", "nan",
     "keeps the scale when a step overflows, instead of multiplying it by backoff_factor"),
    (BACKOFF, "self._scale = to_fp32(self._scale / self.backoff_factor)", "nan",
     "divides the scale by backoff_factor at a back-off instead of multiplying by it"),
    ("if self._growth_tracker == self.growth_interval:", "if self._growth_tracker > self.growth_interval:", "growth",
     "grows one step late, after growth_interval \\+ 1 clean steps"),
    ("self._next_scale(any(self._found_inf.values()))", "self._next_scale(list(self._found_inf.values())[-1])",
     "two_optimizers",
     "looks only at the last optimizer's gradients: it must back off when any optimizer's gradients held an inf"),
])
def test_wrong_update_rules_are_named(old, new, case, named):
    with pytest.raises(AssertionError, match=rf"(?s)case '{case}'.*after update\(\) the scale should be .*Every scale of "
                                             rf"yours so far is exactly what a scaler gets that {named}"):
        checks.check_loss_scaler(scaler_class(wrong(old, new)), cases=(case,))


def test_stepping_on_scaled_gradients_is_named():
    unscale = "if key not in self._found_inf:\n            self.unscale_(optimizer)"
    checked_only = ("if key not in self._found_inf:\n            self._found_inf[key] = not all(\n"
                    "                bool(torch.isfinite(p.grad).all()) for group in optimizer.param_groups\n"
                    "                for p in group['params'] if p.grad is not None)")
    with pytest.raises(AssertionError, match=r"(?s)case 'growth'.*step 0: after step\(\) your parameters differ from "
                                             r"GradScaler's by up to .*optimizer\.step\(\) ran on gradients still "
                                             r"multiplied by the scale \(65536\): step\(\) must unscale them first"):
        checks.check_loss_scaler(scaler_class(wrong(unscale, checked_only)), cases=("growth",))


# --------------------------------------------------------------------------- #
# The course's scaler and torch's GradScaler refuse to run inside the checks
# --------------------------------------------------------------------------- #
class Inherited(mp.DynamicLossScaler):
    """The course's scaler, subclassed."""


class Delegates:
    """Builds the course's scaler inside its own and hands every call over."""

    def __init__(self, **kwargs):
        self.inner = mp.DynamicLossScaler(**kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class GradScalerInside:
    """Wraps torch.amp.GradScaler, the check's own reference."""

    def __init__(self, **kwargs):
        self.inner = torch.amp.GradScaler("cpu", **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_course_scaler_imported_or_subclassed_is_refused_before_it_runs():
    from dtcourse.mixed_precision import DynamicLossScaler     # as a notebook cell would import it

    with pytest.raises(AssertionError, match=r"DynamicLossScaler is dtcourse.mixed_precision.DynamicLossScaler, the "
                                             r"course's own answer to exercise 04, which refuses to run while the "
                                             r"exercise's checks run: subclass the LossScaler that the exercise's scaffold cell defines"):
        checks.check_loss_scaler(DynamicLossScaler)
    with pytest.raises(AssertionError, match=r"Inherited subclasses dtcourse.mixed_precision.DynamicLossScaler"):
        checks.check_loss_scaler(Inherited)
    with pytest.raises(AssertionError, match=r"StaticLossScaler is dtcourse.mixed_precision.StaticLossScaler"):
        checks.check_loss_scaler(mp.StaticLossScaler)


@pytest.mark.parametrize("scaler, refused", [
    (Delegates, r"ReferenceRefused: dtcourse\.mixed_precision\.DynamicLossScaler is the course's own answer to "
                r"exercise 04, and it refuses to run"),
    (GradScalerInside, r"ReferenceRefused: torch\.amp\.GradScaler is what your scaler is compared with, so it "
                       r"refuses to run for your code"),
    (scaler_class(wrong("return optimizer.step()", "return mp.LossScaler.step(self, optimizer)"), mp=mp),
     r"ReferenceRefused: dtcourse\.mixed_precision\.LossScaler\.step is the course's own answer to exercise 04"),
])
def test_a_scaler_that_calls_the_course_or_gradscaler_is_refused(scaler, refused):
    with pytest.raises(AssertionError, match=rf"failed in case 'growth' .*: it raised {refused}"):
        checks.check_loss_scaler(scaler, cases=("growth",))

