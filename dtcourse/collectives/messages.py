"""Point-to-point messages, the only thing the course's collectives are built from, and their count.

Every algorithm in ``dtcourse.collectives`` moves its bytes through ``send`` and ``receive`` (start
one message, return its request), ``post`` (start a round's receives and sends) or ``exchange``
(post a round, then wait for all of it). All of them feed an optional ``ByteCounter``, which is how
lesson 01 counts every byte a rank sends::

    counter = ByteCounter()
    exchange([(chunk, right, 0)], [(incoming, left)], None, counter, "reduce-scatter", step=0)
    counter.sent, counter.messages[-1]      # chunk.nbytes, Message("reduce-scatter", 0, rank, right, 0, ...)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = ["Message", "ByteCounter", "send", "receive", "post", "exchange", "wait_all", "scratch", "ALL_GATHER_TAG"]

ALL_GATHER_TAG = 1   # the ring all-gather's messages, whose receives are posted before the reduce-scatter starts


@dataclass(frozen=True)
class Message:
    """One point-to-point message, as the sending rank recorded it (ranks are group ranks)."""

    phase: str    # "gather", "broadcast", "reduce", "reduce-scatter" or "all-gather"
    step: int     # round of the algorithm, from 0
    src: int
    dst: int
    chunk: int    # ring: which of the N chunks travelled; naive and tree: -1 (whole tensor)
    nbytes: int
    part: int = 0  # pipelined ring: which slice of the chunk; ring in blocks: which block; else 0


@dataclass
class ByteCounter:
    """Bytes this rank sent and received, and the messages it sent, across calls."""

    sent: int = 0
    received: int = 0
    messages: list[Message] = field(default_factory=list)


class _Arrived:
    """The request of a message that needs no waiting (an empty tensor, or a batch already waited for)."""

    def wait(self) -> bool:
        return True


def send(tensor: torch.Tensor, peer: int, group, counter: ByteCounter | None, phase: str, step: int, chunk: int,
         part: int = 0, tag: int = 0):
    """Start sending ``tensor`` to group rank ``peer``, and count it; returns the request to wait on.

    ``tag``: gloo matches a message to the oldest receive posted from the same peer with the same tag, so
    receives posted early for a later phase need a tag of their own (nccl ignores tags: it matches in order).
    """
    if not tensor.numel():             # both sides know the sizes: an empty message is never sent
        return _Arrived()
    if counter is not None:
        counter.sent += tensor.nbytes
        counter.messages.append(Message(phase, step, dist.get_rank(group), peer, chunk, tensor.nbytes, part))
    return dist.isend(tensor, group=group, group_dst=peer, tag=tag)


def receive(tensor: torch.Tensor, peer: int, group, counter: ByteCounter | None, tag: int = 0):
    """Start receiving ``tensor`` from group rank ``peer``, and count it; returns the request to wait on."""
    if counter is not None:
        counter.received += tensor.nbytes
    return dist.irecv(tensor, group=group, group_src=peer, tag=tag) if tensor.numel() else _Arrived()


def post(sends, recvs, group, counter: ByteCounter | None, phase: str, step: int) -> tuple[list, list]:
    """Start every recv ``(tensor, peer)`` and send ``(tensor, peer, chunk[, part])`` of one round.

    Returns ``(recv_requests, send_requests)``, one request per receive, in order, so that the
    caller can use each piece as soon as it lands. Receives are posted first: gloo starts a
    send only once its receiver has posted the receive.
    """
    if dist.get_backend(group) == "nccl":      # one batch, so that no send queues behind a receive
        return _post_batch(sends, recvs, group, counter, phase, step)
    recv_requests = [receive(tensor, peer, group, counter) for tensor, peer in recvs]
    return recv_requests, [send(tensor, peer, group, counter, phase, step, *rest) for tensor, peer, *rest in sends]


def _post_batch(sends, recvs, group, counter, phase, step) -> tuple[list, list]:
    """``post`` as one ``batch_isend_irecv``; a backend that coalesces it returns one request for all."""
    if counter is not None:
        counter.received += sum(tensor.nbytes for tensor, _ in recvs)
        rank = dist.get_rank(group)
        counter.sent += sum(tensor.nbytes for tensor, *_ in sends)
        counter.messages += [Message(phase, step, rank, peer, chunk, t.nbytes, *part)
                             for t, peer, chunk, *part in sends if t.numel()]
    ops = [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in recvs if t.numel()]
    ops += [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer, *_ in sends if t.numel()]
    requests = dist.batch_isend_irecv(ops) if ops else []
    if len(requests) != len(ops):
        for request in requests:
            request.wait()
        requests = [_Arrived()] * len(ops)
    pending = iter(requests)
    return [next(pending) if t.numel() else _Arrived() for t, _ in recvs], list(pending)


def exchange(sends, recvs, group, counter: ByteCounter | None, phase: str, step: int) -> None:
    """One round: post every send and receive (``post``), then wait until all of them are done."""
    recv_requests, send_requests = post(sends, recvs, group, counter, phase, step)
    wait_all(recv_requests + send_requests)


def wait_all(requests) -> None:
    """Wait for every request: a receive's tensor holds its message after this, a send's may be reused."""
    for request in requests:
        request.wait()


_SCRATCH: dict = {}


def scratch(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A receive buffer of at least ``numel`` elements, kept between calls, one per dtype and device.

    Fresh memory for every call costs a page fault per 4 KB page when it is first written
    (BENCHMARKS.md measures what that did to the ring); NCCL likewise keeps its buffers. Each
    thread gets its own, and one collective must finish before the next on the thread starts.
    """
    key = (dtype, torch.device(device), threading.get_ident())
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def check_op(op) -> None:
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"op must be ReduceOp.SUM or ReduceOp.AVG, got {op}: the other reductions "
                         "are left out of these teaching implementations.")


def finish(result: torch.Tensor, op, world_size: int) -> None:
    """Turn a sum into the requested reduction (AVG divides once, by the rank that owns the result)."""
    if op == ReduceOp.AVG:
        result.div_(world_size)
