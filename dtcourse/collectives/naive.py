"""Naive all-reduce: every rank sends its whole tensor to rank 0, which sums and sends the result back.

Rank 0's link carries (N-1)·S bytes each way, so the busiest link's load grows linearly with
the number of ranks N; the other links idle. Lesson 01 counts it against the ring.

    naive_all_reduce(grad, op=ReduceOp.AVG)       # in place, like dist.all_reduce
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dtcourse.collectives.messages import ByteCounter, check_op, exchange, finish

__all__ = ["naive_all_reduce"]


def naive_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                     counter: ByteCounter | None = None) -> None:
    """Rank 0 receives N-1 tensors, sums them in rank order, and sends the result to each rank."""
    check_op(op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank == 0:
        parts = [torch.empty_like(tensor) for _ in range(world - 1)]
        # receives (N-1) * nbytes at rank 0: the link that limits the naive algorithm
        exchange([], [(p, src) for src, p in enumerate(parts, start=1)], group, counter, "gather", 0)
        for p in parts:
            tensor.add_(p)
        finish(tensor, op, world)
        # sends (N-1) * nbytes from rank 0
        exchange([(tensor, dst, -1) for dst in range(1, world)], [], group, counter, "broadcast", 1)
    else:
        exchange([(tensor, 0, -1)], [], group, counter, "gather", 0)
        exchange([], [(tensor, 0)], group, counter, "broadcast", 1)
