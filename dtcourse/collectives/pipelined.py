"""The pipelined ring: every chunk cut into k slices that stream around the ring, additions behind transfers.

A plain ring step (``fast_ring.fast_reduce_scatter_steps``) sends a whole chunk, waits for the whole chunk
from the left, then adds it: the link idles while the rank adds, and again while the next step
gets going. NCCL's ring kernels move chunks through a small FIFO in slices, and gloo's own ring
cuts every chunk into at least two segments, one in flight while the other is reduced (see the
comment above ``ring`` in gloo/allreduce.cc). Here each phase's N-1 steps become one stream of
(N-1)·k slice transfers:

* a slice is sent as soon as it is ready (summed, or received), in the reduce-scatter ``IN_FLIGHT``
  sends at a time;
* each reduce-scatter receive is posted ``AHEAD`` transfers before its send, so that a neighbour's
  send never waits for us to be ready (gloo sends a message only once its receiver has posted the
  receive), and every all-gather receive before the reduce-scatter starts (``all_gather_receives``);
* each slice that lands is added while the next ones travel.

``slices`` must be at least ``IN_FLIGHT``: transfer t sends the slice that transfer t - k summed
or received, and that one has landed by then. The sums are bit for bit the plain ring's::

    fast_ring_all_reduce(grad, slices=4)     # the same additions in the same order as slices=1

On nccl a receive posted ahead of a send could queue that send behind it on the same stream, so
the pipelined ring is for gloo (NCCL's own kernels pipeline their ring already).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from dtcourse.collectives.messages import ALL_GATHER_TAG, ByteCounter, receive, scratch, send, wait_all

__all__ = ["IN_FLIGHT", "AHEAD", "sliced", "receives_early", "all_gather_receives", "pipelined_reduce_scatter_steps",
           "pipelined_all_gather_steps"]

IN_FLIGHT = 2   # reduce-scatter sends posted and not yet waited for
AHEAD = 1       # reduce-scatter receives posted this many transfers before their sends


def sliced(tensor: torch.Tensor, slices: int) -> list[torch.Tensor]:
    """``slices`` contiguous views of a 1-D tensor, differing in length by at most one (some may be empty)."""
    base, extra = divmod(tensor.numel(), slices)
    return list(tensor.split([base + (1 if j < extra else 0) for j in range(slices)]))


def receives_early(group) -> bool:
    """Whether a phase's receives can be posted before the previous phase ends: on gloo, which matches a
    message to a receive by its tag; nccl matches each peer's messages in order, whatever their tags."""
    return dist.get_backend(group) != "nccl"


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


def pipelined_reduce_scatter_steps(chunks: list[torch.Tensor], rank: int, world: int, group,
                                   counter: ByteCounter | None, slices: int) -> list:
    """``fast_ring.fast_reduce_scatter_steps`` as (N-1)·k slice transfers; transfer t is slice t % k of step t // k.

    Returns the sends still under way, as the plain steps do: none here, each was waited for as its slice
    landed (``IN_FLIGHT`` at most at a time).
    """
    right, left = (rank + 1) % world, (rank - 1) % world
    pieces = [sliced(c, slices) for c in chunks]            # pieces[c][j]: slice j of chunk c, a view
    count = (world - 1) * slices
    largest = max(p.numel() for row in pieces for p in row)
    pool = scratch((IN_FLIGHT + AHEAD) * largest, chunks[0].dtype, chunks[0].device)   # kept between calls
    buffers = list(pool.split(largest))                     # (largest,) each: enough for the slices on the wire
    arrivals = {}

    def receive_ahead(t: int) -> None:   # into the buffer that transfer t - IN_FLIGHT - AHEAD has freed
        step, j = divmod(t, slices)
        mine = pieces[(rank - step - 2) % world][j]
        incoming = buffers[t % len(buffers)][: mine.numel()]
        arrivals[t] = receive(incoming, left, group, counter), mine, incoming

    def land(t: int, departure) -> None:
        arrival, mine, incoming = arrivals.pop(t)
        arrival.wait()
        mine.add_(incoming)            # the next slices are on the wire meanwhile
        departure.wait()

    for t in range(min(AHEAD, count)):
        receive_ahead(t)
    in_flight: deque = deque()
    for t in range(count):
        if len(in_flight) == IN_FLIGHT:
            land(*in_flight.popleft())
        if t + AHEAD < count:
            receive_ahead(t + AHEAD)
        step, j = divmod(t, slices)
        send_c = (rank - step - 1) % world    # its slice j was summed by transfer t - k: landed, k >= IN_FLIGHT
        in_flight.append((t, send(pieces[send_c][j], right, group, counter, "reduce-scatter", step, send_c, j)))
    while in_flight:
        land(*in_flight.popleft())
    return []


def pipelined_all_gather_steps(chunks: list[torch.Tensor], rank: int, world: int, group,
                               counter: ByteCounter | None, slices: int, first_step: int = 0, *,
                               arrivals: list) -> list:
    """``fast_ring.fast_all_gather_steps`` as (N-1)·k slice transfers, each slice passed on as soon as it lands.

    ``arrivals``: the phase's receives, posted already (``all_gather_receives``). Returns the sends
    still under way: a slice that has been received is never written again, so no send needs waiting
    before the end.
    """
    right = (rank + 1) % world
    pieces = [sliced(c, slices) for c in chunks]
    departures = []
    for t in range((world - 1) * slices):
        if t >= slices:
            arrivals[t - slices].wait()     # the slice sent now is the one transfer t - k received
        step, j = divmod(t, slices)
        send_c = (rank - step) % world
        departures.append(send(pieces[send_c][j], right, group, counter, "all-gather", first_step + step, send_c, j,
                               tag=ALL_GATHER_TAG))
    wait_all(arrivals[len(arrivals) - slices:])     # the last step's slices, which nobody passes on
    return departures
