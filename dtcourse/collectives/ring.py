"""Ring reduce-scatter, ring all-gather, and ring all-reduce = the two in a row.

The ranks sit on a ring and each talks only to its neighbours: it sends right, to rank + 1,
and receives from the left, rank - 1 (mod N). The tensor is cut into N chunks.

* reduce-scatter, N-1 steps: each step every rank sends one chunk's partial sum right and adds
  the chunk arriving from the left into its own copy; after N-1 steps rank r holds chunk r
  summed over all ranks.
* all-gather, N-1 steps: the finished chunks travel once around the ring, copied, not added.

Each rank sends 2(N-1)/N·S bytes, which no all-reduce can beat (Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009).

``slices=k`` (k >= 2) pipelines the ring as NCCL and gloo do: each chunk travels as k slices,
and a slice is added and passed on while the next one is on the wire (``pipelined.py``;
``cost.predict_ring_step`` prices one step)::

    ring_all_reduce(grad, op=ReduceOp.AVG)             # in place, any length
    ring_all_reduce(grad, slices=2)                    # the same sum, bit for bit, pipelined

``chunk_bytes=c`` caps every message at c bytes, as NCCL's chunk size does: a larger tensor goes
round in blocks of N such chunks, each block's all-gather travelling beside the next block's
reduce-scatter (``blocks.py``)::

    ring_all_reduce(grad, chunk_bytes=4 << 20)         # messages and receive buffer of 4 MB at most
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dtcourse.collectives.messages import (ALL_GATHER_TAG, ByteCounter, check_op, finish, post, receive, scratch, send,
                                           wait_all)
from dtcourse.collectives.pipelined import IN_FLIGHT, pipelined_all_gather_steps, pipelined_reduce_scatter_steps, sliced
from dtcourse.runtime.refuse import reference

__all__ = ["chunk_sizes", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Split ``numel`` elements into ``world_size`` chunks differing by at most one.

    The first ``numel % world_size`` chunks get one extra element; with fewer
    elements than ranks, the trailing chunks are empty.
    """
    base, extra = divmod(numel, world_size)
    return [base + (1 if i < extra else 0) for i in range(world_size)]


@reference("collectives", "01")
def reduce_scatter_steps(chunks: list[torch.Tensor], rank: int, world: int, group,
                         counter: ByteCounter | None) -> list:
    """After N-1 steps, ``chunks[rank]`` holds the sum of every rank's chunk ``rank``.

    Returns the sends still under way; the caller waits for them once, at the end (``wait_all``).
    """
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming_buffer = scratch(max(c.numel() for c in chunks), chunks[0].dtype, chunks[0].device)
    departures = []
    for step in range(world - 1):
        send_c = (rank - step - 1) % world   # the chunk my right neighbour adds into next
        recv_c = (rank - step - 2) % world   # the chunk I add my left neighbour's partial sum into
        incoming = incoming_buffer[: chunks[recv_c].numel()]   # one receive buffer, reused by every step
        # sends |chunk| bytes right, receives |chunk| from the left: (N-1)/N * S per rank in all
        arrivals, sends = post([(chunks[send_c], right, send_c)], [(incoming, left)], group, counter,
                               "reduce-scatter", step)
        wait_all(arrivals)                   # the next step needs this sum, not the end of my own send
        chunks[recv_c].add_(incoming)
        departures += sends
    return departures


def receives_early(group) -> bool:
    """Whether a phase's receives can be posted before the previous phase ends: on gloo, which matches a
    message to a receive by its tag; nccl matches each peer's messages in order, whatever their tags."""
    return dist.get_backend(group) != "nccl"


@reference("collectives", "01")
def all_gather_receives(chunks: list[torch.Tensor], rank: int, world: int, group, counter: ByteCounter | None,
                        slices: int = 1) -> list:
    """Post every receive of the all-gather at once, each straight into its place in ``chunks``.

    Returns (N-1)·k requests in the order their pieces arrive, step by step, slice by slice. A send
    goes out only once its receiver has posted the receive (gloo), so with every receive posted
    no neighbour's send waits for us.
    """
    left = (rank - 1) % world
    return [receive(piece, left, group, counter, ALL_GATHER_TAG)
            for step in range(world - 1) for piece in sliced(chunks[(rank - step - 1) % world], slices)]


@reference("collectives", "01")
def all_gather_steps(chunks: list[torch.Tensor], rank: int, world: int, group,
                     counter: ByteCounter | None, first_step: int = 0, arrivals: list | None = None) -> list:
    """Starting with ``chunks[rank]`` complete, pass chunks around until every rank has all N.

    ``arrivals``: this phase's receives, if posted already (``all_gather_receives``); otherwise gloo
    posts them all here, and nccl one step at a time. Returns the sends still under way, like
    ``reduce_scatter_steps``.
    """
    right, left = (rank + 1) % world, (rank - 1) % world
    if arrivals is None and receives_early(group):
        arrivals = all_gather_receives(chunks, rank, world, group, counter)
    departures = []
    for step in range(world - 1):
        send_c = (rank - step) % world       # my own chunk first, then the one that arrived a step ago
        recv_c = (rank - step - 1) % world
        # received straight into its place; sends (N-1)/N * S per rank in all, like the reduce-scatter
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


