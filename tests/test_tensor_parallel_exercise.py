"""Exercise 09 (Megatron's f and g, column- and row-parallel layers): the released notebook, its checks, refusals.

The checks test the algorithm, not only the answer: each compares the student's layer with the serial
``nn.Linear`` on every rank and names the rank and the tensor (output, input gradient, weight or bias
gradient), and each counts the collectives the student's code starts, with their bytes and their process
group. A missing all-reduce in f's backward, an all-reduce in g's backward too, a split along the wrong
dimension, the row layer's bias added on every rank, a slice kept as a view of the full weight, an all-reduce
on the default group, or f's forward all-reducing (right numbers, wrong traffic) each fail with the message
that says which, each hint once however many ranks repeat the mistake; a deadlock fails after the timeout; the
course's own layers and operators are refused.
Everything here calls the checks directly (each launch forks its ranks in well under a second); full marks for
the solution and zero for the untouched exercise are checked with every exercise's, in ``test_grading.py``.
Run just these with ``pytest -q tests/test_tensor_parallel_exercise.py``, and everything about this exercise
with ``pytest -q tests -k "09_tensor_parallel_layers or test_tensor_parallel_exercise"``.

The functions and classes handed to the checks are compiled from the notebook's cells under this file's
name, some with a line changed: to the checks, they are a student's code.
"""

from __future__ import annotations

import inspect
import re
import time

import pytest

from dtcourse import checks
from dtcourse.checks import tensor_parallel as tp_checks
from dtcourse.checks.messages import hints_once
from dtcourse.checks.guard import course_answer
from dtcourse.tensor_parallel import communications, layers
from exercise_harness import EXPECTED, assert_released, compile_answers

NAME = "09_tensor_parallel_layers"
BOTH = ("small", "large")


def _answer(**edits: list[tuple[str, str]]) -> dict:
    """The solution's cells, each ``(old, new)`` of ``edits[cell]`` replaced, compiled under this file's name."""
    return compile_answers(NAME, ("f_and_g", "column", "row"), edits, __file__, __name__)


SOLUTION = _answer()
f, g = SOLUTION["copy_to_tensor_parallel"], SOLUTION["reduce_from_tensor_parallel"]
ColumnParallelLinear, RowParallelLinear = SOLUTION["ColumnParallelLinear"], SOLUTION["RowParallelLinear"]

# --------------------------------------------------------------------------- #
# Wrong answers, each a student's plausible mistake (one line of the solution changed)
# --------------------------------------------------------------------------- #
F_WITHOUT_ALL_REDUCE = _answer(f_and_g=[("        dist.all_reduce(grad, group=ctx.group)", "")])
G_ALL_REDUCES_BACKWARD = _answer(f_and_g=[
    ("        x = x.contiguous().clone()  #", "        ctx.group = group\n        x = x.contiguous().clone()  #"),
    ("        return grad, None  # every rank already", "        grad = grad.clone()\n"
                                                         "        dist.all_reduce(grad, group=ctx.group)\n"
                                                         "        return grad, None  #")])
F_FORWARD_ALL_REDUCES = _answer(f_and_g=[               # right numbers (x / t after the sum), twice the traffic
    ("        return x.view_as(x)  # every rank", "        x = x.clone()\n        dist.all_reduce(x, group=group)\n"
                                                  "        return x / dist.get_world_size(group)  #")])
F_FORWARD_SUMS = _answer(f_and_g=[("        return x.view_as(x)  # every rank", "        x = x.clone()\n"
                                                                            "        dist.all_reduce(x, group=group)\n"
                                                                            "        return x  #")])
DEFAULT_GROUP = _answer(f_and_g=[("dist.all_reduce(grad, group=ctx.group)", "dist.all_reduce(grad)"),
                                 ("dist.all_reduce(x, group=group)", "dist.all_reduce(x)")])
