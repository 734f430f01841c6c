"""Exercise 06 (the ZeRO stage-2 step): the released notebook, its checks, and what they refuse.

The checks test the algorithm, not only the answer: a step that averages right with an all-reduce
fails the technique's checks (8 of the 14 points), one that keeps every gradient until backward ends
(stage 1) or never frees the .grad fails part 1's (4 points), and each names the rank, the bucket
and the bytes; a forgotten division, the wrong part, a missing all-gather, gradients that accumulate
across steps and a full-model optimizer fail with a hint that says which; a deadlock fails after the
timeout; the course's own ``dtcourse.zero.ZeRO`` is refused. Everything here calls the checks
directly (each launch forks its ranks in well under a second); full marks for the solution and zero
for the untouched exercise are checked with every exercise's, in ``test_grading.py``. Run just these
with ``pytest -q tests/test_zero_exercise.py``, and everything about this exercise with
``pytest -q tests -k "06_zero_stage2 or test_zero_exercise"``.

The classes handed to the checks are defined in this file (or compiled from the notebook's cells
under this file's name): to the checks, they are a student's code.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from dtcourse import checks
from dtcourse.zero import ZeRO
from exercise_harness import EXPECTED, assert_released, nbgrader_cells, solution_code, source_path

NAME = "06_zero_stage2"
ALL_CASES = ("mlp", "per_parameter", "one_bucket", "scattered", "tiny", "gpt")


def _notebook() -> dict:
    """The solution's classes, compiled under this file's name: the checks take them for a student's."""
    cells, answers = nbgrader_cells(source_path(NAME)), solution_code(NAME)
    code = "\n\n".join([cells["setup"], cells["scaffold"], answers["zero_stage2"]])
    namespace: dict = {"__name__": __name__}
    exec(compile(code, __file__, "exec"), namespace)
    return namespace


NOTEBOOK = _notebook()
ZeroBase, ZeroStage2 = NOTEBOOK["ZeroBase"], NOTEBOOK["ZeroStage2"]


def _flat_gradient(self, bucket) -> torch.Tensor:
    """The bucket's (N·s,) gradient, zero in the padding; the .grad are dropped."""
    grad = torch.zeros_like(bucket.flat)
    for j in bucket.ids:
        lo, hi = bucket.span[j]
        grad[lo:hi] = self.params[j].grad.reshape(-1)
        self.params[j].grad = None
    return grad


# --------------------------------------------------------------------------- #
# Wrong answers, each a student's plausible mistake
# --------------------------------------------------------------------------- #
class _SumNotMean(ZeroStage2):
    """Reduce-scatters, but keeps the sum over the ranks."""

    def grad_ready(self, i):
        bucket = self.bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            part = torch.empty(bucket.size)
            dist.reduce_scatter_single(part, _flat_gradient(self, bucket))
            bucket.shard.grad = part


class _NextRanksPart(ZeroStage2):
    """All-reduces the bucket (twice the bytes) and keeps the next rank's part of the mean."""

    def grad_ready(self, i):
        bucket = self.bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            grad = _flat_gradient(self, bucket)
            dist.all_reduce(grad)
            r, s = (self.rank + 1) % self.world_size, bucket.size
            bucket.shard.grad = grad[r * s:(r + 1) * s].clone() / self.world_size


class _AllReduced(ZeroStage2):
    """Right numbers, the way data parallelism gets them: an all-reduce of each bucket, then a slice."""

    def grad_ready(self, i):
        bucket = self.bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            grad = _flat_gradient(self, bucket)
            dist.all_reduce(grad)              # sends 2(N-1)/N * grad.nbytes
            s = bucket.size
            bucket.shard.grad = grad[self.rank * s:(self.rank + 1) * s].clone() / self.world_size


class _Stage1(ZeroStage2):
    """Right numbers and bytes, but every gradient is kept until backward ends, then reduce-scattered."""

    def grad_ready(self, i):
        if all(b.pending == len(b.ids) for b in self.buckets):
            torch.autograd.Variable._execution_engine.queue_callback(self.after_backward)
        self.bucket_of[i].pending -= 1

    def after_backward(self):
        for bucket in self.buckets:
            bucket.pending = 1
            super().grad_ready(bucket.ids[0])


