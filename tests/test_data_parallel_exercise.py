"""Exercise 02 (gradient buckets): the released notebook, its checks and the autograder.

The exercise is ``dtcourse.data_parallel.DistributedDataParallel`` with holes: the scaffolding is
its set-up with the library's own ``Bucket``, and the student writes ``assign_buckets`` and the
backward half (``_grad_ready``, ``_launch_ready_buckets``, ``_launch``, ``_finish_backward``,
``_complete``). A wrong bucket rule and a missing division by N each fail only their own checks, with
the bucket or the parameter, rank and factor named; a deadlock fails after the timeout. The checks of
the technique (one all-reduce per bucket, in index order, started in the hook that completes it, every
handle waited on) carry 7 of the 12 points, so a wrapper that averages right without buckets or overlap
scores under half; a wrapper that forgets to wait on a handle fails the same checks on every run; one
that launches buckets as they fill, out of index order, fails on layers registered out of order; the
course's own wrapper, its methods, and PyTorch's wrapper are refused. Full marks for the solution and
zero for the untouched exercise are checked with every exercise's, in ``test_grading.py``. Each grading run starts one
Jupyter kernel (a few seconds). Run just these with ``pytest -q test_data_parallel_exercise.py``,
and everything about this exercise with
``pytest -q tests -k "02_data_parallel_buckets or test_data_parallel_exercise"``.

The wrappers handed to the checks here are defined in this file (or run from the notebook's
cells, compiled under this file's name): to the checks, they are a student's code.
"""

from __future__ import annotations

import functools
import re
import time

import pytest
import torch
import torch.distributed as dist

from dtcourse import checks
from dtcourse.data_parallel import DistributedDataParallel, assign_buckets
from exercise_harness import (EXPECTED, assert_released, by_id, failed, grade_answers, nbgrader_cells, solution_code,
                              source_path)

NAME = "02_data_parallel_buckets"
POINTS = EXPECTED[NAME].points
TECHNIQUE = ["check_overlap", "check_overlap_hidden"]      # 3 + 4 of the 12 points

# The bucket closes only once it holds *more* than the cap: wrong at a cap that is reached exactly.
WRONG_ASSIGN_BUCKETS = '''
def assign_buckets(params, cap_bytes):
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        if current and params[i].dtype != params[current[0]].dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size > cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets
'''
# _complete copies the all-reduced sums back without dividing by the world size.
SUM_NOT_MEAN = '''
class OverlappedDDP(DDPBase):
    def _grad_ready(self, i):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._bucket_of[i].pending -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self):
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bucket):
        for p, (lo, hi) in zip(bucket.params, bucket.spans):
            bucket.flat[lo:hi].copy_(p.grad.reshape(-1))
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def _finish_backward(self):
        for bucket in self._buckets:
            self._complete(bucket)
        self._reset()

    def _complete(self, bucket):
        bucket.work.wait()
        for p, (lo, hi) in zip(bucket.params, bucket.spans):
            p.grad.copy_(bucket.flat[lo:hi].view(p.shape))
'''
# Right gradients, the lesson's first step: one blocking all-reduce per parameter, after backward.
NO_BUCKETS_NO_OVERLAP = '''
class OverlappedDDP(DDPBase):
    def _grad_ready(self, i):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self):
        for bucket in self._buckets:
            for p in bucket.params:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= self.world_size
        self._reset()
'''
# The course's answers, imported instead of written.
IMPORTS_THE_COURSE = {
    "assign_buckets": "from dtcourse.data_parallel import assign_buckets",
    "overlapped_ddp": "from dtcourse.data_parallel import DistributedDataParallel as OverlappedDDP",
}
# Correct, and written differently from the solution: buckets by a running total over the reversed
# indices, and a wrapper that concatenates a complete bucket's gradients, waits through futures, and
# sets each .grad to a fresh tensor.
DIFFERENT_BUT_RIGHT = {
    "assign_buckets": '''
def assign_buckets(params, cap_bytes):
    order = list(range(len(params)))[::-1]
    buckets = []
    for i in order:
        kind = (params[i].dtype, params[i].device)
        open_bucket = buckets and not buckets[-1]["closed"] and buckets[-1]["kind"] == kind
        if not open_bucket:
            if buckets:
                buckets[-1]["closed"] = True
            buckets.append({"ids": [], "bytes": 0, "kind": kind, "closed": False})
        bucket = buckets[-1]
        bucket["ids"].append(i)
        bucket["bytes"] += params[i].nbytes
        bucket["closed"] = bucket["bytes"] >= cap_bytes
    return [bucket["ids"] for bucket in buckets]
''',
    "overlapped_ddp": '''
class OverlappedDDP(DDPBase):
    def _grad_ready(self, i):
        if not self._callback_queued:
            self._callback_queued, self.in_flight = True, []
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._bucket_of[i].pending -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self):
        for bucket in self._buckets[self._next:]:
            if bucket.pending:
                break
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket):
        flat = torch.cat([p.grad.flatten() for p in bucket.params])
        future = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True).get_future()
        self.in_flight.append((bucket, flat, future))

    def _finish_backward(self):
        for bucket, flat, future in self.in_flight:
            self._complete(bucket, flat, future)
        self._reset()

    def _complete(self, bucket, flat, future):
        future.wait()
        mean = flat / self.world_size
        for p, (lo, hi) in zip(bucket.params, bucket.spans):
            p.grad = mean[lo:hi].view_as(p).clone()
''',
}


