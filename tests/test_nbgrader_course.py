"""``dtcourse course DIR``: the nbgrader course folder it writes, and real nbgrader runs in it.

The first tests check what is written and what is refused (well under a second). The last two run
real nbgrader as an instructor would, from the course folder with ``python -m nbgrader``, and are
skipped when nbgrader is not installed (``pip install -e '.[dev]'``):

* ``test_nbgrader_generates_every_exercise_from_the_course_config`` (about 12 s): one
  ``generate_assignment`` run for every exercise, no stub on the command line;
* ``test_generate_autograde_feedback_export_in_the_course`` (40 to 60 s): the whole road for
  exercise 00, its quickest to grade.

Run just these with ``pytest -q tests/test_nbgrader_course.py``.
"""

from __future__ import annotations

import csv
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtcourse import cli
from dtcourse.grading import course
from exercise_harness import EXPECTED, NAMES, ROOT, exercise_path, solution_code, source_path, student_copy

QUICK = "00_memory_step_bytes"   # about 10 s to grade, the least of the six
HIDE_LINE = "c.GenerateFeedback.preprocessors = [GetGrades, ClearHiddenTests, CSSHTMLHeaderPreprocessor]"


# --------------------------------------------------------------------------- #
# What the command writes and refuses
# --------------------------------------------------------------------------- #
def test_writes_every_exercise_a_config_and_the_instructors_readme(tmp_path):
    written = course.write_course(tmp_path / "grading")
    notebooks = sorted(written.glob("source/*/*.ipynb"))
    assert [(path.parent.name, path.stem) for path in notebooks] == [(name, name) for name in NAMES]
    for path in notebooks:
        assert path.read_bytes() == source_path(path.stem).read_bytes(), f"{path} is not a copy of solutions/"
    config = (written / "nbgrader_config.py").read_text()
    compile(config, "nbgrader_config.py", "exec")
    assert "c.GenerateAssignment.preprocessors = with_exercise_stubs()" in config
    assert config.count(f"# {HIDE_LINE}") == 1, "the hide-the-hidden-tests option is one commented line"
    readme = (written / "README.md").read_text()
    for step in ("nbgrader generate_assignment", "release_assignment", "collect", "nbgrader autograde",
                 "nbgrader generate_feedback", "nbgrader export", "submitted/<student id>/NAME/NAME.ipynb"):
        assert step in readme, step
    assert "`solutions/`" in readme and "`source/`" in readme and "ClearHiddenTests" in readme
    assert all(f"`source/{name}/{name}.ipynb`" in readme for name in NAMES)


def test_refuses_a_folder_that_is_not_empty_unless_forced(tmp_path, capsys):
    target = tmp_path / "grading"
    target.mkdir()
    assert cli.main(["course", str(target)]) == 0          # an empty folder is fine
    (target / "gradebook.db").write_text("kept")
    assert cli.main(["course", str(target)]) == 2
    error = capsys.readouterr().err
    assert f"{target} is not empty" in error and "--force" in error
    (target / "README.md").write_text("edited")
    assert cli.main(["course", str(target), "--force"]) == 0
    assert (target / "gradebook.db").read_text() == "kept", "--force must leave the gradebook alone"
    assert (target / "README.md").read_text().startswith("# Grading the dtcourse exercises")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        course.write_course(tmp_path / "a_file", force=True)


def test_exercises_are_chosen_by_number_or_name(tmp_path):
    target = tmp_path / "grading"
    assert course.main([str(target), "--exercises", "04", "00_memory_step_bytes", "00.ipynb"]) == 0
    chosen = ["00_memory_step_bytes", "04_mixed_precision_loss_scaler"]
    assert sorted(path.name for path in (target / "source").iterdir()) == chosen
    readme = (target / "README.md").read_text()
    assert "`source/04_mixed_precision_loss_scaler/" in readme and "01_collectives_ring`:" not in readme


def test_an_unknown_or_ambiguous_exercise_is_refused_before_anything_is_written(tmp_path, capsys):
    target = tmp_path / "grading"
    assert course.main([str(target), "--exercises", "00", "99"]) == 2
    error = capsys.readouterr().err
    assert "no exercise '99'" in error and "01_collectives_ring" in error
    assert not target.exists()
    with pytest.raises(ValueError, match="2 exercises start with '0'"):
        course._select(["0"], ["0_ring", "0_tree"])


