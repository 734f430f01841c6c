"""Exercise 12 (a snapshot's save and load): the released notebook, its checks, and what they refuse.

The checks test the algorithm, not only the answer: the round trip names the first tensor (parameter, buffer,
optimizer entry) or generator that does not come back; the atomic check watches how the file reaches its name
(audit events) and kills the process part-way through a save, so a snapshot written in place, one renamed from
another directory or before it was whole, an old snapshot deleted first, or an error swallowed each fail with the
message that says which; the size check weighs the file against the model's and the optimizer's state and names
gradients or pickled modules in it; the resume check kills a rank of a real DDP run, restarts every rank, and names
the first step and the first tensor or generator where the resumed run differs from the one that never stopped,
with the cause (a generator or the optimizer not restored, a step off by one, a save that draws a number, ranks
resuming from different steps). A deadlock fails after the timeout; the course's own snapshots are refused.
Everything here calls the checks directly; full marks for the solution and zero for the untouched exercise are
checked with every exercise's, in ``test_grading.py``. Run just these with
``pytest -q tests/test_fault_tolerance_exercise.py``, and everything about this exercise with
``pytest -q tests -k "12_fault_tolerance_snapshot or test_fault_tolerance_exercise"``.

The functions handed to the checks are compiled from the notebook's cells under this file's name, some with a line
changed: to the checks, they are a student's code.
"""

from __future__ import annotations

import time

import pytest

from dtcourse import checks
from dtcourse.checks.guard import course_answer
from dtcourse.fault_tolerance import snapshot
from exercise_harness import EXPECTED, assert_released, compile_answers, solution_code

NAME = "12_fault_tolerance_snapshot"
BOTH = ("small", "large")


def _answer(**edits: list[tuple[str, str]]) -> tuple:
    """The solution's save and load with each ``(old, new)`` of ``edits[cell]`` replaced, compiled under this name."""
    namespace = compile_answers(NAME, ("save", "load"), edits, __file__, __name__)
    return namespace["save_snapshot"], namespace["load_snapshot"]


SOLUTION = _answer()
_SAVE = solution_code(NAME)["save"]
_WRITE = _SAVE[_SAVE.index("    with open(tmp"):_SAVE.index("\n", _SAVE.index("    os.replace(tmp, path)"))]  # write, rename

# --------------------------------------------------------------------------- #
# Wrong answers, each a student's plausible mistake (a line or two of the solution changed)
# --------------------------------------------------------------------------- #
NO_GENERATORS = _answer(load=[('    set_rng_state(state["rng"])\n', "")])
NO_NUMPY = _answer(load=[('    np.random.set_state(state["numpy"])\n', "")])
NO_OPTIMIZER = _answer(load=[('    optimizer.load_state_dict(state["optimizer"])\n', "")])
PLUS_ONE = _answer(load=[('return state["step"]', 'return state["step"] + 1')])
MINUS_ONE = _answer(load=[('return state["step"]', 'return state["step"] - 1')])
PARAMETERS_ONLY = _answer(save=[('"model": model.state_dict(),', '"model": dict(model.named_parameters()),')],
                          load=[('model.load_state_dict(state["model"])',
                                 'model.load_state_dict(state["model"], strict=False)')])
STEP_ZERO_IS_NOTHING = _answer(load=[('return state["step"]', 'return state["step"] or None')])
DRAWS_A_NUMBER = _answer(save=[('    state = {\n', '    random.shuffle(order := [0, 1, 2])\n    state = {\n')])
RAISES_WITHOUT_A_SNAPSHOT = _answer(load=[("    if not path.exists():\n        return None", "")])
ONLY_RANK_0_SAVES = _answer(save=[("    tmp = path.with_name", "    import torch.distributed as dist\n"
                                                           "    if dist.get_rank() != 0:\n        return\n"
                                                           "    tmp = path.with_name")])
SLOW_SAVES_BUT_RANK_0 = _answer(save=[("    tmp = path.with_name", "    import torch.distributed as dist\n"
                                                               "    if dist.get_rank() != 0:\n"
                                                               "        __import__('time').sleep(0.5)\n"
                                                               "    tmp = path.with_name")])
IN_PLACE = _answer(save=[("    atomic_write(path, buffer.getvalue())", "    path.write_bytes(buffer.getvalue())")])
ANOTHER_DIRECTORY = _answer(save=[('path.with_name(f".{path.name}.tmp-{os.getpid()}")',
                                   'Path(__import__("tempfile").mkdtemp()) / path.name')])
DELETES_FIRST = _answer(save=[("    tmp = path.with_name",
                                "    path.unlink(missing_ok=True)\n    tmp = path.with_name")])
SWALLOWS_ERRORS = _answer(save=[(_WRITE, "    try:\n        tmp.write_bytes(data)\n        os.replace(tmp, path)\n"
                                         "    except Exception:\n        pass")])
