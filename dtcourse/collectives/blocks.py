"""The ring in blocks: a large tensor goes round N chunks of at most ``chunk_bytes`` at a time.

The plain ring cuts the whole tensor into N chunks, so its messages, and the buffer each
reduce-scatter step receives into, grow with the tensor: 16 MB each for a 64 MB tensor on 4
ranks, far more than a core's cache holds. NCCL instead walks a large buffer in loops of
N · chunkSize bytes and runs the whole ring on each loop in turn (``runRing`` in NCCL's
src/device/all_reduce.h). Here the tensor is cut into
blocks of N chunks of at most ``chunk_bytes``, and the blocks follow one another:

* block b's reduce-scatter travels in the same rounds as block b-1's all-gather: each of these
  N-1 rounds carries one message of each, so B blocks take (B+1)(N-1) rounds, not 2B(N-1);
* every all-gather receive of every block is posted before the first round (under
  ``messages.ALL_GATHER_TAG``, as in ``pipelined.all_gather_receives``); the reduce-scatter receives
  go one at a time into one buffer of ``chunk_bytes``, kept between calls.

Each rank still sends 2(N-1)/N·S bytes in all. A round's messages are recorded with the round as
``step`` and the block as ``part``::

    fast_ring_all_reduce(grad, chunk_bytes=4 << 20)    # on 4 ranks, a 64 MB grad goes round in 4 blocks of 16 MB
"""

from __future__ import annotations

import torch

from dtcourse.collectives.messages import (ALL_GATHER_TAG, ByteCounter, finish, receive, scratch, send,
                                           wait_all)
from dtcourse.collectives.pipelined import all_gather_receives
from dtcourse.collectives.ring import chunk_sizes

__all__ = ["blocks_of", "blocked_all_reduce"]


def blocks_of(flat: torch.Tensor, world: int, chunk_bytes: int) -> list[list[torch.Tensor]]:
    """``flat`` cut into blocks of ``world`` chunks of at most ``chunk_bytes`` each: views, block by block.

    Every block but the last holds world · (chunk_bytes // element size) elements; the last may be
    shorter, and its chunks differ by at most one element (``ring.chunk_sizes``).
    """
    per_block = world * max(1, chunk_bytes // flat.element_size())
    return [list(block.split(chunk_sizes(block.numel(), world))) for block in flat.split(per_block)]


def blocked_all_reduce(flat: torch.Tensor, rank: int, world: int, group, counter: ByteCounter | None, op,
                       chunk_bytes: int) -> None:
    """All-reduce ``flat`` (1-D, in place) block by block, each block's all-gather beside the next block's
    reduce-scatter; ``op`` is SUM or AVG, checked by the caller (``fast_ring.fast_ring_all_reduce``)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    blocks = blocks_of(flat, world, chunk_bytes)
    # every all-gather receive, block by block and step by step, straight into its chunk: a chunk's final sum
    # arrives only after its owner summed it, which needed all of this rank's additions into it and sends of it
    arrivals = [all_gather_receives(chunks, rank, world, group, counter) for chunks in blocks]
    incoming_buffer = scratch(max(c.numel() for c in blocks[0]), flat.dtype, flat.device)
    departures = []
    for b in range(len(blocks) + 1):          # B+1 passes of N-1 rounds: reduce-scatter block b, all-gather b-1
        summing = blocks[b] if b < len(blocks) else None
        gathering = blocks[b - 1] if b > 0 else None
        for step in range(world - 1):
            round_ = b * (world - 1) + step
            if summing is not None:           # the reduce-scatter's receive first, then both sends
                send_c, recv_c = (rank - step - 1) % world, (rank - step - 2) % world
                incoming = incoming_buffer[: summing[recv_c].numel()]
                arrival = receive(incoming, left, group, counter)
                departures.append(send(summing[send_c], right, group, counter, "reduce-scatter", round_, send_c,
                                       b))
            if gathering is not None:         # the chunk that landed a round ago (or my own, finished)
                departures.append(send(gathering[(rank - step) % world], right, group, counter, "all-gather",
                                       round_, (rank - step) % world, b - 1, tag=ALL_GATHER_TAG))
            if summing is not None:           # added while the all-gather's chunk may still be arriving
                arrival.wait()
                summing[recv_c].add_(incoming)
            if gathering is not None:
                arrivals[b - 1][step].wait()  # the next round sends it on
        if summing is not None:
            finish(summing[rank], op, world)  # divided once, by its owner, before it goes round
    wait_all(departures)
