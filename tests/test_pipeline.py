"""Pipeline parallelism (``dtcourse.pipeline``): the partition, the executor against one process, the
micro-batches each stage holds, the errors, and the Chrome trace of a real run.

The schedules here are written by hand (GPipe, 1F1B, a zero-bubble-style split backward, a looped
two-chunk order), so the executor is tested on its own; ``test_generated_schedules_match_one_process``
runs ``dtcourse.pipeline.schedules``'s generators through it when that module is there.
Parity goes through ``dtcourse.parity.check_parity``: every strategy of one world size trains side by
side, in one launch, against one process on the whole batch. ``pytest -s`` prints the largest differences.
"""

import functools
import json

import pytest
import torch
import torch.nn as nn

from dtcourse import launch
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
from dtcourse.parity import Tolerance, check_parity, whole_batch
from dtcourse.pipeline import Action, schedules, validate, without_steps
from dtcourse.pipeline.execute import PipelineExecutor, PipelineParallel, rank_actions, run_schedule
from dtcourse.pipeline.simulate import peak_activations
from dtcourse.pipeline.partition import balanced_partition, gpt_boundary_shape, split_gpt, stages_of_rank
from dtcourse.pipeline.trace import chrome_trace, write_chrome_trace
from dtcourse.runtime.timeline import Timeline, merge, shared_origin

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=5, n_head=2, d_model=16)   # 5 layers: p = 2, 3 cut unevenly
B, STEPS = 6, 3             # 6 rows: m = 5 cuts them 2, 1, 1, 1, 1 (micro-batches of unequal size)
adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
ONE_PROCESS = Tolerance(1e-5, 0, (
    "the last stage adds m micro-batch losses, each scaled by rows_j / B, where one process takes one mean "
    "over B*T tokens, and every weight gradient is a sum of m micro-batch gradients: the same numbers "
    "added in another order, a few ulps of float32. AdamW's early steps are about lr * g / |g|, so where "
    "g nearly cancels those ulps move a parameter by more; 1e-5 is lr/100, 2.4e-7 measured"))

TORCH = Tolerance(1e-5, 0, (
    "torch.distributed.pipelining runs the same micro-batches through the same modules, but scales the "
    "summed gradients by 1/m after the backward where this executor scales each loss by rows_j / B before "
    "it: gradients 4.5e-8 apart at the first step, then AdamW's lr * g / |g| moves parameters whose g "
    "nearly cancels by up to 3e-6 (measured at p = 2 and 3), still well inside lr/100"))


# --------------------------------------------------------------------------- hand-written schedules
def F(s, j): return Action(s, "F", j)
def Bk(s, j): return Action(s, "B", j)


def gpipe(p, m):
    """All forwards, then all backwards (Huang et al., arXiv 1811.06965)."""
    return {r: [F(r, j) for j in range(m)] + [Bk(r, j) for j in range(m)] for r in range(p)}


def one_f_one_b(p, m, backward=lambda s, j: [Bk(s, j)]):
    """p - 1 - r warm-up forwards, then one forward and one backward in turn, then the remaining backwards."""
    out = {}
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [F(r, j) for j in range(warm)]
        for i in range(m - warm):
            acts += [F(r, warm + i)] + backward(r, i)
        for i in range(m - warm, m):
            acts += backward(r, i)
        out[r] = acts
    return out


def zero_bubble(p, m):
    """1F1B with each B split into I (input gradient, at B's place) and W (weight gradient), W deferred to the end."""
    sched = one_f_one_b(p, m, backward=lambda s, j: [Action(s, "I", j)])
    return {r: acts + [Action(r, "W", j) for j in range(m)] for r, acts in sched.items()}


def looped(p, m, v):
    """v chunks per rank (stages r, r + p, ...): each chunk's forwards in turn, then backwards in reverse."""
    return {r: [F(s, j) for s in stages_of_rank(r, p, v) for j in range(m)] +
               [Bk(s, j) for s in reversed(stages_of_rank(r, p, v)) for j in range(m)] for r in range(p)}


def _pipeline(schedule, m, v=1):
    """A ``check_parity`` strategy: cut the model into p·v stages and keep this rank's."""
    def shard(model, group):
        import torch.distributed as dist
        rank, p = dist.get_rank(group), dist.get_world_size(group)
        stages = split_gpt(model, p * v)
        return PipelineParallel({s: stages[s] for s in stages_of_rank(rank, p, v)}, p * v, schedule, m,
                                adamw, gpt_boundary_shape(model), group=group)
    return shard


