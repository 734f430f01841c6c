"""The three collectives ZeRO runs, through the backend or lesson 01's ring.

ZeRO moves the same bytes as data parallelism, in other collectives (Rajbhandari et al.,
arXiv 1910.02054, section 7): an all-reduce is a reduce-scatter followed by an all-gather, and
ZeRO puts the optimizer step between the two. With N ranks and a flat tensor of S bytes, each
rank sends

* ``all_reduce``:      2(N-1)/N · S   (stage 0: the gradients)
* ``reduce_scatter``:   (N-1)/N · S   (stages 1-3: the gradients; rank r keeps part r, summed)
* ``all_gather``:       (N-1)/N · S   (stages 1-2: the updated parameters after the step;
                                       stage 3: each unit's parameters before forward and backward)

``Communicator`` calls them on the backend (``comm="backend"``, async where asked) or on lesson
01's ring (``comm="ring"``, synchronous). It logs nothing: ``dtcourse.runtime.observe`` records
the backend's collectives, or the ring's messages one by one::

    comm = Communicator("ring", group=None)
    comm.reduce_scatter(part, flat_grad)      # part (s,) <- the sum over ranks of this rank's part
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dtcourse.collectives import fast_ring_all_gather, fast_ring_all_reduce, fast_ring_reduce_scatter
from dtcourse.runtime.compat import all_gather_single, reduce_scatter_single

__all__ = ["COMMS", "Communicator", "Handle"]

COMMS = ("backend", "ring")


class Handle(Protocol):
    """What an async collective returns: ``wait()`` blocks until its output is written."""

    def wait(self) -> object: ...


class _Done:
    """The handle of a collective that has already finished (the ring is synchronous)."""

    def wait(self) -> bool:
        return True


class Communicator:
    """ZeRO's collectives on ``group``, through ``comm``: ``"backend"`` or ``"ring"``."""

    def __init__(self, comm: str, group: dist.ProcessGroup | None):
        if comm not in COMMS:
            raise ValueError(f"ZeRO: comm must be one of {COMMS}, got {comm!r}.")
        self.comm, self.group = comm, group

    def all_gather(self, full: torch.Tensor, part: torch.Tensor, async_op: bool = False) -> Handle:
        """``full`` (N·s,) receives every rank's ``part`` (s,), in rank order."""
        if self.comm == "ring":       # sends (N-1)/N * full.nbytes, one part per step
            fast_ring_all_gather(full, part, group=self.group)
            return _Done()
        return _handle(all_gather_single(full, part, group=self.group, async_op=async_op))

    def reduce_scatter(self, part: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Handle:
        """``part`` (s,) receives the sum over ranks of part r of ``full`` (N·s,), r this rank."""
        if self.comm == "ring":       # sends (N-1)/N * full.nbytes: the first half of an all-reduce
            fast_ring_reduce_scatter(part, full, group=self.group)
            return _Done()
        return _handle(reduce_scatter_single(part, full, op=ReduceOp.SUM, group=self.group, async_op=async_op))

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Handle:
        """``tensor`` becomes the sum over ranks, in place."""
        if self.comm == "ring":       # sends 2(N-1)/N * tensor.nbytes: reduce-scatter, then all-gather
            fast_ring_all_reduce(tensor, group=self.group)
            return _Done()
        return _handle(dist.all_reduce(tensor, op=ReduceOp.SUM, group=self.group, async_op=async_op))


def _handle(work: object) -> Handle:
    return _Done() if work is None else work     # a synchronous call returns None