def _notebook() -> dict:
    """The solution's classes, compiled under this file's name: the checks take them for a student's."""
    cells, answers = nbgrader_cells(source_path(NAME)), solution_code(NAME)
    code = "\n\n".join([cells["setup"], answers["assign_buckets"], cells["scaffold"], answers["overlapped_ddp"]])
    namespace: dict = {"__name__": __name__}
    exec(compile(code, __file__, "exec"), namespace)
    return namespace


NOTEBOOK = _notebook()
DDPBase, OverlappedDDP = NOTEBOOK["DDPBase"], NOTEBOOK["OverlappedDDP"]


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["queue_callback(self._finish_backward)", "self._next += 1", 'cases=("dtypes"',
                                  'cases=("tiny", "frozen"'],
                    stubs={"overlapped_ddp": 5},
                    given={"overlapped_ddp": ["def _grad_ready(self, i: int) -> None:",
                                              "def _launch_ready_buckets(self) -> None:",
                                              "def _launch(self, bucket: Bucket) -> None:",
                                              "def _finish_backward(self) -> None:",
                                              "def _complete(self, bucket: Bucket) -> None:"],
                           "scaffold": ["from dtcourse.data_parallel.buckets import Bucket",
                                        "register_post_accumulate_grad_hook", "def _reset(self) -> None:"]})


def test_the_scaffolding_is_the_library_s_own():
    """The given Bucket is the library's, and the student's methods are DistributedDataParallel's, by name."""
    from dtcourse.data_parallel.buckets import Bucket
    assert NOTEBOOK["Bucket"] is Bucket
    written = {name for name in vars(OverlappedDDP) if callable(vars(OverlappedDDP)[name])}
    assert written == {"_grad_ready", "_launch_ready_buckets", "_launch", "_finish_backward", "_complete"}
    assert written <= set(vars(DistributedDataParallel))
    refused = {name.rpartition(".")[2] for name in checks.data_parallel.ANSWERS.course if isinstance(name, str)}
    assert written <= refused and "Bucket" not in refused, refused


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_wrong_bucket_rule_and_a_sum_fail_only_their_own_checks(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), assign_buckets=WRONG_ASSIGN_BUCKETS,
                                                overlapped_ddp=SUM_NOT_MEAN))
    result = by_id(report)
    assert failed(report) == ["check_buckets", "check_buckets_hidden", "check_parity", "check_parity_hidden"], \
        str(report)
    assert report.score == POINTS - 2 - 3, str(report)
    message = result["check_buckets"].message
    assert "case 'mlp'" in message and "cap_bytes=240" in message, message
    assert "bucket 0 should be [5, 4] but yours is [5, 4, 3]" in message, message
    assert "reach cap_bytes (>=)" in message, message
    visible, hidden = result["check_parity"].message, result["check_parity_hidden"].message
    assert "OverlappedDDP is wrong at world size 2 in case 'mlp'" in visible, visible
    assert re.search(r"ranks 0 and 1: step 1, parameter 'net\.0\.weight' \(13, 7\): .grad differs "   # the same on both
                     r"from the mean gradient over all ranks by up to \S+", visible), visible
    assert "It is N = 2 times the mean" in visible and "divide by the world size" in visible, visible
    assert "world size 3" in hidden and "It is N = 3 times the mean" in hidden, hidden