IN_PLACE_G = _answer(f_and_g=[("        x = x.contiguous().clone()  #", "        #")])
WRONG_DIMENSION = _answer(column=[                       # a row-parallel split in the column layer
    ("n = full.out_features // t", "n = full.in_features // t"),
    ("full.weight.detach()[r * n:(r + 1) * n].clone()", "full.weight.detach()[:, r * n:(r + 1) * n].clone()")])
A_VIEW = _answer(column=[("full.weight.detach()[r * n:(r + 1) * n].clone()",
                          "full.weight.detach()[r * n:(r + 1) * n]")])
KEEPS_THE_FULL_LAYER = _answer(column=[("        self.bias = nn.Parameter(", "        self.full = full\n"
                                                                            "        self.bias = nn.Parameter(")])
GATHERS_THE_OUTPUT = _answer(column=[("        return F.linear(x, self.weight, self.bias)  # (B, T, n_out/t)",
                                      "        y = F.linear(x, self.weight, self.bias)\n"
                                      "        parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]\n"
                                      "        dist.all_gather(parts, y, group=self.group)\n"
                                      "        return torch.cat(parts, dim=-1)")])
GLOBAL_RANK = _answer(column=[("t, r = dist.get_world_size(group), dist.get_rank(group)",
                               "t, r = dist.get_world_size(group), dist.get_rank()")])
BIAS_ON_EVERY_RANK = _answer(row=[("        y = F.linear(x, self.weight)  #",
                                   "        y = F.linear(x, self.weight, self.bias)  #"),
                                  ("        return y + self.bias  #", "        return y  #")])
NO_VALUE_ERROR = _answer(row=[("if full.in_features % t:", "if False:")])
DEADLOCK = _answer(f_and_g=[("        dist.all_reduce(x, group=group)", "        if dist.get_rank(group) == 0:\n"
                                                                        "            dist.all_reduce(x, group=group)")])
CALLS_THE_COURSE = _answer(column=[("        x = copy_to_tensor_parallel(x, self.group)",
                                    "        from dtcourse.tensor_parallel import copy_to_tensor_parallel\n"
                                    "        x = copy_to_tensor_parallel(x, self.group)")])
CALLS_ITS_FUNCTION = _answer(f_and_g=[("    return _CopyToTensorParallel.apply(x, group)",
                                       "    from dtcourse.tensor_parallel.communications import _CopyToTensorParallel\n"
                                       "    return _CopyToTensorParallel.apply(x, group)")])


class CourseColumn(layers.ColumnParallelLinear):
    """The course's layer under another name."""


# --------------------------------------------------------------------------- #
# The released notebook, the solution, and the course's own layers
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["dist.all_reduce(grad, group=ctx.group)", "y = reduce_from_tensor_parallel(y, self.group)",
                                  "full.weight.detach()[r * n:(r + 1) * n].clone()", 'cases=("large",)'],
                    stubs={"f_and_g": 4, "column": 2, "row": 2},
                    given={"f_and_g": ["class _CopyToTensorParallel(torch.autograd.Function):",
                                       "def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> "
                                       "torch.Tensor:",
                                       "def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:",
                                       "class _ReduceFromTensorParallel(torch.autograd.Function):",
                                       "def copy_to_tensor_parallel(x: torch.Tensor, group",
                                       "    return _CopyToTensorParallel.apply(x, group)",
                                       "def reduce_from_tensor_parallel(x: torch.Tensor, group",
                                       "    return _ReduceFromTensorParallel.apply(x, group)"],
                           "column": ["class ColumnParallelLinear(nn.Module):",
                                      "def __init__(self, full: nn.Linear, group: dist.ProcessGroup | None):",
                                      "self.group = group", "def forward(self, x: torch.Tensor) -> torch.Tensor:"],
                           "row": ["class RowParallelLinear(nn.Module):", "self.group = group"],
                           "setup": ["import torch.distributed as dist"]})
    assert EXPECTED[NAME].points == 10