@reference("collectives", "01")
def ring_reduce_scatter(output: torch.Tensor, input_tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                        counter: ByteCounter | None = None, slices: int = 1) -> None:
    """Like ``dist.reduce_scatter_tensor``: ``input_tensor`` has N·k elements; rank r gets reduced chunk r."""
    check_op(op)
    _check_slices(slices, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if input_tensor.numel() != world * output.numel():
        raise ValueError(f"ring_reduce_scatter: input has {input_tensor.numel()} elements but must have world_size "
                         f"({world}) x output.numel() ({output.numel()}) = {world * output.numel()}. "
                         "Pad the input or use ring_all_reduce, which accepts any length.")
    if input_tensor.dtype != output.dtype:
        raise TypeError(f"ring_reduce_scatter: output dtype {output.dtype} != input dtype {input_tensor.dtype}")
    work = input_tensor.detach().reshape(-1).clone()           # (N*k,) the input is left untouched
    chunks = list(work.chunk(world)) if world > 1 else [work]
    reduce_scatter, _ = _steps(slices)
    wait_all(reduce_scatter(chunks, rank, world, group, counter))
    finish(chunks[rank], op, world)
    output.copy_(chunks[rank].view_as(output))


@reference("collectives", "01")
def ring_all_gather(output: torch.Tensor, input_tensor: torch.Tensor, group=None,
                    counter: ByteCounter | None = None) -> None:
    """Like ``dist.all_gather_into_tensor``: ``output`` (N·k elements) gets every rank's ``input_tensor``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if output.numel() != world * input_tensor.numel():
        raise ValueError(f"ring_all_gather: output has {output.numel()} elements but must have world_size "
                         f"({world}) x input.numel() ({input_tensor.numel()}) = {world * input_tensor.numel()}.")
    if input_tensor.dtype != output.dtype:
        raise TypeError(f"ring_all_gather: output dtype {output.dtype} != input dtype {input_tensor.dtype}")
    flat = output.view(-1)                               # (N*k,) needs a contiguous output
    chunks = list(flat.chunk(world)) if world > 1 else [flat]
    chunks[rank].copy_(input_tensor.reshape(-1))
    wait_all(all_gather_steps(chunks, rank, world, group, counter))


@reference("collectives", "01")
def ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                    counter: ByteCounter | None = None, slices: int = 1, chunk_bytes: int | None = None) -> None:
    """Ring reduce-scatter then ring all-gather, in place, for any length (uneven chunks).

    ``slices=k``: each chunk streams round as k slices (``pipelined.py``). ``chunk_bytes``: no chunk larger
    than this; a larger tensor goes round in blocks of N chunks (``blocks.py``).
    """
    check_op(op)
    _check_slices(slices, group)
    _check_chunk_bytes(chunk_bytes, slices, group, tensor.element_size())
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    if chunk_bytes is not None and world > 1:   # no message above chunk_bytes: round in blocks (blocks.py)
        from dtcourse.collectives.blocks import blocked_all_reduce   # here, since blocks.py builds on this module
        blocked_all_reduce(flat, rank, world, group, counter, op, chunk_bytes)
    else:
        chunks = list(flat.split(chunk_sizes(flat.numel(), world)))    # N views into the tensor itself
        reduce_scatter, all_gather = _steps(slices)    # slices=1: one message per step, as the lesson draws it
        # a chunk is received into in the all-gather only once its owner has summed it, and that sum needed all
        # of my additions into the chunk and every byte of my sends of it. So, on gloo, every all-gather receive
        # is posted now, before the reduce-scatter starts (under a tag of its own), and the sends are waited
        # for once, at the end
        early = receives_early(group)
        arrivals = all_gather_receives(chunks, rank, world, group, counter, slices) if early else None
        departures = reduce_scatter(chunks, rank, world, group, counter)
        finish(chunks[rank], op, world)   # each chunk divided once, by its owner: bit-identical everywhere
        departures += all_gather(chunks, rank, world, group, counter, first_step=world - 1, arrivals=arrivals)
        wait_all(departures)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


def _steps(slices: int) -> tuple:
    """The reduce-scatter and all-gather steps: one message per step (the algorithm as the lesson draws it),
    or k slices per chunk streamed across the steps (pipelined.py). Both return the sends still under way."""
    if slices == 1:
        return reduce_scatter_steps, all_gather_steps
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
