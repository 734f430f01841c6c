"""Binomial-tree all-reduce: a tree reduce to rank 0 in ceil(log2 N) rounds, then a tree broadcast.

Only 2·ceil(log2 N) rounds, which suits small messages, but every round moves the whole tensor S
(Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 2005).

    tree_all_reduce(grad)                          # in place, any world size
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dtcourse.collectives.messages import ByteCounter, check_op, exchange, finish

__all__ = ["tree_all_reduce"]


def tree_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                    counter: ByteCounter | None = None) -> None:
    """Binomial-tree reduce to rank 0 then binomial-tree broadcast; any world size."""
    check_op(op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rounds = math.ceil(math.log2(world)) if world > 1 else 0
    incoming = torch.empty_like(tensor)
    # Reduce: in round k, ranks with bit k set send to rank - 2^k and drop out.
    for k in range(rounds):
        mask = 1 << k
        if rank & mask:
            exchange([(tensor, rank - mask, -1)], [], group, counter, "reduce", k)
            break
        if rank + mask < world:
            exchange([], [(incoming, rank + mask)], group, counter, "reduce", k)
            tensor.add_(incoming)
    if rank == 0:
        finish(tensor, op, world)
    # Broadcast: the same tree walked backwards, each holder sending to rank + 2^k.
    for k in reversed(range(rounds)):
        mask = 1 << k
        step = 2 * rounds - 1 - k
        if rank % (2 * mask) == 0 and rank + mask < world:
            exchange([(tensor, rank + mask, -1)], [], group, counter, "broadcast", step)
        elif rank % (2 * mask) == mask:
            exchange([], [(tensor, rank - mask)], group, counter, "broadcast", step)
