"""Exercise 11 (expert parallelism: positions, dispatch and combine): the released notebook, its checks, refusals.

The checks test the algorithm, not only the answer: positions are compared choice by choice and named by token,
choice and expert; dispatch's received buffer row by row, named by rank, source rank, expert and slot, with the
token found there; the layer of the three functions against the one-process ``MoE`` on every rank, by token and
tensor; and every all-to-all is counted with its rows to each rank and its process group. Positions from 1,
counted token by token or column by column, a dropped choice sent, only first choices sent, the wrong layout,
tokens sent times their gates, the buffer cut from the graph, every row sent to every rank (right rows, ep times
the bytes), the default group, the gate not applied or swapped, a dropped choice added, a slot read from the
wrong row, a combine without autograd, the gates detached: each fails with the message that says which, each
hint once however many ranks repeat the mistake. A dispatch that sends the choices past an expert's capacity
(into the next expert's slots, or wrapped round or clamped into its own) is named by the expert that overflowed
and by how many, in dispatch's check and in the layer's. A deadlock fails after the timeout, and the course's own
functions are refused. Everything here calls the checks
directly; full marks for the solution and zero for the untouched exercise are checked with every exercise's, in
``test_grading.py``. Run just these with ``pytest -q tests/test_moe_exercise.py``, and everything about this
exercise with ``pytest -q tests -k "11_moe_dispatch or test_moe_exercise"``.

The functions handed to the checks are compiled from the notebook's cells under this file's name (or defined
here), some with a line changed: to the checks, they are a student's code.
"""

from __future__ import annotations

import inspect
import re
import time

import pytest
import torch

from dtcourse import checks
from dtcourse.checks import moe as moe_checks
from dtcourse.checks.guard import course_answer
from dtcourse.models import moe as layer
from dtcourse.moe import dispatch as library
from exercise_harness import EXPECTED, assert_released, compile_answers

NAME = "11_moe_dispatch"
BOTH = ("small", "large")


def _answer(**edits: list[tuple[str, str]]) -> dict:
    """The solution's cells, each ``(old, new)`` of ``edits[cell]`` replaced, compiled under this file's name."""
    return compile_answers(NAME, ("positions", "dispatch", "combine"), edits, __file__, __name__)


SOLUTION = _answer()
positions_in_expert, dispatch, combine = (SOLUTION[n] for n in ("positions_in_expert", "dispatch_padded",
                                                                   "combine_padded"))


def positions_by_loop(experts, n_expert):
    """A loop with one counter per expert, first choices first: right, and unlike the solution."""
    out, seen = torch.empty_like(experts), [0] * n_expert
    for j in range(experts.shape[1]):
        for i in range(experts.shape[0]):
            out[i, j] = seen[int(experts[i, j])]
            seen[int(experts[i, j])] += 1
    return out


def positions_per_column(experts, n_expert):
    """Each choice column counted on its own: second choices start again from 0."""
    out = torch.empty_like(experts)
    for j in range(experts.shape[1]):
        out[:, j] = positions_by_loop(experts[:, j:j + 1], n_expert)[:, 0]
    return out


def positions_second_first(experts, n_expert):
    """One counter per expert, but the second choices queued before the first ones."""
    return positions_by_loop(experts.flip(1), n_expert).flip(1)


def positions_by_token(experts, n_expert):
    """The token's index: counted per token, not per expert."""
    return torch.arange(experts.shape[0])[:, None].expand_as(experts).clone()


# --------------------------------------------------------------------------- #
# Wrong answers, each a student's plausible mistake (one line of the solution changed)
# --------------------------------------------------------------------------- #
FROM_ONE = _answer(positions=[("(one_hot.cumsum(dim=0) - 1)", "one_hot.cumsum(dim=0)")])
TOKEN_MAJOR = _answer(positions=[("experts.t().reshape(-1)", "experts.reshape(-1)"), (".view(k, N).t()", ".view(N, k)")])
DROPPED_SENT = _answer(dispatch=[("kept = routing.kept", "kept = torch.ones_like(routing.kept)")])
FIRST_ONLY = _answer(dispatch=[("kept = routing.kept", "kept = routing.kept & (torch.arange(routing.kept.shape[1]) == 0)")])
POSITION_MAJOR = _answer(dispatch=[("slot = routing.experts * C + routing.positions",
                                    "slot = routing.positions * n_expert + routing.experts")])
