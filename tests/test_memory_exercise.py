"""Exercise 00 (the bytes of a training step): the released notebook, its checks and the autograder.

Every graded cell checks one kind of memory, so a mistake in one kind costs that kind's points
only, with a message that names it: 16-bit weights counted as fp32 fail only the parameters'
check, and GELU counted like ReLU only the activation checks. A count that ignores the dtype
(everything fp32, no master weights) misses the point of the exercise and scores under half. The
course's measurements (``dtcourse.memory.measure_step``, ``SavedTensors``, ``predict_step``,
``mlp_activation_bytes``) refuse to run inside the checks. Full marks for the solution and zero for
the untouched exercise are checked with every exercise's, in ``test_grading.py``; here an answer
written differently from the solution gets full marks too. Each grading run starts one Jupyter
kernel (a few seconds). Run just these with
``pytest -q test_memory_exercise.py``, and everything about this exercise with
``pytest -q tests -k "00_memory_step_bytes or test_memory_exercise"``.
"""

from __future__ import annotations

import pytest
import torch

from dtcourse.checks.memory import check_activations, check_model_states
from dtcourse.memory import SavedTensors, measure_step, mlp_activation_bytes, predict_step
from dtcourse.models import MLP, regression_batch
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
    master = 4 * n_params if mixed else 0
    return {"params": 4 * n_params, "grads": (2 if mixed else 4) * n_params, "master_weights": master,
            "optimizer_states": master + per_param * n_params + per_tensor * n_tensors}
'''
# GELU treated like ReLU: its input is saved as well as its output, and this forgets the input.
GELU_LIKE_RELU = '''
def activation_bytes(sizes, batch_size, activation, mixed):
    return batch_size * (2 if mixed else 4) * (sizes[0] + sum(sizes[1:-1]) + 2 * sizes[-1])
'''

# Mixed precision not understood: every kind counted as in fp32, and no master weights.
DTYPE_BLIND_STATES = '''
def model_state_bytes(sizes, optimizer, mixed):
    n_params = sum(d_in * d_out + d_out for d_in, d_out in zip(sizes[:-1], sizes[1:]))
    n_tensors = 2 * (len(sizes) - 1)
    per_param = {"sgd": 0, "sgd_momentum": 4, "adam": 8, "adamw": 8, "adagrad": 4}[optimizer]
    per_tensor = {"sgd": 0, "sgd_momentum": 0, "adam": 4, "adamw": 4, "adagrad": 4}[optimizer]
    return {"params": 4 * n_params, "grads": 4 * n_params, "master_weights": 0,
            "optimizer_states": per_param * n_params + per_tensor * n_tensors}
'''
DTYPE_BLIND_ACTIVATIONS = '''
def activation_bytes(sizes, batch_size, activation, mixed):
    per_hidden = {"relu": 1, "tanh": 1, "gelu": 2, "silu": 2}[activation]
    return batch_size * 4 * (sizes[0] + per_hidden * sum(sizes[1:-1]) + 2 * sizes[-1])
'''

# Right, and unlike the solution: tensor by tensor, from the layers' shapes and the optimizers' states.
TENSOR_BY_TENSOR = {"model_state_bytes": '''
import math

STATES = {"sgd": [], "sgd_momentum": ["momentum_buffer"], "adam": ["exp_avg", "exp_avg_sq", "step"],
          "adamw": ["exp_avg", "exp_avg_sq", "step"], "adagrad": ["sum", "step"]}


def model_state_bytes(sizes, optimizer, mixed):
    shapes = []
    for d_in, d_out in zip(sizes, sizes[1:]):
        shapes += [(d_out, d_in), (d_out,)]                  # weight, bias
    working = torch.bfloat16 if mixed else torch.float32
    total = {"params": 0, "grads": 0, "master_weights": 0, "optimizer_states": 0}
    for shape in shapes:
        numel = math.prod(shape)
        total["params"] += numel * working.itemsize
        total["grads"] += numel * working.itemsize
        if mixed:
            total["master_weights"] += numel * torch.float32.itemsize
            total["optimizer_states"] += numel * torch.float32.itemsize     # ZeRO's K holds the masters
        for state in STATES[optimizer]:
            total["optimizer_states"] += (1 if state == "step" else numel) * torch.float32.itemsize
    return total
''', "activation_bytes": '''
def activation_bytes(sizes, batch_size, activation, mixed):
    itemsize = (torch.bfloat16 if mixed else torch.float32).itemsize
    saved = [sizes[0]]                                        # the first Linear's input
    for width in sizes[1:-1]:
        saved.append(width)                                   # the activation's output, the next Linear's input
        if activation in ("gelu", "silu"):
            saved.append(width)                               # and, for these two, its input
    saved += [sizes[-1], sizes[-1]]                           # MSE: the output and the target
    return batch_size * itemsize * sum(saved)
