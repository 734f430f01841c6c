"""What the exercise tests share: the exercises, what each should score, and a student's copy.

Every exercise is a notebook in ``solutions/`` (answers and hidden tests marked for nbgrader)
and its released copy in ``exercises/``. The tests that every exercise must pass (released copy
current and identical to nbgrader's, full marks for the solution, zero for the untouched copy)
are written once, parametrized over ``NAMES``, in ``test_grading_exercises.py`` and ``test_grading.py``.
Each exercise's own wrong answers are in ``test_<stem>_exercise.py`` (exercise 01's in
``test_grading.py``). Run everything about one exercise with, for example::

    pytest -q tests -k "02_data_parallel_buckets or test_data_parallel_exercise"
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dtcourse.grading.grade import Report, grade_notebook

ROOT = Path(__file__).resolve().parents[1]
NAMES = sorted(path.stem for path in (ROOT / "solutions").glob("*.ipynb"))


@dataclass(frozen=True)
class Expected:
    """What grading one exercise should give, written out here rather than read from the notebook."""

    title: str                # the stub raises NotImplementedError(title)
    points: float             # the full score
    checks: int               # graded test cells: each fails, naming the stub, when nothing is filled in
    hidden: frozenset[str]    # grade_ids of hidden tests, which the grader must restore and run


EXPECTED = {
    "00_memory_step_bytes": Expected(
        "Exercise 00: memory step bytes", 11, 7,
        frozenset({"check_optimizer_states_hidden", "check_activations_hidden"})),
    "01_collectives_ring": Expected(
        "Exercise 01: collectives ring", 14, 7,
        frozenset({"check_reduce_scatter_hidden", "check_all_gather_hidden", "check_all_reduce_hidden"})),
    "02_data_parallel_buckets": Expected(
        "Exercise 02: data parallel buckets", 12, 6,
        frozenset({"check_buckets_hidden", "check_parity_hidden", "check_overlap_hidden"})),
    "03_parameter_server_staleness": Expected(
        "Exercise 03: parameter server staleness", 12, 8,
        frozenset({"check_once_hidden", "check_bound_hidden", "check_parity_hidden", "check_hang_hidden"})),
    "04_mixed_precision_loss_scaler": Expected(
        "Exercise 04: mixed precision loss scaler", 10, 5, frozenset({"check_streams_hidden", "check_edges_hidden"})),
    "05_checkpointing_sequential": Expected(
        "Exercise 05: checkpointing sequential", 12, 6,
        frozenset({"check_segments_hidden", "check_gradients_hidden", "check_memory_hidden"})),
    "06_zero_stage2": Expected(
        "Exercise 06: zero stage2", 14, 8,
        frozenset({"check_gradients_hidden", "check_memory_hidden", "check_parity_hidden", "check_traffic_hidden"})),
    "08_pipeline_1f1b": Expected(
        "Exercise 08: pipeline 1f1b", 10, 6, frozenset({"check_valid_hidden", "check_order_hidden", "check_run_hidden"})),
    "09_tensor_parallel_layers": Expected(
        "Exercise 09: tensor parallel layers", 10, 8,
        frozenset({"check_f_and_g_hidden", "check_column_hidden", "check_row_hidden", "check_mlp_hidden"})),
    "11_moe_dispatch": Expected(
        "Exercise 11: moe dispatch", 10, 6,
        frozenset({"check_positions_hidden", "check_dispatch_hidden", "check_combine_hidden"})),
    "12_fault_tolerance_snapshot": Expected(
        "Exercise 12: fault tolerance snapshot", 10, 7,
        frozenset({"check_round_trip_hidden", "check_atomic_hidden", "check_resume_hidden"})),
}


def source_path(name: str) -> Path:
    """The source notebook of exercise ``name``, with answers and hidden tests."""
    return ROOT / "solutions" / f"{name}.ipynb"


def exercise_path(name: str) -> Path:
    """The released notebook of exercise ``name``, as students get it."""
    return ROOT / "exercises" / f"{name}.ipynb"


def nbgrader_cells(path: Path, solution_only: bool = False) -> dict[str, str]:
    """Source of every nbgrader cell of the notebook at ``path`` (or only its solution cells), by grade_id."""
    return {cell["metadata"]["nbgrader"]["grade_id"]: "".join(cell["source"])
            for cell in json.loads(path.read_text())["cells"]
            if "nbgrader" in cell["metadata"]
            and (cell["metadata"]["nbgrader"].get("solution") or not solution_only)}


def assert_released(name: str, absent: list[str], stubs: dict[str, int], given: dict[str, list[str]]) -> None:
    """The released notebook of ``name`` keeps the answer out and the given code in.

    No code cell contains any of ``absent`` (lines of the answer or of hidden tests), solution
    cell ``grade_id`` holds exactly ``stubs[grade_id]`` stubs, and cell ``grade_id`` still holds
    every line of ``given[grade_id]`` (signatures and scaffolding the student builds on).
    """
    released = json.loads(exercise_path(name).read_text())["cells"]
    code = "\n".join("".join(cell["source"]) for cell in released if cell["cell_type"] == "code")
    for text in absent:
        assert text not in code, f"the released {name} shows {text!r}"
    cells = nbgrader_cells(exercise_path(name))
    stub = f'raise NotImplementedError("{EXPECTED[name].title}")'
    for grade_id, count in stubs.items():
        assert cells[grade_id].count(stub) == count, f"{grade_id} should hold {count} stub(s):\n{cells[grade_id]}"
    for grade_id, lines in given.items():
        for line in lines:
            assert line in cells[grade_id], f"{grade_id} lost {line!r}:\n{cells[grade_id]}"


def solution_code(name: str) -> dict[str, str]:
    """The source's solution cells with the markers taken out: a student who got it all right."""
    return {grade_id: "\n".join(line for line in source.split("\n") if "SOLUTION" not in line)
            for grade_id, source in nbgrader_cells(source_path(name), solution_only=True).items()}