class TorchPipeline(PipelineParallel):
    """PyTorch's own pipeline (``torch.distributed.pipelining``) on the same stages, as a second reference.

    Only ``forward_backward`` differs: torch's schedule runs the stages (one per rank, or ``v`` for its
    multi-stage schedules), and scales the summed micro-batch gradients by 1/m (``scale_grads``), which
    equals the global mean for equal micro-batches.
    """

    def __init__(self, model, group, schedule_class, m, v=1):
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti
        rank, p = dist.get_rank(group), dist.get_world_size(group)
        split, mine = split_gpt(model, p * v), stages_of_rank(rank, p, v)
        super().__init__({s: split[s] for s in mine}, p * v, {}, m, adamw, gpt_boundary_shape(model), group=group)
        self.torch_stages = [PipelineStage(split[s], s, p * v, torch.device("cpu"), group=group) for s in mine]
        self.multi = issubclass(schedule_class, PipelineScheduleMulti)
        self.schedule_class, self.m, self.first, self.last = schedule_class, m, 0 in mine, p * v - 1 in mine

    def forward_backward(self, x, y, loss_fn):
        stages = self.torch_stages if self.multi else self.torch_stages[0]
        schedule = self.schedule_class(stages, self.m, loss_fn=loss_fn)
        out = schedule.step(*([x] if self.first else []), target=y if self.last else None)
        return out.detach() if self.last else None


def _batches():
    return [token_batch(CFG, B, seed=s) for s in range(STEPS)]


def _parity(strategies, reference=None):
    return check_parity(lambda: GPT(CFG, seed=0), strategies, _batches(), lm_loss, adamw, tolerance=ONE_PROCESS,
                        reference=reference, reference_tolerance=TORCH,
                        split=whole_batch)   # pipeline ranks split the model, not the batch


@pytest.mark.parametrize("p", [2, 3])
def test_hand_written_schedules_are_valid(p):
    for m in (1, 3, 5):
        for make in (gpipe, one_f_one_b, zero_bubble):
            validate(make(p, m), p, m)
    validate(looped(p, 3, 2), p, 3, 2)


# --------------------------------------------------------------------------- partition
def test_balanced_partition_is_contiguous_and_even():
    assert balanced_partition(5, 2) == [(0, 3), (3, 5)]
    assert balanced_partition(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert balanced_partition(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for n, s in [(7, 3), (12, 5), (5, 5)]:
        parts = balanced_partition(n, s)
        sizes = [e - b for b, e in parts]
        assert parts[0][0] == 0 and parts[-1][1] == n and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert max(sizes) - min(sizes) <= 1


def test_more_stages_than_layers_says_what_to_change():
    with pytest.raises(ValueError, match="use at most 3 stages"):
        balanced_partition(3, 4)
    with pytest.raises(ValueError, match="at most 5 stages"):
        split_gpt(GPT(CFG), 6)


@pytest.mark.parametrize("n_stages", [1, 2, 4, 5])
def test_stages_chained_are_the_model(n_stages):
    model = GPT(CFG, seed=0)
    stages = split_gpt(model, n_stages)
    idx, _ = token_batch(CFG, 3)
    x = idx
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(idx))          # the same modules, the same operations: bit for bit
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())   # the GPT's names, each once
    with pytest.raises(ValueError, match="exceeds block_size 8"):
        stages[0](torch.zeros(1, 9, dtype=torch.long))


# --------------------------------------------------------------------------- executor in one process
def test_one_rank_holding_every_stage_matches_the_model():
    """p = 1, v = 3: stages hand over locally; gradients against one backward of the whole batch."""
    model, ref = GPT(CFG, seed=0), GPT(CFG, seed=0)
    stages = split_gpt(model, 3)
    ex = PipelineExecutor(dict(enumerate(stages)), 3, gpt_boundary_shape(model))
    idx, targets = token_batch(CFG, B)
    acts = [F(s, j) for j in range(4) for s in range(3)] + [Bk(s, j) for j in range(4) for s in (2, 1, 0)]
    out = ex.run(acts, idx, targets, lm_loss, 4)
    lm_loss(ref(idx), targets).backward()
    assert torch.allclose(out, ref(idx), atol=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=0), n   # four micro-batch sums: ulps
    assert ex.peak_held == {0: 4, 1: 4, 2: 4}


