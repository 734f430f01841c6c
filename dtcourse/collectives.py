"""All-reduce three ways, built only from point-to-point messages.

Lesson 01 compares three algorithms that leave the same sum on every rank:

* ``naive_all_reduce``: every rank sends its whole tensor to rank 0, which adds
  them up and sends the result back. Rank 0's link carries (N-1)·S bytes each
  way, so it grows linearly with the number of ranks N.
* ``tree_all_reduce``: a binomial-tree reduce to rank 0, then a binomial-tree
  broadcast: 2·ceil(log2 N) rounds of S bytes (Thakur, Rabenseifner & Gropp,
  "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005).
* ``ring_all_reduce``: ``ring_reduce_scatter`` then ``ring_all_gather``. Each
  rank talks only to its neighbours and sends 2(N-1)/N·S bytes in 2(N-1) steps,
  which is bandwidth-optimal (Patarasuk & Yuan, "Bandwidth optimal all-reduce
  algorithms for clusters of workstations", JPDC 2009).

Call shapes follow ``torch.distributed``: the all-reduces work in place on one
tensor; ``ring_reduce_scatter(output, input_tensor)`` and ``ring_all_gather(output,
input_tensor)`` follow ``reduce_scatter_tensor`` and ``all_gather_into_tensor``. Pass a
``ByteCounter`` to see every message a rank sent::

    counter = ByteCounter()
    ring_all_reduce(grad, op=ReduceOp.AVG, counter=counter)
    counter.sent      # == 2 * (N - 1) / N * grad.nbytes when N divides grad.numel()

The cost model (``predict_time``) and the nccl-tests bandwidth definitions
(``algbw``, ``busbw``) live at the end of the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = [
    "naive_all_reduce", "tree_all_reduce", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather",
    "ByteCounter", "Message", "chunk_sizes", "analytic_bytes", "predict_time", "algbw", "busbw",
    "fit_alpha_beta", "ALGORITHMS",
]


@dataclass(frozen=True)
class Message:
    """One point-to-point message, as the sending rank recorded it (ranks are group ranks)."""

    phase: str    # "gather", "broadcast", "reduce", "reduce-scatter" or "all-gather"
    step: int     # round of the algorithm, from 0
    src: int
    dst: int
    chunk: int    # ring: which of the N chunks travelled; naive and tree: -1 (whole tensor)
    nbytes: int


@dataclass
class ByteCounter:
    """Bytes this rank sent and received, and the messages it sent, across calls."""

    sent: int = 0
    received: int = 0
    messages: list[Message] = field(default_factory=list)


def _context(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _exchange(sends, recvs, group, counter: ByteCounter | None, phase: str, step: int) -> None:
    """Post every send ``(tensor, peer, chunk)`` and recv ``(tensor, peer)`` of one round, then wait.

    Empty tensors are skipped on both sides (both sides know the sizes), and
    peers are group ranks, translated to global ranks for torch.distributed.
    """
    rank = dist.get_rank(group)
    ops = []
    for tensor, peer, chunk in sends:
        if tensor.numel():
            ops.append(dist.P2POp(dist.isend, tensor, group=group, group_peer=peer))
            if counter is not None:
                counter.sent += tensor.nbytes
                counter.messages.append(Message(phase, step, rank, peer, chunk, tensor.nbytes))
    for tensor, peer in recvs:
        if tensor.numel():
            ops.append(dist.P2POp(dist.irecv, tensor, group=group, group_peer=peer))
            if counter is not None:
                counter.received += tensor.nbytes
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _check_op(op) -> None:
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"op must be ReduceOp.SUM or ReduceOp.AVG, got {op}: the other reductions "
                         "are left out of these teaching implementations.")


def _finish(result: torch.Tensor, op, world_size: int) -> None:
    if op == ReduceOp.AVG:
        result.div_(world_size)


# --------------------------------------------------------------------------- #
# Naive: gather at rank 0, reduce, send back
# --------------------------------------------------------------------------- #
def naive_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                     counter: ByteCounter | None = None) -> None:
    """Rank 0 receives N-1 tensors, sums them in rank order, and sends the result to each rank."""
    _check_op(op)
    rank, world = _context(group)
    if rank == 0:
        parts = [torch.empty_like(tensor) for _ in range(world - 1)]
        # receives (N-1) * nbytes at rank 0: the link that limits the naive algorithm
        _exchange([], [(p, src) for src, p in enumerate(parts, start=1)], group, counter, "gather", 0)
        for p in parts:
            tensor.add_(p)
        _finish(tensor, op, world)
        # sends (N-1) * nbytes from rank 0
        _exchange([(tensor, dst, -1) for dst in range(1, world)], [], group, counter, "broadcast", 1)
    else:
        _exchange([(tensor, 0, -1)], [], group, counter, "gather", 0)
        _exchange([], [(tensor, 0)], group, counter, "broadcast", 1)


# --------------------------------------------------------------------------- #
# Binomial tree: reduce to rank 0 in log2(N) rounds, broadcast back in log2(N)
# --------------------------------------------------------------------------- #
def tree_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                    counter: ByteCounter | None = None) -> None:
    """Binomial-tree reduce to rank 0 then binomial-tree broadcast; any world size."""
    _check_op(op)
    rank, world = _context(group)
    rounds = math.ceil(math.log2(world)) if world > 1 else 0
    incoming = torch.empty_like(tensor)
    # Reduce: in round k, ranks with bit k set send to rank - 2^k and drop out.
    for k in range(rounds):
        mask = 1 << k
        if rank & mask:
            _exchange([(tensor, rank - mask, -1)], [], group, counter, "reduce", k)
            break
        if rank + mask < world:
            _exchange([], [(incoming, rank + mask)], group, counter, "reduce", k)
            tensor.add_(incoming)
    if rank == 0:
        _finish(tensor, op, world)
    # Broadcast: the same tree walked backwards, each holder sending to rank + 2^k.
    for k in reversed(range(rounds)):
        mask = 1 << k
        step = 2 * rounds - 1 - k
        if rank % (2 * mask) == 0 and rank + mask < world:
            _exchange([(tensor, rank + mask, -1)], [], group, counter, "broadcast", step)
        elif rank % (2 * mask) == mask:
            _exchange([], [(tensor, rank - mask)], group, counter, "broadcast", step)


# --------------------------------------------------------------------------- #
# Ring
# --------------------------------------------------------------------------- #
def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Split ``numel`` elements into ``world_size`` chunks differing by at most one.

    The first ``numel % world_size`` chunks get one extra element; with fewer
    elements than ranks, the trailing chunks are empty.
    """
    base, extra = divmod(numel, world_size)
    return [base + (1 if i < extra else 0) for i in range(world_size)]


