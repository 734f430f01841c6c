"""Parameter servers' formulas (lesson 03): bytes per iteration through the busiest link.

S is one worker's gradient in bytes, N the workers, k the servers. A separate server's link carries N
pushes in and N pulls out of S/k each, a worker's link S each way; co-located beside the workers (k = N),
every range but a machine's own leaves it once and comes back once, as in lesson 01's ring.
``dtcourse.lab.parameter_server`` counts the bytes beside these.
"""

from __future__ import annotations

__all__ = ["server_link_bytes", "colocated_machine_bytes", "ring_link_bytes"]


def server_link_bytes(workers: int, servers: int, gradient_bytes: float) -> float:
    """The busiest link of a job with ``servers`` separate servers: max(N/k, 1)·S each way."""
    return max(workers / servers, 1) * gradient_bytes


def colocated_machine_bytes(workers: int, gradient_bytes: float) -> float:
    """One machine's link when each of k = N servers shares a machine with a worker: 2(N-1)/N·S out."""
    return 2 * (workers - 1) / workers * gradient_bytes


def ring_link_bytes(workers: int, gradient_bytes: float) -> float:
    """A ring all-reduce's link, for the same gradients (lesson 01): 2(N-1)/N·S."""
    return 2 * (workers - 1) / workers * gradient_bytes
