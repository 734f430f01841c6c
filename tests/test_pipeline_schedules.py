"""Pipeline schedules as data (``dtcourse.pipeline.schedules``, ``validate``, ``simulate``).

Every schedule validates for p = 2, 3, 4 and m = 1..8 (with and without communication); compute
orders equal torch.distributed.pipelining's own, action by action, wherever torch builds the same
schedule; the simulated bubble equals each paper's formula exactly; the validator names the rank,
step and missing piece of broken schedules. Torch's orders come from its schedules built around
stand-in stages (their order does not depend on tensors); one test checks that route once against
torch's schedules executing real PipelineStages on gloo ranks forked by ``dtcourse.launch``.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from dtcourse.pipeline import (STEP, Action, bubble_formula, gpipe, interleaved_1f1b, naive, one_f_one_b,
                               peak_activations, simulate, validate, with_communication, with_steps, without_steps,
                               zb_h1)
from dtcourse.runtime.launch import launch

PS = (2, 3, 4)
MS = range(1, 9)


def cases():
    """(name, schedule, p, m, v) for every schedule the module makes over the test grid."""
    for p in PS:
        yield "naive", naive(p), p, 1, 1
        for m in MS:
            yield "gpipe", gpipe(p, m), p, m, 1
            yield "1f1b", one_f_one_b(p, m), p, m, 1
            yield "zb_h1", zb_h1(p, m), p, m, 1
            if m % p == 0:
                yield "interleaved_1f1b", interleaved_1f1b(p, m, 2), p, m, 2


def strings(schedule):
    """Each rank's actions as torch writes them, less the optimizer steps (torch's schedules hold none)."""
    return {r: [str(a) for a in actions if not str(a).endswith(STEP)] for r, actions in schedule.items()}


# --- torch's orders, from stand-in stages ---------------------------------------------------------

class StandInStage:
    """What a torch schedule reads of a ``PipelineStage`` to plan, and a log of what it is told to run."""

    def __init__(self, stage_index: int, p: int, v: int, rank: int):
        self.stage_index, self.num_stages = stage_index, p * v
        self.group_size, self.group_rank, self.submod = p, rank, None
        self.is_first, self.is_last = stage_index == 0, stage_index == p * v - 1
        self.log: list[str] = []

    def get_fwd_recv_ops(self, mb):           # no tensors move: every p2p batch is empty
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, **kwargs):
        self.log.append(f"{self.stage_index}B{mb}")

    def perform_reduce_grad(self, *args):
        pass

    def release_fwd_send_outputs(self, *args, **kwargs):     # torch 2.15 frees sent outputs: none here
        pass


def torch_single_stage_order(cls, p, m):
    """Run torch's own ``_step_microbatches`` of ScheduleGPipe / Schedule1F1B on each rank's stand-in.

    This is the order torch executes. (``_get_pipeline_order``, what its visualiser draws, is a
    separate hand-written copy, off by one on the last rank for 1F1B in torch 2.13.)
    """
    order = {}
    for r in range(p):
        stage = StandInStage(r, p, 1, r)
        schedule = cls(stage, m)
        schedule._check_inputs = lambda *args: ([()] * m, [{}] * m)   # no inputs to split
        schedule._initialize_stage = lambda *args, **kwargs: None       # no shape inference
        schedule._maybe_compute_loss = schedule._maybe_get_loss = lambda *args, **kwargs: None
        schedule._update_losses = lambda *args, **kwargs: None
        schedule._step_microbatches()
        order[r] = stage.log
    return order


def torch_multi_stage(cls, p, m, v):
    """A PipelineScheduleMulti subclass plans every rank's order in its constructor: build it on rank 0."""
    return cls([StandInStage(c * p, p, v, 0) for c in range(v)], m)


def compute_only(order):
    """torch's lists without its idle slots (None) and its non-compute actions (REDUCE_GRAD, UNSHARD...)."""
    return {r: [str(a) for a in actions if a is not None and str(a)[-1].isdigit()] for r, actions in order.items()}


