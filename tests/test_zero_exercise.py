"""Exercise 06 (the ZeRO stage-2 step): the released notebook, its checks, and what they refuse.

The checks test the algorithm, not only the answer: a step that averages right with an all-reduce
fails the technique's checks (8 of the 14 points), one that keeps every gradient until backward ends
(stage 1) or never frees the .grad fails part 1's (4 points), and each names the rank, the flat
and the bytes; a forgotten division, the wrong part, a missing all-gather, gradients that accumulate
across steps and a full-model optimizer fail with a hint that says which; a deadlock fails after the
timeout; the course's own ``dtcourse.zero.ZeRO`` and its stage-2 methods are refused. Everything here calls
the checks directly (each launch forks its ranks in well under a second); full marks for the solution and zero
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
ALL_CASES = ("mlp", "one_unit", "mixed", "tiny", "gpt")


def _notebook() -> dict:
    """The solution's classes, compiled under this file's name: the checks take them for a student's."""
    cells, answers = nbgrader_cells(source_path(NAME)), solution_code(NAME)
    code = "\n\n".join([cells["setup"], cells["scaffold"], answers["zero_stage2"]])
    namespace: dict = {"__name__": __name__}
    exec(compile(code, __file__, "exec"), namespace)
    return namespace


NOTEBOOK = _notebook()
ZeroBase, ZeroStage2 = NOTEBOOK["ZeroBase"], NOTEBOOK["ZeroStage2"]


def _complete(flat) -> bool:
    """Count one more gradient in; True once the flat has all of them (the solution's first two lines)."""
    flat.ready += 1
    return flat.ready == len(flat.params)


# --------------------------------------------------------------------------- #
# Wrong answers, each a student's plausible mistake
# --------------------------------------------------------------------------- #
class _SumNotMean(ZeroStage2):
    """Reduce-scatters, but keeps the sum over the ranks."""

    def _grad_ready(self, unit, flat, p):
        if _complete(flat):
            dist.reduce_scatter_single(flat.grad, flat.gradient_bucket(torch.float32))


class _NextRanksPart(ZeroStage2):
    """All-reduces the flat's gradient (twice the bytes) and keeps the next rank's part of the mean."""

    def _grad_ready(self, unit, flat, p):
        if _complete(flat):
            bucket = flat.gradient_bucket(torch.float32)
            dist.all_reduce(bucket)
            r, s = (dist.get_rank() + 1) % self.world, flat.size
            flat.grad = bucket[r * s:(r + 1) * s].clone() / self.world


class _AllReduced(ZeroStage2):
    """Right numbers, the way data parallelism gets them: an all-reduce of each flat's gradient, then a slice."""

    def _grad_ready(self, unit, flat, p):
        if _complete(flat):
            bucket = flat.gradient_bucket(torch.float32)
            dist.all_reduce(bucket)              # sends 2(N-1)/N * bucket.nbytes
            lo, hi = flat.owned
            flat.grad = bucket[lo:hi].clone() / self.world


class _Stage1(ZeroStage2):
    """Right numbers and bytes, but every gradient is kept until backward ends, then reduce-scattered."""

    def _grad_ready(self, unit, flat, p):
        if all(f.ready == 0 for f in self._flats(trainable=True)):
            torch.autograd.Variable._execution_engine.queue_callback(self.after_backward)
        flat.ready += 1

    def after_backward(self):
        for unit in self.units:
            for flat in unit.flats:
                flat.ready = len(flat.params) - 1
                super()._grad_ready(unit, flat, flat.params[0])


class _KeepsTheGrad(ZeroStage2):
    """Reduce-scatters each flat in its hook, but copies the gradients out without dropping the parameters' .grad."""

    def _grad_ready(self, unit, flat, p):
        if _complete(flat):
            bucket = torch.zeros(flat.padded)
            for q, (lo, hi) in zip(flat.params, flat.spans):
                bucket[lo:hi] = q.grad.reshape(-1)
            dist.reduce_scatter_single(flat.grad, bucket)
            flat.grad.div_(self.world)


class _KeepsABuffer(ZeroStage2):
    """Right, but keeps each flat's whole gradient bucket on the flat, as DDP keeps its buffers."""

    def _grad_ready(self, unit, flat, p):
        if _complete(flat):
            flat.bucket = flat.gradient_bucket(torch.float32)
            dist.reduce_scatter_single(flat.grad, flat.bucket)
            flat.grad.div_(self.world)