RENAMES_BEFORE_CLOSING = _answer(save=[(_WRITE, "    with open(tmp, 'wb') as f:\n        f.write(data[:-100])\n"
                                                "        f.write(data[-100:])\n        os.replace(tmp, path)")])
WITH_GRADIENTS = _answer(save=[('        "step": step,', '        "step": step,\n'
                                                        '        "grads": [p.grad for p in model.parameters()],')])
WHOLE_MODULE = _answer(save=[('"model": model.state_dict(),', '"model": model,')],
                       load=[('model.load_state_dict(state["model"])',
                              'model.load_state_dict(state["model"].state_dict())')])
WAITS_FOR_RANK_0 = _answer(save=[("    tmp = path.with_name", "    import torch.distributed as dist\n"
                                                          "    if dist.get_rank() == 0:\n        dist.barrier()\n"
                                                          "    tmp = path.with_name")])
USES_THE_COURSE_WRITER = _answer(save=[(_WRITE, "    from dtcourse.fault_tolerance.snapshot import _atomic_write\n"
                                                "    _atomic_write(path, data)")])
CALLS_THE_COURSE = _answer(save=[('    state = {\n', '    from dtcourse.fault_tolerance import rng_state\n'
                                                  '    generators = rng_state()\n    state = {\n')])


def course_save(path, step, model, optimizer):
    """The course's Snapshots, one folder per save: refused."""
    snapshot.Snapshots(path.parent).save(step, model, optimizer)


# --------------------------------------------------------------------------- #
# The released notebook, the solution, and the course's own snapshots
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["os.replace(tmp, path)", "np.random.set_state(", "optimizer.load_state_dict(",
                                  'cases=("large",)'],
                    stubs={"save": 3, "load": 2},
                    given={"save": ["def save_snapshot(path: Path, step: int, model: nn.Module, optimizer: "
                                    "torch.optim.Optimizer) -> None:"],
                           "load": ["def load_snapshot(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) "
                                    "-> int | None:"],
                           "setup": ["import numpy as np", "import random", "from pathlib import Path"]})
    assert EXPECTED[NAME].points == 10


def test_the_solution_passes_every_check_hidden_cases_included():
    checks.check_snapshot_round_trip(*SOLUTION, cases=BOTH)
    checks.check_snapshot_atomic(*SOLUTION, cases=BOTH)
    checks.check_snapshot_resume(*SOLUTION, cases=BOTH)
    report = checks.check_snapshot_size(*SOLUTION)
    assert "your snapshot of a GPT of 133,888 parameters after one AdamW step is " in report, report
    assert "the model's state 535,552 B + the optimizer's 1,071,220 B (two moments and a step count per parameter)" \
           in report, report


def test_the_course_snapshots_are_listed_and_refused():
    for obj in (snapshot.Snapshots.save, snapshot.Snapshots.restore, snapshot.rng_state, snapshot.set_rng_state):
        assert course_answer(obj) == ("fault_tolerance", "12"), obj
    with pytest.raises(AssertionError, match=r"was given dtcourse\.fault_tolerance\.snapshot\.Snapshots\.save, the "
                                             r"course's own answer to exercise 12"):
        checks.check_snapshot_round_trip(snapshot.Snapshots.save, SOLUTION[1])
    with pytest.raises(AssertionError, match=r"failed in case 'small', a GPT with dropout and AdamW after 3 steps, "
                                             r"saved as step 3: it raised ReferenceRefused: dtcourse\.fault_tolerance\."
                                             r"snapshot\.Snapshots\.save is the course's own answer to exercise 12"):
        checks.check_snapshot_round_trip(course_save, SOLUTION[1])
    with pytest.raises(AssertionError, match=r"rank \d raised ReferenceRefused: dtcourse\.fault_tolerance\.snapshot\."
                                             r"rng_state is the course's own answer to exercise 12"):
        checks.check_snapshot_resume(*CALLS_THE_COURSE)
    assert course_answer(snapshot._atomic_write) == ("fault_tolerance", "12")
    with pytest.raises(AssertionError, match=r"raised ReferenceRefused: dtcourse\.fault_tolerance\.snapshot\._atomic_write "
                                             r"is the course's own answer to exercise 12"):
        checks.check_snapshot_round_trip(*USES_THE_COURSE_WRITER)


