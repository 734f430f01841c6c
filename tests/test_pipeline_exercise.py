"""Exercise 08 (the 1F1B schedule as data): the released notebook, its checks, and what they refuse.

The checks test the algorithm, not only the answer: GPipe's order and a warm-up one forward too long
both run, so they pass the validator, but fail the order check (named by rank, step and phase, with
the actions expected and found and the mistake) and the run on real ranks, where the executor measures
more than p - r micro-batches held on rank r. A backward before its forward, a missing cool-down, an
uncapped warm-up for m < p and a deadlock each fail with the validator's rank and step and a hint;
a loop that never ends fails after the timeout; the course's own ``one_f_one_b`` (and torch's
``Schedule1F1B`` order) are refused. Everything here calls the checks directly (each launch forks its
ranks in well under a second); full marks for the solution and zero for the untouched exercise are
checked with every exercise's, in ``test_grading.py``. Run just these with
``pytest -q tests/test_pipeline_exercise.py``, and everything about this exercise with
``pytest -q tests -k "08_pipeline_1f1b or test_pipeline_exercise"``.

The functions handed to the checks are defined in this file (or compiled from the notebook's cells
under this file's name): to the checks, they are a student's code.
"""

from __future__ import annotations

import inspect
import re
import time

import pytest

from dtcourse import checks
from dtcourse.checks.guard import course_answer
from dtcourse.pipeline import Action, schedules
from exercise_harness import EXPECTED, assert_released, grade_answers, nbgrader_cells, solution_code, source_path

NAME = "08_pipeline_1f1b"


def _notebook() -> dict:
    """The solution's function, compiled under this file's name: the checks take it for a student's."""
    cells, answers = nbgrader_cells(source_path(NAME)), solution_code(NAME)
    namespace: dict = {"__name__": __name__}
    exec(compile("\n\n".join([cells["setup"], answers["one_f_one_b"]]), __file__, "exec"), namespace)
    return namespace


one_f_one_b = _notebook()["one_f_one_b"]


# --------------------------------------------------------------------------- #
# Wrong answers, each a student's plausible mistake
# --------------------------------------------------------------------------- #
def _1f1b(warmup, steady="FB", cooldown=True, cap=True, step=True):
    """A 1F1B generator with the given warm-up count per (p, r), steady pair order, cool-down, cap and step."""
    def generate(p, m):
        out = {}
        for r in range(p):
            w = min(warmup(p, r), m) if cap else warmup(p, r)
            ops = [Action(r, "F", j) for j in range(w)]
            for j in range(m - w):
                pair = {"F": Action(r, "F", w + j), "B": Action(r, "B", j)}
                ops += [pair[steady[0]], pair[steady[1]]]
            if cooldown:
                ops += [Action(r, "B", j) for j in range(m - w, m)]
            out[r] = ops + [Action(r, "STEP")] * step
        return out
    return generate


warm_up_p_minus_r = _1f1b(lambda p, r: p - r)
backward_first = _1f1b(lambda p, r: p - 1 - r, steady="BF")
no_cool_down = _1f1b(lambda p, r: p - 1 - r, cooldown=False)
uncapped = _1f1b(lambda p, r: p - 1 - r, cap=False)          # m < p: Action(r, "B", -1) raises
warm_up_r = _1f1b(lambda p, r: r)                             # the wrong way round: a deadlock
no_step = _1f1b(lambda p, r: p - 1 - r, step=False)            # valid (torch's kind), but not the whole step
no_warm_up = _1f1b(lambda p, r: 0)                            # valid, holds one micro-batch, idles most of the step
NO_WARM_UP = """def one_f_one_b(p: int, m: int) -> dict[int, list[Action]]:
    out = {}
    for r in range(p):
        ops = []
        for j in range(m):
            ops += [Action(r, "F", j), Action(r, "B", j)]
        out[r] = ops + [Action(r, "STEP")]
    return out
"""


def gpipe_order(p, m):
    return {r: [Action(r, "F", j) for j in range(m)] + [Action(r, "B", j) for j in range(m)] + [Action(r, "STEP")]
            for r in range(p)}


def step_first(p, m):
    return {r: [Action(r, "STEP")] + acts[:-1] for r, acts in one_f_one_b(p, m).items()}


def uncapped_forwards(p, m):
    """Warm-up forwards never capped, the rest guarded: forwards of micro-batches that do not exist."""
    out = {}
    for r in range(p):
        w = p - 1 - r
        ops = [Action(r, "F", j) for j in range(w)]
        for j in range(max(0, m - w)):
            ops += [Action(r, "F", w + j), Action(r, "B", j)]
        out[r] = ops + [Action(r, "B", j) for j in range(max(0, m - w), m)] + [Action(r, "STEP")]
    return out