class _PartIsAView(ZeroStage2):
    """Right numbers and bytes, but flat.grad is a view into a tensor the size of the whole flat."""

    def _grad_ready(self, unit, flat, p):
        if _complete(flat):
            bucket = flat.gradient_bucket(torch.float32)
            out = torch.empty_like(bucket)
            dist.reduce_scatter_single(out[:flat.size], bucket)
            flat.grad = out[:flat.size].div_(self.world)


class _NoAllGather(ZeroStage2):
    """Steps the masters and stops there: the other ranks' parts never arrive."""

    def step(self):
        for flat in self._flats(trainable=True):
            flat.master.grad = flat.grad
        self.optimizer.step()
        self.optimizer.zero_grad()


class _NoMasterGradient(ZeroStage2):
    """All-gathers, but never hands flat.grad to the masters: the optimizer has nothing to step."""

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for flat in self._flats(trainable=True):
                dist.all_gather_single(flat.full, flat.shard.clone())


class _OwnPartOnly(ZeroStage2):
    """Steps this rank's part (a view of full, so the model sees it), and nothing more."""

    def step(self):
        for flat in self._flats(trainable=True):
            flat.master.grad = flat.grad
        self.optimizer.step()
        self.optimizer.zero_grad()


class _AllReducesParameters(ZeroStage2):
    """Right parameters, by an all-reduce of full with only this rank's part filled in: twice the bytes."""

    def step(self):
        for flat in self._flats(trainable=True):
            flat.master.grad = flat.grad
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for flat in self._flats(trainable=True):
                lo, hi = flat.owned
                mine = flat.full[lo:hi].clone()
                flat.full.zero_()
                flat.full[lo:hi] = mine
                dist.all_reduce(flat.full)


class _AddsToTheGrad(ZeroStage2):
    """Adds each backward's reduced part to flat.grad, and never sets the masters' gradient back: step k steps
    the sum."""

    def _grad_ready(self, unit, flat, p):
        if _complete(flat):
            part = torch.empty(flat.size)
            dist.reduce_scatter_single(part, flat.gradient_bucket(torch.float32))
            flat.grad += part / self.world

    def step(self):
        for flat in self._flats(trainable=True):
            flat.master.grad = flat.grad
        self.optimizer.step()
        with torch.no_grad():
            for flat in self._flats(trainable=True):
                dist.all_gather_single(flat.full, flat.shard.clone())


class _ForgetsTheOptimizer(ZeroStage2):
    """Builds a new optimizer for every step: right at step 1, then its momentum or moments start again."""

    def __init__(self, module, optimizer, units=None):
        super().__init__(module, optimizer, units)
        self.make_optimizer = optimizer

    def step(self):
        super().step()
        self.optimizer = self.make_optimizer([flat.master for flat in self._flats(trainable=True)])


class _WholeModelOptimizer(ZeroStage2):
    """Builds a second optimizer on the whole model."""

    def __init__(self, module, optimizer, units=None):
        super().__init__(module, optimizer, units)
        self.everything = optimizer(module.parameters())


class _WaitsForRankOne(ZeroStage2):
    """Rank 0 waits for a message rank 1 never sends; rank 1 waits in the first reduce-scatter."""

    def _grad_ready(self, unit, flat, p):
        if dist.get_rank() == 0:
            dist.recv(torch.zeros(1), src=1)
        super()._grad_ready(unit, flat, p)


class _BuildsTheCourses(torch.nn.Module):
    """Hands the work to the course's own ZeRO."""

    def __init__(self, module, optimizer, units=None):
        super().__init__()
        self.zero = ZeRO(module, 2, optimizer)

    def forward(self, x):
        return self.zero(x)

    def step(self):
        self.zero.step()
        self.zero.zero_grad()


class _CallsTheCoursesMethods(ZeroStage2):
    """Borrows the course's stage-2 methods, unbound, on its own object."""

    stage, _async, _grad_is_view, reduce_dtype = 2, False, False, torch.float32

    def __init__(self, module, optimizer, units=None):
        super().__init__(module, optimizer, units)
        self._reductions, self._arrived, self._in_backward, self._has_grads = [], set(), True, False

    def _grad_ready(self, unit, flat, p):
        ZeRO._grad_ready(self, unit, flat, p)


class _Inherits(ZeRO):
    pass


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_scaffolding():
    assert_released(NAME, absent=["reduce_scatter_single(flat.grad, bucket)", "all_gather_single(flat.full",
                                  'world_sizes=(3, 5)'],
                    stubs={"zero_stage2": 2},
                    given={"zero_stage2": ["def _grad_ready(self, unit: Unit, flat: FlatShard, p: nn.Parameter) -> None:",
                                           "def step(self) -> None:"],
                           "scaffold": ["from dtcourse.zero import FlatShard, Unit, build_units, default_units",
                                        "register_post_accumulate_grad_hook",
                                        "self.units = build_units(module, names, self.world, dist.get_rank()",
                                        "self.optimizer = optimizer([flat.master for flat in self._flats("]})
    assert EXPECTED[NAME].points == 14