class _KeepsTheGrad(ZeroStage2):
    """Reduce-scatters each bucket in its hook, but never drops the parameters' .grad."""

    def grad_ready(self, i):
        bucket = self.bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            grad = torch.zeros_like(bucket.flat)
            for j in bucket.ids:
                lo, hi = bucket.span[j]
                grad[lo:hi] = self.params[j].grad.reshape(-1)
            part = torch.empty(bucket.size)
            dist.reduce_scatter_single(part, grad)
            bucket.shard.grad = part / self.world_size


class _KeepsABuffer(ZeroStage2):
    """Right, but keeps each bucket's whole flat gradient in the bucket, as DDP keeps its buffers."""

    def grad_ready(self, i):
        bucket = self.bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.gradient = _flat_gradient(self, bucket)
            part = torch.empty(bucket.size)
            dist.reduce_scatter_single(part, bucket.gradient)
            bucket.shard.grad = part / self.world_size


class _ShardIsAView(ZeroStage2):
    """Right numbers and bytes, but shard.grad is a view into the whole reduced bucket."""

    def grad_ready(self, i):
        bucket = self.bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            grad = _flat_gradient(self, bucket)
            out = torch.empty_like(grad)
            dist.reduce_scatter_single(out[:bucket.size], grad)
            bucket.shard.grad = out[:bucket.size].div_(self.world_size)


class _NoAllGather(ZeroStage2):
    """Steps the shards and stops there: the model's parameters never change."""

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()


class _OwnPartOnly(ZeroStage2):
    """Copies this rank's updated shard into flat, and nothing more."""

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.flat[self.rank * bucket.size:(self.rank + 1) * bucket.size] = bucket.shard


class _AllReducesParameters(ZeroStage2):
    """Right parameters, by an all-reduce of flat with only this rank's part filled in: twice the bytes."""

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.flat.zero_()
                bucket.flat[self.rank * bucket.size:(self.rank + 1) * bucket.size] = bucket.shard
                dist.all_reduce(bucket.flat)


class _AddsToTheShardGrad(ZeroStage2):
    """Adds each backward's reduced part to shard.grad, and step() never clears it: step k steps the sum."""

    def grad_ready(self, i):
        bucket = self.bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            part = torch.empty(bucket.size)
            dist.reduce_scatter_single(part, _flat_gradient(self, bucket))
            if bucket.shard.grad is None:
                bucket.shard.grad = part / self.world_size
            else:
                bucket.shard.grad += part / self.world_size

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for bucket in self.buckets:
                dist.all_gather_single(bucket.flat, bucket.shard)


class _ForgetsTheOptimizer(ZeroStage2):
    """Builds a new optimizer for every step: right at step 1, then its momentum or moments start again."""

    def __init__(self, module, optimizer, buckets):
        super().__init__(module, optimizer, buckets)
        self.make_optimizer = optimizer

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for bucket in self.buckets:
                dist.all_gather_single(bucket.flat, bucket.shard)
        self.optimizer = self.make_optimizer([bucket.shard for bucket in self.buckets])


class _WholeModelOptimizer(ZeroStage2):
    """Builds a second optimizer on the whole model, and steps it with all-gathered gradients."""

    def __init__(self, module, optimizer, buckets):
        super().__init__(module, optimizer, buckets)
        self.everything = optimizer(module.parameters())


class _WaitsForRankOne(ZeroStage2):
    """Rank 0 waits for a message rank 1 never sends; rank 1 waits in the first reduce-scatter."""

    def grad_ready(self, i):
        if self.rank == 0:
            dist.recv(torch.zeros(1), src=1)
        super().grad_ready(i)


