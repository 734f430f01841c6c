"""What a data-parallel step costs (lesson 02): its compute beside its gradient all-reduce, and the bucket count.

A training step of a transformer costs about 6 FLOPs per parameter per token (Kaplan et al.,
"Scaling Laws for Neural Language Models", arXiv 2001.08361); its gradient all-reduce costs what
the alpha-beta model of ``dtcourse.collectives.predict_time`` says, whatever the batch. Overlap
(Li et al., "PyTorch Distributed", arXiv 2006.15704) can hide the all-reduce only behind
computation that exists, and only as well as the buckets let it::

    from dtcourse.data_parallel.cost import best_bucket_count, hiding_batch
    hiding_batch(1.5e9, 1024, flops_per_s=400e12, comm_s=0.119)       # -> 5.2 sequences per rank
    best_bucket_count(3e9, 64, alpha=10e-6, beta=1 / 50e9, backward_s=0.246)   # -> 101
"""

from __future__ import annotations

from dtcourse.collectives import predict_time

__all__ = ["step_flops", "hiding_batch", "exposed_comm", "best_bucket_count"]


def step_flops(params: float, tokens: float) -> float:
    """FLOPs of one training step: 6 per parameter per token.

    Forward does a multiply and an add per weight and token (2); backward does that twice, once
    for the gradient of the layer's input and once for that of its weight (4).
    """
    return 6.0 * params * tokens


def hiding_batch(params: float, seq_len: int, flops_per_s: float, comm_s: float) -> float:
    """Sequences per rank whose step computes as long as the all-reduce: 6·P·b·T / F = comm_s.

    Below it no overlap can hide the all-reduce. Only backward (4 of the 6) overlaps with it, so
    hiding it behind backward alone takes 1.5 times as many. Round up for a whole batch.
    """
    return comm_s * flops_per_s / step_flops(params, seq_len)


def exposed_comm(buckets: int, nbytes: float, world_size: int, alpha: float, beta: float,
                 backward_s: float) -> float:
    """Seconds the ring all-reduces run on after backward's last gradient, with ``buckets`` equal buckets.

    The model: backward makes the gradient bytes at an even rate, so bucket j of k is complete at
    j·backward_s/k; the all-reduces take the link one at a time, each 2(N-1)α + 2(N-1)/N·(S/k)·β.
    One bucket cannot overlap at all; many small ones pay many latencies.
    """
    if buckets < 1:
        raise ValueError(f"exposed_comm: buckets must be at least 1, got {buckets}")
    each = predict_time("ring", nbytes / buckets, world_size, alpha, beta)
    link_free = 0.0
    for j in range(1, buckets + 1):
        link_free = max(link_free, j * backward_s / buckets) + each   # starts once ready and the link is free
    return link_free - backward_s


def best_bucket_count(nbytes: float, world_size: int, alpha: float, beta: float, backward_s: float,
                      most: int = 2000) -> int:
    """The bucket count, 1 to ``most``, that leaves the least communication after backward.

    About the largest k whose all-reduces keep pace with backward:
    k·2(N-1)α + 2(N-1)/N·S·β <= backward_s.
    """
    return min(range(1, most + 1), key=lambda k: exposed_comm(k, nbytes, world_size, alpha, beta, backward_s))
