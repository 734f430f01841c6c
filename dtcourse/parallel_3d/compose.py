"""``parallelize(model, mesh, plan, optimizer)``: data, pipeline and tensor parallelism applied to one GPT, in one order.

The order, and why (torchtitan applies pipeline split → TP → activation checkpointing → FSDP):

1. **Tensor parallelism first** (``dtcourse.tensor_parallel.parallelize``, with sequence parallelism if the plan
   asks), in place on the whole GPT: it replaces the GPT's own layers by their shards, and every later step must
   see the sharded layers. Under SP the pipeline's messages carry each rank's sequence shard, (B, T/t, C). (torchtitan splits
   first because its stages are copies of the model; ours hold references to the GPT's modules, so cutting
   first would leave the stages pointing at the full layers that TP then replaces.)
2. **The pipeline cut** (``dtcourse.pipeline.split_gpt``): p · v stages of whole blocks; this rank keeps its own.
3. **ZeRO last, around each stage** (``dtcourse.zero.ZeRO`` over the data-parallel group), as FSDP comes last in
   torchtitan: it flattens whatever parameters the stage holds, TP shards included, and only ranks that hold the
   same shards (same pp and tp coordinates) share a data-parallel group. Its micro-batch backwards add up and the
   executor reduces them once, at the stage's STEP (torch's ``REDUCE_GRAD``).

Each data-parallel replica runs the whole schedule on its rows of the global batch, so the plan's step equals
one process's on the global batch (``tests/test_parallel_3d.py`` proves it). ``Parallel3D`` is also
``dtcourse.parity.Parallel``: with ``split=plan.split``, ``check_parity`` compares any plan with one process.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.mesh import Mesh
from dtcourse.models import GPT, lm_loss
from dtcourse.parallel_3d.cost import HeldStage
from dtcourse.parallel_3d.plan import Plan
from dtcourse.pipeline import PipelineExecutor, schedules
from dtcourse.pipeline.partition import gpt_boundary_shape, split_gpt, stages_of_rank
from dtcourse.tensor_parallel import parallelize as tensor_parallelize
from dtcourse.tensor_parallel import vocab_parallel_lm_loss
from dtcourse.tensor_parallel.layers import full_of, gather_shards
from dtcourse.zero import ZeRO

__all__ = ["parallelize", "Parallel3D"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def parallelize(model: GPT, mesh: Mesh, plan: Plan, optimizer: OptimizerFactory) -> "Parallel3D":
    """``model`` trained under ``plan`` on ``mesh`` (every rank calls it with the same full model, from one seed)."""
    return Parallel3D(model, mesh, plan, optimizer)


class Parallel3D:
    """This rank's share of a GPT under a plan: its pipeline stages, tensor-parallel inside, each one ZeRO-sharded.

    ``forward_backward(x, y)`` runs one training step on this replica's rows (``plan.split`` picks them from a
    global batch), optimizer steps included, at the schedule's STEPs; ``full_parameters`` and ``full_gradients`` gather
    the whole model onto every rank, name by name as in the plain GPT.
    """

    def __init__(self, model: GPT, mesh: Mesh, plan: Plan, optimizer: OptimizerFactory):
        world = dist.get_world_size()
        plan.check(model.config, world)
        if mesh.dims != plan.dims:
            raise ValueError(f"parallelize: the mesh is {mesh.dims}, the plan asks for {plan.dims}: build the mesh "
                             "from the plan, build_groups(plan.dims).")
        self.mesh, self.plan = mesh, plan
        self.tp_group, self.pp_group = mesh.group("tp"), mesh.group("pp")
        if plan.tp > 1:                                               # 1. TP (and SP), in place
            tensor_parallelize(model, self.tp_group, sequence_parallel=plan.sequence_parallel)
        parts = split_gpt(model, plan.stages)                         # 2. the pipeline cut
        mine = stages_of_rank(mesh.coordinates["pp"], plan.pp, plan.v)
        self.stages = {s: ZeRO(parts[s], plan.zero_stage, optimizer, mesh.group("dp")) for s in mine}   # 3. ZeRO
        full = gpt_boundary_shape(model)

        def boundary(stage: int, idx: torch.Tensor) -> tuple[int, ...]:   # under SP, each rank's sequence shard
            b, t, c = full(stage, idx)
            return (b, t // plan.tp, c) if plan.sequence_parallel else (b, t, c)

        self.executor = PipelineExecutor(self.stages, plan.stages, boundary, group=self.pp_group)
        self.actions = self.executor.plan(schedules.build(plan.schedule, plan.pp, plan.microbatches, plan.v),
                                          plan.microbatches)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One training step on this replica's rows ``x``, ``y`` (optimizer steps included, at the STEPs); on the last
        stage's ranks, this replica's logits (vocabulary-sharded under TP), else None."""
        loss_fn = lm_loss if self.plan.tp == 1 else functools.partial(vocab_parallel_lm_loss, group=self.tp_group)
        return self.executor.run(self.actions, x, y, loss_fn, self.plan.microbatches, self._step)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn=lm_loss) -> torch.Tensor | None:
        """The parity harness's step: ``train_step``, and the full logits gathered over tp for the comparison."""
        if loss_fn is not lm_loss:
            raise ValueError("Parallel3D trains with lm_loss (vocab-parallel under tensor parallelism); got another.")
        out = self.train_step(x, y)
        if out is None or self.plan.tp == 1:
            return out
        return gather_shards(out, out.dim() - 1, 1, self.tp_group)   # (B, T, V), for looking only

    def _step(self, s: int) -> None:
        self.stages[s].step()

    def step(self) -> None:
        """Nothing: the schedule's STEP actions stepped every stage inside ``forward_backward``."""

    def zero_grad(self) -> None:
        for stage in self.stages.values():
            stage.zero_grad()

    def held_stages(self) -> list[HeldStage]:
        """This rank's stages as ``cost.py``'s formulas take them: first or last, blocks, ZeRO's padded Ψ_s."""
        return [HeldStage(z.module.first, z.module.last, len(z.module.blocks),
                          sum(f.padded for f in z._flats(trainable=True))) for z in self.stages.values()]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._gathered({n: t for z in self.stages.values() for n, t in z.full_parameters().items()})

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self._gathered({n: t for z in self.stages.values() for n, t in z.full_gradients().items()})

    def _gathered(self, over_dp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """ZeRO's full tensors (over dp), then over tp (each sharded parameter's dimension), then every stage."""
        held = {n: p for z in self.stages.values() for n, p in z.module.named_parameters()}
        mine = {n: full_of(held[n], t, self.tp_group) for n, t in over_dp.items()}
        everyone: list = [None] * self.plan.pp
        dist.all_gather_object(everyone, {n: t.cpu() for n, t in mine.items()}, group=self.pp_group)
        return {n: t for part in everyone for n, t in part.items()}