class _BuildsTheCourses(torch.nn.Module):
    """Hands the work to the course's own ZeRO."""

    def __init__(self, module, optimizer, buckets):
        super().__init__()
        self.zero = ZeRO(module, 2, optimizer)

    def forward(self, x):
        return self.zero(x)

    def step(self):
        self.zero.step()
        self.zero.zero_grad()


class _Inherits(ZeRO):
    pass


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["reduce_scatter_single(part, grad)", "all_gather_single(bucket.flat",
                                  'world_sizes=(3, 5)'],
                    stubs={"zero_stage2": 2},
                    given={"zero_stage2": ["def grad_ready(self, i: int) -> None:", "def step(self) -> None:"],
                           "scaffold": ["register_post_accumulate_grad_hook", "size = -(-lo // self.world_size)",
                                        "self.optimizer = optimizer([bucket.shard for bucket in self.buckets])"]})
    assert EXPECTED[NAME].points == 14


# --------------------------------------------------------------------------- #
# The solution passes everything, hidden cases included
# --------------------------------------------------------------------------- #
def test_the_solution_passes_every_check_at_every_world_size():
    for world_sizes in ((2,), (3, 5), (4, 6)):
        checks.check_zero_gradients(ZeroStage2, world_sizes=world_sizes, cases=ALL_CASES)
        checks.check_zero_memory(ZeroStage2, world_sizes=world_sizes, cases=ALL_CASES)
        checks.check_zero_traffic(ZeroStage2, world_sizes=world_sizes, cases=ALL_CASES)
    checks.check_zero_parity(ZeroStage2, world_sizes=(1, 2, 3, 4, 5, 6), cases=ALL_CASES)


# --------------------------------------------------------------------------- #
# Part 1: the numbers, and the technique
# --------------------------------------------------------------------------- #
def test_a_sum_not_a_mean_is_named_with_its_factor():
    with pytest.raises(AssertionError) as info:
        checks.check_zero_gradients(_SumNotMean, world_sizes=(3,))
    message = str(info.value)
    assert "_SumNotMean is wrong at world size 3 in case 'mlp'" in message, message
    for rank in range(3):
        assert re.search(rf"rank {rank}: bucket 0 \(net\.4\.bias, net\.4\.weight, net\.2\.bias: 71 elements padded "
                         rf"to 72, 24 per rank\): shard\.grad differs from this rank's part of the mean gradient "
                         rf"\(elements \[{24 * rank}, {24 * rank + 24}\) of the padded bucket\) by up to \S+ at "
                         r"net\.\d\.\w+\[\d+\]", message), message
    assert "It is N = 3 times the mean" in message and "divide by the world size" in message, message


def test_another_ranks_part_is_named():
    with pytest.raises(AssertionError, match=r"rank 0: bucket 0 .*It is rank 1's part: rank r keeps elements"):
        checks.check_zero_gradients(_NextRanksPart, world_sizes=(2,))


def test_right_gradients_by_an_all_reduce_fail_the_technique():
    checks.check_zero_gradients(_AllReduced, world_sizes=(2, 3), cases=ALL_CASES)
    checks.check_zero_parity(_AllReduced, world_sizes=(3,), optimizers=("adamw",))
    with pytest.raises(AssertionError) as info:
        checks.check_zero_memory(_AllReduced, world_sizes=(2,))
    message = str(info.value)
    assert "bucket 0 (net.4.bias, net.4.weight, net.2.bias: 71 elements padded to 72, 36 per rank) was all-reduced " \
           "(an all-reduce of 288 B, 288 B sent)" in message, message
    with pytest.raises(AssertionError) as info:
        checks.check_zero_traffic(_AllReduced, world_sizes=(2,))
    message = str(info.value)
    assert "backward should make one reduce-scatter per bucket, of its padded flat gradient (288 B, 576 B, 416 B)" \
           in message, message
    assert "rank 0 sent 1920 B in step 1; a stage-2 step sends 2 · (N-1)/N · Ψ · 4 = 2 · 1/2 · 320 · 4 = 1280 B" \
           in message, message