# --------------------------------------------------------------------------- #
# The round trip: each tensor and generator named
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("answer, complaint, cases", [
    (NO_GENERATORS, r"after load_snapshot\(path, model, optimizer\), the next torch\.rand\(4\) is \[[\d., ]+\], where "
                    r"right after the save it was \[[\d., ]+\]: load_snapshot did not restore torch's generator", BOTH),
    (NO_NUMPY, r"the next numpy\.random\.rand\(2\) is .*: load_snapshot did not restore NumPy's global generator",
     BOTH),
    (NO_OPTIMIZER, r"into a fresh model and optimizer, the optimizer holds no state at all, where the original's "
                   r"holds 'step', 'exp_avg', 'exp_avg_sq' for each of 29 parameters: save optimizer\.state_dict\(\)",
     BOTH),
    (PLUS_ONE, r"load_snapshot\(path, model, optimizer\) returned 4, but the snapshot was saved as step 3: return the "
               r"step save_snapshot was given, as it was given \(you added one", BOTH),
    (DRAWS_A_NUMBER, r"save_snapshot\(path, 3, model, optimizer\) moved Python's random \(random\.getstate / "
                     r"random\.setstate\): it drew a number from it or seeded it", BOTH),
    (RAISES_WITHOUT_A_SNAPSHOT, r"load_snapshot on a path where nothing was saved yet raised FileNotFoundError: .* "
                                r"return None, and the run starts at step 0", BOTH),
    (PARAMETERS_ONLY, r"case 'large', an MLP with BatchNorm and SGD with momentum after 2 steps, saved as step 41:\n  "
                      r"after load_snapshot.*, the model's '1\.running_mean' differs from the original's by up to "
                      r"[\d.e-]+: save model\.state_dict\(\) \(the parameters and the buffers", ("large",)),
    (STEP_ZERO_IS_NOTHING, r"saved as step 0:\n  load_snapshot\(path, model, optimizer\) returned None \(NoneType\); "
                           r"the snapshot was saved as step 0", ("large",)),
])
def test_the_round_trip_names_the_first_tensor_or_generator_missing(answer, complaint, cases):
    with pytest.raises(AssertionError, match=complaint):
        checks.check_snapshot_round_trip(*answer, cases=cases)


def test_mistakes_only_the_hidden_round_trip_sees_pass_the_visible_one():
    checks.check_snapshot_round_trip(*PARAMETERS_ONLY)          # a GPT has no buffers in its state_dict
    checks.check_snapshot_round_trip(*STEP_ZERO_IS_NOTHING)     # the visible snapshot is of step 3


# --------------------------------------------------------------------------- #
# Atomic: watched, and killed part-way
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("answer, complaint", [
    (IN_PLACE, r"save_snapshot\(path, 15, \.\.\.\) was killed half-way through writing, and afterwards rank-0\.pt is "
               r"cut short: \d+ B of a \d+ B snapshot, and it does not load \(\w+: .*\)\. The snapshot of step "
               r"10 is lost.*\n  what the check saw of your save before: save_snapshot\(path, 10, model, optimizer\) "
               r"never renamed a finished file onto rank-0\.pt: it wrote rank-0\.pt in place"),
    (ANOTHER_DIRECTORY, r"save_snapshot\(path, 20, model, optimizer\) renamed /\S+/rank-0\.pt onto rank-0\.pt, from "
                        r"another directory: a rename is atomic only within one file system"),
    (DELETES_FIRST, r"was killed half-way through writing, and afterwards there is no rank-0\.pt at all: the snapshot "
                    r"of step 10 was deleted before the new one was whole"),
    (SWALLOWS_ERRORS, r"save_snapshot\(path, 1, model, optimizer\) with path = \S+/a-file/rank-0\.pt \(inside a file, "
                      r"where nothing can be written\) returned without an error"),
    (RENAMES_BEFORE_CLOSING, r"when save_snapshot\(path, 20, model, optimizer\) renamed \.rank-0\.pt\.tmp-\d+ onto "
                             r"rank-0\.pt, that file held (\d+) B of the \d+ B it ended with: the rest was written "
                             r"after the rename"),
])
def test_a_save_that_is_not_atomic_is_named(answer, complaint):
    with pytest.raises(AssertionError, match=r"save_snapshot and load_snapshot fail the atomic check \(a save killed "
                                             r"half-way through writing its file\):\n  " + r"(.|\n)*" + complaint):
        checks.check_snapshot_atomic(*answer)


def test_the_hidden_kills_start_after_the_first_kilobyte():
    with pytest.raises(AssertionError, match=r"\(saves killed after 1 KB, 100 bytes before the end, and as the file "
                                             r"is renamed\):\n  save_snapshot\(path, 15, \.\.\.\) was killed "
                                             r"after writing its first kilobyte, and afterwards rank-0\.pt is cut "
                                             r"short: 1024 B of a"):
        checks.check_snapshot_atomic(*IN_PLACE, cases=("large",))