def strings(p, m):
    return {r: [str(a) for a in acts] for r, acts in one_f_one_b(p, m).items()}


def forgets_the_return(p, m):
    one_f_one_b(p, m)


def never_ends(p, m):
    while True:
        pass


def calls_the_course(p, m):
    return schedules.one_f_one_b(p, m)


def asks_torch(p, m):
    from torch.distributed.pipelining.schedules import Schedule1F1B
    return Schedule1F1B._get_pipeline_order(None)


# --------------------------------------------------------------------------- #
# The released notebook, and the solution
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["warmup = min(p - 1 - r, m)", 'cases=("large",)'],
                    stubs={"one_f_one_b": 1},
                    given={"one_f_one_b": ["def one_f_one_b(p: int, m: int) -> dict[int, list[Action]]:"],
                           "setup": ["from dtcourse.pipeline import Action"]})
    assert EXPECTED[NAME].points == 10


def test_the_solution_passes_every_check_hidden_cases_included():
    for check in (checks.check_1f1b_valid, checks.check_1f1b_order, checks.check_1f1b_run):
        check(one_f_one_b, cases=("small", "large"))


def test_the_course_generator_is_listed_and_still_reads_as_itself():
    assert course_answer(schedules.one_f_one_b) == ("pipeline", "08")
    assert "warmup = min(p - 1 - r, m)" in inspect.getsource(schedules.one_f_one_b)
    assert schedules.one_f_one_b(2, 3)[0] == [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0),
                                                Action(0, "F", 2), Action(0, "B", 1), Action(0, "B", 2),
                                                Action(0, "STEP")]


# --------------------------------------------------------------------------- #
# Valid but not 1F1B: the order check and the run on real ranks
# --------------------------------------------------------------------------- #
def test_a_warm_up_of_p_minus_r_runs_but_fails_order_and_memory():
    checks.check_1f1b_valid(warm_up_p_minus_r, cases=("small", "large"))
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_order(warm_up_p_minus_r)
    message = str(info.value)
    assert "one_f_one_b(4, 8), rank 0, step 4 (steady state): expected 0B0, found 0F4." in message, message
    assert "1F1B on rank 0: warm-up steps 0-2 (min(p-1-r, m) = 3 forwards), steady state steps 3-12 " \
           "(F then B, 5 pairs), cool-down steps 13-15 (3 backwards), the optimizer step at step 16." in message, message
    assert "yours:    [0F0, 0F1, 0F2, 0F3, 0F4, 0B0, 0F5," in message, message
    assert "Yours holds up to 5 micro-batches of activations on rank 0 (1F1B: min(p-r, m) = 4)" in message, message
    assert "hint: your warm-up runs p-r forwards on rank r, one too many" in message, message
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_run(warm_up_p_minus_r)
    message = str(info.value)
    assert "is wrong on 2 ranks in one_f_one_b(2, 4)" in message, message
    assert "rank 0: stage 0 held the activations of 3 micro-batches at once (measured by the executor); 1F1B " \
           "holds at most min(p-r, m) = min(2, 4) = 2 on rank 0" in message, message
    assert "rank 1: stage 1 held the activations of 2 micro-batches at once" in message, message


def test_a_schedule_without_warm_up_holds_little_but_idles_and_scores_under_half(tmp_path):
    checks.check_1f1b_valid(no_warm_up)                    # it can run: one micro-batch at a time
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_order(no_warm_up)
    assert "hint: your schedule has no warm-up" in str(info.value), str(info.value)
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_run(no_warm_up)
    message = str(info.value)
    # 2 ranks, m = 4: each micro-batch goes through both stages and back before the next, 3 of 6 units per rank idle
    assert "its ranks idle 0.500 of the step in simulation, where 1F1B idles (p-1)/(m+p-1) = 0.200 " \
           "(one_f_one_b(2, 4))" in message, message
    assert "hint: your schedule has no warm-up" in message and "rank 1:" not in message, message
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), one_f_one_b=NO_WARM_UP))
    assert report.score == 3 < EXPECTED[NAME].points / 2, str(report)     # part 1 only: it can run