def test_stage_1_keeps_every_gradient_and_fails_only_the_memory_check():
    checks.check_zero_gradients(_Stage1, world_sizes=(2,))
    checks.check_zero_traffic(_Stage1, world_sizes=(2,))
    with pytest.raises(AssertionError) as info:
        checks.check_zero_memory(_Stage1, world_sizes=(2,))
    message = str(info.value)
    assert "bucket 0 (net.4.bias, net.4.weight, net.2.bias: 71 elements padded to 72, 36 per rank) had all its " \
           "gradients after 3 of the 6 gradients, but by the end of that hook only 0 reduce-scatter(s) had started" \
           in message, message
    assert "backward ends). The most .grad bytes alive at once were 1272 B; the whole model's gradient is 1272 B" \
        in message, message


def test_gradients_left_in_grad_are_named_with_their_bytes():
    with pytest.raises(AssertionError) as info:
        checks.check_zero_memory(_KeepsTheGrad, world_sizes=(2,))
    message = str(info.value)
    assert "after the hook that completed bucket 0 (net.4.bias, net.4.weight, net.2.bias: 71 elements padded to 72, " \
           "36 per rank), its gradient(s) 'net.4.bias' (20 B), 'net.4.weight' (220 B), 'net.2.bias' (44 B) were " \
           "still in .grad" in message, message


@pytest.mark.parametrize("cls, complaint", [
    (_KeepsABuffer, r"the wrapper still holds a tensor of 72 elements \(288 B\) at self\.buckets\[0\]\.gradient: the "
                    r"size of bucket 0 \(.*\)'s whole gradient"),
    (_ShardIsAView, r"bucket 0 \(.*\): shard\.grad has 36 elements on a storage of 288 B, but rank \d keeps only its "
                    r"part: 36 elements, 144 B"),
])
def test_a_whole_bucket_kept_anywhere_fails(cls, complaint):
    checks.check_zero_gradients(cls, world_sizes=(2,))
    with pytest.raises(AssertionError, match=complaint):
        checks.check_zero_memory(cls, world_sizes=(2,))


# --------------------------------------------------------------------------- #
# Part 2: the step, its bytes and the optimizer's share
# --------------------------------------------------------------------------- #
def test_a_missing_all_gather_is_named():
    with pytest.raises(AssertionError) as info:
        checks.check_zero_parity(_NoAllGather, world_sizes=(2,))
    message = str(info.value)
    assert "with SGD (lr 0.1, momentum 0.9): after step 1, parameter 'net.4.bias' (5,) differs from one process" \
           in message, message
    assert "No parameter of bucket 0 (net.4.bias, net.4.weight, net.2.bias: 71 elements padded to 72, 36 per rank) " \
           "changed in this step" in message, message
    with pytest.raises(AssertionError, match=r"step\(\) sent nothing: after self\.optimizer\.step\(\)"):
        checks.check_zero_traffic(_NoAllGather, world_sizes=(2,))


def test_updating_only_this_ranks_part_is_named():
    with pytest.raises(AssertionError, match=r"Only this rank's part of bucket \d .* was updated: all-gather"):
        checks.check_zero_parity(_OwnPartOnly, world_sizes=(2,))


ACCUMULATES = ("after step 2, parameter 'net.4.bias' (5,) differs from one process trained on the whole batch by "
               "up to 0.0114 (tolerance 1e-05), at element 2. The parameters moved exactly as one process's do when "
               "its gradients are never cleared: step 2 stepped with the sum of the gradients of steps 1 to 2, not "
               "with step 2's alone. Your gradients accumulate across steps")