def test_the_solution_passes_every_check_hidden_cases_included():
    checks.check_f_and_g(f, g, cases=BOTH)
    checks.check_column_parallel(ColumnParallelLinear, cases=BOTH)
    checks.check_row_parallel(RowParallelLinear, cases=BOTH)
    checks.check_parallel_mlp(ColumnParallelLinear, RowParallelLinear, cases=BOTH)


def test_the_course_layers_and_operators_are_listed_and_still_read_as_themselves():
    for obj in (layers.ColumnParallelLinear, layers.RowParallelLinear, communications.copy_to_tensor_parallel,
                communications.reduce_from_tensor_parallel):
        assert course_answer(obj) == ("tensor_parallel", "09"), obj
    assert "return _CopyToTensorParallel.apply(x, group)" in inspect.getsource(
        communications.copy_to_tensor_parallel)
    assert "self.weight = _split_parameter(full.weight, 0, rank, t, parts)" in inspect.getsource(
        layers.ColumnParallelLinear)
    assert list(inspect.signature(layers.RowParallelLinear.__init__).parameters)[:3] == ["self", "full", "group"]


# --------------------------------------------------------------------------- #
# The two all-reduces: missing in f's backward, doubled in g's, on the wrong group, in f's forward
# --------------------------------------------------------------------------- #
def test_f_without_its_all_reduce_leaves_a_partial_input_gradient():
    ns = F_WITHOUT_ALL_REDUCE
    with pytest.raises(AssertionError) as info:
        checks.check_f_and_g(ns["copy_to_tensor_parallel"], ns["reduce_from_tensor_parallel"])
    message = str(info.value)
    assert "the pair f, g is wrong on 2 ranks in t = 2 on 2 ranks:" in message, message
    assert "rank 0: x.grad after f's backward differs from the sum of the group's gradients by up to " in message
    assert "it is this rank's own gradient, not the sum over the group: f's backward must all-reduce it" in message
    with pytest.raises(AssertionError) as info:
        checks.check_column_parallel(ns["ColumnParallelLinear"])
    message = str(info.value)
    assert "ColumnParallelLinear is wrong on 2 ranks in t = 2 on 2 ranks:" in message, message
    assert "rank 1: the input gradient x.grad differs from the serial layer's by up to " in message, message
    assert "it is this rank's own partial gradient, through its slice of the layer only: f's backward must " \
           "all-reduce the input's gradient over the group" in message, message
    checks.check_row_parallel(ns["RowParallelLinear"])            # the row layer has no f
    with pytest.raises(AssertionError, match=r"rank 0: the input gradient x\.grad differs .*: it is this rank's own "
                                             r"partial gradient"):
        checks.check_parallel_mlp(ns["ColumnParallelLinear"], ns["RowParallelLinear"])


def test_g_that_all_reduces_in_backward_too_makes_gradients_t_times_too_big():
    ns = G_ALL_REDUCES_BACKWARD
    # both ranks find exactly the same: one line for them, its hint once
    with pytest.raises(AssertionError, match=r"ranks 0 and 1: x\.grad after g's backward differs from the gradient of "
                                             r"g's output by up to [\d.]+ \(tolerance 1e-05\): it is t times the "
                                             r"serial layer's: g's backward all-reduced[^\n]*$"):
        checks.check_f_and_g(ns["copy_to_tensor_parallel"], ns["reduce_from_tensor_parallel"])
    checks.check_column_parallel(ns["ColumnParallelLinear"])       # the column layer has no g
    with pytest.raises(AssertionError) as info:
        checks.check_row_parallel(ns["RowParallelLinear"])
    message = str(info.value)
    assert "rank 0: the input gradient x.grad differs from the serial layer's by up to" in message, message
    assert "it is t times the serial layer's: g's backward all-reduced a gradient that every rank of the group " \
           "already holds whole (everything after g is replicated), so the sum counts it t times. g's backward is " \
           "the identity" in message, message
    with pytest.raises(AssertionError, match=r"the MLP of ColumnParallelLinear, GELU, RowParallelLinear is wrong .*\n"
                                             r"  ranks 0 and 1: the input gradient x\.grad .*: it is t times"):
        checks.check_parallel_mlp(ns["ColumnParallelLinear"], ns["RowParallelLinear"])