def test_a_table_of_the_listed_cases_fails_the_pairs_drawn_as_the_check_runs():
    from dtcourse.checks.pipeline import SCHEDULE_CASES
    table = {pair: schedules.one_f_one_b(*pair) for _, pairs in SCHEDULE_CASES.values() for pair in pairs}

    def from_table(p, m):                      # every listed case answered from the table, anything else guessed
        return table.get((p, m)) or gpipe_order(p, m)

    checks.check_1f1b_order(from_table)        # the visible cases
    # GPipe's order differs from 1F1B's on the last rank for every m > 1: only six draws of m = 1 could pass
    with pytest.raises(AssertionError, match=r"6 pairs drawn as the check runs\):\n  one_f_one_b\(\d+, \d+\), "
                                             r"rank \d+, step \d+ \([a-z -]+\): expected"):
        checks.check_1f1b_order(from_table, cases=("large",))


WHOLE_RANGE_TABLE = '''
from dtcourse.pipeline import schedules as course
TABLE = {(p, m): course.one_f_one_b(p, m) for p in range(1, 13) for m in range(1, 41)}   # before any check runs


def one_f_one_b(p: int, m: int) -> dict[int, list[Action]]:
    return TABLE[(p, m)]
'''


def test_a_table_of_every_drawable_pair_passes_but_is_flagged_with_its_cell(tmp_path):
    """The course's generator run before the checks start is not switched off, and a table of the whole range the
    checks draw from answers every pair: the points stand, and the grader lists the cell for the instructor."""
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), one_f_one_b=WHOLE_RANGE_TABLE))
    assert report.exit_code == 1, str(report)
    uses = [line for line in report.flagged if "uses dtcourse.pipeline.schedules.one_f_one_b, the course's own answer "
            "to exercise 08" in line]
    assert len(uses) == 1 and "(the cell that begins 'from dtcourse.pipeline import schedules as course'), line 3" \
        in uses[0], report.flagged
    assert "Flagged for the instructor" in str(report)


def test_a_student_who_names_no_answer_is_not_flagged(tmp_path):
    from dtcourse.grading.uses import answer_uses
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(solution_code(NAME)["one_f_one_b"]),
                                         nbformat.v4.new_code_cell("from dtcourse.pipeline import validate, simulate\n"
                                                                   "import dtcourse.pipeline.schedules as s\n"
                                                                   "s.gpipe(3, 4)")])
    assert answer_uses(nb, "08") == []
    nb.cells.append(nbformat.v4.new_code_cell("x = s.build('1f1b', 3, 4)\ny = s.SCHEDULES['1f1b']"))
    found = [str(f) for f in answer_uses(nb, "08")]
    assert len(found) == 2 and "uses dtcourse.pipeline.schedules.build, which reaches dtcourse.pipeline.schedules." \
        "one_f_one_b" in found[0] and "uses dtcourse.pipeline.schedules.SCHEDULES" in found[1], found


def test_gpipe_order_runs_but_holds_every_micro_batch():
    checks.check_1f1b_valid(gpipe_order)
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_order(gpipe_order)
    message = str(info.value)
    assert "one_f_one_b(4, 8), rank 0, step 4 (steady state): expected 0B0, found 0F4." in message, message
    assert "Yours holds up to 8 micro-batches of activations on rank 0 (1F1B: min(p-r, m) = 4) and its simulated " \
           "bubble is 0.273 (1F1B: (p-1)/(m+p-1) = 0.273)" in message, message
    assert "hint: that is GPipe's order" in message, message
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_run(gpipe_order)
    message = str(info.value)                         # a hint every rank repeats is printed once, on the first rank
    assert re.search(r"rank 0: stage 0 held .*\n.*hint: that is GPipe's order.*\n  rank 1: stage 1 held the activations "
                     r"of 4 micro-batches at once .*min\(1, 4\) = 1 on rank 1.*\n    hint: the same as rank 0's, above",
                     message), message


def test_a_schedule_without_its_step_runs_but_is_not_the_whole_training_step():
    checks.check_1f1b_valid(no_step)                       # torch's schedules leave the step out too
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_order(no_step)
    message = str(info.value)
    assert "one_f_one_b(4, 8), rank 0, step 16 (the optimizer step): expected 0STEP, found the end of the list." \
        in message, message
    assert "hint: your lists end without the optimizer step" in message, message
    with pytest.raises(AssertionError, match=r"rank 0: stage 0's optimizer step ran 0 times: end rank 0's list with "
                                             r"Action\(0, 'STEP'\), once.*\n.*hint: your lists end without"):
        checks.check_1f1b_run(no_step)


def test_a_step_before_the_backwards_cannot_run():
    for check in (checks.check_1f1b_valid, checks.check_1f1b_run):
        with pytest.raises(AssertionError, match=r"one_f_one_b\(\d, \d\) cannot run: rank 0, step 0: 0STEP updates "
                                                 r"stage 0's weights before 0B0"):
            check(step_first)