def test_right_gradients_without_buckets_or_overlap_score_under_half(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), overlapped_ddp=NO_BUCKETS_NO_OVERLAP))
    assert failed(report) == TECHNIQUE, str(report)
    assert report.score == 5 < POINTS / 2, str(report)
    visible, hidden = by_id(report)["check_overlap"].message, by_id(report)["check_overlap_hidden"].message
    assert "expected one all-reduce per bucket, 3 of them (480 B, 1232 B, 832 B), but backward() made 6" \
        in visible, visible
    assert "That is one per parameter" in visible, visible
    assert "world size 3 in case 'tiny'" in hidden and "ran with async_op=False" in hidden, hidden


def test_importing_the_course_answers_scores_nothing(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), **IMPORTS_THE_COURSE))
    assert report.score == 0 and len(failed(report)) == EXPECTED[NAME].checks, str(report)
    result = by_id(report)
    for grade_id in ("check_buckets", "check_buckets_hidden"):
        assert re.search(r"check_bucket_assignment was given dtcourse\.data_parallel\.buckets\.assign_buckets, "
                         r"(which is )?the course's own answer to exercise 02", result[grade_id].message), str(report)
    for grade_id in ("check_parity", "check_parity_hidden", "check_overlap", "check_overlap_hidden"):
        assert re.search(r"was given (dtcourse\.data_parallel\.ddp\.)?DistributedDataParallel, which is (a finished "
                         r"DDP wrapper \()?the course's own answer to exercise 02", result[grade_id].message), \
            result[grade_id].message


def test_a_right_answer_written_differently_gets_full_marks(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), **DIFFERENT_BUT_RIGHT))
    assert report.score == POINTS and not failed(report), str(report)


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
def _different_assign_buckets():
    namespace: dict = {}
    exec(compile(DIFFERENT_BUT_RIGHT["assign_buckets"], __file__, "exec"), namespace)
    return namespace["assign_buckets"]


def test_a_different_bucket_rule_that_is_right_passes_every_case():
    checks.check_bucket_assignment(_different_assign_buckets(), cases=("mlp", "dtypes", "tiny", "gpt", "empty"))


def test_bucket_check_recognises_forward_order():
    mine = _different_assign_buckets()

    def forward_order(params, cap_bytes):
        return [list(reversed(bucket)) for bucket in reversed(mine(params[::-1], cap_bytes))]

    with pytest.raises(AssertionError, match=r"(?s)bucket 0 should be \[5\] but yours is \[0\].*"
                                             r"hint: walk the parameters from the last"):
        checks.check_bucket_assignment(forward_order, cases=("mlp",))


def test_the_course_answers_are_refused():
    for passed in (assign_buckets, functools.partial(assign_buckets)):
        with pytest.raises(AssertionError, match=r"check_bucket_assignment was given dtcourse\.data_parallel\.buckets"
                                                 r"\.assign_buckets, (which is )?the course's own answer to exercise 02"):
            checks.check_bucket_assignment(passed)

    def calls_the_course(params, cap_bytes):
        return assign_buckets(params, cap_bytes)

    with pytest.raises(AssertionError, match=r"it raised ReferenceRefused: dtcourse\.data_parallel\.buckets\."
                                             r"assign_buckets is (part of )?the course's own answer to exercise 02"):
        checks.check_bucket_assignment(calls_the_course)

    class Inherits(DistributedDataParallel):
        pass

    for cls in (DistributedDataParallel, Inherits, torch.nn.parallel.DistributedDataParallel):
        for check in (checks.check_ddp_parity, checks.check_overlap):
            with pytest.raises(AssertionError, match=r"was given \S*(DistributedDataParallel|Inherits), which is"):
                check(cls)

    class Borrows(OverlappedDDP):   # the scaffolding's shape is the library's: its method would fit
        _launch_ready_buckets = DistributedDataParallel._launch_ready_buckets

    with pytest.raises(AssertionError, match=r"raised ReferenceRefused: dtcourse\.data_parallel\.ddp\."
                                             r"DistributedDataParallel\._launch_ready_buckets is (part of )?the "
                                             r"course's own answer to exercise 02"):
        checks.check_overlap(Borrows)


class _BuildsTorchDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.inner = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)

    def forward(self, x):
        return self.inner(x)