def test_shape_mismatch_says_what_to_change():
    stages = {0: nn.Linear(4, 6), 1: nn.Linear(5, 3)}
    ex = PipelineExecutor(stages, 2, lambda s, x: (x.shape[0], 5))
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"stage 0's output for micro-batch 0 is \(2, 6\).*stage 1 expects \(2, 5\)"):
        ex.run([F(0, 0), F(1, 0)], x, y, nn.functional.mse_loss, 2)


def test_incomplete_lists_are_refused():
    model = GPT(CFG, seed=0)
    ex = PipelineExecutor(dict(enumerate(split_gpt(model, 2))), 2, gpt_boundary_shape(model))
    idx, targets = token_batch(CFG, 2)
    with pytest.raises(RuntimeError, match="still holds micro-batch 0"):
        ex.run([F(0, 0), F(1, 0)], idx, targets, lm_loss, 1)
    with pytest.raises(RuntimeError, match="runs before 1I0"):
        ex.run([F(0, 0), F(1, 0), Action(1, "W", 0)], idx, targets, lm_loss, 1)


def test_the_schedules_step_actions_update_each_stage_once_like_one_optimizer():
    """interleaved 1F1B on one rank with v = 3: STEPs 2, 1, 0 at the end. One optimizer per stage, or one
    for the rank stepped at its last STEP, or torch's way (no STEP, step after the list): the same weights."""
    idx, targets = token_batch(CFG, 4)
    schedule = schedules.interleaved_1f1b(1, 4, 3)
    assert [str(a) for a in schedule[0][-3:]] == ["2STEP", "1STEP", "0STEP"]
    finals = []
    for how in ("per stage", "one", "after the list"):
        model = GPT(CFG, seed=0)
        stages = dict(enumerate(split_gpt(model, 3)))
        ex = PipelineExecutor(stages, 3, gpt_boundary_shape(model))
        if how == "per stage":
            opt = {s: adamw(stage.parameters()) for s, stage in stages.items()}
        else:
            opt = adamw(model.parameters())
        plan = schedule if how != "after the list" else without_steps(schedule)
        for _ in range(2):
            run_schedule(ex, plan, idx, targets, lm_loss, 4, opt)
        names = [sp.name for sp in ex.timeline.spans if sp.kind == "optimizer"]
        assert names == (["2STEP", "1STEP", "0STEP"] * 2 if how != "after the list" else ["step"] * 2)
        finals.append(torch.cat([q.detach().flatten() for q in model.parameters()]))
    reference = GPT(CFG, seed=0)
    opt = adamw(reference.parameters())
    for _ in range(2):
        opt.zero_grad()
        lm_loss(reference(idx), targets).backward()
        opt.step()
    want = torch.cat([q.detach().flatten() for q in reference.parameters()])
    assert torch.equal(finals[0], finals[1]) and torch.equal(finals[1], finals[2])
    assert (finals[0] - want).abs().max() < 1e-5


def test_a_step_needs_an_optimizer_and_a_finished_stage():
    model = GPT(CFG, seed=0)
    ex = PipelineExecutor(dict(enumerate(split_gpt(model, 2))), 2, gpt_boundary_shape(model))
    idx, targets = token_batch(CFG, 2)
    steps = [F(0, 0), F(1, 0), Bk(1, 0), Bk(0, 0), Action(1, "STEP"), Action(0, "STEP")]
    with pytest.raises(ValueError, match=r"optimizer steps \(\['1STEP', '0STEP'\]\) but run\(\) got no step="):
        ex.run(steps, idx, targets, lm_loss, 1)
    with pytest.raises(RuntimeError, match=r"1STEP before stage 1's backward of micro-batch 0"):
        ex.run([F(0, 0), F(1, 0), Action(1, "STEP"), Bk(1, 0), Bk(0, 0)], idx, targets, lm_loss, 1, step=print)


def test_a_compute_only_schedule_gets_the_messages_of_with_communication():
    lowered = schedules.with_communication(one_f_one_b(2, 2), 2)
    assert rank_actions(one_f_one_b(2, 2), 0, 2, 2) == lowered[0]
    assert list(map(str, lowered[0])) == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]
    assert rank_actions(lowered, 1, 2, 2) == lowered[1]        # a schedule with messages is taken as it is
    alone = {0: [F(0, 0), F(1, 0), Bk(1, 0), Bk(0, 0)]}        # one rank holding both stages: no messages
    assert rank_actions(alone, 0, 1, 2) == alone[0]