# past the capacity: every choice sent, at row expert·C + position mod C (wrapped round onto its own expert's
# slots) or clamped to its last slot; or kept with position <= C, so position C spills into the next expert's
WRAPPED = _answer(dispatch=[("slot = routing.experts * C + routing.positions",
                             "slot = routing.experts * C + routing.positions % C"),
                            ("kept = routing.kept", "kept = torch.ones_like(routing.kept)")])
CLAMPED = _answer(dispatch=[("slot = routing.experts * C + routing.positions",
                             "slot = routing.experts * C + routing.positions.clamp(max=C - 1)"),
                            ("kept = routing.kept", "kept = torch.ones_like(routing.kept)")])
UP_TO_C = _answer(dispatch=[("kept = routing.kept", "kept = routing.positions <= C")])
DEFAULT_GROUP = _answer(dispatch=[("all_to_all(buffer, splits, splits, group)", "all_to_all(buffer, splits, splits, None)")])
GATED = _answer(dispatch=[("tokens[token[kept]])", "tokens[token[kept]] * routing.gates[kept][:, None])")])
DETACHED = _answer(dispatch=[("tokens[token[kept]])", "tokens.detach()[token[kept]])")])
EVERYTHING = _answer(dispatch=[                         # right rows, every row to every rank: ep times the bytes
    ("    return all_to_all(buffer, splits, splits, group)",
     "    everything = all_to_all(buffer.repeat(ep, 1), [n_expert * C] * ep, [n_expert * C] * ep, group)\n"
     "    return everything.view(ep, ep, n_expert // ep * C, d)[:, dist.get_rank(group)].reshape(-1, d)")])
NO_GATE = _answer(combine=[(" * routing.gates[rows, j, None]", "")])
SWAPPED_GATES = _answer(combine=[("routing.gates[rows, j, None]", "routing.gates[rows, -1 - j, None]")])
DROPPED_ADDED = _answer(combine=[("rows = routing.kept[:, j].nonzero().squeeze(1)", "rows = torch.arange(len(slot))"),
                                 ("returned[slot[rows, j]]", "returned[slot[rows, j].clamp(max=len(returned) - 1)]")])
WRONG_SLOT = _answer(combine=[("slot = routing.experts * C + routing.positions",
                               "slot = routing.positions * (outputs.shape[0] // C) + routing.experts")])
RAW_ALL_TO_ALL = _answer(combine=[("returned = all_to_all(outputs, splits, splits, group)",
                                   "returned = torch.empty_like(outputs)\n"
                                   "    dist.all_to_all_single(returned, outputs.detach(), group=group)")])
DETACHED_GATES = _answer(combine=[("routing.gates[rows, j, None]", "routing.gates.detach()[rows, j, None]")])
DEADLOCK = _answer(dispatch=[("    return all_to_all(buffer, splits, splits, group)",
                              "    if dist.get_rank(group) == 0:\n        return buffer\n"
                              "    return all_to_all(buffer, splits, splits, group)")])
CALLS_THE_COURSE = _answer(dispatch=[("    return all_to_all(buffer, splits, splits, group)",
                                      "    from dtcourse.moe import dispatch_padded\n"
                                      "    return dispatch_padded(tokens, routing, n_expert, group)[0]")])
CALLS_ITS_HELPER = _answer(combine=[("    return out", "    from dtcourse.moe.dispatch import _add_up\n"
                                                      "    return _add_up(returned, routing, slot, len(slot))")])


# --------------------------------------------------------------------------- #
# The released notebook, the solution, the cases, and the course's own functions
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["one_hot.cumsum(dim=0) - 1", "slot = routing.experts * C + routing.positions",
                                  "all_to_all(buffer, splits, splits, group)", 'cases=("large",)'],
                    stubs={"positions": 1, "dispatch": 1, "combine": 1},
                    given={"positions": ["def positions_in_expert(experts: torch.Tensor, n_expert: int) -> "
                                         "torch.Tensor:"],
                           "dispatch": ["def dispatch_padded(tokens: torch.Tensor, routing: Routing, n_expert: int, "
                                        "group: dist.ProcessGroup | None) -> torch.Tensor:"],
                           "combine": ["def combine_padded(outputs: torch.Tensor, routing: Routing, group: "
                                       "dist.ProcessGroup | None) -> torch.Tensor:"],
                           "setup": ["from dtcourse.models.moe import Routing, capacity",
                                     "from dtcourse.moe import all_to_all"]})
    assert EXPECTED[NAME].points == 10


