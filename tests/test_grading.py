"""The autograder and the checks it runs: full marks, zero marks, deadlocks, wrong answers.

Full and zero marks are checked for every exercise (test ids are the notebook names); the
deadlocks and wrong answers here are exercise 01's, the other exercises' are in
``test_<stem>_exercise.py``. Each grading run starts a Jupyter kernel (a few seconds). Run just
these with ``pytest -q tests/test_grading.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dtcourse import checks
from dtcourse.grading.grade import grade_notebook
from exercise_harness import (EXPECTED, NAMES, by_id, exercise_path, grade_answers, solution_code, source_path,
                              student_copy)

NAME = "01_collectives_ring"
SOURCE = source_path(NAME)
EXERCISE = exercise_path(NAME)

DEADLOCKED_REDUCE_SCATTER = '''
def ring_reduce_scatter(output, input_tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    for step in range(n - 1):
        dist.recv(output, (rank - 1) % n)  # every rank only receives: nobody ever sends
'''
WRONG_ALL_GATHER = '''
def ring_all_gather(output, input_tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = output.view(n, -1)
    chunks[rank] = input_tensor.reshape(-1)
    for step in range(n - 1):
        send_right_recv_left(chunks[(rank - step) % n], chunks[(rank - step - 1) % n])
    chunks[rank] += 1  # the bug: each rank's own chunk comes out one too big
'''


def processes_with(marker: str) -> list[int]:
    """Processes (kernels, forked ranks, orphans too) whose environment holds ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


# --------------------------------------------------------------------------- #
# (d) a complete answer earns every point, hidden tests included
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", NAMES)
def test_complete_answer_gets_full_marks(tmp_path, name):
    points, hidden = EXPECTED[name].points, EXPECTED[name].hidden
    start = time.monotonic()
    report = grade_answers(name, tmp_path, solution_code(name))
    assert (report.score, report.max_score, report.exit_code) == (points, points, 0), str(report)
    assert hidden <= set(by_id(report)) and all(c.passed for c in report.checks), str(report)
    assert f"Total: {points:g} / {points:g}" in str(report)
    assert time.monotonic() - start < 60


