"""Exercise 02 (gradient buckets): the released notebook, its checks and the autograder.

A wrong bucket rule and a missing division by N each fail only their own checks, with the
bucket or the parameter, rank and factor named; a deadlock fails after the timeout. Full marks
for the solution and zero for the untouched exercise are checked with every exercise's, in
``test_grading.py``. Each grading run starts one Jupyter kernel (a few seconds). Run just these with
``pytest -q test_data_parallel_exercise.py``, and everything about this exercise with
``pytest -q tests -k "02_data_parallel_buckets or test_data_parallel_exercise"``.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from dtcourse import checks
from dtcourse.data_parallel import assign_buckets
from exercise_harness import EXPECTED, assert_released, by_id, failed, grade_answers, solution_code

NAME = "02_data_parallel_buckets"
POINTS = EXPECTED[NAME].points

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
# finish() copies the all-reduced sums back without dividing by the world size.
SUM_NOT_MEAN = '''
class OverlappedDDP(DDPBase):
    def grad_ready(self, i):
        if not self.finish_queued:
            self.finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        bucket = self.bucket_of[i]
        lo, hi = bucket.span[i]
        bucket.flat[lo:hi].copy_(self.params[i].grad.reshape(-1))
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.work = dist.all_reduce(bucket.flat, async_op=True)

    def finish(self):
        for bucket in self.buckets:
            bucket.work.wait()
            for i, (lo, hi) in bucket.span.items():
                self.params[i].grad.copy_(bucket.flat[lo:hi].view_as(self.params[i]))
'''


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["queue_callback(self.finish)", 'cases=("dtypes"'], stubs={"overlapped_ddp": 2},
                    given={"overlapped_ddp": ["def grad_ready(self, i: int)", "def finish(self)"],
                           "scaffold": ["register_post_accumulate_grad_hook"]})


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_wrong_bucket_rule_fails_only_the_bucket_checks(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), assign_buckets=WRONG_ASSIGN_BUCKETS))
    result = by_id(report)
    assert report.score == POINTS - 4, str(report)
    assert failed(report) == ["check_buckets", "check_buckets_hidden"], str(report)
    message = result["check_buckets"].message
    assert "case 'mlp'" in message and "cap_bytes=240" in message, message
    assert "bucket 0 should be [5, 4] but yours is [5, 4, 3]" in message, message
    assert "reach cap_bytes (>=)" in message, message


def test_sum_instead_of_mean_names_parameter_rank_and_factor(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), overlapped_ddp=SUM_NOT_MEAN))
    result = by_id(report)
    assert report.score == POINTS - 6, str(report)
    assert failed(report) == ["check_parity", "check_parity_hidden"], str(report)
    visible, hidden = result["check_parity"].message, result["check_parity_hidden"].message
    assert "OverlappedDDP is wrong at world size 2 in case 'mlp'" in visible, visible
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: step 1, parameter 'net\.0\.weight' \(13, 7\): .grad differs "
                         r"from the mean gradient over all ranks by up to \S+", visible), visible
    assert "It is N = 2 times the mean" in visible and "divide by the world size" in visible, visible
    assert "world size 3" in hidden and "It is N = 3 times the mean" in hidden, hidden


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
def test_reference_passes_every_bucket_case():
    checks.check_bucket_assignment(assign_buckets, cases=("mlp", "dtypes", "tiny", "gpt", "empty"))


def test_bucket_check_recognises_forward_order():
    def forward_order(params, cap_bytes):
        return [list(reversed(bucket)) for bucket in reversed(assign_buckets(params[::-1], cap_bytes))]

    with pytest.raises(AssertionError, match=r"(?s)bucket 0 should be \[5\] but yours is \[0\].*"
                                             r"hint: walk the parameters from the last"):
        checks.check_bucket_assignment(forward_order, cases=("mlp",))


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


def _overlap_variant(sync: bool, late: bool):
    """A correct wrapper except that its all-reduces block (sync) or start after backward (late)."""
    from dtcourse.data_parallel import DistributedDataParallel

    class Variant(DistributedDataParallel):
        def __init__(self, module, bucket_cap_mb):
            super().__init__(module, bucket_cap_mb, overlap=not late)

        def _all_reduce_sum(self, tensor, async_op):
            return dist.all_reduce(tensor, async_op=async_op and not sync)

    return Variant


@pytest.mark.parametrize("sync, late, complaint", [
    (False, False, None),
    (True, False, r"all-reduce\(s\) \[0, 1, 2\] ran with async_op=False"),
    (False, True, r"no communication overlapped with backward: your all-reduces of 60, 154, 104 elements "
                  r"started after 6, 6, 6 of the 6 gradients"),
])
def test_overlap_check(sync, late, complaint):
    variant = _overlap_variant(sync, late)
    if complaint is None:
        checks.check_overlap(variant, world_size=2)
    else:
        with pytest.raises(AssertionError, match=complaint):
            checks.check_overlap(variant, world_size=2)