def _run_torch_schedule(name: str, m: int, v: int) -> list[str]:
    """On each gloo rank: real PipelineStages of Linear(4, 4), one step of torch's schedule, the order run."""
    rank, p = dist.get_rank(), dist.get_world_size()
    log = []
    forward, backward = PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk

    def logged_forward(self, mb, *args, **kwargs):
        log.append(f"{self.stage_index}F{mb}")
        return forward(self, mb, *args, **kwargs)

    def logged_backward(self, mb, *args, **kwargs):
        log.append(f"{self.stage_index}B{mb}")
        return backward(self, mb, *args, **kwargs)

    PipelineStage.forward_one_chunk, PipelineStage.backward_one_chunk = logged_forward, logged_backward  # forked rank
    torch.manual_seed(0)
    stages = [PipelineStage(torch.nn.Linear(4, 4), rank + c * p, p * v, torch.device("cpu")) for c in range(v)]
    cls = getattr(torch_schedules, name)
    schedule = cls(stages if v > 1 else stages[0], m, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
    if rank == 0:
        schedule.step(x)                    # stage 0 lives on rank 0, the last stage on rank p - 1
    else:
        schedule.step(target=y) if rank == p - 1 else schedule.step()
    return log


def test_stand_ins_give_what_torch_runs_with_real_stages_over_gloo():
    """The stand-in route below is checked once against torch's schedules executing for real."""
    for name, p, m, v, ours in (("ScheduleGPipe", 3, 4, 1, gpipe(3, 4)), ("Schedule1F1B", 3, 5, 1, one_f_one_b(3, 5)),
                                ("ScheduleInterleaved1F1B", 2, 4, 2, interleaved_1f1b(2, 4, 2))):
        assert launch(_run_torch_schedule, p, name, m, v, backend="gloo", timeout=120) == list(strings(ours).values())


@pytest.mark.parametrize("p", PS)
def test_gpipe_equals_torch_schedule_gpipe(p):
    for m in MS:
        assert strings(gpipe(p, m)) == torch_single_stage_order(torch_schedules.ScheduleGPipe, p, m)


@pytest.mark.parametrize("p", PS)
def test_one_f_one_b_equals_torch_schedule_1f1b(p):
    """Torch's warm-up is p - r forwards then B, F, B...; PipeDream-flush's is p-1-r, then F, B...: one sequence.

    Torch refuses m < p, so those orders are checked by validate and the bubble formula alone.
    """
    for m in range(p, 9):
        assert strings(one_f_one_b(p, m)) == torch_single_stage_order(torch_schedules.Schedule1F1B, p, m)
    with pytest.raises(ValueError):
        torch_single_stage_order(torch_schedules.Schedule1F1B, p, p - 1)


def test_torch_1f1b_visualiser_order_is_off_by_one_on_the_last_rank_only():
    """What torch 2.13 draws (``_get_pipeline_order``) is not what it runs; compare orders, not drawings."""
    p, m = 4, 8
    drawn = compute_only(torch_schedules.Schedule1F1B(StandInStage(0, p, 1, 0), m).pipeline_order)
    ours = strings(one_f_one_b(p, m))
    assert all(drawn[r] == ours[r] for r in range(p - 1))
    assert drawn[p - 1][:2] == ["3F1", "3B0"] and ours[p - 1][:2] == ["3F0", "3B0"]


@pytest.mark.parametrize("p", PS)
def test_interleaved_1f1b_equals_torch_schedule_interleaved_1f1b(p):
    """Equal for m a multiple of p (Megatron's rule, which we enforce). Torch also runs other m in
    "rounds" (e.g. p = 4, m = 10); those orders are torch's extension, not the paper's schedule."""
    for m in range(p, 9, p):
        for v in (2, 3):
            torch_order = torch_multi_stage(torch_schedules.ScheduleInterleaved1F1B, p, m, v).pipeline_order
            assert strings(interleaved_1f1b(p, m, v)) == compute_only(torch_order)


@pytest.mark.parametrize("p", PS)
def test_zb_h1_equals_torch_interleaved_zero_bubble_with_one_chunk(p):
    """Torch's ScheduleInterleavedZeroBubble with v = 1 is exactly ZB-H1: warm-up p-1-r, then F, I,
    and W lagging I by r micro-batches on rank r. Torch refuses m not a multiple of max(1, m // p)."""
    for m in MS:
        if m % max(1, m // p):
            continue
        torch_order = torch_multi_stage(torch_schedules.ScheduleInterleavedZeroBubble, p, m, 1).pipeline_order
        assert strings(zb_h1(p, m)) == compute_only(torch_order)


@pytest.mark.parametrize("p", PS)
def test_torch_interleaved_zero_bubble_with_two_chunks_is_valid_but_not_zb_h1(p):
    """With v = 2 torch runs ZB-H1's W delay on top of interleaving (its "ZB1P"), which the zero-bubble
    paper does not define and this module does not generate. What holds: our validator accepts it,
    each (stage, micro-batch) gets one F, one I and one W, and it beats interleaved 1F1B's bubble."""
    m = 2 * p
    order = {r: [Action.parse(a) for a in actions]
             for r, actions in compute_only(torch_multi_stage(
                 torch_schedules.ScheduleInterleavedZeroBubble, p, m, 2).pipeline_order).items()}
    validate(order, p, m, 2)
    assert Counter(a for r in order for a in order[r]) == Counter(
        Action(s, k, j) for s in range(2 * p) for k in "FIW" for j in range(m))
    times = dict(t_f=1.0, t_b=2.0, t_w=1.0)
    assert simulate(order, p, m, 2, **times).bubble < simulate(interleaved_1f1b(p, m, 2), p, m, 2, **times).bubble


@pytest.mark.parametrize("p", PS)
def test_with_communication_equals_torch_add_send_recv(p):
    """The same lowering as torch's runtime uses, so the same SEND/RECV placement, action by action."""
    for name, schedule, q, m, v in cases():
        if q != p:
            continue
        torch_compute = {r: [torch_schedules._Action.from_str(str(a)) for a in without_steps(schedule)[r]]
                         for r in range(p)}
        torch_comms = torch_schedules._add_send_recv(torch_compute, stage_to_rank=lambda s: s % p, num_stages=p * v)
        assert strings(with_communication(schedule, p, v)) == strings(torch_comms), (name, m)


# --- every schedule is valid, and its bubble is the paper's -----------------------------------------

def test_every_schedule_validates_with_and_without_communication():
    for name, schedule, p, m, v in cases():
        validate(schedule, p, m, v)
        comms = with_communication(schedule, p, v)
        validate(comms, p, m, v)
        compute = [a for r in comms for a in comms[r] if not a.is_communication]
        assert Counter(compute) == Counter(a for r in schedule for a in schedule[r])
        # one message each way per stage boundary and micro-batch, and every send received
        sends = sum(a.kind.startswith("SEND") for r in comms for a in comms[r])
        assert sends == 2 * (p * v - 1) * m


def test_simulated_bubble_equals_the_formula():
    """GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v·m+p-1); ZB-H1 with t_f = t_i = t_w:
    (p-1)/(3m+p-1) for m >= p (a third of 1F1B's relative to the work). Exact, at float precision."""
    for name, schedule, p, m, v in cases():
        times = dict(t_f=1.0, t_b=2.0, t_w=1.0) if name == "zb_h1" else dict(t_f=1.0, t_b=2.0)
        prediction = simulate(schedule, p, m, v, **times)
        assert prediction.bubble == pytest.approx(bubble_formula(name, p, m, v), abs=1e-12), (name, p, m, v)
        if name in ("gpipe", "1f1b"):     # same timeline shape on both: the bubble is the same per rank
            assert all(b == pytest.approx(prediction.bubble) for b in prediction.bubble_per_rank.values())
    for p in PS:
        for m in range(p, 9):           # idle time beside the same 3m of work: exactly a third of 1F1B's
            zb = simulate(zb_h1(p, m), p, m, t_f=1.0, t_b=2.0, t_w=1.0)
            ofob = simulate(one_f_one_b(p, m), p, m, t_f=1.0, t_b=2.0)
            assert (zb.step - 3 * m) * 3 == pytest.approx(ofob.step - 3 * m)


def test_simulated_timeline_spans_and_communication_latency():
    prediction = simulate(one_f_one_b(2, 2), 2, 2)
    assert [(s.name, s.start, s.end) for s in prediction.timeline[1]] == [
        ("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7)]
    assert prediction.step == 9                      # rank 0 ends with 0B1 at 7..9
    slow = simulate(one_f_one_b(2, 2), 2, 2, t_comm=0.5)
    assert slow.timeline[1][0].start == 1.5          # 0F0 ends at 1, the activation arrives 0.5 later
    # communication actions take no time: with or without them, the same prediction
    assert simulate(with_communication(zb_h1(3, 6), 3), 3, 6) == simulate(zb_h1(3, 6), 3, 6)


def test_activation_memory_gpipe_m_1f1b_p_zb_h1_as_1f1b():
    for p in PS:
        for m in MS:
            assert peak_activations(gpipe(p, m), p) == {r: m for r in range(p)}
            assert peak_activations(one_f_one_b(p, m), p) == {r: min(m, p - r) for r in range(p)}
            assert max(peak_activations(zb_h1(p, m), p).values()) == min(m, p)


# --- the validator rejects broken schedules, saying where and what ---------------------------------

def test_validator_rejects_a_swapped_pair_on_one_rank():
    schedule = one_f_one_b(3, 4)
    schedule[1][0], schedule[1][1] = schedule[1][1], schedule[1][0]       # 1F1 before 1F0: fine
    validate(schedule, 3, 4)
    schedule = one_f_one_b(3, 4)
    schedule[2][0], schedule[2][1] = schedule[2][1], schedule[2][0]       # 2B0 before 2F0
    with pytest.raises(ValueError,
                       match=r"^rank 2, step 0: 2B0 needs 2F0 .*comes later on rank 2 \(step 1\); swap them"):
        validate(schedule, 3, 4)


def test_validator_finds_a_deadlock_between_compute_orders():
    schedule = {0: [Action.parse(a) for a in ("0F0", "0B0", "0F1", "0B1")],
                1: [Action.parse(a) for a in ("1F1", "1F0", "1B0", "1B1")]}
    with pytest.raises(ValueError) as error:
        validate(schedule, 2, 2)
    assert str(error.value) == (
        "deadlock, no rank can proceed: rank 0, step 1: 0B0 needs 1B0 (the gradient from stage 1), which comes "
        "later on rank 1 (step 2, behind 1F1); rank 1, step 0: 1F1 needs 0F1 (the activation from stage 0), "
        "which comes later on rank 0 (step 2, behind 0B0).")


def test_validator_rejects_a_missing_or_duplicated_action():
    schedule = one_f_one_b(3, 4)
    schedule[2].remove(Action(2, "B", 3))
    with pytest.raises(ValueError, match=r"^stage 2 never runs 2B3 \(or 2I3 and 2W3\): add it to rank 2's list"):
        validate(schedule, 3, 4)
    schedule = zb_h1(3, 4)
    schedule[0].remove(Action(0, "W", 1))
    with pytest.raises(ValueError, match=r"^stage 0 never runs 0W1: add it"):
        validate(schedule, 3, 4)
    schedule = gpipe(2, 2)
    schedule[1].append(Action(1, "B", 0))
    with pytest.raises(ValueError, match=r"^rank 1, step 5: 1B0 appears twice \(also at step 2\)"):
        validate(schedule, 2, 2)
    schedule = gpipe(2, 2)
    schedule[1].append(Action(2, "F", 0))
    with pytest.raises(ValueError, match=r"2 stages and 2 micro-batches"):
        validate(schedule, 2, 2)
    schedule = interleaved_1f1b(2, 2, 2)
    schedule[1].insert(0, schedule[0].pop(0))
    with pytest.raises(ValueError, match=r"^rank 1, step 0: 0F0 belongs to rank 0"):
        validate(schedule, 2, 2, 2)


def test_validator_rejects_a_send_without_its_receive():
    schedule = with_communication(one_f_one_b(2, 2), 2)
    schedule[1].remove(Action(1, "RECV_F", 1))
    with pytest.raises(ValueError, match=r"^rank 0, step \d+: 0SEND_F1 has no matching receive 1RECV_F1 on rank 1"):
        validate(schedule, 2, 2)
    schedule = with_communication(one_f_one_b(2, 2), 2)
    schedule[0].remove(Action(0, "RECV_B", 0))
    schedule[1].remove(Action(1, "SEND_B", 0))
    with pytest.raises(ValueError, match=r"^rank 0, step \d+: 0B0 needs 1B0 .* through 0RECV_B0: add it before 0B0"):
        validate(schedule, 2, 2)


def test_validator_rejects_messages_out_of_order_between_two_ranks():
    schedule = with_communication(one_f_one_b(2, 4), 2)
    schedule[0].remove(Action(0, "SEND_F", 1))                            # still after 0F1, but behind 0SEND_F2
    schedule[0].insert(schedule[0].index(Action(0, "SEND_F", 2)) + 1, Action(0, "SEND_F", 1))
    with pytest.raises(ValueError, match=r"^message 1 from rank 0 to rank 1 is rank 0, step \d+: 0SEND_F2, but "
                                         r"rank 1 expects rank 1, step \d+: 1RECV_F1 there"):
        validate(schedule, 2, 4)


def test_validator_finds_a_deadlock_between_blocking_messages():
    """Rank 0 waits for a gradient before sending the activation that gradient needs."""
    schedule = {0: [Action.parse(a) for a in "0F0 0RECV_B0 0F1 0SEND_F0 0SEND_F1 0B0 0RECV_B1 0B1".split()],
                1: [Action.parse(a) for a in "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1".split()]}
    with pytest.raises(ValueError) as error:
        validate(schedule, 2, 2)
    assert str(error.value).startswith(
        "deadlock, no rank can proceed: rank 0, step 1: 0RECV_B0 waits for rank 1 to post 1SEND_B0 (its step 3), "
        "but rank 1 is blocked at step 0 on 1RECV_F0; rank 1, step 0: 1RECV_F0 waits for rank 0 to post 0SEND_F0 "
        "(its step 3), but rank 0 is blocked at step 1 on 0RECV_B0.")
    with pytest.raises(ValueError, match="deadlock"):
        simulate(schedule, 2, 2)


def receive_before_send_after(schedule, p):
    """Each rank on its own: a receive just before the compute that needs it, a send just after."""
    def around(a):
        if a.kind in ("W", STEP):
            return [a]
        before = [Action(a.stage, "RECV_F" if a.kind == "F" else "RECV_B", a.microbatch)]
        after = [Action(a.stage, "SEND_F" if a.kind == "F" else "SEND_B", a.microbatch)]
        first, last = a.stage == 0, a.stage == max(b.stage for r in schedule for b in schedule[r])
        if a.kind == "F":
            return before * (not first) + [a] + after * (not last)
        return before * (not last) + [a] + after * (not first)
    return {r: [b for a in schedule[r] for b in around(a)] for r in range(p)}


def test_non_blocking_sends_accept_orders_that_blocking_sends_would_hang():
    """Placed rank by rank, interleaved 1F1B on 2 ranks has both ranks sending a gradient the other
    will receive only later: fine if sends are waited for at the end of the step (blocking=False),
    a hang if a send waits for its receive. 1F1B placed the same way passes both (Megatron's pairs)."""
    schedule = receive_before_send_after(interleaved_1f1b(2, 4, 2), 2)
    validate(schedule, 2, 4, 2, blocking=False)
    with pytest.raises(ValueError, match=r"^deadlock.*rank 0, step 14: 2SEND_B0 waits for rank 1 to post 1RECV_B0"):
        validate(schedule, 2, 4, 2)
    validate(receive_before_send_after(one_f_one_b(4, 8), 4), 4, 8)
    hung = {0: [Action.parse(a) for a in "0F0 0RECV_B0 0B0 0SEND_F0".split()],
            1: [Action.parse(a) for a in "1RECV_F0 1F0 1B0 1SEND_B0".split()]}
    with pytest.raises(ValueError, match=r"rank 0, step 2: 0B0 needs the message 1SEND_B0, which comes later on "
                                         r"rank 1 \(step 3, behind 1F0\)"):
        validate(hung, 2, 1, blocking=False)


# --- the optimizer step is an action ------------------------------------------------------------------

def test_every_schedule_ends_each_rank_with_its_stages_optimizer_steps():
    """One STEP per stage, last on its rank, after the stage's last weight gradient (the flush)."""
    for name, schedule, p, m, v in cases():
        for r, actions in schedule.items():
            stages = sorted({a.stage for a in actions if a.kind != STEP})
            steps = [a for a in actions if a.kind == STEP]
            assert actions[-len(steps):] == steps and sorted(a.stage for a in steps) == stages, (name, p, m, v, r)
    assert interleaved_1f1b(2, 2, 2)[0][-2:] == [Action(2, STEP), Action(0, STEP)]   # stage 2's gradients are in first
    assert with_steps({0: [Action(0, "F", 0), Action(0, "B", 0)]}) == {0: [Action(0, "F", 0), Action(0, "B", 0),
                                                                          Action(0, STEP)]}


def test_step_notation_parses_like_torchs_unshard():
    assert str(Action(3, STEP)) == "3STEP" and Action.parse("3STEP") == Action(3, STEP)
    with pytest.raises(ValueError, match=r"write Action\(0, 'STEP'\), without 2"):
        Action(0, STEP, 2)
    with pytest.raises(ValueError, match=r"F needs a micro-batch"):
        Action(0, "F")


def test_validator_places_the_step_after_the_flush_on_every_stage_or_none():
    validate(without_steps(one_f_one_b(3, 4)), 3, 4)               # torch's kind: the caller steps
    early = one_f_one_b(3, 4)
    early[1].insert(early[1].index(Action(1, "B", 3)), early[1].pop())
    with pytest.raises(ValueError, match=r"^rank 1, step 7: 1STEP updates stage 1's weights before 1B3 \(step 8\)"):
        validate(early, 3, 4)
    zb = zb_h1(2, 3)                                               # split backward: the W's are what the step needs
    zb[0].insert(zb[0].index(Action(0, "W", 2)), zb[0].pop())
    with pytest.raises(ValueError, match=r"0STEP updates stage 0's weights before 0W2"):
        validate(zb, 2, 3)
    partial = one_f_one_b(3, 4)
    partial[2].pop()
    with pytest.raises(ValueError, match=r"^stage 2 has no optimizer step, but stage 0 has one: add 2STEP to rank 2's"):
        validate(partial, 3, 4)


def test_a_timed_step_lengthens_the_simulated_step_and_shows_as_a_span():
    base, timed = simulate(one_f_one_b(2, 2), 2, 2), simulate(one_f_one_b(2, 2), 2, 2, t_step=0.5)
    assert timed.step == base.step + 0.5                       # rank 0 ends last; its step follows 0B1
    assert [s.name for s in timed.timeline[0]][-1] == "0STEP" and "1STEP" not in [s.name for s in base.timeline[1]]


# --- bad inputs say what to change -------------------------------------------------------------------

def test_bad_inputs_say_what_to_change():
    with pytest.raises(ValueError, match=r"v >= 2 \(for one chunk per rank use one_f_one_b\)"):
        interleaved_1f1b(4, 8, 1)
    with pytest.raises(ValueError, match=r"m = 6 micro-batches is not a multiple of p = 4 ranks.*use m = 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        gpipe(4, 0)
    with pytest.raises(ValueError, match="at least one rank"):
        one_f_one_b(0, 4)
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        bubble_formula("pipedream", 4, 8)
    with pytest.raises(ValueError, match="t_w = 3 must lie between 0 and t_b = 2"):
        simulate(zb_h1(2, 2), 2, 2, t_w=3)
    with pytest.raises(ValueError, match="already a communication action"):
        with_communication(with_communication(gpipe(2, 2), 2), 2)