def test_the_exercise_reads_like_the_library():
    """The scaffolding is the library's layout, and the methods the student writes are ZeRO's own names."""
    from dtcourse.zero import FlatShard as LibraryFlatShard, Unit as LibraryUnit
    assert NOTEBOOK["FlatShard"] is LibraryFlatShard and NOTEBOOK["Unit"] is LibraryUnit
    for method in ("_grad_ready", "step", "_flats"):
        assert callable(getattr(ZeRO, method)) and method in vars(ZeroBase) | vars(ZeroStage2), method


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
        assert re.search(rf"rank {rank}: the flat of unit 'net\.0' \(net\.0\.weight, net\.0\.bias: 104 elements "
                         rf"padded to 105, 35 per rank\): flat\.grad differs from this rank's part of the mean "
                         rf"gradient \(elements \[{35 * rank}, {35 * rank + 35}\) of the padded flat\) by up to \S+ "
                         r"at net\.0\.\w+\[\d+\]", message), message
    assert "It is N = 3 times the mean" in message and "divide by the world size" in message, message


def test_another_ranks_part_is_named():
    with pytest.raises(AssertionError, match=r"rank 0: the flat of unit 'net\.0' .*It is rank 1's part: rank r "
                                             r"keeps elements"):
        checks.check_zero_gradients(_NextRanksPart, world_sizes=(2,))


def test_right_gradients_by_an_all_reduce_fail_the_technique():
    checks.check_zero_gradients(_AllReduced, world_sizes=(2, 3), cases=ALL_CASES)
    checks.check_zero_parity(_AllReduced, world_sizes=(3,), optimizers=("adamw",))
    with pytest.raises(AssertionError) as info:
        checks.check_zero_memory(_AllReduced, world_sizes=(2,))
    message = str(info.value)
    assert "the flat of unit 'net.4' (net.4.weight, net.4.bias: 60 elements, 30 per rank) was all-reduced " \
           "(an all-reduce of 240 B, 240 B sent)" in message, message
    with pytest.raises(AssertionError) as info:
        checks.check_zero_traffic(_AllReduced, world_sizes=(2,))
    message = str(info.value)
    assert "backward should make one reduce-scatter per flat, of its padded gradient (240 B, 416 B, 616 B)" \
           in message, message
    assert "rank 0 sent 1908 B in step 1; a stage-2 step sends 2 · (N-1)/N · Ψ · 4 = 2 · 1/2 · 318 · 4 = 1272 B" \
           in message, message


def test_stage_1_keeps_every_gradient_and_fails_only_the_memory_check():
    checks.check_zero_gradients(_Stage1, world_sizes=(2,))
    checks.check_zero_traffic(_Stage1, world_sizes=(2,))
    with pytest.raises(AssertionError) as info:
        checks.check_zero_memory(_Stage1, world_sizes=(2,))
    message = str(info.value)
    assert "the flat of unit 'net.4' (net.4.weight, net.4.bias: 60 elements, 30 per rank) had all its gradients " \
           "after 2 of the 6 gradients, but by the end of that hook only 0 reduce-scatter(s) had started" \
           in message, message
    assert "backward ends). The most .grad bytes alive at once were 1272 B; the whole model's gradient is 1272 B" \
        in message, message


def test_gradients_left_in_grad_are_named_with_their_bytes():
    with pytest.raises(AssertionError) as info:
        checks.check_zero_memory(_KeepsTheGrad, world_sizes=(2,))
    message = str(info.value)
    assert "after the hook that completed the flat of unit 'net.4' (net.4.weight, net.4.bias: 60 elements, 30 per " \
           "rank), its gradient(s) 'net.4.weight' (220 B), 'net.4.bias' (20 B) were still in .grad" in message, message


