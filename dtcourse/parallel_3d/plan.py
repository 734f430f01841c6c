"""A 3D-parallel plan: how many ranks each dimension gets, and how each technique runs. It checks itself.

The plan is data, as a pipeline schedule is: ``dtcourse.parallel_3d.parallelize`` applies it, the planner of
lesson 10 will rank plans, and a wrong one is refused here, before any rank builds anything, with what to change::

    plan = Plan(dp=2, pp=2, tp=2, zero_stage=1, schedule="interleaved_1f1b", microbatches=4, v=2)
    plan.check(GPTConfig(n_layer=6, n_head=4), world_size=8, batch=32)    # None, or a ValueError

Dimensions as ``dtcourse.mesh`` lays them out (Narayanan et al., arXiv 2104.04473): tensor-parallel ranks adjacent,
then data, then pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtcourse.mesh import ParallelDims
from dtcourse.models import GPTConfig
from dtcourse.pipeline.partition import balanced_partition
from dtcourse.tensor_parallel.layers import check_divides

__all__ = ["Plan", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")   # zero-bubble's split backward does not compose with ZeRO yet


@dataclass(frozen=True)
class Plan:
    """dp × pp × tp ranks (ep within dp); ZeRO's stage over dp; the pipeline's schedule, micro-batches m and
    chunks per rank v; sequence parallelism inside tensor parallelism; activation recomputation and precision
    (only "none" and "fp32" so far)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    zero_stage: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    v: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    precision: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "ep", "microbatches", "v"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Plan: {name} must be a positive integer, got {value!r}.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Plan: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Plan: schedule must be one of {SCHEDULES}, got {self.schedule!r} (zero-bubble's "
                             "split backward, zb_h1, runs in dtcourse.pipeline alone, not under ZeRO).")
        if (self.v > 1) != (self.schedule == "interleaved_1f1b"):
            raise ValueError(f"Plan: v = {self.v} chunks per rank goes with schedule 'interleaved_1f1b' and v >= 2, "
                             f"one chunk (v = 1) with the others; got schedule {self.schedule!r}.")
        if self.schedule == "interleaved_1f1b" and self.microbatches % self.pp:
            raise ValueError(f"Plan: interleaving needs the micro-batches to be a multiple of pp = {self.pp}, as "
                             f"Megatron requires; got {self.microbatches}: use "
                             f"{(self.microbatches // self.pp + 1) * self.pp}.")
        if self.sequence_parallel and (self.tp < 2 or self.zero_stage >= 2):
            raise ValueError(f"Plan: sequence parallelism needs tp >= 2 (got {self.tp}) and ZeRO stage 0 or 1 (got "
                             f"{self.zero_stage}): its LayerNorm and bias gradients are summed over tp at the end "
                             "of each backward, after stages 2-3 have already taken the gradients away; use "
                             "zero_stage=1, or sequence_parallel=False.")
        if self.ep != 1:
            raise ValueError(f"Plan: ep = {self.ep}: expert parallelism composes through dtcourse.moe's "
                             "ExpertParallel on the mesh, not through parallelize yet; use ep = 1.")
        if self.recompute != "none" or self.precision != "fp32":
            raise ValueError(f"Plan: recompute={self.recompute!r}, precision={self.precision!r}: parallelize applies "
                             "neither activation recomputation nor 16-bit compute yet; use 'none' and 'fp32'.")

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(dp=self.dp, pp=self.pp, tp=self.tp, ep=self.ep)

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp · v."""
        return self.pp * self.v

    def split(self, t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Global rank ``rank``'s rows of a global batch: its replica's, by its dp coordinate (``check_parity``'s
        ``split``): the ranks of one replica (its pipeline stages and tensor-parallel shards) see the same rows."""
        if t.shape[0] % self.dp:
            raise ValueError(f"a global batch of {t.shape[0]} rows does not split into dp = {self.dp} equal shares; "
                             f"use a multiple of {self.dp}.")
        rows, i = t.shape[0] // self.dp, self.dims.coordinates(rank)["dp"]
        return t[i * rows:(i + 1) * rows]

    def microbatch_rows(self, batch: int) -> list[int]:
        """The rows of each of a replica's micro-batches, for a global batch of ``batch`` rows (as the pipeline
        executor cuts them: ``tensor_split``, the first ones one row longer where they do not divide)."""
        return [len(part) for part in torch.arange(batch // self.dp).tensor_split(self.microbatches)]

    def check(self, config: GPTConfig, world_size: int, batch: int | None = None) -> None:
        """Raise a ValueError saying what to change unless the plan fits this model, world and global batch."""
        self.dims.check(world_size)                               # dp · pp · tp == world size
        for size, what in ((config.n_head, "number of heads"), (4 * config.d_model, "hidden size"),
                           (config.vocab_size, "vocabulary size")):
            check_divides(self.tp, size, what)
        balanced_partition(config.n_layer, self.stages)           # at least one layer per stage
        if self.sequence_parallel:
            check_divides(self.tp, config.block_size, "sequence length (block_size)")
        if batch is not None and (batch % self.dp or batch // self.dp < self.microbatches):
            raise ValueError(f"Plan: a global batch of {batch} rows gives dp = {self.dp} replicas equal shares of "
                             f"at least m = {self.microbatches} rows only if it is a multiple of dp and at least "
                             f"dp · m = {self.dp * self.microbatches}; use a batch of "
                             f"{max(self.dp * self.microbatches, -(-batch // self.dp) * self.dp)} rows.")
