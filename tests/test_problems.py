"""The predict-then-check pattern every lesson's problems use (dtcourse/lab/problems.py)."""

import contextlib
import io

import pytest
from IPython.lib.pretty import pretty as ipython_text     # how Jupyter shows a cell's value as text/plain

from dtcourse.lab.problems import Answer, check, pretty


def test_a_formula_that_matches_the_measurement_passes_and_reports_the_prediction():
    answer = Answer(measured=1.02e9, formula=1.0e9, unit="B", rtol=0.05, why="allocator rounding")
    assert answer.agrees
    assert "right" in repr(check(1.0e9, answer))
    wrong = check(0.5e9, answer)
    assert wrong.error == pytest.approx(0.5e9 / 1.02e9 - 1)
    assert "51% too low" in repr(wrong) and "worked answer" in repr(wrong)
    assert "too high" in repr(check(2e9, answer))


def test_without_a_prediction_the_check_shows_no_number_only_how_to_predict():
    """Run All leaves every prediction at None: what the notebook shows must not give the answer away."""
    answer = Answer(measured=40, formula=40, unit="choices", rtol=0, why="exact")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        verdict = check(None, answer)
    shown = printed.getvalue() + ipython_text(verdict)   # what the cell prints, and the value it displays
    assert "replace None with your number" in shown and "run this one again" in shown, shown
    assert not any(ch.isdigit() for ch in shown), shown          # no 40, nor any other number
    assert "measured" not in shown and "formula" not in shown, shown
    assert check(None, answer).error is None
    with_prediction = repr(check(40, answer))
    assert "measured 40 choices; the lesson's formula gives 40 choices" in with_prediction
    assert "your prediction 40 choices is right" in with_prediction
    # the formula is still asserted without a prediction: a wrong lesson fails Run All and CI
    with pytest.raises(AssertionError, match="exact"):
        check(None, Answer(measured=41, formula=40, unit="choices", rtol=0, why="exact"))


def test_a_formula_off_by_more_than_its_tolerance_fails_with_its_reason():
    answer = Answer(measured=1.2e9, formula=1.0e9, unit="B", rtol=0.05, why="allocator rounding")
    assert not answer.agrees
    with pytest.raises(AssertionError, match="allocator rounding"):
        check(1.0e9, answer)


def test_zero_formulas_use_the_absolute_tolerance():
    assert Answer(measured=1e-7, formula=0.0, unit="s", rtol=0.1, atol=1e-6, why="timer resolution").agrees
    assert not Answer(measured=1e-5, formula=0.0, unit="s", rtol=0.1, atol=1e-6, why="timer resolution").agrees
    # the prediction's error is relative to atol when the measurement is zero: no division by zero
    assert check(1.0, Answer(measured=0.0, formula=0.0, unit="", rtol=0, atol=0.5, why="exact")).error == 2.0


def test_bad_answers_and_predictions_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="why"):
        Answer(measured=1.0, formula=1.0, unit="B", rtol=0.1, why="")
    with pytest.raises(ValueError, match=">= 0"):
        Answer(measured=1.0, formula=1.0, unit="B", rtol=-0.1, why="x")
    with pytest.raises(TypeError, match="a prediction is a number"):
        check("3 GB", Answer(measured=1.0, formula=1.0, unit="B", rtol=0.1, why="x"))


@pytest.mark.parametrize("value, unit, text", [
    (3 * 2**30, "B", "3 GiB"), (512, "B", "512 B"), (1536, "B", "1.5 KiB"),
    (2.5e-5, "s", "25 µs"), (1.25e10, "B/s", "12.5 GB/s"), (0.0, "B", "0 B"), (7, "", "7"),
    # a counted unit agrees with its number, whichever form the lab wrote
    (1, "step", "1 step"), (2, "step", "2 steps"), (1, "rounds", "1 round"), (0, "messages", "0 messages"),
    (3, "iterations", "3 iterations"),
])
def test_pretty_chooses_readable_units(value, unit, text):
    assert pretty(value, unit) == text
