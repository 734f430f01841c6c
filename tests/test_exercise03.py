"""Exercise 03 (an SSP server loop): the notebook, its checks and the autograder.

A complete answer earns every point; the untouched exercise earns none, with the stub named in
every failed check; a server that ignores the bound, or applies whole gradients instead of 1/N
shares, fails only the checks about that, with the worker, iteration or factor named; a server
with no deadline fails the hang check after the check's time limit. Each grading run starts one
Jupyter kernel. Run just these with ``pytest -q tests/test_exercise03.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtcourse import checks, exercises
from dtcourse.grade import grade_notebook
from dtcourse.parameter_server import ParameterServer

ROOT = Path(__file__).resolve().parents[1]
NAME = "03_async_server"
SOURCE = ROOT / "solutions" / f"{NAME}.ipynb"
EXERCISE = ROOT / "exercises" / f"{NAME}.ipynb"
POINTS = 12
STUB = "NotImplementedError: Exercise 03: async server"

# Answers every waiting worker at once: correct as async, wrong for any finite bound.
NO_BOUND = '''
class AsyncServer(ServerBase):
    def serve(self):
        n = self.num_workers
        clock, waiting, owed = [0] * n, set(range(n)), {}
        while min(clock) < self.steps:
            for u in sorted(waiting):
                self.reply(u)
                owed[u] = time.perf_counter()
            waiting.clear()
            request = self.next_request(owed)
            w = request.worker
            del owed[w]
            late = staleness(self.version, request.read_version, request.clock)
            self.apply(request.grad / n)
            clock[w] += 1
            self.version = max(self.version, clock[w])
            self.record(request, late)
            if clock[w] < self.steps:
                waiting.add(w)
        return self.finish()
'''


def solution_code() -> dict[str, str]:
    """The source's solution cells with the markers taken out: a student who got it all right."""
    answers = {}
    for cell in json.loads(SOURCE.read_text())["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if meta.get("solution"):
            lines = "".join(cell["source"]).split("\n")
            answers[meta["grade_id"]] = "\n".join(line for line in lines if "SOLUTION" not in line)
    return answers


def student_copy(directory: Path, answers: dict[str, str]) -> Path:
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


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_exercise_is_current_and_keeps_the_answers_out():
    assert not exercises.stale(ROOT / "solutions", ROOT / "exercises"), "run `make exercises`"
    nb = json.loads(EXERCISE.read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "BEGIN SOLUTION" not in code and "HIDDEN TESTS" not in code
    assert "clock[u] - min(clock)" not in code and 'cases=("sharded",)' not in code
    cells = {c["metadata"]["nbgrader"]["grade_id"]: "".join(c["source"])
             for c in nb["cells"] if "nbgrader" in c["metadata"]}
    assert cells["async_server"].count('raise NotImplementedError("Exercise 03: async server")') == 1
    assert "def serve(self)" in cells["async_server"] and "return self.finish()" in cells["async_server"]


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_complete_answer_gets_full_marks(tmp_path):
    report = grade_notebook(student_copy(tmp_path, solution_code()), source=SOURCE)
    assert (report.score, report.max_score, report.exit_code) == (POINTS, POINTS, 0), str(report)
    assert {"check_once_hidden", "check_bound_hidden", "check_parity_hidden", "check_hang_hidden"} <= set(by_id(report))


def test_untouched_exercise_scores_zero_with_a_clear_report(tmp_path):
    copy = tmp_path / "my_copy.ipynb"
    copy.write_bytes(EXERCISE.read_bytes())
    done = subprocess.run([sys.executable, "-m", "dtcourse.grade", str(copy), "--source", str(SOURCE)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"Total: 0 / {POINTS:g}" in done.stdout
    fails = [line for line in done.stdout.splitlines() if line.strip().startswith("FAIL")]
    assert len(fails) == 8, done.stdout
    assert done.stdout.count(STUB) == 8, done.stdout
    assert "replace the `raise NotImplementedError` line" in done.stdout
    assert "Traceback" not in done.stdout


def test_ignoring_the_bound_fails_only_the_bound_and_parity_checks(tmp_path):
    report = grade_notebook(student_copy(tmp_path, {"async_server": NO_BOUND}), source=SOURCE)
    result = by_id(report)
    failed = [grade_id for grade_id, check in result.items() if not check.passed]
    assert failed == ["check_bound", "check_bound_hidden", "check_parity", "check_parity_hidden"], str(report)
    assert report.score == POINTS - 6, str(report)
    message = result["check_bound"].message
    assert "AsyncServer is wrong (s=1, 1 server(s), 3 workers, 7 iterations, worker 2 sleeps 20 ms" in message
    assert re.search(r"worker \d received the parameters of iteration \d+ when worker 2 had sent only \d+ "
                     r"pushes: .* more than s = 1", message), message
    assert "more than s = 0" in result["check_parity"].message, result["check_parity"].message


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
class WholeGradients(ParameterServer):
    """The course's server, but each push is applied whole instead of as 1/N of a round."""

    def apply(self, grad, gradients=1):
        super().apply(grad * self.num_workers if self.config.mode != "sync" else grad, gradients)


def test_whole_gradients_are_reported_as_n_times_too_far():
    with pytest.raises(AssertionError, match=r"WholeGradients is wrong \(s=inf \(async\), 1 server\(s\), 3 workers.*"
                                             r"moved N = 3 times too far: apply each push as 1/N of a round"):
        checks.check_exactly_once(WholeGradients)
    checks.check_staleness_bound(WholeGradients)         # its clocks and staleness are right


class WrongStaleness(ParameterServer):
    """Records version - read_version: every push since the read, even the same iteration's."""

    def apply(self, grad, gradients=1):
        self.before = self.version
        super().apply(grad, gradients)

    def record(self, request, late):
        super().record(request, self.before - request.read_version)


def test_staleness_with_the_wrong_rule_names_the_update():
    with pytest.raises(AssertionError, match=r"update \d+ \(worker \d, iteration \d\): recorded staleness 1, but "
                                             r"the version was \d just before it .* pushes of the same or an older"):
        checks.check_staleness_bound(WrongStaleness, bounds=(0,))


class NoDeadline(ParameterServer):
    """Waits for requests with an empty `owed`: no deadline at all."""

    def next_request(self, owed):
        return super().next_request({})


def test_a_server_without_deadline_fails_the_hang_check_after_the_time_limit():
    start = time.monotonic()
    # Here the other workers' own deadlines (twice the server's) run out first; in async mode the
    # check's time limit would.
    with pytest.raises(AssertionError, match=r"NoDeadline waited for ever \(s=1, .*\): worker 1 \(rank 2\) hung in "
                                             r"iteration 2, and (the run was still going 5 s later|the other workers "
                                             r"gave up waiting for your answers first)\. Keep `owed`"):
        checks.check_hang(NoDeadline, timeout=5)
    assert time.monotonic() - start < 15
