"""Ring reduce-scatter, ring all-gather, and ring all-reduce = the two in a row, as lesson 01 draws them.

The ranks sit on a ring and each talks only to its neighbours: it sends right, to rank + 1,
and receives from the left, rank - 1 (mod N). The tensor is cut into N chunks.

* reduce-scatter, N-1 steps: each step every rank sends one chunk's partial sum right and adds
  the chunk arriving from the left into its own copy; after N-1 steps rank r holds chunk r
  summed over all ranks.
* all-gather, N-1 steps: the finished chunks travel once around the ring, copied, not added.

Each rank sends 2(N-1)/N·S bytes, which no all-reduce can beat (Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009)::

    ring_all_reduce(grad, op=ReduceOp.AVG)             # in place, any length

This is the algorithm alone: one step, one exchange. ``fast_ring.py`` sends the same messages and
computes the same sums, bit for bit, with what a race against gloo needs besides (receives posted
ahead, reused buffers, slices in flight, blocks of small chunks); DDP and ZeRO use that one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dtcourse.collectives.messages import ByteCounter, check_op, exchange, finish

__all__ = ["chunk_sizes", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Split ``numel`` elements into ``world_size`` chunks differing by at most one.

    The first ``numel % world_size`` chunks get one extra element; with fewer
    elements than ranks, the trailing chunks are empty.
    """
    base, extra = divmod(numel, world_size)
    return [base + (1 if i < extra else 0) for i in range(world_size)]


def reduce_scatter_steps(chunks: list[torch.Tensor], rank: int, world: int, group,
                         counter: ByteCounter | None) -> None:
    """After N-1 steps, ``chunks[rank]`` holds the sum of every rank's chunk ``rank``."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_c = (rank - step - 1) % world   # the chunk my right neighbour adds into next
        recv_c = (rank - step - 2) % world   # the chunk I add my left neighbour's partial sum into
        incoming = torch.empty_like(chunks[recv_c])
        # sends |chunk| bytes right, receives |chunk| from the left: (N-1)/N * S per rank in all
        exchange([(chunks[send_c], right, send_c)], [(incoming, left)], group, counter, "reduce-scatter", step)
        chunks[recv_c].add_(incoming)


def all_gather_steps(chunks: list[torch.Tensor], rank: int, world: int, group,
                     counter: ByteCounter | None, first_step: int = 0) -> None:
    """Starting with ``chunks[rank]`` complete, pass chunks around until every rank has all N."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_c = (rank - step) % world       # my own chunk first, then the one that arrived a step ago
        recv_c = (rank - step - 1) % world
        # received straight into its place; sends (N-1)/N * S per rank in all, like the reduce-scatter
        exchange([(chunks[send_c], right, send_c)], [(chunks[recv_c], left)], group, counter, "all-gather",
                 first_step + step)


def ring_reduce_scatter(output: torch.Tensor, input_tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                        counter: ByteCounter | None = None) -> None:
    """Like ``dist.reduce_scatter_tensor``: ``input_tensor`` has N·k elements; rank r gets reduced chunk r."""
    check_op(op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_scatter_sizes("ring_reduce_scatter", output, input_tensor, world)
    work = input_tensor.detach().reshape(-1).clone()           # (N*k,) the input is left untouched
    chunks = list(work.chunk(world)) if world > 1 else [work]
    reduce_scatter_steps(chunks, rank, world, group, counter)
    finish(chunks[rank], op, world)
    output.copy_(chunks[rank].view_as(output))


def ring_all_gather(output: torch.Tensor, input_tensor: torch.Tensor, group=None,
                    counter: ByteCounter | None = None) -> None:
    """Like ``dist.all_gather_into_tensor``: ``output`` (N·k elements) gets every rank's ``input_tensor``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_gather_sizes("ring_all_gather", output, input_tensor, world)
    flat = output.view(-1)                               # (N*k,) needs a contiguous output
    chunks = list(flat.chunk(world)) if world > 1 else [flat]
    chunks[rank].copy_(input_tensor.reshape(-1))
    all_gather_steps(chunks, rank, world, group, counter)


def ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, counter: ByteCounter | None = None) -> None:
    """Ring reduce-scatter then ring all-gather, in place, for any length (uneven chunks)."""
    check_op(op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = list(flat.split(chunk_sizes(flat.numel(), world)))    # N views into the tensor itself
    reduce_scatter_steps(chunks, rank, world, group, counter)
    finish(chunks[rank], op, world)       # each chunk divided once, by its owner: bit-identical everywhere
    all_gather_steps(chunks, rank, world, group, counter, first_step=world - 1)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


def check_scatter_sizes(name: str, output: torch.Tensor, input_tensor: torch.Tensor, world: int) -> None:
    if input_tensor.numel() != world * output.numel():
        raise ValueError(f"{name}: input has {input_tensor.numel()} elements but must have world_size "
                         f"({world}) x output.numel() ({output.numel()}) = {world * output.numel()}. "
                         "Pad the input or use ring_all_reduce, which accepts any length.")
    if input_tensor.dtype != output.dtype:
        raise TypeError(f"{name}: output dtype {output.dtype} != input dtype {input_tensor.dtype}")


def check_gather_sizes(name: str, output: torch.Tensor, input_tensor: torch.Tensor, world: int) -> None:
    if output.numel() != world * input_tensor.numel():
        raise ValueError(f"{name}: output has {output.numel()} elements but must have world_size "
                         f"({world}) x input.numel() ({input_tensor.numel()}) = {world * input_tensor.numel()}.")
    if input_tensor.dtype != output.dtype:
        raise TypeError(f"{name}: output dtype {output.dtype} != input dtype {input_tensor.dtype}")
