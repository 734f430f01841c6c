"""Exercise 05 (a checkpointed sequential container): the released notebook, its checks and the autograder.

A checkpoint that forgets to replay the RNG fails only the hidden check with dropout, told why. The
checks of the technique (what is held after the forward, what backward recomputes, the peak during
backward, what is left after it) carry 7 of the 12 points, so a container that keeps every
activation scores under half, and one that never lets its recomputed tensors go, or keeps each until
backward is past its segment, fails the memory checks. A replay without gradients, or from an input
without requires_grad, is told so. The course's answers and torch.utils.checkpoint are refused. Full
marks for the solution and zero for the untouched exercise are checked with every exercise's, in
``test_grading.py``. Each grading run starts one Jupyter kernel (a few seconds). Run just these with
``pytest -q test_checkpointing_exercise.py``, and everything about this exercise with
``pytest -q tests -k "05_checkpointing_sequential or test_checkpointing_exercise"``.

The containers handed to the checks here are defined in this file: to the checks, they are a
student's code.
"""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from dtcourse import checks
from dtcourse.checkpointing import CheckpointedSequential, checkpoint, segment_bounds
from dtcourse.checks.checkpointing import GRADIENT_CASES
from exercise_harness import EXPECTED, assert_released, by_id, failed, grade_answers, solution_code

NAME = "05_checkpointing_sequential"
POINTS = EXPECTED[NAME].points
TECHNIQUE = ["check_memory", "check_memory_hidden"]      # 3 + 4 of the 12 points

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
# Right gradients, each layer recomputed once, a peak within the slack and nothing left when backward
# returns, but unpack remembers every tensor it handed out: a segment's recomputed tensors all stay
# alive until backward is past the segment, instead of going one by one as backward uses them.
NEVER_FORGETS = '''
class _Region:
    def __init__(self, fn, x):
        self.fn, self.x, self.rng = fn, x, torch.get_rng_state()
        self.saved, self.replayed, self.handed_out = 0, None, []

    def pack(self, tensor):
        self.saved += 1
        return self.saved - 1

    def unpack(self, position):
        if self.replayed is None:
            kept = []
            with torch.random.fork_rng():
                torch.set_rng_state(self.rng)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                        lambda t: kept.append(t.detach()), lambda _: None):
                    self.fn(self.x.detach().requires_grad_(self.x.requires_grad))
            self.replayed = dict(enumerate(kept))
        tensor = self.replayed.pop(position)
        self.handed_out.append(tensor)
        return tensor


def checkpoint(fn, x):
    region = _Region(fn, x)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
        return fn(x)
'''
# The course's answers, imported instead of written.
IMPORTS_THE_COURSE = {
    "segment_bounds": "from dtcourse.checkpointing import segment_bounds",
    "checkpoint": "from dtcourse.checkpointing import checkpoint",
}
# Correct, and written differently from the solution: sizes from a list comprehension, and a
# checkpoint kept in a small class that recomputes into a list and hands each tensor out by
# setting its slot to None.
DIFFERENT_BUT_RIGHT = {
    "segment_bounds": '''
def segment_bounds(n_layers, segments):
    if segments < 1 or segments > n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {segments} segments: need 1 <= segments <= {n_layers}")
    sizes = [n_layers // segments + (i < n_layers % segments) for i in range(segments)]
    ends = [sum(sizes[:i + 1]) for i in range(segments)]
    return list(zip([0] + ends[:-1], ends))
''',
    "checkpoint": '''
class _Region:
    def __init__(self, fn, x):
        self.fn, self.x, self.rng = fn, x, torch.get_rng_state()
        self.saved, self.replayed = 0, None

    def pack(self, tensor):
        self.saved += 1
        return self.saved - 1

    def unpack(self, position):
        if self.replayed is None:
            self.replayed = []
            with torch.random.fork_rng():
                torch.set_rng_state(self.rng)
                with torch.enable_grad():
                    with torch.autograd.graph.saved_tensors_hooks(lambda t: self.replayed.append(t.detach()),
                                                                  lambda _: None):
                        self.fn(self.x.detach().requires_grad_(self.x.requires_grad))
        tensor, self.replayed[position] = self.replayed[position], None
        return tensor


def checkpoint(fn, x):
    region = _Region(fn, x)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
        return fn(x)
''',
}


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_keeps_the_given_parts():
    assert_released(NAME, absent=["set_rng_state", 'cases=("dropout"', "segments=(2, 4, 6)"],
                    stubs={"segment_bounds": 1, "checkpoint": 1, "checkpointed_sequential": 1},
                    given={"checkpointed_sequential": ["def _run_layers(layers: list[nn.Module], x: torch.Tensor)",
                                                       "def checkpoint_sequential(layers: nn.Sequential | "
                                                       "list[nn.Module], segments: int, x: torch.Tensor)",
                                                       "class CheckpointedSequential(nn.Sequential):",
                                                       "self.segments = segments",
                                                       "return checkpoint_sequential(self, self.segments, x)"]})


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_forgetting_the_rng_replay_fails_only_the_dropout_check(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), checkpoint=NO_RNG_REPLAY))
    result = by_id(report)
    assert failed(report) == ["check_gradients_hidden"] and report.score == POINTS - 1, str(report)
    message = result["check_gradients_hidden"].message
    assert "CheckpointedSequential is wrong in case 'dropout'" in message and "segments=2" in message, message
    assert "the .grad of parameter '0.0.weight' (8, 8) differs from the plain run's (by up to" in message, \
        message
    assert "backward saw other dropout masks" in message and "torch.get_rng_state()" in message, message


