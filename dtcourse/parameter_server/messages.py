"""The parameter server's protocol: who owns which keys, the message tags, and counted sends and
receives with deadlines (``Request`` is a push as a server receives it).

Transport: torch.distributed point-to-point messages (``isend``/``irecv`` with tags), not
``torch.distributed.rpc``. ``dtcourse.launch`` already gives every rank a gloo process group, while
RPC needs its own agent and rendezvous in every process and is in maintenance mode upstream. With
plain messages every byte is visible, so each rank counts what it sends and receives per link with
lesson 01's ``ByteCounter``, and a server waits for a request with a deadline, so a worker that hangs
or dies ends the run with an error that names it (``WorkerFailure``) instead of a silent wait.

A push is two messages to server j: a header ``[worker, clock, read_version]`` (tag ``TAG_PUSH``)
then the gradient's range j (``TAG_GRAD``). The server takes the header from whichever worker
sends first, so the header names its sender, as every message of Li et al.'s parameter server
does; the server then receives the gradient from that worker. A reply, which answers a pull, is a
header ``[version, applied]`` (``TAG_REPLY``) then the parameters' range j (``TAG_PARAMS``).

A receive waits until a deadline. If nothing came by then, ``_recv`` raises ``TimeoutError``; if
the sender's connection broke first (its process died), the backend's ``RuntimeError`` passes through.

    shard_ranges(676, 3)    # [(0, 226), (226, 451), (451, 676)]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dtcourse.collectives import ByteCounter, Message, chunk_sizes

TAG_PUSH, TAG_GRAD, TAG_REPLY, TAG_PARAMS = 1, 2, 3, 4   # a push is a header then a gradient; a reply too


def shard_ranges(numel: int, num_servers: int) -> list[tuple[int, int]]:
    """Key ranges ``[lo, hi)`` of the flat parameters, one per server, sizes differing by at most one."""
    bounds = [0]
    for size in chunk_sizes(numel, num_servers):
        bounds.append(bounds[-1] + size)
    return list(zip(bounds[:-1], bounds[1:]))


class WorkerFailure(RuntimeError):
    """A rank stopped waiting for another that owed it a message; ``worker`` names the worker."""

    def __init__(self, message: str, worker: int | None = None):
        super().__init__(message)
        self.worker = worker


def _isend(tensor, dst: int, tag: int, group, counter: ByteCounter, phase: str, step: int, chunk: int):
    counter.sent += tensor.nbytes
    counter.messages.append(Message(phase, step, dist.get_rank(group), dst, chunk, tensor.nbytes))
    return dist.isend(tensor, group=group, group_dst=dst, tag=tag)


def _recv(tensor, src: int | None, tag: int, group, counter: ByteCounter, seconds: float | None) -> None:
    """Receive into ``tensor`` from ``src`` (None: from any rank), waiting at most ``seconds``.

    Raises ``TimeoutError`` if nothing arrived by the deadline. A gloo receive reports a timeout and a
    broken connection as the same ``RuntimeError``, so the deadline, kept here, tells the two apart.
    A gloo receive that times out also closes its connection, so a timeout is final.
    """
    deadline = None if seconds is None else time.perf_counter() + seconds
    work = dist.irecv(tensor, group=group, group_src=src, tag=tag)
    try:
        if seconds is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=max(seconds, 1e-3)))
    except RuntimeError as err:
        # The backend's clock starts after ours, so once it gives up, ours has passed the deadline.
        if deadline is not None and time.perf_counter() >= deadline:
            raise TimeoutError(f"nothing arrived within {seconds:g} s") from err
        raise
    counter.received += tensor.nbytes


@dataclass(frozen=True)
class Request:
    """A push: worker ``worker``'s gradient of iteration ``clock``, computed on version ``read_version``."""

    worker: int
    clock: int
    read_version: int
    grad: torch.Tensor       # (hi - lo,) this server's range
