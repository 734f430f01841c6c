"""The data x pipeline x tensor grid of process groups that 3D parallelism runs on.

``world = dp * pp * tp`` ranks are laid out in a grid of shape ``(pp, dp, tp)`` in
Megatron's order: tensor-parallel ranks are adjacent (tp varies fastest), then data
parallel, and pipeline parallel is outermost. Tensor parallelism all-reduces activations
in every layer, so its ranks should share the fastest links (one node's NVLink); pipeline
stages only pass one activation to their neighbour per micro-batch, so they may straddle
the slowest ones (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", the PTD-P paper, arXiv 2104.04473, section 3).
For dp=2, pp=2, tp=2 the grid is ``torch.arange(8).reshape(pp, dp, tp)``::

                  tp=0  tp=1
    pp=0  dp=0      0     1       tp groups: [0, 1] [2, 3] [4, 5] [6, 7]
          dp=1      2     3       dp groups: [0, 2] [1, 3] [4, 6] [5, 7]
    pp=1  dp=0      4     5       pp groups: [0, 4] [1, 5] [2, 6] [3, 7]
          dp=1      6     7

A group of one dimension holds the ranks that differ only in that coordinate. Expert
parallelism (mixture of experts) borrows its ranks from the data-parallel dimension, as
torchtitan does: each dp group is cut into runs of ``ep`` consecutive dp ranks, and the
ranks of one run hold different experts while seeing different data.

``ParallelDims`` is the pure arithmetic (no process group needed), ``build_groups`` calls
``torch.distributed.new_group`` for every group and returns this rank's ``Mesh``, which is
passed around explicitly, never stored in a global. Example::

    mesh = build_groups(ParallelDims(dp=2, pp=2, tp=2)); dist.all_reduce(x, group=mesh.tp_group)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DIMENSIONS", "ParallelDims", "Mesh", "build_groups", "factorisations"]

DIMENSIONS = ("dp", "pp", "tp", "ep")


def factorisations(world_size: int) -> list[tuple[int, int, int]]:
    """Every ``(dp, pp, tp)`` with ``dp * pp * tp == world_size``, by increasing pp, then tp."""
    return [(world_size // (pp * tp), pp, tp)
            for pp in range(1, world_size + 1) if world_size % pp == 0
            for tp in range(1, world_size // pp + 1) if (world_size // pp) % tp == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the data (dp), pipeline (pp), tensor (tp) and expert (ep) parallel dimensions."""

    dp: int
    pp: int
    tp: int
    ep: int = 1   # borrowed from dp: ep divides dp and adds no ranks to the world

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}; use 1 to leave "
                                 f"the {name} dimension unused")
        if self.dp % self.ep:
            choices = ", ".join(str(e) for e in range(1, self.dp + 1) if self.dp % e == 0)
            raise ValueError(f"expert-parallel size ep={self.ep} does not divide data-parallel size "
                             f"dp={self.dp}: expert parallelism borrows its ranks from dp (as "
                             f"torchtitan does), so choose ep among {choices}")

    @property
    def world_size(self) -> int:
        """Number of ranks the grid needs: dp * pp * tp (ep adds none)."""
        return self.dp * self.pp * self.tp

    def check(self, world_size: int) -> None:
        """Raise ValueError, with the sizes that would fit, unless the grid covers ``world_size`` ranks."""
        if self.world_size != world_size:
            fits = ", ".join(f"(dp, pp, tp) = {f}" for f in factorisations(world_size))
            raise ValueError(f"dp*pp*tp = {self.world_size} does not equal the world size "
                             f"{world_size}; change the sizes or the number of ranks. Sizes that "
                             f"fit {world_size} ranks: {fits}")

    def grid(self) -> torch.Tensor:
        """The rank at each coordinate: ``grid()[pp, dp, tp]``."""
        return torch.arange(self.world_size).reshape(self.pp, self.dp, self.tp)  # (pp, dp, tp)

    def groups(self, dim: str) -> list[list[int]]:
        """The ranks of every group of dimension ``dim``, each sorted, ordered by first rank."""
        grid = self.grid()  # (pp, dp, tp)
        if dim == "tp":
            runs = grid.reshape(-1, self.tp)                     # (pp*dp, tp)
        elif dim == "dp":
            runs = grid.permute(0, 2, 1).reshape(-1, self.dp)    # (pp*tp, dp)
        elif dim == "pp":
            runs = grid.permute(1, 2, 0).reshape(-1, self.pp)    # (dp*tp, pp)
        elif dim == "ep":
            # each dp group cut into dp/ep runs of ep consecutive dp ranks
            runs = grid.permute(0, 2, 1).reshape(-1, self.ep)    # (pp*tp*dp/ep, ep)
        else:
            raise ValueError(f"unknown dimension {dim!r}; choose one of {', '.join(DIMENSIONS)}")
        return runs.tolist()

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits: its pp, dp, tp indices, and ep, its index inside its ep group."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the grid of {self.world_size} ranks "
                             f"(dp={self.dp}, pp={self.pp}, tp={self.tp})")
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return {"pp": pp, "dp": dp, "tp": tp, "ep": dp % self.ep}

    def rank_at(self, pp: int, dp: int, tp: int) -> int:
        """The rank at coordinates (pp, dp, tp): the inverse of ``coordinates``."""
        return (pp * self.dp + dp) * self.tp + tp