'''}


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
    assert "That is exactly what you get when you counted the 16-bit working copy at fp32's 4 bytes" in message
    message = by_id(report)["check_activations"].message
    assert "activation_bytes is wrong in case 'gelu'" in message, message
    assert ("That is exactly what you get when you count one tensor per hidden width, as for ReLU, but GELU "
            "computes its gradient from its input" in message), message
    assert "layer 1 (GELU) saved a (9, 24) float32 tensor (864 bytes)" in message, message
    assert "layer 2 (Linear) saved a (9, 24) float32 tensor (864 bytes)" in message, message


def test_ignoring_the_dtype_misses_the_point_and_scores_under_half(tmp_path):
    answers = {"model_state_bytes": DTYPE_BLIND_STATES, "activation_bytes": DTYPE_BLIND_ACTIVATIONS}
    report = grade_answers(NAME, tmp_path, answers)
    result = by_id(report)
    assert failed(report) == ["check_params", "check_grads", "check_master_weights", "check_optimizer_states",
                              "check_optimizer_states_hidden", "check_activations", "check_activations_hidden"], \
        str(report)
    assert report.score == 0 < POINTS / 2, str(report)          # optimizer_states holds the masters: wrong too
    for grade_id, named in [("check_params", "you counted the 16-bit working copy at fp32's 4 bytes a parameter"),
                            ("check_grads", "you counted the gradients in fp32: backward writes them in the working "
                                            "copy's dtype"),
                            ("check_master_weights", "you counted no master weights: mixed precision keeps an "
                                                     "fp32 master copy of every parameter"),
                            ("check_optimizer_states", "you left out the master weights: in mixed precision "
                                                       "the optimizer steps an fp32 master copy"),
                            ("check_activations", "you count 4 bytes an element: in mixed precision every saved "
                                                  "tensor is 16-bit")]:
        message = result[grade_id].message
        assert "mixed precision" in message and f"That is exactly what you get when {named}" in message, message


def test_an_answer_written_unlike_the_solution_gets_full_marks(tmp_path):
    report = grade_answers(NAME, tmp_path, TENSOR_BY_TENSOR)
    assert report.score == POINTS and not failed(report), str(report)


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


def _with(kind: str, change):
    """The solution's model_state_bytes with ``kind`` replaced by ``change(sizes, optimizer, mixed, right)``."""
    answers = _solution()

    def answer(sizes, optimizer, mixed):
        states = answers["model_state_bytes"](sizes, optimizer, mixed)
        states[kind] = change(sizes, optimizer, mixed, states[kind])
        return states
    return answer


def _n_params(sizes) -> int:
    return sum(d_in * d_out + d_out for d_in, d_out in zip(sizes[:-1], sizes[1:]))


def _n_tensors(sizes) -> int:
    return 2 * (len(sizes) - 1)


@pytest.mark.parametrize("kind, change, cases, where, named", [
    # momentum in bf16, like the working copy
    ("optimizer_states", lambda sizes, opt, mixed, right: (right - 2 * _n_params(sizes)
                                                           if mixed and opt == "sgd_momentum" else right),
     ("mixed",), "'sgd_momentum'", r"you counted the states at 2 bytes, the working copy's 16 bits"),
    # momentum forgotten
    ("optimizer_states", lambda sizes, opt, mixed, right: 0 if opt == "sgd_momentum" else right, ("fp32",),
     "'sgd_momentum'", r"you counted what 'sgd' keeps \(nothing\), but 'sgd_momentum' keeps `momentum_buffer`"),
    # Adam's step as one number per parameter
    ("optimizer_states", lambda sizes, opt, mixed, right: (right + 4 * _n_params(sizes) - 4 * _n_tensors(sizes)
                                                           if opt == "adam" else right),
     ("fp32",), "'adam'", r"you counted `step` once per parameter: it is one 0-dim float32 tensor per parameter"),
    # the weights alone
    ("params", lambda sizes, opt, mixed, right: right - (2 if mixed else 4) * sum(sizes[1:]), ("fp32",), "fp32",
     r"you left out the biases: each nn.Linear\(d_in, d_out\) also holds a bias of d_out parameters"),
    # master weights in fp32 too
    ("master_weights", lambda sizes, opt, mixed, right: 4 * _n_params(sizes), ("fp32",), "fp32",
     r"you counted master weights in fp32, where the optimizer steps the model's own parameters: there is no "
     r"master copy"),
])
def test_common_model_state_mistakes_are_named(kind, change, cases, where, named):
    with pytest.raises(AssertionError, match=rf"(?s){kind} for .*{where}.*That is exactly what you get when {named}"):
        check_model_states(_with(kind, change), kind, cases=cases)


def test_common_activation_mistakes_are_named():
    answers = _solution()

    def relu_twice(sizes, batch_size, activation, mixed):
        return answers["activation_bytes"](sizes, batch_size, "gelu" if activation == "relu" else activation, mixed)

    with pytest.raises(AssertionError, match=r"That is exactly what you get when you count two tensors per hidden "
                                             r"width, but ReLU computes its gradient from its output, and the next "
                                             r"Linear saves that same tensor"):
        check_activations(relu_twice, cases=("relu",))

    def no_input(sizes, batch_size, activation, mixed):
        return answers["activation_bytes"](sizes, batch_size, activation, mixed) - batch_size * 4 * sizes[0]

    with pytest.raises(AssertionError, match=r"That is exactly what you get when you leave out the input x, which "
                                             r"the first Linear saves"):
        check_activations(no_input, cases=("relu",))


def test_master_weights_left_out_of_the_optimizer_states_are_named():
    answers = _solution()

    def master_outside(sizes, optimizer, mixed):
        states = answers["model_state_bytes"](sizes, optimizer, mixed)
        states["optimizer_states"] -= states["master_weights"]        # what optimizer.state holds, not ZeRO's K
        return states

    check_model_states(master_outside, "optimizer_states", cases=("fp32",))
    with pytest.raises(AssertionError, match=r"'sgd': you predicted 0 bytes, the measured step holds 3,668; "
                                             r"yours is 3,668 too low, which is 4 bytes per parameter\. .*you left "
                                             r"out the master weights: in mixed precision the optimizer steps an "
                                             r"fp32 master copy"):
        check_model_states(master_outside, "optimizer_states", cases=("mixed",))


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


# --------------------------------------------------------------------------- #
# The course's measurements refuse to run inside the checks
# --------------------------------------------------------------------------- #
def measured_states(sizes, optimizer, mixed):
    """Measures a real step with the course's measure_step instead of counting."""
    optimizers = {"sgd": torch.optim.SGD, "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                  "adam": torch.optim.Adam}
    step = measure_step(MLP(sizes), regression_batch(4, sizes[0], sizes[-1]), torch.nn.functional.mse_loss,
                        optimizers[optimizer], mixed_dtype=torch.bfloat16 if mixed else None)
    return {kind: getattr(step, kind) for kind in ("params", "grads", "master_weights", "optimizer_states")}


def predicted_states(sizes, optimizer, mixed):
    """Asks the course's predict_step."""
    step = predict_step(MLP(sizes), optimizer=optimizer, mixed=mixed)
    return {kind: getattr(step, kind) for kind in ("params", "grads", "master_weights", "optimizer_states")}


def saved_activations(sizes, batch_size, activation, mixed):
    """Counts a real forward with the course's SavedTensors."""
    model = MLP(sizes)
    with SavedTensors(model) as saved:
        model(torch.randn(batch_size, sizes[0]))
    return saved.nbytes


def predicted_activations(sizes, batch_size, activation, mixed):
    """Asks the course's mlp_activation_bytes."""
    return mlp_activation_bytes(sizes, batch_size, dtype=torch.bfloat16 if mixed else torch.float32)


@pytest.mark.parametrize("check, answer, what", [
    (lambda fn: check_model_states(fn, "params"), measured_states, "measure_step"),
    (lambda fn: check_model_states(fn, "optimizer_states"), predicted_states, "predict_step"),
    (lambda fn: check_activations(fn), saved_activations, "SavedTensors"),
    (lambda fn: check_activations(fn), predicted_activations, "mlp_activation_bytes"),
])
def test_the_course_measurements_are_refused_inside_the_checks(check, answer, what):
    with pytest.raises(AssertionError, match=rf"{answer.__name__} failed in case 'relu'|{answer.__name__} failed in "
                                             rf"case 'fp32'") as error:
        check(answer)
    assert (f"ReferenceRefused: dtcourse.memory.{what} is the course's own answer to exercise 00, and it refuses to "
            "run while that exercise's checks run" in str(error.value)), str(error.value)
    answer((12, 24, 5), 4, "relu", False) if "activations" in answer.__name__ else answer((12, 24, 5), "adam", False)