class _BuildsCourseDDP(_BuildsTorchDDP):
    def __init__(self, module, bucket_cap_mb):
        torch.nn.Module.__init__(self)
        self.inner = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)


@pytest.mark.parametrize("cls, refused", [
    (_BuildsTorchDDP, r"torch\.nn\.parallel\.DistributedDataParallel is switched off while exercise 02's checks run"),
    (_BuildsCourseDDP, r"dtcourse\.data_parallel\.ddp\.DistributedDataParallel is (part of )?the course's own "
                       r"answer"),
])
def test_a_wrapper_that_builds_a_finished_ddp_is_refused(cls, refused):
    with pytest.raises(AssertionError, match=r"building the wrapper: rank \d raised ReferenceRefused: " + refused):
        checks.check_ddp_parity(cls)


class _Deadlocks(torch.nn.Module):
    """Rank 0 waits for a message rank 1 never sends; rank 1 waits in the next step's all-reduce."""

    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module = module

    def forward(self, x):
        if dist.get_rank() == 0:
            dist.recv(torch.zeros(1), src=1)
        return self.module(x)


def test_a_deadlock_fails_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        checks.check_ddp_parity(_Deadlocks, world_sizes=(2,), timeout=2)
    message = str(info.value)
    assert "_Deadlocks did not finish at world size 2 within 2 s" in message, message
    assert "rank(s) [0] in case 'mlp'" in message and "deadlock" in message, message
    assert time.monotonic() - start < 20


class _WaitsOnTheLastHandleOnly(OverlappedDDP):
    """The race of issue 10: right whenever the earlier buckets' all-reduces happened to finish in time."""

    def _complete(self, bucket):
        if bucket is self._buckets[-1]:
            bucket.work.wait()
        bucket.flat /= self.world_size
        for p, (lo, hi) in zip(bucket.params, bucket.spans):
            p.grad.copy_(bucket.flat[lo:hi].view(p.shape))


def test_a_forgotten_wait_fails_the_same_way_every_time():
    def failures() -> tuple[str, ...]:
        found = []
        for check in (lambda: checks.check_ddp_parity(_WaitsOnTheLastHandleOnly),
                      lambda: checks.check_overlap(_WaitsOnTheLastHandleOnly),
                      lambda: checks.check_overlap(_WaitsOnTheLastHandleOnly, world_sizes=(3,), cases=("tiny",))):
            with pytest.raises(AssertionError) as info:
                check()
            found.append(str(info.value))
        return tuple(found)

    runs = [failures() for _ in range(3)]
    assert runs[0] == runs[1] == runs[2], runs
    parity, overlap, tiny = runs[0]
    assert "The handle(s) of all-reduce(s) [0, 1] of this backward (in the order they started) were never " \
           "waited on" in parity, parity
    assert "the handle(s) of all-reduce(s) [0, 1] (in the order they started) were never waited on before " \
           "backward() returned" in overlap, overlap
    assert "all-reduce(s) [0, 1, 2, 3, 4] (in the order they started) were never waited on" in tiny, tiny


class _NeverResets(OverlappedDDP):
    """Right in the first step; _finish_backward forgets _reset(), so the next backward launches nothing."""

    def _finish_backward(self):
        for bucket in self._buckets:
            self._complete(bucket)


def test_a_wrapper_that_never_resets_is_told_so():
    with pytest.raises(AssertionError) as info:
        checks.check_ddp_parity(_NeverResets)
    message = str(info.value)
    assert "step 2, parameter 'net.0.weight'" in message, message
    assert "It is still this rank's own gradient" in message, message
    assert "The backward of step 2 started no all-reduce, though an earlier one did: does _finish_backward end " \
           "with self._reset()" in message, message


class _Blocking(OverlappedDDP):
    """Each bucket's all-reduce starts in the hook that completes it, and blocks it."""

    def _launch(self, bucket):
        for p, (lo, hi) in zip(bucket.params, bucket.spans):
            bucket.flat[lo:hi].copy_(p.grad.reshape(-1))
        dist.all_reduce(bucket.flat)

    def _complete(self, bucket):
        bucket.flat /= self.world_size
        for p, (lo, hi) in zip(bucket.params, bucket.spans):
            p.grad.copy_(bucket.flat[lo:hi].view(p.shape))