def test_keeping_every_tensor_scores_under_half(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), checkpoint=KEEPS_EVERYTHING))
    result = by_id(report)
    assert failed(report) == TECHNIQUE and report.score == 5 < POINTS / 2, str(report)
    message = result["check_memory"].message
    assert "the stack held 49,152 bytes (12.0 activations of (16, 64))" in message, message
    assert "a checkpointed stack holds 24,576 (6:" in message, message
    assert "kept the tensors it was given" in message, message
    assert "segments=2" in result["check_memory_hidden"].message, result["check_memory_hidden"].message


def test_keeping_what_unpack_handed_out_loses_the_technique_points(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), checkpoint=NEVER_FORGETS))
    result = by_id(report)
    assert failed(report) == TECHNIQUE and report.score == 5, str(report)
    message = result["check_memory"].message
    assert "segments=3" in message and "during backward, 16,384 bytes (4.0 activations of (16, 64)), recomputed " \
           "by layer(s) 4, 5, 6, 7 for segment 2 of 3 (layers 4 to 7), were still alive after the backward ops " \
           "that read them were done" in message, message
    assert "the course's checkpoint holds none that way" in message, message
    assert "hand each one out once and forget it" in message, message
    hidden = result["check_memory_hidden"].message
    assert "segments=2" in hidden and "24,576 bytes (6.0 activations of (16, 64))" in hidden, hidden


def test_importing_the_course_answers_scores_nothing(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), **IMPORTS_THE_COURSE))
    assert report.score == 0 and len(failed(report)) == EXPECTED[NAME].checks, str(report)
    result = by_id(report)
    for grade_id in ("check_segments", "check_segments_hidden"):
        assert re.search(r"check_segment_bounds was given dtcourse\.checkpointing\.segment_bounds, (which is )?the "
                         r"course's own answer to exercise 05", result[grade_id].message), str(report)
    for grade_id in ("check_gradients", "check_memory", "check_gradients_hidden", "check_memory_hidden"):
        assert re.search(r"raised ReferenceRefused: dtcourse\.checkpointing\.segment_bounds is (part of )?the "
                         r"course's own answer to exercise 05", result[grade_id].message), result[grade_id].message


def test_a_right_answer_written_differently_gets_full_marks(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), **DIFFERENT_BUT_RIGHT))
    assert report.score == POINTS and not failed(report), str(report)


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
def _bounds(n_layers: int, segments: int) -> list[tuple[int, int]]:
    if not 0 < segments <= n_layers:
        raise ValueError(f"segments must be between 1 and {n_layers}, got {segments}")
    size, longer = divmod(n_layers, segments)
    ends = [(i + 1) * size + min(i + 1, longer) for i in range(segments)]
    return list(zip([0] + ends[:-1], ends))


def _run_layers(part, x):
    for layer in part:
        x = layer(x)
    return x


def _container(checkpoint_fn):
    """A CheckpointedSequential (written here, so a student's) that checkpoints with ``checkpoint_fn``."""
    class Container(nn.Sequential):
        def __init__(self, *layers, segments):
            super().__init__(*layers)
            self.bounds = _bounds(len(self), segments)

        def forward(self, x):
            layers = list(self)
            for start, end in self.bounds[:-1]:
                x = checkpoint_fn(partial(_run_layers, layers[start:end]), x)
            return _run_layers(layers[self.bounds[-1][0]:], x)

    Container.__name__ = Container.__qualname__ = checkpoint_fn.__name__
    return Container


