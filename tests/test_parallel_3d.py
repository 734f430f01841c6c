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
from dtcourse.pipeline import PipelineExecutor, schedules
from dtcourse.pipeline.partition import gpt_boundary_shape, split_gpt, stages_of_rank
from dtcourse.runtime.observe import observe
from dtcourse.tensor_parallel import parallelize, vocab_parallel_lm_loss
from dtcourse.tensor_parallel.parallelize import _full
from dtcourse.zero import ZeRO

# 5 layers: with p = 2 and v = 2 the 4 stages hold 2, 1, 1, 1 blocks; 4 heads, so t = 4 divides them. 48 rows: 6 per
# replica at dp = 8, cut into m = 4 micro-batches of 2, 2, 1 and 1 rows (the executor's tensor_split)
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=5, n_head=4, d_model=16)
ROWS, STEPS, M = 48, 3, 4
adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
# float32. Each replica's micro-batch losses, scaled by rows_j / rows and summed, then averaged over dp, add the
# same terms as one mean over the global batch in another order, and tensor parallelism sums partial products
# in another order too: a few ulps per gradient, which AdamW's lr * g / (|g| + eps) moves further where a
# gradient nearly cancels. Measured after 3 steps: at most 6.0e-7 over the cases below (lr = 1e-2 gives 10x).
TOLERANCE = 1e-5


def _composed(dp: int, pp: int, tp: int, stage: int, schedule: str, v: int) -> dict:
    """The GPT split into pp·v pipeline stages, tensor-parallel over tp inside each, each stage sharded by ZeRO over
    dp; 3 steps of m micro-batches beside one process on the global batch. This rank's view of the result."""
    mesh = build_groups(ParallelDims(dp=dp, pp=pp, tp=tp))
    where, tp_group = mesh.coordinates, mesh.group("tp")
    model, reference = GPT(CFG, seed=0), GPT(CFG, seed=0)      # the second: one process, the global batch
    stepper = adamw(reference.parameters())
    if tp > 1:
        parallelize(model, tp_group)                           # TP first: the stages hold the sharded layers
    parts = split_gpt(model, pp * v)
    zeros = {s: ZeRO(parts[s], stage, adamw, mesh.group("dp")) for s in stages_of_rank(where["pp"], pp, v)}
    executor = PipelineExecutor(zeros, pp * v, gpt_boundary_shape(model), group=mesh.group("pp"))
    actions = executor.plan(schedules.build(schedule, pp, M, v), M)
    loss_fn = lm_loss if tp == 1 else functools.partial(vocab_parallel_lm_loss, group=tp_group)

    def step(s: int) -> None:
        zeros[s].step()
        zeros[s].zero_grad()

    collectives = set()
    for k in range(STEPS):
        x, y = token_batch(CFG, ROWS, seed=k)
        mine = slice(where["dp"] * ROWS // dp, (where["dp"] + 1) * ROWS // dp)
        with observe() as log:
            executor.run(actions, x[mine], y[mine], loss_fn, M, step)
        collectives |= {(r.collective, r.group_size) for r in log.records if r.collective not in ("send", "recv")}
        lm_loss(reference(x), y).backward()
        stepper.step()
        stepper.zero_grad()
    held = {n: p for z in zeros.values() for n, p in z.module.named_parameters()}
    mine_full = {n: _full(held[n], t, tp_group) for z in zeros.values() for n, t in z.full_parameters().items()}
    everyone: list = [None] * pp
    dist.all_gather_object(everyone, mine_full, group=mesh.group("pp"))     # every stage's, to every rank
    full = {n: t for part in everyone for n, t in part.items()}
    want = dict(reference.named_parameters())
    return {"names": sorted(full) == sorted(want), "worst": max((full[n] - want[n]).abs().max().item() for n in want),
            "collectives": collectives}


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


@pytest.mark.parametrize("dp, pp, tp, stage, schedule, v", CASES)
def test_data_pipeline_and_tensor_parallelism_stacked_train_as_one_process(dp, pp, tp, stage, schedule, v):
    found = launch(_composed, dp * pp * tp, dp, pp, tp, stage, schedule, v, timeout=240)
    for result in found:
        assert result["names"], result
        assert result["worst"] <= TOLERANCE, result
    # every rank gathered the same full model: the replicas, shards and stages all agree
    assert len({r["worst"] for r in found}) == 1, [r["worst"] for r in found]
    # besides the pipeline's messages: ZeRO's gathers and reductions over dp, and TP's all-reduces over tp, only
    allowed = {("all_gather", dp), ("reduce_scatter", dp)} | ({("all_reduce", tp)} if tp > 1 else set())
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
