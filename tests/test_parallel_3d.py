"""Techniques that stack (issue 32, lesson 10's ground): data x pipeline x tensor parallelism on one mesh.

The GPT's layers are made tensor-parallel over the rank's tp group, the model is cut into pipeline stages
(``dtcourse.pipeline``), and each stage this rank holds is wrapped in ``dtcourse.zero.ZeRO`` over its
data-parallel group of ``dtcourse.mesh``. Each data-parallel replica runs the whole schedule on its share
of the global batch; a stage's micro-batch backwards only add up its gradients (``no_sync``), and the executor
reduces them once, at the stage's STEP, as torch's ``REDUCE_GRAD`` does. The proof is parity: after 3 AdamW steps
the parameters equal one process's on the global batch, and every rank that holds a stage agrees.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from dtcourse import launch
from dtcourse.mesh import ParallelDims, build_groups
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
from dtcourse.collectives.cost import ring_bytes_sent
from dtcourse.parallel_3d import Plan, parallelize
from dtcourse.parallel_3d.cost import model_state_bytes, step_bytes
from dtcourse.parity import Tolerance, check_parity
from dtcourse.pipeline import PipelineExecutor, schedules
from dtcourse.pipeline.partition import gpt_boundary_shape, split_gpt
from dtcourse.runtime.observe import observe
from dtcourse.zero import ZeRO

# 5 layers: with p = 2 and v = 2 the 4 stages hold 2, 1, 1, 1 blocks; 4 heads, so t = 4 divides them. 48 rows: 6 per
# replica at dp = 8, cut into m = 4 micro-batches of 2, 2, 1 and 1 rows (the executor's tensor_split)
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=5, n_head=4, d_model=16)
ROWS, STEPS, M = 48, 3, 4
adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
# float32. Each replica's micro-batch losses, scaled by rows_j / rows and summed, then averaged over dp, add the
# same terms as one mean over the global batch in another order, and tensor parallelism sums partial products
# in another order too: a few ulps per gradient, which AdamW's lr * g / (|g| + eps) moves further where a
# gradient nearly cancels. Measured over the cases below, SP included: outputs 1.2e-7, gradients 3.0e-8, parameters
# after 3 steps 6.0e-7 at most (lr = 1e-2 gives 10x).
TOLERANCE = 1e-5
REASON = ("each replica's micro-batch losses, scaled and summed, then averaged over dp, and TP's partial products "
          "add the same terms as one process in another order; AdamW moves further where a gradient nearly cancels")


def _composed(dp: int, pp: int, tp: int, stage: int, schedule: str, v: int, sp: bool = False) -> dict:
    """``parallelize`` under the plan, through the parity harness beside one process on the global batch, 3 steps:
    outputs, gradients before each step and parameters after it compared, and every rank against rank 0."""
    plan = Plan(dp=dp, pp=pp, tp=tp, zero_stage=stage, schedule=schedule, microbatches=M, v=v, sequence_parallel=sp)
    mesh = build_groups(plan.dims)
    with observe() as log:
        report = check_parity(lambda: GPT(CFG, seed=0), lambda model, group: parallelize(model, mesh, plan, adamw),
                              [token_batch(CFG, ROWS, seed=k) for k in range(STEPS)], lm_loss, adamw,
                              tolerance=Tolerance(TOLERANCE, 0, REASON), split=plan.split)
    return {"worst": {kind: report.worst("single", kind) for kind in ("output", "gradient", "parameter")},
            "collectives": {(r.collective, r.group_size) for r in log.records if r.collective not in ("send", "recv")
                            and (r.group_size < dist.get_world_size() or r.group_size == dp and r.collective != "all_reduce")}}


CASES = [  # (dp, pp, tp, ZeRO stage, schedule, v): the factorisations of 8 ranks, and two of 4 and 3
    (2, 2, 2, 1, "1f1b", 1),
    (2, 2, 2, 3, "interleaved_1f1b", 2),
    (1, 2, 4, 1, "interleaved_1f1b", 2),
    (2, 1, 4, 3, "1f1b", 1),
    (4, 2, 1, 3, "1f1b", 1),
    (1, 4, 2, 1, "1f1b", 1),
    (8, 1, 1, 3, "1f1b", 1),
    (2, 2, 1, 1, "interleaved_1f1b", 2),
    (3, 1, 1, 2, "1f1b", 1),
]
SEQUENCE_PARALLEL = [(2, 2, 2, 1, "1f1b", 1), (1, 2, 4, 1, "interleaved_1f1b", 2), (2, 1, 2, 0, "gpipe", 1)]


@pytest.mark.parametrize("dp, pp, tp, stage, schedule, v, sp", [(*case, False) for case in CASES] +
                         [(*case, True) for case in SEQUENCE_PARALLEL])
def test_data_pipeline_and_tensor_parallelism_stacked_train_as_one_process(dp, pp, tp, stage, schedule, v, sp):
    found = launch(_composed, dp * pp * tp, dp, pp, tp, stage, schedule, v, sp, timeout=240)
    # check_parity raised in the ranks at the first difference past TOLERANCE, or between ranks; here: what it saw
    assert found[0]["worst"]["parameter"] <= TOLERANCE and found[0]["worst"]["gradient"] <= TOLERANCE, found[0]
    # besides the pipeline's messages: ZeRO's gathers and reductions over dp (and the broadcast of the buffers
    # when it is built), TP's all-reduces over tp, and the gathers of full tensors for the comparison (over dp, tp
    # and pp); no all-reduce of gradients. The harness's own collectives span the whole world, left out (where
    # dp is the whole world, its all-reduces are).
    allowed = {("all_gather", dp), ("reduce_scatter", dp), ("broadcast", dp), ("all_gather", tp), ("all_gather", pp)}
    allowed |= {("all_reduce", tp)} if tp > 1 else set()
    allowed |= {("reduce_scatter", tp)} if sp else set()      # SP: all-gathers and reduce-scatters of the sequence
    for result in found:
        assert result["collectives"] <= allowed and ("reduce_scatter", dp) in result["collectives"], result


def _split_backward_refused() -> str:
    mesh = build_groups(ParallelDims(dp=2, pp=1, tp=1))
    model = GPT(CFG, seed=0)
    zeros = {0: ZeRO(split_gpt(model, 1)[0], 2, adamw, mesh.group("dp"))}
    executor = PipelineExecutor(zeros, 1, gpt_boundary_shape(model), group=mesh.group("pp"))
    x, y = token_batch(CFG, 4, seed=0)
    try:
        executor.run(executor.plan(schedules.zb_h1(1, 2), 2), x, y, lm_loss, 2, lambda s: None)
    except ValueError as err:
        return str(err)
    return ""


def test_zero_bubbles_split_backward_is_refused_for_sharded_stages():
    for message in launch(_split_backward_refused, 2):
        assert "stage(s) [0] reduce their gradients over data-parallel ranks" in message, message
        assert "use one B (GPipe, 1F1B, interleaved)" in message, message


# --------------------------------------------------------------------------- #
# A plan that cannot run is refused before any rank builds anything, saying what to change
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("plan, args, complaint", [
    (dict(dp=2, pp=2, tp=2), (CFG, 6), r"dp\*pp\*tp = 8 does not equal the world size 6.*\(dp, pp, tp\) = \(6, 1, 1\)"),
    (dict(dp=1, pp=1, tp=3), (CFG, 3), r"tensor-parallel size 3 does not divide number of heads 4; use a "
                                       r"tensor-parallel size among \[1, 2, 4\]"),
    (dict(dp=1, pp=4, tp=1, schedule="interleaved_1f1b", v=2, microbatches=4), (CFG, 4),
     r"8 stages cannot each hold one of 5 layers; use at most 5 stages"),
    (dict(dp=4, pp=1, tp=1, microbatches=2), (CFG, 4, 30), r"a global batch of 30 rows .* use a batch of 32 rows"),
    (dict(dp=4, pp=1, tp=1, microbatches=4), (CFG, 4, 8), r"at least dp · m = 16; use a batch of 16 rows"),
])
def test_a_plan_that_does_not_fit_says_what_to_change(plan, args, complaint):
    with pytest.raises(ValueError, match=complaint):
        Plan(**plan).check(*args)


@pytest.mark.parametrize("fields, complaint", [
    (dict(pp=2, schedule="interleaved_1f1b", v=2, microbatches=3), r"multiple of pp = 2, as Megatron requires; got 3: "
                                                                 r"use 4"),
    (dict(schedule="1f1b", v=2), r"v = 2 chunks per rank goes with schedule 'interleaved_1f1b'"),
    (dict(schedule="zb_h1"), r"zero-bubble's split backward, zb_h1, runs in dtcourse.pipeline alone, not under ZeRO"),
    (dict(zero_stage=4), r"zero_stage must be 0, 1, 2 or 3"),
    (dict(dp=0), r"dp must be a positive integer, got 0"),
    (dict(precision="bf16"), r"neither activation recomputation nor 16-bit compute yet; use 'none' and 'fp32'"),
    (dict(ep=2), r"expert parallelism composes through dtcourse.moe's ExpertParallel"),
    (dict(tp=2, zero_stage=2, sequence_parallel=True), r"sequence parallelism needs tp >= 2 \(got 2\) and ZeRO stage 0 "
                                                        r"or 1 \(got 2\)"),
])
def test_a_plan_checks_itself(fields, complaint):
    with pytest.raises(ValueError, match=complaint):
        Plan(**fields)


def test_a_plan_gives_each_replica_its_rows():
    plan, x = Plan(dp=2, pp=2, tp=2), torch.arange(8)
    # ranks 0, 1 (tp), 4, 5 (the next pipeline stage) are replica 0; 2, 3, 6, 7 replica 1
    assert [plan.split(x, r, 8).tolist() for r in range(8)] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2 + \
        [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    with pytest.raises(ValueError, match="does not split into dp = 2 equal shares; use a multiple of 2"):
        plan.split(torch.arange(7), 0, 8)


# --------------------------------------------------------------------------- #
# Bytes per group and step: counted on the ranks, equal to the formulas
# --------------------------------------------------------------------------- #
def _counted(dp: int, pp: int, tp: int, stage: int, schedule: str, v: int) -> tuple[dict, dict]:
    """What this rank sent in its second step over each of its groups (a ring's bytes for each collective, each
    message's for the pipeline), and what ``cost.step_bytes`` says."""
    plan = Plan(dp=dp, pp=pp, tp=tp, zero_stage=stage, schedule=schedule, microbatches=M, v=v)
    mesh = build_groups(plan.dims)
    model = parallelize(GPT(CFG, seed=0), mesh, plan, adamw)
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = {tuple(mesh.ranks[dim]): dim for dim in ("dp", "pp", "tp") if len(mesh.ranks[dim]) > 1}
    counted = dict.fromkeys(("tp", "pp", "dp"), 0)
    for k in range(2):                                   # the first step builds AdamW's states: count the second
        x, y = (plan.split(t, rank, world) for t in token_batch(CFG, ROWS, seed=k))
        model.zero_grad()
        with observe() as log:
            model.train_step(x, y)
    for r in log.records:
        if r.collective == "send":
            counted[dims[r.ranks]] += r.nbytes
        elif r.collective in ("all_reduce", "all_gather", "reduce_scatter") and r.ranks in dims:
            full = r.nbytes * r.group_size if r.collective == "all_gather" else r.nbytes
            counted[dims[r.ranks]] += ring_bytes_sent(r.collective, full, r.group_size)
    return counted, step_bytes(model.held_stages(), plan.microbatch_rows(ROWS), CFG.block_size, CFG.d_model, tp, dp,
                               stage)


@pytest.mark.parametrize("case", [(2, 2, 2, 1, "1f1b", 1), (2, 2, 2, 3, "interleaved_1f1b", 2),
                                  (1, 4, 2, 2, "1f1b", 1), (4, 2, 1, 0, "gpipe", 1)])
def test_bytes_per_group_and_step_follow_the_formulas(case):
    for counted, predicted in launch(_counted, case[0] * case[1] * case[2], *case, timeout=240):
        assert counted == predicted, (case, counted, predicted)


# --------------------------------------------------------------------------- #
# Model states per rank: held, equal to ZeRO's formula on each stage's (tensor-parallel) share
# --------------------------------------------------------------------------- #
def _held(dp: int, pp: int, tp: int, stage: int, schedule: str, v: int) -> tuple[int, int, int]:
    plan = Plan(dp=dp, pp=pp, tp=tp, zero_stage=stage, schedule=schedule, microbatches=M, v=v)
    model = parallelize(GPT(CFG, seed=0), build_groups(plan.dims), plan, adamw)
    rank, world = dist.get_rank(), dist.get_world_size()
    model.train_step(*(plan.split(t, rank, world) for t in token_batch(CFG, ROWS, seed=0)))   # AdamW's states
    steps = 4 * sum(len(z._flats(True)) for z in model.stages.values())   # AdamW's step: a 0-dim fp32 per flat
    measured = sum(z.memory().model_states for z in model.stages.values())
    return measured - steps, model_state_bytes(model.held_stages(), dp, stage), sum(p.numel() for p in
                                                                                    GPT(CFG).parameters())


@pytest.mark.parametrize("case", [(2, 2, 2, 1, "1f1b", 1), (2, 2, 2, 3, "interleaved_1f1b", 2),
                                  (4, 2, 1, 2, "1f1b", 1), (2, 1, 4, 0, "gpipe", 1)])
def test_model_states_per_rank_follow_zeros_formula_on_each_stages_share(case):
    found = launch(_held, case[0] * case[1] * case[2], *case, timeout=240)
    for measured, predicted, psi in found:
        assert measured == predicted, (case, measured, predicted)
    # every parameter's 16 bytes (fp32 parameter, gradient, m, v) are somewhere: the ranks together hold at least
    # the whole model's (more where ZeRO or TP replicates: LayerNorms over tp, everything over dp below stage 3)
    assert sum(m for m, _, _ in found) >= 16 * found[0][2]


# --------------------------------------------------------------------------- #
# Against PyTorch's own stack: FSDP2 inside torch.distributed.pipelining's stages
# --------------------------------------------------------------------------- #
def _against_torch() -> tuple[bool, float, float]:
    """(dp, pp) = (2, 2), ZeRO-3 and 1F1B, 4 micro-batches, 3 AdamW steps: ours, and torch's PipelineStage +
    Schedule1F1B around a stage that fully_shard shards block by block over the same data-parallel ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    plan = Plan(dp=2, pp=2, tp=1, zero_stage=3, schedule="1f1b", microbatches=M)
    mesh = build_groups(plan.dims)
    rank, world, s = dist.get_rank(), dist.get_world_size(), mesh.coordinates["pp"]
    ours = parallelize(GPT(CFG, seed=0), mesh, plan, adamw)
    theirs = split_gpt(GPT(CFG, seed=0), plan.pp)[s]
    start = {n: p.detach().clone() for n, p in theirs.named_parameters()}
    on_dp = DeviceMesh.from_group(mesh.group("dp"), "cpu")
    for block in theirs.blocks.values():
        fully_shard(block, mesh=on_dp)
    fully_shard(theirs, mesh=on_dp)
    optimizer = adamw(theirs.parameters())
    schedule = Schedule1F1B(PipelineStage(theirs, s, plan.pp, torch.device("cpu"), group=mesh.group("pp")), M,
                            loss_fn=lm_loss)          # scale_grads: the sum of m micro-batch means, divided by m
    for k in range(STEPS):
        x, y = (plan.split(t, rank, world) for t in token_batch(CFG, 32, seed=k))   # 4 rows per micro-batch
        ours.zero_grad()
        ours.train_step(x, y)
        optimizer.zero_grad()
        schedule.step(x) if s == 0 else schedule.step(target=y)
        optimizer.step()
    mine = {n: p.full_tensor() for n, p in theirs.named_parameters()}
    moved = max((mine[n] - start[n]).abs().max().item() for n in mine)
    everyone: list = [None] * plan.pp
    dist.all_gather_object(everyone, mine, group=mesh.group("pp"))
    theirs_full, ours_full = {n: t for part in everyone for n, t in part.items()}, ours.full_parameters()
    return sorted(ours_full) == sorted(theirs_full), max((ours_full[n] - theirs_full[n]).abs().max().item()
                                                         for n in ours_full), moved


def test_a_sharded_pipeline_matches_fsdp2_inside_torch_pipelining():
    for same_names, worst, moved in launch(_against_torch, 4, timeout=240):
        # the same per-rank gradients, summed over dp and scaled by 1/m (exact: m = 4) in another order
        assert same_names and worst <= 1e-6 < moved, (worst, moved)     # measured: 0.0, after moves of ~3e-3