def _replaying(keep=lambda t: t.detach(), hand_out="pop", grad=True, requires_grad=True, kept_forever=None):
    """The solution's checkpoint, with one part changed: how the replay keeps and hands out its tensors,
    whether it runs with gradients on and from an input with the forward's requires_grad."""
    def checkpoint_fn(fn, x):
        state, count, replayed = torch.get_rng_state(), 0, {}

        def pack(tensor):
            nonlocal count
            count += 1
            return count - 1

        def unpack(position):
            if not replayed:
                kept = []
                with torch.random.fork_rng():
                    torch.set_rng_state(state)
                    with (torch.enable_grad() if grad else torch.no_grad()), \
                            torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(keep(t)), lambda _: None):
                        fn(x.detach().requires_grad_(x.requires_grad) if requires_grad else x.detach())
                replayed.update(enumerate(kept))
                if kept_forever is not None:
                    kept_forever.append(kept)
            return replayed.pop(position) if hand_out == "pop" else replayed[position]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(x)
    return checkpoint_fn


class _Recompute(torch.autograd.Function):
    """A checkpoint as a Function: forward without a graph, backward recomputes and runs its own backward.

    ``anchor`` requires grad, so that the output needs a gradient even where ``x`` does not.
    """

    @staticmethod
    def forward(ctx, x, anchor, fn):
        ctx.fn, ctx.rng = fn, torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        x = x.detach().requires_grad_(ctx.needs_input_grad[0])
        with torch.random.fork_rng():
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                y = ctx.fn(x)
        torch.autograd.backward(y, grad)        # y, the recomputed output, stays alive until this returns
        return x.grad, None, None


_ANCHOR = torch.empty(0, requires_grad=True)


def _function_checkpoint(fn, x):
    return _Recompute.apply(x, _ANCHOR, fn)


def test_different_but_right_checkpoints_pass_every_check():
    for checkpoint_fn in (_replaying(), _function_checkpoint):
        container = _container(checkpoint_fn)
        checks.check_checkpoint_gradients(container, cases=tuple(GRADIENT_CASES))
        checks.check_checkpoint_memory(container, segments=(3, 2, 4, 6))
    checks.check_segment_bounds(_bounds, cases=("small", "large"))


NEVER_RELEASED = r"when backward\(\) returned, 40,960 bytes \(10\.0 activations of \(16, 64\)\) were still alive"


@pytest.mark.parametrize("checkpoint_fn, complaint", [
    # the recomputed tensors kept in a list that outlives the call
    (_replaying(kept_forever=[]), NEVER_RELEASED + r".*were never let go$"),
    # kept with their grad_fn: a cycle through autograd that Python's collector cannot free
    (_replaying(keep=lambda t: t), NEVER_RELEASED + r".*carry a grad_fn.*Keep t\.detach\(\)"),
    # handed out and kept: a segment's recomputed tensors all alive until backward is past the segment
    (_replaying(hand_out="keep until the segment is done"),
     r"during backward, 16,384 bytes \(4\.0 activations of \(16, 64\)\), recomputed by layer\(s\) 4, 5, 6, 7 for "
     r"segment 2 of 3 \(layers 4 to 7\), were still alive after the backward ops that read them were done.*"
     r"hand each one out once and forget it"),
    # copies of every saved tensor, weights included
    (_replaying(keep=lambda t: t.detach().clone()), r"during backward up to 126,984 bytes \(31\.0 activations of "
                                                    r"\(16, 64\)\) were alive at once; the course's checkpoint "
                                                    r"peaks at 45,320 bytes"),
])
def test_memory_check_wants_recomputed_tensors_let_go(checkpoint_fn, complaint):
    container = _container(checkpoint_fn)
    checks.check_checkpoint_gradients(container, cases=("mlp",))          # the gradients are right
    with pytest.raises(AssertionError, match="(?s)segments=3:.*" + complaint):
        checks.check_checkpoint_memory(container)


def test_keeping_what_was_handed_out_is_caught_at_every_segment_count():
    # two layers a segment: the smallest such leak, two activations that outlive their use
    with pytest.raises(AssertionError, match=r"(?s)segments=6:\n  during backward, 8,192 bytes \(2\.0 activations "
                                             r"of \(16, 64\)\), recomputed by layer\(s\) 8, 9 for segment 5 of 6 "
                                             r"\(layers 8 to 9\)"):
        checks.check_checkpoint_memory(_container(_replaying(hand_out="keep")), segments=(6,))


def test_a_leak_is_caught_by_what_is_left_when_the_peak_is_close():
    with pytest.raises(AssertionError, match=r"(?s)segments=2:\n  when backward\(\) returned, 28,672 bytes \(7\.0 "
                                             r"activations of \(16, 64\)\) were still alive"):
        checks.check_checkpoint_memory(_container(_replaying(kept_forever=[])), segments=(2,))


