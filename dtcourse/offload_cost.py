"""Offloading's formulas (lesson 07): bytes moved per step and held on the device, per rank.

Ψ parameters on N ranks, ZeRO stage 2 with AdamW and fp32 states (ZeRO-Offload, Ren et al., arXiv
2101.06840; ZeRO-Infinity, Rajbhandari et al., arXiv 2104.07857). ``dtcourse.lab.offload`` counts each
beside its formula (each unit's part is padded to a multiple of N elements: a few bytes more).
"""

from __future__ import annotations

__all__ = ["bytes_each_way", "disk_bytes_each_way", "device_optimizer_bytes"]


def bytes_each_way(psi: float, world: int) -> float:
    """Down to the host, the fp32 gradients of this rank's part; up, its updated parameters: 4Ψ/N each."""
    return 4 * psi / world


def disk_bytes_each_way(psi: float, world: int) -> float:
    """Read from and written to disk per step with the states there: the fp32 part, m and v, 12Ψ/N."""
    return 12 * psi / world


def device_optimizer_bytes(psi: float, world: int) -> float:
    """AdamW's m and v of this rank's part, kept on the device without offloading: 8Ψ/N (with it: none)."""
    return 8 * psi / world
