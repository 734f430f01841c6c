"""The ring as a library runs it: ``ring.py``'s messages and sums, bit for bit, with what a race against
gloo's own all-reduce needs besides. None of it changes a byte sent or an addition.

* **Receives posted ahead.** A chunk is received in the all-gather only once its owner has summed
  it, which needed every one of my additions into that chunk and every byte of my sends of it. So
  on gloo every all-gather receive is posted before the reduce-scatter starts, under a tag of its
  own (``pipelined.all_gather_receives``), and no neighbour's send ever waits for us to be ready
  (gloo sends a message only once its receiver has posted the receive).
* **Sends waited for once**, at the end, instead of step by step.
* **One receive buffer**, reused by every step and every call (``messages.scratch``): fresh memory
  costs a page fault per 4 KB page when it is first written.
* ``slices=k`` pipelines the ring as NCCL and gloo do: each chunk travels as k slices, and a slice
  is added and passed on while the next one is on the wire (``pipelined.py``).
* ``chunk_bytes=c`` caps every message at c bytes, as NCCL's chunk size does: a larger tensor goes
  round in blocks of N such chunks (``blocks.py``).

DDP's ``comm="ring"``, ZeRO's ring and the collectives benchmark use these::

    fast_ring_all_reduce(grad, op=ReduceOp.AVG)        # ring_all_reduce's result, bit for bit
    fast_ring_all_reduce(grad, slices=2)               # the same sum, pipelined
    fast_ring_all_reduce(grad, chunk_bytes=4 << 20)    # messages and receive buffer of 4 MB at most
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dtcourse.collectives.blocks import blocked_all_reduce
from dtcourse.collectives.messages import (ALL_GATHER_TAG, ByteCounter, check_op, finish, post, scratch, send,
                                           wait_all)
from dtcourse.collectives.pipelined import (IN_FLIGHT, all_gather_receives, pipelined_all_gather_steps,
                                            pipelined_reduce_scatter_steps, receives_early)
from dtcourse.collectives.ring import check_gather_sizes, check_scatter_sizes, chunk_sizes

__all__ = ["fast_ring_reduce_scatter", "fast_ring_all_gather", "fast_ring_all_reduce"]


def fast_reduce_scatter_steps(chunks: list[torch.Tensor], rank: int, world: int, group,
                              counter: ByteCounter | None) -> list:
    """``ring.reduce_scatter_steps`` into one reused buffer; returns the sends still under way (``wait_all``)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming_buffer = scratch(max(c.numel() for c in chunks), chunks[0].dtype, chunks[0].device)
    departures = []
    for step in range(world - 1):
        send_c, recv_c = (rank - step - 1) % world, (rank - step - 2) % world
        incoming = incoming_buffer[: chunks[recv_c].numel()]
        arrivals, sends = post([(chunks[send_c], right, send_c)], [(incoming, left)], group, counter,
                               "reduce-scatter", step)
        wait_all(arrivals)                   # the next step needs this sum, not the end of my own send
        chunks[recv_c].add_(incoming)
        departures += sends
    return departures


def fast_all_gather_steps(chunks: list[torch.Tensor], rank: int, world: int, group,
                          counter: ByteCounter | None, first_step: int = 0, arrivals: list | None = None) -> list:
    """``ring.all_gather_steps`` with its receives posted ahead (``arrivals``, or all of them here on gloo;
    nccl matches each peer's messages in order, so there each step posts its own). Returns the sends under way."""
    right, left = (rank + 1) % world, (rank - 1) % world
    if arrivals is None and receives_early(group):
        arrivals = all_gather_receives(chunks, rank, world, group, counter)
    departures = []
    for step in range(world - 1):
        send_c, recv_c = (rank - step) % world, (rank - step - 1) % world
        if arrivals is None:                 # nccl: this step's receive and send, posted as one batch
            landed, sends = post([(chunks[send_c], right, send_c)], [(chunks[recv_c], left)], group, counter,
                                 "all-gather", first_step + step)
        else:
            landed = arrivals[step:step + 1]
            sends = [send(chunks[send_c], right, group, counter, "all-gather", first_step + step, send_c,
                          tag=ALL_GATHER_TAG)]
        wait_all(landed)                     # the next step sends what landed here
        departures += sends
    return departures