class _InFinish(OverlappedDDP):
    """Bucketed, but every all-reduce starts after backward: the lesson's step 2."""

    def _grad_ready(self, i):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._bucket_of[i].pending -= 1

    def _finish_backward(self):
        for bucket in self._buckets[self._next:]:
            self._launch(bucket)
        super()._finish_backward()


class _AllInTheLastHook(OverlappedDDP):
    """Bucketed and asynchronous, but nothing starts before the last gradient."""

    def _launch_ready_buckets(self):
        if all(bucket.pending == 0 for bucket in self._buckets):
            super()._launch_ready_buckets()


class _AsTheyFill(OverlappedDDP):
    """The exercise's former shape: a bucket starts the moment it is complete, whatever its index."""

    def _grad_ready(self, i):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket = self._bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)


class _LaunchesTheNextEarly(OverlappedDDP):
    """In index order, but bucket _next starts whenever any bucket is complete, its own gradients or not."""

    def _grad_ready(self, i):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._bucket_of[i].pending -= 1
        if self._bucket_of[i].pending == 0:
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bucket):
        for p, (lo, hi) in zip(bucket.params, bucket.spans):
            if p.grad is None:                   # not produced yet: the bucket started too early
                bucket.flat[lo:hi].zero_()
            else:
                bucket.flat[lo:hi].copy_(p.grad.reshape(-1))
        bucket.work = dist.all_reduce(bucket.flat, async_op=True)


class _WaitsEarly(OverlappedDDP):
    """Waits on a bucket's handle in the hook that started it."""

    def _launch(self, bucket):
        super()._launch(bucket)
        bucket.work.wait()


class _OnePerParameter(DDPBase):
    """Overlapped, but one all-reduce per gradient: no buckets."""

    def _grad_ready(self, i):
        if not self._callback_queued:
            self._callback_queued, self.works = True, []
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket = self._bucket_of[i]
        p = bucket.params[bucket.param_ids.index(i)]
        self.works.append(dist.all_reduce(p.grad, async_op=True))

    def _finish_backward(self):
        for work in self.works:
            work.wait()
        for bucket in self._buckets:
            for p in bucket.params:
                p.grad /= self.world_size
        self._reset()


@pytest.mark.parametrize("cls, cases, complaint", [
    (OverlappedDDP, None, None),
    (_Blocking, ("mlp",), r"all-reduce\(s\) \[0, 1, 2\] ran with async_op=False"),
    (_InFinish, ("mlp",), r"all-reduce\(s\) \[0, 1, 2\] started only after backward had produced every gradient .*: "
                          r"your all-reduces of 480 B, 1232 B, 832 B started after 6, 6, 6 of the 6 gradients"),
    (_AllInTheLastHook, ("mlp",), r"all-reduce\(s\) \[0, 1\] started only once every gradient was ready, so they "
                                  r"could not overlap with backward: .*, but they could start after 2, 4, when"),
    (_AsTheyFill, ("mlp", "reordered"), r"(?s)case 'reordered' .*all-reduce 0 carried 480 B, but bucket 0 holds "
                                        r"1232 B: your all-reduces of 480 B, 1232 B, 832 B started after 2, 4, 6 of "
                                        r"the 6 gradients were ready\. The buckets were complete in the order "
                                        r"\[2, 0, 1\]"),
    (_LaunchesTheNextEarly, ("mlp", "reordered"), r"(?s)case 'reordered' .*all-reduce 0 started after only 2 of the 6 "
                                                  r"gradients, but bucket 0 was complete only after 4"),
    (_WaitsEarly, ("mlp",), r"all-reduce 0's handle was waited on after only 2 of the 6 gradients"),
    (_OnePerParameter, ("mlp",), r"expected one all-reduce per bucket, 3 of them \(480 B, 1232 B, 832 B\), but "
                                 r"backward\(\) made 6: your all-reduces of 40 B, 440 B, 88 B, 1144 B, 104 B, 728 B "
                                 r"started after 1, 2, 3, 4, 5, 6 of the 6 gradients were ready\. That is one per "
                                 r"parameter"),
])
def test_overlap_check(cls, cases, complaint):
    if complaint is None:
        checks.check_overlap(cls, world_sizes=(2, 3), cases=("mlp", "tiny", "frozen", "one_bucket", "reordered", "gpt"))
    else:
        with pytest.raises(AssertionError, match=complaint):
            checks.check_overlap(cls, cases=cases)