# --------------------------------------------------------------------------- #
# Schedules that cannot run: the validator's rank and step, and the mistake
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("fn, complaint", [
    (backward_first, r"one_f_one_b\(4, 8\) cannot run: rank 3, step 0: 3B0 needs 3F0 \(the activation from stage 3\), "
                     r"which comes later on rank 3 \(step 1\); swap them\.\n    hint: in your steady state the "
                     r"backward comes before the forward"),
    (no_cool_down, r"one_f_one_b\(4, 8\) cannot run: stage 0 never runs 0B5 .*: add it to rank 0's list\.\n    "
                   r"hint: your schedule has no cool-down"),
    (warm_up_r, r"one_f_one_b\(4, 8\) cannot run: deadlock, no rank can proceed: rank 0, step 1: 0B0 needs 1B0 "
                r".*\n    hint: your warm-up runs r forwards on rank r, the wrong way round"),
    (uncapped, r"one_f_one_b\(4, 2\) raised ValueError: Action: stage and micro-batch are indices >= 0, got 0 and -1"
               r"\.\n(.*\n)*    hint: with m = 2 micro-batches and p = 4 ranks, rank 0's warm-up p-1-r = 3 is more "
               r"than the m = 2 micro-batches there are: cap it, min\(p-1-r, m\)"),
    (uncapped_forwards, r"one_f_one_b\(4, 2\) cannot run: rank 0, step 2: 0F2 names stage 0 / micro-batch 2, but "
                        r"there are 4 stages and 2 micro-batches\.\n    hint: with m = 2 micro-batches and p = 4"),
])
def test_a_schedule_that_cannot_run_is_named_by_rank_and_step(fn, complaint):
    for check in (checks.check_1f1b_valid, checks.check_1f1b_order):
        with pytest.raises(AssertionError, match=complaint):
            check(fn)


def test_on_real_ranks_a_broken_schedule_is_not_run_and_the_cap_is_hinted():
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_run(no_cool_down)
    message = str(info.value)
    assert "one_f_one_b(2, 4) cannot run: stage 0 never runs 0B3" in message and "(not run on the ranks)" in message
    assert message.count("cannot run") == 1, message                     # rank 0 reports it, once
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_run(uncapped)
    message = str(info.value)
    assert "failed on 3 ranks in one_f_one_b(3, 1): rank" in message and "raised ValueError: Action:" in message
    assert "hint: with m = 1 micro-batches and p = 3 ranks, rank 0's warm-up p-1-r = 2 is more than" in message


# --------------------------------------------------------------------------- #
# Form, hangs, and the course's own answer
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("fn, complaint", [
    (strings, r"one_f_one_b\(4, 8\)\[0\]\[0\] is '0F0' \(str\), not an Action: build each one with "
              r"Action\(stage, kind, micro-batch\)"),
    (forgets_the_return, r"one_f_one_b\(4, 8\) returned NoneType None; .*\(did you forget the return\?\)"),
])
def test_the_wrong_form_is_named(fn, complaint):
    with pytest.raises(AssertionError, match=complaint):
        checks.check_1f1b_valid(fn)


def test_a_loop_that_never_ends_fails_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        checks.check_1f1b_valid(never_ends, timeout=3)
    message = str(info.value)
    assert "never_ends did not finish within 3 s" in message and "one_f_one_b(4, 8)" in message, message
    assert "Does a loop in it never end?" in message, message
    assert time.monotonic() - start < 20


def test_the_course_answer_and_torchs_order_are_refused():
    for check in (checks.check_1f1b_valid, checks.check_1f1b_order, checks.check_1f1b_run):
        with pytest.raises(AssertionError, match=r"was given dtcourse\.pipeline\.schedules\.one_f_one_b, the course's "
                                                 r"own answer to exercise 08"):
            check(schedules.one_f_one_b)
    with pytest.raises(AssertionError, match=r"rank \d raised ReferenceRefused: dtcourse\.pipeline\.schedules\."
                                             r"one_f_one_b is the course's own answer to exercise 08"):
        checks.check_1f1b_run(calls_the_course)
    with pytest.raises(AssertionError, match=r"it raised ReferenceRefused: torch's Schedule1F1B order is switched off"):
        checks.check_1f1b_order(asks_torch)


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_1f1b_valid(one_f_one_b, cases=("nope",))
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_1f1b_run(one_f_one_b, cases=("huge",))