def test_right_numbers_with_an_all_reduce_in_f_forward_fail_on_traffic():
    ns = F_FORWARD_ALL_REDUCES
    with pytest.raises(AssertionError) as info:
        checks.check_f_and_g(ns["copy_to_tensor_parallel"], ns["reduce_from_tensor_parallel"])
    message = str(info.value)
    assert "ranks 0 and 1: f's forward started an all-reduce of 144 B on the group; expected nothing: f is the identity " \
           "forward" in message, message
    with pytest.raises(AssertionError, match=r"ranks 0 and 1: the forward started 2 collectives \(an all-reduce of 144 B on "
                                             r"the group, an all-reduce of 144 B on the group\); expected one "
                                             r"all-reduce of 144 B \(\(2, 3, 6\) float32\) on the group, each rank "
                                             r"sending 2\(t-1\)/t of it, 144 B, with a ring"):
        checks.check_parallel_mlp(ns["ColumnParallelLinear"], ns["RowParallelLinear"])


def test_an_all_reduce_on_the_default_group_is_named_even_where_the_sums_agree():
    ns = DEFAULT_GROUP
    with pytest.raises(AssertionError) as info:
        checks.check_row_parallel(ns["RowParallelLinear"])
    message = str(info.value)
    assert "ranks 0 and 1: the forward started an all-reduce of 144 B on the default group (all 2 ranks); expected one " \
           "all-reduce of 144 B" in message, message
    assert message.count("hint: a collective ran on another process group than the one passed in (ranks [0, 1]): " \
                         "give group=group to dist.all_reduce") == 1, message        # once, not once per rank
    assert "\n  rank 1: " not in message, message                  # one line for both ranks, not two
    with pytest.raises(AssertionError, match=r"two groups of t = 2 side by side on 4 ranks, \[0, 1\] and \[2, 3\]:\n"
                                             r"  rank 0: \(group \[0, 1\], its rank 0\) x\.grad after f's backward "
                                             r"differs from the sum of the group's gradients .*\n"
                                             r"    hint: a collective ran on another process group"):
        checks.check_f_and_g(ns["copy_to_tensor_parallel"], ns["reduce_from_tensor_parallel"], cases=("large",))


def _repeated_hints(message: str) -> list[str]:
    """The hints printed more than once in ``message``: ``hint:`` lines, and the checks' own inline hints."""
    lines = re.findall(r"^    hint: .*$", message, re.M)
    texts = [h.change for h in tp_checks._HINTS if message.count(h.change) > 1]
    return sorted({line for line in lines if lines.count(line) > 1}) + texts


@pytest.mark.parametrize("ns, check, shown", [
    (F_WITHOUT_ALL_REDUCE, "check_f_and_g", r"it is this rank's own gradient, not the sum over the group: f's backward "
                                            r"must all-reduce it"),
    (F_WITHOUT_ALL_REDUCE, "check_column_parallel", r"it is this rank's own partial gradient, through its slice of "
                                                    r"the layer only: f's backward must all-reduce"),
    (G_ALL_REDUCES_BACKWARD, "check_row_parallel", r"it is t times the serial layer's: g's backward all-reduced"),
    (G_ALL_REDUCES_BACKWARD, "check_parallel_mlp", r"it is t times the serial layer's: g's backward all-reduced"),
    (BIAS_ON_EVERY_RANK, "check_row_parallel", r"it is the serial output plus \(t-1\) times the bias: each rank added"),
    (GATHERS_THE_OUTPUT, "check_column_parallel", r"the whole output: the column layer's output stays split"),
    (DEFAULT_GROUP, "check_column_parallel", r"\n    hint: a collective ran on another process group"),
])
def test_a_hint_every_rank_repeats_is_printed_once(ns, check, shown):
    """Each rank of the group makes the same mistake: the hint once, the later ranks pointing to rank 0's line."""
    students = {"check_f_and_g": ("copy_to_tensor_parallel", "reduce_from_tensor_parallel"),
                "check_column_parallel": ("ColumnParallelLinear",),
                "check_row_parallel": ("RowParallelLinear",),
                "check_parallel_mlp": ("ColumnParallelLinear", "RowParallelLinear")}[check]
    with pytest.raises(AssertionError) as info:
        getattr(checks, check)(*(ns[name] for name in students))
    message = str(info.value)
    grouped = "is wrong on 2 ranks in t = 2 on 2 ranks:\n  ranks 0 and 1: " in message    # found exactly the same
    assert grouped or "\n  rank 0: " in message and "\n  rank 1: " in message, message
    assert re.search(f"  ranks? 0(?: and 1)?: .*{shown}", message), message
    assert not _repeated_hints(message), message
    assert grouped or "(the same as rank 0's, above)" in message or "hint: the same as rank 0's, above" in message, \
        message