# --------------------------------------------------------------------------- #
# What the file holds
# --------------------------------------------------------------------------- #
def test_gradients_and_pickled_modules_in_the_file_are_named():
    with pytest.raises(AssertionError) as info:
        checks.check_snapshot_size(*WITH_GRADIENTS)
    message = str(info.value)
    assert "is 2,1" in message and "That is 5" in message and "B more than the model's and the optimizer's state, " \
           "where generator states and the format take under 64 KB; what it holds, by key: 'step' 0 B, 'grads' " \
           "535,552 B, 'model' 535,552 B, 'optimizer' 1,071,220 B, 'rng' 5,056 B" in message, message
    with pytest.raises(AssertionError, match=r"the file holds an object of class GPT, pickled whole: save "
                                             r"state_dict\(\)s"):
        checks.check_snapshot_size(*WHOLE_MODULE)
    checks.check_snapshot_round_trip(*WITH_GRADIENTS)         # the right tensors come back: only the size tells


# --------------------------------------------------------------------------- #
# Kill a rank, restart, resume: the first step and tensor that differ
# --------------------------------------------------------------------------- #
def _resume_fails(answer, cases=("small",), **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        checks.check_snapshot_resume(*answer, cases=cases, **kwargs)
    return str(info.value)


def test_generators_not_restored_make_the_losses_differ_from_the_first_resumed_step():
    message = _resume_fails(NO_GENERATORS)
    assert "are wrong on 2 ranks in case 'small' (2 ranks, snapshots every 2 steps, rank 1 raising at step 5):" \
           in message, message
    assert "rank 0: after rank 1 raised at step 5 and every rank restarted, the run resumed from step 4, and the " \
           "loss of step 4 is " in message and "(the first step after the restart)" in message, message
    assert "Right after load_snapshot, torch's generator (torch.get_rng_state / torch.set_rng_state) is not where it " \
           "was at step 4: the dropout masks and batches drawn after the restart differ" in message, message


def test_the_optimizer_not_restored_leaves_the_first_loss_right_and_the_parameters_wrong():
    message = _resume_fails(NO_OPTIMIZER)
    assert "the run resumed from step 4, and the loss of step 5 is " in message, message
    assert "; after the last step, the model's 'wte.weight' differs from the uninterrupted run's by up to " in message
    assert "Right after load_snapshot, the optimizer holds no state at all, where the uninterrupted run's holds " \
           "'step', 'exp_avg', 'exp_avg_sq' for each of 29 parameters at step 4: step 4's loss can still match, but " \
           "its update differs" in message, message


@pytest.mark.parametrize("answer, what", [
    (PLUS_ONE, "load_snapshot returned 5, but the last snapshot before the failure was save_snapshot(path, 4, model, "
               "optimizer): step 4 was skipped"),
    (MINUS_ONE, "load_snapshot returned 3, but the last snapshot before the failure was save_snapshot(path, 4, model, "
                "optimizer): step 3 ran twice")])
def test_a_step_off_by_one_repeats_or_skips_a_step(answer, what):
    assert what in _resume_fails(answer)


def test_a_save_that_changes_the_run_is_caught_before_any_failure():
    message = _resume_fails(DRAWS_A_NUMBER)
    assert "rank 1: before any failure, the loss of step 2 is " in message, message
    assert "the only difference is your save_snapshot" in message, message


def test_ranks_that_resume_from_different_steps_are_stopped_before_they_deadlock():
    message = _resume_fails(ONLY_RANK_0_SAVES)
    assert "after restart 1, the ranks' load_snapshot returned different steps (rank 0: 4, rank 1: None): every rank " \
           "saves and loads its own file" in message, message


def test_where_the_ranks_resume_does_not_depend_on_which_saved_last():
    # in case 'large' rank 0 dies as step 9 starts, right after the snapshot of step 9: ranks slower to save must
    # have saved theirs too by then, or they would resume from step 6 while rank 0 resumes from 9
    checks.check_snapshot_resume(*SLOW_SAVES_BUT_RANK_0, cases=("large",))


def test_the_hidden_run_kills_three_ranks_twice_by_sigkill():
    message = _resume_fails(NO_NUMPY, cases=("large",))
    assert "in case 'large' (3 ranks, snapshots every 3 steps, rank 2 killed by SIGKILL at step 7, then rank 0 at " \
           "step 9):" in message, message
    assert "rank 2: after rank 2 was killed by SIGKILL at step 7 and every rank restarted, the run resumed from step " \
           "6" in message and "NumPy's global generator" in message, message


def test_a_deadlock_fails_after_the_timeout_and_names_where():
    start = time.monotonic()
    message = _resume_fails(WAITS_FOR_RANK_0, timeout=3)
    assert "did not finish on 2 ranks within 3 s (each attempt): rank 0 in attempt 0, save_snapshot(path, 2, model, " \
           "optimizer)" in message, message
    assert time.monotonic() - start < 20


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_snapshot_atomic(*SOLUTION, cases=("huge",))
    with pytest.raises(TypeError, match="pass your function or class itself"):
        checks.check_snapshot_resume(SOLUTION[0], 3)
