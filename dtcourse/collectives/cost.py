"""What the formulas predict: bytes per rank, the alpha-beta-gamma time, and nccl-tests' bandwidths.

A message of m bytes costs alpha + m·beta: a fixed latency alpha plus beta seconds per byte
(Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel
Computing 20(3), 1994). Adding m received bytes into a local buffer costs m·gamma (Thakur,
Rabenseifner & Gropp, IJHPCA 2005, who count reductions the same way)::

    predict_time("ring", 64 << 20, 4, alpha=50e-6, beta=1 / 5e9, gamma=1 / 10e9)
    busbw("all_reduce", 64 << 20, seconds=0.03, world_size=4)     # bytes/s, comparable across N
"""

from __future__ import annotations

import math
import statistics

__all__ = ["analytic_bytes", "ring_bytes_sent", "predict_time", "predict_ring_step", "fit_alpha_beta", "algbw", "busbw",
           "BUSBW_FACTOR"]

ALL_REDUCE_ALGORITHMS = ("naive", "tree", "ring")


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
    raise ValueError(f"unknown algorithm {algorithm!r}; choose from {list(ALL_REDUCE_ALGORITHMS)}")


def ring_bytes_sent(collective: str, full_nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) collective over a full tensor of ``full_nbytes``:
    2(N-1)/N of it for an all-reduce, (N-1)/N for an all-gather (of its output) or a reduce-scatter (of its
    input); rounded down, as a rank sends whole elements."""
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) * full_nbytes // n
    if collective in ("all_gather", "reduce_scatter"):
        return (n - 1) * full_nbytes // n
    raise ValueError(f"ring_bytes_sent: unknown collective {collective!r}; choose all_reduce, all_gather or "
                     f"reduce_scatter")


def predict_time(algorithm: str, nbytes: float, world_size: int, alpha: float, beta: float,
                 gamma: float = 0.0, collective: str = "all_reduce") -> float:
    """Alpha-beta(-gamma) time of one collective of ``nbytes`` on ``world_size`` ranks.

    all-reduce (S = the tensor's bytes):
      ring:  2(N-1) alpha + 2(N-1)/N S beta + (N-1)/N S gamma
      tree:  2 ceil(log2 N) (alpha + S beta) + ceil(log2 N) S gamma
      naive: 2(N-1) (alpha + S beta) + (N-1) S gamma   (rank 0 handles the messages one after another)
    ring reduce-scatter (S = the input's bytes):  (N-1) alpha + (N-1)/N S beta + (N-1)/N S gamma
    ring all-gather (S = the output's bytes):     (N-1) alpha + (N-1)/N S beta
    gamma (seconds per byte added) defaults to 0: on a network the additions hide behind beta.
    """
    n, s = world_size, nbytes
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose from {list(ALL_REDUCE_ALGORITHMS)}")
    if collective not in BUSBW_FACTOR:
        raise ValueError(f"unknown collective {collective!r}; choose from {sorted(BUSBW_FACTOR)}")
    if collective != "all_reduce" and algorithm != "ring":
        raise ValueError(f"{collective} is modelled for the ring only, got algorithm={algorithm!r}")
    if n == 1:
        return 0.0
    if collective == "reduce_scatter":
        return (n - 1) * alpha + (n - 1) / n * s * (beta + gamma)
    if collective == "all_gather":
        return (n - 1) * alpha + (n - 1) / n * s * beta
    if algorithm == "ring":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta + (n - 1) / n * s * gamma
    rounds = math.ceil(math.log2(n)) if algorithm == "tree" else n - 1
    return 2 * rounds * (alpha + s * beta) + rounds * s * gamma


def predict_ring_step(nbytes: float, slices: int, alpha: float, beta: float, gamma: float) -> float:
    """Time of one reduce-scatter step that moves ``nbytes`` in ``slices`` messages, then adds them.

    The slices follow each other on the link; each is added as soon as it lands, while the
    next one is still travelling. Only the last slice's addition is left uncovered::

      1 slice:   alpha + m beta + m gamma
      k slices:  (alpha + m beta / k) + (k - 1) max(alpha + m beta / k, m gamma / k) + m gamma / k
                 = k alpha + m beta + m gamma / k   when each transfer outlasts an addition

    k trades k-1 extra latencies for hiding (k-1)/k of the additions; the best k is near
    sqrt(m gamma / alpha).
    """
    if slices < 1:
        raise ValueError(f"slices must be at least 1, got {slices}")
    transfer, add = alpha + nbytes * beta / slices, nbytes * gamma / slices
    return transfer + (slices - 1) * max(transfer, add) + add


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit t = alpha + beta * S to measured message times; both come out strictly positive.

    Repeats at one size are first reduced to their median, so one slow outlier moves
    nothing. The line is then fitted by least squares weighted by 1/t: each size counts by
    its relative error, so the 4-byte and the 4-MB messages weigh alike (an unweighted fit
    lets the largest messages decide alone and often drives alpha below zero).

    Raises ``ValueError`` when the fitted alpha or beta is not positive. That happens when
    the measurement is too noisy (on a busy machine the largest message came out no slower
    than the smallest): measure again, with more repeats or a larger largest message. A
    non-positive beta must never be returned: 1/beta is a bandwidth.
    """
    if len(nbytes) != len(seconds):
        raise ValueError(f"fit_alpha_beta: {len(nbytes)} sizes but {len(seconds)} times")
    if any(not t > 0 for t in seconds):
        raise ValueError(f"fit_alpha_beta: every time must be positive, got {sorted(seconds)[:3]}...")
    by_size: dict[float, list[float]] = {}
    for s, t in zip(nbytes, seconds):
        by_size.setdefault(float(s), []).append(t)
    if len(by_size) < 2:
        raise ValueError(f"fit_alpha_beta: a line needs at least two message sizes, got {sorted(by_size)}")
    sizes = sorted(by_size)
    times = [statistics.median(by_size[s]) for s in sizes]
    # minimise sum(((alpha + beta s - t) / t)^2): weighted least squares with weights w = 1/t^2
    w = [1 / t**2 for t in times]
    sw, sx, sy = sum(w), sum(wi * s for wi, s in zip(w, sizes)), sum(wi * t for wi, t in zip(w, times))
    sxx = sum(wi * s * s for wi, s in zip(w, sizes))
    sxy = sum(wi * s * t for wi, s, t in zip(w, sizes, times))
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - beta * sx) / sw
    if not (alpha > 0 and beta > 0):
        raise ValueError(
            f"fit_alpha_beta: the fit gave alpha = {alpha:.3g} s and beta = {beta:.3g} s/byte, and both must be "
            f"positive. The measurement was too noisy: the median times were {[f'{t:.3g}' for t in times]} s "
            f"for {[int(s) for s in sizes]} bytes. Measure again with more repeats, or with a largest message "
            "big enough that its transfer clearly outlasts the latency (a few MB).")
    return alpha, beta


# nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): busbw = algbw x the traffic factor
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
                "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n}


def algbw(nbytes: float, seconds: float) -> float:
    """nccl-tests "algorithm bandwidth": message size over time, bytes/s."""
    return nbytes / seconds


def busbw(collective: str, nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests "bus bandwidth": algbw scaled so it compares with the link's peak.

    all-reduce x 2(N-1)/N; all-gather and reduce-scatter x (N-1)/N (S is the larger side:
    the gathered output, the scattered input).
    """
    if collective not in BUSBW_FACTOR:
        raise ValueError(f"unknown collective {collective!r}; choose from {sorted(BUSBW_FACTOR)}")
    return algbw(nbytes, seconds) * BUSBW_FACTOR[collective](world_size)