def fast_ring_reduce_scatter(output: torch.Tensor, input_tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                             counter: ByteCounter | None = None, slices: int = 1) -> None:
    """``ring.ring_reduce_scatter``, with a reused buffer, or in ``slices`` (``pipelined.py``)."""
    check_op(op)
    _check_slices(slices, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_scatter_sizes("fast_ring_reduce_scatter", output, input_tensor, world)
    work = input_tensor.detach().reshape(-1).clone()           # (N*k,) the input is left untouched
    chunks = list(work.chunk(world)) if world > 1 else [work]
    reduce_scatter, _ = _steps(slices)
    wait_all(reduce_scatter(chunks, rank, world, group, counter))
    finish(chunks[rank], op, world)
    output.copy_(chunks[rank].view_as(output))


def fast_ring_all_gather(output: torch.Tensor, input_tensor: torch.Tensor, group=None,
                         counter: ByteCounter | None = None) -> None:
    """``ring.ring_all_gather``, with every receive posted before the first send (gloo)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_gather_sizes("fast_ring_all_gather", output, input_tensor, world)
    flat = output.view(-1)                               # (N*k,) needs a contiguous output
    chunks = list(flat.chunk(world)) if world > 1 else [flat]
    chunks[rank].copy_(input_tensor.reshape(-1))
    wait_all(fast_all_gather_steps(chunks, rank, world, group, counter))


def fast_ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, counter: ByteCounter | None = None,
                         slices: int = 1, chunk_bytes: int | None = None) -> None:
    """``ring.ring_all_reduce``, as a library runs it: receives posted ahead, and ``slices`` or ``chunk_bytes``."""
    check_op(op)
    _check_slices(slices, group)
    _check_chunk_bytes(chunk_bytes, slices, group, tensor.element_size())
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    if chunk_bytes is not None and world > 1:   # no message above chunk_bytes: round in blocks (blocks.py)
        blocked_all_reduce(flat, rank, world, group, counter, op, chunk_bytes)
    else:
        chunks = list(flat.split(chunk_sizes(flat.numel(), world)))    # N views into the tensor itself
        reduce_scatter, all_gather = _steps(slices)
        arrivals = all_gather_receives(chunks, rank, world, group, counter, slices) if receives_early(group) else None
        departures = reduce_scatter(chunks, rank, world, group, counter)
        finish(chunks[rank], op, world)   # each chunk divided once, by its owner: bit-identical everywhere
        departures += all_gather(chunks, rank, world, group, counter, first_step=world - 1, arrivals=arrivals)
        wait_all(departures)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


def _steps(slices: int) -> tuple:
    """The reduce-scatter and all-gather steps: one message per step, or k slices per chunk streamed across
    the steps (pipelined.py). Both return the sends still under way."""
    if slices == 1:
        return fast_reduce_scatter_steps, fast_all_gather_steps
    return (partial(pipelined_reduce_scatter_steps, slices=slices),
            partial(pipelined_all_gather_steps, slices=slices))


def _check_chunk_bytes(chunk_bytes: int | None, slices: int, group, element_size: int) -> None:
    if chunk_bytes is None:
        return
    if not (isinstance(chunk_bytes, int) and chunk_bytes >= element_size):
        raise ValueError(f"chunk_bytes must be a whole number of bytes, at least one element ({element_size} bytes "
                         f"here), or None for one block of N chunks; got {chunk_bytes!r}")
    if slices != 1:
        raise ValueError(f"choose slices={slices} (each chunk pipelined in slices) or chunk_bytes={chunk_bytes} "
                         "(the tensor in blocks of small chunks), not both")
    if dist.get_backend(group) == "nccl":
        raise ValueError("chunk_bytes posts every all-gather receive first, under a tag, which nccl ignores; use "
                         "chunk_bytes=None on nccl, whose own kernels already go round in blocks of chunkSize")


def _check_slices(slices: int, group) -> None:
    if not (isinstance(slices, int) and (slices == 1 or slices >= IN_FLIGHT)):
        raise ValueError(f"slices must be 1 (each chunk travels whole) or a whole number >= {IN_FLIGHT} "
                         f"(pipelined, {IN_FLIGHT} slices in flight), got {slices!r}")
    if slices > 1 and dist.get_backend(group) == "nccl":
        raise ValueError("the pipelined ring (slices > 1) posts receives ahead of sends, which nccl may queue on one "
                         "stream; use slices=1 on nccl, whose own kernels pipeline the ring already")
