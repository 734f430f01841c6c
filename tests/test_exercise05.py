"""Exercise 05 (a checkpointed sequential container): the notebook, its checks and the autograder.

A complete answer earns every point; the untouched exercise earns none, with the stub named in
every failed check; a checkpoint that forgets to replay the RNG fails only the hidden check with
dropout, told why; one that keeps every tensor fails only the memory check, told how much it held.
Each grading run starts one Jupyter kernel (a few seconds). Run just these with
``pytest -q tests/test_exercise05.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dtcourse import checks, exercises
from dtcourse.checkpointing import CheckpointedSequential, segment_bounds
from dtcourse.checks.checkpointing import GRADIENT_CASES
from dtcourse.grade import grade_notebook

ROOT = Path(__file__).resolve().parents[1]
NAME = "05_checkpointed_sequential"
SOURCE = ROOT / "solutions" / f"{NAME}.ipynb"
EXERCISE = ROOT / "exercises" / f"{NAME}.ipynb"
POINTS = 12
STUB = "NotImplementedError: Exercise 05: checkpointed sequential"

# Recomputes without restoring the RNG state: dropout draws new masks in backward.
NO_RNG_REPLAY = '''
def checkpoint(fn, x):
    count, recomputed = 0, {}

    def pack(tensor):
        nonlocal count
        count += 1
        return count - 1

    def unpack(position):
        if position not in recomputed:
            kept = []
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                    lambda t: kept.append(t.detach()), lambda _: None):
                fn(x.detach().requires_grad_(x.requires_grad))
            recomputed.update(enumerate(kept))
        return recomputed.pop(position)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)
'''
# Hooks that keep the tensors themselves: right gradients, no memory saved, nothing recomputed.
KEEPS_EVERYTHING = '''
def checkpoint(fn, x):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return fn(x)
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


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_exercise_is_current_and_keeps_the_answers_out():
    assert not exercises.stale(ROOT / "solutions", ROOT / "exercises"), "run `make exercises`"
    nb = json.loads(EXERCISE.read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "BEGIN SOLUTION" not in code and "HIDDEN TESTS" not in code
    assert "set_rng_state" not in code and 'cases=("dropout"' not in code
    cells = {c["metadata"]["nbgrader"]["grade_id"]: "".join(c["source"])
             for c in nb["cells"] if "nbgrader" in c["metadata"]}
    stub = 'raise NotImplementedError("Exercise 05: checkpointed sequential")'
    assert all(stub in cells[i] for i in ("segment_bounds", "checkpoint", "checkpointed_sequential"))
    assert "def run_layers" in cells["checkpointed_sequential"]             # the given parts stay
    assert "self.bounds = segment_bounds(len(self), segments)" in cells["checkpointed_sequential"]


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
    report = grade_notebook(student_copy(tmp_path, solution_code()), source=SOURCE)
    assert (report.score, report.max_score, report.exit_code) == (POINTS, POINTS, 0), str(report)
    assert {"check_segments_hidden", "check_gradients_hidden"} <= set(by_id(report))


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


def test_forgetting_the_rng_replay_fails_only_the_dropout_check(tmp_path):
    report = grade_notebook(student_copy(tmp_path, dict(solution_code(), checkpoint=NO_RNG_REPLAY)),
                            source=SOURCE)
    result = by_id(report)
    failed = [grade_id for grade_id, check in result.items() if not check.passed]
    assert failed == ["check_gradients_hidden"] and report.score == POINTS - 4, str(report)
    message = result["check_gradients_hidden"].message
    assert "CheckpointedSequential is wrong in case 'dropout'" in message and "segments=2" in message, message
    assert "the .grad of parameter '0.0.weight' (8, 8) differs from the plain run's (by up to" in message, \
        message
    assert "backward saw other dropout masks" in message and "torch.get_rng_state()" in message, message


def test_keeping_every_tensor_fails_only_the_memory_check(tmp_path):
    report = grade_notebook(student_copy(tmp_path, dict(solution_code(), checkpoint=KEEPS_EVERYTHING)),
                            source=SOURCE)
    result = by_id(report)
    failed = [grade_id for grade_id, check in result.items() if not check.passed]
    assert failed == ["check_memory"] and report.score == POINTS - 2, str(report)
    message = result["check_memory"].message
    assert "the stack held 49,152 bytes (12.0 activations of (16, 64))" in message, message
    assert "a checkpointed stack holds 24,576 (6:" in message, message
    assert "kept the tensors it was given" in message, message


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
def test_reference_passes_every_check():
    checks.check_segment_bounds(segment_bounds, cases=("small", "large"))
    checks.check_checkpoint_gradients(CheckpointedSequential, cases=tuple(GRADIENT_CASES))
    checks.check_checkpoint_memory(CheckpointedSequential)


def test_segment_check_names_the_rule_and_the_missing_error():
    def torch_rule(n, k):
        size = n // k
        return [(i * size, (i + 1) * size) for i in range(k - 1)] + [((k - 1) * size, n)]

    with pytest.raises(AssertionError, match=r"segment_bounds\(3, 2\) should be \[\(0, 2\), \(2, 3\)\] but "
                                             r"yours is \[\(0, 1\), \(1, 3\)\]\. That is torch's rule"):
        checks.check_segment_bounds(torch_rule)

    def never_complains(n, k):
        return segment_bounds(n, max(1, min(k, n)))

    with pytest.raises(AssertionError, match=r"segment_bounds\(5, 0\) returned \[\(0, 5\)\]; it should raise "
                                             r"ValueError"):
        checks.check_segment_bounds(never_complains)


def _recomputes_every_time(fn, x):
    """A checkpoint that re-runs fn for every unpack instead of once per backward."""
    def unpack(position):
        kept = []
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda t: kept.append(t.detach()), lambda _: None):
            fn(x.detach().requires_grad_(x.requires_grad))
        return kept[position]

    positions = iter(range(10**6))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: next(positions), unpack):
        return fn(x)


class _Wasteful(nn.Sequential):
    def __init__(self, *layers, segments):
        super().__init__(*layers)
        self.bounds = segment_bounds(len(self), segments)

    def forward(self, x):
        layers = list(self)
        for start, end in self.bounds[:-1]:
            x = _recomputes_every_time(nn.Sequential(*layers[start:end]), x)
        return nn.Sequential(*layers[self.bounds[-1][0]:])(x)


def test_memory_check_counts_recomputations():
    with pytest.raises(AssertionError, match=r"during backward the layers ran "
                                             r"\[11, 11, 11, 11, 12, 12, 12, 12, 0, 0, 0, 0\] "
                                             r"more times; expected \[1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0\].*"
                                             r"Recompute a segment once"):
        checks.check_checkpoint_memory(_Wasteful)
    checks.check_checkpoint_gradients(_Wasteful, cases=("mlp",))           # right, only wasteful
