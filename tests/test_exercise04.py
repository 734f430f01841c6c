"""Exercise 04 (a dynamic loss scaler): the notebook, its checks and the autograder.

A complete answer earns every point; the untouched exercise earns none, with the stub named
in every failed check; a scaler that forgets to restart its count of clean steps after an
overflow fails the checks that contain an overflow, with the step and the expected and
actual scales named. The checks are also driven directly with other wrong scalers (no
kernel). Each grading run starts one Jupyter kernel (a few seconds). Run just these with
``pytest -q tests/test_exercise04.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtcourse import checks, exercises
from dtcourse.grade import grade_notebook

ROOT = Path(__file__).resolve().parents[1]
NAME = "04_loss_scaler"
SOURCE = ROOT / "solutions" / f"{NAME}.ipynb"
EXERCISE = ROOT / "exercises" / f"{NAME}.ipynb"
POINTS = 10
STUB = "NotImplementedError: Exercise 04: loss scaler"

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


def cells(path: Path) -> dict[str, str]:
    """Source of every nbgrader cell of a notebook, by grade_id."""
    return {c["metadata"]["nbgrader"]["grade_id"]: "".join(c["source"])
            for c in json.loads(path.read_text())["cells"] if "nbgrader" in c["metadata"]}


def solution_code() -> dict[str, str]:
    """The source's solution cell with the markers taken out: a student who got it all right."""
    lines = cells(SOURCE)["loss_scaler"].split("\n")
    return {"loss_scaler": "\n".join(line for line in lines if "SOLUTION" not in line)}


def student_copy(directory: Path, answers: dict[str, str]) -> Path:
    """The released exercise with some solution cells filled in, saved as a student would."""
    nb = json.loads(EXERCISE.read_text())
    for cell in nb["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell["source"] = answers[grade_id]
    path = directory / f"{NAME}.ipynb"
    path.write_text(json.dumps(nb, indent=1))
    return path


def by_id(report) -> dict:
    return {check.grade_id: check for check in report.checks}


def scaler_class(body: str):
    """``DynamicLossScaler`` from the notebook's given cells plus ``body``, built without a kernel."""
    given = cells(SOURCE)
    namespace: dict = {}
    for grade_id in ("setup", "scaffold"):
        exec(compile(given[grade_id], f"<{grade_id}>", "exec"), namespace)
    exec(compile(body, "<answer>", "exec"), namespace)
    return namespace["DynamicLossScaler"]


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_exercise_is_current_and_keeps_the_answers_out():
    assert not exercises.stale(ROOT / "solutions", ROOT / "exercises"), "run `make exercises`"
    released = cells(EXERCISE)
    code = "\n".join(released.values())
    assert "BEGIN SOLUTION" not in code and "HIDDEN TESTS" not in code
    assert "self._growth_tracker += 1" not in code and '"fp32_rounding"' not in code
    assert released["loss_scaler"].count(f'raise NotImplementedError("Exercise 04: loss scaler")') == 2
    assert "def step(self, optimizer" in released["loss_scaler"]
    assert "def update(self)" in released["loss_scaler"]
    assert "def unscale_(self, optimizer" in released["scaffold"]          # the scaffolding is given


def test_generator_matches_nbgrader(tmp_path):
    pytest.importorskip("nbgrader", reason="nbgrader is not installed: pip install -e '.[dev]'")
    assignment = tmp_path / "source" / NAME
    assignment.mkdir(parents=True)
    (assignment / f"{NAME}.ipynb").write_bytes(SOURCE.read_bytes())
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", NAME, "--force",
                           f"--ClearSolutions.code_stub={exercises.code_stub(NAME)}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert EXERCISE.read_text(encoding="utf-8") == \
        (tmp_path / "release" / NAME / f"{NAME}.ipynb").read_text(encoding="utf-8")


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_complete_answer_gets_full_marks(tmp_path):
    start = time.monotonic()
    report = grade_notebook(student_copy(tmp_path, solution_code()), source=SOURCE)
    assert (report.score, report.max_score, report.exit_code) == (POINTS, POINTS, 0), str(report)
    assert {"check_streams_hidden", "check_edges_hidden"} <= set(by_id(report))
    assert time.monotonic() - start < 60


def test_untouched_exercise_scores_zero_with_a_clear_report(tmp_path):
    copy = tmp_path / "my_copy.ipynb"
    copy.write_bytes(EXERCISE.read_bytes())
    done = subprocess.run([sys.executable, "-m", "dtcourse.grade", str(copy), "--source", str(SOURCE)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"Total: 0 / {POINTS:g}" in done.stdout
    fails = [line for line in done.stdout.splitlines() if line.strip().startswith("FAIL")]
    assert len(fails) == 5, done.stdout
    assert done.stdout.count(STUB) == 5, done.stdout
    assert "replace the `raise NotImplementedError` line" in done.stdout
    assert "Traceback" not in done.stdout


def test_a_count_not_restarted_after_overflow_is_reported_precisely(tmp_path):
    report = grade_notebook(student_copy(tmp_path, {"loss_scaler": NO_RESET}), source=SOURCE)
    result = by_id(report)
    failed = [grade_id for grade_id, check in result.items() if not check.passed]
    assert failed == ["check_nan", "check_streams_hidden", "check_edges_hidden"], str(report)
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
    checks.check_loss_scaler(scaler_class(solution_code()["loss_scaler"]), cases=every_case)


def test_stepping_despite_an_overflow_is_named():
    body = solution_code()["loss_scaler"].replace("return None  # skipped", "return optimizer.step()  # wrong")
    with pytest.raises(AssertionError, match=r"(?s)case 'nan' .*step 4: GradScaler skipped optimizer\.step\(\) "
                                             r"\(a gradient was NaN\), but yours called it\."):
        checks.check_loss_scaler(scaler_class(body), cases=("growth", "nan"))


def test_a_scale_kept_in_float64_gets_the_rounding_hint():
    answer = solution_code()["loss_scaler"]
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
    answer = solution_code()["loss_scaler"]
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
    body = solution_code()["loss_scaler"].replace("self._found_inf, self._stepped = {}, set()",
                                                  "while True:\n            pass")
    start = time.monotonic()
    complaint = r"DynamicLossScaler did not finish within 2 s: .*case 'growth'.*step 0"
    with pytest.raises(AssertionError, match=complaint):
        checks.check_loss_scaler(scaler_class(body), cases=("growth",), timeout=2)
    assert time.monotonic() - start < 20


def test_unknown_cases_are_refused():
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_loss_scaler(scaler_class(solution_code()["loss_scaler"]), cases=("nope",))