@pytest.mark.parametrize("cls, complaint", [
    (_KeepsABuffer, r"the wrapper still holds a tensor of 104 elements \(416 B\) at self\.units\[0\]\.flats\[0\]\."
                    r"bucket: the size of the flat of unit 'net\.0' \(.*\)'s whole gradient"),
    (_PartIsAView, r"the flat of unit 'net\.0' \(.*\): flat\.grad has 52 elements on a storage of 416 B, but rank \d "
                   r"keeps only its part: 52 elements, 208 B"),
])
def test_a_whole_flat_kept_anywhere_fails(cls, complaint):
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
    assert "with SGD (lr 0.1, momentum 0.9): after step 1, parameter 'net.0.weight' (13, 7) differs from one " \
           "process" in message, message
    assert "Only this rank's part of the flat of unit 'net.0' (net.0.weight, net.0.bias: 104 elements, 52 per rank) " \
           "(elements [0, 52)) was updated: all-gather" in message, message
    with pytest.raises(AssertionError, match=r"step\(\) sent nothing: after self\.optimizer\.step\(\)"):
        checks.check_zero_traffic(_NoAllGather, world_sizes=(2,))


def test_a_master_without_its_gradient_is_named():
    with pytest.raises(AssertionError) as info:
        checks.check_zero_parity(_NoMasterGradient, world_sizes=(2,))
    message = str(info.value)
    assert "No parameter of the flat of unit 'net.0' (net.0.weight, net.0.bias: 104 elements, 52 per rank) changed " \
           "in this step: the optimizer steps flat.master (this rank's part of flat.full) with the gradient you put " \
           "in flat.master.grad" in message, message


def test_updating_only_this_ranks_part_is_named():
    with pytest.raises(AssertionError, match=r"Only this rank's part of the flat of unit 'net\.\d' .* was updated: "
                                             r"all-gather"):
        checks.check_zero_parity(_OwnPartOnly, world_sizes=(2,))


ACCUMULATES = ("after step 2, parameter 'net.0.weight' (13, 7) differs from one process trained on the whole batch "
               "by up to 0.00576 (tolerance 1e-05), at element 70. The parameters moved exactly as one process's do "
               "when its gradients are never cleared: step 2 stepped with the sum of the gradients of steps 1 to 2, "
               "not with step 2's alone. Your gradients accumulate across steps")


@pytest.mark.parametrize("cls, where", [
    # the parameters' .grad never dropped: the next backward adds to them
    (_KeepsTheGrad, "After step(), the parameters 'net.0.weight', 'net.0.bias', 'net.2.weight', 'net.2.bias', ... "
                    "(6 in all) still had a .grad, which the next backward added to: in _grad_ready, move the flat's "
                    "gradients out with flat.gradient_bucket, which sets each .grad to None"),
    # flat.grad added to, and the masters' gradient never set back
    (_AddsToTheGrad, "After step(), flat.master.grad was still set for flat(s) 0, 1, 2: set it back to None once "
                     "self.optimizer.step() has used it, and make flat.grad the reduce-scatter's output divided by N "
                     "rather than adding that to the old one"),
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
    assert "if check_zero_gradients passes, look at step(): the masters' gradients, the optimizer and its states" \
        in message and "accumulate" not in message, message


def test_right_parameters_by_an_all_reduce_fail_the_traffic_check():
    checks.check_zero_parity(_AllReducesParameters, world_sizes=(2,))
    with pytest.raises(AssertionError) as info:
        checks.check_zero_traffic(_AllReducesParameters, world_sizes=(5,))
    message = str(info.value)
    assert "step() all-reduced the parameters" in message, message
    assert "rank 0 sent 3072 B in step 1; a stage-2 step sends 2 · (N-1)/N · Ψ · 4 = 2 · 4/5 · 320 · 4 = 2048 B " \
           "(1024 B in reduce-scatters during backward, 1024 B in all-gathers in step(); Ψ = 320 elements, padding " \
           "included). Yours: backward: reduce-scatter of 240 B, 192 B sent," in message, message


def test_an_optimizer_on_the_whole_model_is_refused():
    with pytest.raises(AssertionError, match=r"the optimizer was built 2 time\(s\), and given 9 tensor\(s\) of 52, 77, "
                                             r"30, 91, 13, 143, 11, 55, \.\.\. elements \(477 in all\); stage 2 builds "
                                             r"one optimizer, on this rank's parts only: 3 masters of 159 elements"):
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
    with pytest.raises(AssertionError, match=r"backward: rank \d raised ReferenceRefused: dtcourse\.zero\.sharded\.ZeRO\."
                                             r"_grad_ready is the course's own answer to exercise 06"):
        checks.check_zero_gradients(_CallsTheCoursesMethods)


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="cases must be among"):
        checks.check_zero_gradients(ZeroStage2, cases=("nope",))
    with pytest.raises(ValueError, match="world sizes must be at least 2 and divide the batch of 60"):
        checks.check_zero_memory(ZeroStage2, world_sizes=(1,))
    with pytest.raises(ValueError, match="optimizers must be among"):
        checks.check_zero_parity(ZeroStage2, optimizers=("lion",))
