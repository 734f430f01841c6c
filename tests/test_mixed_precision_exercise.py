"""Exercise 04 (a dynamic loss scaler): the released notebook, its checks and the autograder.

A scaler that forgets to restart its count of clean steps after an overflow fails the checks
that contain an overflow, with the step and the expected and actual scales named. The checks are
also driven directly with other wrong scalers (no kernel). Full marks for the solution and zero
for the untouched exercise are checked with every exercise's, in ``test_grading.py``. Each grading
run starts one Jupyter kernel (a few seconds). Run just these with
``pytest -q test_mixed_precision_exercise.py``, and everything about this exercise with
``pytest -q tests -k "04_mixed_precision_loss_scaler or test_mixed_precision_exercise"``.
"""

from __future__ import annotations

import time

import pytest

from dtcourse import checks
from exercise_harness import assert_released, by_id, failed, grade_answers, nbgrader_cells, solution_code, source_path

NAME = "04_mixed_precision_loss_scaler"

# update() backs off on an overflow but leaves the count of clean steps where it was.
NO_RESET = '''
class DynamicLossScaler(ScalerBase):
    def step(self, optimizer):
        if id(optimizer) in self._stepped:
            raise RuntimeError("stepped twice")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        return None if self._found_inf[id(optimizer)] else optimizer.step()

    def update(self):
        if not self._found_inf:
            raise RuntimeError("nothing to update from")
        if any(self._found_inf.values()):
            self._set_scale(self._scale * self.backoff_factor)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = fp32(self._scale * self.growth_factor)
                if math.isfinite(grown):
                    self._set_scale(grown)
                self._growth_tracker = 0
        self._found_inf, self._stepped = {}, set()
'''


def scaler_class(body: str):
    """``DynamicLossScaler`` from the notebook's given cells plus ``body``, built without a kernel."""
    given = nbgrader_cells(source_path(NAME))
    namespace: dict = {}
    for grade_id in ("setup", "scaffold"):
        exec(compile(given[grade_id], f"<{grade_id}>", "exec"), namespace)
    exec(compile(body, "<answer>", "exec"), namespace)
    return namespace["DynamicLossScaler"]


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["self._growth_tracker += 1", '"fp32_rounding"'], stubs={"loss_scaler": 2},
                    given={"loss_scaler": ["def step(self, optimizer", "def update(self)"],
                           "scaffold": ["def unscale_(self, optimizer"]})


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_a_count_not_restarted_after_overflow_is_reported_precisely(tmp_path):
    report = grade_answers(NAME, tmp_path, {"loss_scaler": NO_RESET})
    result = by_id(report)
    assert failed(report) == ["check_nan", "check_streams_hidden", "check_edges_hidden"], str(report)
    assert report.score == 3, str(report)                       # growth (2) and misuse (1) still pass
    nan = result["check_nan"].message
    # NaN at step 4: GradScaler's count restarts at 0 and reaches 3 at step 7; this one kept its 1
    # and grows the scale a step early, at step 6.
    assert "DynamicLossScaler is wrong in case 'nan'" in nan, nan
    assert ("step 6: after update() the scale should be 65536.0 (unchanged: 2 of 3 clean steps in a row), "
            "yours is 131072.0.") in nan, nan
    assert "GradScaler [65536.0, 131072.0, 131072.0, 65536.0, 65536.0, 65536.0]" in nan, nan
    assert "yours      [65536.0, 131072.0, 131072.0, 65536.0, 65536.0, 131072.0]" in nan, nan
    assert "case 'inf'" in result["check_streams_hidden"].message
    assert "case 'fp32_rounding'" in result["check_edges_hidden"].message


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
def test_reference_passes_every_case():
    every_case = tuple(checks.mixed_precision.SCALER_CASES)
    checks.check_loss_scaler(scaler_class(solution_code(NAME)["loss_scaler"]), cases=every_case)


def test_stepping_despite_an_overflow_is_named():
    body = solution_code(NAME)["loss_scaler"].replace("return None  # skipped", "return optimizer.step()  # wrong")
    with pytest.raises(AssertionError, match=r"(?s)case 'nan' .*step 4: GradScaler skipped optimizer\.step\(\) "
                                             r"\(a gradient was NaN\), but yours called it\."):
        checks.check_loss_scaler(scaler_class(body), cases=("growth", "nan"))


def test_a_scale_kept_in_float64_gets_the_rounding_hint():
    answer = solution_code(NAME)["loss_scaler"]
    backoff = scaler_class(answer.replace("self._set_scale(self._scale * self.backoff_factor)",
                                          "self._scale = self._scale * self.backoff_factor"))
    checks.check_loss_scaler(backoff, cases=("growth", "nan", "inf", "defaults"))     # powers of two: exact
    rounding = (r"(?s)case 'fp32_rounding'.*step 6: after update\(\) the scale should be 980\.0999755859375 "
                r"\(backed off: .*\), yours is 980\.0999999999999\..*hint: yours differs only in rounding")
    with pytest.raises(AssertionError, match=rounding):
        checks.check_loss_scaler(backoff, cases=("fp32_rounding",))
    growth = scaler_class(answer.replace("grown = fp32(self._scale * self.growth_factor)",
                                         "grown = self._scale * self.growth_factor"))
    overflow = (r"step 0: after update\(\) the scale should be 1\.70\d+e\+38 \(unchanged: the count of "
                r"clean steps reached growth_interval \(1\), but the grown scale would be inf in fp32.*\), "
                r"yours is inf\.")
    with pytest.raises(AssertionError, match=overflow):
        checks.check_loss_scaler(growth, cases=("growth_overflow",))


def test_unscaling_twice_and_missing_refusals_are_named():
    answer = solution_code(NAME)["loss_scaler"]
    twice = answer.replace("if key not in self._found_inf:\n            self.unscale_(optimizer)",
                           "self._found_inf.pop(key, None)\n        self.unscale_(optimizer)")   # unscale again
    complaint = (r"(?s)case 'unscale_first' .*step 0: after step\(\) your parameters differ from GradScaler's "
                 r"by up to .*unscaled exactly once")
    with pytest.raises(AssertionError, match=complaint):
        checks.check_loss_scaler(scaler_class(twice), cases=("unscale_first",))
    lenient = answer.replace('raise RuntimeError("step() was', 'print("step() was')
    complaint = r"step\(\) called twice before update\(\) should raise RuntimeError, but yours returned normally"
    with pytest.raises(AssertionError, match=complaint):
        checks.check_loss_scaler(scaler_class(lenient), cases=("misuse",))


def test_an_endless_update_fails_after_the_timeout():
    body = solution_code(NAME)["loss_scaler"].replace("self._found_inf, self._stepped = {}, set()",
                                                  "while True:\n            pass")
    start = time.monotonic()
    complaint = r"DynamicLossScaler did not finish within 2 s: .*case 'growth'.*step 0"
    with pytest.raises(AssertionError, match=complaint):
        checks.check_loss_scaler(scaler_class(body), cases=("growth",), timeout=2)
    assert time.monotonic() - start < 20


def test_unknown_cases_are_refused():
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_loss_scaler(scaler_class(solution_code(NAME)["loss_scaler"]), cases=("nope",))