@dataclass(frozen=True)
class Mesh:
    """One rank's view of the grid: its coordinates, and its process group in each dimension."""

    dims: ParallelDims
    rank: int                           # this rank, in the group the grid was laid over
    coordinates: dict[str, int]         # {"pp": .., "dp": .., "tp": .., "ep": ..}
    ranks: dict[str, list[int]]         # this rank's group in each dimension, as global ranks
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup

    def group(self, dim: str) -> dist.ProcessGroup:
        """This rank's process group in dimension ``dim`` ("dp", "pp", "tp" or "ep")."""
        if dim not in DIMENSIONS:
            raise ValueError(f"unknown dimension {dim!r}; choose one of {', '.join(DIMENSIONS)}")
        return getattr(self, f"{dim}_group")


def build_groups(dims: ParallelDims, group: dist.ProcessGroup | None = None) -> Mesh:
    """Create the process groups of every dimension and return this rank's ``Mesh``.

    Every rank must call this with the same ``dims``: ``torch.distributed.new_group`` is
    collective over the default group, so each rank creates every group of every dimension,
    in the same order, even the groups it is not in (for those it gets a placeholder).
    ``group`` (None: the default group) orders the ranks laid over the grid; it must span
    every rank, since the ranks outside it could not take part in ``new_group``.

    Example::

        mesh = build_groups(ParallelDims(dp=2, pp=1, tp=2))   # inside launch(fn, 4)
    """
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs a running process group: call it inside "
                           "dtcourse.launch(fn, world_size) or after init_from_env()")
    world = dist.get_world_size()
    if group is not None and dist.get_world_size(group) != world:
        raise ValueError(f"group has {dist.get_world_size(group)} ranks but the world has {world}: "
                         f"new_group needs every rank, so lay the grid over the whole world "
                         f"(pass group=None)")
    dims.check(world)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    rank = dist.get_rank(group)   # this rank's position in the grid
    mine: dict[str, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    for dim in DIMENSIONS:                       # the same order on every rank ...
        for grid_ranks in dims.groups(dim):      # ... and every group, ours or not
            global_ranks = [members[r] for r in grid_ranks]
            pg = dist.new_group(global_ranks)
            if rank in grid_ranks:
                mine[dim], ranks[dim] = pg, global_ranks
    return Mesh(dims=dims, rank=rank, coordinates=dims.coordinates(rank), ranks=ranks,
                dp_group=mine["dp"], pp_group=mine["pp"], tp_group=mine["tp"], ep_group=mine["ep"])