def test_hints_once_keeps_what_each_rank_found_and_distinct_hints():
    hint = tp_checks._G_BACKWARD
    message = (f"the pair f, g is wrong on 3 ranks in t = 3 on 3 ranks:\n"
               f"  rank 0: x.grad differs by up to 1 (tolerance 1e-05): {hint}\n    hint: one\n"
               f"  rank 1: x.grad differs by up to 2 (tolerance 1e-05): {hint}\n    hint: two\n"
               f"  rank 2: x.grad differs by up to 3 (tolerance 1e-05): {hint}\n    hint: one")
    assert hints_once(message, tp_checks._HINTS).split("\n")[1:] == [
        f"  rank 0: x.grad differs by up to 1 (tolerance 1e-05): {hint}", "    hint: one",
        f"  rank 1: x.grad differs by up to 2 (tolerance 1e-05): {hint.what} (the same as rank 0's, above)",
        "    hint: two",
        f"  rank 2: x.grad differs by up to 3 (tolerance 1e-05): {hint.what} (the same as rank 0's, above)",
        "    hint: the same as rank 0's, above"]


def test_g_that_all_reduces_its_input_in_place_is_named():
    with pytest.raises(AssertionError, match=r"ranks 0 and 1: reduce_from_tensor_parallel\(x, group\) \(g\) changed its "
                                             r"input x: dist\.all_reduce works in place, so all-reduce a copy"):
        checks.check_f_and_g(IN_PLACE_G["copy_to_tensor_parallel"], IN_PLACE_G["reduce_from_tensor_parallel"])


# --------------------------------------------------------------------------- #
# What each rank holds: the right slice, copied, and no more
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("ns, complaint", [
    (WRONG_DIMENSION, r"rank 0: ColumnParallelLinear\.weight has shape \(24, 3\); expected \(12, 6\): you split "
                      r"dimension 1 of nn\.Linear's weight \(out, in\), the input features, which is "
                      r"RowParallelLinear's split\. ColumnParallelLinear keeps rows \[0, 12\) of the full weight "
                      r"\(out, in\): the output features"),
    (A_VIEW, r"ranks 0 and 1: ColumnParallelLinear\.weight is a view into a storage of 576 B, the full layer's, not a copy of "
             r"its 288 B slice: the full weight stays in memory on every rank\. Clone the slice"),
    (KEEPS_THE_FULL_LAYER, r"ranks 0 and 1: ColumnParallelLinear keeps 1008 B of tensors; this rank's weight and bias are "
                           r"336 B: keep only them"),
    (F_FORWARD_SUMS, r"rank 0: the output differs from the serial layer's by up to [\d.]+ \(tolerance 1e-05\): it is "
                     r"what t times the input gives: f's forward all-reduced the input"),
    (GATHERS_THE_OUTPUT, r"ranks 0 and 1: the output has shape \(2, 3, 24\); expected \(2, 3, 12\), the whole output: the "
                         r"column layer's output stays split"),
])
def test_a_column_layer_that_holds_sends_or_returns_too_much_is_named(ns, complaint):
    with pytest.raises(AssertionError, match=complaint):
        checks.check_column_parallel(ns["ColumnParallelLinear"])