@pytest.mark.parametrize("replay, hint", [
    (dict(grad=False), r"hint: during backward your recomputation ran layer\(s\) \[0, 1, 2\] with gradients off "
                       r"\(backward runs under no_grad\), so the replayed ops saved no tensors at all.*"
                       r"recompute inside torch\.enable_grad\(\)"),
    (dict(requires_grad=False), r"hint: during backward your recomputation ran layer 0 on an input with "
                                r"requires_grad=False, where the forward's input had requires_grad=True.*saved fewer "
                                r"tensors than the forward.*x\.detach\(\)\.requires_grad_\(x\.requires_grad\)"),
])
def test_a_replay_that_saves_fewer_tensors_is_explained(replay, hint):
    with pytest.raises(AssertionError, match=r"(?s)in case 'mlp' .*segments=2: it raised KeyError: 8\n"
                                             r"    in unpack, .*" + hint):
        checks.check_checkpoint_gradients(_container(_replaying(**replay)), cases=("mlp",))


def test_a_key_error_of_its_own_gets_no_replay_hint():
    def off_by_one(fn, x):
        positions = iter(range(1, 10**6))

        def unpack(position):
            raise KeyError(position)

        with torch.autograd.graph.saved_tensors_hooks(lambda t: next(positions), unpack):
            return fn(x)

    with pytest.raises(AssertionError) as info:
        checks.check_checkpoint_gradients(_container(off_by_one), cases=("mlp",))
    assert "it raised KeyError: 9" in str(info.value) and "hint" not in str(info.value), str(info.value)


def _torch_checkpoint(fn, x):
    return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)


def _torch_checkpoint_reentrant(fn, x):
    return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)


def _course_checkpoint(fn, x):
    return checkpoint(fn, x)


@pytest.mark.parametrize("checkpoint_fn, refused", [
    (_torch_checkpoint, "torch.utils.checkpoint is switched off while exercise 05's checks run"),
    (_torch_checkpoint_reentrant, "torch.utils.checkpoint is switched off while exercise 05's checks run"),
    (_course_checkpoint, r"dtcourse\.checkpointing\.checkpoint is (part of )?the course's own answer to "
                         r"exercise 05"),
])
def test_checkpoints_that_are_not_the_students_are_refused(checkpoint_fn, refused):
    for check in (checks.check_checkpoint_gradients, checks.check_checkpoint_memory):
        with pytest.raises(AssertionError, match="it raised ReferenceRefused: " + refused):
            check(_container(checkpoint_fn))


def test_the_course_container_and_bounds_are_refused():
    class Inherits(CheckpointedSequential):
        pass

    for cls in (CheckpointedSequential, Inherits):
        for check in (checks.check_checkpoint_gradients, checks.check_checkpoint_memory):
            with pytest.raises(AssertionError, match="the course's own answer to exercise 05"):
                check(cls)
    for passed in (segment_bounds, partial(segment_bounds)):
        with pytest.raises(AssertionError, match="the course's own answer to exercise 05"):
            checks.check_segment_bounds(passed)

    def calls_the_course(n, k):
        return segment_bounds(n, k)

    with pytest.raises(AssertionError, match=r"it raised ReferenceRefused: dtcourse\.checkpointing\.segment_bounds"):
        checks.check_segment_bounds(calls_the_course)


def test_segment_check_names_the_rule_and_the_missing_error():
    def torch_rule(n, k):
        size = n // k
        return [(i * size, (i + 1) * size) for i in range(k - 1)] + [((k - 1) * size, n)]

    with pytest.raises(AssertionError, match=r"segment_bounds\(3, 2\) should be \[\(0, 2\), \(2, 3\)\] but "
                                             r"yours is \[\(0, 1\), \(1, 3\)\]\. That is torch's rule"):
        checks.check_segment_bounds(torch_rule)

    def never_complains(n, k):
        return _bounds(n, max(1, min(k, n)))

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


def test_memory_check_counts_recomputations():
    wasteful = _container(_recomputes_every_time)
    with pytest.raises(AssertionError, match=r"during backward the layers ran "
                                             r"\[11, 11, 11, 11, 12, 12, 12, 12, 0, 0, 0, 0\] "
                                             r"more times; expected \[1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0\].*"
                                             r"Recompute a segment once"):
        checks.check_checkpoint_memory(wasteful)
    checks.check_checkpoint_gradients(wasteful, cases=("mlp",))           # right, only wasteful
