"""Exercise 05 (a checkpointed sequential container): the released notebook, its checks and the autograder.

A checkpoint that forgets to replay the RNG fails only the hidden check with dropout, told why;
one that keeps every tensor fails only the memory check, told how much it held. Full marks for
the solution and zero for the untouched exercise are checked with every exercise's, in
``test_grading.py``. Each grading run starts one Jupyter kernel (a few seconds). Run just these with
``pytest -q test_checkpointing_exercise.py``, and everything about this exercise with
``pytest -q tests -k "05_checkpointing_sequential or test_checkpointing_exercise"``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dtcourse import checks
from dtcourse.checkpointing import CheckpointedSequential, segment_bounds
from dtcourse.checks.checkpointing import GRADIENT_CASES
from exercise_harness import EXPECTED, assert_released, by_id, failed, grade_answers, solution_code

NAME = "05_checkpointing_sequential"
POINTS = EXPECTED[NAME].points

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


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_keeps_the_given_parts():
    assert_released(NAME, absent=["set_rng_state", 'cases=("dropout"'],
                    stubs={"segment_bounds": 1, "checkpoint": 1, "checkpointed_sequential": 1},
                    given={"checkpointed_sequential": ["def run_layers",
                                                       "self.bounds = segment_bounds(len(self), segments)"]})


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_forgetting_the_rng_replay_fails_only_the_dropout_check(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), checkpoint=NO_RNG_REPLAY))
    result = by_id(report)
    assert failed(report) == ["check_gradients_hidden"] and report.score == POINTS - 4, str(report)
    message = result["check_gradients_hidden"].message
    assert "CheckpointedSequential is wrong in case 'dropout'" in message and "segments=2" in message, message
    assert "the .grad of parameter '0.0.weight' (8, 8) differs from the plain run's (by up to" in message, \
        message
    assert "backward saw other dropout masks" in message and "torch.get_rng_state()" in message, message


def test_keeping_every_tensor_fails_only_the_memory_check(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), checkpoint=KEEPS_EVERYTHING))
    result = by_id(report)
    assert failed(report) == ["check_memory"] and report.score == POINTS - 2, str(report)
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