def _ring_reduce_scatter_inplace(chunks: list[torch.Tensor], rank: int, world: int, group,
                                 counter: ByteCounter | None) -> None:
    """After N-1 steps, ``chunks[rank]`` holds the sum of every rank's chunk ``rank``."""
    right, left = (rank + 1) % world, (rank - 1) % world
    buffer = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
    for step in range(world - 1):
        send_c = (rank - step - 1) % world   # the chunk my left neighbour will finish next
        recv_c = (rank - step - 2) % world   # the chunk I add my own values into
        incoming = buffer[: chunks[recv_c].numel()]
        # sends |chunk| bytes right, receives |chunk| bytes from the left: (N-1)/N * S per rank in total
        _exchange([(chunks[send_c], right, send_c)], [(incoming, left)], group, counter, "reduce-scatter", step)
        chunks[recv_c].add_(incoming)


def _ring_all_gather_inplace(chunks: list[torch.Tensor], rank: int, world: int, group,
                             counter: ByteCounter | None, first_step: int = 0) -> None:
    """Starting with ``chunks[rank]`` complete, pass chunks around until every rank has all N."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_c = (rank - step) % world
        recv_c = (rank - step - 1) % world
        # sends (N-1)/N * S per rank in total, like the reduce-scatter
        _exchange([(chunks[send_c], right, send_c)], [(chunks[recv_c], left)], group, counter,
                  "all-gather", first_step + step)


def ring_reduce_scatter(output: torch.Tensor, input_tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                        counter: ByteCounter | None = None) -> None:
    """Like ``dist.reduce_scatter_tensor``: ``input_tensor`` has N·k elements; rank r gets reduced chunk r."""
    _check_op(op)
    rank, world = _context(group)
    if input_tensor.numel() != world * output.numel():
        raise ValueError(f"ring_reduce_scatter: input has {input_tensor.numel()} elements but must have world_size "
                         f"({world}) x output.numel() ({output.numel()}) = {world * output.numel()}. "
                         "Pad the input or use ring_all_reduce, which accepts any length.")
    if input_tensor.dtype != output.dtype:
        raise TypeError(f"ring_reduce_scatter: output dtype {output.dtype} != input dtype {input_tensor.dtype}")
    work = input_tensor.detach().reshape(-1).clone()           # (N*k,) the input is left untouched
    chunks = list(work.chunk(world)) if world > 1 else [work]
    _ring_reduce_scatter_inplace(chunks, rank, world, group, counter)
    _finish(chunks[rank], op, world)
    output.copy_(chunks[rank].view_as(output))


def ring_all_gather(output: torch.Tensor, input_tensor: torch.Tensor, group=None,
                    counter: ByteCounter | None = None) -> None:
    """Like ``dist.all_gather_into_tensor``: ``output`` (N·k elements) gets every rank's ``input_tensor``."""
    rank, world = _context(group)
    if output.numel() != world * input_tensor.numel():
        raise ValueError(f"ring_all_gather: output has {output.numel()} elements but must have world_size "
                         f"({world}) x input.numel() ({input_tensor.numel()}) = {world * input_tensor.numel()}.")
    if input_tensor.dtype != output.dtype:
        raise TypeError(f"ring_all_gather: output dtype {output.dtype} != input dtype {input_tensor.dtype}")
    flat = output.view(-1)                               # (N*k,) needs a contiguous output
    chunks = list(flat.chunk(world)) if world > 1 else [flat]
    chunks[rank].copy_(input_tensor.reshape(-1))
    _ring_all_gather_inplace(chunks, rank, world, group, counter)


def ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                    counter: ByteCounter | None = None) -> None:
    """Ring reduce-scatter then ring all-gather, in place, for any length (uneven chunks)."""
    _check_op(op)
    rank, world = _context(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = list(flat.split(chunk_sizes(flat.numel(), world)))
    _ring_reduce_scatter_inplace(chunks, rank, world, group, counter)
    _finish(chunks[rank], op, world)   # each chunk divided once, by its owner: bit-identical everywhere
    _ring_all_gather_inplace(chunks, rank, world, group, counter, first_step=world - 1)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


ALGORITHMS = {"naive": naive_all_reduce, "tree": tree_all_reduce, "ring": ring_all_reduce}


# --------------------------------------------------------------------------- #
# What the formulas predict
# --------------------------------------------------------------------------- #
def analytic_bytes(algorithm: str, nbytes: int, world_size: int, rank: int = 0) -> tuple[float, float]:
    """Bytes ``rank`` sends and receives in one all-reduce of ``nbytes``: ``(sent, received)``.

    ring:  2(N-1)/N * S each way, on every rank (exact when N divides the element count)
    naive: rank 0 (N-1) * S each way; every other rank S each way
    tree:  S times the number of tree edges at this rank, each way
    """
    n, s = world_size, nbytes
    if algorithm == "ring":
        return (2 * (n - 1) / n * s,) * 2
    if algorithm == "naive":
        return ((n - 1) * s,) * 2 if rank == 0 else ((s, s) if n > 1 else (0, 0))
    if algorithm == "tree":
        # edges: one to the parent (unless rank 0), one per child 2^k with rank+2^k < N
        low = (rank & -rank).bit_length() - 1 if rank else math.ceil(math.log2(n)) if n > 1 else 0
        children = sum(1 for k in range(low) if rank + (1 << k) < n)
        edges = children + (1 if rank else 0)
        return (edges * s, edges * s)
    raise ValueError(f"unknown algorithm {algorithm!r}; choose from {sorted(ALGORITHMS)}")


def predict_time(algorithm: str, nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Alpha-beta (Hockney) time of one all-reduce: alpha per message, beta seconds per byte.

    ring:  2(N-1) alpha + 2(N-1)/N * S beta   (latency grows with N, bandwidth term nearly flat)
    tree:  2 ceil(log2 N) (alpha + S beta)
    naive: 2(N-1) (alpha + S beta)            (rank 0 handles the messages one after another)
    The time of the local additions is left out: on a network it is small next to beta.
    """
    n, s = world_size, nbytes
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + s * beta)
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + s * beta)
    raise ValueError(f"unknown algorithm {algorithm!r}; choose from {sorted(ALGORITHMS)}")


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit t = alpha + beta * S to measured one-way message times.

    Each sample is weighted by 1/t, so the fit minimises relative error: an
    unweighted fit lets the largest messages decide alone and often drives
    alpha below zero.
    """
    x = torch.tensor(nbytes, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1) / y.unsqueeze(1)     # (M, 2), rows scaled by 1/t
    alpha, beta = torch.linalg.lstsq(design, torch.ones_like(y).unsqueeze(1)).solution.squeeze(1).tolist()
    return max(alpha, 0.0), max(beta, 0.0)


def algbw(nbytes: float, seconds: float) -> float:
    """nccl-tests "algorithm bandwidth": message size over time, bytes/s."""
    return nbytes / seconds


def busbw(collective: str, nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests "bus bandwidth": algbw scaled so it compares with the link's peak.

    all-reduce x 2(N-1)/N; all-gather and reduce-scatter x (N-1)/N.
    """
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    if collective not in factor:
        raise ValueError(f"unknown collective {collective!r}; choose from {sorted(factor)}")
    return algbw(nbytes, seconds) * factor[collective]
