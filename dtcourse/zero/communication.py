"""The three collectives ZeRO runs, through the backend or lesson 01's ring, each one written down.

ZeRO moves the same bytes as data parallelism, in other collectives (Rajbhandari et al.,
arXiv 1910.02054, section 7): an all-reduce is a reduce-scatter followed by an all-gather, and
ZeRO puts the optimizer step between the two. With N ranks and a flat tensor of S bytes, each
rank sends

* ``all_reduce``:      2(N-1)/N · S   (stage 0: the gradients)
* ``reduce_scatter``:   (N-1)/N · S   (stages 1-3: the gradients; rank r keeps part r, summed)
* ``all_gather``:       (N-1)/N · S   (stages 1-2: the updated parameters after the step;
                                       stage 3: each unit's parameters before forward and backward)

``Communicator`` calls them on the backend (``comm="backend"``, async where asked) or on lesson
01's ring (``comm="ring"``, synchronous), and appends a ``Collective`` to ``log`` for every call.
For the ring, ``sent`` is measured: the bytes of every message this rank posted, from a
``ByteCounter``. The backend's messages are not visible from Python, so there ``sent`` is what a
bandwidth-optimal algorithm sends, the figures above::

    comm = Communicator("ring", group=None)
    comm.reduce_scatter(part, flat_grad, what="gradients", unit="net.0", phase="backward")
    comm.log[-1].sent      # == (N - 1) / N * flat_grad.nbytes, counted message by message
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dtcourse.collectives import ByteCounter, fast_ring_all_gather, fast_ring_all_reduce, fast_ring_reduce_scatter
from dtcourse.runtime.compat import all_gather_single, reduce_scatter_single

__all__ = ["COMMS", "Collective", "Communicator", "Handle"]

COMMS = ("backend", "ring")


class Handle(Protocol):
    """What an async collective returns: ``wait()`` blocks until its output is written."""

    def wait(self) -> object: ...


class _Done:
    """The handle of a collective that has already finished (the ring is synchronous)."""

    def wait(self) -> bool:
        return True


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it.

    op: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``; what: ``"parameters"`` or
    ``"gradients"``; unit: the unit's name (``""`` for the root); phase: ``"forward"``,
    ``"backward"`` or ``"step"``; nbytes: the full tensor's bytes (the gathered output, the
    reduce-scatter's input, the all-reduced tensor), padding included; sent: bytes this rank sent.
    """

    op: str
    what: str
    unit: str
    phase: str
    nbytes: int
    sent: int


class Communicator:
    """ZeRO's collectives on ``group``, through ``comm`` (``"backend"`` or ``"ring"``), logged in ``log``."""

    def __init__(self, comm: str, group: dist.ProcessGroup | None):
        if comm not in COMMS:
            raise ValueError(f"ZeRO: comm must be one of {COMMS}, got {comm!r}.")
        self.comm, self.group = comm, group
        self.world = dist.get_world_size(group)
        self.counter = ByteCounter()        # the ring's messages; unused by the backend
        self.log: list[Collective] = []

    @property
    def sent(self) -> int:
        """Bytes this rank has sent in the collectives logged so far."""
        return sum(c.sent for c in self.log)

    def reset(self) -> None:
        """Forget the log (and the ring's messages), e.g. before the step to be counted."""
        self.log.clear()
        self.counter = ByteCounter()

    def all_gather(self, full: torch.Tensor, part: torch.Tensor, what: str, unit: str, phase: str,
                   async_op: bool = False) -> Handle:
        """``full`` (N·s,) receives every rank's ``part`` (s,), in rank order."""
        if self.comm == "ring":       # sends (N-1)/N * full.nbytes, one part per step
            return self._measured("all_gather", what, unit, phase, full.nbytes,
                                  lambda: fast_ring_all_gather(full, part, group=self.group, counter=self.counter))
        self._note("all_gather", what, unit, phase, full.nbytes, self.world - 1)
        return _handle(all_gather_single(full, part, group=self.group, async_op=async_op))

    def reduce_scatter(self, part: torch.Tensor, full: torch.Tensor, what: str, unit: str, phase: str,
                       async_op: bool = False) -> Handle:
        """``part`` (s,) receives the sum over ranks of part r of ``full`` (N·s,), r this rank."""
        if self.comm == "ring":       # sends (N-1)/N * full.nbytes: the first half of an all-reduce
            return self._measured("reduce_scatter", what, unit, phase, full.nbytes,
                                  lambda: fast_ring_reduce_scatter(part, full, group=self.group, counter=self.counter))
        self._note("reduce_scatter", what, unit, phase, full.nbytes, self.world - 1)
        return _handle(reduce_scatter_single(part, full, op=ReduceOp.SUM, group=self.group,
                                             async_op=async_op))

    def all_reduce(self, tensor: torch.Tensor, what: str, unit: str, phase: str,
                   async_op: bool = False) -> Handle:
        """``tensor`` becomes the sum over ranks, in place."""
        if self.comm == "ring":       # sends 2(N-1)/N * tensor.nbytes: reduce-scatter, then all-gather
            return self._measured("all_reduce", what, unit, phase, tensor.nbytes,
                                  lambda: fast_ring_all_reduce(tensor, group=self.group, counter=self.counter))
        self._note("all_reduce", what, unit, phase, tensor.nbytes, 2 * (self.world - 1))
        return _handle(dist.all_reduce(tensor, op=ReduceOp.SUM, group=self.group, async_op=async_op))

    def _measured(self, op: str, what: str, unit: str, phase: str, nbytes: int, run) -> Handle:
        before = self.counter.sent
        run()
        self.log.append(Collective(op, what, unit, phase, nbytes, self.counter.sent - before))
        return _Done()

    def _note(self, op: str, what: str, unit: str, phase: str, nbytes: int, parts_sent: int) -> None:
        # nbytes is a multiple of N (the flat tensors are padded), so this is exact
        self.log.append(Collective(op, what, unit, phase, nbytes, parts_sent * nbytes // self.world))


def _handle(work: object) -> Handle:
    return _Done() if work is None else work     # a synchronous call returns None