def compile_answers(name: str, cells: Sequence[str], edits: dict[str, list[tuple[str, str]]], filename: str,
                    module: str) -> dict:
    """The setup cell and the solution's ``cells`` of ``name``, each ``(old, new)`` of ``edits[cell]`` replaced, run.

    The code is compiled under ``filename`` and run as module ``module`` (the test file's ``__file__`` and
    ``__name__``): to the checks, what it defines is a student's code. Returns the namespace it ran in.
    """
    given, answers = nbgrader_cells(source_path(name)), solution_code(name)
    for cell, pairs in edits.items():
        for old, new in pairs:
            assert old in answers[cell], f"{old!r} is not in the solution's {cell} cell"
            answers[cell] = answers[cell].replace(old, new)
    namespace: dict = {"__name__": module}
    code = "\n\n".join([given["setup"], *(answers[cell] for cell in cells)])
    exec(compile(code, filename, "exec"), namespace)
    return namespace


def student_copy(name: str, directory: Path, answers: dict[str, str]) -> Path:
    """The released exercise with some solution cells filled in, saved as a student would."""
    nb = json.loads(exercise_path(name).read_text())
    for cell in nb["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell["source"] = answers[grade_id]
    path = directory / f"{name}.ipynb"
    path.write_text(json.dumps(nb, indent=1))
    return path


def grade_answers(name: str, directory: Path, answers: dict[str, str], **options) -> Report:
    """Grade the released exercise with ``answers`` filled in (one Jupyter kernel, a few seconds)."""
    return grade_notebook(student_copy(name, directory, answers), source=source_path(name), **options)


def by_id(report: Report) -> dict:
    """The report's checks, by grade_id, in notebook order."""
    return {check.grade_id: check for check in report.checks}


def failed(report: Report) -> list[str]:
    """The grade_ids of the checks that failed, in notebook order."""
    return [grade_id for grade_id, check in by_id(report).items() if not check.passed]