# --------------------------------------------------------------------------- #
# (e) the untouched exercise: zero, with the reason, through the command line
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", NAMES)
def test_untouched_exercise_scores_zero_with_a_clear_report(tmp_path, name):
    expected = EXPECTED[name]
    copy = tmp_path / "somewhere" / "my_copy.ipynb"  # renamed and moved: found through --source
    copy.parent.mkdir()
    copy.write_bytes(exercise_path(name).read_bytes())
    done = subprocess.run([sys.executable, "-m", "dtcourse.grade", str(copy), "--source", str(source_path(name))],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"Total: 0 / {expected.points:g}" in done.stdout
    fails = [line for line in done.stdout.splitlines() if line.strip().startswith("FAIL")]
    assert len(fails) == expected.checks, done.stdout
    assert done.stdout.count(f"NotImplementedError: {expected.title}") == expected.checks, done.stdout
    assert "replace the `raise NotImplementedError` line" in done.stdout
    assert "Traceback" not in done.stdout
    # the report is the first thing a student reads, not the kernel's start-up warnings
    assert "without encryption" not in done.stdout + done.stderr, done.stderr


def test_an_exercise_is_found_by_number_or_name_from_any_folder(tmp_path, monkeypatch):
    from dtcourse.grading.grade import find_notebook

    monkeypatch.chdir(tmp_path)                          # not the course root
    assert find_notebook(NAME) == EXERCISE
    assert find_notebook(NAME[:2]) == EXERCISE           # "01"
    assert find_notebook(f"{NAME}.ipynb") == EXERCISE
    mine = tmp_path / "mine.ipynb"
    mine.write_text("{}")
    assert find_notebook("mine.ipynb") == Path("mine.ipynb")   # a path that exists wins
    with pytest.raises(FileNotFoundError, match="exercise's name or number .*01_collectives_ring"):
        find_notebook("99")
    with pytest.raises(FileNotFoundError, match="no file"):
        find_notebook("some/where/01")                   # a path is never guessed at
    done = subprocess.run([sys.executable, "-m", "dtcourse.cli", "grade", "99"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "dtcourse grade: no file 99" in done.stderr


def test_ungradable_inputs_exit_2(tmp_path):
    broken = tmp_path / f"{NAME}.ipynb"
    broken.write_text("{ not json")
    assert grade_notebook(broken, source=SOURCE).exit_code == 2
    orphan = tmp_path / "no_such_exercise.ipynb"
    orphan.write_bytes(EXERCISE.read_bytes())
    report = grade_notebook(orphan)
    assert report.exit_code == 2 and "--source" in str(report)


# --------------------------------------------------------------------------- #
# (f) a deadlocked ring fails after the timeout and leaves nothing running;
# (g) a wrong answer names the rank, the index, expected and got
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def broken_report(tmp_path_factory):
    marker = f"DTCOURSE_TEST_MARKER={uuid.uuid4().hex}"
    key, value = marker.split("=")
    answers = dict(solution_code(NAME), ring_reduce_scatter=DEADLOCKED_REDUCE_SCATTER,
                   ring_all_gather=WRONG_ALL_GATHER)
    path = student_copy(NAME, tmp_path_factory.mktemp("broken"), answers)
    os.environ[key] = value  # inherited by the kernel and every rank it forks
    try:
        start = time.monotonic()
        report = grade_notebook(path, source=SOURCE, check_timeout=2, cell_timeout=60)
        seconds = time.monotonic() - start
    finally:
        del os.environ[key]
    deadline = time.monotonic() + 10  # the kernel's shutdown may take a moment
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return report, seconds, processes_with(marker)


def test_deadlock_is_a_failure_not_a_hang(broken_report):
    report, seconds, leftovers = broken_report
    checks_ = by_id(report)
    for grade_id, function in [("check_reduce_scatter", "ring_reduce_scatter"),
                               ("check_reduce_scatter_hidden", "ring_reduce_scatter"),
                               ("check_all_reduce", "ring_all_reduce")]:
        message = checks_[grade_id].message
        assert checks_[grade_id].points == 0, str(report)
        assert f"{function} did not finish" in message and "deadlock" in message, message
        assert "within 2 s" in message and re.search(r"rank\(s\) \[0, 1(, 2)?\]", message), message
    assert checks_["check_ring_step"].passed  # the kernel went on grading after each deadlock
    assert report.exit_code == 1
    assert seconds < 90, f"grading took {seconds:.0f} s"
    assert leftovers == [], f"processes left behind: {leftovers}"


def test_wrong_answer_names_rank_index_expected_and_got(broken_report):
    report, _, _ = broken_report
    message = by_id(report)["check_all_gather"].message
    assert "ring_all_gather is wrong at world size 2" in message, message
    for rank in (0, 1):  # rank r's own chunk r is one too big, at index r
        found = re.search(rf"rank {rank}: index {rank}: expected (\S+), got (\S+);", message)
        assert found, message
        assert float(found[2]) - float(found[1]) == pytest.approx(1.0, abs=1e-3)


def test_a_hanging_cell_is_interrupted_and_grading_goes_on(tmp_path):
    source = tmp_path / "solutions" / "02_sleepy.ipynb"
    source.parent.mkdir()
    meta = {"grade": False, "grade_id": "answer", "locked": False, "schema_version": 3, "solution": True}
    test = {"grade": True, "grade_id": "test", "locked": False, "points": 1, "schema_version": 3,
            "solution": False}
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": "a", "metadata": {"nbgrader": meta},
                     "outputs": [], "source": "import time\nx = 1\ntime.sleep(600)"},
                    {"cell_type": "code", "execution_count": None, "id": "b", "metadata": {"nbgrader": test},
                     "outputs": [], "source": "assert x == 1"}],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    source.write_text(json.dumps(nb))
    start = time.monotonic()
    report = grade_notebook(source, source=source, cell_timeout=3)
    assert time.monotonic() - start < 60
    assert report.exit_code == 0 and report.score == 1, str(report)
    assert any("(answer) raised CellTimeoutError: the cell ran longer than 3 s" in note
               for note in report.notes), report.notes


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel): tolerances and messages
# --------------------------------------------------------------------------- #
def _ring_step(send: torch.Tensor, recv: torch.Tensor) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def test_checks_reject_a_collective_in_disguise():
    def all_reduce_by_cheating(tensor):
        dist.all_reduce(tensor)

    with pytest.raises(AssertionError, match=r"called torch\.distributed\.all_reduce"):
        checks.check_all_reduce(all_reduce_by_cheating, world_sizes=(2,), sizes=(3,))


def test_checks_report_an_unwritten_output():
    def returns_instead(output, input_tensor):
        return input_tensor[: output.numel()].clone()

    with pytest.raises(AssertionError, match="still holds the NaN .* returned a tensor"):
        checks.check_reduce_scatter(returns_instead, world_sizes=(2,), sizes=(2,))


def test_exchange_check_passes_on_odd_world_sizes_and_all_dtypes():
    checks.check_ring_exchange(_ring_step, world_sizes=(3, 5), sizes=(1, (2, 3)), dtypes=checks.FLOATS)