def test_the_solution_passes_every_check_hidden_cases_included():
    checks.check_moe_positions(positions_in_expert, cases=BOTH)
    checks.check_moe_dispatch(dispatch, cases=BOTH)
    checks.check_moe_combine(positions_in_expert, dispatch, combine, cases=BOTH)
    checks.check_moe_positions(positions_by_loop, cases=BOTH)


def test_every_configuration_drops_choices_on_some_rank_of_every_group():
    """Capacity dropping is part of every case, in dispatch's routings and in the layer's."""
    for name in BOTH:
        for case in moe_checks.MOE_CASES[name][1]:
            for index in range(case.world // case.ep):
                for cfg in moe_checks._configs(case.ep):
                    seed = 1000 * index
                    routings = [layer.route(moe_checks._logits(seed, s, cfg), cfg.k, cfg.cf) for s in range(case.ep)]
                    assert any(not r.kept.all() for r in routings), (case, cfg)
                    full, xs = moe_checks._layer(seed, cfg, case.ep)
                    full.groups = case.ep
                    full(torch.cat(xs))
                    assert full.stats["dropped"] > 0, (case, cfg)


def test_the_course_functions_are_listed_and_still_read_as_themselves():
    for fn in (layer.positions_in_expert, library.dispatch_padded, library.combine_padded, library._add_up,
               library.combine_dropless):
        assert course_answer(fn) == ("moe", "11"), fn
    assert "one_hot.cumsum(dim=0) - 1" in inspect.getsource(layer.positions_in_expert)
    assert list(inspect.signature(library.dispatch_padded).parameters)[:4] == ["tokens", "routing", "n_expert", "group"]
    assert layer.positions_in_expert(torch.tensor([[1], [0], [1]]), 2).tolist() == [[0], [0], [1]]   # no check running


# --------------------------------------------------------------------------- #
# Positions
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("fn, complaint", [
    (FROM_ONE["positions_in_expert"], r"positions_in_expert\(experts, 2\) for 3 tokens, top-1, E = 2: token 0's "
                                      r"choice 0 \(expert 1\): expected position 0, found 1\.\n    expert 1's queue, "
                                      r"in arrival order: token 0 \(choice 0\)\n    hint: your positions start at 1"),
    (TOKEN_MAJOR["positions_in_expert"], r"for 3 tokens, top-2, E = 3: token 0's choice 1 \(expert 0\): expected "
                                         r"position 1, found 0\.\n    expert 0's queue, in arrival order: token 1 "
                                         r"\(choice 0\), token 0 \(choice 1\)\n    hint: you counted token by token"),
    (positions_second_first, r"token 0's choice 0 \(expert 1\): expected position 0, found 1\.\n.*\n    hint: your "
                             r"second choices are counted before the first ones"),
    (positions_per_column, r"token 0's choice 1 \(expert 0\): expected position 1, found 0\.\n.*\n    hint: your "
                           r"second choices start again from 0"),
    (positions_by_token, r"for 3 tokens, top-1, E = 2: token 1's choice 0 \(expert 0\): expected position 0, found "
                         r"1\.\n.*\n    hint: that is each token's index: count per expert, not per token"),
])
def test_wrong_positions_name_the_token_choice_and_expert(fn, complaint):
    with pytest.raises(AssertionError, match=complaint):
        checks.check_moe_positions(fn)


def test_wrong_positions_are_named_inside_the_layer_too():
    with pytest.raises(AssertionError) as info:
        checks.check_moe_combine(FROM_ONE["positions_in_expert"], dispatch, combine)
    message = str(info.value)
    assert "is wrong on 2 ranks in ep = 2 on 2 ranks, E = 2, top-1, capacity factor 1.0 (C = 6):" in message, message
    assert "rank 1: your positions_in_expert(experts, 2) for rank 1's 12 tokens" in message, message
    assert "check_moe_positions names it on smaller routings" in message, message


# --------------------------------------------------------------------------- #
# Dispatch: the rows each rank receives, and the all-to-all that brings them
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("ns, complaint", [
    (DROPPED_SENT, r"rank 1: the received buffer, row 0 = \(from rank 0, local expert 0 = expert 1, slot 0\): expected "
                   r"token 1 of rank 0 \(its choice 0\), found token 9 of rank 0 \(its choice 0 to expert 0 at position "
                   r"6, dropped: past the capacity C = 6\)\n    hint: a dropped choice was sent"),
    (UP_TO_C, r"rank 1: the received buffer, row 0 = \(from rank 0, local expert 0 = expert 1, slot 0\): expected token "
              r"1 of rank 0 \(its choice 0\), found token 9 of rank 0 \(its choice 0 to expert 0 at position 6, "
              r"dropped: past the capacity C = 6\)\n    hint: a dropped choice was sent: expert 0 is over capacity in "
              r"rank 0's routing: its tokens chose it 8 times for C = 6 slots, so 2 choices, at positions 6 to 7, are "
              r"past C\. Token 9's choice 0 \(rank 0's\), at position 6, went to row expert·C \+ position = 6 of the "
              r"send buffer: past expert 0's C slots, into expert 1's slot 0\. A choice at position >= C is dropped, "
              r"not sent: send only the kept ones, kept = position < C \(routing\.kept\), as the lesson's route does"),
    (WRAPPED, r"rank 0: the received buffer, row 0 = .*: expected token 0 of rank 0 \(its choice 0\), found token 9 of "
              r"rank 0 .*\n    hint: a dropped choice was sent: expert 0 is over capacity in rank 0's routing: its "
              r"tokens chose it 8 times for C = 6 slots, so 2 choices, at positions 6 to 7, are past C\. Token 9's "
              r"choice 0 \(rank 0's\), at position 6, wrapped round onto expert 0's slot 0 = 6 mod C, the slot of a "
              r"kept choice\. A choice at position >= C is dropped, not sent: .*kept = position < C"),
    (CLAMPED, r"rank 0: the received buffer, row 5 = .*found token 11 of rank 0 .*\n    hint: a dropped choice was sent: "
              r"expert 0 is over capacity in rank 0's routing: .*, so 2 choices, at positions 6 to 7, are past C\. "
              r"Token 11's choice 0 \(rank 0's\), at position 7, was clamped onto expert 0's last slot, 5"),
    (FIRST_ONLY, r"E = 4, top-2, capacity factor 1\.0 \(C = 6\):\n  rank 0: the received buffer, row 4 = \(from rank 0, "
                 r"local expert 0 = expert 0, slot 4\): expected token 1 of rank 0 \(its choice 1\), found zeros\n    "
                 r"hint: only first choices arrived"),
    (POSITION_MAJOR, r"rank 0: the received buffer, row 1 = .*: expected token 2 of rank 0 \(its choice 0\), found token "
                     r"1 of rank 0 \(its choice 0 to expert 1, slot 0, which rank 1 receives\)\n    hint: the received "
                     r"buffer is laid out \(source rank, local expert, slot\)"),
    (GATED, r"found token 0 of rank 0 times its choice 0's gate\n    hint: dispatch sends the tokens as they are"),
    (DETACHED, r"ranks 0 and 1: the received rows do not require grad: autograd cannot send the gradients back"),
    (EVERYTHING, r"ranks 0 and 1: dispatch's forward started an all-to-all on the group sending rows \[12, 12\] of 32 B to the "
                 r"ranks; expected one all-to-all on the group of the E·C = 12-row buffer \(384 B of float32\), split "
                 r"equally: E/ep·C = 6 rows to each rank, rows \[6, 6\], so each rank sends \(ep-1\)/ep of it, 192 B"),
])
def test_a_dispatch_that_sends_the_wrong_rows_or_too_many_is_named(ns, complaint):
    with pytest.raises(AssertionError, match=complaint):
        checks.check_moe_dispatch(ns["dispatch_padded"])


def test_an_all_to_all_on_the_default_group_is_named_even_where_the_rows_agree():
    with pytest.raises(AssertionError) as info:
        checks.check_moe_dispatch(DEFAULT_GROUP["dispatch_padded"])
    message = str(info.value)
    assert "ranks 0 and 1: dispatch's forward started an all-to-all on the default group (all 2 ranks) sending rows [6, 6] " \
           "of 32 B to the ranks; expected one all-to-all on the group" in message, message
    assert message.count("hint: a collective ran on another process group than the one passed in (ranks [0, 1]): "
                         "pass group=group to all_to_all") == 1, message                # once, not once per rank
    assert "\n  rank 1: " not in message, message                  # one line for both ranks, not two
    with pytest.raises(AssertionError, match=r"failed on 4 ranks in two groups of ep = 2 side by side on 4 ranks, "
                                             r"\[0, 1\] and \[2, 3\], E = 2, top-1.*: rank \d raised RuntimeError: "
                                             r"Number of tensor splits not equal to group size\n.*\n    hint: a "
                                             r"collective ran on another process group than the one passed in"):
        checks.check_moe_dispatch(DEFAULT_GROUP["dispatch_padded"], cases=("large",))


def test_a_dropped_choice_past_the_buffer_names_the_capacity():
    """The last expert's choices past C have rows past E·C: the student's IndexError, and which expert overflowed."""
    with pytest.raises(AssertionError, match=r"failed on 4 ranks in two groups of ep = 2 .*: rank \d raised IndexError: "
                                             r"index_copy_\(\): index 12 is out of bounds .*\n(.*\n)*    hint: expert 1 "
                                             r"is over capacity in this rank's routing: its tokens chose it 8 times for "
                                             r"C = 6 slots, so 2 choices, at positions 6 to 7, are past C, and token "
                                             r"10's choice 0, at position 6, has row expert·C \+ position = 12, past "
                                             r"the buffer's E·C = 12 rows.*kept = position < C"):
        checks.check_moe_dispatch(DROPPED_SENT["dispatch_padded"], cases=("large",))


# --------------------------------------------------------------------------- #
# Combine: the layer against one process
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("ns, complaint", [
    (NO_GATE, r"rank 0: token 0's output differs from the one-process layer's by up to [\d.]+ \(tolerance 1e-05\); its "
              r"choice 0: expert 1, slot 0 \(row 6 of the returned buffer\), gate [\d.]+\n    hint: the gate is not "
              r"applied"),
    (SWAPPED_GATES, r"E = 4, top-2, .*\n  rank 0: token 0's output differs .*; its choice 0: .*; choice 1: .*\n    hint: "
                    r"choice j's output is weighted by another choice's gate"),
    (DROPPED_ADDED, r"rank 0: token 9's output differs .*; its choice 0: expert 0, position 6, dropped \(C = 6\)\n    "
                    r"hint: every choice of this token was dropped, so its output must be zero"),
    (WRONG_SLOT, r"rank 0: token 0's output differs .*\n    hint: choice 0's output was read from row 1 \(expert 0, slot "
                 r"1\) of the buffer the all-to-all returned, not row expert·C \+ position = 6"),
    (RAW_ALL_TO_ALL, r"rank 0: expert 0's c_fc\.weight gradient is None after backward: the outputs' gradient never "
                     r"reached this rank's experts: combine's all-to-all must be differentiable"),
    (DETACHED_GATES, r"ranks 0 and 1: the router's weight gradient is None after backward: the gates' gradient is cut"),
])
def test_a_combine_that_adds_the_wrong_outputs_is_named_by_token_and_tensor(ns, complaint):
    with pytest.raises(AssertionError, match=complaint):
        checks.check_moe_combine(positions_in_expert, dispatch, ns["combine_padded"])


@pytest.mark.parametrize("ns, complaint", [
    (DROPPED_SENT, r"rank 1: token 2's output differs .*\n    hint: your dispatch sent a dropped choice \(check_moe_dispatch "
                   r"names the row it landed in\): expert 0 is over capacity in rank 0's routing: its tokens chose it "
                   r"8 times for C = 6 slots, so 2 choices, at positions 6 to 7, are past C\. Token 9's choice 0 "
                   r"\(rank 0's\), at position 6, went to row expert·C \+ position = 6 of the send buffer: past expert "
                   r"0's C slots, into expert 1's slot 0\. A choice at position >= C is dropped"),
    (WRAPPED, r"rank 0: token 2's output differs .*\n    hint: your dispatch sent a dropped choice .*: expert 0 is over "
              r"capacity in rank 0's routing: .*, so 2 choices, at positions 6 to 7, are past C\. Token 9's choice 0 "
              r"\(rank 0's\), at position 6, wrapped round onto expert 0's slot 0 = 6 mod C"),
])
def test_the_layer_names_a_dispatch_past_the_capacity(ns, complaint):
    with pytest.raises(AssertionError, match=complaint):
        checks.check_moe_combine(positions_in_expert, ns["dispatch_padded"], combine)


# --------------------------------------------------------------------------- #
# One hint per message, however many ranks make the mistake
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("check, ns, shown", [
    ("check_moe_dispatch", GATED, r"hint: dispatch sends the tokens as they are"),
    ("check_moe_dispatch", FIRST_ONLY, r"hint: only first choices arrived"),
    ("check_moe_dispatch", POSITION_MAJOR, r"hint: the received buffer is laid out"),
    ("check_moe_combine", NO_GATE, r"hint: the gate is not applied"),
    ("check_moe_combine", SWAPPED_GATES, r"hint: choice j's output is weighted by another choice's gate"),
    ("check_moe_combine", TOKEN_MAJOR, r"hint: you counted token by token"),
    ("check_moe_combine", DETACHED_GATES, r"the gates' gradient is cut: keep routing\.gates in the graph"),
    ("check_moe_combine", RAW_ALL_TO_ALL, r"combine's all-to-all must be differentiable"),
])
def test_a_hint_every_rank_repeats_is_printed_once(check, ns, shown):
    """Each rank makes the same mistake: its hint once, on rank 0's line; rank 1's points back to it."""
    with pytest.raises(AssertionError) as info:
        if check == "check_moe_dispatch":
            checks.check_moe_dispatch(ns["dispatch_padded"])
        else:
            checks.check_moe_combine(ns["positions_in_expert"], ns["dispatch_padded"], ns["combine_padded"])
    message = str(info.value)
    assert "is wrong on 2 ranks in ep = 2 on 2 ranks" in message, message
    if "\n  ranks 0 and 1: " in message:               # both found exactly the same: one line, its hint once
        assert len(re.findall(shown, message)) == 1, message
    else:
        rank0, rank1 = message.split("\n  rank 1: ")
        assert re.search(shown, rank0) and not re.search(shown, rank1), message
        assert "the same as rank 0's, above" in rank1, message
    lines = re.findall(r"^    hint: .*$", message, re.M)
    assert len(lines) == len(set(lines)), message
    for hint in (moe_checks._CUT, moe_checks._UNREACHED):
        assert message.count(hint.change) <= 1, message
    assert message.count("check_moe_positions names it on smaller routings") <= 1, message


# --------------------------------------------------------------------------- #
# Hangs, and the course's own answer
# --------------------------------------------------------------------------- #
def test_a_deadlock_fails_after_the_timeout_and_names_where():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        checks.check_moe_dispatch(DEADLOCK["dispatch_padded"], timeout=3)
    message = str(info.value)
    assert "dispatch_padded did not finish on 2 ranks within 3 s" in message, message
    assert "dispatch's forward" in message and "most likely a deadlock" in message, message
    assert time.monotonic() - start < 20


def test_the_course_functions_are_refused():
    with pytest.raises(AssertionError, match=r"check_moe_positions was given dtcourse\.models\.moe\.positions_in_expert"
                                             r", the course's own answer to exercise 11"):
        checks.check_moe_positions(layer.positions_in_expert)
    with pytest.raises(AssertionError, match=r"was given dtcourse\.moe\.dispatch\.combine_padded, the course's own "
                                             r"answer to exercise 11"):
        checks.check_moe_combine(positions_in_expert, dispatch, library.combine_padded)
    with pytest.raises(AssertionError, match=r"rank \d raised ReferenceRefused: dtcourse\.moe\.dispatch\.dispatch_padded "
                                             r"is the course's own answer to exercise 11"):
        checks.check_moe_dispatch(CALLS_THE_COURSE["dispatch_padded"])
    with pytest.raises(AssertionError, match=r"rank \d raised ReferenceRefused: dtcourse\.moe\.dispatch\._add_up is the "
                                             r"course's own answer to exercise 11"):
        checks.check_moe_combine(positions_in_expert, dispatch, CALLS_ITS_HELPER["combine_padded"])


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_moe_dispatch(dispatch, cases=("huge",))
    with pytest.raises(TypeError, match="pass your function or class itself"):
        checks.check_moe_combine(positions_in_expert, dispatch, 3)
