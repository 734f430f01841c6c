"""Exercise 00 (the bytes of a training step): the released notebook, its checks and the autograder.

Every graded cell checks one kind of memory, so a mistake in one kind costs that kind's points
only, with a message that names it: 16-bit weights counted as fp32 fail only the parameters'
check, and GELU counted like ReLU only the activation checks. Full marks for the solution and
zero for the untouched exercise are checked with every exercise's, in ``test_grading.py``. Each
grading run starts one Jupyter kernel (a few seconds). Run just these with
``pytest -q test_memory_exercise.py``, and everything about this exercise with
``pytest -q tests -k "00_memory_step_bytes or test_memory_exercise"``.
"""

from __future__ import annotations

import pytest

from dtcourse.checks.memory import check_activations, check_model_states
from exercise_harness import EXPECTED, assert_released, by_id, failed, grade_answers, solution_code

NAME = "00_memory_step_bytes"
POINTS = EXPECTED[NAME].points

# Mixed precision's working copy counted at fp32's 4 bytes: wrong parameters, and only those.
FP32_PARAMS = '''
def model_state_bytes(sizes, optimizer, mixed):
    n_params = sum(d_in * d_out + d_out for d_in, d_out in zip(sizes[:-1], sizes[1:]))
    n_tensors = 2 * (len(sizes) - 1)
    per_param = {"sgd": 0, "sgd_momentum": 4, "adam": 8, "adamw": 8, "adagrad": 4}[optimizer]
    per_tensor = {"sgd": 0, "sgd_momentum": 0, "adam": 4, "adamw": 4, "adagrad": 4}[optimizer]
    return {"params": 4 * n_params, "grads": (2 if mixed else 4) * n_params,
            "master_weights": 4 * n_params if mixed else 0,
            "optimizer_states": per_param * n_params + per_tensor * n_tensors}
'''
# GELU treated like ReLU: its input is saved as well as its output, and this forgets the input.
GELU_LIKE_RELU = '''
def activation_bytes(sizes, batch_size, activation, mixed):
    return batch_size * (2 if mixed else 4) * (sizes[0] + sum(sizes[1:-1]) + 2 * sizes[-1])
'''


def _solution() -> dict:
    """The notebook's own answers, run here: model_state_bytes and activation_bytes."""
    namespace: dict = {}
    for source in solution_code(NAME).values():
        exec(source, namespace)                # noqa: S102 - the course's own solution cells
    return namespace


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_keeps_the_given_parts():
    assert_released(NAME, absent=["per_tensor = {", "per_hidden = {", 'cases=("more_optimizers"',
                                  'cases=("tanh_silu"'],
                    stubs={"model_state_bytes": 1, "activation_bytes": 1},
                    given={"model_state_bytes": ["def model_state_bytes(sizes: tuple[int, ...], optimizer: str, "
                                                 "mixed: bool) -> dict[str, int]:"],
                           "activation_bytes": ["def activation_bytes(sizes: tuple[int, ...], batch_size: int, "
                                                "activation: str, mixed: bool) -> int:"]})


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_a_wrong_kind_loses_only_that_kinds_points(tmp_path):
    # Two mistakes in one grading run (a kernel each costs seconds): the other kinds keep their points.
    answers = dict(solution_code(NAME), model_state_bytes=FP32_PARAMS, activation_bytes=GELU_LIKE_RELU)
    report = grade_answers(NAME, tmp_path, answers)
    assert failed(report) == ["check_params", "check_activations", "check_activations_hidden"], str(report)
    assert report.score == POINTS - 1 - 2 - 2, str(report)
    message = by_id(report)["check_params"].message
    assert "model_state_bytes is wrong in case 'mixed'" in message, message
    assert "params for sizes (12, 24, 20, 5), bfloat16 mixed precision (917 parameters in 6 tensors)" in message
    assert "you predicted 3,668 bytes, the measured step holds 1,834" in message, message
    assert "which is 2 bytes per parameter" in message and "16-bit" in message, message
    message = by_id(report)["check_activations"].message
    assert "activation_bytes is wrong in case 'gelu'" in message, message
    assert "layer 1 (GELU) saved a (9, 24) float32 tensor (864 bytes)" in message, message
    assert "layer 2 (Linear) saved a (9, 24) float32 tensor (864 bytes)" in message, message


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
def test_the_solution_holds_for_every_kind_on_the_hidden_model_cases():
    # The notebook checks the other kinds on "fp32" and "mixed" only (the full-marks test in
    # test_grading.py runs every cell); here they meet AdamW, Adagrad, fp16 and a one-layer MLP too.
    answers = _solution()
    for kind in ("params", "grads", "master_weights"):
        check_model_states(answers["model_state_bytes"], kind, cases=("more_optimizers", "fp16"))


def test_a_forgotten_step_counter_is_named_per_tensor():
    answers = _solution()

    def no_step(sizes, optimizer, mixed):
        states = answers["model_state_bytes"](sizes, optimizer, mixed)
        if optimizer in ("adam", "adamw", "adagrad"):
            states["optimizer_states"] -= 4 * 2 * (len(sizes) - 1)
        return states

    with pytest.raises(AssertionError, match=r"optimizer_states for sizes \(12, 24, 20, 5\), fp32 .* optimizer "
                                             r"'adam': you predicted 7,336 bytes, the measured step holds 7,360; "
                                             r"yours is 24 too low, which is 4 bytes per parameter tensor.*"
                                             r"a 0-dim float32 tensor"):
        check_model_states(no_step, "optimizer_states", cases=("fp32",))
    for kind in ("params", "grads", "master_weights"):                 # the other kinds still pass
        check_model_states(no_step, kind, cases=("fp32", "mixed"))


def test_master_weights_counted_twice_are_named_in_the_optimizer_states():
    answers = _solution()

    def master_inside(sizes, optimizer, mixed):
        states = answers["model_state_bytes"](sizes, optimizer, mixed)
        states["optimizer_states"] += states["master_weights"]        # ZeRO's K, but here a kind of its own
        return states

    check_model_states(master_inside, "optimizer_states", cases=("fp32",))
    with pytest.raises(AssertionError, match=r"'sgd': you predicted 3,668 bytes, the measured step holds 0; "
                                             r"yours is 3,668 too high, which is 4 bytes per parameter\. .*leave "
                                             r"the master weights out"):
        check_model_states(master_inside, "optimizer_states", cases=("mixed",))


@pytest.mark.parametrize("answer, complaint", [
    (lambda sizes, optimizer, mixed: [1, 2], r"returned \[1, 2\]; it must return a dict with the keys"),
    (lambda sizes, optimizer, mixed: {"params": 1}, r"returned a dict with no 'grads' key \(its keys: \['params'\]\)"),
    (lambda sizes, optimizer, mixed: {"grads": 1.5}, r"should be a whole number of bytes, but yours is 1\.5"),
])
def test_answers_of_the_wrong_shape_are_told_what_to_return(answer, complaint):
    with pytest.raises(AssertionError, match=complaint):
        check_model_states(answer, "grads")


def test_checks_refuse_unknown_kinds_and_cases():
    answers = _solution()
    with pytest.raises(ValueError, match="kind must be one of"):
        check_model_states(answers["model_state_bytes"], "activations")
    with pytest.raises(ValueError, match="cases must be among"):
        check_activations(answers["activation_bytes"], cases=("swish",))
