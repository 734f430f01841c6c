"""The exercise generator: exercises/ is current, and it writes what nbgrader writes.

The checks every exercise must pass run once per notebook in ``solutions/`` (test ids are the
notebook names); the markup tests use exercise 01 and a notebook of edge cases. Run just these
with ``pytest -q tests/test_grading_exercises.py``. The nbgrader comparison runs real
``nbgrader generate_assignment`` (a few seconds per exercise) and is skipped only when nbgrader
is not installed (``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtcourse.grading import exercises
from dtcourse.grading.exercises import MarkupError, checksum, dumps, generate, loads
from exercise_harness import EXPECTED, NAMES, ROOT, exercise_path, nbgrader_cells, source_path

NAME = "01_collectives_ring"
SOURCE = source_path(NAME)


def meta(grade_id: str, grade: bool = False, solution: bool = False, locked: bool = False,
         points: float | None = None, task: bool = False) -> dict:
    nbgrader = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3,
                "solution": solution}
    if points is not None:
        nbgrader["points"] = points
    if task:
        nbgrader["task"] = True
    return {"nbgrader": nbgrader}


def notebook(*cells: dict, **metadata) -> dict:
    kernelspec = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return {"cells": list(cells), "metadata": {"kernelspec": kernelspec, **metadata},
            "nbformat": 4, "nbformat_minor": 5}


def code(cell_id: str, source: str, metadata: dict | None = None, **extra) -> dict:
    return {"cell_type": "code", "execution_count": None, "id": cell_id, "metadata": metadata or {},
            "outputs": [], "source": source, **extra}


def markdown(cell_id: str, source: str, metadata: dict | None = None, **extra) -> dict:
    return {"cell_type": "markdown", "id": cell_id, "metadata": metadata or {}, "source": source, **extra}


def edge_cases() -> dict:
    """A source notebook with every kind of markup the generator handles."""
    return notebook(
        markdown("intro", "# Ünïcode — ring ✓\nNo markup here."),
        code("mixed", "import math\n\ndef f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n"
                      "    ### END SOLUTION\n\nZ = 3", meta("mixed", solution=True)),
        code("whole", "def g():\n    return 2", meta("whole", solution=True)),
        markdown("answer", "Explain:\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION\nThanks.",
                 meta("answer", grade=True, solution=True, points=1)),
        markdown("answer2", "Because, again.", meta("answer2", grade=True, solution=True, points=0.5)),
        code("tests", "assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(2) == 3\n### END HIDDEN TESTS\n",
             meta("tests", grade=True, points=1.5)),
        code("readonly", "SETUP = 1", meta("readonly", locked=True)),
        markdown("task", "Describe it.\n=== BEGIN MARK SCHEME ===\nFull marks for rings.\n"
                         "=== END MARK SCHEME ===", meta("task", task=True, points=2)),
        code("ran", "print('hi')", {"collapsed": True, "scrolled": False, "tags": ["keep"]},
             execution_count=7, outputs=[{"name": "stdout", "output_type": "stream", "text": ["hi\n"]}]),
        markdown("picture", "![dot](attachment:dot.png)",
                 attachments={"dot.png": {"image/png": "iVBORw0KGgo=", "text/plain": ["a\n", "b"]}}),
        {"cell_type": "raw", "id": "raw", "metadata": {}, "source": "raw text\n"},
        celltoolbar="Create Assignment",
    )


# --------------------------------------------------------------------------- #
# (a) exercises/ is up to date, through the command line, without torch
# --------------------------------------------------------------------------- #
def test_exercises_are_up_to_date():
    problems = exercises.stale(ROOT / "solutions", ROOT / "exercises")
    assert not problems, "\n".join(problems) + "\nRun `make exercises`."


def test_every_exercise_has_expectations_that_agree_with_its_metadata():
    assert sorted(EXPECTED) == NAMES, "add the new exercise to EXPECTED in tests/exercise_harness.py"
    for name, expected in EXPECTED.items():
        graded = [cell["metadata"]["nbgrader"] for cell in json.loads(source_path(name).read_text())["cells"]
                  if cell["metadata"].get("nbgrader", {}).get("grade")]
        assert sum(meta["points"] for meta in graded) == expected.points, name
        assert len(graded) == expected.checks, name
        assert expected.hidden <= {meta["grade_id"] for meta in graded}, name


@pytest.mark.parametrize("name", NAMES)
def test_released_exercise_is_current_and_keeps_the_answers_out(name):
    problems = [problem for problem in exercises.stale(ROOT / "solutions", ROOT / "exercises") if name in problem]
    assert not problems, "\n".join(problems) + "\nRun `make exercises`."
    stub = f'raise NotImplementedError("{EXPECTED[name].title}")'
    assert exercises.code_stub(name) == f"# YOUR CODE HERE\n{stub}"
    text = exercise_path(name).read_text()
    assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
    released = nbgrader_cells(exercise_path(name))
    for grade_id in nbgrader_cells(source_path(name), solution_only=True):
        assert stub in released[grade_id], f"{grade_id} has no stub"


def test_check_command_reports_missing_stale_and_orphans(tmp_path):
    solutions, student = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    (solutions / f"{NAME}.ipynb").write_bytes(SOURCE.read_bytes())
    # The generator must run on a bare Python: no torch, nbformat or nbgrader imported.
    script = ("import sys\nfrom dtcourse.grading.exercises import main\nrc = main(sys.argv[1:])\n"
              "assert not {'torch', 'nbformat', 'nbgrader'} & set(sys.modules), 'imported a heavy module'\n"
              "sys.exit(rc)")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, "--solutions", str(solutions),
                               "--exercises", str(student), *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)

    missing = run("--check")
    assert missing.returncode == 1 and "is missing" in missing.stderr and "make exercises" in missing.stderr
    assert run().returncode == 0
    assert run("--check").returncode == 0, run("--check").stderr
    target = student / f"{NAME}.ipynb"
    target.write_text(target.read_text().replace("YOUR CODE HERE", "my code"))
    (student / "99_old.ipynb").write_text("{}")
    stale = run("--check")
    assert stale.returncode == 1
    assert "out of date" in stale.stderr and "99_old.ipynb has no source" in stale.stderr


def test_read_write_round_trip_is_exact():
    assert dumps(loads(SOURCE.read_text())) == SOURCE.read_text()


# --------------------------------------------------------------------------- #
# (b) the same bytes as real nbgrader
# --------------------------------------------------------------------------- #
# One nbgrader run per exercise here is a few seconds each: three exercises, the first, the newest and one
# whose stub goes in through a config file (the other way nbgrader takes it), with the edge cases beside them.
# tests/test_nbgrader_course.py generates every exercise in one nbgrader run and checks the same bytes and
# gradebook cells for all of them.
NBGRADER_FORMS = {name: "config file" if name == "03_parameter_server_staleness" else "command line"
                  for name in (NAMES[0], "03_parameter_server_staleness", NAMES[-1])}


@pytest.mark.parametrize("name, form", [pytest.param(name, form, id=f"{name}-{form}")
                                        for name, form in NBGRADER_FORMS.items()])
def test_generator_matches_nbgrader(tmp_path, name, form):
    pytest.importorskip("nbgrader", reason="nbgrader is not installed: pip install -e '.[dev]'")
    from nbgrader.api import Gradebook

    assignment = tmp_path / "source" / name
    assignment.mkdir(parents=True)
    (assignment / f"{name}.ipynb").write_bytes(source_path(name).read_bytes())
    (assignment / "edge_cases.ipynb").write_text(dumps(edge_cases()), encoding="utf-8")
    stub = exercises.code_stub(name)
    if form == "command line":  # the option documented in dtcourse/exercises.py
        options = [f"--ClearSolutions.code_stub={stub}"]
    else:
        (tmp_path / "nbgrader_config.py").write_text(f"c.ClearSolutions.code_stub = {{'python': {stub!r}}}\n")
        options = []
    # nbgrader runs `alembic` from PATH to set up its gradebook.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", name, "--force", *options],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr

    release = tmp_path / "release" / name
    for notebook_name in (name, "edge_cases"):
        source = loads((assignment / f"{notebook_name}.ipynb").read_text(encoding="utf-8"))
        released = (release / f"{notebook_name}.ipynb").read_text(encoding="utf-8")
        assert dumps(generate(source, name)) == released, f"{notebook_name} differs from nbgrader's"
    ours = exercise_path(name).read_text(encoding="utf-8")
    assert ours == (release / f"{name}.ipynb").read_text(encoding="utf-8")

    # What nbgrader keeps in its gradebook is what dtcourse.grade restores test cells from.
    stored = generate(loads(source_path(name).read_text(encoding="utf-8")), name, keep_hidden_tests=True)
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gradebook:
        kept = {c.name: c for c in gradebook.find_notebook(name, name).source_cells}
    for cell in stored["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id:
            assert kept[grade_id].source == cell["source"], grade_id
            assert kept[grade_id].checksum == cell["metadata"]["nbgrader"]["checksum"], grade_id


# --------------------------------------------------------------------------- #
# (c) marker handling
# --------------------------------------------------------------------------- #
def cells_by_id(nb: dict) -> dict[str, dict]:
    return {cell["id"]: cell for cell in nb["cells"]}


def test_solution_region_inside_other_code_keeps_the_rest():
    cells = cells_by_id(generate(edge_cases(), NAME))
    assert cells["mixed"]["source"] == (
        "import math\n\ndef f(x):\n    y = 1\n    # YOUR CODE HERE\n"
        '    raise NotImplementedError("Exercise 01: collectives ring")\n\nZ = 3')
    assert cells["whole"]["source"] == exercises.code_stub(NAME)
    assert cells["mixed"]["metadata"]["deletable"] is False and "editable" not in cells["mixed"]["metadata"]


def test_markdown_solutions_get_the_text_stub():
    cells = cells_by_id(generate(edge_cases(), NAME))
    assert cells["answer"]["source"] == "Explain:\nYOUR ANSWER HERE\nThanks."
    assert cells["answer2"]["source"] == "YOUR ANSWER HERE"


def test_hidden_tests_and_mark_schemes_are_removed_and_checksummed():
    student, stored = generate(edge_cases(), NAME), generate(edge_cases(), NAME, keep_hidden_tests=True)
    tests, kept = cells_by_id(student)["tests"], cells_by_id(stored)["tests"]
    assert tests["source"] == "assert f(1) == 2\n"
    assert "assert f(2) == 3" in kept["source"]
    assert tests["metadata"]["nbgrader"]["checksum"] == checksum(tests) != kept["metadata"]["nbgrader"]["checksum"]
    assert tests["metadata"]["editable"] is False and tests["metadata"]["deletable"] is False
    assert cells_by_id(student)["task"]["source"] == "Describe it."


def test_outputs_and_output_metadata_are_cleared():
    nb = generate(edge_cases(), NAME)
    ran = cells_by_id(nb)["ran"]
    assert ran["outputs"] == [] and ran["execution_count"] is None
    assert ran["metadata"] == {"tags": ["keep"]}
    assert "celltoolbar" not in nb["metadata"]


@pytest.mark.parametrize("source, complaint", [
    ("x = 1\n### BEGIN SOLUTION\ny = 2", "has no matching"),
    ("### END SOLUTION\ny = 2", "with no 'BEGIN SOLUTION' before it"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "opens a second"),
])
def test_mismatched_markers_name_the_cell_and_line(source, complaint):
    nb = notebook(code("c0", "print(1)"), code("bad", source, meta("broken_cell", solution=True)))
    with pytest.raises(MarkupError, match=complaint) as info:
        generate(nb, NAME, where="solutions/x.ipynb")
    assert "solutions/x.ipynb, cell 1 (broken_cell)" in str(info.value)


@pytest.mark.parametrize("cell, complaint", [
    (code("c", "### BEGIN SOLUTION\nx = 1\n### END SOLUTION"), "not marked as a solution cell"),
    (code("c", "### BEGIN HIDDEN TESTS\nassert 1\n### END HIDDEN TESTS", meta("t", locked=True)),
     "not marked as a grade cell"),
    (code("c", "### BEGIN HIDDEN TESTS\nassert 1", meta("t", grade=True, points=1)), "has no matching"),
    (code("c", "assert 1", meta("t", grade=True)), "needs numeric points"),
    (code("c", "# AUTOTEST f(1)", meta("t", grade=True, points=1)), "AUTOTEST"),
])
def test_markup_errors_are_clear(cell, complaint):
    with pytest.raises(MarkupError, match=complaint):
        generate(notebook(cell), NAME)


def test_duplicate_grade_ids_are_refused():
    nb = notebook(code("a", "x", meta("same", solution=True)), code("b", "y", meta("same", solution=True)))
    with pytest.raises(MarkupError, match="used twice"):
        generate(nb, NAME)


def test_source_notebook_is_stored_without_outputs():
    nb = json.loads(SOURCE.read_text())
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in nb["cells"] if c["cell_type"] == "code")