def test_a_schedule_that_would_deadlock_is_refused_before_anything_runs():
    # rank 0 waits for 1B0 before sending 0F1; rank 1 needs 0F1 before it can reach 1B0
    stuck = {0: [F(0, 0), Bk(0, 0), F(0, 1), Bk(0, 1)], 1: [F(1, 0), F(1, 1), Bk(1, 0), Bk(1, 1)]}
    with pytest.raises(ValueError, match=r"deadlock.*rank 0, step 1: 0B0 needs 1B0"):
        rank_actions(stuck, 0, 2, 2, microbatches=2)
    with pytest.raises(ValueError, match=r"stage 1 never runs 1B0 .*add it to rank 1.s list"):
        rank_actions({0: [F(0, 0), Bk(0, 0)], 1: [F(1, 0)]}, 1, 2, 2, microbatches=1)     # 1B0 is missing


# --------------------------------------------------------------------------- parity on real ranks
def _parity_cases(p):
    from torch.distributed.pipelining import Schedule1F1B
    strategies = {f"{name} m={m}": _pipeline(make(p, m), m) for name, make in [("gpipe", gpipe), ("1f1b", one_f_one_b)]
                  for m in (1, 3, 5)}
    strategies["zero-bubble m=3"] = _pipeline(zero_bubble(p, 3), 3)
    if p == 2:
        strategies["looped v=2 m=3"] = _pipeline(looped(p, 3, 2), 3, v=2)   # 4 stages of 2, 1, 1, 1 layers
    # torch's 1F1B with 3 equal micro-batches: its 1/m scaling is the global mean only when B/m is whole
    return _parity(strategies, reference=lambda model, group: TorchPipeline(model, group, Schedule1F1B, 3))


@pytest.mark.parametrize("p", [2, 3])
def test_schedules_match_one_process(p):
    report = launch(_parity_cases, p, p, timeout=120)[0]   # check_parity raised in the ranks if not
    assert report.steps == STEPS and report.worst("ranks") == 0.0
    print(f"p={p}: largest difference vs one process: output {report.worst('single', 'output'):.1e}, "
          f"gradient {report.worst('single', 'gradient'):.1e}, parameter {report.worst('single', 'parameter'):.1e}; "
          f"vs torch.distributed.pipelining: {report.worst('reference'):.1e}")


def _generated_cases(p):
    cases = {"gpipe": (schedules.gpipe(p, 3), 3, 1), "1f1b": (schedules.one_f_one_b(p, 5), 5, 1),
             "zb_h1": (schedules.zb_h1(p, 5), 5, 1)}
    if p == 2:                                   # p = 3 would need 6 layers for 6 stages
        cases["interleaved_1f1b v=2"] = (schedules.interleaved_1f1b(p, 4, 2), 4, 2)
    strategies = {}
    for name, (schedule, m, v) in cases.items():
        strategies[name] = _pipeline(schedule, m, v)        # compute only: PipelineParallel adds the messages
        strategies[name + " + with_communication"] = _pipeline(schedules.with_communication(schedule, p, v), m, v)
    return _parity(strategies)


CFG9 = GPTConfig(vocab_size=32, block_size=8, n_layer=9, n_head=2, d_model=16)   # 9 layers: 4 or 8 stages, uneven


def _more_ranks(p):
    """p = 3 and 4 on a 9-layer GPT: naive (one micro-batch), m = 8, m not a multiple of p, and interleaving's
    2p stages over 9 layers."""
    cases = {"naive": (schedules.naive(p), 1, 1), "gpipe m=8": (schedules.gpipe(p, 8), 8, 1),
             "1f1b m=7": (schedules.one_f_one_b(p, 7), 7, 1), "zb_h1 m=7": (schedules.zb_h1(p, 7), 7, 1),
             "interleaved_1f1b v=2": (schedules.interleaved_1f1b(p, 2 * p, 2), 2 * p, 2)}
    return check_parity(lambda: GPT(CFG9, seed=0), {n: _pipeline(*c) for n, c in cases.items()},
                        [token_batch(CFG9, 8, seed=s) for s in range(STEPS)], lm_loss, adamw, tolerance=ONE_PROCESS,
                        split=whole_batch)


@pytest.mark.parametrize("p", [3, 4])
def test_more_ranks_up_to_eight_micro_batches_match_one_process(p):
    report = launch(_more_ranks, p, p, timeout=180)[0]
    assert report.steps == STEPS and report.worst("ranks") == 0.0
    print(f"p={p}: largest difference vs one process {report.worst('single'):.1e}")