# --------------------------------------------------------------------------- #
# Real nbgrader in the written course
# --------------------------------------------------------------------------- #
def nbgrader(course_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m nbgrader ARGS`` run from ``course_dir``, as the README's steps run it."""
    # nbgrader runs `alembic` from PATH for its gradebook; the config imports dtcourse.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course_dir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stdout}{done.stderr}"
    return done


def visible_text(page: str) -> str:
    """What a browser shows of a feedback page: tags dropped (Pygments splits code into spans), entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def hidden_tests(name: str) -> list[list[str]]:
    """Each hidden-test region of exercise ``name``: its lines that the released notebook does not show.

    A line such as ``from dtcourse.checks import check_model_states`` may be in a visible test too;
    what is left are the lines only the hidden tests hold, the ones feedback could give away.
    """
    released = {line.strip() for cell in json.loads(exercise_path(name).read_text())["cells"]
                for line in "".join(cell["source"]).splitlines()}
    regions = []
    for cell in json.loads(source_path(name).read_text())["cells"]:
        source = "".join(cell["source"])
        for region in re.findall(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", source, re.S):
            secret = [line.strip() for line in region.splitlines() if line.strip() not in released]
            assert secret, f"a hidden test of {name} holds nothing the released notebook lacks"
            regions.append(secret)
    return regions


def test_nbgrader_generates_every_exercise_from_the_course_config(tmp_path):
    """About 12 s: one nbgrader process generates all six, so the stub must change between assignments."""
    pytest.importorskip("nbgrader", reason="nbgrader is not installed: pip install -e '.[dev]'")
    written = course.write_course(tmp_path / "grading")
    # No --ClearSolutions.code_stub: the stubs come from nbgrader_config.py alone.
    nbgrader(written, "generate_assignment", "*")
    from nbgrader.api import Gradebook
    from dtcourse.grading.exercises import generate, loads
    from exercise_harness import source_path
    with Gradebook(f"sqlite:///{written / 'gradebook.db'}") as gradebook:
        for name in NAMES:
            released = written / "release" / name / f"{name}.ipynb"
            assert released.read_bytes() == exercise_path(name).read_bytes(), f"{released} differs from exercises/"
            # what nbgrader keeps of each graded cell is what dtcourse.grade restores test cells from
            kept = {c.name: c for c in gradebook.find_notebook(name, name).source_cells}
            stored = generate(loads(source_path(name).read_text(encoding="utf-8")), name, keep_hidden_tests=True)
            for cell in stored["cells"]:
                grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
                if grade_id:
                    assert kept[grade_id].source == cell["source"], (name, grade_id)
                    assert kept[grade_id].checksum == cell["metadata"]["nbgrader"]["checksum"], (name, grade_id)


def test_generate_autograde_feedback_export_in_the_course(tmp_path):
    """50 to 80 s: generate, three submissions, autograde (three kernels), feedback twice, export."""
    pytest.importorskip("nbgrader", reason="nbgrader is not installed: pip install -e '.[dev]'")
    written = course.write_course(tmp_path / "grading", [QUICK])
    nbgrader(written, "generate_assignment", QUICK)
    released = written / "release" / QUICK / f"{QUICK}.ipynb"
    assert released.read_bytes() == exercise_path(QUICK).read_bytes()

    # ada fills in every solution cell with the answer; bob returns the notebook untouched; eve
    # writes empty functions and rebinds the checks' names to do-nothing lambdas in her cells.
    for student in ("ada", "bob", "eve"):
        (written / "submitted" / student / QUICK).mkdir(parents=True)
    student_copy(QUICK, written / "submitted" / "ada" / QUICK, solution_code(QUICK))
    shutil.copyfile(released, written / "submitted" / "bob" / QUICK / f"{QUICK}.ipynb")
    student_copy(QUICK, written / "submitted" / "eve" / QUICK, {
        "model_state_bytes": "def model_state_bytes(sizes, optimizer, mixed):\n    return {}\n"
                             "check_model_states = lambda *args, **kwargs: None",
        "activation_bytes": "def activation_bytes(sizes, batch_size, activation, mixed):\n    return 0\n"
                            "import dtcourse.checks\ndtcourse.checks.check_activations = lambda *args, **kwargs: None"})

    nbgrader(written, "autograde", QUICK)
    nbgrader(written, "generate_feedback", QUICK)
    nbgrader(written, "export")

    def feedback(student: str) -> str:
        return visible_text((written / "feedback" / student / QUICK / f"{QUICK}.html").read_text())

    with open(written / "grades.csv", newline="") as table:
        rows = {row["student_id"]: row for row in csv.DictReader(table) if row["assignment"] == QUICK}
    points = EXPECTED[QUICK].points
    assert sorted(rows) == ["ada", "bob", "eve"]
    assert float(rows["ada"]["score"]) == float(rows["ada"]["max_score"]) == points
    assert float(rows["bob"]["score"]) == 0 and float(rows["bob"]["max_score"]) == points
    # the test cells import their checks themselves, and the checks refuse a notebook that
    # reaches into them: eve's rebinding earns nothing under real nbgrader either
    assert float(rows["eve"]["score"]) == 0, rows["eve"]
    assert "reaches into the grading" in feedback("eve")

    regions = hidden_tests(QUICK)
    hidden = [line for region in regions for line in region]
    assert len(regions) == len(EXPECTED[QUICK].hidden)       # one region per hidden test cell
    by_default = feedback("ada")
    assert f"Score: {points:.1f} / {points:.1f}" in by_default
    assert "BEGIN HIDDEN TESTS" in by_default and all(line in by_default for line in hidden), \
        "nbgrader's feedback shows the hidden tests by default; the README says so"

    # The option the config carries, commented out: the cells lose their hidden tests...
    config = written / "nbgrader_config.py"
    config.write_text(config.read_text().replace(f"# {HIDE_LINE}", HIDE_LINE))
    nbgrader(written, "generate_feedback", QUICK, "--force")
    hidden_off = feedback("ada")
    assert f"Score: {points:.1f} / {points:.1f}" in hidden_off
    assert "HIDDEN TESTS" not in hidden_off and not any(line in hidden_off for line in hidden)
    # ...but a hidden test that fails still quotes its failing line in the traceback, as the
    # README warns: bob fails every hidden test, and each shows through.
    failed = feedback("bob")
    assert f"Score: 0.0 / {points:.1f}" in failed
    for region in regions:
        assert any(line in failed for line in region), region