@pytest.mark.parametrize("cls, where", [
    # the parameters' .grad never dropped: the next backward adds to them
    (_KeepsTheGrad, "After step(), the parameters 'net.0.weight', 'net.0.bias', 'net.2.weight', 'net.2.bias', ... "
                    "(6 in all) still had a .grad, which the next backward added to: in grad_ready, set each "
                    "parameter's .grad to None once it is copied into its bucket's flat gradient for the "
                    "reduce-scatter"),
    # shard.grad added to, and never cleared after the step
    (_AddsToTheShardGrad, "After step(), bucket.shard.grad was still set for bucket(s) 0, 1, 2: clear the shards' "
                          "gradients once self.optimizer.step() has used them (self.optimizer.zero_grad())"),
])
def test_gradients_that_accumulate_across_steps_are_named_as_such(cls, where):
    checks.check_zero_gradients(cls, world_sizes=(2,))          # one backward is right
    with pytest.raises(AssertionError) as info:
        checks.check_zero_parity(cls, world_sizes=(2,))
    message = str(info.value)
    assert "with SGD (lr 0.1, momentum 0.9): " + ACCUMULATES in message, message
    assert where in message, message
    assert "look at step()" not in message, message


def test_a_step_wrong_in_itself_is_still_sent_to_step():
    with pytest.raises(AssertionError) as info:
        checks.check_zero_parity(_ForgetsTheOptimizer, world_sizes=(2,))
    message = str(info.value)
    assert "with SGD (lr 0.1, momentum 0.9): after step 2, parameter" in message, message
    assert "if check_zero_gradients passes, look at step())" in message and "accumulate" not in message, message


def test_right_parameters_by_an_all_reduce_fail_the_traffic_check():
    checks.check_zero_parity(_AllReducesParameters, world_sizes=(2,))
    with pytest.raises(AssertionError) as info:
        checks.check_zero_traffic(_AllReducesParameters, world_sizes=(5,))
    message = str(info.value)
    assert "step() all-reduced the parameters" in message, message
    assert "rank 0 sent 3120 B in step 1; a stage-2 step sends 2 · (N-1)/N · Ψ · 4 = 2 · 4/5 · 325 · 4 = 2080 B " \
           "(1040 B in reduce-scatters during backward, 1040 B in all-gathers in step(); Ψ = 325 elements, padding " \
           "included). Yours: backward: reduce-scatter of 300 B, 240 B sent," in message, message


def test_an_optimizer_on_the_whole_model_is_refused():
    with pytest.raises(AssertionError, match=r"the optimizer was built 2 time\(s\), and given 9 tensor\(s\) of 36, 72, "
                                             r"52, 91, 13, 143, 11, 55, \.\.\. elements \(478 in all\); stage 2 builds one optimizer, on this rank's shards "
                                             r"only: 3 tensors of 160 elements"):
        checks.check_zero_traffic(_WholeModelOptimizer, world_sizes=(2,))


# --------------------------------------------------------------------------- #
# Deadlocks and the course's own answer
# --------------------------------------------------------------------------- #
def test_a_deadlock_fails_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        checks.check_zero_gradients(_WaitsForRankOne, world_sizes=(2,), timeout=3)
    message = str(info.value)
    assert "_WaitsForRankOne did not finish at world size 2 within 3 s" in message, message
    assert "case 'mlp'" in message and "deadlock" in message, message
    assert time.monotonic() - start < 20


def test_the_course_answer_is_refused():
    for cls in (ZeRO, _Inherits):
        for check in (checks.check_zero_gradients, checks.check_zero_memory, checks.check_zero_parity,
                      checks.check_zero_traffic):
            with pytest.raises(AssertionError, match=r"was given \S*(ZeRO|_Inherits), which (is|is built on "
                                                     r"dtcourse\.zero\.sharded\.ZeRO,) the course's own answer to "
                                                     r"exercise 06"):
                check(cls)
    with pytest.raises(AssertionError, match=r"building the wrapper: rank \d raised ReferenceRefused: "
                                             r"dtcourse\.zero\.sharded\.ZeRO is the course's own answer to exercise 06"):
        checks.check_zero_parity(_BuildsTheCourses)


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_zero_gradients(ZeroStage2, cases=("nope",))
    with pytest.raises(ValueError, match="world sizes must be at least 2 and divide the batch of 60"):
        checks.check_zero_memory(ZeroStage2, world_sizes=(1,))
    with pytest.raises(ValueError, match="optimizers must be among"):
        checks.check_zero_parity(ZeroStage2, optimizers=("lion",))
