"""Mixed precision's formulas (lesson 04): model-state bytes per parameter, and what an all-reduce sends.

Micikevicius et al. (arXiv 1710.03740) keep a 16-bit copy of the weights and gradients beside fp32
masters; with Adam that is 2 + 2 + 12 bytes per parameter (the master, m and v: K = 12), the ZeRO
paper's count (arXiv 1910.02054). ``dtcourse.lab.mixed_precision`` counts both beside these.
"""

from __future__ import annotations

__all__ = ["MIXED_ADAM_BYTES_PER_PARAMETER", "ring_all_reduce_bytes"]

MIXED_ADAM_BYTES_PER_PARAMETER = 2 + 2 + 12    # 16-bit weights and gradients; fp32 master, m and v


def ring_all_reduce_bytes(world: int, n_params: int, element_bytes: int) -> float:
    """Bytes one rank's ring all-reduce sends for ``n_params`` gradients of ``element_bytes``: 2(N-1)/N of them."""
    return 2 * (world - 1) / world * element_bytes * n_params