def test_the_rank_within_the_group_is_needed_when_groups_sit_side_by_side():
    checks.check_column_parallel(GLOBAL_RANK["ColumnParallelLinear"])          # one group: the ranks agree
    with pytest.raises(AssertionError) as info:
        checks.check_column_parallel(GLOBAL_RANK["ColumnParallelLinear"], cases=("large",))
    message = str(info.value)
    assert "is wrong on 4 ranks in two groups of t = 2 side by side on 4 ranks, [0, 1] and [2, 3]:" in message
    assert "rank 2: (group [2, 3], its rank 0) ColumnParallelLinear.weight has shape (0, 6); expected (12, 6): this " \
           "is rank 2 of the world but rank 0 of its group: r is dist.get_rank(group)" in message, message


def test_the_row_layer_adds_its_bias_once_and_refuses_sizes_t_does_not_divide():
    with pytest.raises(AssertionError) as info:
        checks.check_row_parallel(BIAS_ON_EVERY_RANK["RowParallelLinear"])
    message = str(info.value)
    assert "ranks 0 and 1: the output differs from the serial layer's by up to" in message, message
    assert "it is the serial output plus (t-1) times the bias: each rank added the bias before the all-reduce, so " \
           "the sum holds it t times. Add it once, after g" in message, message
    with pytest.raises(AssertionError, match=r"ranks 0 and 1: RowParallelLinear\(nn\.Linear\(25, 6\), group\) with t = 2 "
                                             r"built a layer, but t = 2 does not divide its 25 input features"):
        checks.check_row_parallel(NO_VALUE_ERROR["RowParallelLinear"])


# --------------------------------------------------------------------------- #
# Hangs, and the course's own answer
# --------------------------------------------------------------------------- #
def test_a_deadlock_fails_after_the_timeout_and_names_where():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        checks.check_f_and_g(DEADLOCK["copy_to_tensor_parallel"], DEADLOCK["reduce_from_tensor_parallel"], timeout=3)
    message = str(info.value)
    assert "the pair f, g did not finish on 2 ranks within 3 s" in message, message
    assert "in t = 2 on 2 ranks, g's forward" in message and "most likely a deadlock" in message, message
    assert time.monotonic() - start < 20


def test_the_course_layers_and_operators_are_refused():
    for cls in (layers.ColumnParallelLinear, CourseColumn):
        with pytest.raises(AssertionError, match=r"check_column_parallel was given \w+, which (is|is built on "
                                                 r"dtcourse\.tensor_parallel\.layers\.ColumnParallelLinear,) the "
                                                 r"course's own answer to exercise 09"):
            checks.check_column_parallel(cls)
    with pytest.raises(AssertionError, match=r"was given dtcourse\.tensor_parallel\.communications\."
                                             r"copy_to_tensor_parallel, the course's own answer to exercise 09"):
        checks.check_f_and_g(communications.copy_to_tensor_parallel, g)
    with pytest.raises(AssertionError, match=r"rank \d raised ReferenceRefused: dtcourse\.tensor_parallel\."
                                             r"communications\.copy_to_tensor_parallel is the course's own answer to "
                                             r"exercise 09"):
        checks.check_column_parallel(CALLS_THE_COURSE["ColumnParallelLinear"])
    with pytest.raises(AssertionError, match=r"rank \d raised ReferenceRefused: dtcourse\.tensor_parallel's f and g "
                                             r"are switched off"):
        checks.check_f_and_g(CALLS_ITS_FUNCTION["copy_to_tensor_parallel"], g)


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_row_parallel(RowParallelLinear, cases=("huge",))
    with pytest.raises(TypeError, match="pass your function or class itself"):
        checks.check_parallel_mlp(ColumnParallelLinear, 3)