def _torch_references():
    """Each generated schedule beside torch's own schedule of the same name (m = 4: B/m whole, as torch's 1/m needs)."""
    from torch.distributed.pipelining import ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
    p, m = 2, 4
    pairs = [("gpipe", schedules.gpipe(p, m), 1, ScheduleGPipe),
             ("interleaved_1f1b v=2", schedules.interleaved_1f1b(p, m, 2), 2, ScheduleInterleaved1F1B),
             ("zb_h1", schedules.zb_h1(p, m), 1, ScheduleInterleavedZeroBubble)]   # its v = 1 order is ZB-H1's
    reports = []
    for name, schedule, v, theirs in pairs:
        ref = lambda model, group, theirs=theirs, v=v: TorchPipeline(model, group, theirs, m, v)
        reports.append(check_parity(lambda: GPT(CFG, seed=0), {name: _pipeline(schedule, m, v)},
                                    [token_batch(CFG, 8, seed=s) for s in range(STEPS)], lm_loss, adamw,
                                    tolerance=ONE_PROCESS, reference=ref, reference_tolerance=TORCH, split=whole_batch))
    return reports


def test_generated_schedules_match_torchs_own():
    for report in launch(_torch_references, 2, timeout=120)[0]:
        assert report.steps == STEPS and report.worst("ranks") == 0.0 and report.worst("reference") <= 1e-5


@pytest.mark.parametrize("p", [2, 3])
def test_generated_schedules_match_one_process(p):
    report = launch(_generated_cases, p, p, timeout=120)[0]
    assert report.steps == STEPS and report.worst("ranks") == 0.0
    print(f"p={p}, generated schedules: largest difference vs one process {report.worst('single'):.1e}")


# --------------------------------------------------------------------------- memory and the recorded run
def _recorded(schedules, m):
    import torch.distributed as dist
    rank, p = dist.get_rank(), dist.get_world_size()
    idx, targets = token_batch(CFG, 8)
    out = {}
    for name, schedule in schedules.items():
        model = GPT(CFG, seed=0)
        ex = PipelineExecutor({rank: split_gpt(model, p)[rank]}, p, gpt_boundary_shape(model),
                              timeline=Timeline(shared_origin()))
        run_schedule(ex, schedule, idx, targets, lm_loss, m, adamw(ex.stages[rank].parameters()))
        out[name] = (ex.peak_held_rank, ex.timeline)
    return out


def test_peak_micro_batches_held_and_chrome_trace(tmp_path):
    p, m = 3, 4
    runs = {"gpipe": gpipe(p, m), "1f1b": one_f_one_b(p, m), "zb_h1": schedules.zb_h1(p, m)}
    per_rank = launch(_recorded, p, runs, m, timeout=120)
    assert [r["gpipe"][0] for r in per_rank] == [m] * p                      # GPipe keeps every micro-batch
    assert [r["1f1b"][0] for r in per_rank] == [p - r for r in range(p)]     # 1F1B: p - r on rank r
    for name, schedule in runs.items():                                       # as the simulator counts them
        assert [r[name][0] for r in per_rank] == [peak_activations(schedule, p)[r] for r in range(p)], name
    recording = merge([r["1f1b"][1] for r in per_rank])
    path = write_chrome_trace(recording, tmp_path / "1f1b.json")
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(spans) for spans in recording.values())
    assert all({"name", "cat", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0 for e in events)
    computed = {(e["pid"], e["name"]) for e in events if e["cat"] in ("forward", "backward")}
    assert computed == {(r, f"{r}{k}{j}") for r in range(p) for k in "FB" for j in range(m)}
    sends = {e["name"] for e in events if e["cat"] == "send" and e["pid"] == 0}
    assert sends == {f"0SEND_F{j}" for j in range(m)} and {e["tid"] for e in events if e["cat"] == "send"} == {1}
    assert trace == chrome_trace(recording)     # what was written is what chrome_trace builds


def test_the_executor_plans_a_schedule_once_and_again_only_when_it_changes():
    model = GPT(CFG, seed=0)
    ex = PipelineExecutor(dict(enumerate(split_gpt(model, 2))), 2, gpt_boundary_shape(model))
    alone = {0: [F(0, 0), F(1, 0), Bk(1, 0), Bk(0, 0)]}
    first = ex.plan(alone, 1)
    assert ex.plan(alone, 1) is first                           # the same schedule: not validated again
    alone[0] = alone[0][:2]                                      # changed in place: planned (and refused) anew
    with pytest.raises(ValueError, match="never runs 0B0"):
        ex.plan(alone, 1)
